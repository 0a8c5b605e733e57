"""One family end to end (issue 20): its tiny target saved as a folder (:mod:`family_targets`),
a whole ``eagle3kit run`` on it (prompts → generate with the target itself → … → evaluate
simulate on held-out prompts), ``check`` on the exported drafter, and — where vLLM's CPU build
serves the target — a vLLM server with the drafter (EAGLE-3, K = 3) on the same held-out prompts:
τ from vLLM's own counters against ``evaluate``'s τ, and vLLM's outputs with speculation against
the greedy continuations ``evaluate`` measured (vLLM's own, without speculation).

Used by ``tests/test_family_runs.py`` (CI size) and ``benchmarks/families.py`` (the README table).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import family_targets
from conftest import GSM8K

# train: the optimizer and batching these runs' τ margins were set with (the defaults before
# 2026-12-04): on a few hundred tiny samples τ moves by more than the margin with the batches' order
CONFIG = """run_dir: {run}
target: {{model: {target}}}
prompts:
  sources: [{{path: {gsm8k}, name: gsm8k, stop: -80, limit: {prompts}}}]
  heldout_fraction: 0.0
generate: {{max_new_tokens: {tokens}}}
vocab: {{draft_vocab_size: 1024}}
train: {{ttt_steps: 3, epochs: {epochs}, lr: {lr}, tokens_per_step: 2048, betas: [0.9, 0.95], shuffle: batches}}
evaluate:
  k: 3
  max_new_tokens: {tokens}
  num_prompts: {eval_prompts}
  untrained_baseline: false
  sets: [{{path: {gsm8k}, name: gsm8k_heldout, start: -80}}]
"""


EVAL_PROMPTS = 8


def run_pool(workers: int = 2):
    """A process pool for whole family runs side by side: each worker (spawned, so no engine state is
    inherited) computes on one core of its own — its affinity, torch's threads and vLLM's OpenMP
    binding — so two tiny runs, whose steps are too small to use a second core, fill both cores
    instead of leaving one mostly idle. Results and exceptions come back pickled."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    cores, queue = sorted(os.sched_getaffinity(0)), ctx.Queue()
    for i in range(workers):
        queue.put(cores[i % len(cores)])
    return ProcessPoolExecutor(workers, mp_context=ctx, initializer=_one_core, initargs=(queue,))


def _one_core(queue) -> None:
    """A :func:`run_pool` worker's set-up: take a core from ``queue`` and compute only there."""
    import torch

    core = queue.get()
    os.sched_setaffinity(0, {core})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    torch.set_num_threads(1)


def release_engines() -> None:
    """Shut down the in-process vLLM engine a run leaves cached (its KV cache is GBs)."""
    from eagle3kit.data.backends import release_vllm_engine, vllm_available

    if vllm_available():
        release_vllm_engine()


def write_config(
    work: Path,
    folder: Path,
    prompts: int = 200,
    tokens: int = 48,
    epochs: int = 20,
    eval_prompts: int = EVAL_PROMPTS,
    lr: float = 1.0e-3,
) -> Path:
    path = work / "config.yaml"
    path.write_text(
        CONFIG.format(
            run=work / "run",
            target=folder,
            gsm8k=GSM8K,
            prompts=prompts,
            tokens=tokens,
            epochs=epochs,
            eval_prompts=eval_prompts,
            lr=lr,
        )
    )
    return path


