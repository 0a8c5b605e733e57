"""Stage ``diagnose``: a server accepts less than the drafter should — is the drafter bad, or the
engine's integration of it? Answered from one set of requests, without restarting the server.

1. The engine: each prompt sent alone, greedy; its prompt ids, output ids and counter deltas
   (:mod:`eagle3kit.diagnose.engine`); bench's template check on the same prompts first.
2. eagle3kit: simulated greedy-chain acceptance of the drafter on exactly those sequences at the
   engine's K (:mod:`eagle3kit.diagnose.simulate`). Simulate reproduces the engine's τ when the
   engine runs the drafter as trained (docs/limits.md: 1.531 against 1.527 on SmolLM2).
3. Agree (within the stated noise): the drafter is what it is — where it loses, per position and
   per category, and how much of the served text its draft vocabulary covers.
4. The engine lower: each known fault (:data:`eagle3kit.diagnose.faults.FAULTS`) simulated on the
   same sequences; the one that reproduces the engine's numbers is named with its fix. When none
   does and vLLM can run here, the engine's own hidden states are captured on the same sequences
   (the ``extract --backend vllm`` path) and compared layer by layer (``parity``'s measures); if
   the drafter on those states reproduces the engine, the verdict is "other numerics".
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from pathlib import Path

import httpx

from eagle3kit.core.config import Config, TargetConfig
from eagle3kit.core.kinds import kind_for_folder
from eagle3kit.data.backends import render_prompt_ids
from eagle3kit.diagnose.engine import EngineError, EngineRun, measure_engine
from eagle3kit.diagnose.record import (
    DiagnoseError,
    check_record_answers,
    read_engine_record,
    write_engine_record,
)
from eagle3kit.diagnose.report import advice, write_report
from eagle3kit.diagnose.simulate import (
    DISTANCE_FLOOR,
    DISTANCE_RATIO,
    Sequences,
    capture_sequences,
    compare,
    engine_per_prompt_tau,
    explains,
    simulate_on,
)
from eagle3kit.model.target import Target, load_target, pick_device
from eagle3kit.serve.bench import BenchError
from eagle3kit.serve.check import check_drafter
from eagle3kit.serve.inputs import measuring_prompts
from eagle3kit.serve.parity import StateAgreement, first_drift, tolerances_for, verdict
from eagle3kit.serve.server_probe import (
    auth_headers,
    check_template,
    detect_engine,
    first_difference,
    served_model,
)
from eagle3kit.train.extract import engine_features, start_capture


def run_diagnose(
    base_url: str | None,
    drafter_dir: str | Path,
    target_cfg: TargetConfig,
    prompts: str | None = None,
    engine: str | None = None,
    num_prompts: int = 20,
    max_tokens: int = 64,
    other_vocab: list[str] | None = None,
    parity: str = "auto",
    rel_tol: float = 0.02,
    out: str | Path = "diagnose",
    overwrite: bool = False,
    api_key: str | None = None,
    device: str = "auto",
    target: Target | None = None,
    chat_template: str | None = None,
    model: str | None = None,
    timeout: float = 600.0,
    config: Config | None = None,
    replay: str | Path | None = None,
) -> dict:
    """Diagnose the server at ``base_url`` serving ``target_cfg``'s target with ``drafter_dir``'s
    drafter (module docstring). Writes ``diagnose.json``, ``diagnose.md`` and ``engine.json`` (what the
    engine answered, for ``replay``) into ``out``.

    Args:
        prompts: a prompt file (any format ``prompts.sources`` reads) or a ``datasets`` dataset
            (:func:`~eagle3kit.serve.inputs.measuring_prompts`); None: the ``heldout.jsonl`` of the run the
            drafter folder belongs to, else ``config``'s evaluate sets. num_prompts: how many, in order;
            max_tokens: new tokens per prompt. parity: ``auto`` (capture the engine's states when no
            fault matches), ``always`` or ``never``. rel_tol: the relative τ tolerance (the noise
            floor; :func:`eagle3kit.diagnose.simulate.compare`). device: where the target and drafter run
            (``auto``: CUDA when present). target: the target already loaded from ``target_cfg`` (None:
            loaded here). chat_template: a Jinja file, or a ``tokenizer_config.json`` holding one, that
            the client renders prompts with; they are then sent as token ids, and compared with the
            target's own template first. model: the served model id (default: the server's first).
            timeout: seconds per request. replay: a diagnose ``--out`` folder (or its ``engine.json``)
            whose recorded engine answers are diagnosed again here, no server contacted (the target side
            on another machine: where the target fits).
    Returns: the report; its ``verdict`` is ``agree``, ``fault`` or ``unexplained``.
    Raises: DiagnoseError, ConfigError, DataError, BenchError on bad input (no server, no drafter, one
        for another target, unreadable prompts, an existing report); EngineError when the server fails.
    """
    t0 = time.perf_counter()
    out = Path(out)
    folder = _checked_inputs(drafter_dir, out, overwrite, parity, engine, rel_tol)
    _checked_files(other_vocab, chat_template)
    side = _engine_side(
        base_url, replay, prompts, config, folder, num_prompts, max_tokens, engine, model, api_key
    )
    parity = "never" if replay is not None and parity == "auto" else parity  # capturing needs the engine
    target, kind, drafter = _loaded(target_cfg, target, folder, pick_device(device))
    faults = kind.faults(drafter, target.tokenizer, folder, other_vocab)
    report = _header(side, folder, target_cfg)
    timings = {"setup_s": round(time.perf_counter() - t0, 1)}
    run = _engine_run(side, report, target, chat_template, timeout)
    timings["engine_s"] = round(run.seconds, 1)
    eng, per_e = run.totals(), engine_per_prompt_tau(run.per_prompt)
    report["engine"] = {**eng, "per_prompt_tau": [None if t is None else round(t, 4) for t in per_e]}
    report["k"] = int(round(eng["k"])) if eng["k"] else 1
    t1 = time.perf_counter()
    seqs = _simulate(report, faults, kind, drafter, target, run, side["rows"], per_e, rel_tol)
    timings["simulate_s"] = round(time.perf_counter() - t1, 1)
    agree = report["reference"]["within"]
    matched = [h for h in report["hypotheses"] if h.get("explains")]
    warned = any(" engine_numerics:" in f for f in report["check_findings"])
    if side["name"] == "vllm" and (
        parity == "always" or (parity == "auto" and not matched and (not agree or warned))
    ):
        # the engine's own states: the other-numerics case (and, with --parity always, a check of them)
        t2 = time.perf_counter()
        report["numerics"] = _numerics(target_cfg, target, kind, drafter, seqs, report, per_e, rel_tol)
        timings["parity_s"] = round(time.perf_counter() - t2, 1)
    report["verdict"], report["finding"] = _verdict(report, agree, matched)
    report["timings"] = {**timings, "total_s": round(time.perf_counter() - t0, 1)}
    write_report(report, out)
    if replay is None:
        write_engine_record(out, report, side["rows"], run)
    return report


def _engine_side(base_url, replay, prompts, config, folder, n, max_tokens, engine, model, api_key) -> dict:
    """Who answers and what is asked: ``{base, name (vllm or sglang), version, model, headers, label (of
    the prompts), rows, max_tokens, record}`` — from the server at ``base_url`` (detected, the prompts
    resolved by :func:`~eagle3kit.serve.inputs.measuring_prompts`), or from the ``replay`` record (its
    prompts and token limit; no server contacted).

    Raises: DiagnoseError (a bad record, no server), ConfigError/DataError (no prompts)."""
    if replay is not None:
        rec = read_engine_record(replay)
        srv = rec["server"]
        return {
            "base": srv["url"],
            "name": srv["engine"],
            "version": srv.get("version"),
            "model": srv["model"],
            "headers": {},
            "label": rec["prompts"]["source"],
            "rows": rec["rows"],
            "max_tokens": rec["max_tokens"],
            "record": rec,
            "replay": str(replay),
        }
    base, headers = _base_url(base_url or ""), auth_headers(api_key)
    label, rows = measuring_prompts(prompts, config, folder, n)
    found = detect_engine(base, headers)
    name = _engine_name(found["name"], engine, base)
    return {
        "base": base,
        "name": name,
        "version": found.get("version"),
        "model": model or served_model(base, headers),
        "headers": headers,
        "label": label,
        "rows": rows,
        "max_tokens": max_tokens,
        "record": None,
    }


def _engine_run(side: dict, report: dict, target, chat_template, timeout) -> EngineRun:
    """The engine's answers (its :class:`EngineRun`) and the report's ``template``: the replayed record's,
    or bench's template check (or the client's, ``chat_template``) and then one request per prompt."""
    if side["record"] is not None:
        check_record_answers(side["record"], target.vocab_size)
        report["template"], report["replayed_from"] = side["record"]["template"], side["replay"]
        return EngineRun(**side["record"]["run"])
    base, model, rows = side["base"], side["model"], side["rows"]
    if chat_template:
        report["template"], client_ids = _client_template(chat_template, target, rows)
    else:
        report["template"], client_ids = _template(base, model, target, rows, side["headers"]), None
    return measure_engine(
        base,
        model,
        rows,
        side["max_tokens"],
        side["name"],
        target.tokenizer,
        side["headers"],
        timeout,
        client_ids,
        target.vocab_size,
    )


def _header(side: dict, folder: Path, target_cfg: TargetConfig) -> dict:
    """The report's first keys: the server, the drafter, the target, the prompts, and what
    ``check`` says of the drafter folder for this engine."""
    findings = check_drafter(folder, target_cfg, engine=side["name"])
    return {
        "server": {
            "url": side["base"],
            "engine": side["name"],
            "version": side["version"],
            "model": side["model"],
        },
        "drafter": str(folder),
        "target": target_cfg.model,
        "prompts": {"source": side["label"], "count": len(side["rows"])},
        "max_tokens": side["max_tokens"],
        "check_findings": [f"{f.severity} {f.code}: {f.message}" for f in findings],
    }


def _base_url(url: str) -> str:
    """The server root: ``/v1`` and trailing slashes dropped, credentials in the URL refused.

    Raises:
        DiagnoseError: not an http(s) URL with a host, or one holding a user name or password."""
    try:
        u = httpx.URL(url.strip())
    except (httpx.InvalidURL, TypeError) as e:
        raise DiagnoseError(
            f"--base-url {url!r} is not a URL ({e}); give the server root, e.g. http://127.0.0.1:8000"
        ) from None
    if u.scheme not in ("http", "https") or not u.host:
        raise DiagnoseError(
            f"--base-url {url!r} is not an http(s) URL; give the server root, e.g. http://127.0.0.1:8000"
        )
    if u.userinfo:
        raise DiagnoseError(
            "--base-url holds a user name or password; put the key in the environment variable --api-key-env names"
        )
    return str(u).rstrip("/").removesuffix("/v1").rstrip("/")


def _checked_files(other_vocab: list[str] | None, chat_template: str | None) -> None:
    """``--other-vocab`` and ``--chat-template`` exist, checked before the server is contacted.

    Raises:
        DiagnoseError: naming the option whose file is missing."""
    for p in other_vocab or []:
        if not Path(p).exists():
            raise DiagnoseError(
                f"--other-vocab {p} does not exist; give a vocab.safetensors or a drafter folder"
            )
    if chat_template and not Path(chat_template).is_file():
        raise DiagnoseError(
            f"--chat-template {chat_template} is no file; give a Jinja file or a tokenizer_config.json"
        )


def _checked_inputs(drafter_dir, out: Path, overwrite: bool, parity: str, engine, rel_tol) -> Path:
    """The drafter folder, with the local options checked before the server is contacted.

    Raises:
        DiagnoseError: an existing report (without ``overwrite``) or an ``--out`` that is a file, a bad
            ``parity`` or ``engine``, no drafter folder or config."""
    if out.exists() and not out.is_dir():
        raise DiagnoseError(f"--out {out} is a file; give a folder for diagnose.json and diagnose.md")
    there = [str(out / n) for n in ("diagnose.json", "diagnose.md") if (out / n).exists()]
    if there and not overwrite:
        raise DiagnoseError(
            f"{' and '.join(there)} already there: pass --out to a new folder, or --overwrite"
        )
    if parity not in ("auto", "always", "never"):
        raise DiagnoseError(f"--parity must be auto, always or never, not {parity!r}")
    if engine not in (None, "vllm", "sglang"):
        raise DiagnoseError(f"--engine must be vllm or sglang, not {engine!r}")
    if not (0 <= rel_tol < 1 and math.isfinite(rel_tol)):
        raise DiagnoseError(f"--tolerance must be a fraction in [0, 1), not {rel_tol}")
    folder = Path(drafter_dir)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise DiagnoseError(f"--drafter {folder} {what}; give the drafter folder you trained")
    if not (folder / "config.json").is_file():
        raise DiagnoseError(f"--drafter {folder} holds no config.json; give the drafter folder you trained")
    return folder


def _loaded(target_cfg: TargetConfig, target: Target | None, folder: Path, dev):
    """``(target, kind, drafter)``: the drafter of the folder's kind loaded strictly, checked against the
    target, in its dtype.

    Raises:
        ConfigError, ExportError: a drafter for another target, or one that does not load."""
    target = target if target is not None else load_target(target_cfg, device=dev)
    kind = kind_for_folder(folder)
    drafter = kind.load(folder, target_cfg, target, dev)
    return target, kind, drafter.to(target.dtype)


def _simulate(report: dict, faults, kind, drafter, target, run, rows, per_e, rel_tol) -> Sequences:
    """The target's states on the engine's sequences (every layer a hypothesis reads), the drafter
    as trained and every fault simulated on them; fills the report's ``reference``, ``advice``,
    ``hypotheses``, ``noise`` and ``match_rule``. Returns the sequences with their states.

    Raises:
        DiagnoseError: the engine drafts more tokens a step than the drafter can."""
    k, tau_e = report["k"], report["engine"]["tau"]
    aux_ids, most = kind.aux_ids(drafter), kind.max_draft(drafter)
    if most is not None and k > most:
        raise DiagnoseError(
            f"the engine drafts {k} tokens a step, and the drafter drafts at most {most}: is the server serving "
            "this drafter?"
        )
    layers = set(aux_ids)
    for f in faults:
        if kind.applicable(f, drafter, target.num_layers) is None:
            layers |= {i + f.aux_shift for i in aux_ids}
    seqs = capture_sequences(target, run.prompt_ids, run.outputs, layers)
    ref = simulate_on(kind, drafter, target, seqs, k, aux_ids)
    ref_cmp = compare(tau_e, per_e, ref, rel_tol)
    report["reference"] = {**ref.as_dict(), **ref_cmp}
    report["noise"] = (
        f"engine and simulation agree when |τ_engine − τ_sim| ≤ {rel_tol:g} · τ_sim (both on the engine's own "
        "sequences, so only numerics that flip a near-tie separate them)"
    )
    report["advice"] = advice(kind, drafter, ref, seqs, [r.get("category") or "-" for r in rows])
    report["hypotheses"] = _hypotheses(faults, kind, drafter, target, seqs, k, tau_e, per_e, rel_tol)
    for h in report["hypotheses"]:
        if "skipped" not in h:
            h["explains"] = explains(h, report["reference"])
            # the fault changes no draft on these sequences (e.g. d2t offsets all 0 where drafts fall)
            h["indistinguishable"] = (h["tau"], h["distance"]) == (ref_cmp["tau"], ref_cmp["distance"])
    report["match_rule"] = (
        f"a hypothesis explains the engine when its τ is within the tolerance and its per-prompt τ distance is at "
        f"most {DISTANCE_RATIO:g} × the drafter-as-trained's and {DISTANCE_FLOOR:g} below it"
    )
    return seqs


def _engine_name(found: str, given: str | None, base: str) -> str:
    if found not in ("vllm", "sglang"):
        raise DiagnoseError(
            f"{base} is an OpenAI-compatible server but neither vLLM nor SGLang: diagnose reads the engine's "
            "own acceptance counters, which only those two give"
        )
    if given and given != found:
        raise DiagnoseError(
            f"--engine {given}, but the server at {base} is {found}; drop --engine or fix the URL"
        )
    return found


def _template(base: str, model: str, target, rows: list[dict], headers: dict) -> dict:
    """Bench's template check on the prompts: the server's rendering against the target's."""
    try:
        got = check_template(base, model, target.tokenizer, rows, headers=headers)
        return {"mismatch": False, **got}
    except BenchError as e:
        return {"mismatch": True, "message": str(e)}
    except httpx.HTTPError as e:
        raise EngineError(
            f"{base}/tokenize did not answer the template check ({type(e).__name__}); nothing was written: rerun "
            "diagnose once the server answers"
        ) from None


