"""Issue 21: one lineage rule for every stage (:mod:`eagle3kit.core.lineage`). A run on a tiny target
(prompts → generate → tokenize → vocab → train → export), copied per test; each test changes one
upstream input and asserts that the next stage refuses before doing any work, naming the stale
file and the stage to rerun."""

import json
import shutil

import pytest
from conftest import GSM8K, build_tiny_llama

from eagle3kit.core.config import ConfigError, load_config
from eagle3kit.core.lineage import StaleInput
from eagle3kit.core.rundir import DataError, RunDir, read_jsonl, write_jsonl

CONFIG = """run_dir: {run}
target: {{model: {target}, dtype: float32}}
prompts:
  sources: [{{path: {gsm8k}, stop: 8}}]
  heldout_fraction: 0.0
generate: {{backend: transformers, max_new_tokens: 8, batch_size: 8}}
vocab: {{draft_vocab_size: 64}}
train: {{epochs: 1, ttt_steps: 1, tokens_per_step: 256}}
"""


def stages():
    from eagle3kit.data.generate import run_generate
    from eagle3kit.data.prompts import run_prompts
    from eagle3kit.data.tokenize import run_tokenize
    from eagle3kit.data.vocab import run_vocab
    from eagle3kit.serve.export import run_export
    from eagle3kit.train.stage import run_train

    return {
        "prompts": run_prompts,
        "generate": run_generate,
        "tokenize": run_tokenize,
        "vocab": run_vocab,
        "train": run_train,
        "export": run_export,
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_target_dir):
    """A whole run through export on a copy of the tiny target."""
    d = tmp_path_factory.mktemp("lineage")
    shutil.copytree(tiny_target_dir, d / "target")
    (d / "c.yaml").write_text(CONFIG.format(run=d / "run", target=d / "target", gsm8k=GSM8K))
    cfg = load_config(d / "c.yaml")
    run = RunDir(cfg.run_dir)
    for fn in stages().values():
        fn(cfg, run)
    return d


@pytest.fixture
def copy(base, tmp_path):
    """This test's own copy of the run and its target: ``(cfg, run)``."""
    shutil.copytree(base / "run", tmp_path / "run")
    shutil.copytree(base / "target", tmp_path / "target")
    (tmp_path / "c.yaml").write_text(
        CONFIG.format(run=tmp_path / "run", target=tmp_path / "target", gsm8k=GSM8K)
    )
    m = json.loads(
        (tmp_path / "run" / "manifest.json").read_text()
    )  # the copy's records name the copy's files
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(m).replace(str(base), str(tmp_path)))
    return load_config(tmp_path / "c.yaml"), RunDir(tmp_path / "run")


def refused(stage, cfg, run, *names):
    with pytest.raises(StaleInput) as e:
        stages()[stage](cfg, run)
    said = " ".join(str(e.value).split())
    for n in names:
        assert n in said, said
    return said


def replace_weights(folder):
    m = build_tiny_llama(8, seed=1)
    m.generation_config.eos_token_id = 2
    m.save_pretrained(folder)


def interrupted(run, rows):
    """conversations.jsonl as a generate killed after ``rows`` leaves it: those rows, and its
    lineage record marked unfinished (what generate writes before its first row)."""
    write_jsonl(run / "conversations.jsonl", rows)
    rec = run.manifest["lineage"]["conversations.jsonl"]
    run.mark_pending("conversations.jsonl", "generate", rec["from"], rec["target"])


def more_data(cfg, run):
    """One more prompt, generated (resumed) and tokenized: the legitimate way tokens change."""
    cfg.prompts.sources[0].stop = 9
    for stage in ("prompts", "generate", "tokenize"):
        stages()[stage](cfg, run)


