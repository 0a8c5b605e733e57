"""The DSpark drafter kind: its network holds the tensors vLLM's Qwen3 DSpark model loads, its loss learns
and applies the Markov bias from the true token before each draft, its confidence part follows
whether the drafts agree with the data, its block drafting applies the Markov bias left to right from
the token just drafted (as vLLM's speculator samples), its folder reads back bit-exact, ``check`` passes
a good folder with only the GPU-only warning and names what is wrong in a bad one, and the registry
finds the kind by name, folder and checkpoint.

A tiny random Qwen3-like target: config from transformers' ``Qwen3Config``, its embedding and lm_head
as plain modules (what the drafter reads of a target)."""

import json
import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from eagle3kit.core.config import ConfigError, TargetConfig
from eagle3kit.core.kinds import KINDS, kind_for_checkpoint, kind_for_folder, kind_for_variant, kind_named
from eagle3kit.drafters.dflash.objective import pick_anchors
from eagle3kit.drafters.dspark.folder import (
    read_dspark,
    vllm_aux_ids,
    write_dspark,
)
from eagle3kit.drafters.dspark.network import DSparkConfig, DSparkDrafter
from eagle3kit.drafters.dspark.objective import (
    block_hidden,
    dspark_block_drafts,
    dspark_block_stats,
    dspark_loss,
    markov_decode,
)
from eagle3kit.model.contract import ExportError
from eagle3kit.model.target import teacher_logits
from eagle3kit.serve.check import check_drafter

V, H, BLOCK, MASK, RANK, LAYERS = 96, 64, 4, 5, 8, 8

# What vLLM 0.32's model_executor/models/qwen3_dspark.py (Qwen3DSparkModel: DSparkMarkovHead,
# DSparkConfidenceHead) and qwen3_dflash.py (DFlashQwen3Model, its backbone) load from a folder, by
# name, for this drafter: hidden 64, 4 heads of 16, 2 KV heads, MLP 128, 2 layers, 3 target layers
# (fc input 3 · 64), vocabulary 96 (draft vocabulary the same: no d2t, no lm_head), Markov rank 8,
# confidence head with the Markov embedding (input 64 + 8, with bias). load_weights prefixes "model."
# to every name but lm_head, so the folder's names carry no prefix.
_LAYER = {
    "input_layernorm.weight": (64,),
    "post_attention_layernorm.weight": (64,),
    "self_attn.q_proj.weight": (64, 64),
    "self_attn.k_proj.weight": (32, 64),
    "self_attn.v_proj.weight": (32, 64),
    "self_attn.o_proj.weight": (64, 64),
    "self_attn.q_norm.weight": (16,),
    "self_attn.k_norm.weight": (16,),
    "mlp.gate_proj.weight": (128, 64),
    "mlp.up_proj.weight": (128, 64),
    "mlp.down_proj.weight": (64, 128),
}
VLLM_TENSORS = {
    "fc.weight": (64, 192),
    "hidden_norm.weight": (64,),
    "norm.weight": (64,),
    **{f"layers.{i}.{k}": s for i in range(2) for k, s in _LAYER.items()},
    "markov_head.markov_w1.weight": (96, 8),
    "markov_head.markov_w2.weight": (96, 8),
    "confidence_head.proj.weight": (1, 72),
    "confidence_head.proj.bias": (1,),
}


def _target_config(vocab_size=V):
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab_size,
        max_position_embeddings=512,
    )


def _drafter(seed=0, scale=None, **kw) -> DSparkDrafter:
    torch.manual_seed(seed)
    cfg = DSparkConfig.from_target(
        _target_config(),
        MASK,
        num_layers=2,
        block_size=BLOCK,
        target_layer_ids=[1, 3, 5],
        **{"markov_rank": RANK, **kw},
    )
    d = DSparkDrafter(cfg)
    g = torch.Generator().manual_seed(seed + 100)
    for name, p in d.named_parameters():
        if p.dim() == 1 and "norm" in name:  # norms away from 1, so a norm read in the wrong place shows
            p.data = 1 + 0.2 * torch.randn(p.shape, generator=g)
        elif scale is not None and name.startswith(("fc", "layers")):
            p.data = scale * torch.randn(p.shape, generator=g)
    return d.float()