def _client_template(path: str, target, rows: list[dict]) -> tuple[dict, list[list[int]]]:
    """The prompts as a client rendering them with the template in ``path`` sends them, and the
    template check of that rendering against the target's own template.

    Raises:
        DiagnoseError: the file is missing or holds no template."""
    p = Path(path)
    try:
        text = p.read_text()
        template = json.loads(text)["chat_template"] if p.suffix == ".json" else text
        if isinstance(template, list):  # transformers' named-template form: [{"name", "template"}, …]
            template = next(
                (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
            )
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise DiagnoseError(
            f"--chat-template {path}: not a readable Jinja file or tokenizer_config.json with a chat_template"
        ) from None
    if not isinstance(template, str) or not template.strip():
        raise DiagnoseError(f"--chat-template {path}: the template is empty or not text")
    client = copy.deepcopy(target.tokenizer)
    client.chat_template = template
    try:
        sent = [render_prompt_ids(client, r["messages"]) for r in rows]
    except Exception as e:  # a Jinja syntax error, raise_exception(), a template of the wrong kind
        raise DiagnoseError(
            f"--chat-template {path} does not render the prompts ({type(e).__name__}: {str(e)[:160]}); fix the "
            "template"
        ) from None
    if not all(sent):
        raise DiagnoseError(f"--chat-template {path} renders a prompt to no tokens; fix the template")
    for r, ids in zip(rows, sent):
        ours = render_prompt_ids(target.tokenizer, r["messages"])
        if ids != ours:
            pos = first_difference(ours, ids)
            return {
                "mismatch": True,
                "method": "client rendering",
                "message": (
                    f"the client renders prompts with another chat template ({path}) than the target's: prompt "
                    f"{r['messages'][0]['content'][:60]!r} is {len(ids)} tokens there and {len(ours)} with the "
                    f"target's template, first difference at token {pos} "
                    f"({target.tokenizer.decode(ids[pos : pos + 3])!r} there). Render with the target's own "
                    "template (or send chat messages and let the server render them)"
                ),
            }, sent
    return {"mismatch": False, "method": "client rendering", "checked": len(rows)}, sent


def _hypotheses(faults: list, kind, drafter, target, seqs: Sequences, k, tau_e, per_e, rel_tol) -> list[dict]:
    """Each fault simulated on the engine's sequences and compared with the engine, or ``skipped``
    with the reason; what the faulty engine runs is the kind's :meth:`~eagle3kit.core.kinds.DrafterKind.planted`
    (a planted copy of an EAGLE-3 family drafter, or a block drafter filling its block as that engine does)."""
    out = []
    for f in faults:
        head = {"name": f.name, "what": f.what, "fix": f.fix}
        why = kind.applicable(f, drafter, target.num_layers)
        if why:
            out.append({**head, "skipped": why})
            continue
        d, ids, engine = kind.planted(f, drafter)
        sim = simulate_on(kind, d, target, seqs, k, ids, engine=engine)
        out.append({**head, **compare(tau_e, per_e, sim, rel_tol)})
    return out


def _numerics(target_cfg, target, kind, drafter, seqs: Sequences, report: dict, per_e, rel_tol) -> dict:
    """The engine's own states on the same sequences (vLLM in this process, ``extract --backend
    vllm``'s capture), their agreement with the target's per layer, and the drafter simulated on
    them, compared with the engine like the drafter as trained (``report["reference"]``)."""
    k, tau_e = report["k"], report["engine"]["tau"]
    aux_ids = kind.aux_ids(drafter)
    store = Path(os.environ.get("TMPDIR", "/tmp")) / f"eagle3kit-diagnose-{os.getpid()}"
    longest = max(int(ids.numel()) for ids in seqs.ids)
    capture = start_capture(target, aux_ids, longest, store, target_cfg.dtype)
    try:
        states = capture.capture(seqs.ids)
    finally:
        capture.close()
    precision = (
        "fp32" if target_cfg.dtype in ("float32", "float64") else "bf16"
    )  # the states compared, in memory
    agreement = StateAgreement(target, aux_ids, precision)
    aux, n = [], len(aux_ids)
    for i, st in enumerate(states):
        a, _ = engine_features(target, st)
        aux.append(a.cpu())
        mine = seqs.aux(i, aux_ids)
        agreement.add(mine.view(mine.shape[0], n, -1).float(), a.view(a.shape[0], n, -1).float().cpu())
    layers = agreement.layers()
    sim = compare(tau_e, per_e, simulate_on(kind, drafter, target, seqs, k, aux_ids, aux=aux), rel_tol)
    return {
        "source": "vllm (in-process capture, extract_hidden_states)",
        "layers": layers,
        "tolerances": tolerances_for(precision),
        "first_drift": first_drift(layers),
        "parity": verdict(layers),
        "simulated_on_engine_states": sim,
        "explains": explains(sim, report["reference"]),
    }


def _verdict(report: dict, agree: bool, matched: list[dict]) -> tuple[str, str]:
    """``(verdict, finding)``, in this order: the template check; a fault that explains the engine;
    other numerics (parity disagrees and the drafter on the engine's own states explains it);
    agreement; else unexplained, naming the closest hypothesis."""
    eng, ref = report["engine"]["tau"], report["reference"]["tau"]
    if report["template"]["mismatch"]:
        return "fault", "chat_template: " + report["template"]["message"]
    if matched:
        best = min(matched, key=lambda h: h["distance"])
        cost = (
            "; on this target it costs no τ beyond the noise, but the engine reads the drafter wrongly"
            if agree
            else ""
        )
        return "fault", (
            f"{best['name']}: {best['what']} — simulated τ {best['tau']:.3f} against the engine's {eng:.3f} "
            f"(the drafter as trained: {ref:.3f}; per-prompt distance {best['distance']} against "
            f"{report['reference']['distance']}){cost}. Fix: {best['fix']}"
        )
    num = report.get("numerics")
    if num and num["parity"] == "disagree":
        bad = [k for k, v in num["layers"].items() if not v["pass"]]
        s = num["simulated_on_engine_states"]
        how = (
            "which reproduces the engine"
            if num["explains"]
            else "(a capture prefills each sequence at once; it reproduces the served τ only where the "
            "engine's states do not depend on how tokens are batched)"
        )
        return "fault", (
            f"other_numerics: the engine computes other hidden states than the transformers target the drafter "
            f"was simulated with (parity: disagree on {len(bad)} of {len(num['layers'])} layers, e.g. {bad[0]}); "
            f"τ served {eng:.3f}, simulated on transformers' states {ref:.3f}, on the engine's captured states "
            f"{s['tau']:.3f} {how}. Fix: train on features from the engine that serves (`extract --backend vllm`, "
            "then `train.features`), or fix the engine's implementation of the target"
        )
    if agree:
        return "agree", (
            f"engine and reference agree (τ {eng:.4f} served, {ref:.4f} simulated): the drafter is what it is"
        )
    scored = [h for h in report["hypotheses"] if "delta" in h]
    close = min(scored, key=lambda h: abs(h["delta"])) if scored else None
    return "unexplained", (
        f"the engine accepts τ {eng:.3f}, the drafter as trained {ref:.3f}, and no known fault reproduces it"
        + (f"; the closest is {close['name']} (τ {close['tau']:.3f})" if close else "")
    )
