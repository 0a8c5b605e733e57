"""The drafter variants (issue 24) without an engine: each variant's training forward equals its
step-by-step draft (C23 for every variant), the reference decoder drafts exactly what simulate
predicts for each, the LK objectives equal their formulas, the config presets and refusals, and
every variant exported in both layouts reads back to the same tensors and flags, in the fields
vLLM's own config reader takes.

The engine side (vLLM's CPU build serving each variant at evaluate's τ) is tests/test_variant_serving.py."""

from __future__ import annotations

import json

import pytest
import torch
from test_decoder import PROMPT, tiny_pair
from test_drafter import V, tiny_drafter, tiny_target

from eagle3kit.core.config import ConfigError, load_config
from eagle3kit.core.config_train import DrafterVariantConfig
from eagle3kit.train.batches import Sample, make_batch
from eagle3kit.train.ttt import ttt_loss

VARIANTS = {
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "eagle3.1": {"fc_norm": True, "norm_output": True, "norm_before_residual": True},
    "speculators_default": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
    "p-eagle": {"parallel_drafting": True, "mask_token_id": 5},
    "p-eagle_nbf": {"parallel_drafting": True, "mask_token_id": 5, "norm_before_fc": True},
}


def variant_drafter(flags: dict, vd: int = V, seed: int = 0, dtype=torch.float64):
    """:func:`test_drafter.tiny_drafter` rebuilt with ``flags``, every norm weight drawn from
    U(0.5, 1.5) (a trained norm is not the identity) and a random ``mask_hidden``."""
    from dataclasses import replace

    from eagle3kit.model.drafter import Eagle3Drafter

    base = tiny_drafter(vd, seed, dtype)
    d = Eagle3Drafter(replace(base.config, **flags)).to(dtype)
    d.load_state_dict(base.state_dict(), strict=False)
    torch.manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        if d.mask_hidden is not None:
            d.mask_hidden.normal_()
    return d


def reference_draft(d, aux, tokens, emb_table, T, S):
    """Per position t and step k, the pre-norm output of the cached one-token-at-a-time draft:
    chain (feed back :meth:`feedback` of the last output with the data token) or P-EAGLE (the mask
    slot's ``combine(mask_hidden)`` with the mask token), over a fresh cache per t."""
    out = torch.zeros(S, T, d.config.hidden_size, dtype=torch.float64)
    for t in range(T):
        cache = d.new_cache(1, T + S)
        h = d.step(
            d.combine(aux[:, : t + 1]), emb_table(tokens[1 : t + 2])[None], torch.arange(t + 1)[None], cache
        )
        out[0, t] = h[0, -1]
        h = h[:, -1:]
        for k in range(1, S):
            if d.config.parallel_drafting:
                hidden = d.combine(d.mask_hidden).reshape(1, 1, -1)
                tok = torch.tensor([d.config.mask_token_id])
            else:
                hidden, tok = d.feedback(h), tokens[t + k + 1 : t + k + 2]
            h = d.step(hidden, emb_table(tok)[None], torch.tensor([[t + k]]), cache)
            out[k, t] = h[0, 0]
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
@torch.no_grad()
def test_c23_every_variant_trains_the_function_it_drafts_with(name):
    """TTT's steps equal the cached draft for each variant, and turning the variant off changes
    the outputs (so each flag is live in both forwards)."""
    d = variant_drafter(VARIANTS[name])
    T, S = 9, 3
    torch.manual_seed(1)
    aux = torch.randn(1, T, 96, dtype=torch.float64)
    tokens = torch.randint(0, V, (T + S,))
    emb_table = torch.nn.Embedding(V, 32).to(torch.float64)
    ids = [tokens[k + 1 : k + 1 + T][None] for k in range(S)]  # x_{t+k+1} at t
    embeds = [emb_table(x) for x in d.step_tokens(ids)]
    outs = d.ttt_forward(aux, embeds, torch.arange(T)[None], None)
    ref = reference_draft(d, aux, tokens, emb_table, T, S)
    for k in range(S):
        assert torch.allclose(d.logits(outs[k][0]), d.logits(ref[k]), atol=1e-10), k
    plain = variant_drafter({})
    plain.load_state_dict({k: v for k, v in d.state_dict().items() if k in plain.state_dict()})
    p_outs = plain.ttt_forward(aux, [emb_table(x) for x in ids], torch.arange(T)[None], None)
    changed = [not torch.allclose(a, b) for a, b in zip(outs, p_outs)]
    # what each flag touches: the fc input and the residual at every step; the fed-back state (norm_output)
    # and the mask slots (P-EAGLE) from step 1 on
    assert changed == ([False] + [True] * (S - 1) if name in ("norm_output", "p-eagle") else [True] * S), (
        changed
    )