def _target(seed=0, head_std=None):
    g = torch.Generator().manual_seed(seed)
    embed, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    embed.weight.data = torch.randn(V, H, generator=g)
    if head_std is not None:
        head.weight.data = head_std * torch.randn(V, H, generator=g)
    return types.SimpleNamespace(parts=types.SimpleNamespace(embed=embed, lm_head=head))


def _successor_head(d: DSparkDrafter, strength: float = 30.0, only_even: bool = False) -> None:
    """A Markov head (rank = V) whose bias after token t is ``strength`` on t + 1 (mod V), for every t or
    for the even ones only: it decides the draft whenever the base logits are small."""
    assert d.cfg.markov_rank == V
    d.markov_head.markov_w1.weight.data = torch.eye(V)
    w2 = torch.zeros(V, V)
    for t in range(0, V, 2 if only_even else 1):
        w2[(t + 1) % V, t] = strength
    d.markov_head.markov_w2.weight.data = w2


def _batch(ids: torch.Tensor, first: int, seed=0) -> dict:
    T = ids.numel()
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, first:] = True
    aux = torch.randn(1, T, 3 * H, generator=torch.Generator().manual_seed(seed))
    return {"ids": ids[None], "mask": mask, "valid": torch.ones(1, T, dtype=torch.bool), "aux": aux}


def _no_successor_ids(T: int, seed=0) -> torch.Tensor:
    """Random ids in which no token is its predecessor + 1 and none is the mask token."""
    g = torch.Generator().manual_seed(seed)
    ids = [7]
    while len(ids) < T:
        t = int(torch.randint(6, V, (1,), generator=g))
        if t != (ids[-1] + 1) % V:
            ids.append(t)
    return torch.tensor(ids)


def _all_anchors(batch):
    return pick_anchors(batch["mask"], [batch["ids"].shape[1]], BLOCK, 10**6, torch.Generator())


def test_the_drafter_holds_the_tensors_vllm_loads_and_drafts_a_block_per_anchor():
    d = _drafter()
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items() if not k.startswith("rotary.")}
    assert shapes == VLLM_TENSORS
    assert d.cfg.aux_layer_ids == [2, 4, 6] and d.cfg.drafts_per_block == BLOCK  # anchor-as-first
    assert (
        DSparkDrafter(DSparkConfig(**{**d.cfg.to_dict(), "sample_from_anchor": False})).cfg.drafts_per_block
        == 3
    )
    T, first = 20, 6
    ids = _no_successor_ids(T)
    hidden = block_hidden(d, _target(), _batch(ids, first)["aux"][0], ids, first, BLOCK)
    assert hidden.shape == (T - 1 - first, BLOCK, H)
    with torch.no_grad():
        conf = d.confidence(hidden, ids[first : T - 1, None].expand(-1, BLOCK))
    assert conf.shape == (T - 1 - first, BLOCK) and conf.dtype == torch.float32
    assert 0 < float(conf.min()) and float(conf.max()) < 1
    with pytest.raises(ValueError, match="1 … 4"):
        block_hidden(d, _target(), _batch(ids, first)["aux"][0], ids, first, BLOCK + 1)


@pytest.mark.parametrize("sample_from_anchor", [True, False])
@torch.no_grad()
def test_each_block_is_the_query_vllms_speculator_builds(sample_from_anchor):
    """vLLM's DSpark speculator queries ``[anchor, MASK × (N − 1)]`` anchor-as-first (every slot drafts the
    next token), ``[anchor, MASK × N]`` in the fill-in layout (slots 1 … N draft), reading the target
    states before the anchor (``_prepare_dflash_inputs_kernel``): all blocks drafted at once equal that
    query run alone."""
    d, target = _drafter(scale=0.3, sample_from_anchor=sample_from_anchor), _target()
    T, first, k = 24, 5, 3
    ids = _no_successor_ids(T, seed=7)
    aux = _batch(ids, first, seed=7)["aux"][0]
    every = block_hidden(d, target, aux, ids, first, k)
    ctx = d.context(aux[None])
    for p in range(first, T - 1):
        query = [int(ids[p])] + [MASK] * (k - 1 if sample_from_anchor else k)
        n = len(query)
        embeds = target.parts.embed(torch.tensor([query]))
        mask = torch.ones(1, 1, n, p + n, dtype=torch.bool)
        alone = d(ctx[:, :p], torch.arange(p)[None], embeds, torch.arange(p, p + n)[None], mask)[0, n - k :]
        assert torch.allclose(every[p - first], alone, atol=1e-5), p
    assert (every[0] - every[1]).abs().max() > 1e-2  # the blocks differ


