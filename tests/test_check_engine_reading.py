"""`check` and `import` read a drafter folder the way the engine reads it: every rope spelling that
transformers 4/5 and vLLM accept resolves to one effective rope, which is what is compared; the shape
fields vLLM builds the drafter from are compared with the weights; the drafter's attention type is said;
conflicting flags between `eagle_config` and the top level are refused; unknown keys are listed."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3kit.core.config import TargetConfig
from eagle3kit.model.contract import DrafterImportError
from eagle3kit.model.draft_vocab import DraftVocab
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.folder import export_drafter
from eagle3kit.model.folder_read import read_drafter
from eagle3kit.serve.check import check_drafter

LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def _target(tmp, smollm2_tokenizer, rope: dict | None):
    """A tiny Llama folder whose config carries ``rope`` as transformers 5 writes it (rope_parameters)."""
    from conftest import build_tiny_llama

    params = (
        {"rope_theta": 10000.0, "rope_type": "default"} if rope is None else {"rope_theta": 500000.0, **rope}
    )
    m = build_tiny_llama(8, rope_parameters=params)
    m.save_pretrained(tmp)
    smollm2_tokenizer.save_pretrained(tmp)
    return tmp


@pytest.fixture(scope="module")
def targets(tmp_path_factory, smollm2_tokenizer):
    d = tmp_path_factory.mktemp("rope-targets")
    return {
        "plain": _target(d / "plain", smollm2_tokenizer, None),
        "llama3": _target(d / "llama3", smollm2_tokenizer, {"rope_type": "llama3", **LLAMA3}),
    }


def _export(target, tmp):
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(target)
    d = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [2, 4, 5]))
    d.set_vocab(DraftVocab(ids=torch.arange(512) * 7, vocab_size=tc.vocab_size))
    return export_drafter(d, tmp / "drafter")


def _edited(folder, tmp, edit, name="edited"):
    out = tmp / name
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(edit(cfg)))
    return out


def _errors(folder, target):
    return [f for f in check_drafter(folder, TargetConfig(model=str(target))) if f.severity == "error"]


def _respelled(cfg: dict, **fields) -> dict:
    cfg = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "rope_parameters")}
    return {**cfg, **fields}


def test_a_rope_parameters_theta_other_than_the_targets_is_refused_by_check_and_import(targets, tmp_path):
    good = _export(targets["plain"], tmp_path)
    bad = _edited(
        good, tmp_path, lambda c: {**c, "rope_parameters": {"rope_theta": 5e6, "rope_type": "default"}}
    )
    found = _errors(bad, targets["plain"])
    assert [f.code for f in found] == ["rope"] and "theta 5000000.0" in found[0].message
    with pytest.raises(DrafterImportError, match="rope"):
        read_drafter(bad, target=TargetConfig(model=str(targets["plain"])))


@pytest.mark.parametrize(
    "spelling",
    [
        {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", **LLAMA3}},
        {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}},
        {
            "rope_theta": 500000,
            "rope_scaling": {"type": "llama3", **LLAMA3, "factor": 8},
        },  # transformers 4, ints
    ],
    ids=["rope_parameters", "rope_scaling", "legacy_type_key"],
)
def test_every_spelling_of_the_targets_llama3_rope_is_servable_and_imports(targets, tmp_path, spelling):
    good = _export(targets["llama3"], tmp_path)
    folder = _edited(good, tmp_path, lambda c: _respelled(c, **spelling))
    assert _errors(folder, targets["llama3"]) == []
    assert read_drafter(folder, target=TargetConfig(model=str(targets["llama3"]))).drafter.config.rope_scaling


@pytest.mark.parametrize(
    "spelling",
    [
        {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "default"}},
        {"rope_theta": 10000.0, "rope_scaling": None},
    ],
    ids=["default_type", "none"],
)
def test_a_default_rope_in_any_spelling_is_no_scaling(targets, tmp_path, spelling):
    good = _export(targets["plain"], tmp_path)
    folder = _edited(good, tmp_path, lambda c: _respelled(c, **spelling))
    assert _errors(folder, targets["plain"]) == []
    read_drafter(folder, target=TargetConfig(model=str(targets["plain"])))
    other = _edited(
        good, tmp_path, lambda c: _respelled(c, rope_scaling={"rope_type": "llama3", **LLAMA3}), "scaled"
    )
    assert [f.code for f in _errors(other, targets["plain"])] == ["rope"]


def test_a_flag_nested_in_eagle_config_that_contradicts_the_top_level_is_refused_naming_both(
    targets, tmp_path
):
    good = _export(targets["plain"], tmp_path)
    bad = _edited(
        good,
        tmp_path,
        lambda c: {
            **c,
            "norm_before_fc": False,
            "eagle_config": {**c["eagle_config"], "norm_before_fc": True},
        },
    )
    found = _errors(bad, targets["plain"])
    assert [f.code for f in found] == ["config_invalid"]
    assert "eagle_config.norm_before_fc is true and the top-level norm_before_fc is false" in found[0].message
    with pytest.raises(DrafterImportError, match="eagle_config.norm_before_fc is true"):
        read_drafter(bad, target=TargetConfig(model=str(targets["plain"])))
    same = _edited(
        good, tmp_path, lambda c: {**c, "eagle_config": {**c["eagle_config"], "norm_before_fc": False}}, "s"
    )
    assert _errors(same, targets["plain"]) == []  # written twice, one value: fine


def test_an_export_writes_every_variant_flag_false_included(targets, tmp_path):
    cfg = json.loads((_export(targets["plain"], tmp_path) / "config.json").read_text())
    assert {
        k: cfg[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    } == dict.fromkeys(("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), False)


def test_keys_no_reader_uses_are_listed_on_import_without_naming_a_tool(targets, tmp_path):
    good = _export(targets["plain"], tmp_path)
    odd = _edited(good, tmp_path, lambda c: {**c, "my_trainer_step": 7, "draft_temperature": 0.5})
    notes = read_drafter(odd, target=TargetConfig(model=str(targets["plain"]))).notes
    listed = [n for n in notes if n.startswith("config.json keys no engine reads")]
    assert listed == [
        "config.json keys no engine reads for this drafter, left out: draft_temperature, my_trainer_step"
    ]
    assert not any(k in n for n in notes for k in ("my_trainer", "draft_temperature") if n not in listed)
    assert not [
        n for n in read_drafter(good, target=TargetConfig(model=str(targets["plain"]))).notes if "keys" in n
    ]


@pytest.mark.parametrize(
    "edit, code",
    [
        (lambda c: {**c, "num_aux_hidden_states": 4}, "num_aux_states"),
        (lambda c: {**c, "num_hidden_layers": 2}, "num_hidden_layers"),
        (
            lambda c: {**c, "eagle_config": {**c["eagle_config"], "use_aux_hidden_state": False}},
            "use_aux_hidden_state",
        ),
    ],
    ids=["num_aux_hidden_states", "num_hidden_layers", "use_aux_hidden_state"],
)
def test_a_shape_field_vllm_builds_from_that_the_weights_contradict_is_refused(targets, tmp_path, edit, code):
    bad = _edited(_export(targets["plain"], tmp_path), tmp_path, edit)
    assert code in [f.code for f in _errors(bad, targets["plain"])]


def test_a_consistent_drafter_of_four_aux_states_is_servable_imported_and_exported_for_vllm(
    targets, tmp_path
):
    """vLLM reads any number of aux states (fc sized by num_aux_hidden_states or eagle_config's ids): a
    drafter of four is checked as vLLM reads it, imported, and exported with the count written out."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(targets["plain"])
    d = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [1, 3, 5, 6]))
    d.set_vocab(DraftVocab(ids=torch.arange(512) * 7, vocab_size=tc.vocab_size))
    dual = export_drafter(d, tmp_path / "four")
    assert json.loads((dual / "config.json").read_text())["num_aux_hidden_states"] == 4
    assert _errors(dual, targets["plain"]) == []
    back = read_drafter(dual, target=TargetConfig(model=str(targets["plain"]))).drafter
    assert back.fc.weight.shape == (64, 4 * 64) and torch.equal(back.fc.weight, d.fc.weight)
    spec = export_drafter(
        d, tmp_path / "four-spec", fmt="speculators", verifier={"name_or_path": "x", "architectures": ["X"]}
    )
    assert (
        json.loads((spec / "config.json").read_text())["transformer_layer_config"]["num_aux_hidden_states"]
        == 4
    )
    assert _errors(spec, targets["plain"]) == []
    three = _edited(
        dual, tmp_path, lambda c: {k: v for k, v in c.items() if k != "num_aux_hidden_states"}, "x"
    )
    assert _errors(three, targets["plain"]) == []  # eagle_config's 4 ids size fc as vLLM reads them
    no_count = _edited(
        spec,
        tmp_path,
        lambda c: {
            **c,
            "transformer_layer_config": {**c["transformer_layer_config"], "num_aux_hidden_states": None},
        },
        "y",
    )
    assert "num_aux_states" in [
        f.code for f in _errors(no_count, targets["plain"])
    ]  # vLLM would size fc for 3