def test_every_stage_output_records_what_it_was_built_from(base):
    m = json.loads((base / "run" / "manifest.json").read_text())
    lin = m["lineage"]
    assert {k: v["stage"] for k, v in lin.items()} == {
        "prompts.jsonl": "prompts",
        "heldout.jsonl": "prompts",
        "conversations.jsonl": "generate",
        "tokens.safetensors": "tokenize",
        "vocab.safetensors": "vocab",
        "checkpoints/best.safetensors": "train",
        "drafter/model.safetensors": "export",
    }
    assert lin["drafter/model.safetensors"]["from"] == {
        "checkpoints/best.safetensors": lin["checkpoints/best.safetensors"]["sha256"]
    }
    assert set(lin["tokens.safetensors"]["from"]) == {"conversations.jsonl"}
    assert set(lin["checkpoints/best.safetensors"]["from"]) == {"tokens.safetensors", "vocab.safetensors"}
    assert lin["conversations.jsonl"]["target"] == lin["checkpoints/best.safetensors"]["target"] is not None
    assert lin["vocab.safetensors"]["from"]["tokens.safetensors"] == lin["tokens.safetensors"]["sha256"]


def test_generate_refuses_to_append_rows_made_by_other_weights_at_the_same_path(copy):
    """Finding 1: the weights replaced in the same folder, generate resumed: it used to append the
    new model's rows to the old model's (already_done 6, generated 6, rows_kept 12)."""
    cfg, run = copy
    rows = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    interrupted(run, rows[:4])
    stages()["generate"](cfg, run)  # the same weights in another folder (this copy's) are the same target
    rows = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    assert len(rows) == 8 and len({r["target"] for r in rows}) == 2
    interrupted(run, [r for r in rows if r["target"] == cfg.target.model])  # and again
    replace_weights(cfg.target.model)
    with pytest.raises(ConfigError) as e:
        stages()["generate"](cfg, run)
    said = " ".join(str(e.value).split())
    assert "target_weights" in said and "were replaced" in said
    assert len(list(read_jsonl(run / "conversations.jsonl"))) == 4  # nothing appended


def test_a_config_edited_in_place_is_another_target_a_reindented_one_is_not(copy):
    """Attack finding: the target's config.json edited in place (rope theta, activation) with the
    same weights: generate appended the new model's rows to the old one's and every later stage ran.
    The target's identity covers config.json and generation_config.json (their JSON content)."""
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target_files import weights_fingerprint

    cfg, run = copy
    path = run.path.parent / "target" / "config.json"
    before = weights_fingerprint(TargetConfig(model=str(path.parent)))
    conf = json.loads(path.read_text())
    path.write_text(json.dumps(conf, indent=7))  # the same content, other whitespace
    assert weights_fingerprint(TargetConfig(model=str(path.parent))) == before
    conf["rope_parameters"]["rope_theta"] = 500.0
    path.write_text(json.dumps(conf))
    refused("train", cfg, run, "conversations.jsonl", "other target weights", "config.json were replaced")
    interrupted(run, [r for _, r in read_jsonl(run / "conversations.jsonl")][:4])
    with pytest.raises(ConfigError, match="target_weights: .* but now"):
        stages()["generate"](cfg, run)


def test_train_refuses_conversations_made_by_weights_replaced_since(copy):
    cfg, run = copy
    replace_weights(cfg.target.model)
    refused("train", cfg, run, "conversations.jsonl", "other target weights", "new run_dir")


def test_generate_refuses_a_prompts_file_changed_after_prompts_wrote_it(copy):
    cfg, run = copy
    rows = [r for _, r in read_jsonl(run / "prompts.jsonl")]
    write_jsonl(run / "prompts.jsonl", rows + [{**rows[0], "id": "extra"}])
    refused("generate", cfg, run, "prompts.jsonl", "eagle3kit prompts")


def test_tokenize_refuses_conversations_changed_after_generate_wrote_them(copy):
    cfg, run = copy
    rows = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    write_jsonl(run / "conversations.jsonl", rows[1:])
    said = refused(
        "tokenize", cfg, run, "conversations.jsonl", "eagle3kit generate", "then `eagle3kit tokenize`"
    )
    # hostile-input trial: "rerun generate" alone looped (generate refuses a changed file it only appends to)
    assert "move it away and rerun" in said