def test_the_loss_is_finite_and_falls_over_twenty_steps():
    d, target = _drafter(), _target()
    ids = _no_successor_ids(32, seed=3)
    batch = _batch(ids, 8, seed=3)
    anchors = _all_anchors(batch)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss, st = dspark_loss(d, target, batch, anchors, gamma=2.0)
        assert torch.isfinite(loss)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"DSpark loss {losses[0]:.3f} → {losses[-1]:.3f}")
    assert losses[-1] < 0.7 * losses[0]
    assert set(st) == {
        "n",
        "correct",
        "count",
        "accepted",
        "blocks",
        "block_loss",
        "confidence_loss",
        "weight",
    }
    # anchors 7 … 30 (mask[p + 1]); draft j of anchor p is the token at p + j, in the sequence up to 31
    assert st["count"] == [24, 23, 22, 21] and st["blocks"] == 24 and st["n"] == 90
    assert abs(st["block_loss"] + st["confidence_loss"] - float(loss.detach())) < 1e-4
    assert d.markov_head.markov_w2.weight.abs().sum() > 0  # the Markov head trained (it starts at zero)


def test_a_batch_without_a_supervised_draft_still_gives_every_head_a_gradient():
    """Under DDP every process must produce a gradient for every parameter in every step: a batch whose
    anchors supervise nothing (no anchor at all) still puts the confidence head in the graph (zero loss)."""
    d, target = _drafter(), _target()
    batch = _batch(_no_successor_ids(16, seed=1), 8, seed=1)
    anchors = torch.full((1, 1), -1, dtype=torch.long)  # no block at all
    loss, st = dspark_loss(d, target, batch, anchors, gamma=2.0)
    loss.backward()
    assert st["n"] == 0 and float(loss.detach()) == 0.0
    grads = {n: p.grad for n, p in d.named_parameters()}
    assert (
        grads["confidence_head.proj.weight"] is not None and grads["markov_head.markov_w2.weight"] is not None
    )
    assert float(grads["confidence_head.proj.weight"].abs().sum()) == 0.0


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_the_loss_applies_the_markov_bias_of_the_true_previous_token(sample_from_anchor):
    """With a head that drafts ``prev + 1`` and small base logits, a counting sequence (each token its
    predecessor + 1) is drafted right at every supervised slot only if the bias of draft ``q`` is the
    head's bias of the true token at ``q − 1``; the confidence loss is low exactly there."""
    d = _drafter(markov_rank=V, sample_from_anchor=sample_from_anchor)
    _successor_head(d)
    d.confidence_head.proj.weight.data.zero_()
    d.confidence_head.proj.bias.data.fill_(4.0)  # the head says "accepted" (p ≈ 0.982) everywhere
    target = _target(head_std=0.02)
    counting = (torch.arange(30) + 11) % V
    loss_c, st_c = dspark_loss(d, target, _batch(counting, 6), _all_anchors(_batch(counting, 6)), 2.0)
    other = _no_successor_ids(30)
    loss_o, st_o = dspark_loss(d, target, _batch(other, 6), _all_anchors(_batch(other, 6)), 2.0)
    assert st_c["correct"] == st_c["count"] and sum(st_c["count"]) > 50
    # anchors 5 … 28; draft j (1 … 4 anchor-as-first, 1 … 3 fill-in) is the token at p + j ≤ 29
    assert st_c["count"] == [24, 23, 22, 21][: BLOCK if sample_from_anchor else BLOCK - 1]
    assert sum(st_o["correct"]) == 0
    assert st_c["accepted"] == sum(st_c["count"])  # every run of correct drafts runs to the block's end
    assert st_c["block_loss"] < 1e-3 < st_o["block_loss"]
    assert st_c["confidence_loss"] == pytest.approx(0.01815, abs=1e-4)  # softplus(−4): agreement
    assert st_o["confidence_loss"] == pytest.approx(4.01815, abs=1e-4)  # softplus(4): disagreement


