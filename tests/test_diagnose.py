"""`eagle3kit diagnose` without a real engine: the planted faults compute what they name, the
comparison arithmetic, and bad input (exit 2, nothing written). The engine-verified cases (a vLLM
server serving each planted fault) are in tests/test_engine_acceptance.py and, for other numerics,
tests/test_family_runs.py.

The server here is a TEST DOUBLE (FastAPI in a thread), standing in for vLLM's endpoints where a
behaviour must be produced on demand: counters that move per request, and a connection cut
mid-run."""

import asyncio
import json

import pytest
import torch
from conftest import diagnose_cli
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from standin_server import AppThread

from eagle3kit.core.config import ConfigError
from eagle3kit.core.engines import free_port
from eagle3kit.core.metrics import AcceptanceStats
from eagle3kit.diagnose.faults import FAULTS, applicable, other_vocab_fault, planted
from eagle3kit.diagnose.simulate import Simulated, compare, explains
from eagle3kit.model.draft_vocab import DraftVocab
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.folder import export_drafter

FAULT = {f.name: f for f in FAULTS}


@pytest.fixture(scope="module")
def drafter_dir(tiny_target_dir, tmp_path_factory):
    """A drafter exported for the tiny 8-layer Llama target (V 49152, Vd 512, aux 2, 4, 5)."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(tc, 512, [2, 4, 5]))
    d.set_vocab(DraftVocab(ids=torch.arange(512) * 7 + 3, vocab_size=tc.vocab_size))
    return export_drafter(d, tmp_path_factory.mktemp("d") / "drafter")


@pytest.fixture
def drafter(drafter_dir):
    from eagle3kit.model.folder import load_exported

    return load_exported(drafter_dir).eval()


def test_each_planted_fault_computes_what_it_names_on_a_copy(drafter):
    ids = torch.tensor([0, 1, 2, 511])
    h = torch.randn(4, drafter.config.hidden_size)
    assert planted(FAULT["d2t_missing"], drafter)[0].draft_to_target(ids).tolist() == [0, 1, 2, 511]
    # d2t read as ids: target id = d2t[i] (offsets 3, 9, 15, … here), not i + d2t[i]
    assert planted(FAULT["d2t_as_ids"], drafter)[0].draft_to_target(ids).tolist() == drafter.d2t[ids].tolist()
    assert drafter.draft_to_target(ids).tolist() == [3, 10, 17, 3580]  # the drafter itself untouched
    assert not planted(FAULT["fc_missing"], drafter)[0].fc.weight.any() and drafter.fc.weight.any()
    assert not planted(FAULT["lm_head_missing"], drafter)[0].lm_head.weight.any()
    twice = planted(FAULT["final_norm_twice"], drafter)[0]
    assert torch.allclose(twice.logits(h), drafter.lm_head(drafter.norm(drafter.norm(h))))
    assert torch.allclose(planted(FAULT["final_norm_missing"], drafter)[0].logits(h), drafter.lm_head(h))
    assert planted(FAULT["norm_before_residual"], drafter)[0].norm_before_residual is True
    assert planted(FAULT["norm_output"], drafter)[0].norm_output is True
    assert drafter.norm_before_residual is False and drafter.norm_output is False
    assert planted(FAULT["aux_ids_plus_1"], drafter)[1] == [3, 5, 6]
    assert planted(FAULT["aux_ids_minus_1"], drafter)[1] == [1, 3, 4]
    assert planted(FAULT["aux_blocks_swapped"], drafter)[1] == [
        4,
        2,
        5,
    ]  # fc reads layer 4 where it learned 2


def test_a_fault_that_cannot_apply_says_why(drafter):
    assert applicable(FAULT["aux_ids_plus_1"], drafter, 8) is None
    assert "outside [1, 5]" in applicable(FAULT["aux_ids_plus_1"], drafter, 6)  # layer 5 + 1 = 6 = N
    full = Eagle3Drafter(DrafterConfig(**{**drafter.config.to_dict(), "draft_vocab_size": 49152}))
    assert "no d2t" in applicable(FAULT["d2t_missing"], full, 8)
    assert applicable(FAULT["fc_missing"], full, 8) is None


def test_another_builds_vocabulary_is_checked_before_it_is_simulated(drafter, tmp_path):
    from safetensors.torch import save_file

    other = torch.arange(512) * 5 + 11  # another build: other ids, same size
    save_file({"d2t": other - torch.arange(512)}, str(tmp_path / "vocab.safetensors"))
    f = other_vocab_fault(tmp_path / "vocab.safetensors", drafter)
    d, _ = planted(f, drafter)
    assert d.draft_to_target(torch.tensor([0, 511])).tolist() == [11, 2566] and int(d.t2d.sum()) == 512
    save_file({"d2t": torch.zeros(100, dtype=torch.long)}, str(tmp_path / "small.safetensors"))
    with pytest.raises(ConfigError, match="100 entries, the drafter's 512"):
        other_vocab_fault(tmp_path / "small.safetensors", drafter)
    save_file({"t2d": torch.zeros(3, dtype=torch.bool)}, str(tmp_path / "none.safetensors"))
    with pytest.raises(ConfigError, match="holds no d2t"):
        other_vocab_fault(tmp_path / "none.safetensors", drafter)
    with pytest.raises(ConfigError, match="cannot read"):
        other_vocab_fault(tmp_path / "missing.safetensors", drafter)


def stats(accepts: list[int], k: int = 3) -> AcceptanceStats:
    st = AcceptanceStats(k)
    for a in accepts:
        st.add(a)
    return st


def test_compare_and_explains_follow_the_per_prompt_numbers():
    """Pooled τ alike, per-prompt τ not: the per-prompt distance decides which hypothesis explains."""
    a, b = stats([1, 1, 0, 0]), stats([0, 0, 1, 1])  # τ 1.5 each
    right = Simulated(stats([1, 1, 0, 0, 0, 0, 1, 1]), [a, b])
    swapped = Simulated(stats([0, 0, 1, 1, 1, 1, 0, 0]), [b, a])
    engine = [1.5, 1.5]
    c = compare(1.5, engine, right, 0.02)
    assert c == {"tau": 1.5, "delta": 0.0, "tolerance": 0.03, "distance": 0.0, "within": True}
    off = Simulated(stats([0, 0, 0, 0, 0, 0, 1, 1]), [stats([0, 0, 0, 0]), b])  # τ 1.25
    far = compare(1.5, engine, off, 0.02)
    assert far["delta"] == 0.25 and not far["within"] and far["distance"] == 0.25
    assert explains(c, far) and not explains(far, c) and not explains(compare(1.5, engine, swapped, 0.02), c)


def fake_vllm(tokenizer, drop_after: int | None = None, stop=None, mode: str = "") -> FastAPI:
    """vLLM's endpoints diagnose reads: prompts rendered with ``tokenizer``'s template; each chat
    request moves the counters by 10 drafts and (3, 1, 0) accepted at positions (0, 1, 2) and
    returns 16 output ids; the request after ``drop_after`` of them calls ``stop()`` (the server
    shuts down: that request and every later one finds nobody listening). ``mode``: ``backwards``
    (the counters fall, as after a restart), ``outside`` (output ids past the vocabulary), ``empty``
    (no output ids)."""
    from eagle3kit.data.backends import render_prompt_ids

    api = FastAPI()
    seen = {"n": 0}

    @api.get("/v1/models")
    def models():
        return {"data": [{"id": "tiny"}]}

    @api.get("/version")
    def version():
        return {"version": "0.32.0"}

    @api.post("/tokenize")
    async def tokenize(req: dict):
        return {"tokens": render_prompt_ids(tokenizer, req["messages"])}

    @api.get("/metrics")
    def metrics():
        n = seen["n"] if mode != "backwards" else 10 - seen["n"]
        lines = [
            f"vllm:spec_decode_num_drafts_total {10.0 * n}",
            f"vllm:spec_decode_num_draft_tokens_total {30.0 * n}",
            f"vllm:spec_decode_num_accepted_tokens_total {4.0 * n}",
        ] + [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{k}"}} {float(v * n)}'
            for k, v in enumerate((3, 1, 0))
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    @api.post("/v1/chat/completions")
    async def chat(req: dict):
        if drop_after is not None and seen["n"] >= drop_after:
            stop()
            await asyncio.sleep(30)  # never answered: the shutdown closes the connection
        seen["n"] += 1
        ids = render_prompt_ids(tokenizer, req["messages"])
        out = {"outside": [10**9] * 4, "empty": []}.get(mode, list(range(100, 116)))
        return {"prompt_token_ids": ids, "choices": [{"token_ids": out}]}

    return api


def prompts_file(tmp_path, n=3):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"question": f"What is {i} + {i}?"}) + "\n" for i in range(n)))
    return p


def test_diagnose_reads_the_engines_counters_per_prompt_and_writes_its_report(
    drafter_dir, tiny_target_dir, tmp_path, smollm2_tokenizer
):
    """Against the stand-in (3 prompts, counters 10 drafts / 4 accepted each): the engine's τ is
    1 + 12/30 pooled, per prompt 1.4, per position 0.3/0.1/0.0; the untrained drafter simulates
    1.0 on the engine's outputs, so engine and reference disagree and no fault explains it (exit 1)."""
    with _Server(fake_vllm(smollm2_tokenizer)) as server:
        res = against(server, drafter_dir, tiny_target_dir, tmp_path, "--parity", "never")
    rep = json.loads((tmp_path / "rep" / "diagnose.json").read_text())
    assert res["exit_code"] == 1, res["output"]
    eng = rep["engine"]
    assert (eng["drafts"], eng["accepted"], eng["tau"]) == (30, 12, 1.4) and eng["per_prompt_tau"] == [
        1.4
    ] * 3
    assert eng["per_position_acceptance"] == [0.3, 0.1, 0.0]
    assert rep["template"] == {
        "mismatch": False,
        "checked": 3,
        "method": "tokenize",
        "result": "same prompt ids as the target's own template",
    }
    assert rep["reference"]["tau"] == 1.0 and not rep["reference"]["within"]
    assert rep["verdict"] == "unexplained" and not any(h.get("explains") for h in rep["hypotheses"])
    simulated = {h["name"] for h in rep["hypotheses"] if "skipped" not in h}
    # every fault but the two of variants this EAGLE-3 drafter is not (EAGLE-3.1 norms, P-EAGLE)
    assert simulated == {f.name for f in FAULTS} - {"eagle31_norms_ignored", "parallel_drafting_off"}
    assert "| the engine (its counters) | 1.4000 |" in (tmp_path / "rep" / "diagnose.md").read_text()


