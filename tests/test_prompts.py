import pytest
from conftest import GSM8K, MT_BENCH, SHARED

from eagle3kit.core.config import Config, PromptsConfig, PromptSource
from eagle3kit.core.rundir import DataError, RunDir, read_jsonl
from eagle3kit.data.magpie import magpie_prefix, synthesize
from eagle3kit.data.prompts import run_prompts
from eagle3kit.data.sources import parse_row, read_source


def test_every_prompt_format_is_read():
    assert parse_row({"turns": ["a", "b"], "category": "writing"}, "auto", None, "x")[0] == [
        {"role": "user", "content": "a"}
    ]
    sg = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
        ]
    }
    assert parse_row(sg, "auto", None, "x")[0] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
    ]
    oa = {
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"},
            {"role": "user", "content": "Q2"},
        ]
    }
    assert parse_row(oa, "auto", None, "x")[0] == [{"role": "user", "content": "Q"}]
    assert parse_row("just text", "auto", None, "x")[0] == [{"role": "user", "content": "just text"}]
    assert parse_row({"question": "Q?", "answer": "A"}, "auto", None, "x")[0][0]["content"] == "Q?"
    assert (
        parse_row({"prompt": {"text": "tree root", "replies": []}}, "auto", None, "x")[0][0]["content"]
        == "tree root"
    )


def test_sharegpt_rows_as_specforge_and_public_dumps_write_them_are_read():
    """SpecForge's data preparation writes ``conversations`` of role/content; public ShareGPT dumps name
    the assistant chatgpt, bing or bard: each row gives its first user turn, none is rejected."""
    for conv in (
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
        [{"from": "human", "value": "Q"}, {"from": "chatgpt", "value": "A"}],
        [{"from": "human", "value": "Q"}, {"from": "bing", "value": "A"}, {"from": "human", "value": "Q2"}],
        [{"from": "human", "value": "Q"}, {"from": "bard", "value": "A"}],
    ):
        assert parse_row({"conversations": conv}, "auto", None, "x")[0] == [{"role": "user", "content": "Q"}]
    with pytest.raises(DataError, match=r"unknown ShareGPT speaker 'robot'"):
        parse_row({"conversations": [{"from": "robot", "value": "Q"}]}, "auto", None, "x")
    with pytest.raises(DataError, match=r"need 'from' and 'value' \(or 'role' and 'content'\)"):
        parse_row({"conversations": [{"speaker": "human", "text": "Q"}]}, "auto", None, "x")


def test_real_files_mt_bench_gsm8k_oasst_and_spec_bench_filters():
    mt, _ = read_source(PromptSource(path=str(MT_BENCH)))
    assert len(mt) == 80 and mt[0]["messages"][0]["content"].startswith("Compose an engaging travel blog")
    tail, _ = read_source(PromptSource(path=str(GSM8K), start=-80))
    assert len(tail) == 80
    oa, _ = read_source(PromptSource(path=str(SHARED / "data/chats/oasst_en_100_tree.jsonl")))
    assert len(oa) == 100
    sb, dropped = read_source(
        PromptSource(
            path=str(SHARED / "data/prompts/spec_bench.jsonl"),
            exclude_categories=[
                "writing",
                "roleplay",
                "reasoning",
                "math",
                "coding",
                "extraction",
                "stem",
                "humanities",
            ],
        )
    )
    assert len(sb) == 400 and dropped["category_filtered"] == 80


def test_a_source_with_a_limit_reads_only_the_lines_it_needs(tmp_path):
    """A 400,000-row JSONL with ``limit: 5`` (a bad line among the first rows, reported as before): the rows
    read hold a few kilobytes, not the whole file's parsed rows (about 300 MB held before); a negative
    ``start`` or a category filter still reads the whole file, and gives the same rows as before."""
    import json
    import tracemalloc

    path = tmp_path / "big.jsonl"
    row = json.dumps({"prompt": "What is " + "x" * 40 + "?", "category": "c"}) + "\n"
    with open(path, "w") as f:
        f.write(row * 2 + "{not json\n" + row * 399_998)
    src = PromptSource(path=str(path), limit=5)
    tracemalloc.start()
    bad: list = []
    rows, dropped = read_source(src, bad_rows=bad)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(rows) == 5 and dropped["malformed"] == 1 and bad[0]["line"] == 3
    assert peak < 2_000_000, peak
    tail, _ = read_source(PromptSource(path=str(path), start=-2), bad_rows=[])
    assert len(tail) == 2 and tail[0]["messages"] == rows[0]["messages"]
    some, _ = read_source(PromptSource(path=str(path), start=3, stop=5, categories=["c"]), bad_rows=[])
    assert len(some) == 2