def test_block_drafting_applies_the_markov_bias_left_to_right_from_the_drafted_token():
    """Bias ``prev + 1`` after an even token only: draft i is ``prev + 1`` when the token before it —
    the anchor, then the draft just made — is even, else the argmax of the base logits alone."""
    d = _drafter(markov_rank=V, scale=0.3)
    _successor_head(d, only_even=True)
    target = _target(seed=2, head_std=0.3)
    T, first = 40, 5
    ids = _no_successor_ids(T, seed=5)
    aux = _batch(ids, first, seed=5)["aux"][0]
    drafts = dspark_block_drafts(d, target, aux, ids, first, BLOCK)
    base = teacher_logits(target, block_hidden(d, target, aux, ids, first, BLOCK)).argmax(-1)

    def chain(prevs_from_drafts: bool):
        rows = []
        for r, p in enumerate(range(first, T - 1)):
            prev, row = int(ids[p]), []
            for i in range(BLOCK):
                tok = (prev + 1) % V if prev % 2 == 0 else int(base[r, i])
                row.append(tok)
                prev = tok if prevs_from_drafts else int(ids[min(p + 1 + i, T - 1)])
            rows.append(row)
        return rows

    assert drafts.tolist() == chain(True)
    assert chain(False) != chain(True)  # a bias from the true tokens would draft otherwise
    assert (drafts != base).any() and (drafts == base).any()  # both branches taken
    assert (
        drafts.tolist()
        == markov_decode(d, target, block_hidden(d, target, aux, ids, first, BLOCK), ids[first:-1]).tolist()
    )


def test_a_strong_successor_head_drafts_a_counting_reply_whole():
    d = _drafter(markov_rank=V, scale=0.3)
    _successor_head(d)
    ids = (torch.arange(30) + 20) % V
    stats = dspark_block_stats(d, _target(head_std=0.02), _batch(ids, 4)["aux"][0], ids, 4, BLOCK)
    # from bonus position 4: steps at 4, 9, 14, 19, 24 accept 4 each; at 29 nothing is left to draft
    assert (stats.drafts, stats.accepted) == (5, 20)
    plain = dspark_block_stats(
        _drafter(markov_rank=V, scale=0.3), _target(head_std=0.02), _batch(ids, 4)["aux"][0], ids, 4, BLOCK
    )
    assert plain.accepted < 5  # without the head the random backbone drafts almost nothing right