def test_a_recorded_engine_run_is_diagnosed_again_elsewhere_without_a_server(
    drafter_dir, tiny_target_dir, tmp_path, smollm2_tokenizer
):
    """diagnose writes engine.json beside its report; --replay diagnoses those answers again (where the
    target fits, no server asked) and reaches the same numbers; the positions come back in order."""
    with _Server(fake_vllm(smollm2_tokenizer)) as server:
        against(server, drafter_dir, tiny_target_dir, tmp_path, "--parity", "never")
    first = json.loads((tmp_path / "rep" / "diagnose.json").read_text())
    rec = json.loads((tmp_path / "rep" / "engine.json").read_text())
    assert len(rec["run"]["prompt_ids"]) == 3 and rec["run"]["outputs"][0] == list(range(100, 116))
    res = diagnose_cli(
        None,
        drafter_dir,
        None,
        tmp_path / "again",
        "--replay",
        str(tmp_path / "rep"),
        "--target",
        str(tiny_target_dir),
    )
    again = json.loads((tmp_path / "again" / "diagnose.json").read_text())
    assert res["exit_code"] == 1 and again["replayed_from"] == str(tmp_path / "rep"), res["output"]
    for key in ("engine", "reference", "verdict", "template", "k"):
        assert again[key] == first[key], key
    assert again["engine"]["per_position_acceptance"] == [0.3, 0.1, 0.0]
    assert not (tmp_path / "again" / "engine.json").exists()  # a replay records no engine run of its own
    # a folder without a record, and both or neither of --base-url and --replay, are refused
    res = diagnose_cli(None, drafter_dir, None, tmp_path / "x", "--replay", str(tmp_path), "--target", "t")
    assert res["exit_code"] == 2 and "no diagnose engine record there" in " ".join(res["output"].split())
    res = diagnose_cli(None, drafter_dir, None, tmp_path / "x", "--target", str(tiny_target_dir))
    assert res["exit_code"] == 2 and "--base-url" in res["output"] and "--replay" in res["output"]
    # what a replay cannot honour is refused, not silently ignored; a missing folder is named as missing
    rep = str(tmp_path / "rep")
    res = diagnose_cli(
        None, drafter_dir, None, tmp_path / "x", "--replay", rep, "--num-prompts", "2", "--target", "t"
    )
    assert res["exit_code"] == 2 and "--num-prompts: no effect with --replay" in " ".join(
        res["output"].split()
    )
    res = diagnose_cli(
        None, drafter_dir, None, tmp_path / "x", "--replay", str(tmp_path / "nowhere"), "--target", "t"
    )
    assert res["exit_code"] == 2 and "does not exist" in res["output"]
    assert "Replayed here from the answers recorded in" in (tmp_path / "again" / "diagnose.md").read_text()
    # records no server could have answered are refused, each named (checked as a live run's answers are)
    broken = {
        "more accepted than drafted": lambda r: r["run"]["per_prompt"][0].update(accepted=999),
        "one each per prompt": lambda r: r["run"]["per_prompt"].pop(),
        "outside [0, ": lambda r: r["run"]["outputs"][0].append(10**9),
        "not one diagnose wrote": lambda r: r["run"]["per_prompt"][0]["per_position"].update({"x": 1}),
        "drafted nothing": lambda r: [
            d.update(drafts=0, draft_tokens=0, accepted=0, per_position={}) for d in r["run"]["per_prompt"]
        ],
        "vLLM's and SGLang's counters only": lambda r: r["server"].update(engine="tgi"),
    }
    for i, (said, mend) in enumerate(broken.items()):
        bad = json.loads(json.dumps(rec))
        mend(bad)
        (tmp_path / f"b{i}").mkdir()
        (tmp_path / f"b{i}" / "engine.json").write_text(json.dumps(bad))
        res = diagnose_cli(
            None,
            drafter_dir,
            None,
            tmp_path / f"o{i}",
            "--replay",
            str(tmp_path / f"b{i}"),
            "--target",
            str(tiny_target_dir),
        )
        assert res["exit_code"] == 2 and said in " ".join(res["output"].split()), (said, res["output"])
        assert not (tmp_path / f"o{i}").exists()