def test_malformed_row_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"turns": ["ok"]}\n{"turns": [\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        read_source(PromptSource(path=str(p)))
    p.write_text('{"foo": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: row matches no prompt format"):
        read_source(PromptSource(path=str(p)))


def test_dedupe_and_counts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('"a"\n"b"\n"a"\n"  "\n')
    run = RunDir(tmp_path / "run")
    cfg = Config(
        run_dir=str(run.path),
        prompts=PromptsConfig(sources=[PromptSource(path=str(p))], heldout_fraction=0.0),
    )
    counts = run_prompts(cfg, run)
    assert (
        counts["rows_kept"] == 2 and counts["dropped_duplicate"] == 1 and counts["dropped_empty_prompt"] == 1
    )
    rows = [r for _, r in read_jsonl(run / "prompts.jsonl")]
    assert [r["messages"][0]["content"] for r in rows] == ["a", "b"]
    assert run.report["prompts"]["rows_kept"] == 2


def test_magpie_prefix_with_the_real_template(smollm2_tokenizer):
    prefix = magpie_prefix(smollm2_tokenizer)
    assert (
        prefix
        == "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n"
    )


def test_magpie_synthesis_gives_distinct_user_turns(tiny_target):
    rows = synthesize(tiny_target, 3, 12, seed=0, batch_size=8)
    # a random tiny model rarely ends its turn: whatever it returns must be distinct, non-trivial user turns
    texts = [r["messages"][0]["content"] for r in rows]
    assert len(set(texts)) == len(texts)
    assert all(r["source"] == "magpie" and len(t.split()) >= 3 for r, t in zip(rows, texts))


def test_synthesize_defaults_to_zero_with_sources_and_64_without():
    assert PromptsConfig().synthesize == 64
    assert PromptsConfig(sources=[PromptSource(path=str(GSM8K))]).synthesize == 0
    with pytest.raises(ValueError, match="no sources and synthesize is 0"):
        PromptsConfig(synthesize=0)


@pytest.mark.smollm2
def test_magpie_prompts_are_added_to_the_sources_prompts(tmp_path, smollm2_target):
    """The scaling recipe's mix: file prompts plus open-chat prompts SmolLM2 writes itself."""
    run = RunDir(tmp_path / "run")
    cfg = Config(
        run_dir=str(run.path),
        prompts=PromptsConfig(
            sources=[PromptSource(path=str(GSM8K), limit=5, name="gsm8k")],
            synthesize=3,
            synthesize_max_tokens=48,
            heldout_fraction=0.0,
        ),
    )
    counts = run_prompts(cfg, run, target=smollm2_target)
    rows = [r for _, r in read_jsonl(run / "prompts.jsonl")]
    by_source = [r["source"] for r in rows]
    assert counts["rows_from_gsm8k"] == 5 and by_source.count("gsm8k") == 5
    assert (
        counts["rows_from_magpie"] == by_source.count("magpie") == 3 and "synthesize_shortfall" not in counts
    )
    assert run.manifest["stages"]["prompts"]["inputs"]["magpie"]["n"] == 3


def test_magpie_gives_up_early_when_nothing_can_be_kept_and_sources_survive_a_shortfall(
    tmp_path, tiny_target
):
    """A 2-token limit can never hold a 3-word user turn that ends: synthesis stops after its first
    256 attempts instead of trying 4·n, and the file prompts still make the stage."""
    rows = synthesize(tiny_target, 100_000, 2, seed=0, batch_size=64)
    assert rows == []
    run = RunDir(tmp_path / "run")
    cfg = Config(
        run_dir=str(run.path),
        prompts=PromptsConfig(
            sources=[PromptSource(path=str(GSM8K), limit=3, name="gsm8k")],
            synthesize=5,
            synthesize_max_tokens=2,
            heldout_fraction=0.0,
        ),
    )
    counts = run_prompts(cfg, run, target=tiny_target)
    assert (
        counts["rows_kept"] == 3 and counts["rows_from_magpie"] == 0 and counts["synthesize_shortfall"] == 5
    )
