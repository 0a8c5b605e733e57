"""Reasoning capture (issue 3; field cases C01–C06) on reply shapes hand-written from
the servers' documented formats (fixtures/reasoning_replies.json says so: no reasoning model can be
served here)."""

import json
from pathlib import Path

import pytest
from conftest import SHARED

from eagle3kit.data.reasoning import assistant_history_message, parse_reply, parse_stream

R = json.loads((Path(__file__).parent / "fixtures" / "reasoning_replies.json").read_text())


def msg(name):
    ch = R[name]["choices"][0]
    return ch["message"], ch["finish_reason"]


@pytest.mark.parametrize(
    "name,source",
    [
        ("vllm_reasoning_field", "message.reasoning"),
        ("deepseek_reasoning_content", "message.reasoning_content"),
    ],
)
def test_c02_reasoning_fields(name, source):
    r = parse_reply(*msg(name))
    assert (r.reasoning, r.content, r.reasoning_source, r.flags, r.trainable) == (
        "think",
        "ans",
        source,
        [],
        True,
    )


def test_c02_openai_sdk_object_exposes_reasoning_content_only_through_model_extra():
    from openai.types.chat import ChatCompletion

    obj = ChatCompletion.model_validate(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            **R["deepseek_reasoning_content"],
        }
    )
    m = obj.choices[0].message
    assert not hasattr(type(m), "reasoning_content")  # not in the SDK's schema ...
    r = parse_reply(m, obj.choices[0].finish_reason)
    assert (r.reasoning, r.content, r.reasoning_source) == ("think", "ans", "model_extra.reasoning_content")


def test_c02_streamed_pieces_and_disagreeing_fields():
    for name, src in (
        ("stream_reasoning", "stream.reasoning"),
        ("stream_reasoning_content", "stream.reasoning_content"),
    ):
        r = parse_stream(R[name])
        assert (r.reasoning, r.content, r.reasoning_source, r.finish_reason) == ("think", "ans", src, "stop")
    r = parse_reply(*msg("both_fields_disagree"))
    assert "reasoning_fields_disagree" in r.flags and not r.trainable


def test_c03_close_marker_only_after_a_prompt_that_opened_think():
    r = parse_reply(*msg("r1_distill_close_only"), prompt_opens_think=True)
    assert (r.reasoning, r.content, r.reasoning_source) == ("step1 step2", "Final", "prompt_opened_think")
    assert "</think>" not in r.content and r.trainable


def test_inline_think_block_is_split():
    r = parse_reply(*msg("inline_think"))
    assert (r.reasoning, r.content, r.reasoning_source) == (
        "Let me think step by step.",
        "The answer is 6.",
        "inline_think",
    )


def test_c04_truncated_reasoning_never_becomes_a_training_turn():
    r = parse_reply(*msg("length_null_content"))
    assert r.truncated and r.content == "" and r.reasoning == "partial reas" and not r.trainable
    r = parse_reply(*msg("length_unclosed_inline"))
    assert r.truncated and "unclosed_think" in r.flags and r.content == "" and not r.trainable


def test_c06_special_token_string_inside_reasoning_is_flagged():
    r = parse_reply(*msg("special_token_in_reasoning"), special_tokens=["<|tool_call_begin|>", "<|im_end|>"])
    assert "special_token_in_reasoning" in r.flags and not r.trainable


@pytest.mark.parametrize(
    "reads,keys",
    [
        ("reasoning", {"reasoning"}),
        ("reasoning_content", {"reasoning_content"}),
        ("both", {"reasoning", "reasoning_content"}),
    ],
)
def test_c01_history_reasoning_goes_under_the_key_the_server_reads(reads, keys):
    m = assistant_history_message("A", "T", reads)
    assert {k for k in m if k.startswith("reasoning")} == keys and all(m[k] == "T" for k in keys)


KIMI = (SHARED / "tokenizers" / "templates" / "kimi_k2_thinking.jinja").read_text()
KIMI_SPECIALS = [
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]


