"""benchmarks/variants.py's report: which row is best and whether it beats the baseline by more
than the seed spread, from results as the benchmark writes them (and as a broken run leaves them)."""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import variants  # noqa: E402


def _seed(name, seed, mt3, gsm3, mt5=None, gsm5=None):
    return {
        "key": f"{name}:{seed}",
        "seed": seed,
        "tau": {
            "mt_bench": {"k3": mt3, "k5": mt3 if mt5 is None else mt5},
            "gsm8k_heldout": {"k3": gsm3, "k5": gsm3 if gsm5 is None else gsm5},
        },
        "tokens_per_s": 100.0,
    }


def _row(name, *seeds):
    row = {"name": name, "seeds": list(seeds)}
    for c in variants.COLUMNS:
        key = {"mt_bench": "mt_bench", "gsm8k": "gsm8k_heldout"}[c.split("_tau")[0]]
        vals = [s["tau"][key][f"k{c[-1]}"] for s in seeds]
        row[c] = sum(vals) / len(vals)
        if len(vals) > 1:
            row.setdefault("seed_spread", {})[c] = max(vals) - min(vals)
    return row


def test_one_seed_a_side_is_never_a_win_by_more_than_the_spread():
    rows = [
        _row("eagle3", _seed("eagle3", 0, 1.30, 1.80)),
        _row("eagle3.1", _seed("eagle3.1", 0, 1.31, 1.81)),
    ]
    v = variants.compare_rows(rows)
    assert v["best"] == "eagle3.1"
    assert all(c["wins_by_more_than_seed_spread"] is None for c in v["columns"].values())
    assert v["default_should_change"] is False


def test_the_best_row_wins_every_column_and_a_non_finite_row_is_left_out():
    base = _row("eagle3", _seed("eagle3", 0, 1.30, 1.80), _seed("eagle3", 1, 1.31, 1.81))
    good = _row("eagle3.1", _seed("eagle3.1", 0, 1.36, 1.98), _seed("eagle3.1", 1, 1.35, 1.97))
    # a larger mean gain that loses MT-bench: not the row the default should move to
    lopsided = _row("lk_alpha", _seed("lk_alpha", 0, 1.20, 2.60), _seed("lk_alpha", 1, 1.21, 2.61))
    broken = _row("norm_before_residual", _seed("norm_before_residual", 0, math.nan, 1.9))
    v = variants.compare_rows([base, broken, lopsided, good])
    assert v["best"] == "eagle3.1"
    assert v["default_should_change"] is True
    assert v["skipped"] == ["norm_before_residual"]
    assert v["columns"]["mt_bench_tau_k3"]["gain"] == pytest.approx(1.355 / 1.305 - 1, abs=1e-4)


def test_no_baseline_is_a_clear_error():
    with pytest.raises(ValueError, match="no eagle3 row"):
        variants.compare_rows([_row("eagle3.1", _seed("eagle3.1", 0, 1.3, 1.8))])


def _args(work):
    return SimpleNamespace(work=str(work), precision="fp32", loss_chunk=0, smoke=True)


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"key": "eagle3:0", "tau": ', "not readable JSON"),
        ("[1, 2]", "holds a list"),
        (json.dumps(_seed("eagle3", 1, 1.3, 1.8)), "is not eagle3:0"),
        (json.dumps({"key": "eagle3:0", "tau": {"mt_bench": {"k3": 1.3}}}), "no τ for mt_bench at K=5"),
    ],
)
def test_a_broken_result_file_is_named_with_the_fix(tmp_path, content, match):
    (tmp_path / "eagle3-s0").mkdir()
    (tmp_path / "eagle3-s0" / "result.json").write_text(content)
    with pytest.raises(SystemExit, match=match) as e:
        variants.stage_report(_args(tmp_path))
    assert "eagle3-s0/result.json" in str(e.value)