def test_check_says_both_attentions_and_refuses_what_no_eagle3_class_runs(targets, tmp_path, smollm2_tok_dir):
    """Every check says the drafter's attention and the target's; MLA fields beside q/k/v weights are
    ignored by the engine (a warning), MLA weights cannot be served (an error), and beside an MLA target
    the engine setting of the drafter's own attention backend is named, for vLLM and for SGLang."""
    from family_targets import build as build_family_target

    good = _export(targets["plain"], tmp_path)
    said = [
        f.message
        for f in check_drafter(good, TargetConfig(model=str(targets["plain"])))
        if f.code == "attention"
    ]
    assert said == ["the drafter's MHA, the target's MHA"]
    fields = _edited(good, tmp_path, lambda c: {**c, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, "fields")
    found = {f.code: f for f in check_drafter(fields, TargetConfig(model=str(targets["plain"])))}
    assert (
        found["drafter_attention"].severity == "warning"
        and "kv_lora_rank, qk_rope_head_dim" in found["drafter_attention"].message
    )
    mla = tmp_path / "mla"
    shutil.copytree(good, mla)
    t = load_file(str(good / "model.safetensors"))
    t["midlayer.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(8, 64)
    save_file(t, str(mla / "model.safetensors"))
    assert "drafter_attention" in [f.code for f in _errors(mla, targets["plain"])]
    deepseek = build_family_target("deepseek_v3", tmp_path / "ds", smollm2_tok_dir)
    d = _export(deepseek, tmp_path / "for-ds")
    for engine, setting in (
        ("vllm", '"attention_backend"'),
        ("sglang", "--speculative-draft-attention-backend"),
    ):
        found = {f.code: f for f in check_drafter(d, TargetConfig(model=str(deepseek)), engine=engine)}
        assert found["attention"].message == "the drafter's MHA, the target's MLA"
        assert setting in found["attention_types"].fix


def test_the_rope_of_a_speculators_folder_is_read_from_its_layer_config(targets, tmp_path):
    """vLLM builds a speculators drafter from ``transformer_layer_config``: our own llama3 export is
    servable, and a θ edited there (the top level untouched) is refused."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(targets["llama3"])
    d = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [2, 4, 5]))
    d.set_vocab(DraftVocab(ids=torch.arange(512) * 7, vocab_size=tc.vocab_size))
    spec = export_drafter(
        d, tmp_path / "spec", fmt="speculators", verifier={"name_or_path": "x", "architectures": ["X"]}
    )
    assert _errors(spec, targets["llama3"]) == []
    bad = _edited(
        spec,
        tmp_path,
        lambda c: {
            **c,
            "transformer_layer_config": {
                **_respelled(c["transformer_layer_config"]),
                "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            },
        },
    )
    found = _errors(bad, targets["llama3"])
    assert [f.code for f in found] == ["rope"] and "'linear'" in found[0].message


@pytest.mark.parametrize(
    "scaling, parameters",
    [
        ({"rope_type": "default"}, {"rope_theta": 500000.0, "rope_type": "llama3", **LLAMA3}),
        ({"rope_type": "llama3", **LLAMA3}, {"rope_type": "default"}),
    ],
    ids=["llama3_hidden_in_parameters", "llama3_in_scaling_default_in_parameters"],
)
def test_a_rope_spelled_twice_differently_is_refused_by_check_and_import(
    targets, tmp_path, scaling, parameters
):
    """transformers reads rope_scaling whole and drops rope_parameters; a folder that spells the two
    differently is served by what one tool honours and trained by what another did: refused, never merged."""
    good = _export(targets["llama3"], tmp_path)
    twice = _edited(
        good,
        tmp_path,
        lambda c: _respelled(c, rope_theta=500000.0, rope_scaling=scaling, rope_parameters=parameters),
    )
    found = _errors(twice, targets["llama3"])
    assert [f.code for f in found] == ["rope_twice"] and "transformers (and vLLM) read rope_scaling" in found[
        0
    ].message
    with pytest.raises(DrafterImportError, match="give different ropes"):
        read_drafter(twice, target=TargetConfig(model=str(targets["llama3"])))


def test_a_partial_rotary_factor_at_the_top_level_is_part_of_the_rope(targets, tmp_path):
    good = _export(targets["plain"], tmp_path)
    half = _edited(good, tmp_path, lambda c: {**c, "partial_rotary_factor": 0.5})
    assert [f.code for f in _errors(half, targets["plain"])] == ["rope"]
    whole = _edited(good, tmp_path, lambda c: {**c, "partial_rotary_factor": 1.0}, "whole")
    assert _errors(whole, targets["plain"]) == []


def test_a_consistent_drafter_of_two_aux_states_is_no_eagle1_head(targets, tmp_path):
    """fc [H, 2H] is also EAGLE-1's width; a folder with a draft vocabulary and an lm_head is EAGLE-3."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(targets["plain"])
    d = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [2, 5]))
    d.set_vocab(DraftVocab(ids=torch.arange(512) * 7, vocab_size=tc.vocab_size))
    two = export_drafter(d, tmp_path / "two")
    assert _errors(two, targets["plain"]) == []