def run_family(
    family: str,
    work: str | Path,
    smollm2_dir: str | Path,
    prompts: int = 200,
    tokens: int = 48,
    epochs: int = 20,
    eval_prompts: int = EVAL_PROMPTS,
    serve: bool = True,
    lr: float = 1.0e-3,
) -> dict:
    """The family's row: whole-run result, ``check``'s verdict, and vLLM's (see the module)."""
    from eagle3kit.core.config import TargetConfig, load_config
    from eagle3kit.core.rundir import read_jsonl
    from eagle3kit.pipeline import run_all
    from eagle3kit.serve.check import check_drafter

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    folder = family_targets.build(family, work / "target", smollm2_dir)
    cfg_path = write_config(work, folder, prompts, tokens, epochs, eval_prompts, lr)
    report = run_all(load_config(cfg_path))
    from eagle3kit.data import backends

    assert not backends._VLLM, "run_all returned with its vLLM engine still cached (GBs of KV cache held)"
    drafter = work / "run" / "drafter"
    findings = check_drafter(drafter, TargetConfig(model=str(folder)))
    errors = [f for f in findings if f.severity == "error"]
    ev = report["evaluate"]["sets"]["gsm8k_heldout"]
    manifest = json.loads((work / "run" / "manifest.json").read_text())
    row = {
        "family": family,
        "stages": sorted(manifest["stages"]),  # the stages the run recorded as done
        "generate_backend": manifest["stages"]["generate"]["inputs"]["backend"],
        "evaluate_tau": ev["tau"],
        "check": "servable" if not errors else "refused",
        "check_errors": [f"{f.code}: {f.message}" for f in errors],
        "findings": [f.code for f in findings],
    }
    if any(f.code == "mla_cpu_eagle3" for f in errors):  # and as check sees a server started with MLA off
        with env(VLLM_MLA_DISABLE="1"):
            row["check_errors_without_mla"] = [
                f"{f.code}: {f.message}"
                for f in check_drafter(drafter, TargetConfig(model=str(folder)))
                if f.severity == "error"
            ]
    conts = [r for _, r in read_jsonl(ev["continuations"])]
    row["evaluate_backend"] = conts[0]["backend"]
    row["_serve"] = (folder, drafter, conts, tokens, work)  # what serve_rows needs; summary() leaves it out
    if serve:
        serve_rows([row])
    return row


def serve_rows(rows: list[dict], wait_s: float = 400) -> None:
    """For each row of :func:`run_family`: vLLM's server for its target with its drafter (K = 3),
    launched as :class:`VLLMServer` does for that target (:func:`spawn_server`, unless already
    spawned), then measured one at a time (:func:`finish_row`). Adds the server's keys to each
    row in place and kills the servers."""
    try:
        for row in rows:
            if "_server" not in row:
                spawn_server(row)
        for row in rows:
            finish_row(row, wait_s)
    finally:
        for row in rows:
            if "_server" in row:
                row["_server"].kill()


def finish_row(row: dict, wait_s: float = 400) -> dict:
    """Wait for the row's server (:func:`spawn_server`, spawned here when it was not yet), measure it on the held-out
    prompts, sent as token ids (the prompts ``evaluate`` rendered), and kill it: adds ``vllm``
    ("served" or "refused", with ``vllm_error`` from its log) and the measurements to the row."""
    from eagle3kit.core.engines import wait_servers

    if row.get("_server") is None:  # not spawned when its run ended (another server was up)
        spawn_server(row)
    srv = row["_server"]
    try:
        err = wait_servers([srv], wait_s)[0]
        if err:
            srv.kill()
            log = srv.log_path.read_text(errors="replace").strip().splitlines()
            row.update(
                {"vllm": "refused", "vllm_error": next((x for x in reversed(log) if "Error" in x), err)[:300]}
            )
        else:
            row.update(measure_served(srv.url, *row["_serve"][2:4]))
            row["diagnose"] = diagnose_served(srv.url, row)
    finally:
        srv.kill()
    return row


def diagnose_served(url: str, row: dict) -> dict:
    """`eagle3kit diagnose` (in process, no parity capture) against the row's server on the first
    held-out GSM8K questions, given the drafter as trained: each prompt sent alone, the engine's
    per-prompt τ against the drafter's simulated on the engine's own outputs, and against the drafter
    reading every aux layer one later or earlier — a check at the resolution of one layer, where the
    pooled τ of a tiny target moves by 0.1%. Returns the verdict, the reference and the shifts."""
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.diagnose.stage import run_diagnose

    folder, drafter, conts, tokens, work = row["_serve"]
    questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[-80:]][: len(conts)]
    prompts = work / "diagnose_prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in questions)
    )
    rep = run_diagnose(
        url, drafter, TargetConfig(model=str(folder)), prompts=str(prompts), num_prompts=len(questions),
        max_tokens=tokens, parity="never", out=work / "diagnose", model="target",
    )  # fmt: skip
    keep = ("tau", "distance", "within", "explains", "skipped", "indistinguishable")
    return {
        "verdict": rep["verdict"],
        "engine_tau": rep["engine"]["tau"],
        "reference": {k: rep["reference"][k] for k in ("tau", "distance", "within")},
        "hypotheses": {h["name"]: {k: h[k] for k in keep if k in h} for h in rep["hypotheses"]},
    }