def test_the_target_and_prompts_come_from_the_run_config_with_its_dtype_and_remote_code(tmp_path):
    """bench and diagnose measure the target as the run trained it: the config's dtype, device_map and
    trust_remote_code (a flag overrides), the CPU's float32 or the GPU's bfloat16 for a target named alone;
    prompts from a file, a datasets folder, or the run's evaluate sets."""
    import datasets
    import torch

    from eagle3kit.core.config import ConfigError, load_config
    from eagle3kit.serve.inputs import measured_target, measuring_prompts, prompt_source, run_config

    run = tmp_path / "run"
    (run / "drafter").mkdir(parents=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"q{i}?"}) + "\n" for i in range(5)))
    (run / "config.yaml").write_text(
        f"run_dir: {run}\ntarget: {{model: /models/big, dtype: bfloat16, device_map: auto, trust_remote_code: true}}\n"
        f"evaluate: {{sets: [{{path: {prompts}, name: mine}}]}}\n"
    )
    cfg = run_config(None, run / "drafter")  # the drafter's own run
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    t = measured_target(None, cfg, cpu)
    assert (t.model, t.dtype, t.device_map, t.trust_remote_code) == ("/models/big", "bfloat16", "auto", True)
    assert measured_target(None, cfg, cpu, "float32", "", False).model_dump()["device_map"] is None
    assert measured_target("/other", cfg, cpu).dtype == "float32"
    assert measured_target("/other", cfg, gpu).dtype == "bfloat16"
    assert not measured_target("/other", cfg, gpu).trust_remote_code
    with pytest.raises(ConfigError, match="--target"):
        measured_target(None, None, cpu)
    label, rows = measuring_prompts(None, cfg, run / "drafter", 3)
    assert "mine" in label and [r["messages"][0]["content"] for r in rows] == ["q0?", "q1?", "q2?"]
    (run / "heldout.jsonl").write_text(json.dumps({"question": "held?"}) + "\n")
    assert measuring_prompts(None, cfg, run / "drafter", 3)[1][0]["messages"][0]["content"] == "held?"
    folder = tmp_path / "ds"
    datasets.DatasetDict(
        {"test": datasets.Dataset.from_list([{"question": "from a dataset?"}])}
    ).save_to_disk(folder)
    assert prompt_source(f"{folder}", 2).dataset == str(folder)
    assert prompt_source("gsm8k:test", 2).model_dump(include={"dataset", "split"}) == {
        "dataset": "gsm8k",
        "split": "test",
    }
    assert prompt_source("mt_bench.jsonl", 2).path == "mt_bench.jsonl"
    label, rows = measuring_prompts(f"{folder}:test", None, None, 5)
    assert rows[0]["messages"][0]["content"] == "from a dataset?"
    with pytest.raises(ConfigError, match="no prompt file"):
        measuring_prompts(str(tmp_path / "none.jsonl"), cfg, None, 3)
    # a local folder named like a dataset eagle3kit knows is read as itself, not from the hub
    import os

    datasets.Dataset.from_list([{"question": "mine, not the hub's?"}]).save_to_disk(tmp_path / "gsm8k")
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert prompt_source("gsm8k", 1).dataset == str(tmp_path / "gsm8k")
        assert (
            measuring_prompts("gsm8k", None, None, 1)[1][0]["messages"][0]["content"]
            == "mine, not the hub's?"
        )
    finally:
        os.chdir(here)
    for empty in ("", ":train"):
        with pytest.raises(ConfigError, match="--prompts"):
            prompt_source(empty, 1)
    assert load_config(run / "config.yaml").target.device_map == "auto"