def test_run_info_adds_to_the_recorded_settings_and_odd_folders_are_left_out(tmp_path, capsys):
    for name, seed, mt in (("eagle3", 0, 1.30), ("eagle3", 1, 1.31), ("eagle3.1", 0, 1.35)):
        d = tmp_path / f"{name}-s{seed}"
        d.mkdir()
        (d / "result.json").write_text(json.dumps(_seed(name, seed, mt, 1.8)))
    (tmp_path / "eagle3-sX").mkdir()
    (tmp_path / "eagle3-sX" / "result.json").write_text(json.dumps(_seed("eagle3", 7, 9.0, 9.0)))
    (tmp_path / "run_info.json").write_text(json.dumps({"smoke": False, "machine": "H200"}))
    out = variants.stage_report(_args(tmp_path))
    assert out["smoke"] is True and out["machine"] == "H200"
    assert [s["seed"] for s in out["rows"][0]["seeds"]] == [0, 1]
    assert out["rows"][0]["mt_bench_tau_k3"] == pytest.approx(1.305)
    err = capsys.readouterr().err
    assert "eagle3-sX: not a row folder" in err and "['smoke'] left as the run recorded them" in err


def _write_seed(root: Path, name: str, seed: int, mt3: float, gsm3: float) -> None:
    d = root / f"{name}-s{seed}"
    d.mkdir(parents=True)
    (d / "result.json").write_text(
        json.dumps({k: v for k, v in _seed(name, seed, mt3, gsm3).items() if k != "seed"})
    )


def test_the_speed_check_compares_the_two_paths_per_column_within_the_seed_spread(tmp_path, capsys):
    # reference rows in <work>, auto rows in <work>/speed-auto, as --speed writes them
    for seed, (mt, gsm) in enumerate([(1.340, 1.970), (1.356, 1.990)]):  # spread 0.016 / 0.020
        _write_seed(tmp_path, "eagle3.1", seed, mt, gsm)
    for seed, (mt, gsm) in enumerate([(1.350, 1.930), (1.352, 1.935)]):  # GSM8K 0.0475 lower: outside
        _write_seed(tmp_path / "speed-auto", "eagle3.1", seed, mt, gsm)
    _write_seed(tmp_path, "eagle3", 0, 1.3, 1.8)  # under one path only: not compared
    args = SimpleNamespace(
        work=str(tmp_path), precision="tf32", loss_chunk=0, smoke=False, speed_out=str(tmp_path / "s.json")
    )
    out = variants.stage_speed(args)
    assert [r["name"] for r in out["rows"]] == ["eagle3.1"]
    cols = out["rows"][0]["columns"]
    assert cols["mt_bench_tau_k3"]["difference"] == pytest.approx(1.351 - 1.348, abs=1e-4)
    assert cols["mt_bench_tau_k3"]["within"] is True
    assert cols["gsm8k_tau_k3"]["seed_spread"] == pytest.approx(0.020)
    assert cols["gsm8k_tau_k3"]["within"] is False
    assert out["same_tau_within_seed_spread"] is False
    assert json.loads((tmp_path / "s.json").read_text())["rows"][0]["auto"]["gsm8k_tau_k3"] == pytest.approx(
        1.9325
    )
    assert "same τ within the seed spread: False" in capsys.readouterr().out


def test_the_speed_check_refuses_a_work_folder_with_no_row_under_both_paths(tmp_path):
    _write_seed(tmp_path, "eagle3", 0, 1.3, 1.8)
    args = SimpleNamespace(work=str(tmp_path), precision="tf32", loss_chunk=0, smoke=False, speed_out="x")
    with pytest.raises(SystemExit, match="no row trained under both"):
        variants.stage_speed(args)


def _block_row(name, seeds=1, **taus):
    row = {"name": name, "seeds": [{}] * seeds}
    for k in (3, 5, 7):
        for short in ("mt_bench", "gsm8k"):
            row[f"{short}_tau_k{k}"] = taus.get(f"{short}_tau_k{k}", 2.0)
    return row


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_compare_blocks_refuses_a_reference_tau_that_is_not_positive_and_finite(bad):
    with pytest.raises(ValueError, match=r"eagle3\.1 row's gsm8k_tau_k5 is .*not a positive finite number"):
        variants.compare_blocks([_block_row("eagle3.1", gsm8k_tau_k5=bad), _block_row("dflash")])