@pytest.mark.parametrize("name", ["eagle3", "norm_output", "eagle3.1", "p-eagle", "p-eagle_nbf"])
def test_the_reference_decoder_drafts_what_simulate_predicts_for_each_variant(name):
    """Greedy decoding with each variant is lossless and its verify steps accept exactly what
    simulate computes on the decoded continuation (a P-EAGLE drafter drafts 2..K in one call over
    its mask slots, a chain feeds back post-norm states under norm_output)."""
    from eagle3kit.core.config import SpecConfig
    from eagle3kit.eval.decoder import greedy_generate, speculative_generate
    from eagle3kit.eval.evaluate import simulate
    from eagle3kit.model.drafter import Eagle3Drafter

    target, base = tiny_pair(dtype=torch.float64)
    flags = {k: (1 if k == "mask_token_id" else v) for k, v in VARIANTS.get(name, {}).items()}
    from dataclasses import replace

    d = Eagle3Drafter(replace(base.config, **flags)).to(torch.float64)
    d.load_state_dict(base.state_dict(), strict=False)  # weights and the vocab maps (d2t, t2d)
    if d.mask_hidden is not None:
        with torch.no_grad():  # the slots' feature: the last aux state of the prompt, a plausible one
            d.mask_hidden.copy_(
                torch.randn(1, 1, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
            )
    d.eval()
    prompts = [PROMPT, [0, 0, 1], [6, 2, 2, 4, 1, 3, 5, 7, 0, 4]]
    for k in (3, 5):
        stats = None
        conts = []
        for p in prompts:
            res = speculative_generate(target, d, p, 40, SpecConfig(steps=k), eot_ids=[V + 1])
            assert res.tokens == greedy_generate(target, p, 40, eot_ids=[V + 1])  # lossless
            conts.append(res.tokens)
            stats = res.stats if stats is None else (stats.merge(res.stats) or stats)
        sim, _ = simulate(d, target, prompts, conts, k, torch.device("cpu"))
        assert (sim.drafts, sim.accepted) == (stats.drafts, stats.accepted), (name, k)
        assert sim.accepted > 0, (name, k)  # the check can fail: some drafts are accepted


def _lk_batch(seed=0, cached_lse=False):
    """Two sequences' batch; ``cached_lse``: with the normaliser the training stage caches
    (``compute_features(lse=True)``), else computed by the loss at every step."""
    from eagle3kit.model.target import target_features, teacher_argmax, teacher_top1_lse

    t = tiny_target()
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in (17, 23):
        ids = torch.randint(0, V, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3 :] = True
        aux, last = target_features(t, ids[None], None, (1, 2, 3))
        samples.append(Sample(ids, mask, aux[0], last[0], teacher_argmax(t, last[0])))
        if cached_lse:
            samples[-1].lse = teacher_top1_lse(t, last[0], where=mask)[1]
    return t, make_batch(samples, [0, 1], 3, "cpu")


def _hand_lk(d, t, b, draft_ids, kind, scale=1.0, decay=1.0):
    """The LK objectives written out from full softmaxes: per step, over the supervised positions,
    α = Σ_v min(p_full(v), q(v)); alpha: −mean log α; lambda: λ·CE + (1 − λ)(1 − ᾱ)."""
    from eagle3kit.train.ttt import shift

    emb = [t.parts.embed(x) for x in b["tok"]]
    outs = d.ttt_forward(b["aux"], emb, b["positions"], b["key_mask"])
    total = 0.0
    for k, out in enumerate(outs):
        sup = b["sup"][k] & d.t2d[shift(b["argmax"], k + 1)]
        last = shift(b["last"], k + 1)[sup]
        z_full = last @ t.parts.lm_head.weight.T
        p_full = torch.softmax(z_full, -1)[:, draft_ids]
        p_draft = torch.softmax(z_full[:, draft_ids], -1)
        q = torch.softmax(d.logits(out[sup]), -1)
        alpha = torch.minimum(p_full, q).sum(-1)
        ce = -(p_draft * q.log()).sum(-1).mean()
        if kind == "lk_alpha":
            obj = -alpha.log().mean()
        else:
            lam = scale * torch.exp(-decay * alpha.mean().detach())
            obj = lam * ce + (1 - lam) * (1 - alpha.mean())
        total = total + 0.8**k * obj
    return total


@pytest.mark.parametrize("kind", ["lk_alpha", "lk_lambda"])
def test_lk_objectives_equal_their_formulas_chunked_or_not(kind):
    t, b = _lk_batch()
    d = tiny_drafter(vd=48)
    draft_ids = d.d2t + torch.arange(48)
    want = _hand_lk(d, t, b, draft_ids, kind, 0.7, 2.0)
    grads = []
    for chunk in (0, 5):
        d.zero_grad()
        loss, st = ttt_loss(
            d, t, b, draft_ids, 3, 0.8, loss=kind, lk_kl_scale=0.7, lk_kl_decay=2.0, loss_chunk=chunk
        )
        # the loss is taken in float32 (log-softmax and teacher in fp32), the formula here in float64
        assert torch.allclose(loss.double(), want, rtol=1e-5, atol=1e-6), (chunk, float(loss), float(want))
        loss.backward()
        grads.append(d.fc.weight.grad.clone())
        assert len(st["alpha"]) == 3 and all(0 < a < 1 for a in st["alpha"])
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7) and grads[0].abs().sum() > 0
    kl, _ = ttt_loss(d, t, b, draft_ids, 3, 0.8)
    assert not torch.allclose(kl.double(), want, rtol=1e-2)  # a different objective than forward KL
    _, cached = _lk_batch(cached_lse=True)
    assert "lse" in cached and "lse" not in b
    again, _ = ttt_loss(d, t, cached, draft_ids, 3, 0.8, loss=kind, lk_kl_scale=0.7, lk_kl_decay=2.0)
    assert torch.allclose(again.double(), want, rtol=1e-5, atol=1e-6)  # the cached normaliser is the same