def test_train_refuses_a_vocab_built_from_other_tokens(copy):
    """Finding 2: tokenize rerun (on a resumed generate's rows) without vocab: train used to run
    on a draft vocabulary counted over other tokens, without a word."""
    cfg, run = copy
    more_data(cfg, run)
    said = refused(
        "train", cfg, run, "vocab.safetensors", "from another tokens.safetensors", "eagle3kit vocab"
    )
    assert "then `eagle3kit train`" in said


def test_vocab_refuses_a_token_shard_changed_after_tokenize_wrote_it(copy, tmp_path):
    from eagle3kit.data.tokenize import load_shard, save_shard

    cfg, run = copy
    rows = load_shard(run / "tokens.safetensors")
    save_shard(run / "tokens.safetensors", [(ids.tolist(), mask.tolist()) for ids, mask in rows[1:]])
    refused("vocab", cfg, run, "tokens.safetensors", "eagle3kit tokenize")


def test_export_refuses_a_checkpoint_whose_data_changed_since_training(copy):
    cfg, run = copy
    stages()["vocab"](cfg, run)  # rebuilt (same tokens): the checkpoint is current
    stages()["export"](cfg, run)
    more_data(cfg, run)
    stages()["vocab"](cfg, run)
    refused("export", cfg, run, "checkpoints/best.safetensors", "eagle3kit train")


def test_evaluate_refuses_a_drafter_that_is_not_its_checkpoints_export_or_whose_data_changed(copy):
    """evaluate checks the run's drafter through its chain: an export replaced by hand names
    export; retrained data under an old export names the stage to rerun first."""
    from safetensors.torch import load_file, save_file

    from eagle3kit.eval.evaluate import run_evaluate

    cfg, run = copy
    path = run / "drafter" / "model.safetensors"
    good = path.read_bytes()
    weights = load_file(str(path))
    save_file({**weights, "norm.weight": weights["norm.weight"] * 2}, str(path))
    with pytest.raises(StaleInput, match="drafter/model.safetensors changed after `eagle3kit export`"):
        run_evaluate(cfg, run)
    path.write_bytes(good)
    more_data(cfg, run)
    with pytest.raises(StaleInput) as e:
        run_evaluate(cfg, run)
    said = " ".join(str(e.value).split())
    assert "vocab.safetensors was built by `eagle3kit vocab` from another tokens.safetensors" in said, said


def test_extract_refuses_tokens_changed_after_tokenize(copy):
    from eagle3kit.data.tokenize import load_shard, save_shard
    from eagle3kit.train.extract import run_extract

    cfg, run = copy
    rows = load_shard(run / "tokens.safetensors")
    save_shard(run / "tokens.safetensors", [(ids.tolist(), mask.tolist()) for ids, mask in rows[:-1]])
    with pytest.raises(StaleInput, match="tokens.safetensors changed after `eagle3kit tokenize`"):
        run_extract(cfg, run)


def test_a_generate_killed_midway_leaves_conversations_every_later_stage_refuses_until_it_finishes(copy):
    """Attack finding: a first generate killed after 6 of 24 rows left a file tokenize took as the
    whole dataset. generate marks conversations.jsonl unfinished before its first row."""
    cfg, run = copy
    rows = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    interrupted(run, rows[:3])
    said = refused(
        "tokenize", cfg, run, "conversations.jsonl is unfinished", "`eagle3kit generate` was stopped"
    )
    assert "rerun `eagle3kit generate" in said
    out = stages()["generate"](cfg, run)  # resumes: the missing rows only
    assert out["already_done"] == 3 and out["generated"] == 5
    stages()["tokenize"](cfg, run)


def test_generate_refuses_to_bless_a_conversations_file_edited_after_it_finished(copy):
    """Attack finding: tokenize refused a hand-edited conversations.jsonl and said to rerun
    generate, which found every row done and recorded the edited file as its own."""
    cfg, run = copy
    rows = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    rows[0]["content"] = "HAND EDITED WRONG ANSWER 42"
    write_jsonl(run / "conversations.jsonl", rows)
    refused("tokenize", cfg, run, "conversations.jsonl changed after `eagle3kit generate`")
    said = refused(
        "generate",
        cfg,
        run,
        "conversations.jsonl changed after `eagle3kit generate` finished it",
        "Restore the file, or move it away",
    )
    assert "would keep the changed ones" in said