def against(server, drafter_dir, target_dir, tmp_path, *extra, n=3) -> dict:
    """diagnose against the stand-in ``server``: n prompts, the tiny target, report in tmp_path/rep."""
    return diagnose_cli(
        server.url,
        drafter_dir,
        prompts_file(tmp_path, n),
        tmp_path / "rep",
        "--target",
        str(target_dir),
        *extra,
    )


class _Server(AppThread):
    def __init__(self, api):
        self.serve(api)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.server.force_exit = True


def test_a_server_that_drops_mid_run_stops_diagnose_with_exit_2_and_nothing_written(
    drafter_dir, tiny_target_dir, tmp_path, smollm2_tokenizer
):
    holder = []
    with _Server(fake_vllm(smollm2_tokenizer, drop_after=1, stop=lambda: holder[0].stop())) as server:
        holder.append(server)
        res = against(server, drafter_dir, tiny_target_dir, tmp_path)
    said = " ".join(res["output"].split())
    # the request in flight when it shut down is answered 500 or cut: either way named, and nothing kept
    assert res["exit_code"] == 2 and "nothing was written" in said and "rerun diagnose" in said, res["output"]
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--drafter", "{tmp}/nowhere"], "does not exist"),
        (["--drafter", "{tmp}"], "holds no config.json"),
        (["--drafter", "{tmp}/prompts.jsonl"], "is a file, not a folder"),
        (["--tolerance", "inf"], "--tolerance must be a fraction in [0, 1)"),
        (["--out", "{tmp}/prompts.jsonl"], "is a file; give a folder"),
        (["--prompts", "{tmp}/none.jsonl"], "no prompt file"),
        (["--parity", "sometimes"], "--parity must be auto, always or never"),
        (["--engine", "tgi"], "--engine must be vllm or sglang"),
        # files and values the server never sees, named before it is asked
        (["--other-vocab", "{tmp}/nowhere"], "--other-vocab"),
        (["--chat-template", "{tmp}/nowhere.jinja"], "--chat-template"),
        (["--device-map", "bogus"], "target.device_map 'bogus' is no placement"),
        ([], "no OpenAI-compatible server answers"),
    ],
)
def test_bad_input_is_named_with_its_fix_and_exits_2(args, expected, drafter_dir, tiny_target_dir, tmp_path):
    """Local inputs are checked before the server is contacted (none answers on this port)."""
    given = dict(zip(args[::2], [a.format(tmp=tmp_path) for a in args[1::2]]))
    drafter = given.pop("--drafter", str(drafter_dir))
    prompts = given.pop("--prompts", prompts_file(tmp_path))
    extra = ["--target", str(tiny_target_dir), *[x for kv in given.items() for x in kv]]
    res = diagnose_cli(f"http://127.0.0.1:{free_port()}", drafter, prompts, tmp_path / "r", *extra)
    assert res["exit_code"] == 2 and expected in " ".join(res["output"].split()), res["output"]
    assert not (tmp_path / "r").exists()