def test_compare_blocks_leaves_out_a_nan_column_and_reads_a_zero_ratio_as_measured():
    out = variants.compare_blocks([_block_row("eagle3.1"), _block_row("dflash", mt_bench_tau_k3=math.nan)])
    assert "mt_bench_tau_k3" not in out["dflash"]["vs_reference"] and len(out["dflash"]["vs_reference"]) == 5
    assert out["dflash"]["aim_1.2x_at_k7_met"] is False  # ratios of 1.0 at K = 7
    out = variants.compare_blocks([_block_row("eagle3.1"), _block_row("dflash", gsm8k_tau_k7=0.0)])
    assert out["dflash"]["vs_reference"]["gsm8k_tau_k7"]["ratio"] == 0.0
    assert out["dflash"]["aim_1.2x_at_k7_met"] is False  # a ratio of 0 is a miss, not "not measured"
    out = variants.compare_blocks([_block_row("eagle3.1", gsm8k_tau_k7=None), _block_row("dflash")])
    assert out["dflash"]["aim_1.2x_at_k7_met"] is None


def test_compare_blocks_picks_trains_default_as_reference_meets_the_aim_at_1_2x_and_tests_the_seed_spread():
    """The headline's three choices, each pinned: train's default row (eagle3.1_mixed_betas999) is the
    reference when measured, whatever the row order, else eagle3.1; the aim holds at a ratio of exactly 1.2 at
    K = 7 on both sets and not at 1.19 on one; a difference is beyond the seed spread only when larger than
    the larger of the two rows' spreads, and None when either row has one seed."""
    default = _block_row("eagle3.1_mixed_betas999", seeds=2, mt_bench_tau_k7=2.0, gsm8k_tau_k7=2.0)
    default["seed_spread"] = {"mt_bench_tau_k3": 0.05}
    old = _block_row("eagle3.1", seeds=2, mt_bench_tau_k7=1.0, gsm8k_tau_k7=1.0)
    block = _block_row(
        "dflash", seeds=2, mt_bench_tau_k3=2.06, mt_bench_tau_k5=2.04, mt_bench_tau_k7=2.4, gsm8k_tau_k7=2.4
    )
    block["seed_spread"] = {"mt_bench_tau_k5": 0.1}
    for rows in ([old, default, block], [default, old, block], [block, default, old]):
        out = variants.compare_blocks(rows)
        assert out["reference"] == "eagle3.1_mixed_betas999"
        cols = out["dflash"]["vs_reference"]
        assert cols["mt_bench_tau_k7"]["ratio"] == 1.2 and out["dflash"]["aim_1.2x_at_k7_met"] is True
        assert cols["mt_bench_tau_k3"]["beyond_seed_spread"] is True  # 0.06 > the reference's 0.05
        assert cols["mt_bench_tau_k5"]["beyond_seed_spread"] is False  # 0.04 < the block row's 0.1
    assert variants.compare_blocks([old, block])["reference"] == "eagle3.1"
    miss = variants.compare_blocks([default, {**block, "gsm8k_tau_k7": 2.38}])
    assert miss["dflash"]["vs_reference"]["gsm8k_tau_k7"]["ratio"] == 1.19
    assert miss["dflash"]["aim_1.2x_at_k7_met"] is False
    one = variants.compare_blocks([default, {**block, "seeds": [{}]}])
    assert one["dflash"]["vs_reference"]["mt_bench_tau_k3"]["beyond_seed_spread"] is None


def test_rows_take_row_colon_seed_each_once_seed_a_non_negative_integer():
    assert variants.parse_rows(" eagle3:0, eagle3:12 ,specforge:1") == [
        "eagle3:0",
        "eagle3:12",
        "specforge:1",
    ]
    for text in (
        "eagle3:01",
        "eagle3:-1",
        "eagle3:１",
        "eagle3:²",
        "eagle3:1:2",
        "eagle3",
        "nope:0",
        "eagle3: 1x",
    ):
        with pytest.raises(SystemExit, match="row:seed, seed a non-negative integer"):
            variants.parse_rows(text)
    for text in ("", " , ,"):
        with pytest.raises(SystemExit, match="names no row: give row:seed, seed a non-negative integer"):
            variants.parse_rows(text)
    with pytest.raises(SystemExit, match=r"\['eagle3:0'\] given more than once: give each row:seed once"):
        variants.parse_rows("eagle3:0,eagle3:1,eagle3:0")