def test_a_train_killed_in_its_first_run_leaves_a_checkpoint_export_refuses(copy):
    """Attack finding: best.safetensors of a train killed before it finished was exported as the
    drafter. train marks it unfinished before its first epoch; a rerun finishes and records it."""
    cfg, run = copy
    rec = run.manifest["lineage"]["checkpoints/best.safetensors"]
    run.mark_pending("checkpoints/best.safetensors", "train", rec["from"], rec["target"])
    refused("export", cfg, run, "best.safetensors is unfinished", "`eagle3kit train` was stopped")


def test_train_retrains_when_its_best_checkpoint_was_replaced(copy):
    """Attack finding: a best.safetensors replaced by hand was refused by export ("rerun train"),
    and train said "all epochs already done" and left it: a dead end. Now train sets the
    checkpoints aside and trains again; export then takes the new one."""
    from safetensors.torch import load_file, save_file

    cfg, run = copy
    best = run / "checkpoints" / "best.safetensors"
    w = load_file(str(best))
    save_file({k: v * 2 if v.is_floating_point() else v for k, v in w.items()}, str(best))
    refused("export", cfg, run, "best.safetensors changed after `eagle3kit train`")
    stages()["train"](cfg, run)
    assert list(run.path.glob("checkpoints.prev-*/best.safetensors"))
    stages()["export"](cfg, run, overwrite=True)  # the export of the old checkpoint is moved aside, not lost


def test_train_without_validation_keeps_a_best_checkpoint_and_refuses_an_epoch_that_supervises_nothing(copy):
    """Attack findings: with val_fraction 0 no best.safetensors was ever written unless the loss
    fell below 1 (the score started at −1); an epoch in which no position was supervised (the
    target's top-1 never in the draft vocabulary) trained on and reported success."""
    import torch

    from eagle3kit.model.draft_vocab import load_vocab, save_vocab

    cfg, run = copy
    cfg.train.val_fraction = 0.0
    out = stages()["train"](cfg, run)
    assert out["val_samples"] == 0 and (run / "checkpoints" / "best.safetensors").exists()
    vocab, meta = load_vocab(run / "vocab.safetensors")
    m = json.loads((run / "manifest.json").read_text())
    del m["lineage"]  # as after a deleted manifest: nothing to check against
    (run / "manifest.json").write_text(json.dumps(m))
    from eagle3kit.model.draft_vocab import DraftVocab

    unused = torch.tensor(
        sorted(set(range(vocab.vocab_size)) - set(vocab.ids.tolist()))[-vocab.ids.numel() :]
    )
    save_vocab(run / "vocab.safetensors", DraftVocab(ids=unused, vocab_size=vocab.vocab_size), meta)
    cfg.train.epochs = 1
    cfg.train.seed = 1
    with pytest.raises(DataError, match="epoch 1 supervised no position"):
        stages()["train"](cfg, run)


def test_a_manifest_of_the_wrong_shape_is_one_line_not_a_traceback(copy):
    cfg, run = copy
    for bad in ("[]", '{"lineage": []}', '{"lineage": {"tokens.safetensors": {"sha256": "x"}}}'):
        (run / "manifest.json").write_text(bad)
        code, said, res = cli("vocab", "--config", run.path.parent / "c.yaml")
        assert code == 2 and "Traceback" not in res.output and "not an eagle3kit manifest.json" in said, (
            bad,
            said,
        )


