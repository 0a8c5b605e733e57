"""Every target family (issue 6, point 1; C13–C17): tiny random Llama, Qwen3, Qwen3-MoE,
DeepSeek-V3, Kimi-K2.5 in both wrapper layouts and gpt-oss, built from config. The resolver finds
the parts through the wrappers; the captured aux states equal ``output_hidden_states`` at the
same HF indices; the teacher logits (final norm applied once) equal the model's own logits; one
TTT training step runs on each."""
import pytest
import torch

from eagle3kit.config import ConfigError, TargetConfig
from eagle3kit.target import (Target, capture_layer_inputs, resolve_aux_layer_ids, resolve_parts, target_features,
                              teacher_logits)
from tiny_targets import FAMILIES, build, unwrapped


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    m = build(request.param)
    return request.param, m, Target(model=m, tokenizer=None, parts=resolve_parts(m))


def test_c17_the_resolver_finds_every_part_through_the_wrappers(family):
    name, m, t = family
    u = unwrapped(m)
    inner = u.model
    assert t.parts.layers is inner.layers and len(t.parts.layers) == 8
    assert t.parts.embed is inner.embed_tokens and t.parts.final_norm is inner.norm and t.parts.lm_head is u.lm_head
    assert t.hidden_size == 64 and t.vocab_size == 97


def test_c13_c14_captured_aux_states_equal_output_hidden_states(family):
    name, m, t = family
    ids = torch.randint(3, 97, (2, 11))
    hs = unwrapped(m)(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hs) == 9 and torch.equal(hs[0], t.parts.embed(ids))                       # index 0 = the embedding
    a = resolve_aux_layer_ids(TargetConfig(aux_layer_ids=[1, 4, 6], aux_layer_convention="output_of_layer"), 8)
    assert a == resolve_aux_layer_ids(TargetConfig(aux_layer_ids=[2, 5, 7]), 8) == (2, 5, 7)
    aux, _ = target_features(t, ids, None, a)
    assert torch.allclose(aux, torch.cat([hs[2], hs[5], hs[7]], -1), atol=1e-6, rtol=0)
    with capture_layer_inputs(t.parts.layers, [3]) as store:                             # = what a layer hook sees
        unwrapped(m)(input_ids=ids)
    assert torch.allclose(store[3], hs[3], atol=1e-6, rtol=0)


def test_c15_teacher_logits_apply_the_final_norm_once(family):
    name, m, t = family
    ids = torch.randint(3, 97, (2, 9))
    _, last = target_features(t, ids, None, (2, 4, 5))
    ref = unwrapped(m)(input_ids=ids).logits
    assert torch.allclose(teacher_logits(t, last), ref, atol=1e-4)
    assert not torch.allclose(teacher_logits(t, t.parts.final_norm(last)), ref, atol=1e-4)   # twice would differ
    with pytest.raises(ConfigError, match="outside"):
        resolve_aux_layer_ids(TargetConfig(aux_layer_ids=[2, 4, 8]), 8)


def test_c16_a_shallow_target_with_the_default_layers_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"\[2, 2, 1\] collide \(id \[2\] repeated\)"):
        resolve_aux_layer_ids(TargetConfig(), 4)


def test_one_ttt_step_trains_on_every_family(family):
    from eagle3kit.train import Sample, build_drafter, compute_features, make_batch, ttt_loss
    from eagle3kit.vocab import DraftVocab

    name, m, t = family
    torch.manual_seed(0)
    samples = [Sample(torch.randint(3, 97, (12,)), torch.arange(12) >= 4) for _ in range(3)]
    compute_features(t, samples, (2, 4, 5), 4096, torch.device("cpu"), torch.device("cpu"))
    vocab = DraftVocab(ids=torch.arange(0, 97, 2), vocab_size=97)
    d = build_drafter(t, vocab, (2, 4, 5), seed=0)
    batch = make_batch(samples, [0, 1, 2], 3, torch.device("cpu"))
    loss, st = ttt_loss(d, t, batch, vocab.ids, 3, 0.8)
    loss.backward()
    assert torch.isfinite(loss) and loss > 0 and d.fc.weight.grad.abs().sum() > 0 and st["n"][0] > 0


# ---- issue 20: the families as they lie on disk (tests/family_targets.py) ----

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import family_targets  # noqa: E402

ON_DISK = family_targets.FAMILIES + ("deepseek_v3_default_rope",)


@pytest.fixture(scope="session")
def family_folders(tmp_path_factory, smollm2_tokenizer):
    """Every family's tiny target, saved once per session."""
    base = tmp_path_factory.mktemp("families")
    smollm2_tokenizer.save_pretrained(base / "smollm2-tokenizer")
    return {f: family_targets.build(f, base / f, base / "smollm2-tokenizer") for f in ON_DISK}


