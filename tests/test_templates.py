"""Training sequences per template family (issue 4): golden ids and masks, field cases C07–C12,
think markers from the tokenizer's own special-token table, and the self-check."""

import json

import family_tokenizers as fam
import pytest
from golden_templates import GOLDEN

from eagle3kit.data.templates import MaskRule, think_spec
from eagle3kit.data.turn_samples import build_samples, self_check

TC = [{"id": "call0", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 3}'}}]
CONVS = {
    "reasoning": {
        "messages": [{"role": "user", "content": "What is 3+3?"}],
        "reasoning": "Add them.",
        "content": "6",
        "finish_reason": "stop",
    },
    "plain": {"messages": [{"role": "user", "content": "hi"}], "content": "hello", "finish_reason": "stop"},
    "multi": {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
            {"role": "user", "content": "3+3?"},
        ],
        "reasoning": "add",
        "content": "6",
        "finish_reason": "stop",
    },
    "tool": {
        "messages": [
            {"role": "user", "content": "3+3?"},
            {"role": "assistant", "content": None, "reasoning_content": "use add", "tool_calls": TC},
            {"role": "tool", "tool_call_id": "call0", "content": "6"},
        ],
        "reasoning": "got it",
        "content": "6",
        "finish_reason": "stop",
    },
}
FLAGS = {
    "kimi": {},
    "v31-think": {"thinking": True},
    "v31-nothink": {"thinking": False},
    "r1": {},
    "llama": {},
    "smollm2": {},
}
THINKING = ("kimi", "v31-think", "r1")


@pytest.fixture(scope="module")
def toks(tiny_target_dir, smollm2_tokenizer):
    return {
        "kimi": fam.kimi_standin(tiny_target_dir),
        "v31": fam.deepseek_v31(),
        "r1": fam.r1_distill_qwen(),
        "llama": fam.llama31(),
        "smollm2": smollm2_tokenizer,
    }


def golden_row(family: str, name: str) -> dict:
    row = json.loads(json.dumps(CONVS[name]))
    if family not in THINKING:  # no reasoning for models (or modes) that do not think
        row.pop("reasoning", None)
        for m in row["messages"]:
            m.pop("reasoning_content", None)
    return dict(row, template_flags=FLAGS[family])


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_golden_sequences_and_masks(key, toks):
    family, name, mode = key.split("/")
    tok = toks[family.split("-")[0]]
    row = golden_row(family, name)
    samples = build_samples(tok, row, think_spec(tok), [tok.eos_token_id], mode)
    s = samples[-1]
    ids, mask, supervised = GOLDEN[key]
    assert s.ids == ids
    assert "".join(map(str, s.mask)) == mask
    assert tok.decode([t for t, m in zip(s.ids, s.mask) if m]) == supervised
    assert len(samples) == (
        1 if mode == "one_sequence" else sum(m["role"] == "assistant" for m in row["messages"]) + 1
    )
    # and the independent full-conversation render agrees with every sample
    assert all(self_check(tok, row, x, think_spec(tok), [tok.eos_token_id]) == "ok" for x in samples)


def test_c07_stock_template_without_generation_tags(toks):
    """C07: SmolLM2's stock template has no {% generation %} tags; the mask comes from the prefix
    render difference and covers exactly "A" plus the end-of-turn token."""
    tok = toks["smollm2"]
    row = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"},
        ]
    }
    (s,) = build_samples(tok, row, think_spec(tok), [tok.eos_token_id])
    assert 0 < sum(s.mask) < len(s.ids)
    assert tok.decode([t for t, m in zip(s.ids, s.mask) if m]) == "A<|im_end|>"
    assert (
        s.ids == tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"][:-1]
    )  # minus the trailing "\n"


