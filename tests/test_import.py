"""`import` and `export --format speculators` (issue 5, point 3; C26): foreign layouts built from
one of our drafters import strictly to the same tensors, export → import → export is the identity,
and every variant eagle3kit cannot serve exactly is refused by name."""

import json

import pytest
import torch
from foreign_layouts import write_layout
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from eagle3kit.cli import app
from eagle3kit.core.config import ConfigError, TargetConfig
from eagle3kit.model.contract import DrafterImportError
from eagle3kit.model.draft_vocab import DraftVocab
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.folder import export_drafter
from eagle3kit.model.folder_read import read_drafter
from eagle3kit.serve.importer import run_import


@pytest.fixture(scope="module")
def source(tiny_target_dir, tmp_path_factory):
    """A bf16 drafter for the tiny 8-layer target (H 64, V 49152, Vd 512, aux = default [2, 4, 5]),
    exported in the dual layout, with random (not initial) weights everywhere."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    torch.manual_seed(3)
    d = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [2, 4, 5]))
    with torch.no_grad():
        for p in d.parameters():
            p.normal_()
    d.set_vocab(DraftVocab(ids=torch.arange(512) * 7 + 3, vocab_size=tc.vocab_size))
    prov = {
        "aux_layer_ids": {"convention": "hf_output_hidden_states_index", "ids": [2, 4, 5]},
        "checkpoint_sha256": "abc",
    }
    return export_drafter(
        d, tmp_path_factory.mktemp("src") / "drafter", provenance=prov, dtype=torch.bfloat16
    )


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return TargetConfig(model=str(tiny_target_dir))


def embedding(tiny_target_dir):
    return load_file(str(tiny_target_dir / "model.safetensors"))["model.embed_tokens.weight"]


def same_tensors(drafter, folder):
    """The imported drafter's tensors equal the dual export's, bit for bit (dtype included)."""
    want = load_file(str(folder / "model.safetensors"))
    got = drafter.state_dict()
    return set(want) <= set(got) and all(
        torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items()
    )


@pytest.mark.parametrize(
    "layout,detected",
    [
        ("eagle", "eagle"),
        ("specforge", "specforge"),
        ("speculators", "speculators"),
        ("modelopt", "modelopt"),
        ("modelopt_raw", "modelopt"),
    ],
)
def test_each_foreign_layout_imports_strictly_to_the_same_tensors(
    source, target, tiny_target_dir, tmp_path, layout, detected
):
    src = write_layout(source, tmp_path / layout, layout, embed=embedding(tiny_target_dir))
    imp = read_drafter(src, target=target)
    assert imp.layout == detected
    assert imp.drafter.config.aux_layer_ids == [
        2,
        4,
        5,
    ]  # converted to HF indices (ModelOpt/SpecForge: j + 1)
    assert imp.drafter.config.max_position_embeddings == 4096  # the target's, not SafeAILab's stale 2048
    assert same_tensors(imp.drafter, source)  # t2d synthesized for ModelOpt equals the real one
    if layout == "speculators":
        assert any("embed_tokens" in n for n in imp.notes)
    if layout == "modelopt":
        assert "synthesized t2d from d2t" in imp.notes


@pytest.mark.parametrize("naming", ["midlayer", "layers0"])
def test_c26_layers0_and_midlayer_naming_load_strictly_and_save_the_source_tensors(
    source, target, tmp_path, naming
):
    src = source if naming == "midlayer" else write_layout(source, tmp_path / "l0", "layers0")
    res = run_import(src, tmp_path / "out", target)
    assert res["layout"] == "eagle3kit" and res["dtype"] == "bfloat16"
    a, b = (
        load_file(str(source / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_import_export_is_the_identity_in_both_formats(source, target, tmp_path):
    imp = read_drafter(source, target=target)
    again = export_drafter(imp.drafter, tmp_path / "again", imp.provenance)
    assert json.loads((again / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    a, b = load_file(str(source / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    spec = export_drafter(
        imp.drafter,
        tmp_path / "spec",
        imp.provenance,
        fmt="speculators",
        verifier={"name_or_path": "t", "architectures": ["LlamaForCausalLM"]},
    )
    back = read_drafter(spec, target=target)
    assert back.layout == "speculators" and same_tensors(back.drafter, source)
    third = export_drafter(back.drafter, tmp_path / "third", back.provenance)
    assert json.loads((third / "config.json").read_text()) == json.loads((source / "config.json").read_text())


def test_speculators_export_has_every_key_of_design_section_5(source, target, tmp_path):
    d = read_drafter(source, target=target)
    out = export_drafter(
        d.drafter,
        tmp_path / "spec",
        d.provenance,
        fmt="speculators",
        num_speculative_tokens=3,
        verifier={"name_or_path": "/models/t", "architectures": ["LlamaForCausalLM"]},
    )
    cfg = json.loads((out / "config.json").read_text())
    assert "model_type" not in cfg and cfg["speculators_model_type"] == "eagle3"
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    assert cfg["draft_vocab_size"] == 512 and cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["speculators_config"] == {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "/models/t", "architectures": ["LlamaForCausalLM"]},
    }
    names = set(load_file(str(out / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig  # what vLLM makes of it

    pre = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(cfg)))
    assert pre["norm_before_residual"] is False and pre["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert SpeculatorsConfig.extract_vllm_speculative_config(cfg) == {
        "method": "eagle3",
        "num_speculative_tokens": 3,
    }


def edit(source, tmp_path, tensors=None, config=None):
    out = tmp_path / "v"
    out.mkdir()
    t = load_file(str(source / "model.safetensors"))
    c = json.loads((source / "config.json").read_text())
    save_file(tensors(t) if tensors else t, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config(c) if config else c))
    return out


@pytest.mark.parametrize(
    "name,tensors,config,words",
    [
        (
            "missing fc",
            lambda t: {k: v for k, v in t.items() if k != "fc.weight"},
            None,
            "missing ['fc.weight']",
        ),
        (
            "stray key",
            lambda t: {**t, "midlayer.self_attn.q_proj.bias": torch.zeros(4)},
            None,
            "unexpected ['midlayer.self_attn.q_proj.bias']",
        ),
        (
            "second layer",
            lambda t: {
                **{k.replace("midlayer.", "layers.0."): v for k, v in t.items()},
                "layers.1.mlp.up_proj.weight": torch.zeros(2, 2),
            },
            None,
            "more than one decoder layer",
        ),
        ("misshapen", lambda t: {**t, "norm.weight": torch.ones(65)}, None, "norm.weight [65] ≠ [64]"),
        ("ids not offsets", lambda t: {**t, "d2t": torch.arange(512) * 7 + 3}, None, "offsets"),
        (
            "fc_norm without its norms",
            None,
            lambda c: {**c, "fc_norm": True},
            "missing ['fc_norm.0.weight', 'fc_norm.1.weight', 'fc_norm.2.weight']",
        ),
        (
            "both norms before fc",
            lambda t: {**t, "input_norm.weight": torch.ones(192)},
            lambda c: {**c, "fc_norm": True, "norm_before_fc": True},
            "norm_before_fc and fc_norm are both true",
        ),
        (
            "P-EAGLE without its mask token",
            lambda t: {**t, "mask_hidden": torch.ones(1, 1, 192)},
            None,
            "lacks a mask token id (mask_token_id)",
        ),
        ("bias", None, lambda c: {**c, "attention_bias": True}, "attention_bias: true"),
    ],
)
def test_what_cannot_load_exactly_is_refused_by_name(source, target, tmp_path, name, tensors, config, words):
    bad = edit(source, tmp_path, tensors, config)
    with pytest.raises(DrafterImportError, match=None) as e:
        read_drafter(bad, target=target)
    assert words in str(e.value), str(e.value)


def test_speculators_without_norm_before_residual_is_read_true_as_vllm_reads_it(source, target, tmp_path):
    src = write_layout(source, tmp_path / "s", "speculators", embed=torch.zeros(49152, 64))
    c = json.loads((src / "config.json").read_text())
    del c["norm_before_residual"]
    (src / "config.json").write_text(json.dumps(c))
    imp = read_drafter(src, target=target)
    assert imp.drafter.config.norm_before_residual and imp.drafter.norm_before_residual
    assert any("no norm_before_residual in a speculators config: true" in n for n in imp.notes)
    assert not read_drafter(
        source, target=target
    ).drafter.config.norm_before_residual  # the dual export: false


def test_a_source_without_ids_needs_the_target_and_another_target_is_refused(
    source, tmp_path, smollm2_tokenizer
):
    src = write_layout(source, tmp_path / "e", "eagle")
    with pytest.raises(DrafterImportError, match="give --target"):
        read_drafter(src)
    from conftest import build_tiny_llama

    other = tmp_path / "other"
    build_tiny_llama(8, hidden_size=32, intermediate_size=64, head_dim=8).save_pretrained(other)
    with pytest.raises(DrafterImportError, match="another target.*hidden size 64 ≠ the target's 32"):
        read_drafter(source, target=TargetConfig(model=str(other)))


def test_the_import_command_converts_reports_and_checks(source, tiny_target_dir, tmp_path):
    src = write_layout(source, tmp_path / "mo", "modelopt")
    res = CliRunner().invoke(
        app, ["import", str(src), "--out", str(tmp_path / "out"), "--target", str(tiny_target_dir)]
    )
    assert res.exit_code == 0, res.output
    assert "aux ids [1, 3, 4] (output of layer j, modelopt) → HF indices [2, 4, 5]" in res.output
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and cfg["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [1, 3, 4]
    assert cfg["eagle3kit"]["imported_from"]["layout"] == "modelopt"
    again = CliRunner().invoke(
        app, ["import", str(src), "--out", str(tmp_path / "out"), "--target", str(tiny_target_dir)]
    )
    assert again.exit_code == 2 and "--overwrite" in again.output  # never overwrites unasked
    for out in (src, tiny_target_dir):  # never into the source or the target
        with pytest.raises(ConfigError, match="import never writes into either"):
            run_import(src, out, TargetConfig(model=str(tiny_target_dir)), overwrite=True)


def test_init_from_copies_weights_and_matches_lm_head_rows_by_target_id(source, target, tiny_target_dir):
    from transformers import AutoConfig

    from eagle3kit.train.checkpoints import init_from_drafter

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    fresh = Eagle3Drafter(DrafterConfig.from_target(tc, 256, [2, 4, 5]))
    fresh.set_vocab(
        DraftVocab(ids=torch.arange(256) * 14 + 3, vocab_size=tc.vocab_size)
    )  # every other source token
    before = fresh.lm_head.weight.detach().clone()
    rep = init_from_drafter(fresh, source, target)
    src = read_drafter(source, target=target).drafter
    assert rep["lm_head_rows_copied"] == 256
    assert torch.equal(fresh.fc.weight, src.fc.weight.float())
    assert torch.equal(
        fresh.lm_head.weight[5], src.lm_head.weight[10].float()
    )  # target id 73 = draft 5 here, 10 there
    fresh.set_vocab(DraftVocab(ids=torch.arange(256) * 7 + 4, vocab_size=tc.vocab_size))  # no token in common
    fresh.lm_head.weight.data.copy_(before)
    assert init_from_drafter(fresh, source, target)["lm_head_rows_copied"] == 0
    assert torch.equal(fresh.lm_head.weight, before)
    wrong = Eagle3Drafter(DrafterConfig.from_target(tc, 256, [1, 4, 5]))
    with pytest.raises(ConfigError, match=r"reads aux layers \[2, 4, 5\] but this run trains on \[1, 4, 5\]"):
        init_from_drafter(wrong, source, target)


def test_a_folder_holding_another_tools_drafter_is_never_mixed_or_lost(source, target, tmp_path):
    theirs = write_layout(source, tmp_path / "theirs", "eagle")
    before = (theirs / "config.json").read_text()
    with pytest.raises(FileExistsError, match="not empty"):
        run_import(source, theirs, target)
    assert (theirs / "config.json").read_text() == before and not (theirs / "model.safetensors").exists()
    run_import(source, theirs, target, overwrite=True)  # asked: the old folder is moved aside
    assert (tmp_path / "theirs.prev-1" / "config.json").read_text() == before
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda c: [1, 2, 3], "top level must be a JSON object"),
        (lambda c: {**c, "hidden_size": "sixty-four"}, "hidden_size: Input should be a valid integer"),
        (lambda c: {**c, "hidden_size": 64.9}, "hidden_size: Input should be a valid integer"),
        (lambda c: {**c, "rms_norm_eps": "tiny"}, "rms_norm_eps"),
        (lambda c: {**c, "vocab_size": None}, "vocab_size"),
        (lambda c: {**c, "draft_vocab_size": 0}, "draft_vocab_size: Input should be greater than 0"),
        (lambda c: {**c, "hidden_act": "gelu"}, "hidden_act: Input should be 'silu'"),
        (
            lambda c: {**c, "norm_before_residual": "false"},
            "norm_before_residual: Input should be a valid boolean",
        ),
        (lambda c: {**c, "eagle_aux_hidden_state_layer_ids": "245"}, "eagle_aux_hidden_state_layer_ids"),
        (
            lambda c: {
                **c,
                "eagle_aux_hidden_state_layer_ids": [2, 4],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3]},
            },
            "name 2 aux layers, but fc.weight takes 192 inputs",
        ),
        (
            lambda c: {**c, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, None, 4]}},
            "must be a list of ints",
        ),
        (lambda c: {**c, "rope_theta": 500000.0}, "differs from the target's"),
        (lambda c: {**c, "draft_vocab_size": 60000}, "exceeds vocab_size"),
    ],
)
def test_a_malformed_config_is_refused_by_field_in_import_and_check(
    source, target, tiny_target_dir, tmp_path, change, words
):
    from eagle3kit.serve.check import check_drafter

    bad = edit(source, tmp_path, config=change)
    with pytest.raises(DrafterImportError) as e:
        read_drafter(bad, target=target)
    assert words in str(e.value), str(e.value)
    found = [
        f for f in check_drafter(bad, target) if f.severity == "error"
    ]  # never a traceback, never "servable"
    assert found, words
    res = CliRunner().invoke(
        app, ["import", str(bad), "--out", str(tmp_path / "o"), "--target", str(tiny_target_dir)]
    )
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert not (tmp_path / "o").exists()  # nothing written


def test_an_explicit_layout_that_would_drop_the_sources_ids_is_refused(source, target, tmp_path):
    src = write_layout(source, tmp_path / "sf", "specforge")
    with pytest.raises(DrafterImportError, match="would be lost"):
        read_drafter(src, layout="eagle", target=target)
    with pytest.raises(DrafterImportError, match="not in the speculators layout"):
        read_drafter(src, layout="speculators", target=target)


@pytest.mark.parametrize(
    "name,make,words",
    [
        (
            "bin holds a list",
            lambda d: torch.save([torch.ones(1)], d / "pytorch_model.bin"),
            "not a name → tensor dict",
        ),
        (
            "bin holds a step counter",
            lambda d: torch.save(
                {**torch.load(d / "pytorch_model.bin", weights_only=True), "step": 1}, d / "pytorch_model.bin"
            ),
            "not named tensors",
        ),
    ],
)
def test_a_pytorch_bin_that_is_not_a_plain_state_dict(source, target, tmp_path, name, make, words):
    src = write_layout(source, tmp_path / "e", "eagle")
    make(src)
    with pytest.raises(DrafterImportError, match=words):
        read_drafter(src, target=target)


def test_shards_are_read_by_their_weight_map_only(source, target, tmp_path):
    src = write_layout(source, tmp_path / "sf", "specforge")
    index = src / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    for wmap, words in (
        ({**good["weight_map"], "fc.weight": "../x.safetensors"}, "not a file name"),
        ({k: v for k, v in good["weight_map"].items() if k != "fc.weight"}, "maps elsewhere or not at all"),
        ({**good["weight_map"], "norm.weight": "model-00009-of-00002.safetensors"}, "which is missing"),
    ):
        index.write_text(json.dumps({"weight_map": wmap}))
        with pytest.raises(DrafterImportError, match=words):
            read_drafter(src, target=target)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(DrafterImportError, match="weight_map"):
        read_drafter(src, target=target)


@pytest.mark.parametrize(
    "change,words,code",
    [
        (lambda t: {**t, "fc.weight": t["fc.weight"].to(torch.int32)}, "floating-point", "weight_dtype"),
        (lambda t: {**t, "fc.weight": t["fc.weight"] * float("nan")}, "non-finite", None),
        (lambda t: {**t, "d2t": t["d2t"].double()}, "1-D an integer tensor", "vocab_map_dtype"),
    ],
)
def test_weights_of_the_wrong_kind(source, target, tmp_path, change, words, code):
    from eagle3kit.serve.check import check_drafter

    bad = edit(source, tmp_path, tensors=change)
    with pytest.raises(DrafterImportError, match=words):
        read_drafter(bad, target=target)
    if code:
        assert code in [f.code for f in check_drafter(bad, target)]


def test_check_finds_an_aux_id_count_that_does_not_fit_fc_and_a_bad_engine_version(
    source, tiny_target_dir, tmp_path
):
    from eagle3kit.serve.check import check_drafter

    bad = edit(
        source,
        tmp_path,
        config=lambda c: {
            **c,
            "eagle_aux_hidden_state_layer_ids": [2, 4],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3]},
        },
    )
    assert "aux_ids_count" in [f.code for f in check_drafter(bad, TargetConfig(model=str(tiny_target_dir)))]
    res = CliRunner().invoke(
        app, ["check", str(source), "--target", str(tiny_target_dir), "--engine-version", "banana"]
    )
    assert res.exit_code == 2 and "not a version" in res.output