def test_lk_needs_the_full_vocabulary_and_an_unknown_loss_is_refused():
    t, b = _lk_batch()
    d = tiny_drafter(vd=48)
    ids = d.d2t + torch.arange(48)
    top = dict(b)
    top["topk_ids"] = top["topk_values"] = top["top1_in_draft"] = b["argmax"]
    with pytest.raises(ValueError, match="top-K teacher"):
        ttt_loss(d, t, top, ids, 3, 0.8, loss="lk_alpha")
    with pytest.raises(ValueError, match="not one of"):
        ttt_loss(d, t, b, ids, 3, 0.8, loss="reverse_kl")


def test_drafter_presets_explicit_flags_and_refusals(tmp_path):
    assert DrafterVariantConfig(variant="eagle3.1").flags() == {
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": True,
        "norm_output": True,
        "parallel_drafting": False,
    }
    assert DrafterVariantConfig(
        variant="eagle3.1", norm_before_residual=True
    ).norm_before_residual  # added to it

    class Tok:
        mask_token_id, pad_token_id, unk_token_id = None, 7, 3

    assert DrafterVariantConfig(variant="p-eagle").flags(Tok(), 100)["mask_token_id"] == 7
    assert DrafterVariantConfig(variant="p-eagle", mask_token_id=9).flags(Tok(), 100)["mask_token_id"] == 9
    with pytest.raises(ConfigError, match="outside the target's vocabulary of 100"):
        DrafterVariantConfig(variant="p-eagle", mask_token_id=100).flags(Tok(), 100)
    for bad, words in (
        ("drafter: {norm_before_fc: true, fc_norm: true}", "are exclusive"),
        ("drafter: {variant: p-eagle, norm_output: true}", "no effect with drafter.parallel_drafting"),
        ("drafter: {mask_token_id: 3}", "only with drafter.parallel_drafting"),
        ("drafter: {variant: eagle4}", "drafter.variant"),
        ("train: {loss: lk}", "train.loss"),
    ):
        (tmp_path / "c.yaml").write_text(bad + "\n")
        with pytest.raises(ConfigError, match=words):
            load_config(tmp_path / "c.yaml")


