import pytest
import torch
from conftest import build_tiny_llama

from eagle3kit.core.config import TargetConfig
from eagle3kit.model.target import (
    Target,
    capture_layer_inputs,
    resolve_aux_layer_ids,
    resolve_parts,
    target_features,
    teacher_logits,
)


def _wrap(model):
    return Target(model=model, tokenizer=None, parts=resolve_parts(model))


def test_c14_hidden_state_indices_on_a_4_layer_model():
    m = build_tiny_llama(4, vocab_size=97)
    ids = torch.randint(0, 97, (2, 9))
    out = m(input_ids=ids, output_hidden_states=True)
    hs = out.hidden_states
    assert len(hs) == 5
    assert torch.equal(hs[0], m.model.embed_tokens(ids))
    seen = {}
    hooks = [
        m.model.layers[i].register_forward_hook(
            lambda mod, a, kw, o, i=i: seen.__setitem__(i, a[0] if a else kw["hidden_states"]),
            with_kwargs=True,
        )
        for i in range(4)
    ]
    with capture_layer_inputs(m.model.layers, [1, 2, 3]) as store:
        m(input_ids=ids)
    for h in hooks:
        h.remove()
    for i in (1, 2, 3):
        assert torch.equal(store[i], seen[i])  # our capture = the input of layer i seen by a hook
        assert torch.allclose(store[i], hs[i], atol=0, rtol=0)  # = HF index i
    # HF index N is after the final norm: not equal to the pre-norm input of the norm
    assert not torch.allclose(hs[4], store[3])


def test_c13_output_of_layer_and_hf_numbering_select_the_same_tensors():
    m = build_tiny_llama(8, vocab_size=97)
    t = _wrap(m)
    ids = torch.randint(0, 97, (1, 12))
    a = resolve_aux_layer_ids(
        TargetConfig(aux_layer_ids=[1, 4, 6], aux_layer_convention="output_of_layer"), 8
    )
    b = resolve_aux_layer_ids(TargetConfig(aux_layer_ids=[2, 5, 7]), 8)
    assert a == b == (2, 5, 7)
    aux, _ = target_features(t, ids, None, a)
    hs = m(input_ids=ids, output_hidden_states=True).hidden_states
    assert torch.equal(aux, torch.cat([hs[2], hs[5], hs[7]], -1))


def test_c15_teacher_logits_apply_the_final_norm_once():
    m = build_tiny_llama(4, vocab_size=97)
    t = _wrap(m)
    ids = torch.randint(0, 97, (2, 7))
    _, last = target_features(t, ids, None, (1, 2, 3))
    ref = m(input_ids=ids).logits
    assert torch.allclose(teacher_logits(t, last), ref, atol=1e-5)
    sub = torch.tensor([3, 10, 50])
    assert torch.allclose(teacher_logits(t, last, sub), ref[..., sub], atol=1e-5)


def test_resolver_finds_parts_through_a_wrapper():
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.language_model = inner

        def get_output_embeddings(self):
            return self.language_model.lm_head

    inner = build_tiny_llama(4, vocab_size=97)
    parts = resolve_parts(Wrapper(inner))
    assert (
        parts.layers is inner.model.layers
        and parts.lm_head is inner.lm_head
        and parts.final_norm is inner.model.norm
    )


@pytest.mark.smollm2
def test_smollm2_loads_from_the_package_without_a_hub(smollm2_target):
    t = smollm2_target
    assert t.num_layers == 30 and t.hidden_size == 576 and t.vocab_size == 49152
    assert resolve_aux_layer_ids(TargetConfig(), t.num_layers) == (2, 15, 27)
    assert t.source["gguf_file"].endswith(".gguf")
    assert t.end_of_turn_ids() == [2]  # <|im_end|>
    ids = t.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    out = t.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    text = t.tokenizer.decode(out[0, len(ids) :])
    assert "4" in text


def test_gguf_tokenizer_is_cached_as_a_folder_and_loads_identically(tmp_path, monkeypatch, smollm2_tokenizer):
    """The GGUF tokenizer rebuild (seconds) happens once; the cached folder gives the same vocabulary,
    special tokens and chat template (same tokenizer hash, same ids)."""
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target import tokenizer_hash
    from eagle3kit.model.target_files import load_tokenizer

    monkeypatch.setenv("EAGLE3KIT_CACHE", str(tmp_path))
    first = load_tokenizer(TargetConfig())
    (entry,) = (tmp_path / "tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file()
    again = load_tokenizer(TargetConfig())
    assert tokenizer_hash(again) == tokenizer_hash(first) == tokenizer_hash(smollm2_tokenizer)
    msgs = [{"role": "user", "content": "Résumé <|im_end|> 12 345"}]
    assert again.apply_chat_template(msgs, add_generation_prompt=True) == first.apply_chat_template(
        msgs, add_generation_prompt=True
    )


@pytest.mark.smollm2
def test_a_gguf_target_reloads_from_its_float32_export_bit_for_bit(smollm2_target, tmp_path, monkeypatch):
    """A GGUF target loaded in float32 reads the float32 export of the same GGUF file instead of
    de-quantizing it again: every tensor equal, the same source record; the GGUF's config is read
    once and kept. A bfloat16-loaded target's export goes to its own folder and is never read back
    as the float32 weights (it holds bfloat16-rounded values)."""
    import copy

    from eagle3kit.model.target import Target, load_target, resolve_parts
    from eagle3kit.model.target_export import export_fp32_folder
    from eagle3kit.model.target_files import load_target_config

    monkeypatch.setenv("EAGLE3KIT_CACHE", str(tmp_path))
    ref = smollm2_target
    half = copy.deepcopy(ref.model).to(torch.bfloat16)
    bf16_dir = export_fp32_folder(
        Target(model=half, tokenizer=ref.tokenizer, parts=resolve_parts(half), source=ref.source)
    )
    assert bf16_dir.name.endswith("-bfloat16")
    fp32_dir = export_fp32_folder(ref)
    assert fp32_dir.parent == bf16_dir.parent == tmp_path / "fp32" and fp32_dir != bf16_dir
    again = load_target(TargetConfig(), device="cpu")
    assert again.model.config._name_or_path == str(fp32_dir)  # read from the export, not the GGUF
    assert again.source == ref.source
    a, b = ref.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first, _ = load_target_config(TargetConfig())
    assert (tmp_path / "configs").is_dir()
    cached, _ = load_target_config(TargetConfig())
    assert cached.to_dict() == first.to_dict() and cached._name_or_path == ref.source["path"]