def test_an_existing_report_is_not_overwritten_unless_asked(drafter_dir, tiny_target_dir, tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "diagnose.json").write_text("{}")
    url = f"http://127.0.0.1:{free_port()}"
    res = diagnose_cli(
        url, drafter_dir, prompts_file(tmp_path), tmp_path / "r", "--target", str(tiny_target_dir)
    )
    assert res["exit_code"] == 2 and "--overwrite" in res["output"]
    assert (tmp_path / "r" / "diagnose.json").read_text() == "{}"


def fake_sglang(tokenizer) -> FastAPI:
    """SGLang's endpoints diagnose reads (field names as bench's SGLang path reads them): no
    /tokenize for chats, so the template check counts usage.prompt_tokens; /generate answers 12
    output ids with meta_info spec_verify_ct 5, spec_accept_token_num 6, spec_draft_token_num 15."""
    from eagle3kit.data.backends import render_prompt_ids

    api = FastAPI()
    got: list = []

    @api.get("/v1/models")
    def models():
        return {"data": [{"id": "tiny"}]}

    @api.get("/server_info")
    def server_info():
        return {"version": "0.5.23", "speculative_algorithm": "EAGLE3"}

    @api.post("/v1/chat/completions")
    async def chat(req: dict):
        n = len(render_prompt_ids(tokenizer, req["messages"]))
        return {
            "choices": [{"message": {"content": "x"}}],
            "usage": {"prompt_tokens": n, "completion_tokens": 1},
        }

    @api.post("/generate")
    async def generate(req: dict):
        got.append(req)
        meta = {
            "spec_verify_ct": 5,
            "spec_accept_token_num": 6,
            "spec_draft_token_num": 15,
            "completion_tokens": 12,
        }
        return {"output_ids": list(range(200, 212)), "meta_info": meta}

    api.state.got = got
    return api