@pytest.mark.parametrize("name", ["eagle3.1", "speculators_default", "p-eagle_nbf"])
def test_every_variant_round_trips_through_both_layouts_in_the_fields_vllm_reads(name, tmp_path):
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    from eagle3kit.model.folder import export_drafter
    from eagle3kit.model.folder_read import read_drafter

    d = variant_drafter(VARIANTS[name], vd=48, dtype=torch.float32)  # draft ids 0, 2, 4, … (offsets ≠ 0)
    flags = d.config.variant()
    for fmt in ("dual", "speculators"):
        verifier = {"name_or_path": "/models/t", "architectures": ["LlamaForCausalLM"]}
        out = export_drafter(d, tmp_path / fmt, fmt=fmt, verifier=verifier if fmt == "speculators" else None)
        back = read_drafter(out).drafter
        assert back.config.variant() == flags, fmt
        assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items()), fmt
        cfg = json.loads((out / "config.json").read_text())
        if fmt == "dual":  # what vLLM's llama_eagle3.py getattr()s from the drafter's config
            for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
                assert cfg.get(k, False) == d.config.to_dict()[k], k
            if d.config.parallel_drafting:
                assert cfg["mask_token_id"] == 5 and cfg["parallel_drafting"] is True
        else:  # what vLLM's speculators reader makes of it
            pre = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(cfg)))
            assert pre["norm_before_residual"] == d.config.norm_before_residual
            assert pre["norm_before_fc"] == d.config.norm_before_fc
            if d.config.parallel_drafting:
                assert pre["architectures"] == ["PeagleLlamaForCausalLM"] and pre["pard_token"] == 5
            else:
                assert (pre["fc_norm"], pre["norm_output"]) == (d.config.fc_norm, d.config.norm_output)


def test_a_p_eagle_drafter_with_fc_norm_is_not_written_where_vllm_would_drop_it(tmp_path):
    from eagle3kit.model.contract import ExportError
    from eagle3kit.model.folder import export_drafter

    d = variant_drafter({"parallel_drafting": True, "mask_token_id": 5, "fc_norm": True}, vd=48)
    with pytest.raises(ExportError, match="ignores fc_norm"):
        export_drafter(
            d, tmp_path / "s", fmt="speculators", verifier={"name_or_path": "t", "architectures": ["X"]}
        )
    assert export_drafter(d, tmp_path / "d").is_dir()  # the dual layout carries it


def test_a_run_made_before_the_variants_resumes_and_a_variant_is_another_training():
    """The settings hash of a plain EAGLE-3 config (``variant: eagle3``, or a section naming no flag)
    with the optimizer and batching of then (betas (0.9, 0.95), ``shuffle: batches``) is the one
    every run made before the drafter section, train.loss and train.shuffle existed recorded
    (computed at da828d9), so its checkpoints resume; the default (EAGLE-3.1 since issue 24, the
    new betas and batch mixing), a variant, other betas, mixed batches or an LK loss change it, so
    their checkpoints are never resumed by another training."""
    from eagle3kit.core.config import Config
    from eagle3kit.core.rundir import sha256_json
    from eagle3kit.train.samples import trained_settings

    old = "1d35fde9481f511c7d6febd542b3d3fa62158e806065c462334aac016a00c639"
    then = {"betas": [0.9, 0.95], "shuffle": "batches"}
    for plain in ({"variant": "eagle3"}, {}, {"variant": None}):
        assert sha256_json(trained_settings(Config.model_validate({"drafter": plain, "train": then}))) == old
    for changed in ({"betas": [0.9, 0.999]}, {"shuffle": "samples"}):
        cfg = Config.model_validate({"drafter": {"variant": "eagle3"}, "train": {**then, **changed}})
        assert sha256_json(trained_settings(cfg)) != old
    default = trained_settings(Config())
    assert sha256_json(default) != old
    assert default["betas"] == [0.9, 0.999] and default["shuffle"] == "samples"
    assert default["drafter"]["variant"] == "eagle3.1" and default["drafter"]["fc_norm"] is True
    other = Config.model_validate({"drafter": {"variant": "p-eagle"}})
    assert trained_settings(other)["drafter"]["parallel_drafting"] is True
    assert trained_settings(Config.model_validate({"train": {"loss": "lk_alpha"}}))["loss"] == "lk_alpha"