GENERATION_TAGGED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_c08_tagged_template_and_an_assistant_span_ending_in_spaces(tiny_target_dir):
    """C08: a template that marks assistant spans; [assistant "A  ", user "user message"]. The mask
    covers the assistant span only (it agrees with the template's own generation-tag mask there)
    and never runs on into the user turn."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    tok.chat_template = GENERATION_TAGGED
    msgs = [{"role": "assistant", "content": "A  "}, {"role": "user", "content": "user message"}]
    for mode in ("per_turn", "one_sequence"):
        (s,) = build_samples(tok, {"messages": msgs}, think_spec(tok), [tok.eos_token_id], mode)
        assert tok.decode([t for t, m in zip(s.ids, s.mask) if m]) == "A  <|im_end|>"
        assert "user message" not in tok.decode(s.ids)
    hf = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert hf["input_ids"][: len(s.ids)] == s.ids and hf["assistant_masks"][: len(s.ids)] == s.mask


def test_c09_empty_think_block_the_template_inserts_is_not_supervised(toks):
    """C09: Kimi's template puts <think></think> before a reply without reasoning; those ids (and the
    role header) are outside the loss; exactly the reply and its end-of-turn are supervised."""
    tok = toks["kimi"]
    (s,) = build_samples(tok, golden_row("kimi", "plain"), think_spec(tok), [tok.eos_token_id])
    completion = list(zip(s.ids[s.prompt_len :], s.mask[s.prompt_len :]))
    assert completion == [(163606, 0), (163607, 0), (28120, 1), (163586, 1)]
    assert s.ids[s.prompt_len - 4 : s.prompt_len] == [
        163588,
        520,
        9531,
        163601,
    ]  # <|im_assistant|>assistant<|im_middle|>
    assert not any(s.mask[: s.prompt_len])


@pytest.mark.parametrize("family", ["kimi", "r1", "v31-think"])
def test_c10_mask_covers_markers_reasoning_and_answer_with_and_without_reasoning(family, toks):
    tok = toks[family.split("-")[0]]
    spec = think_spec(tok)
    row = {
        "messages": [{"role": "user", "content": "What is 3+3?"}],
        "reasoning": "Let me think step by step.",
        "content": "The answer is 6.",
        "finish_reason": "stop",
        "template_flags": FLAGS[family],
    }
    (s,) = build_samples(tok, row, spec, [tok.eos_token_id])
    sup = [t for t, m in zip(s.ids, s.mask) if m]
    assert (
        spec.close_id in sup
        and tok.decode(sup).count("Let me think step by step.") == 1
        and "The answer is 6." in tok.decode(sup)
    )
    assert (spec.open_id in sup) == (family == "kimi")  # R1 and V3.1 (thinking) open the block in the prompt
    no_reasoning = {k: v for k, v in row.items() if k != "reasoning"}
    (s2,) = build_samples(tok, no_reasoning, spec, [tok.eos_token_id])
    assert sum(s2.mask) > 0 and "The answer is 6." in tok.decode([t for t, m in zip(s2.ids, s2.mask) if m])


@pytest.mark.parametrize("flag", [True, False])
def test_c11_tokenize_uses_the_template_flags_recorded_at_generation(flag, toks):
    tok = toks["v31"]
    msgs = [{"role": "user", "content": "hi"}]
    row = {
        "messages": msgs,
        "content": "hello",
        "finish_reason": "stop",
        "template_flags": {"enable_thinking": flag},
        "completion_ids": tok("</think>hello" if flag else "hello", add_special_tokens=False)["input_ids"]
        + [tok.eos_token_id],
    }
    (s,) = build_samples(tok, row, think_spec(tok), [tok.eos_token_id])
    prompt = tok.apply_chat_template(
        msgs, tokenize=True, return_dict=True, add_generation_prompt=True, enable_thinking=flag
    )["input_ids"]
    assert s.ids == prompt + row["completion_ids"] and s.prompt_len == len(prompt)
    assert prompt[-1] == (128821 if flag else 128822)  # <think> opened by the prompt, or </think> closing it


def test_c12_r1_distill_prompt_opens_think_and_the_completion_holds_only_the_closer(toks):
    tok = toks["r1"]
    (s,) = build_samples(tok, golden_row("r1", "reasoning"), think_spec(tok), [tok.eos_token_id])
    assert tok.decode(s.ids[: s.prompt_len]).endswith("<｜Assistant｜><think>\n")
    completion = s.ids[s.prompt_len :]
    assert 151648 not in completion and completion.count(151649) == 1 and completion[-1] == 151643


def test_kimi_think_markers_come_from_the_tokenizers_special_token_table(toks, smollm2_tokenizer):
    """Kimi-K2's think markers are added special tokens 163606/163607: the rebuild uses those ids;
    the same strings typed inside the reasoning stay plain text (never a marker id)."""
    tok = toks["kimi"]
    spec = think_spec(tok)
    assert (spec.open_id, spec.close_id) == (163606, 163607)
    row = {
        "messages": [{"role": "user", "content": "q"}],
        "reasoning": "I could write <think> here.",
        "content": "a",
        "finish_reason": "stop",
    }
    (s,) = build_samples(tok, row, spec, [tok.eos_token_id])
    reasoning = next(p for p in s.pieces if p.kind == "reasoning").ids
    assert (
        163606 not in reasoning
        and 163607 not in reasoning
        and tok.decode(reasoning) == "I could write <think> here."
    )
    assert s.ids[s.prompt_len] == 163606 and s.ids.count(163607) == 1
    # SmolLM2 spells "<think>" only as text: it is not a marker there
    assert think_spec(smollm2_tokenizer).open_id is None


def test_typed_markers_stay_text_even_when_the_markers_are_not_special_tokens(toks):
    """R1-Distill's <think>/</think> are added tokens with special: false, which
    split_special_tokens does not cover (found by a new-user review): typed inside the reasoning
    or the content, they must still not become marker ids."""
    tok = toks["r1"]
    spec = think_spec(tok)
    assert (spec.open_id, spec.close_id) == (151648, 151649)
    row = {
        "messages": [{"role": "user", "content": "q"}],
        "reasoning": "I wrote </think> and <think> here.",
        "content": "the </think> tag",
        "finish_reason": "stop",
    }
    (s,) = build_samples(tok, row, spec, [tok.eos_token_id])
    completion = s.ids[s.prompt_len :]
    assert completion.count(151649) == 1 and 151648 not in completion  # only the real closer
    assert (
        tok.decode(completion)
        == "I wrote </think> and <think> here.\n</think>\n\nthe </think> tag<｜end▁of▁sentence｜>"
    )


def test_supervise_rule_leaves_out_what_it_is_told(toks):
    tok = toks["kimi"]
    rule = MaskRule(reasoning=False, think_markers=False, end_of_turn=False)
    (s,) = build_samples(tok, golden_row("kimi", "reasoning"), think_spec(tok), [tok.eos_token_id], rule=rule)
    assert tok.decode([t for t, m in zip(s.ids, s.mask) if m]) == "6"


def test_self_check_catches_what_a_circular_check_would_miss(toks):
    """A sample that lost its end-of-turn, lost the template's default system prompt or holds other
    content than the row's text is a mismatch; a non-canonical tokenization of the same text is
    'retokenized'."""
    tok = toks["smollm2"]
    spec = think_spec(tok)
    row = {"messages": [{"role": "user", "content": "hi"}], "content": "hello there", "finish_reason": "stop"}
    (s,) = build_samples(tok, row, spec, [tok.eos_token_id])
    assert self_check(tok, row, s, spec, [2]) == "ok"

    def variant(ids, prompt_len=s.prompt_len):
        return type(s)(ids, [0] * len(ids), s.turn, prompt_len, s.pieces, True)

    assert self_check(tok, row, variant(s.ids[:-1]), spec, [2]) == "mismatch"  # end-of-turn dropped
    no_system = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False).split(
        "<|im_end|>\n", 1
    )[1]
    p = tok(no_system, add_special_tokens=False)["input_ids"]
    assert (
        self_check(tok, row, variant(p + s.ids[s.prompt_len :], len(p)), spec, [2]) == "mismatch"
    )  # system prompt lost
    other = tok("hello world", add_special_tokens=False)["input_ids"] + [2]
    assert self_check(tok, row, variant(s.ids[: s.prompt_len] + other), spec, [2]) == "mismatch"
    split = (
        [tok.convert_tokens_to_ids(c) for c in ["h", "ello"]]
        + tok(" there", add_special_tokens=False)["input_ids"]
        + [2]
    )
    assert tok.decode(split) == "hello there<|im_end|>"
    assert self_check(tok, row, variant(s.ids[: s.prompt_len] + split), spec, [2]) == "retokenized"


def test_self_check_accepts_a_cut_reply_ending_inside_a_character(toks):
    """Found on real vLLM rows: a reply cut at the token limit can end with part of a multi-byte
    character; the server's text drops it, the returned ids keep it. Not a mismatch."""
    tok = toks["smollm2"]
    ids = tok("ok 🦜", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # the emoji spans several byte tokens
    row = {
        "messages": [{"role": "user", "content": "hi"}],
        "content": "ok",
        "finish_reason": "length",
        "completion_ids": ids[:-1],
    }
    (s,) = build_samples(tok, row, think_spec(tok), [tok.eos_token_id])
    assert s.ids[s.prompt_len :] == ids[:-1]
    assert self_check(tok, row, s, think_spec(tok), [tok.eos_token_id]) == "retokenized"
    assert (
        self_check(tok, dict(row, finish_reason="stop"), s, think_spec(tok), [tok.eos_token_id]) == "mismatch"
    )


# ---- found by an adversarial review of templates.py (each once gave a wrong sample or a traceback)


def test_tool_call_turns_keep_content_and_the_tool_section_when_the_template_drops_the_content(toks):
    tok = toks["llama"]  # Llama 3.1's template renders a tool-call turn without its content
    row = {
        "messages": [{"role": "user", "content": "hi"}],
        "content": "Let me add.",
        "tool_calls": TC,
        "finish_reason": "tool_calls",
    }
    (s,) = build_samples(tok, row, think_spec(tok), [tok.eos_token_id])
    assert (
        tok.decode([t for t, m in zip(s.ids, s.mask) if m])
        == 'Let me add.{"name": "add", "parameters": {"a": 3, "b": 3}}<|eot_id|>'
    )
    tok = toks["r1"]
    (s,) = build_samples(tok, row, think_spec(tok), [tok.eos_token_id])
    sup = tok.decode([t for t, m in zip(s.ids, s.mask) if m])
    assert sup.startswith("</think>\n\nLet me add.<｜tool▁calls▁begin｜>") and sup.endswith(
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    )


def test_think_looking_text_on_a_template_without_think_tokens_is_plain_content(toks):
    tok = toks["llama"]
    row = {
        "messages": [{"role": "user", "content": "hi"}],
        "content": "<think></think>hello",
        "finish_reason": "stop",
    }
    (s,) = build_samples(tok, row, think_spec(tok), [tok.eos_token_id])
    assert [p.kind for p in s.pieces] == ["content", "end_of_turn"]
    assert tok.decode(s.ids[s.prompt_len :]) == "<think></think>hello<|eot_id|>" and all(
        s.mask[s.prompt_len :]
    )


def test_a_template_that_trims_content_is_a_whitespace_difference_not_a_mismatch(toks):
    tok = toks["llama"]
    row = {"messages": [{"role": "user", "content": "hi"}], "content": " hello\n", "finish_reason": "stop"}
    (s,) = build_samples(tok, row, think_spec(tok), [tok.eos_token_id])
    assert self_check(tok, row, s, think_spec(tok), [tok.eos_token_id]) == "whitespace"


def test_one_sequence_history_spans_keep_leading_space_and_an_end_of_turn_string_typed_in_the_content(toks):
    tok = toks["kimi"]
    row = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": " hello a <|im_end|> b"},
            {"role": "user", "content": "again"},
        ],
        "content": "ok",
        "finish_reason": "stop",
    }
    (s,) = build_samples(tok, row, think_spec(tok), [tok.eos_token_id], "one_sequence")
    assert (
        tok.decode([t for t, m in zip(s.ids, s.mask) if m]) == " hello a <|im_end|> b<|im_end|>ok<|im_end|>"
    )


