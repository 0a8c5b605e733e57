"""`eagle3kit check`: faults found in seconds, before any server starts (issue 5; C27–C32)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from eagle3kit.cli import app
from eagle3kit.core.config import TargetConfig
from eagle3kit.model.draft_vocab import DraftVocab
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.folder import export_drafter
from eagle3kit.serve.check import check_drafter
from eagle3kit.serve.engine_rules import sglang_captured


@pytest.fixture(scope="module")
def good(tiny_target_dir, tmp_path_factory):
    """A drafter exported for the tiny 8-layer Llama target (hidden 64, V 49152, Vd 512)."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    d = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [2, 4, 5]))
    d.set_vocab(DraftVocab(ids=torch.arange(512) * 7, vocab_size=tc.vocab_size))
    prov = {"aux_layer_ids": {"convention": "hf_output_hidden_states_index", "ids": [2, 4, 5]}}
    return export_drafter(d, tmp_path_factory.mktemp("good") / "drafter", provenance=prov)


def codes(folder, target_dir, **kw):
    return [
        f.code
        for f in check_drafter(folder, TargetConfig(model=str(target_dir)), **kw)
        if f.severity == "error"
    ]


def variant(good, tmp_path, tensors=None, config=None):
    """A copy of the good export with tensors and/or config.json changed."""
    out = tmp_path / "v"
    out.mkdir(parents=True)
    t = load_file(str(good / "model.safetensors"))
    cfg = json.loads((good / "config.json").read_text())
    t = tensors(t) if tensors else t
    cfg = config(cfg) if config else cfg
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_a_good_export_is_servable_and_the_cli_exits_0(good, tiny_target_dir):
    assert codes(good, tiny_target_dir, max_model_len=4096) == []
    res = CliRunner().invoke(app, ["check", str(good), "--target", str(tiny_target_dir), "--json"])
    assert res.exit_code == 0 and json.loads(res.output[res.output.index("{") :])["ok"] is True
    res = CliRunner().invoke(app, ["check", str(good), "--target", str(tiny_target_dir)])
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "servable on vllm (installed " in said, said
    # the releases its rules were measured against by serving, CPU build and GPU
    assert "0.32.0's CPU build" in said and "0.26.0 on an H100 GPU" in said, said


@pytest.mark.parametrize(
    "drop,code",
    [("fc.weight", "missing_tensor"), ("lm_head.weight", "missing_tensor"), ("d2t", "missing_d2t")],
)
def test_c27_control_a_missing_fc_or_d2t_is_refused_with_exit_1(good, tiny_target_dir, tmp_path, drop, code):
    bad = variant(good, tmp_path, tensors=lambda t: {k: v for k, v in t.items() if k != drop})
    assert code in codes(bad, tiny_target_dir)
    res = CliRunner().invoke(app, ["check", str(bad), "--target", str(tiny_target_dir)])
    assert res.exit_code == 1 and code in res.output


def test_control_aux_ids_shifted_by_one_are_refused_naming_both_lists(good, tiny_target_dir, tmp_path):
    bad = variant(
        good,
        tmp_path,
        config=lambda c: {
            **c,
            "eagle_aux_hidden_state_layer_ids": [3, 5, 6],
            "eagle_config": {**c["eagle_config"], "eagle_aux_hidden_state_layer_ids": [2, 4, 5]},
        },
    )
    found = check_drafter(bad, TargetConfig(model=str(tiny_target_dir)))
    trained = next(f for f in found if f.code == "aux_ids_trained")
    assert "[3, 5, 6]" in trained.message and "[2, 4, 5]" in trained.message


def test_c30_no_aux_ids_or_ids_past_the_last_layer(good, tiny_target_dir, tmp_path):
    bad = variant(
        good,
        tmp_path,
        config=lambda c: {k: v for k, v in c.items() if k != "eagle_aux_hidden_state_layer_ids"},
    )
    assert codes(bad, tiny_target_dir) == ["aux_ids_missing"]
    past = variant(
        good,
        tmp_path / "p",
        config=lambda c: {
            **c,
            "eagle_aux_hidden_state_layer_ids": [2, 4, 8],
            "eagle_config": {**c["eagle_config"], "eagle_aux_hidden_state_layer_ids": [1, 3, 7]},
        },
    )
    assert codes(past, tiny_target_dir) == ["aux_ids_range", "aux_ids_trained"]  # 8 layers: ids end at 7


def test_c28_c29_lm_head_rows_and_widths_for_another_target(good, tiny_target_dir, tmp_path):
    bad = variant(good, tmp_path, tensors=lambda t: {**t, "lm_head.weight": t["lm_head.weight"][:500]})
    assert "tensor_shape" in codes(bad, tiny_target_dir)
    other = variant(good, tmp_path / "o", config=lambda c: {**c, "target_hidden_size": 32})
    assert "target_hidden_size" in codes(other, tiny_target_dir)


def test_c32_an_eagle1_head_is_recognised_from_its_shapes(good, tiny_target_dir, tmp_path):
    def eagle1(t):
        t = {k: v for k, v in t.items() if k not in ("lm_head.weight", "d2t", "t2d")}
        t["fc.weight"] = torch.zeros(64, 128)
        return t

    bad = variant(
        good,
        tmp_path,
        tensors=eagle1,
        config=lambda c: {k: v for k, v in c.items() if k != "draft_vocab_size"},
    )
    assert codes(bad, tiny_target_dir) == ["eagle1_head"]


