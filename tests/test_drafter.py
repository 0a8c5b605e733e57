import pytest
import torch
from conftest import build_tiny_llama

from eagle3kit.model.draft_vocab import DraftVocab
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.target import Target, resolve_parts, target_features
from eagle3kit.train.batches import Sample, make_batch
from eagle3kit.train.ttt import ttt_loss

V = 97


def tiny_drafter(vd=V, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        vocab_size=V,
        draft_vocab_size=vd,
        target_hidden_size=32,
        aux_layer_ids=[1, 2, 3],
    )
    d = Eagle3Drafter(cfg).to(dtype)
    d.set_vocab(DraftVocab(ids=torch.arange(vd) * (V // vd), vocab_size=V) if vd < V else DraftVocab.full(V))
    return d


def tiny_target(layers=4):
    m = build_tiny_llama(
        layers,
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        dtype=torch.float64,
    )
    return Target(model=m, tokenizer=None, parts=resolve_parts(m))


def test_c22_one_position_shift_of_the_loss_mask():
    ids = torch.arange(10) + 5
    mask = torch.zeros(10, dtype=torch.bool)
    mask[5:8] = True  # assistant span [5, 8)
    b = make_batch([Sample(ids, mask)], [0], 3, "cpu")
    assert b["sup"][0][0].nonzero().flatten().tolist() == [4, 5, 6]  # [a-1, b-2]
    assert b["sup"][1][0].nonzero().flatten().tolist() == [3, 4, 5]  # step k: [a-1-k, b-2-k]
    assert b["tok"][0][0, 4] == ids[5]  # position 4 takes the first completion token ...


def test_c22_gradient_reaches_the_first_supervised_position_and_nothing_past_the_span():
    t = tiny_target()
    d = tiny_drafter()
    ids = torch.randint(0, V, (10,))
    mask = torch.zeros(10, dtype=torch.bool)
    mask[5:8] = True
    s = Sample(ids, mask)
    aux, last = target_features(t, ids[None], None, (1, 2, 3))
    s.aux, s.last = aux[0], last[0]
    s.argmax = (last[0] @ t.parts.lm_head.weight.T).argmax(-1)
    b = make_batch([s], [0], 1, "cpu")
    b["aux"].requires_grad_(True)
    loss, st = ttt_loss(d, t, b, torch.arange(V), 1, 0.8)
    loss.backward()
    g = b["aux"].grad[0].abs().sum(-1)
    assert st["n"] == [3]
    assert g[4] > 0  # ... and predicts the second: it gets gradient
    assert torch.all(g[7:] == 0)  # the position past the span gets none


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_c23_ttt_steps_equal_a_step_by_step_autoregressive_draft(norm_before_residual):
    """Also with the other residual convention (``norm_before_residual``, which `diagnose` flips to
    simulate an engine that reads it): both forwards follow it, and it changes the drafts."""
    torch.manual_seed(0)
    d = tiny_drafter()
    with torch.no_grad():
        d.midlayer.hidden_norm.weight.uniform_(0.5, 1.5)  # a trained norm is not the identity
    T, S = 9, 3
    aux = torch.randn(1, T, 96, dtype=torch.float64)
    tokens = torch.randint(0, V, (T + S,))
    emb_table = torch.nn.Embedding(V, 32).to(torch.float64)
    embeds = [emb_table(tokens[k + 1 : k + 1 + T])[None] for k in range(S)]  # x_{t+k+1}
    default = d.ttt_forward(aux, embeds, torch.arange(T)[None], None)
    d.norm_before_residual = norm_before_residual
    outs = d.ttt_forward(aux, embeds, torch.arange(T)[None], None)
    assert torch.equal(outs[0], default[0]) != norm_before_residual
    for t in range(T):
        cache = d.new_cache(1, T + S)
        h = d.step(
            d.fc(aux[:, : t + 1]), emb_table(tokens[1 : t + 2])[None], torch.arange(t + 1)[None], cache
        )[:, -1:]
        assert torch.allclose(d.logits(h[0, 0]), d.logits(outs[0][0, t]), atol=1e-10)
        for k in range(1, S):
            h = d.step(h, emb_table(tokens[t + k + 1 : t + k + 2])[None], torch.tensor([[t + k]]), cache)
            assert torch.allclose(d.logits(h[0, 0]), d.logits(outs[k][0, t]), atol=1e-10), (t, k)


def test_c25_loss_is_normalised_per_supervised_token_never_nan_never_a_fake_zero():
    t = tiny_target()
    d = tiny_drafter()
    torch.manual_seed(1)

    def sample(n_sup):
        ids = torch.randint(0, V, (12,))
        mask = torch.zeros(12, dtype=torch.bool)
        if n_sup:
            mask[12 - n_sup :] = True
        s = Sample(ids, mask)
        aux, last = target_features(t, ids[None], None, (1, 2, 3))
        s.aux, s.last, s.argmax = aux[0], last[0], (last[0] @ t.parts.lm_head.weight.T).argmax(-1)
        return s

    a, empty = sample(6), sample(0)
    alone, _ = ttt_loss(d, t, make_batch([a], [0], 2, "cpu"), torch.arange(V), 2, 0.8)
    mixed, st = ttt_loss(d, t, make_batch([a, empty], [0, 1], 2, "cpu"), torch.arange(V), 2, 0.8)
    assert torch.isfinite(alone) and alone > 0
    assert torch.allclose(alone, mixed)  # an unsupervised row changes nothing (not divided by B·T)
    none, st = ttt_loss(d, t, make_batch([empty], [0], 2, "cpu"), torch.arange(V), 2, 0.8)
    assert float(none) == 0.0 and st["n"] == [0, 0]
    d.zero_grad()
    none.backward()  # a graph exists (every DDP process must call backward) ...
    assert all(p.grad is not None and not p.grad.any() for p in d.parameters())  # ... and moves nothing


def test_positions_whose_target_argmax_is_outside_the_draft_vocab_are_dropped():
    t = tiny_target()
    d = tiny_drafter(vd=8)  # draft ids 0, 12, 24, ... : most argmaxes fall outside
    ids = torch.randint(0, V, (16,))
    mask = torch.ones(16, dtype=torch.bool)
    s = Sample(ids, mask)
    aux, last = target_features(t, ids[None], None, (1, 2, 3))
    s.aux, s.last = aux[0], last[0]
    s.argmax = (last[0] @ t.parts.lm_head.weight.T).argmax(-1)
    b = make_batch([s], [0], 1, "cpu")
    _, st = ttt_loss(d, t, b, d.d2t + torch.arange(8), 1, 0.8)
    expected = int((d.t2d[s.argmax[1:]]).sum())  # positions 0..14 use the target at 1..15
    assert st["n"] == [expected]