@pytest.mark.parametrize("family", ON_DISK)
def test_the_saved_config_mirrors_the_hub_config_key_for_key(family, family_folders):
    saved = json.loads((family_folders[family] / "config.json").read_text())
    hub_family = "kimi_k25" if family.startswith("kimi") else family.replace("_default_rope", "")
    if family == "kimi_k25_native":      # transformers' own save: its class and fields, rope in its own form
        assert saved["architectures"] == ["Kimi_K25ForConditionalGeneration"] and "media_placeholder_token_id" not in saved
        assert saved["text_config"]["rope_parameters"]["rope_type"] == "yarn" and "rope_scaling" not in saved["text_config"]
        return
    hub = family_targets.HUB[hub_family]
    text, hub_text = saved.get("text_config", saved), hub.get("text_config", hub)
    dropped = {"rope_scaling"} if family == "deepseek_v3_default_rope" else set()
    assert set(hub_text) - set(text) - dropped == set() and set(hub) - set(saved) - dropped == set()
    tiny = family_targets.TINY[hub_family]
    for k, v in hub_text.items():
        if k not in tiny and k in text and not (family.endswith("default_rope") and k == "rope_scaling"):
            assert text[k] == v, k
    if hub_family in ("deepseek_v3", "kimi_k25"):
        assert (text["topk_method"], text["scoring_func"]) == ("noaux_tc", "sigmoid") and text["n_group"] >= 1
        assert "routed_scaling_factor" in text and text["q_lora_rank"]
        if family != "deepseek_v3_default_rope":
            assert text["rope_scaling"]["type"] == "yarn" and text["rope_scaling"]["mscale_all_dim"] == 1.0
    if hub_family == "kimi_k25":
        assert saved["media_placeholder_token_id"] == 163605 and text["model_type"] == "kimi_k2"


@pytest.mark.parametrize("family", ON_DISK)
def test_load_target_loads_every_family_from_its_folder(family, family_folders):
    from eagle3kit.target import load_target

    t = load_target(TargetConfig(model=str(family_folders[family])), device="cpu")
    assert t.num_layers == 8 and t.hidden_size == 64
    assert t.vocab_size == json.loads((family_folders[family] / "config.json").read_text()).get("text_config", {}).get(
        "vocab_size", t.model.config.vocab_size)
    ids = torch.randint(3, 1000, (1, 9))
    _, last = target_features(t, ids, None, (2, 4, 5))
    assert torch.allclose(teacher_logits(t, last), t.model(input_ids=ids).logits, atol=1e-4)
    if family.startswith("kimi"):    # the language model alone, equal to transformers' whole Kimi-K2.5 class
        import transformers as T

        assert type(t.model).__name__ == "DeepseekV3ForCausalLM"
        assert t.source["language_model"]["decoder_prefix"] == "language_model.model."
        # (the hub config has no projection_hidden_size, so transformers' class sizes the projector at its 1152
        # default: a vision-side mismatch that does not touch the language model compared here)
        whole = T.Kimi_K25ForConditionalGeneration.from_pretrained(family_folders[family], dtype=torch.float32,
                                                                   ignore_mismatched_sizes=True).eval()
        assert torch.equal(whole(input_ids=ids).logits, t.model(input_ids=ids).logits)


def test_a_wrappers_vision_weights_never_enter_memory(family_folders, tmp_path):
    """A 1 GiB vision tensor beside Kimi-K2.5's weights: loading the target does not grow the
    process's peak memory by it (measured in a fresh process, with and without the tensor)."""
    from safetensors.torch import save_file

    big = tmp_path / "kimi_big"
    big.mkdir()
    for f in family_folders["kimi_k25"].iterdir():
        (big / f.name).symlink_to(f)
    save_file({"vision_tower.encoder.blocks.0.huge.weight": torch.ones(256, 1024, 1024)}, str(big / "model-vision.safetensors"))
    code = ("import resource, sys; from eagle3kit.config import TargetConfig; from eagle3kit.target import load_target; "
            "load_target(TargetConfig(model=sys.argv[1]), device='cpu'); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    peak = {name: int(subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True,
                                     check=True).stdout.split()[-1]) for name, d in (("plain", family_folders["kimi_k25"]),
                                                                                     ("big", big))}
    assert peak["big"] - peak["plain"] < (256 << 10), peak          # kB: far less than the tensor's 1 GiB


def test_a_wrapper_without_a_loadable_language_model_is_refused_naming_its_class(family_folders, tmp_path):
    from eagle3kit.target import load_target

    odd = tmp_path / "odd"
    odd.mkdir()
    for f in family_folders["kimi_k25"].iterdir():
        if f.name != "config.json":
            (odd / f.name).symlink_to(f)
    cfg = json.loads((family_folders["kimi_k25"] / "config.json").read_text())
    cfg["text_config"]["model_type"] = "clip_text_model"                 # a text model with no causal-LM class
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="KimiK25ForConditionalGeneration.*clip_text_model.*no causal-LM"):
        load_target(TargetConfig(model=str(odd)), device="cpu")
