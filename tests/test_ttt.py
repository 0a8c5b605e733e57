"""The GPU formulation of training-time test against the readable reference, on the CPU:
flex attention with a block mask vs dense TTT attention, the chunked loss vs the unchunked one,
packed rows vs one sample per row."""

import random
import warnings

import pytest
import torch
from test_drafter import V, tiny_drafter, tiny_target

from eagle3kit.train.batches import Sample, length_batches, make_batch, packed_batches
from eagle3kit.train.ttt import ttt_loss

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def _samples(target, lengths, seed=0):
    from eagle3kit.model.target import target_features, teacher_argmax

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, V, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3 :] = True
        aux, last = target_features(target, ids[None], None, (1, 2, 3))
        out.append(Sample(ids, mask, aux[0], last[0], teacher_argmax(target, last[0])))
    return out


@torch.no_grad()
def test_flex_attention_gives_the_reference_outputs_at_every_ttt_step():
    """GQA (4 query heads, 2 kv heads), 4 TTT steps, right padding: every real position's output
    of every step agrees with the dense reference (flex's unfused CPU path, float64)."""
    d = tiny_drafter()
    t = tiny_target()
    b = make_batch(_samples(t, [19, 33]), [0, 1], 4, "cpu")
    embeds = [t.parts.embed(x).to(torch.float64) for x in b["tok"]]
    ref = d.ttt_forward(b["aux"], embeds, b["positions"], b["key_mask"])
    flex = d.ttt_forward(b["aux"], embeds, b["positions"], b["key_mask"], attention="flex")
    real = b["key_mask"]
    for r, f in zip(ref, flex):
        assert torch.allclose(r[real], f[real], atol=1e-6, rtol=1e-6)
    # and the function differs from plain causal attention over one step (so the test can fail)
    assert not torch.allclose(
        ref[3][real], d.ttt_forward(b["aux"], embeds[3:], b["positions"], b["key_mask"])[0][real]
    )


@pytest.mark.parametrize("attention", ["reference", "flex"])
@torch.no_grad()
def test_a_packed_row_gives_each_sample_what_it_gets_alone(attention):
    d = tiny_drafter()
    t = tiny_target()
    ss = _samples(t, [11, 17, 6], seed=1)
    packed = make_batch(ss, [[0, 1, 2]], 3, "cpu")
    assert packed["positions"][0].tolist() == list(range(11)) + list(range(17)) + list(range(6))
    emb = [t.parts.embed(x).to(torch.float64) for x in packed["tok"]]
    outs = d.ttt_forward(
        packed["aux"], emb, packed["positions"], packed["key_mask"], doc=packed["doc"], attention=attention
    )
    start = 0
    for j, s in enumerate(ss):
        alone = make_batch(ss, [j], 3, "cpu")
        assert torch.equal(
            packed["tok"][2][0, start : start + len(s.ids)], alone["tok"][2][0]
        )  # no token from the next sample
        assert torch.equal(packed["sup"][2][0, start : start + len(s.ids)], alone["sup"][2][0])
        emb1 = [t.parts.embed(x).to(torch.float64) for x in alone["tok"]]
        ref = d.ttt_forward(alone["aux"], emb1, alone["positions"], alone["key_mask"])
        for k in range(3):
            assert torch.allclose(outs[k][0, start : start + len(s.ids)], ref[k][0], atol=1e-6), (j, k)
        start += len(s.ids)
    loss_p, st_p = ttt_loss(d, t, packed, torch.arange(V), 3, 0.8)
    assert sum(st_p["n"]) == sum(
        sum(make_batch(ss, [j], 3, "cpu")["sup"][k].sum().item() for k in range(3)) for j in range(3)
    )