@pytest.mark.parametrize(
    "name,args,fix",
    [
        ("tokens.safetensors", ["vocab"], "rerun `eagle3kit tokenize`"),
        ("vocab.safetensors", ["train"], "rerun `eagle3kit vocab`"),
        ("checkpoints/best.safetensors", ["export", "--overwrite"], "rerun `eagle3kit train`"),
        ("checkpoints/last.safetensors", ["train", "--epochs", "2"], "move checkpoints/ away"),
        ("checkpoints/train_state.pt", ["train", "--epochs", "2"], "move checkpoints/ away"),
    ],
)
def test_a_truncated_file_is_one_line_naming_it_and_the_stage_that_writes_it(copy, name, args, fix):
    """Hostile-input trial: a run file cut short (an interrupted copy, a full disk) ended the next
    stage in safetensors' "incomplete metadata" traceback (torch's unpickling one for train_state.pt)."""
    cfg, run = copy
    path = run / name
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.6)])
    code, said, res = cli(*args, "--config", run.path.parent / "c.yaml")
    assert code == 2 and "Traceback" not in res.output, said
    assert str(path) in said and "unreadable" in said and fix in said, said


def test_a_corrupt_report_says_to_delete_that_file_not_the_run(copy):
    """Hostile-input trial: a truncated report.json was met with "delete the run directory", though
    it holds only summaries; deleting it alone is the fix, and the stage then runs."""
    cfg, run = copy
    text = (run / "report.json").read_text()
    (run / "report.json").write_text(text[: len(text) // 2])
    code, said, res = cli("vocab", "--config", run.path.parent / "c.yaml")
    assert code == 2 and "delete report.json alone" in said and "delete the run directory" not in said, said
    (run / "report.json").unlink()
    code, said, res = cli("vocab", "--config", run.path.parent / "c.yaml")
    assert code == 0, said


def test_a_second_train_on_the_same_run_dir_is_refused_while_one_trains(copy):
    """Hostile-input trial: two `train` processes on one run directory both ran, writing the same
    checkpoints, until one crashed; train holds .train.lock as generate holds its own."""
    from eagle3kit.core.rundir import DataError

    cfg, run = copy
    before = (run / "checkpoints" / "best.safetensors").read_bytes()
    cfg.train.epochs = 2
    with run.lock("train"):  # another train, still running
        with pytest.raises(DataError, match="another `eagle3kit train`"):
            stages()["train"](cfg, run)
    assert (run / "checkpoints" / "best.safetensors").read_bytes() == before


def test_a_file_brought_without_a_record_is_taken_as_it_is(copy, tmp_path):
    """Conversations you bring (no record of how they were made) tokenize; lineage starts there."""
    cfg, run = copy
    m = json.loads((run / "manifest.json").read_text())
    del m["lineage"]["conversations.jsonl"]
    (run / "manifest.json").write_text(json.dumps(m))
    rows = [r for _, r in read_jsonl(run / "conversations.jsonl")]
    write_jsonl(run / "conversations.jsonl", rows[1:])
    stages()["tokenize"](cfg, run)
    assert "conversations.jsonl" in RunDir(run.path).manifest["lineage"]["tokens.safetensors"]["from"]


# ---- no traceback on a full disk, a read-only folder, a target vLLM cannot import ----------------


def cli(*args):
    from typer.testing import CliRunner

    from eagle3kit.cli import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, " ".join(res.output.split()), res


def io_error(monkeypatch, errno_number, text):
    """Every safetensors write fails as the Rust writer fails on that disk (SafetensorError)."""
    import safetensors.torch
    from safetensors import SafetensorError

    def fail(*a, **kw):
        raise SafetensorError(f"Error while serializing: I/O error: {text} (os error {errno_number})")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)


def test_a_full_disk_in_tokenize_is_one_line_naming_the_file_and_keeps_the_old_shard(copy, monkeypatch):
    cfg, run = copy
    before = (run / "tokens.safetensors").read_bytes()
    io_error(monkeypatch, 28, "No space left on device")
    code, said, res = cli("tokenize", "--config", run.path.parent / "c.yaml")
    assert code == 2 and (res.exception is None or isinstance(res.exception, SystemExit)), res.exception
    assert (
        f"could not write {run / 'tokens.safetensors'}: No space left on device; free space on that disk"
        in said
    )
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) <= 3
    assert (run / "tokens.safetensors").read_bytes() == before and not list(run.path.glob("*.tmp"))


