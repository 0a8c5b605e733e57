"""Every long benchmark says up front how long it will take (benchmarks/common.expected_time), so
nobody waits minutes on a script that prints nothing."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

# Scripts whose main need not call expected_time: each finishes in seconds or only reports.
QUICK_OR_REPORT = {
    "device_map_check",  # 32.5 s wall on two H200s (results/device_map.json)
}


def _main(path: Path) -> ast.FunctionDef | None:
    tree = ast.parse(path.read_text())
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)


def _calls_expected_time(fn: ast.FunctionDef) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "expected_time"
        for n in ast.walk(fn)
    )


SCRIPTS = sorted(p for p in BENCH.glob("*.py") if _main(p) is not None)


def test_the_allow_list_names_scripts_that_exist():
    assert QUICK_OR_REPORT <= {p.stem for p in SCRIPTS}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_each_long_benchmark_states_its_expected_time(path: Path):
    if path.stem in QUICK_OR_REPORT:
        return
    assert _calls_expected_time(_main(path)), (
        f"benchmarks/{path.name}: main() should call common.expected_time(...) after parsing its "
        "arguments (or join QUICK_OR_REPORT, with a comment saying why)"
    )


def test_expected_time_prints_one_flushed_line_with_both_parts(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("common", None)
    from common import expected_time

    expected_time("variants", "about 8 minutes on one H200")
    out = capsys.readouterr().out
    assert out == "variants: expected about 8 minutes on one H200; progress lines follow\n"
    expected_time("peers", "not timed yet")
    assert capsys.readouterr().out == "peers: not timed yet; progress lines follow\n"


def test_serving_cpu_refuses_bad_options_before_its_expected_time_line(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("serving_cpu", None)
    import serving_cpu

    shared = tmp_path / "shared"
    (shared / "data" / "chats").mkdir(parents=True)
    (shared / "data" / "chats" / "gsm8k_train.jsonl").write_text("{}\n")
    (tmp_path / "file").write_text("")
    work = tmp_path / "work"

    def refusal(*argv: str) -> str:
        monkeypatch.setattr(
            sys, "argv", ["serving_cpu.py", "--shared", str(shared), "--work", str(work), *argv]
        )
        with pytest.raises(SystemExit) as e:
            serving_cpu.main()
        assert capsys.readouterr().out == ""  # refused before the expected-time line
        return str(e.value.code)

    assert refusal("--k", "0").startswith("--k 0: give at least 1")
    assert refusal("--max-tokens", "-1").startswith("--max-tokens -1: give at least 1")
    assert "gsm8k_train.jsonl is missing" in refusal("--shared", str(tmp_path / "nowhere"))
    assert "exists and is not a folder" in refusal("--work", str(tmp_path / "file"))
    assert not work.exists()
    assert "'x' is not a seed" in refusal("--seeds", "0,x")
    assert "'01' is not a seed" in refusal("--seeds", "01")
    assert "'-1' is not a seed" in refusal("--seeds", "-1")
    assert "seed 1 is given twice" in refusal("--seeds", "1,2,1")
    assert "no seed given" in refusal("--seeds", " ")
    assert "integers from 0 to 4294967295" in refusal("--seeds", str(2**32))
    assert "is not a seed" in refusal("--seeds", "1" * 5000)  # no int() of 5,000 digits
    assert not work.exists()
    ns = serving_cpu.argparse.Namespace(k=7, max_tokens=64, shared=shared, work=work, seeds="0,2,1")
    serving_cpu.check_args(ns)
    assert ns.seed_list == [0, 2, 1]
    assert (work / "settings.json").read_text() == '{"k": 7, "max_tokens": 64}\n'
    ns.seeds = "0,1,2,3"  # seeds may be added to a resumed run: its K and max tokens are what must match
    serving_cpu.check_args(ns)
    for bad in ("", '{"k": 7', "[7, 64]"):  # damaged settings: a message, not a traceback
        (work / "settings.json").write_text(bad)
        with pytest.raises(
            SystemExit,
            match="settings.json: (not readable JSON|holds a list, not a JSON object).*delete it or use another --work",
        ):
            serving_cpu.check_args(ns)
    (work / "settings.json").write_text('{"k": 7, "max_tokens": 64}\n')
    message = refusal("--k", "3")
    assert (
        "k=7, max_tokens=64" in message
        and "k=3, max_tokens=64" in message
        and "use another --work" in message
    )


def test_expected_time_refuses_an_empty_or_non_str_estimate_and_reads_not_timed_in_any_case(
    monkeypatch, capsys
):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("common", None)
    from common import expected_time

    for bad in ("", "  ", None, 8):
        with pytest.raises(TypeError, match="non-empty str"):
            expected_time("x", bad)
    expected_time("peers", "Not timed yet")
    assert capsys.readouterr().out == "peers: Not timed yet; progress lines follow\n"


def test_serving_cpu_spread_spans_each_drafters_seeds_apart(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("serving_cpu", None)
    import serving_cpu

    def r(drafter, seed, tau_eval, *levels):
        keys = ("1", "4")[: len(levels)]
        return {
            "drafter": drafter,
            "seed": seed,
            "tau_evaluate": tau_eval,
            "levels": {
                c: {"tau_vllm": t, "speedup": x, "output_tokens_per_s": 1.0}
                for c, (t, x) in zip(keys, levels)
            },
        }

    rows = [
        r("eagle3.1", 0, 1.74, (1.73, 1.04), (1.73, 0.67)),
        r("dflash", 0, 1.35, (1.35, 0.89), (1.35, 0.56)),
        r("eagle3.1", 1, 1.70, (1.71, 1.08), (1.71, 0.64)),
        r("dflash", 1, None, (1.40, 0.91)),
    ]
    got = serving_cpu.spread(rows)
    assert list(got) == ["eagle3.1", "dflash"]
    assert got["eagle3.1"] == {
        "seeds": [0, 1],
        "tau_evaluate": [1.70, 1.74],
        "tau_vllm_c1": [1.71, 1.73],
        "speedup_c1": [1.04, 1.08],
        "tau_vllm_c4": [1.71, 1.73],
        "speedup_c4": [0.64, 0.67],
    }
    # a value some seed lacks makes the span None: one seed's value is no spread
    assert got["dflash"]["tau_evaluate"] is None and got["dflash"]["speedup_c4"] is None
    assert got["dflash"]["speedup_c1"] == [0.89, 0.91]
    odd = serving_cpu.spread([r("x", 0, float("nan"), (True, 1.0)), r("x", 1, 1.2, (1.0, float("inf")))])
    assert (
        odd["x"]["tau_evaluate"] is None
        and odd["x"]["tau_vllm_c1"] is None
        and odd["x"]["speedup_c1"] is None
    )
    assert (
        serving_cpu.run_name("dflash", 0) == "dflash" and serving_cpu.run_name("dflash", 2) == "dflash-seed2"
    )


def test_serving_cpu_resumes_only_finished_runs_and_a_benched_seed_trains_nothing(monkeypatch, tmp_path):
    """A run copied from EAGLE-3.1's carries its report.json (τ included) until its own evaluate
    replaces it: a run stopped during training must train again, not pass for done with that τ. A seed
    whose bench records exist is read back without training or serving."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("serving_cpu", None)
    import serving_cpu

    import eagle3kit.pipeline

    work = tmp_path / "work"
    args = serving_cpu.argparse.Namespace(k=7, max_tokens=64, shared=tmp_path, work=work)
    base = work / "eagle3.1" / "run"
    (base / "drafter").mkdir(parents=True)
    (base / "report.json").write_text('{"evaluate": {"sets": {"gsm8k_heldout": {"tau": 1.7331}}}}')
    (work / "eagle3.1" / "trained.json").write_text("{}")
    calls = []

    def stopped(cfg):
        calls.append(cfg.run_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(eagle3kit.pipeline, "run_all", stopped)
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            serving_cpu.train(args, "dflash", 1)
    assert len(calls) == 2  # the second call trained again: the copied τ did not pass for done
    assert not (work / "dflash-seed1" / "trained.json").exists()

    def finished(cfg):
        calls.append(cfg.run_dir)
        run = Path(cfg.run_dir)
        (run / "drafter").mkdir()
        (run / "report.json").write_text('{"evaluate": {"sets": {"gsm8k_heldout": {"tau": 1.4607}}}}')

    monkeypatch.setattr(eagle3kit.pipeline, "run_all", finished)
    run = serving_cpu.train(args, "dflash", 1)
    assert serving_cpu.evaluate_tau(run) == 1.4607 and len(calls) == 3
    assert serving_cpu.train(args, "dflash", 1) == run and len(calls) == 3  # done: not trained again

    record = {"servers": {n: {"results": [{"concurrency": 1, "output_tokens_per_s": 9.0}]}
                          for n in ("speculative", "baseline")}}  # fmt: skip
    for n in ("eagle3.1-seed2", "dflash-seed2"):
        (work / f"bench-{n}").mkdir()
        (work / f"bench-{n}" / "bench.json").write_text(json.dumps(record))
    rows = serving_cpu.serve_seed(args, tmp_path / "target", tmp_path / "prompts.jsonl", 2)
    assert [(r["drafter"], r["seed"], r["tau_evaluate"]) for r in rows] == [
        ("eagle3.1", 2, None),
        ("dflash", 2, None),
    ]
    assert len(calls) == 3  # seed 2 was benched: nothing trained, no server started


def test_a_row_records_the_gpu_processes_it_saw_not_how_many_it_launched(tmp_path, monkeypatch):
    """benchmarks/common.gpu_processes counts nvidia-smi's compute apps (a row shared with three other
    processes says 4, whatever --parallel launched); without nvidia-smi, or when it fails, None — never a
    guess. The training rows of variants.py and the peer rows record it at the start and end of their timed
    part under ``gpu_processes``."""
    sys.path.insert(0, str(BENCH))
    import common

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '101\\n202\\n303\\n404\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert common.gpu_processes() == 4
    smi.write_text("#!/bin/sh\nexit 9\n")
    assert common.gpu_processes() is None
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert common.gpu_processes() is None
    for f in ("variants.py", "peers/specforge_run.py", "peers/speculators_dflash_run.py"):
        text = (BENCH / f).read_text()
        assert (
            '"gpu_processes": seen' in text
            and text.count("gpu_processes()") == 2
            and "concurrent_processes" not in text
        )


def test_a_variants_row_records_its_peak_gpu_memory_in_gib_beside_the_cards(monkeypatch):
    """benchmarks/common.gpu_peak_memory: the allocator's peak allocated and reserved bytes and the card's
    total, in GiB to 0.01 (what says whether a row fits an 80 GB card); None without CUDA. The training stage
    resets the peak after the target is loaded; variants.py's rows read it after training, before
    evaluating, under ``gpu_peak_memory``."""
    sys.path.insert(0, str(BENCH))
    import common
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert common.gpu_peak_memory() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 61.5 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 70.254 * 2**30)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 79.19 * 2**30})()
    )
    assert common.gpu_peak_memory() == {"allocated_gib": 61.5, "reserved_gib": 70.25, "card_gib": 79.19}
    text = (BENCH / "variants.py").read_text()
    stage = (BENCH.parent / "src" / "eagle3kit" / "train" / "loop_inputs.py").read_text()
    assert "torch.cuda.reset_peak_memory_stats(self.device)" in stage
    assert (
        text.index("= train_variant(")
        < text.index("peak = gpu_peak_memory()")
        < text.index("= heldout_tau(")  # the peak of training, not of the evaluation after it
    )
    assert '"gpu_peak_memory": peak' in text