@pytest.mark.parametrize(
    "edit, code, said",
    [
        (lambda c: {k: v for k, v in c.items() if k != "num_hidden_layers"}, "num_hidden_layers", "missing"),
        (lambda c: {**c, "num_hidden_layers": "1"}, "num_hidden_layers", "'1'"),
        (lambda c: {**c, "num_aux_hidden_states": True}, "num_aux_states", "True, not a whole number"),
        (lambda c: {**c, "num_aux_hidden_states": 3.0}, "num_aux_states", "3.0, not a whole number"),
        (
            lambda c: {**c, "eagle_config": {**c["eagle_config"], "use_aux_hidden_state": 0}},
            "use_aux_hidden_state",
            "is 0",
        ),
    ],
    ids=["layers_missing", "layers_string", "aux_bool", "aux_float", "use_aux_zero"],
)
def test_a_shape_field_missing_or_of_another_type_is_refused_saying_what_vllm_does(
    targets, tmp_path, edit, code, said
):
    bad = _edited(_export(targets["plain"], tmp_path), tmp_path, edit)
    found = {f.code: f.message for f in _errors(bad, targets["plain"])}
    assert code in found and said in found[code], found


def test_a_flag_written_only_inside_eagle_config_is_a_warning_and_an_import_note(targets, tmp_path):
    """vLLM reads norm_before_residual, fc_norm and norm_output at the top level only: written only inside
    eagle_config the drafter is served without them, which check and import say."""
    good = _export(targets["plain"], tmp_path)
    nested = _edited(
        good,
        tmp_path,
        lambda c: {
            **{k: v for k, v in c.items() if k != "norm_before_residual"},
            "eagle_config": {**c["eagle_config"], "norm_before_residual": True, "my_nested": 1},
        },
    )
    found = check_drafter(nested, TargetConfig(model=str(targets["plain"])))
    warned = [f for f in found if f.code == "nested_flag"]
    assert len(warned) == 1 and warned[0].severity == "warning" and "served without it" in warned[0].message
    notes = read_drafter(nested, target=TargetConfig(model=str(targets["plain"]))).notes
    assert any("eagle_config.norm_before_residual is true but no engine reads it" in n for n in notes)
    assert any("eagle_config.my_nested" in n and "eagle_config.norm_before_residual" in n for n in notes)