def test_a_p_eagle_drafter_gives_every_parameter_a_gradient_when_no_mask_slot_is_supervised():
    """DistributedDataParallel needs a gradient for every parameter on every process: a batch whose
    mask slots (steps ≥ 1) supervise nothing still reaches ``mask_hidden`` (with zero)."""
    t, b = _lk_batch()
    d = variant_drafter(VARIANTS["p-eagle"], vd=48)
    b = dict(b)
    b["sup"] = [b["sup"][0]] + [torch.zeros_like(x) for x in b["sup"][1:]]
    loss, st = ttt_loss(d, t, b, d.d2t + torch.arange(48), 3, 0.8)
    loss.backward()
    assert st["n"][1:] == [0, 0] and st["n"][0] > 0
    assert d.mask_hidden.grad is not None and not d.mask_hidden.grad.any()
    assert all(p.grad is not None for p in d.parameters())


def _edited(src, out, config=None, tensors=None):
    """A copy of the drafter folder ``src`` with its config and tensors edited."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    t = load_file(str(src / "model.safetensors"))
    c = json.loads((src / "config.json").read_text())
    save_file(tensors(t) if tensors else t, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config(c) if config else c))
    return out


@pytest.fixture(scope="module")
def variant_folders(tiny_target_dir, tmp_path_factory):
    """Dual and speculators exports of a P-EAGLE and of a norm_before_fc drafter for the tiny target."""
    from transformers import AutoConfig

    from eagle3kit.model.draft_vocab import DraftVocab
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.model.folder import export_drafter

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    tmp = tmp_path_factory.mktemp("variant-folders")
    out = {}
    for name, flags in (
        ("pe", {"parallel_drafting": True, "mask_token_id": 5}),
        ("nbf", {"norm_before_fc": True}),
    ):
        d = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [2, 4, 5], **flags))
        d.set_vocab(DraftVocab(ids=torch.arange(512) * 7 + 3, vocab_size=tc.vocab_size))
        out[name] = export_drafter(d, tmp / name)
        verifier = {"name_or_path": str(tiny_target_dir), "architectures": ["LlamaForCausalLM"]}
        out[name + "_spec"] = export_drafter(d, tmp / f"{name}_spec", fmt="speculators", verifier=verifier)
    return out


def _moved_into_layer(key):
    def edit(c):
        c = dict(c)
        c["transformer_layer_config"] = {**c["transformer_layer_config"], key: c.pop(key)}
        return c

    return edit


@pytest.mark.parametrize(
    "name,src,config,tensors,words",
    [
        (
            "mask token past the vocabulary",
            "pe",
            lambda c: {**c, "mask_token_id": 49152},
            None,
            "not a token",
        ),
        (
            "parallel_drafting false beside mask_hidden",
            "pe",
            lambda c: {**c, "parallel_drafting": False},
            None,
            "parallel_drafting: false",
        ),
        # speculators: vLLM reads the flags from the top level only (its update_eagle3 / update_peagle)
        (
            "norm_before_fc only in the layer config",
            "nbf_spec",
            _moved_into_layer("norm_before_fc"),
            None,
            "unexpected ['input_norm.weight']",
        ),
        (
            "a peagle config without a top-level mask_token_id",
            "pe_spec",
            _moved_into_layer("mask_token_id"),
            None,
            "without a top-level mask_token_id",
        ),
        ("a flag that is not true/false", "nbf", lambda c: {**c, "fc_norm": "no"}, None, "fc_norm"),
    ],
)
def test_variant_folders_are_read_as_vllm_reads_them_and_refused_where_it_would_serve_another_network(
    variant_folders, tiny_target_dir, tmp_path, name, src, config, tensors, words
):
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.contract import DrafterImportError
    from eagle3kit.model.folder_read import read_drafter
    from eagle3kit.serve.check import check_drafter

    bad = _edited(variant_folders[src], tmp_path / "bad", config, tensors)
    target = TargetConfig(model=str(tiny_target_dir))
    with pytest.raises(DrafterImportError) as e:
        read_drafter(bad, target=target)
    assert words in str(e.value), str(e.value)
    assert [f for f in check_drafter(bad, target) if f.severity == "error"], name  # never "servable"


def test_what_vllm_reads_of_a_variant_folder_is_what_eagle3kit_builds(
    variant_folders, tiny_target_dir, tmp_path
):
    """A speculators eagle3 config's norm_before_residual inside its layer config is not read (vLLM's
    default true wins); a mask_hidden of any shape with 3·Ht values is read as vLLM views it; a folder
    holding mask_hidden is launched with parallel drafting even without the field; SGLang gets no
    P-EAGLE launch; P-EAGLE refuses tree drafting before the target is loaded."""
    from eagle3kit.core.config import Config, ConfigError, TargetConfig
    from eagle3kit.core.engines import eagle3_speculative_config
    from eagle3kit.eval.evaluate import _checked_drafter
    from eagle3kit.model.folder_read import read_drafter
    from eagle3kit.serve.check import check_drafter

    target = TargetConfig(model=str(tiny_target_dir))
    layer_only = _edited(
        variant_folders["nbf_spec"], tmp_path / "nbr", _moved_into_layer("norm_before_residual")
    )
    assert read_drafter(layer_only, target=target).drafter.config.norm_before_residual is True
    flat = _edited(
        variant_folders["pe"],
        tmp_path / "flat",
        lambda c: {k: v for k, v in c.items() if k != "parallel_drafting"},
        lambda t: {**t, "mask_hidden": t["mask_hidden"].reshape(-1)},
    )
    assert not [f for f in check_drafter(flat, target) if f.severity == "error"]
    assert read_drafter(flat, target=target).drafter.mask_hidden.shape == (1, 1, 192)
    assert eagle3_speculative_config(flat, 3)["parallel_drafting"] is True
    assert "parallel_drafting" not in eagle3_speculative_config(variant_folders["nbf"], 3)
    sglang = [
        f.code for f in check_drafter(variant_folders["pe"], target, engine="sglang") if f.severity == "error"
    ]
    assert "engine_support" in sglang
    with pytest.raises(ConfigError, match="drafts a chain"):  # the target (SmolLM2's GGUF) is never loaded
        _checked_drafter(Config(), None, None, str(variant_folders["pe"]), torch.device("cpu"), tree=True)


def test_the_config_refuses_what_would_train_another_drafter_than_it_says():
    from eagle3kit.core.config import Config

    for bad, words in (
        ({"drafter": {"variant": "p-eagle", "parallel_drafting": False}}, "contradicts the preset"),
        ({"drafter": {"variant": "eagle3", "fc_norm": True}}, "plain drafter"),
        ({"drafter": {"variant": "eagle3.1", "norm_before_fc": True}}, "variant eagle3.1 sets fc_norm"),
        ({"drafter": {"norm_output": "yes"}}, "norm_output"),
        ({"drafter": {"variant": "p-eagle", "mask_token_id": "5"}}, "mask_token_id"),
        ({"drafter": {"variant": "p-eagle"}, "train": {"ttt_steps": 1}}, "train.ttt_steps ≥ 2"),
        ({"train": {"lk_kl_decay": 2.0}}, "only with train.loss: lk_lambda"),
    ):
        with pytest.raises(ValueError, match=words):
            Config.model_validate(bad)


def test_init_from_another_variant_names_settings_the_config_takes(variant_folders, tiny_target_dir):
    from transformers import AutoConfig

    from eagle3kit.core.config import ConfigError, TargetConfig
    from eagle3kit.core.config_train import DrafterVariantConfig
    from eagle3kit.model.draft_vocab import DraftVocab
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.train.checkpoints import init_from_drafter

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    run = Eagle3Drafter(
        DrafterConfig.from_target(tc, 512, [2, 4, 5], parallel_drafting=True, mask_token_id=5)
    )
    run.set_vocab(DraftVocab(ids=torch.arange(512) * 7 + 3, vocab_size=tc.vocab_size))
    with pytest.raises(ConfigError) as e:
        init_from_drafter(run, variant_folders["nbf"], TargetConfig(model=str(tiny_target_dir)))
    advice = str(e.value).split("drafter section: ")[1]
    assert advice == "norm_before_fc: true, parallel_drafting: false (and no mask_token_id)"
    DrafterVariantConfig(norm_before_fc=True, parallel_drafting=False)  # the advice is a valid section


@pytest.mark.parametrize(
    "edit, code",
    [
        (lambda c: {k: v for k, v in c.items() if k != "norm_output"}, "variant_mismatch"),
        (lambda c: {**c, "norm_before_residual": True}, "variant_mismatch"),
        (None, "non_finite"),
    ],
)
def test_check_refuses_an_export_whose_flags_or_weights_were_edited_after_export(
    tiny_target_dir, tmp_path, edit, code
):
    """An EAGLE-3.1 export records the variant it was trained as; flags edited by hand (a flag
    dropped, another added) would serve another network, and a NaN weight would be loaded as is."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.contract import ExportError
    from eagle3kit.model.draft_vocab import DraftVocab
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.model.folder import export_drafter
    from eagle3kit.serve.check import check_drafter

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    d = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [2, 4, 5], fc_norm=True, norm_output=True))
    d.set_vocab(DraftVocab(ids=torch.arange(512) * 7 + 3, vocab_size=tc.vocab_size))
    folder = export_drafter(d, tmp_path / "d")
    target = TargetConfig(model=str(tiny_target_dir))
    assert not [f for f in check_drafter(folder, target) if f.severity == "error"]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["eagle3kit"]["drafter_variant"] == {"fc_norm": True, "norm_output": True}
    if edit is not None:
        (folder / "config.json").write_text(json.dumps(edit(cfg)))
    else:
        t = load_file(str(folder / "model.safetensors"))
        t["fc.weight"][0, 0] = float("nan")
        save_file(t, str(folder / "model.safetensors"))
        with pytest.raises(ExportError, match="fc.weight holds non-finite values"):
            d.fc.weight.data[0, 0] = float("nan")
            export_drafter(d, tmp_path / "nan")
    found = [f for f in check_drafter(folder, target) if f.severity == "error"]
    assert code in {f.code for f in found}, found
    if code == "variant_mismatch":
        assert "as eagle3.1" in next(f.message for f in found if f.code == code)


