"""Reasoning capture (issue 3 groundwork; field cases C01–C04, C06) on reply shapes hand-written from
the servers' documented formats (fixtures/reasoning_replies.json says so: no reasoning model can be
served here)."""
import json
from pathlib import Path

import pytest

from eagle3kit.reasoning import assistant_history_message, parse_reply, parse_stream

R = json.loads((Path(__file__).parent / "fixtures" / "reasoning_replies.json").read_text())


def msg(name):
    ch = R[name]["choices"][0]
    return ch["message"], ch["finish_reason"]


@pytest.mark.parametrize("name,source", [("vllm_reasoning_field", "message.reasoning"),
                                          ("deepseek_reasoning_content", "message.reasoning_content")])
def test_c02_reasoning_fields(name, source):
    r = parse_reply(*msg(name))
    assert (r.reasoning, r.content, r.reasoning_source, r.flags, r.trainable) == ("think", "ans", source, [], True)


def test_c02_openai_sdk_object_exposes_reasoning_content_only_through_model_extra():
    from openai.types.chat import ChatCompletion

    obj = ChatCompletion.model_validate({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                         **R["deepseek_reasoning_content"]})
    m = obj.choices[0].message
    assert not hasattr(type(m), "reasoning_content")         # not in the SDK's schema ...
    r = parse_reply(m, obj.choices[0].finish_reason)
    assert (r.reasoning, r.content, r.reasoning_source) == ("think", "ans", "model_extra.reasoning_content")


def test_c02_streamed_pieces_and_disagreeing_fields():
    for name, src in (("stream_reasoning", "stream.reasoning"), ("stream_reasoning_content", "stream.reasoning_content")):
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
    assert (r.reasoning, r.content, r.reasoning_source) == ("Let me think step by step.", "The answer is 6.", "inline_think")


def test_c04_truncated_reasoning_never_becomes_a_training_turn():
    r = parse_reply(*msg("length_null_content"))
    assert r.truncated and r.content == "" and r.reasoning == "partial reas" and not r.trainable
    r = parse_reply(*msg("length_unclosed_inline"))
    assert r.truncated and "unclosed_think" in r.flags and r.content == "" and not r.trainable


def test_c06_special_token_string_inside_reasoning_is_flagged():
    r = parse_reply(*msg("special_token_in_reasoning"), special_tokens=["<|tool_call_begin|>", "<|im_end|>"])
    assert "special_token_in_reasoning" in r.flags and not r.trainable


@pytest.mark.parametrize("reads,keys", [("reasoning", {"reasoning"}), ("reasoning_content", {"reasoning_content"}),
                                        ("both", {"reasoning", "reasoning_content"})])
def test_c01_history_reasoning_goes_under_the_key_the_server_reads(reads, keys):
    m = assistant_history_message("A", "T", reads)
    assert {k for k in m if k.startswith("reasoning")} == keys and all(m[k] == "T" for k in keys)