def test_diagnose_reads_sglangs_meta_info_per_prompt(
    drafter_dir, tiny_target_dir, tmp_path, smollm2_tokenizer
):
    """SGLang (a stand-in: no SGLang runs on this machine): the prompt ids are rendered with the
    target's template and sent to /generate; τ = 1 + accepted / verify steps pooled (1 + 12/10)."""
    api = fake_sglang(smollm2_tokenizer)
    with _Server(api) as server:
        res = against(server, drafter_dir, tiny_target_dir, tmp_path, "--parity", "never", n=2)
    rep = json.loads((tmp_path / "rep" / "diagnose.json").read_text())
    assert res["exit_code"] == 1 and rep["server"]["engine"] == "sglang", res["output"]
    assert (rep["engine"]["drafts"], rep["engine"]["accepted"], rep["engine"]["tau"]) == (10, 12, 2.2)
    assert rep["template"]["method"] == "usage.prompt_tokens" and not rep["template"]["mismatch"]
    sent = api.state.got[0]
    assert sent["sampling_params"] == {"max_new_tokens": 64, "temperature": 0.0}
    from eagle3kit.data.backends import render_prompt_ids

    assert sent["input_ids"] == render_prompt_ids(
        smollm2_tokenizer, [{"role": "user", "content": "What is 0 + 0?"}]
    )


def test_plant_in_folder_writes_what_a_broken_converter_would(drafter_dir, tmp_path):
    from safetensors.torch import load_file

    from eagle3kit.diagnose.faults import plant_in_folder

    cfg = json.loads((drafter_dir / "config.json").read_text())
    assert "fc.weight" not in load_file(
        str(plant_in_folder(drafter_dir, tmp_path / "a", "fc_missing") / "model.safetensors")
    )
    up = json.loads(
        (plant_in_folder(drafter_dir, tmp_path / "b", "aux_ids_plus_1") / "config.json").read_text()
    )
    assert (
        up["eagle_aux_hidden_state_layer_ids"]
        == [3, 5, 6]
        == [i + 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    )
    assert up["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # SGLang numbering, +1 too
    nbr = json.loads(
        (plant_in_folder(drafter_dir, tmp_path / "c", "norm_before_residual") / "config.json").read_text()
    )
    assert cfg["norm_before_residual"] is False and nbr["norm_before_residual"] is True
    with pytest.raises(ConfigError, match="exists"):
        plant_in_folder(drafter_dir, tmp_path / "c", "fc_missing")
    with pytest.raises(ConfigError, match="cannot plant 'norm_output'"):
        plant_in_folder(drafter_dir, tmp_path / "d", "norm_output")


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("backwards", "counters went backwards during prompt 1"),
        ("outside", "token ids outside [0, 49152) for prompt 1 (e.g. 1000000000)"),
        ("empty", "no output tokens for prompt 1"),
    ],
)
def test_engine_answers_that_would_give_a_wrong_diagnosis_stop_it(
    mode, expected, drafter_dir, tiny_target_dir, tmp_path, smollm2_tokenizer
):
    """Counters that fall (a restart mid-run), ids the target does not have, no output: exit 2,
    named, nothing written (found by a bad-input attack on the first version, which reported them)."""
    with _Server(fake_vllm(smollm2_tokenizer, mode=mode)) as server:
        res = against(server, drafter_dir, tiny_target_dir, tmp_path)
    assert res["exit_code"] == 2 and expected in " ".join(res["output"].split()), res["output"]
    assert not (tmp_path / "rep").exists()