def test_tied_embeddings_short_max_positions_and_rope_are_caught(good, tiny_target_dir, tmp_path):
    bad = variant(
        good,
        tmp_path,
        config=lambda c: {
            **c,
            "tie_word_embeddings": True,
            "max_position_embeddings": 2048,
            "rope_theta": 500000.0,
        },
    )
    assert set(codes(bad, tiny_target_dir, max_model_len=4096)) == {
        "tied_embeddings",
        "max_positions",
        "rope",
    }


def test_sglang_aux_rule_per_family():
    assert sglang_captured([1, 14, 26], "llama", 30) == [2, 15, 27]  # always +1
    assert sglang_captured([2, 15, 27], "deepseek_v3", 61) == [2, 15, 27]  # first id is not 1: verbatim
    assert sglang_captured([1, 29, 57], "kimi_k2", 61) == [2, 30, 58]  # first id is 1: +1
    assert sglang_captured([2, 12, 24], "gpt_oss", 24) == [2, 12, 24]  # largest id = N: verbatim


def test_c31_engine_version_and_target_family(good, tiny_target_dir, tmp_path):
    """vLLM's EAGLE-3 gate by release (read from each release's source): 0.8.5–0.10.0 Llama only,
    0.10.1 adds Qwen, …; a Qwen2 or Gemma-3 target is refused before launch where the release
    would refuse it, and the fix names the first release that serves it."""
    cfg = json.loads((tiny_target_dir / "config.json").read_text())

    def target(model_type, arch):
        d = tmp_path / model_type
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, "model_type": model_type, "architectures": [arch]}))
        return d

    qwen, gemma = target("qwen2", "Qwen2ForCausalLM"), target("gemma3_text", "Gemma3ForCausalLM")

    def support(t, v):
        return [
            f
            for f in check_drafter(good, TargetConfig(model=str(t)), engine_version=v)
            if f.code.startswith("engine_")
        ]

    assert [f.severity for f in support(tiny_target_dir, "0.10.0")] == []  # llama: allowed since 0.8.5
    refused = support(qwen, "0.10.0")
    assert [f.severity for f in refused] == ["error"] and "['llama']" in refused[0].message
    assert refused[0].fix == "serve on vLLM ≥ 0.10.1"
    assert [f.severity for f in support(qwen, "0.10.1")] == [
        "warning"
    ]  # allowed; class interface not checkable here
    assert support(gemma, "0.20.0")[0].fix.startswith(
        "serve on vLLM ≥ 0.22.0"
    )  # 'gemma4' is listed, gemma3 is not
    assert "no EAGLE-3" in support(tiny_target_dir, "0.8.4")[0].message
    assert [
        f.severity for f in support(tiny_target_dir, "0.32.0")
    ] == []  # the installed CPU build: class checked for real
    res = CliRunner().invoke(
        app, ["check", str(good), "--target", str(qwen), "--engine-version", "0.9.2", "--json"]
    )
    assert res.exit_code == 1 and "engine_support" in res.output


def test_the_speculators_layout_is_checked_as_such(good, tiny_target_dir, tmp_path):
    """A speculators export: vLLM reads it from 0.10.1 on (read from the releases' source), SGLang
    has no class for it; check renames layers.0.* itself, so nothing else is flagged."""
    from eagle3kit.model.folder import export_drafter, load_exported

    spec = export_drafter(
        load_exported(good),
        tmp_path / "spec",
        json.loads((good / "config.json").read_text())["eagle3kit"],
        fmt="speculators",
        verifier={"name_or_path": "t", "architectures": ["LlamaForCausalLM"]},
    )
    target = TargetConfig(model=str(tiny_target_dir))
    assert codes(spec, tiny_target_dir) == []
    assert codes(spec, tiny_target_dir, engine_version="0.10.0") == ["layout"]
    assert "layout" not in codes(spec, tiny_target_dir, engine_version="0.10.1")
    assert "layout" in codes(spec, tiny_target_dir, engine="sglang")
    info = [f for f in check_drafter(good, target, engine="sglang") if f.severity == "info"]
    assert info and "[2, 4, 5]" in info[0].message  # what SGLang will capture, said out loud


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_a_target_config_without_its_sizes_is_named_not_blamed_on_the_drafter(
    good, tiny_target_dir, tmp_path, key
):
    """Hostile-input trial: a target config.json without hidden_size made `check` blame the drafter
    ("the target's hidden size is 4096", transformers' class default) in three findings; the
    target's config is the fault, and it is named (exit 2)."""
    target = tmp_path / "target"
    target.mkdir()
    for f in tiny_target_dir.iterdir():
        (target / f.name).symlink_to(f)
    cfg = json.loads((tiny_target_dir / "config.json").read_text())
    del cfg[key]
    (target / "config.json").unlink()
    (target / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, ["check", str(good), "--target", str(target)])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and f"config.json has no {key}" in said, said
    assert "target_hidden_size" not in said and "fc_width" not in said


def test_check_locates_the_target_once_and_reads_its_configs_once(good, tiny_target_dir, target_reads):
    """One `eagle3kit check`: the target is located once, and its config read once through transformers
    and once as written (every rule reads the same), for a servable folder and for one with findings."""
    res = CliRunner().invoke(app, ["check", str(good), "--target", str(tiny_target_dir), "--json"])
    assert res.exit_code == 0, res.output
    assert target_reads == {"locate": 1, "configs": 1, "raw": 1}
    check_drafter(good, TargetConfig(model=str(tiny_target_dir)))  # called as a function: the same
    assert target_reads == {"locate": 2, "configs": 2, "raw": 2}