def test_a_read_only_run_dir_in_vocab_is_one_line_naming_the_file(copy, monkeypatch):
    cfg, run = copy
    io_error(monkeypatch, 30, "Read-only file system")
    code, said, res = cli("vocab", "--config", run.path.parent / "c.yaml")
    assert code == 2 and "Traceback" not in res.output
    assert (
        f"could not write {run / 'vocab.safetensors'}: Read-only file system" in said
        and "writable one" in said
    )


@pytest.mark.parametrize(
    "stage,what", [("tokenize", "tokenize's tokens.safetensors"), ("vocab", "vocab.safetensors")]
)
def test_tokenize_and_vocab_check_free_disk_before_any_work(copy, monkeypatch, stage, what):
    import shutil as sh
    from collections import namedtuple

    cfg, run = copy
    out = run / ("tokens.safetensors" if stage == "tokenize" else "vocab.safetensors")
    before = out.read_bytes()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    code, said, res = cli(stage, "--config", run.path.parent / "c.yaml")
    assert code == 2 and "Traceback" not in res.output
    assert f"{what} needs about" in said and "1,000 free" in said and "nothing was started" in said
    assert out.read_bytes() == before


def test_train_checks_free_disk_before_the_first_epoch(copy, monkeypatch):
    import shutil as sh
    from collections import namedtuple

    cfg, run = copy
    log = (run / "train_log.jsonl").read_text() if (run / "train_log.jsonl").exists() else ""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    code, said, res = cli("train", "--config", run.path.parent / "c.yaml")
    assert code == 2 and "Traceback" not in res.output
    assert "train's checkpoints needs about" in said and "1,000 free" in said
    assert ((run / "train_log.jsonl").read_text() if (run / "train_log.jsonl").exists() else "") == log


def test_bench_on_a_full_disk_names_the_file_and_leaves_nothing_that_blocks_a_rerun(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    from eagle3kit.core.rundir import DataError
    from eagle3kit.serve.benchreport import write_outputs

    real = Path.write_text

    def full(self, *a, **kw):
        if self.name.startswith("bench.md"):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *a, **kw)

    from standin_server import StandInServer

    from eagle3kit.serve.bench import run_bench

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["hello"]}) + "\n")
    with StandInServer() as srv:
        record = run_bench(srv.url.removesuffix("/v1"), prompts, [1], 4, template_check=False, warmup=0)
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(DataError, match="could not write .*bench.md: No space left on device; free space"):
        write_outputs(record, tmp_path / "b")
    assert list((tmp_path / "b").iterdir()) == []  # no bench.json, no empty bench.md


def test_a_read_only_run_dir_in_generate_is_one_line_with_the_fix(copy, monkeypatch):
    """Attack finding: on a read-only disk generate (its lock file), like prompts, train and export,
    printed Python's bare errno line; every command now names the file and the fix."""
    import errno
    import os as _os

    cfg, run = copy
    real_open = _os.open

    def ro_open(path, flags, *a, **kw):
        if flags & (_os.O_WRONLY | _os.O_RDWR | _os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(_os, "open", ro_open)
    code, said, res = cli("generate", "--config", run.path.parent / "c.yaml")
    assert code == 2 and "Traceback" not in res.output
    assert (
        f"could not write {run / '.generate.lock'}: Read-only file system; the file system is read-only"
        in said
    )


def test_bench_checks_free_disk_before_anything_is_timed(tmp_path, monkeypatch):
    import shutil as sh
    from collections import namedtuple

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["hello"]}) + "\n")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    code, said, res = cli(
        "bench", "--base-url", "http://127.0.0.1:9", "--prompts", prompts, "--out", tmp_path / "b"
    )
    assert code == 2 and "Traceback" not in res.output
    assert (
        "bench's results (bench.json, bench.md, bench.png) needs about" in said
        and "nothing was started" in said
    )