def spawn_server(row: dict) -> None:
    """Start (and return at once) vLLM's server for a :func:`run_family` row's target with its
    drafter, as ``row["_server"]``: a start is mostly one core's work for about 50 s, so a test
    spawns each family's server as soon as its run ends, beside the next family's run (which
    leaves about half of the second core idle), and :func:`finish_row` measures it (from a thread,
    while that run goes on)."""
    from eagle3kit.core.engines import VLLMServer, eagle3_speculative_config, free_port

    folder, drafter, _, _, work = row["_serve"]
    srv = VLLMServer(
        folder,
        free_port(),
        work / "vllm.log",
        served_name="target",
        max_model_len=1024,
        speculative=eagle3_speculative_config(drafter, 3),
    )
    row.update({"vllm_launch": srv.launch.notes, "vllm_env": srv.launch.env, "_server": srv})
    srv.spawn()


def measure_served(url: str, conts: list[dict], tokens: int) -> dict:
    """τ from the server's counters over the held-out prompts, and its outputs against the greedy
    continuations ``evaluate`` measured."""
    from eagle3kit.core.engines import spec_decode_counters, spec_decode_delta

    before = spec_decode_counters(url)
    ids = completion_ids(url, [c["prompt_ids"] for c in conts], tokens)
    acc = spec_decode_delta(before, spec_decode_counters(url))
    same = sum(
        a == c["continuation_ids"][: len(a)] and len(a) == len(c["continuation_ids"])
        for a, c in zip(ids, conts)
    )
    return {
        "vllm": "served",
        "vllm_tau": acc["tau"],
        "vllm_drafts": acc["drafts"],
        "vllm_accepted": acc["accepted"],
        "greedy_identical": f"{same}/{len(conts)}",
        "vllm_outputs": ids,
    }