def test_a_client_template_that_does_not_render_is_named(
    drafter_dir, tiny_target_dir, tmp_path, smollm2_tokenizer
):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ messages[0]['content'] ")  # unterminated
    with _Server(fake_vllm(smollm2_tokenizer)) as server:
        res = against(server, drafter_dir, tiny_target_dir, tmp_path, "--chat-template", str(bad))
    said = " ".join(res["output"].split())
    assert res["exit_code"] == 2 and "does not render the prompts (TemplateSyntaxError" in said, res["output"]


# DFlash: the hypotheses of a block drafter, on a tiny drafter for the tiny Llama target
@pytest.fixture(scope="module")
def dflash_dir(tiny_target_dir, tmp_path_factory):
    """A DFlash drafter (2 layers, block 4, mask token 5, target layers [1, 5]: aux ids 2 and 6) for the
    tiny 8-layer Llama target, in vLLM's layout, float32, random."""
    from transformers import AutoConfig

    from eagle3kit.drafters.dflash.folder import write_dflash
    from eagle3kit.drafters.dflash.network import DFlashConfig, DFlashDrafter

    torch.manual_seed(0)
    tc = AutoConfig.from_pretrained(tiny_target_dir)
    d = DFlashDrafter(DFlashConfig.from_target(tc, 5, num_layers=2, block_size=4, target_layer_ids=[1, 5]))
    for p in d.parameters():  # norms away from 1, weights large enough that the context moves the drafts
        p.data.normal_(1.0, 0.3) if p.dim() == 1 else p.data.normal_(0.0, 0.5)
    return write_dflash(d, tmp_path_factory.mktemp("df") / "drafter", dtype=torch.float32)


def test_the_dflash_hypotheses_are_the_layer_shifts_the_causal_block_and_other_mask_tokens(
    dflash_dir, smollm2_tokenizer
):
    from eagle3kit.drafters.dflash.faults import dflash_applicable, dflash_faults
    from eagle3kit.drafters.dflash.folder import read_dflash

    d = read_dflash(dflash_dir)
    cfg = {"mask_token_id": 7, "dflash_config": {"mask_token_id": 5}}  # a top-level id vLLM would not read
    faults = {f.name: f for f in dflash_faults(d, smollm2_tokenizer, cfg)}
    # SmolLM2's tokenizer: <|endoftext|> 0 is unk, <|im_start|> 1 bos, <|im_end|> 2 eos and pad
    assert list(faults) == [
        "target_layer_ids_plus_1",
        "target_layer_ids_minus_1",
        "block_causal",
        "mask_token:7",
        "mask_token:2",
        "mask_token:1",
        "mask_token:0",
    ]
    assert faults["mask_token:2"].mask_token == 2 and "'<|im_end|>'" in faults["mask_token:2"].what
    assert dflash_applicable(faults["target_layer_ids_plus_1"], d, 8) is None  # aux 3 and 7 of 8 layers
    assert "outside [1, 6]" in dflash_applicable(faults["target_layer_ids_plus_1"], d, 7)
    assert "outside [1, 7]" in dflash_applicable(faults["target_layer_ids_minus_1"], _shifted(d, [0, 5]), 8)


def _shifted(d, target_layer_ids):
    import dataclasses

    from eagle3kit.drafters.dflash.network import DFlashDrafter

    return DFlashDrafter(dataclasses.replace(d.cfg, target_layer_ids=target_layer_ids))