def test_one_sequence_keeps_a_long_conversation_cut_at_max_length_and_earlier_turns_after_an_empty_last_one(
    smollm2_tokenizer,
):
    from eagle3kit.data.tokenize import samples_for_row

    tok = smollm2_tokenizer
    turns = []
    for i in range(6):
        turns += [
            {"role": "user", "content": f"question {i} " + "word " * 60},
            {"role": "assistant", "content": f"answer {i} " + "fine " * 60},
        ]
    row = {"messages": turns}
    kept, reason = samples_for_row(tok, row, think_spec(tok), [2], 300, "one_sequence")
    assert reason is None and len(kept[0].ids) == 300 and sum(kept[0].mask) > 50
    row = {"messages": turns[:4] + [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}
    kept, reason = samples_for_row(tok, row, think_spec(tok), [2], 4096, "one_sequence")
    assert reason is None and "answer 1" in tok.decode([t for t, m in zip(kept[0].ids, kept[0].mask) if m])


def test_returned_ids_are_used_even_when_the_reasoning_could_not_be_rebuilt(smollm2_tokenizer):
    tok = smollm2_tokenizer  # no <think> special token: a text-only reasoning row could not be rebuilt
    ids = tok("thinking done", add_special_tokens=False)["input_ids"] + [2]
    row = {
        "messages": [{"role": "user", "content": "q"}],
        "reasoning": "thinking",
        "content": "done",
        "completion_ids": ids,
        "finish_reason": "stop",
    }
    (s,) = build_samples(tok, row, think_spec(tok), [2])
    assert s.returned_ids and s.ids[s.prompt_len :] == ids
