import warnings

import pytest
import torch

from eagle3kit.core.config import ConfigError
from eagle3kit.data.vocab import build_draft_vocab
from eagle3kit.model.draft_vocab import DraftVocab, check_maps, load_vocab, save_vocab


def test_c18_fewer_distinct_ids_than_the_draft_vocab():
    counts = torch.zeros(16, dtype=torch.int64)
    counts[torch.tensor([3, 5, 9, 11, 12, 14])] = torch.tensor([7, 1, 4, 4, 2, 9])
    with pytest.warns(UserWarning, match="2 entries never occur"):
        v, stats = build_draft_vocab(counts, 8)
    assert v.d2t.numel() == 8 and int(v.t2d.sum()) == 8
    assert v.ids.tolist() == [0, 1, 3, 5, 9, 11, 12, 14]  # padding = smallest unused ids, deterministic
    assert len(set(v.ids.tolist())) == 8
    assert stats["never_seen_entries"] == 2 and stats["coverage"] == 1.0


def test_c19_reduced_and_full_vocabularies():
    counts = torch.zeros(16, dtype=torch.int64)
    counts[torch.tensor([1, 3, 7, 9])] = 5
    v, _ = build_draft_vocab(counts, 4)
    assert v.d2t.tolist() == [1, 2, 5, 6]
    i = torch.arange(4)
    assert bool(((i + v.d2t) < 16).all()) and bool(v.t2d[i + v.d2t].all())
    check_maps(v.d2t, v.t2d, 16)
    full = DraftVocab.full(16)
    assert full.is_full and full.d2t.abs().sum() == 0


def test_top_frequency_ties_and_always_kept_tokens():
    counts = torch.tensor([0, 5, 5, 9, 1, 0, 0, 0])
    v, stats = build_draft_vocab(counts, 3, always_keep=[7])
    assert v.ids.tolist() == [1, 3, 7]  # 7 kept though unseen; tie 1 vs 2 → smaller id
    assert stats["coverage"] == round((9 + 5) / 20, 6)


@pytest.mark.parametrize("size", [0, -1, 17, 4.0])
def test_c20_invalid_sizes(size):
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        build_draft_vocab(torch.ones(16, dtype=torch.int64), size)


def test_c21_vocab_file_disagrees_with_config(tmp_path):
    counts = torch.zeros(16, dtype=torch.int64)
    counts[:5] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v, _ = build_draft_vocab(counts, 5)
    save_vocab(tmp_path / "v.safetensors", v, {})
    with pytest.raises(ConfigError) as e:
        load_vocab(tmp_path / "v.safetensors", expected_size=8)
    assert "8" in str(e.value) and "5" in str(e.value)


def test_ids_instead_of_offsets_are_refused():
    with pytest.raises(ValueError, match="offsets"):
        check_maps(torch.tensor([1, 3, 7, 9]) + 10, None, 16)