def completion_ids(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions of token-id prompts from vLLM's ``/v1/completions`` (its
    ``return_token_ids``), all prompts in one request, in order."""
    import httpx

    r = httpx.post(
        url + "/v1/completions",
        timeout=600,
        json={
            "model": "target",
            "prompt": prompts,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
        },
    )
    r.raise_for_status()
    return [list(c["token_ids"]) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def feature_sources_story(
    work: str | Path, smollm2_dir: str | Path, prompts: int = 200, tokens: int = 48, epochs: int = 20
) -> dict:
    """DeepSeek-V3 without rope scaling, where vLLM's CPU build computes other hidden states than
    transformers (tests/test_deepseek_numerics.py): a whole run (its drafter trains on the
    transformers target's features, online), the same samples' features extracted by both
    backends and compared by ``parity``, a second drafter trained with the same seed on the vLLM
    features, and both drafters evaluated (simulate, transformers) and served by vLLM."""
    from eagle3kit.core.config import load_config
    from eagle3kit.core.rundir import RunDir, read_jsonl
    from eagle3kit.eval.evaluate import run_evaluate
    from eagle3kit.model.target import load_target
    from eagle3kit.pipeline import run_all
    from eagle3kit.serve.export import run_export
    from eagle3kit.serve.parity import compare_features
    from eagle3kit.train.extract import run_extract
    from eagle3kit.train.stage import run_train

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    folder = family_targets.build("deepseek_v3_default_rope", work / "target", smollm2_dir)
    cfg_path = write_config(work, folder, prompts, tokens, epochs)
    report = run_all(load_config(cfg_path))
    cfg = load_config(cfg_path)
    run = RunDir(cfg.run_dir)
    target = load_target(cfg.target, device="cpu")
    feats = {"transformers": work / "features-transformers", "vllm": work / "features-vllm"}
    run_extract(cfg, run, target, out_dir=str(feats["transformers"]))
    cfg.extract.backend = "vllm"
    run_extract(cfg, run, target, out_dir=str(feats["vllm"]))
    release_engines()
    parity = compare_features(target, feats["transformers"], feats["vllm"])
    out = {"parity": {"verdict": parity["verdict"], "layers": parity["layers"]}, "drafters": {}}
    second = RunDir(work / "run-vllm-features")
    for f in ("tokens.safetensors", "vocab.safetensors", "manifest.json"):
        (second.path / f).write_bytes((run / f).read_bytes())
    vcfg = cfg.model_copy(deep=True)
    vcfg.run_dir, vcfg.train.features = str(second.path), str(feats["vllm"])
    run_train(vcfg, second, target)
    run_export(vcfg, second)
    ev_b = run_evaluate(vcfg, second, target)
    release_engines()
    rows = {}
    for name, run_dir, ev in (("transformers", run, report["evaluate"]), ("vllm", second, ev_b)):
        conts = [r for _, r in read_jsonl(ev["sets"]["gsm8k_heldout"]["continuations"])]
        (work / f"serve-{name}").mkdir(parents=True, exist_ok=True)
        rows[name] = {
            "evaluate_tau": ev["tau"],
            "_serve": (folder, run_dir / "drafter", conts, tokens, work / f"serve-{name}"),
        }
    serve_rows(list(rows.values()))
    for name, row in rows.items():
        out["drafters"][name] = {
            k: v for k, v in row.items() if k != "vllm_outputs" and not k.startswith("_")
        }
    return out


def table(result: dict) -> str:
    """The README's family table (Markdown) and, when present, the feature-source story's."""
    lines = [
        "| family | whole run | vLLM serves (path) | τ vLLM counters | τ evaluate | greedy with = without spec. | "
        "check |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        path = (
            ("MLA disabled" if r.get("vllm_env", {}).get("VLLM_MLA_DISABLE") else "as is")
            if r.get("vllm") == "served"
            else "no"
        )
        tau = (
            f"{r['vllm_tau']:.4f} ({r['vllm_accepted']}/{r['vllm_drafts']})"
            if r.get("vllm") == "served"
            else "—"
        )
        check = r["check"] + (
            " (servable with VLLM_MLA_DISABLE=1)" if r.get("check_errors_without_mla") == [] else ""
        )
        lines.append(
            f"| {r['family']} | {r['run']} | {r.get('vllm', '—')} ({path}) | {tau} | {r['evaluate_tau']:.4f} | "
            f"{r.get('greedy_identical', '—')} | {check} |"
        )
    story = result.get("feature_sources")
    if story:
        lines += [
            "",
            f"parity, transformers vs vLLM features (DeepSeek-V3, no rope scaling): {story['parity']['verdict']}",
            "| layer | cosine | rel. error | top-1 |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {k} | {v['cosine']:.6f} | {v['relative_error']:.2e} | {v['top1_agreement']:.3f} |"
            for k, v in story["parity"]["layers"].items()
        ]
        lines += [
            "",
            "| drafter trained on | τ evaluate (transformers) | τ vLLM counters |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {k} features | {d['evaluate_tau']:.4f} | {d.get('vllm_tau', float('nan')):.4f} |"
            for k, d in story["drafters"].items()
        ]
    return "\n".join(lines)


@contextlib.contextmanager
def env(**values: str):
    """Set environment variables for the block."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def untrained_drafter(folder: str | Path, out: str | Path, draft_vocab_size: int = 512) -> Path:
    """An exported, untrained (seeded) drafter shaped for the target in ``folder``: enough for an
    engine to load and start (tests of what engines refuse)."""
    import torch

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.draft_vocab import DraftVocab
    from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3kit.model.folder import export_drafter
    from eagle3kit.model.target import default_aux_layer_ids
    from eagle3kit.model.target_files import load_target_config

    _, tc = load_target_config(TargetConfig(model=str(folder)))
    ids = list(default_aux_layer_ids(int(tc.num_hidden_layers)))
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(tc, draft_vocab_size, ids))
    d.set_vocab(DraftVocab(ids=torch.arange(draft_vocab_size) * 3, vocab_size=int(tc.vocab_size)))
    prov = {"aux_layer_ids": {"convention": "hf_output_hidden_states_index", "ids": ids}}
    return export_drafter(d, out, provenance=prov, overwrite=True)


def summary(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items() if k != "vllm_outputs" and not k.startswith("_")})