@pytest.fixture(scope="module")
def kimi_standin_tokenizer(tiny_target_dir):
    """A STAND-IN for Kimi's tokenizer (no Kimi vocabulary exists here, ../shared/tokenizers/README.md):
    SmolLM2's real vocabulary with Kimi's special tokens added, and Kimi-K2-Thinking's real template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    tok.add_special_tokens({"additional_special_tokens": KIMI_SPECIALS})
    tok.chat_template = KIMI
    return tok


@pytest.mark.parametrize("mode", ["message", "stream"])
def test_c05_turn2_of_a_kimi_tool_call_exchange_keeps_turn1_reasoning(mode, kimi_standin_tokenizer):
    """C05: turn 1's reply has reasoning and a tool call; the turn-2 request built for a Kimi-style
    template carries that reasoning under the key the template reads, so the rendered turn-2 prompt
    holds it exactly once, inside turn 1's <think>…</think>, before the tool call."""
    from eagle3kit.data.reasoning import next_turn_messages, template_reasoning_key

    reply = (
        parse_reply(*msg("kimi_tool_call")) if mode == "message" else parse_stream(R["stream_kimi_tool_call"])
    )
    thought = "The user wants the weather in Paris; I should call get_weather."
    assert reply.reasoning == thought and reply.finish_reason == "tool_calls" and reply.trainable
    assert reply.tool_calls == [
        {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    reads = template_reasoning_key(KIMI)
    assert reads == "reasoning_content"
    user = [{"role": "user", "content": "Weather in Paris?"}]
    turn2 = next_turn_messages(
        user, reply, [{"tool_call_id": "functions.get_weather:0", "content": "18 C, sunny"}], reads
    )
    assert [m["role"] for m in turn2] == ["user", "assistant", "tool"] and "reasoning" not in turn2[1]
    text = kimi_standin_tokenizer.apply_chat_template(turn2, tokenize=False, add_generation_prompt=True)
    assert text.count(thought) == 1
    assert (
        f"<|im_assistant|>assistant<|im_middle|><think>{thought}</think><|tool_calls_section_begin|>"
        f'<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{{"city": "Paris"}}'
    ) in text
    assert text.endswith(
        "## Return of functions.get_weather:0\n18 C, sunny<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    # the same reply sent under vLLM's key only: Kimi's template would drop the thinking (the fault C05 guards)
    lost = kimi_standin_tokenizer.apply_chat_template(
        next_turn_messages(user, reply, None, "reasoning"), tokenize=False
    )
    assert thought not in lost and "<think></think>" in lost
    # "both" keys: the template still replays it once (C01's "exactly once")
    both = kimi_standin_tokenizer.apply_chat_template(
        next_turn_messages(user, reply, None, "both"), tokenize=False
    )
    assert both.count(thought) == 1


def test_tool_result_for_an_unknown_call_is_refused():
    from eagle3kit.data.reasoning import next_turn_messages

    with pytest.raises(ValueError, match="answers no tool call"):
        next_turn_messages(
            [], parse_reply(*msg("kimi_tool_call")), [{"tool_call_id": "nope", "content": "x"}]
        )


@pytest.mark.parametrize(
    "template,key",
    [
        ("{{ m.reasoning_content }}", "reasoning_content"),
        ("{{ message['reasoning'] }}", "reasoning"),
        ("{{ m.reasoning }}", "reasoning"),
        ("{{ m.content }}", "both"),
    ],
)
def test_template_reasoning_key(template, key):
    from eagle3kit.data.reasoning import template_reasoning_key

    assert template_reasoning_key(template) == key


def test_streamed_tool_calls_without_an_index_are_split_by_id():
    """Found by an adversarial review: a server that omits `index` had two calls merged into one."""

    def chunk(**tc):
        return {"choices": [{"index": 0, "delta": {"tool_calls": [tc]}, "finish_reason": None}]}

    chunks = [
        chunk(id="a", function={"name": "f", "arguments": '{"x"'}),
        chunk(function={"arguments": ": 1}"}),
        chunk(id="b", function={"name": "g", "arguments": "{}"}),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    r = parse_stream(chunks)
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in r.tool_calls] == [
        ("a", "f", '{"x": 1}'),
        ("b", "g", "{}"),
    ]
