import json

import pytest
import torch
from safetensors.torch import load_file
from test_drafter import tiny_drafter

from eagle3kit.model.contract import ExportError, validate_tensors
from eagle3kit.model.folder import export_drafter, load_exported


def test_c28_reduced_vocab_export_shapes_and_config(tmp_path):
    d = tiny_drafter(vd=8)
    out = export_drafter(d, tmp_path / "dr", provenance={"k": "v"})
    cfg = json.loads((out / "config.json").read_text())
    t = load_file(str(out / "model.safetensors"))
    assert cfg["vocab_size"] == 97 and cfg["draft_vocab_size"] == 8
    assert t["lm_head.weight"].shape[0] == 8 == t["d2t"].numel()
    assert t["t2d"].numel() == 97 and t["t2d"].dtype == torch.bool and t["d2t"].dtype == torch.int64
    assert not any("embed" in k for k in t) and not any(k.startswith("model.") for k in t)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False and cfg["norm_before_residual"] is False and "bias" not in cfg
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["eagle_config"] == {
        "use_aux_hidden_state": True,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
    }
    assert cfg["target_hidden_size"] == 32 and t["fc.weight"].shape == (32, 96)
    assert t["midlayer.self_attn.q_proj.weight"].shape == (32, 64)
    back = load_exported(out)
    assert torch.equal(back.lm_head.weight, d.lm_head.weight) and torch.equal(back.d2t, d.d2t)


def test_c19_full_vocab_exports_no_maps(tmp_path):
    out = export_drafter(tiny_drafter(), tmp_path / "full")
    t = load_file(str(out / "model.safetensors"))
    assert "d2t" not in t and "t2d" not in t
    assert load_exported(out).draft_to_target(torch.tensor([5])).item() == 5


def test_c27_missing_or_stray_tensors_are_refused(tmp_path):
    d = tiny_drafter(vd=8)
    good = {k: v for k, v in d.state_dict().items() if not k.startswith("rotary")}
    for drop in ("lm_head.weight", "fc.weight", "d2t"):
        bad = {k: v for k, v in good.items() if k != drop}
        with pytest.raises(ExportError, match=f"missing {drop}"):
            validate_tensors(bad, d.config)
    with pytest.raises(ExportError, match="unexpected tensor embed_tokens.weight"):
        validate_tensors({**good, "embed_tokens.weight": torch.zeros(97, 32)}, d.config)


def test_export_never_overwrites_without_being_asked(tmp_path):
    export_drafter(tiny_drafter(), tmp_path / "x")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_drafter(tiny_drafter(), tmp_path / "x")
    export_drafter(tiny_drafter(), tmp_path / "x", overwrite=True)


def test_c24_a_tied_target_gives_an_untied_drafter_whose_lm_head_survives_save_and_resume(
    tmp_path, tiny_target_dir
):
    from transformers import AutoConfig

    from eagle3kit.model.draft_vocab import DraftVocab
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.train.checkpoints import load_drafter_checkpoint, save_drafter_checkpoint

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    assert tc.tie_word_embeddings is True  # the target ties its embedding and lm_head
    d = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [2, 4, 5]))
    d.set_vocab(DraftVocab(ids=torch.arange(512) * 3, vocab_size=tc.vocab_size))
    save_drafter_checkpoint(d, tmp_path / "last.safetensors", {})
    back = load_drafter_checkpoint(tmp_path / "last.safetensors")
    assert back.lm_head.weight.shape == (512, 64) and torch.equal(back.lm_head.weight, d.lm_head.weight)
    cfg = json.loads((export_drafter(back, tmp_path / "dr") / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["draft_vocab_size"] == 512


def test_c29_a_drafter_narrower_than_its_target(tmp_path):
    from eagle3kit.model.contract import engine_config, required_shapes
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter

    c = DrafterConfig(
        hidden_size=8,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        vocab_size=97,
        draft_vocab_size=97,
        target_hidden_size=16,
        aux_layer_ids=[1, 2, 3],
    )
    assert engine_config(c, "float32")["target_hidden_size"] == 16
    assert required_shapes(c)["fc.weight"] == (8, 3 * 16) and tuple(Eagle3Drafter(c).fc.weight.shape) == (
        8,
        48,
    )
    with pytest.raises(
        ExportError, match="needs its own embed_tokens"
    ):  # not silently served with a borrowed one
        export_drafter(Eagle3Drafter(c), tmp_path / "narrow")