def test_chunked_loss_equals_the_unchunked_loss_and_gradients():
    t = tiny_target()
    b = make_batch(_samples(t, [23, 30], seed=2), [0, 1], 3, "cpu")
    grads = []
    for chunk in (0, 7):
        d = tiny_drafter(vd=48)
        loss, st = ttt_loss(d, t, b, d.d2t + torch.arange(48), 3, 0.8, loss_chunk=chunk)
        loss.backward()
        grads.append((float(loss.detach()), st["acc"], {k: p.grad.clone() for k, p in d.named_parameters()}))
    (l0, a0, g0), (l1, a1, g1) = grads
    assert l0 == pytest.approx(l1, rel=1e-6)  # the loss is taken in fp32
    assert a0 == a1
    for k in g0:
        assert torch.allclose(g0[k], g1[k], rtol=1e-4, atol=1e-7), k
    assert any(g0[k].abs().sum() > 0 for k in g0)


def test_packing_fills_rows_and_keeps_every_sample_once():
    lengths = [5, 9, 3, 7, 12, 2, 8, 30]
    batches = packed_batches(lengths, tokens_per_step=32, row_len=16, shuffle=True, rng=random.Random(0))
    rows = [r for b in batches for r in b]
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 16 for r in rows if len(r) > 1)
    assert [r for r in rows if 7 in r] == [[7]]  # longer than a row: a row of its own
    assert all(len(b) <= 2 for b in batches)  # 32 tokens a step = 2 rows of 16
    assert sorted(sorted(lengths[i] for i in r) for r in rows) == [
        [2, 5, 8],
        [3, 12],
        [7, 9],
        [30],
    ]  # first fit, decreasing


def test_mixed_samples_make_new_length_grouped_batches_every_epoch():
    """train.shuffle: batches keeps the same samples together every epoch; samples makes new
    batches each epoch (every sample once, B · T_max within the budget, lengths still grouped within
    a window, so padding stays near the sorted batches')."""
    lengths = [random.Random(i).randint(20, 400) for i in range(300)]

    def epochs(mix):
        return [
            length_batches(lengths, 2048, True, random.Random(e), random.Random(-e) if mix else None)
            for e in range(2)
        ]

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    for mix in (False, True):
        for batches in epochs(mix):
            assert sorted(i for b in batches for i in b) == list(range(300))
            assert all(len(b) * max(lengths[i] for i in b) <= 2048 for b in batches if len(b) > 1)
    fixed, mixed = epochs(False), epochs(True)
    same = {frozenset(b) for b in fixed[0]} == {frozenset(b) for b in fixed[1]}
    assert same  # the old behaviour: one grouping, reordered
    assert not {frozenset(b) for b in mixed[0]} & {frozenset(b) for b in mixed[1]}  # no batch repeats
    assert padded(mixed[0]) < 1.25 * padded(fixed[0])  # grouped by length within windows
    whole_random = [list(range(300))[i : i + 10] for i in range(0, 300, 10)]  # what no grouping would pad
    assert padded(mixed[0]) < padded(whole_random)
    small = lengths[:40]  # 40 samples fit in one window: the sorted grouping's batches, in its order
    assert length_batches(small, 2048, True, random.Random(3), random.Random(9)) == length_batches(
        small, 2048, True, random.Random(3)
    )


def test_the_fast_path_is_the_cuda_default_and_flex_is_refused_without_cuda():
    from eagle3kit.core.config import ConfigError
    from eagle3kit.core.config_train import TrainConfig
    from eagle3kit.train.chain_step import resolve_speed

    cuda = torch.device("cuda", 0)
    assert resolve_speed(TrainConfig(), cuda) == {
        "attention": "flex",
        "bf16": True,
        "tf32": False,
        "loss_chunk": 8192,
        "compile": True,
    }
    assert resolve_speed(TrainConfig(), torch.device("cpu")) == {
        "attention": "reference",
        "bf16": False,
        "tf32": False,
        "loss_chunk": 0,
        "compile": False,
    }
    assert resolve_speed(
        TrainConfig(attention="reference", precision="fp32", loss_chunk=0, compile=False), cuda
    ) == {"attention": "reference", "bf16": False, "tf32": False, "loss_chunk": 0, "compile": False}
    assert resolve_speed(TrainConfig(attention="reference", precision="tf32"), cuda) == {
        "attention": "reference",
        "bf16": False,
        "tf32": True,
        "loss_chunk": 8192,
        "compile": True,
    }
    # FSDP2 shards the layer's parameters: the layer is not compiled unless asked for
    assert resolve_speed(TrainConfig(parallel="fsdp"), cuda)["compile"] is False
    assert resolve_speed(TrainConfig(parallel="fsdp", compile=True), cuda)["compile"] is True
    with pytest.raises(ConfigError, match="flex needs a CUDA device"):
        resolve_speed(TrainConfig(attention="flex"), torch.device("cpu"))
    with pytest.raises(ConfigError, match="tf32 needs a CUDA device"):
        resolve_speed(TrainConfig(precision="tf32"), torch.device("cpu"))


