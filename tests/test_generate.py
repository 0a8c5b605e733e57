from conftest import GSM8K

from eagle3kit.core.config import Config, GenerateConfig, PromptsConfig, PromptSource, TargetConfig
from eagle3kit.core.rundir import RunDir, read_jsonl
from eagle3kit.data.backends import render_prompt_ids, transformers_generate
from eagle3kit.data.generate import run_generate
from eagle3kit.data.prompts import run_prompts


def _cfg(tmp_path, tiny_target_dir, n):
    return Config(
        run_dir=str(tmp_path / "run"),
        target=TargetConfig(model=str(tiny_target_dir), dtype="float64"),
        prompts=PromptsConfig(sources=[PromptSource(path=str(GSM8K), stop=n)], heldout_fraction=0.0),
        generate=GenerateConfig(backend="transformers", max_new_tokens=8, batch_size=3),
    )


def test_generate_resumes_without_redoing_or_duplicating(tmp_path, tiny_target, tiny_target_dir):
    cfg = _cfg(tmp_path, tiny_target_dir, 4)
    run = RunDir(cfg.run_dir)
    run_prompts(cfg, run)
    first = run_generate(cfg, run, tiny_target)
    assert first["generated"] == 4
    # a killed writer leaves a torn line; more prompts arrive; the rerun repairs, skips done rows
    with open(run / "conversations.jsonl", "a") as f:
        f.write('{"id": "torn"')
    cfg2 = _cfg(tmp_path, tiny_target_dir, 6)
    run_prompts(cfg2, run)
    second = run_generate(cfg2, run, tiny_target)
    assert second["already_done"] == 4 and second["generated"] == 2
    rows = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    assert len(rows) == 6 and len({r["id"] for r in rows}) == 6
    r = rows[0]
    assert r["prompt_ids"] == render_prompt_ids(tiny_target.tokenizer, r["messages"])
    assert len(r["completion_ids"]) == r["usage"]["completion_tokens"] <= 8
    assert r["finish_reason"] in ("stop", "length")
    third = run_generate(cfg2, run, tiny_target)
    assert third.get("generated", 0) == 0 and third["rows_kept"] == 6


def test_batched_generation_equals_one_by_one_greedy(tiny_target):
    tok = tiny_target.tokenizer
    prompts = [
        render_prompt_ids(tok, [{"role": "user", "content": q}])
        for q in ("Hi", "What is the capital of France?")
    ]
    batched = transformers_generate(tiny_target, prompts, 10)
    single = [transformers_generate(tiny_target, [p], 10)[0] for p in prompts]
    assert batched == single
