"""Every target family through eagle3kit and into vLLM's CPU build (issue 20): the README's
family table. For each family's tiny hub-shaped target (tests/family_targets.py): a whole
``eagle3kit run``, ``check``, and vLLM serving the trained drafter (EAGLE-3, K = 3) on the held-out
prompts evaluate measured; then, on DeepSeek-V3 without rope scaling (the case where vLLM's CPU
build computes other hidden states than transformers), ``parity`` of the two feature sources and
two drafters trained with the same seed on each, both served. Prints one table; writes JSON.

    python benchmarks/families.py --out benchmarks/results/families.json
    python benchmarks/families.py --families llama,deepseek_v3 --no-story      # a subset
    python benchmarks/families.py --from-tests /tmp/pytest-of-$USER/pytest-current --families none
        # the rows test_family_runs.py wrote (row.json in each test's folder), with this run's story
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/families")
    ap.add_argument(
        "--families", default=None, help="comma-separated (default: all of tests/family_targets.FAMILIES)"
    )
    ap.add_argument(
        "--no-story", action="store_true", help="skip the two-drafter DeepSeek feature-source story"
    )
    ap.add_argument("--out", default="benchmarks/results/families.json")
    ap.add_argument(
        "--from-tests",
        default=None,
        help="a pytest base temp folder: take the family rows from the "
        "row.json files test_family_end_to_end wrote there (same code, same seeds)",
    )
    args = ap.parse_args()
    from common import expected_time

    expected_time(
        "families",
        "not timed as a whole; the family rows took 1,702 s as tests/test_family_runs.py under pytest -n 2 "
        "(results/families.json; machine not recorded), here one family after another, then the "
        "DeepSeek story unless --no-story (not timed)",
    )

    import family_flow

    from eagle3kit.core.config import TargetConfig
    from eagle3kit.core.engines import installed_vllm
    from eagle3kit.model.target_files import load_tokenizer

    work = Path(args.work)
    tok_dir = work / "smollm2-tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        load_tokenizer(TargetConfig()).save_pretrained(tok_dir)
    families = (
        [f for f in args.families.split(",") if f != "none"]
        if args.families
        else list(family_flow.family_targets.FAMILIES)
    )
    result = {
        "benchmark": "families",
        "vllm": installed_vllm(),
        "machine": platform.processor() or platform.machine(),
        "rows": [],
    }
    for fam in families:
        t = time.perf_counter()
        row = family_flow.run_family(fam, work / fam, tok_dir)
        row["seconds"] = round(time.perf_counter() - t, 1)
        for k in ("vllm_outputs", "_serve", "_server"):
            row.pop(k, None)
        result["rows"].append(row)
        print(family_flow.summary(row), flush=True)
    if args.from_tests:
        order = list(family_flow.family_targets.FAMILIES)
        rows = list(
            {
                r["family"]: r
                for r in (
                    json.loads(p.read_text())
                    for p in Path(args.from_tests).glob(  # (pytest's *current links)
                        "**/test_family_end_to_end_*/row.json"
                    )
                )
            }.values()
        )
        result["rows"] += sorted(
            rows, key=lambda r: order.index(r["family"]) if r["family"] in order else len(order)
        )
        result["rows_from"] = "tests/test_family_runs.py::test_family_end_to_end"
    if not args.no_story:
        t = time.perf_counter()
        result["feature_sources"] = family_flow.feature_sources_story(
            work / "deepseek_v3_default_rope", tok_dir
        )
        result["feature_sources"]["seconds"] = round(time.perf_counter() - t, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(family_flow.table(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
