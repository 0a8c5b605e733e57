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