def test_the_folder_is_vllms_layout_and_reads_back_bit_exact(tmp_path):
    d = _drafter(seed=1)
    for p in d.markov_head.parameters():
        p.data.normal_()
    folder = write_dspark(d, tmp_path / "drafter", torch.float32, provenance={"note": "x"})
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert stored == VLLM_TENSORS
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dspark_target_layer_ids"] == [1, 3, 5] and vllm_aux_ids(cfg) == [2, 4, 6]  # vLLM adds 1
    assert (cfg["mask_token_id"], cfg["markov_rank"], cfg["draft_vocab_size"], cfg["block_size"]) == (
        MASK,
        RANK,
        V,
        BLOCK,
    )
    assert cfg["sample_from_anchor"] is True and cfg["enable_confidence_head"] is True
    assert cfg["confidence_head_with_markov"] is True and cfg["eagle3kit"] == {
        "drafter": "dspark",
        "note": "x",
    }
    back = read_dspark(folder)
    assert back.cfg == d.cfg
    assert all(torch.equal(back.state_dict()[k], v) for k, v in d.state_dict().items())
    bf16 = load_file(str(write_dspark(d, tmp_path / "bf16", torch.bfloat16) / "model.safetensors"))
    assert (
        bf16["fc.weight"].dtype == torch.bfloat16
        and bf16["confidence_head.proj.weight"].dtype == torch.float32
    )
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["surplus.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "drafter" / "model.safetensors"))
    with pytest.raises(ConfigError, match="unknown \\['surplus.weight'\\]"):
        read_dspark(folder)


@pytest.fixture
def target_dir(tmp_path):
    _target_config().save_pretrained(tmp_path / "target")
    return TargetConfig(model=str(tmp_path / "target"))


def _errors(findings):
    return [(f.code, f.severity) for f in findings if f.severity != "info"]


def test_check_passes_a_good_folder_with_only_the_gpu_only_warning(tmp_path, target_dir):
    folder = write_dspark(_drafter(), tmp_path / "drafter", torch.float32)
    assert _errors(check_drafter(folder, target_dir, num_speculative_tokens=BLOCK)) == [
        ("dspark_gpu_only", "warning")
    ]
    too_many = check_drafter(folder, target_dir, num_speculative_tokens=BLOCK + 1)
    assert ("dspark_block", "error") in _errors(too_many)


def test_check_names_a_misshapen_tensor_and_a_missing_field(tmp_path, target_dir):
    folder = write_dspark(_drafter(), tmp_path / "drafter", torch.float32)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["markov_head.markov_w2.weight"] = torch.zeros(V, RANK + 1)
    save_file(tensors, str(folder / "model.safetensors"))
    bad = [f for f in check_drafter(folder, target_dir) if f.severity == "error"]
    assert [f.code for f in bad] == ["dspark_tensors"] and "markov_head.markov_w2.weight (96, 9)" in bad[
        0
    ].message

    folder = write_dspark(_drafter(), tmp_path / "no-rank", torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["markov_rank"]
    (folder / "config.json").write_text(json.dumps(cfg))
    bad = [f for f in check_drafter(folder, target_dir) if f.severity == "error"]
    assert [f.code for f in bad] == ["config_invalid"] and "without markov_rank" in bad[0].message


def test_the_registry_finds_dspark_by_name_folder_and_checkpoint(tmp_path):
    kind = kind_named("dspark")
    assert list(KINDS)[-1] == "eagle3" and kind_for_variant("dspark") is kind and kind.name == "dspark"
    folder = write_dspark(_drafter(), tmp_path / "drafter", torch.float32)
    assert kind_for_folder(folder) is kind
    assert kind.aux_ids(read_dspark(folder)) == [2, 4, 6] and kind.max_draft(read_dspark(folder)) == BLOCK
    d = _drafter(seed=4)
    kind.save_checkpoint(
        d, tmp_path / "best.safetensors", {"epoch": 3, "provenance": json.dumps({"x": 1})}, d.state_dict()
    )
    assert kind_for_checkpoint(tmp_path / "best.safetensors") is kind
    back, prov = kind.read_checkpoint(tmp_path / "best.safetensors", None)
    assert prov["x"] == 1 and len(prov["checkpoint_sha256"]) == 64
    assert all(torch.equal(back.state_dict()[k], v) for k, v in d.state_dict().items())
    with pytest.raises(ExportError, match="Qwen3DSparkModel layout only"):
        kind.write_folder(d, tmp_path / "spec", {}, "speculators", None, False, BLOCK)


def test_dspark_trains_in_the_common_loop_exports_and_checks(tmp_path, tiny_target_dir, tiny_target):
    """`train` runs the one training loop for a DSpark drafter (its loss, DFlash's step) on the tiny
    8-layer target: the loss falls, the checkpoint is a DSpark checkpoint, `export` writes vLLM's
    Qwen3DSparkModel folder holding the trained weights, and `check` finds no error in it (only that
    vLLM serves DSpark on the GPU)."""
    from eagle3kit.core.config import load_config
    from eagle3kit.core.rundir import RunDir
    from eagle3kit.data.tokenize import save_shard
    from eagle3kit.model.draft_vocab import DraftVocab, save_vocab
    from eagle3kit.serve.export import run_export
    from eagle3kit.train.stage import run_train

    run = tmp_path / "run"
    run.mkdir()
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(16):  # a counting-like pattern the drafter can learn: x, x+1, x+2, …
        start, n = int(torch.randint(10, 1500, (1,), generator=g)), 14 + i % 7
        rows.append((list(range(start, start + n)), [0] * 4 + [1] * (n - 4)))
    save_shard(run / "tokens.safetensors", rows)
    save_vocab(run / "vocab.safetensors", DraftVocab(ids=torch.arange(256), vocab_size=49152), {})
    (run / "c.yaml").write_text(
        f"run_dir: {run}\ntarget: {{model: {tiny_target_dir}, dtype: float64, device: cpu}}\n"
        "vocab: {draft_vocab_size: 256}\n"
        "drafter: {variant: dspark, num_layers: 1, block_size: 4, max_anchors: 8}\n"
        "train: {epochs: 3, tokens_per_step: 128, lr: 0.003, val_fraction: 0.2, device: cpu}\n"
        "evaluate: {k: 3}\n"
    )
    cfg = load_config(run / "c.yaml")
    rep = run_train(cfg, RunDir(run), target=tiny_target)
    hist = rep["history"]
    assert rep["drafter_variant"] == "dspark" and rep["drafts_per_block"] == 4 and len(hist) == 3
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    best = run / "checkpoints" / "best.safetensors"
    assert kind_for_checkpoint(best).name == "dspark"
    log = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    assert all("confidence_loss" in r for r in log if "step" in r and "loss" in r)
    run_export(cfg, RunDir(run), target=tiny_target)
    folder = run / "drafter"
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    assert kind_for_folder(folder).name == "dspark"
    findings = check_drafter(folder, cfg.target, num_speculative_tokens=3)
    assert [f.code for f in findings if f.severity == "error"] == [], findings
    assert "dspark_gpu_only" in {f.code for f in findings}
    (run / "drafter-speculators").mkdir()
    (run / "drafter-speculators" / "keep.txt").write_text("a user's file")
    with pytest.raises(ExportError, match="DSpark drafter is written as dual only"):
        run_export(cfg, RunDir(run), fmt="speculators", set_aside_existing=True, target=tiny_target)
    assert (run / "drafter-speculators" / "keep.txt").exists()  # refused before anything was moved
    (run / "broken.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ExportError, match="not a readable safetensors checkpoint"):
        run_export(cfg, RunDir(run), checkpoint=str(run / "broken.safetensors"), out_dir=str(tmp_path / "o"))
    d = read_dspark(folder)
    trained = load_file(str(best))
    assert torch.equal(d.markov_head.markov_w1.weight.float(), trained["markov_head.markov_w1.weight"])


@pytest.mark.parametrize("objective", ["ce", "kl"])
def test_the_block_loss_in_checkpointed_chunks_equals_it_whole_with_the_same_gradients(objective):
    """train.loss_chunk for a block drafter (DSpark here, its Markov bias added per chunk; DFlash shares the
    path): the loss, every draft's top-1 and every gradient are those of the unchunked loss, while at most
    one chunk's logits are live at once ("auto" on a CPU: unchunked)."""
    d, target = _drafter(), _target()
    ids = _no_successor_ids(32, seed=3)
    batch = _batch(ids, 8, seed=3)
    batch["last"] = torch.randn(1, 32, H, generator=torch.Generator().manual_seed(4))
    anchors = _all_anchors(batch)
    got = {}
    for chunk in (0, 7, "auto"):
        d.zero_grad()
        loss, st = dspark_loss(d, target, batch, anchors, gamma=2.0, objective=objective, chunk=chunk)
        loss.backward()
        got[chunk] = (
            float(loss.detach()),
            st["correct"],
            {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None},
        )
    assert st["n"] == 90  # 90 rows: 13 chunks of 7
    for chunk in (7, "auto"):
        assert abs(got[chunk][0] - got[0][0]) < 1e-5 and got[chunk][1] == got[0][1], chunk
        assert got[chunk][2].keys() == got[0][2].keys()
        for n, g in got[0][2].items():
            torch.testing.assert_close(got[chunk][2][n], g, atol=1e-5, rtol=1e-4, msg=f"{chunk} {n}")