def test_a_changed_chat_template_is_what_tokens_were_built_from_and_nothing_rewrites_that(copy):
    """The target's chat template edited after a whole run: `train` refuses the tokens rendered with
    the old one, `run` refuses to resume generation over rows whose prompts it rendered, the manifest still
    names the template the tokens were built from until `tokenize` runs again, which records the new one."""
    from typer.testing import CliRunner

    from eagle3kit.cli import app
    from eagle3kit.core.config import TargetConfig
    from eagle3kit.model.target import chat_template_hash
    from eagle3kit.model.target_files import load_tokenizer
    from eagle3kit.pipeline import run_all

    cfg, run = copy
    before = run.manifest["chat_template_sha256"]
    jinja = cfg.target.model + "/chat_template.jinja"
    with open(jinja, "a") as f:
        f.write("{# a fix #}")
    now = chat_template_hash(load_tokenizer(TargetConfig(model=cfg.target.model)))
    assert now != before
    config = str(run.path.parent / "c.yaml")
    res = CliRunner().invoke(app, ["train", "-c", config])
    assert res.exit_code == 2 and "another chat template" in " ".join(res.output.split()), res.output
    with pytest.raises(ConfigError, match="chat_template"):
        run_all(cfg)
    assert run.manifest["chat_template_sha256"] == before  # the tokens' record was not rewritten
    res = CliRunner().invoke(app, ["tokenize", "-c", config])
    assert res.exit_code == 0, res.output
    assert run.manifest["chat_template_sha256"] == now
    assert run.manifest["stages"]["tokenize"]["inputs"]["chat_template"] == now


def test_a_tokenizer_that_keeps_its_vocabulary_but_merges_differently_hashes_differently(
    smollm2_tok_dir, tmp_path
):
    """The tokenizer's hash covers what turns text into ids: dropping one BPE merge keeps every id and
    special token but tokenizes text to other ids, so every stage keyed on the tokenizer reruns."""
    import shutil

    from transformers import AutoTokenizer

    from eagle3kit.model.target import tokenizer_hash

    edited = tmp_path / "tok"
    shutil.copytree(smollm2_tok_dir, edited)
    spec = json.loads((edited / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][1:]
    (edited / "tokenizer.json").write_text(json.dumps(spec))
    a, b = AutoTokenizer.from_pretrained(smollm2_tok_dir), AutoTokenizer.from_pretrained(edited)
    assert a.get_vocab() == b.get_vocab()
    text = "The quick brown fox jumps over the lazy dog. " * 3
    assert a(text)["input_ids"] != b(text)["input_ids"]
    assert tokenizer_hash(a) != tokenizer_hash(b)
    a(text, truncation=True, max_length=4)  # a call's truncation state is not part of the tokenizer
    assert tokenizer_hash(a) == tokenizer_hash(AutoTokenizer.from_pretrained(smollm2_tok_dir))


def test_the_vocab_stage_tells_a_dflash_run_its_draft_vocabulary_is_unused(copy, monkeypatch):
    """A draft vocabulary larger than the data's distinct tokens warns "a smaller draft_vocab_size would
    do" — advice that means nothing to a DFlash drafter, which predicts over the whole vocabulary."""
    import io

    from rich.console import Console

    from eagle3kit.data import vocab as vocab_stage

    buf = io.StringIO()
    monkeypatch.setattr(vocab_stage, "console", Console(file=buf, width=200))
    cfg, run = copy
    big = cfg.model_copy(update={"vocab": cfg.vocab.model_copy(update={"draft_vocab_size": 200})})
    vocab_stage.run_vocab(big, run)
    assert "a smaller vocab.draft_vocab_size would do" in buf.getvalue()
    buf.truncate(0)
    buf.seek(0)
    dflash = big.model_copy(update={"drafter": big.drafter.model_copy(update={"variant": "dflash"})})
    vocab_stage.run_vocab(dflash, run)
    assert (
        "would do" not in buf.getvalue()
        and "a DFlash drafter predicts over the target's whole vocabulary" in buf.getvalue()
    )