def test_each_dflash_fault_drafts_what_the_folder_with_it_planted_drafts(
    dflash_dir, tiny_target_dir, tmp_path, smollm2_tokenizer
):
    """On one sequence of the tiny target, what diagnose simulates for a fault — the layers and block
    settings ``dflash_planted`` gives for the hypothesis ``dflash_faults`` lists — equals what the drafter
    read from a folder with that fault written in drafts (layers one later; mask token 0), and differs
    from the drafter as trained; the causal block changes the drafts, and `check` names it planted."""
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.diagnose.simulate import capture_sequences
    from eagle3kit.drafters.dflash.faults import dflash_faults, dflash_planted, plant_dflash_in_folder
    from eagle3kit.drafters.dflash.folder import read_dflash
    from eagle3kit.drafters.dflash.objective import block_drafts
    from eagle3kit.model.target import load_target
    from eagle3kit.serve.check import check_drafter

    target = load_target(TargetConfig(model=str(tiny_target_dir), dtype="float32"), device="cpu")
    d = read_dflash(dflash_dir).eval()
    g = torch.Generator().manual_seed(3)
    seqs = capture_sequences(
        target, [torch.randint(10, 1000, (12,), generator=g).tolist()],
        [torch.randint(10, 1000, (20,), generator=g).tolist()], {2, 3, 6, 7},
    )  # fmt: skip

    def drafts(drafter, layers, **kw):
        return block_drafts(drafter, target, seqs.aux(0, layers), seqs.ids[0], 12, 3, **kw)

    base = drafts(d, [2, 6])
    assert base.shape == (19, 3) and torch.equal(drafts(d, [2, 6], mask_token_id=5), base)
    faults = {
        f.name: f
        for f in dflash_faults(d, smollm2_tokenizer, json.loads((dflash_dir / "config.json").read_text()))
    }
    for name, layers, mask in (("target_layer_ids_plus_1", [3, 7], 5), ("mask_token:0", [2, 6], 0)):
        ids, kw = dflash_planted(faults[name], d)  # what diagnose simulates for the hypothesis
        filled = d.cfg.mask_token_id if kw["mask_token_id"] is None else kw["mask_token_id"]
        assert ids == layers and filled == mask and not kw["causal"], name
        p = read_dflash(plant_dflash_in_folder(dflash_dir, tmp_path / name.replace(":", "_"), name)).eval()
        # the planted folder is read as the engine reads it: its layers, its mask token
        assert p.cfg.aux_layer_ids == layers and p.cfg.mask_token_id == mask
        want = drafts(p, p.cfg.aux_layer_ids)  # the planted drafter on the layers its config names
        assert torch.equal(drafts(d, ids, **kw), want) and not torch.equal(want, base), name
    ids, kw = dflash_planted(faults["block_causal"], d)
    assert ids == [2, 6] and kw["causal"] is True and not torch.equal(drafts(d, ids, **kw), base)
    causal = plant_dflash_in_folder(dflash_dir, tmp_path / "causal", "block_causal")
    assert json.loads((causal / "config.json").read_text())["dflash_config"]["causal"] is True
    assert "dflash_causal" in {
        f.code for f in check_drafter(causal, TargetConfig(model=str(tiny_target_dir)))
    }
    with pytest.raises(ConfigError, match="cannot plant 'fc_missing' in a DFlash folder"):
        plant_dflash_in_folder(dflash_dir, tmp_path / "x", "fc_missing")


def test_diagnose_of_a_dflash_drafter_simulates_block_drafting_and_its_own_hypotheses(
    dflash_dir, tiny_target_dir, tmp_path, smollm2_tokenizer
):
    """Against the stand-in (16 output ids a prompt, 3 draft tokens a step): diagnose reads the DFlash
    folder, simulates block drafting at K 3 (the untrained drafter accepts nothing: τ 1.0), tries the
    DFlash hypotheses only, and refuses --other-vocab (a DFlash drafter has no d2t)."""
    with _Server(fake_vllm(smollm2_tokenizer)) as server:
        res = against(server, dflash_dir, tiny_target_dir, tmp_path, "--parity", "never")
        bad = diagnose_cli(
            server.url, dflash_dir, prompts_file(tmp_path), tmp_path / "rep2", "--target", str(tiny_target_dir),
            "--other-vocab", str(dflash_dir),
        )  # fmt: skip
    assert res["exit_code"] == 1, res["output"]
    rep = json.loads((tmp_path / "rep" / "diagnose.json").read_text())
    assert rep["k"] == 3 and rep["reference"]["tau"] == 1.0 and rep["reference"]["drafts"] == 3 * 15
    names = [h["name"] for h in rep["hypotheses"]]
    assert names[:3] == ["target_layer_ids_plus_1", "target_layer_ids_minus_1", "block_causal"]
    assert {n for n in names[3:]} == {"mask_token:0", "mask_token:1", "mask_token:2"}
    assert rep["advice"]["draft_vocab_coverage_of_served_tokens"] == 1.0
    assert (
        bad["exit_code"] == 2
        and "a DFlash drafter drafts from the target's whole vocabulary" in bad["output"]
    )
