"""The speculators DFlash peer of benchmarks/variants.py (benchmarks/peers/speculators_dflash_*.py):
the files it writes are read by speculators 0.9.0's own dataset, collate, CLI and DFlash model with
the values eagle3kit computed, the loss mask where speculators expects it, and the vocabulary maps
round-trip through speculators' own loader."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("speculators")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from peers import speculators_dflash_adapter as sda  # noqa: E402
from peers import speculators_dflash_run as sdr  # noqa: E402

from eagle3kit.model.target import target_features  # noqa: E402
from eagle3kit.train.batches import Sample  # noqa: E402

AUX = [2, 4, 6]  # HF output_hidden_states indices of the tiny 8-layer target


def _samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = 24 + 7 * i
        ids = torch.randint(3, 500, (T,), generator=g)
        mask = torch.zeros(T, dtype=torch.bool)
        mask[T // 3 :] = True
        out.append(Sample(ids, mask))
    return out


@pytest.fixture(scope="module")
def written(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-dflash")
    samples = _samples()
    rows = list(sdr.target_state_rows(tiny_target, samples, AUX, 100, torch.device("cpu")))
    summary = sda.write_offline_data(root / "data", iter(rows), dtype=torch.float32)
    sdr.write_verifier(tiny_target, root / "verifier")
    return root, samples, rows, summary


def test_states_are_eagle3kits_with_the_last_one_before_the_final_norm(tiny_target, written):
    _, samples, rows, _ = written
    for s, (ids, mask, aux, pre) in zip(samples, rows, strict=True):
        ref_aux, ref_last = target_features(tiny_target, s.ids[None], None, AUX)
        assert torch.equal(ids, s.ids) and torch.equal(mask, s.mask)
        torch.testing.assert_close(aux, ref_aux[0])
        torch.testing.assert_close(tiny_target.parts.final_norm(pre), ref_last[0])


def test_speculators_dataset_reads_the_values_written(written):
    from speculators.train.data import ArrowDataset

    root, samples, rows, summary = written
    assert summary["rows"] == len(samples) and summary["aux_layers"] == len(AUX)
    ratio = sda.data_ratio(4, len(samples))
    tr = ArrowDataset(
        max_len=512, datapath=str(root / "data"), on_missing="raise", train_ratio=ratio, split="train"
    )
    va = ArrowDataset(
        max_len=512, datapath=str(root / "data"), on_missing="raise", train_ratio=ratio, split="val"
    )
    assert (len(tr), len(va)) == (4, 2)
    assert tr.approx_lengths == [s.ids.numel() for s in samples[:4]]
    for ds, offset in ((tr, 0), (va, 4)):
        for k in range(len(ds)):
            item, s, (_, _, aux, pre) = ds[k], samples[offset + k], rows[offset + k]
            assert torch.equal(item["input_ids"], s.ids.long())
            assert torch.equal(item["loss_mask"], s.mask.long())  # speculators' convention: 1 on reply tokens
            H = pre.shape[1]
            assert item["hidden_states"].shape == (s.ids.numel(), len(AUX) * H)
            # every aux block, in layer order (aux itself is eagle3kit's states, the test above): written in
            # another order the peer row would train on layers it does not read at serving time
            for i in range(len(AUX)):
                torch.testing.assert_close(
                    item["hidden_states"][:, i * H : (i + 1) * H], aux[:, i * H : (i + 1) * H].float()
                )
            torch.testing.assert_close(item["verifier_last_hidden_states"], pre.float())


def test_data_ratio_is_speculators_split():
    for n_train, n in ((1, 2), (9, 10), (4571, 4810), (32, 36)):
        assert int(n * sda.data_ratio(n_train, n)) == n_train
    with pytest.raises(ValueError, match=r"need 0 < training rows \(5\) < all rows \(5\)"):
        sda.data_ratio(5, 5)


def test_cli_parses_the_command_and_its_model_trains_on_a_collated_batch(written):
    from speculators.model import SpeculatorModel
    from speculators.train import cli
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset, CollateFn

    root, samples, _, _ = written
    ratio = sda.data_ratio(4, len(samples))
    argv = sda.build_train_command(
        verifier=root / "verifier",
        data_path=root / "data",
        save_path=root / "ckpt",
        log_dir=root / "logs",
        target_layer_ids=AUX,
        mask_token_id=1,
        train_ratio=ratio,
        epochs=12,
        lr=6e-4,
        seed=3,
        total_seq_len=128,
        num_layers=2,
        attn_impl="sdpa",
        loss_implementation="eager",
        num_workers=0,
    )
    assert argv[1:3] == ["-m", "speculators.train"]
    flat = TrainConfig.resolve(argv[3:]).flatten()
    want = {
        "speculator_type": "dflash",
        "target_layer_ids": AUX,
        "block_size": 8,
        "num_layers": 2,
        "epochs": 12,
        "lr": 6e-4,
        "seed": 3,
        "total_seq_len": 128,
        "full_attention_indices": [0, 1],
        "sliding_window_non_causal": True,
        "on_missing": "raise",
        "mask_token_id": 1,
        "loss_fn": "ce",
    }
    assert {k: flat[k] for k in want} == want
    args = argparse.Namespace(**flat)
    d2t, t2d, vocab = cli.parse_vocab_mappings(args)
    assert d2t is None and t2d is None  # the full target vocabulary, as eagle3kit's DFlash
    torch.manual_seed(0)
    model = cli.build_draft_model(args, SpeculatorModel.registry["dflash"], t2d, d2t, vocab).float()
    assert model.target_layer_ids == AUX and model.config.sliding_window_non_causal
    ds = ArrowDataset(
        max_len=128, datapath=str(root / "data"), on_missing="raise", train_ratio=ratio, split="train"
    )
    batch = CollateFn(128, model.config.transformer_layer_config.hidden_size, len(AUX), torch.float32)(
        [ds[0], ds[1]]
    )
    n0, n1 = samples[0].ids.numel(), samples[1].ids.numel()
    assert torch.equal(batch["input_ids"][0, n0 : n0 + n1], samples[1].ids)
    assert torch.equal(batch["loss_mask"][0, : n0 + n1].bool(), torch.cat([samples[0].mask, samples[1].mask]))
    tensors = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    _, _, _, aligned, idx = model._backbone_forward(**tensors, max_anchors=16)
    # slot k ≥ 1 of the block at anchor p is supervised where loss_mask[p + k], as eagle3kit's mask[p + k]
    B = model.block_size
    got = aligned.view(-1, B).bool()
    lm = batch["loss_mask"][0, idx].view(-1, B).bool()
    used = got.any(1)  # the anchors drawn (padding anchors are all zero)
    assert used.any() and not got[:, 0].any()
    assert torch.equal(got[used, 1:], lm[used, 1:])
    assert bool(batch["loss_mask"][0, idx.view(-1, B)[used, 0]].bool().all())  # anchors on reply tokens
    kw, _ = SpeculatorModel.registry["dflash"].get_trainer_kwargs(**flat)
    _, loss, _ = model(**tensors, **kw)
    loss.backward()
    assert torch.isfinite(loss) and model.fc.weight.grad.abs().sum() > 0


def _row(T=3, L=2, H=4, ids_dtype=torch.int64, mask=None):
    ids = torch.arange(T).to(ids_dtype)
    mask = torch.ones(T, dtype=torch.int64) if mask is None else mask
    return ids, mask, torch.zeros(T, L * H), torch.zeros(T, H)


@pytest.mark.parametrize(
    "rows, match",
    [
        ([], "no rows"),
        ([_row(), _row(T=0)], "row 1: no tokens"),
        ([_row(L=0)], "holds no layer"),
        ([_row(ids_dtype=torch.float32)], "ids must be integers"),
        ([_row(ids_dtype=torch.bool, T=2)], "ids must be integers"),
        ([_row(mask=torch.ones(3))], "loss mask must be integers or bools"),
        ([_row(mask=torch.tensor([0, 1, 2]))], "values other than 0 and 1"),
    ],
)
def test_offline_data_refuses_empty_or_malformed_rows(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        sda.write_offline_data(tmp_path / "data", iter(rows))


def test_data_ratio_and_final_checkpoint_refuse_bad_counts(tmp_path):
    for n_train, n in ((4.0, 10), (4, 10.5), (True, 10), (0, 10), (10, 10), (-1, 10)):
        said = (
            "row counts must be ints"
            if not all(type(x) is int for x in (n_train, n))
            else "need 0 < training rows"
        )
        with pytest.raises(ValueError, match=said):
            sda.data_ratio(n_train, n)
    for epochs in (0, -1):
        with pytest.raises(ValueError, match="epochs must be at least 1"):
            sda.final_checkpoint(tmp_path, epochs)