def test_tf32_matmuls_turns_tf32_on_inside_the_block_only():
    from eagle3kit.train.chain_step import tf32_matmuls

    mm, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = mm.fp32_precision, conv.fp32_precision
    with tf32_matmuls(True):
        assert (mm.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")
    assert (mm.fp32_precision, conv.fp32_precision) == before
    with tf32_matmuls(False):
        assert (mm.fp32_precision, conv.fp32_precision) == before
    # a process that set TF32 the way PyTorch >= 2.9 asks keeps it after the block (the legacy
    # flags, set here, raised "mix of the legacy and new APIs")
    mm.fp32_precision = "tf32"
    try:
        with tf32_matmuls(True):
            pass
        assert mm.fp32_precision == "tf32"
    finally:
        mm.fp32_precision = before[0]


def test_padding_in_packed_rows_keeps_every_gradient_finite():
    """A packed batch whose second row is shorter (padding, doc −1, no real key to attend to) used
    to give NaN in every weight through the dense path's all-masked softmax rows."""
    t = tiny_target()
    ss = _samples(t, [12, 9, 7], seed=3)
    d = tiny_drafter()
    b = make_batch(ss, [[0, 1], [2]], 2, "cpu")
    assert (b["doc"][1] == -1).any()  # the second row is padded
    loss, st = ttt_loss(d, t, b, torch.arange(V), 2, 0.8)
    loss.backward()
    assert torch.isfinite(loss) and sum(st["n"]) > 0
    assert all(torch.isfinite(p.grad).all() for p in d.parameters())


def test_packed_batches_stay_within_the_token_budget_when_samples_outgrow_a_row():
    lengths = [10 + (i * 7) % 21 for i in range(30)]
    batches = packed_batches(lengths, tokens_per_step=64, row_len=5, shuffle=True, rng=random.Random(1))
    for b in batches:
        widest = max(sum(lengths[i] for i in r) for r in b)
        assert len(b) == 1 or len(b) * widest <= 64
    assert sorted(i for b in batches for r in b for i in r) == list(range(30))


def test_the_top1_is_computed_only_at_completion_tokens_and_the_loss_is_unchanged():
    """compute_features skips the [T, V] product at prompt tokens (teacher_argmax ``where``): no TTT
    step reads the target's top-1 there, so the loss, its supervised counts and its gradients
    equal those with the top-1 computed everywhere."""
    from eagle3kit.train.samples import compute_features

    t, d = tiny_target(), tiny_drafter()
    full = _samples(t, [19, 33, 26], seed=3)
    masked = [Sample(s.ids, s.mask) for s in full]
    compute_features(t, masked, (1, 2, 3), 4096, torch.device("cpu"), torch.device("cpu"))
    for f, m in zip(full, masked):
        assert torch.equal(m.argmax[m.mask], f.argmax[f.mask]) and not m.argmax[~m.mask].any()
        assert bool((f.argmax[~f.mask] != 0).any())  # the full top-1 differs there: the skip is real
    draft_ids = d.draft_to_target(torch.arange(d.config.draft_vocab_size))
    grads = []
    for samples in (full, masked):
        d.zero_grad()
        b = make_batch(samples, [0, 1, 2], 3, "cpu")
        loss, st = ttt_loss(d, t, b, draft_ids, 3, 0.8)
        loss.backward()
        grads.append((float(loss), st["n"], [p.grad.clone() for p in d.parameters() if p.grad is not None]))
    assert grads[0][0] == grads[1][0] and grads[0][1] == grads[1][1] and sum(grads[0][1]) > 0
    # float64; the features of a padded batch differ from one sample's by rounding (1e-18)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(grads[0][2], grads[1][2]))


def test_simulating_two_drafters_in_one_target_pass_gives_each_its_own_tau():
    """evaluate simulates the trained and the untrained drafter on one set of target features
    (simulate_drafters); each τ and per-prompt τ equal those of its own simulate, and drafters
    reading other aux layers are refused."""
    from eagle3kit.eval.evaluate import simulate, simulate_drafters

    t = tiny_target()
    a, b = tiny_drafter(seed=0), tiny_drafter(seed=1)
    with torch.no_grad():
        a.lm_head.weight.mul_(40)  # peaked: the two drafters accept differently
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (7, 11)]
    conts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 6)]
    together = simulate_drafters([a, b], t, prompts, conts, 3, torch.device("cpu"))
    apart = [simulate(d, t, prompts, conts, 3, torch.device("cpu")) for d in (a, b)]
    for (s1, p1), (s2, p2) in zip(together, apart):
        assert s1.as_dict() == s2.as_dict() and p1 == p2
    assert together[0][0].as_dict() != together[1][0].as_dict() or together[0][1] != together[1][1]
    c = tiny_drafter()
    c.config.aux_layer_ids = [0, 1, 2]
    with pytest.raises(ValueError, match="different aux layers"):
        simulate_drafters([a, c], t, prompts, conts, 3, torch.device("cpu"))