def test_the_mask_token_is_a_reserved_token_the_data_never_uses_and_a_used_one_is_refused(
    smollm2_tokenizer, capsys
):
    """SmolLM2's pad id 2 is <|im_end|>, supervised in every conversation: the mask slots must not read as
    it. Unset, the mask token is a reserved token, as published DFlash drafters take: the first special or
    added token the training data never uses that is not the end, begin, padding or unknown token
    (<repo_name>, id 3, not the "!" (17) the target writes); only when every such token occurs, the smallest
    ordinary id the data never uses, said on the console. A configured one that occurs is refused."""
    import pytest
    import torch

    from eagle3kit.core.config import ConfigError
    from eagle3kit.core.config_train import DrafterVariantConfig
    from eagle3kit.train.batches import Sample
    from eagle3kit.train.samples import mask_token

    tok = smollm2_tokenizer
    reserved = sorted(int(i) for i in tok.added_tokens_decoder)  # 0 … 16
    used = sorted(set(tok.all_special_ids) | {17, 18, 20, 300})  # end, begin, pad occur, and some text
    samples = [Sample(torch.tensor(used), torch.ones(len(used), dtype=torch.bool))]
    picked = mask_token(samples, tok, 49152, None)
    assert picked == 3 and tok.convert_ids_to_tokens(picked) == "<repo_name>"
    assert mask_token(samples, tok, 49152, None, ends=[3]) == 4  # never a token the target ends a turn with
    assert DrafterVariantConfig(variant="p-eagle").flags(tok, 49152, picked)["mask_token_id"] == 3
    all_used = sorted(set(used) | set(reserved))
    samples = [Sample(torch.tensor(all_used), torch.ones(len(all_used), dtype=torch.bool))]
    capsys.readouterr()
    assert mask_token(samples, tok, 49152, None) == 19
    said = " ".join(capsys.readouterr().err.split())
    assert "mask token: 19" in said and "the target may still write it" in said
    with pytest.raises(ConfigError, match=r"mask_token_id 2 \('<\|im_end\|>'\) occurs 1 times"):
        mask_token(samples, tok, 49152, 2)
    assert mask_token(samples, tok, 49152, 21) == 21