def test_the_teacher_table_gives_each_step_the_teacher_at_its_shift():
    """TTT step k reads the teacher at t + k + 1: the table computed once per batch must give, row
    for row, the softmax of the target's draft-vocabulary logits there."""
    from eagle3kit.model.target import teacher_logits
    from eagle3kit.train.ttt import TeacherTable, _supervised, _unshift, shift

    t = tiny_target()
    b = make_batch(_samples(t, [23, 30], seed=2), [0, 1], 3, "cpu")
    draft_ids = torch.arange(48) * 2
    in_draft = torch.zeros(V, dtype=torch.bool)
    in_draft[draft_ids] = True
    sups = [_supervised(b, k, in_draft) for k in range(3)]
    need = torch.zeros_like(sups[0])
    for k, s in enumerate(sups):
        need |= _unshift(s, k + 1)
    table = TeacherTable(t, b["last"], need, draft_ids)
    assert int(need.sum()) < need.numel()  # padding and prompt positions are left out
    for k, sup in enumerate(sups):
        assert sup.any()
        got, full = table.rows(table.index(sup, k + 1))
        want = torch.softmax(teacher_logits(t, shift(b["last"], k + 1)[sup], draft_ids), -1)
        assert full is None and torch.allclose(got, want, atol=1e-6)


def test_the_fused_lm_head_and_loss_gives_the_reference_loss_and_gradients(monkeypatch):
    """The forward KL with a chunk on: FusedDraftCE (gradients taken in the forward pass) against
    the unchunked reference, fp64 drafter; then under bf16 autocast, within bf16's precision."""
    from eagle3kit.train import ttt

    calls = []
    real = ttt.FusedDraftCE.apply
    monkeypatch.setattr(ttt.FusedDraftCE, "apply", lambda *a: calls.append(1) or real(*a))
    t = tiny_target()
    b = make_batch(_samples(t, [23, 30], seed=2), [0, 1], 3, "cpu")
    got = {}
    for chunk in (0, 5):
        d = tiny_drafter(vd=48)
        loss, st = ttt_loss(d, t, b, d.d2t + torch.arange(48), 3, 0.8, loss_chunk=chunk)
        loss.backward()
        got[chunk] = (float(loss), st["acc"], {k: p.grad.clone() for k, p in d.named_parameters()})
    assert calls and len(calls) == 3  # one fused call per TTT step, only with a chunk
    assert got[0][0] == pytest.approx(got[5][0], rel=1e-6) and got[0][1] == got[5][1]
    for k, g in got[0][2].items():
        assert torch.allclose(g, got[5][2][k], rtol=1e-5, atol=1e-8), k  # the loss is taken in fp32
    assert got[0][2]["lm_head.weight"].abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        d = tiny_drafter(vd=48, dtype=torch.float32)
        loss, _ = ttt_loss(d, t, b, d.d2t + torch.arange(48), 3, 0.8, loss_chunk=5)
    loss.backward()
    assert d.lm_head.weight.grad.dtype == torch.float32
    assert float(loss) == pytest.approx(got[0][0], rel=2e-2)
    g = d.lm_head.weight.grad.double()
    assert float((g - got[0][2]["lm_head.weight"]).norm() / got[0][2]["lm_head.weight"].norm()) < 5e-2


def test_loss_chunk_auto_is_fused_for_kl_and_unchunked_for_lk_when_it_fits_a_quarter_of_the_gpu(monkeypatch):
    from types import SimpleNamespace

    from eagle3kit.core.config_train import TrainConfig
    from eagle3kit.train.chain_step import FUSED_LOSS_CHUNK, resolve_speed, unchunked_loss_bytes

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=141e9))
    cuda = torch.device("cuda", 0)
    # the forward KL: the fused chunks on CUDA whatever the size (faster than unchunked at the 8B shape)
    assert FUSED_LOSS_CHUNK == 8192
    assert resolve_speed(TrainConfig(tokens_per_step=16384), cuda, 32000)["loss_chunk"] == 8192
    assert resolve_speed(TrainConfig(tokens_per_step=8192), cuda, 8192)["loss_chunk"] == 8192
    # ... but not under FSDP2 (a sharded lm_head is not fusable): the memory rule below
    assert resolve_speed(TrainConfig(tokens_per_step=16384, parallel="fsdp"), cuda, 32000)["loss_chunk"] == 0
    # the LK objectives: unchunked when the loss fits a quarter of the GPU, else checkpointed chunks
    eight_b = TrainConfig(tokens_per_step=16384, ttt_steps=7, loss="lk_alpha")
    assert unchunked_loss_bytes(16384, 32000, 7) == 8 * 16384 * 32000 * 7  # 29.4 GB ≤ 35.25 GB
    assert resolve_speed(eight_b, cuda, 32000)["loss_chunk"] == 0
    assert resolve_speed(eight_b, cuda, 128256)["loss_chunk"] == 4096  # 118 GB: chunked
    assert resolve_speed(eight_b, cuda)["loss_chunk"] == 4096  # the draft vocabulary unknown
    assert resolve_speed(TrainConfig(loss_chunk=1024), cuda, 32000)["loss_chunk"] == 1024
    assert resolve_speed(TrainConfig(), torch.device("cpu"), 32000)["loss_chunk"] == 0


@torch.no_grad()
def test_block_masks_are_cached_least_recently_used_first_within_a_byte_bound(monkeypatch):
    """The masks of unpacked rows are kept per (T, steps, device) until their bytes pass the bound
    (a mask's index tensors grow with T²); the one used last stays, the longest unused goes first."""
    import eagle3kit.model.drafter as drafter

    monkeypatch.setattr(drafter, "_BLOCK_MASKS", type(drafter._BLOCK_MASKS)())
    monkeypatch.setattr(drafter, "BLOCK_MASK_CACHE_BYTES", 1500)
    for T in (256, 300, 256, 512, 700):
        kv = [torch.randn(1, 2, T, 16) for _ in range(2)]
        drafter.flex_ttt_attention(torch.randn(1, 2, T, 16), kv, kv)
    cached = drafter._BLOCK_MASKS
    assert sum(n for _, n in cached.values()) <= 1500
    assert list(cached)[-1] == (700, 2, "cpu") and (300, 2, "cpu") not in cached
