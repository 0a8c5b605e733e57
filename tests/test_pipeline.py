"""The whole `run` on a tiny random Llama (real SmolLM2 tokenizer and template, real prompts), then
each stage alone from the CLI, decode vs simulate, and the train/eval overlap guard."""

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import GSM8K, MT_BENCH
from typer.testing import CliRunner

from eagle3kit.cli import app
from eagle3kit.core.config import load_config
from eagle3kit.core.rundir import DataError, RunDir
from eagle3kit.pipeline import run_all


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_target_dir):
    d = tmp_path_factory.mktemp("tiny-run")
    cfg_path = d / "config.yaml"
    cfg_path.write_text(f"""
run_dir: {d / "run"}
target: {{model: {tiny_target_dir}, dtype: float64}}
prompts:
  sources: [{{path: {GSM8K}, stop: 40}}]
generate: {{backend: transformers, max_new_tokens: 32, batch_size: 8}}
vocab: {{draft_vocab_size: 512}}
train: {{epochs: 12, ttt_steps: 3, tokens_per_step: 512, lr: 0.002}}
evaluate:
  k: 3
  max_new_tokens: 32
  sets: [{{path: {MT_BENCH}, name: mt_bench, limit: 4}}]
""")
    cfg = load_config(cfg_path)
    report = run_all(cfg)
    return cfg, cfg_path, RunDir(cfg.run_dir), report


def test_run_writes_every_stage_and_the_report_keys(tiny_run):
    cfg, _, run, report = tiny_run
    for name in (
        "prompts.jsonl",
        "conversations.jsonl",
        "tokens.safetensors",
        "vocab.safetensors",
        "checkpoints/best.safetensors",
        "drafter/config.json",
        "drafter/model.safetensors",
        "manifest.json",
    ):
        assert (run / name).exists(), name
    ev = report["evaluate"]
    assert ev["mode"] == "simulate" and ev["k"] == 3 and ev["num_prompts"] == 4
    assert len(ev["per_position_acceptance"]) == 3 and "mt_bench" in ev["sets"]
    assert 1.0 <= ev["tau"] <= 4.0
    assert report["prompts"]["rows_kept"] == 40 and report["generate"]["rows_kept"] == 40
    assert (
        report["tokenize"]["rows_kept"]
        + sum(v for k, v in report["tokenize"].items() if k.startswith("dropped_"))
        == 40
    )
    assert (
        report["tokenize"]["selfcheck_rows"] == report["tokenize"]["rows_kept"]
        and report["tokenize"]["selfcheck_mismatch"] == 0
    )
    assert 0 < report["vocab"]["coverage"] <= 1
    stages = report["run"]["stages"]  # every stage's wall time, each within the run's
    names = ["load target", "prompts", "generate", "tokenize", "vocab", "train", "export", "evaluate"]
    assert list(stages) == names
    assert all(0 <= r["seconds"] <= report["run"]["seconds"] for r in stages.values())
    assert sum(r["seconds"] for r in stages.values()) <= report["run"]["seconds"] + 1
    assert report["train"]["final_loss"] > 0 and 0 <= report["train"]["step0_accuracy"] <= 1
    tr = report["train"]  # steady: the steps after the first three only; wall: the stage's whole clock
    assert (
        tr["tokens_per_s_wall"] == tr["tokens_per_s"] and tr["tokens_per_s_steady"] > tr["tokens_per_s_wall"]
    )
    m = run.manifest
    assert m["aux_layer_ids"] == {"convention": "hf_output_hidden_states_index", "ids": [2, 4, 5]}
    assert m["tokenizer_sha256"] and m["chat_template_sha256"] and m["draft_vocab_sha256"]
    exported = json.loads((run / "drafter/config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert exported["draft_vocab_size"] == 512 and exported["vocab_size"] == 49152
    # the folder `vllm serve` serves alone: the same tensors under speculators' names, the target as verifier
    from safetensors.torch import load_file

    alone = json.loads((run / "drafter-speculators/config.json").read_text())
    assert alone["speculators_config"]["verifier"]["name_or_path"] == str(Path(cfg.target.model).resolve())
    dual = load_file(str(run / "drafter/model.safetensors"))
    spec = load_file(str(run / "drafter-speculators/model.safetensors"))
    assert {k.replace("midlayer.", "layers.0."): v for k, v in dual.items()}.keys() == spec.keys()
    assert all(torch.equal(v, spec[k.replace("midlayer.", "layers.0.")]) for k, v in dual.items())
    assert report["export-speculators"]["path"] == str(run / "drafter-speculators")


def test_training_beats_the_untrained_drafter(tiny_run):
    ev = tiny_run[3]["evaluate"]
    assert ev["untrained_tau"] < 1.1
    assert ev["tau"] > ev["untrained_tau"] + 0.3


def test_simulate_and_decode_agree_and_decode_is_lossless(tiny_run):
    from eagle3kit.eval.evaluate import run_evaluate

    cfg, _, run, _ = tiny_run
    rep = run_evaluate(cfg, run, mode="decode")
    assert rep["greedy_identical"] is True
    s = rep["sets"]["mt_bench"]
    assert s["mismatches"] == []
    assert s["tau"] == pytest.approx(s["simulate_tau_same_prompts"], abs=1e-9)
    assert s["tau"] > 1.2
    assert sum(1 for h in s["accept_histogram"] if h) >= 2  # partial acceptances and rejections both happened
    assert s["draft"]["mode"] == "chain" and s["tokens_per_s"] > 0 and s["baseline_tokens_per_s"] > 0
    assert s["speedup"] == pytest.approx(
        s["tokens_per_s"] / s["baseline_tokens_per_s"], rel=0.01
    )  # both rounded


def test_evaluate_decodes_with_a_tree_from_the_cli_losslessly_and_per_category(tiny_run):
    """... and leaves the run's stored recipe alone: its one-off flags are recorded in the report section it
    writes, not in config.yaml (a later plain evaluate or run measures the recipe's settings)."""
    _, cfg_path, run, _ = tiny_run
    stored = (run / "config.yaml").read_text()
    assert "mode: simulate" in stored
    res = CliRunner().invoke(
        app,
        [
            "evaluate",
            "--config",
            str(cfg_path),
            "--mode",
            "decode",
            "--draft",
            "tree",
            "--k",
            "3",
            "--topk",
            "4",
            "--num-draft-tokens",
            "12",
            "--section",
            "evaluate-tree",
        ],
    )
    assert res.exit_code == 0, res.output
    assert (run / "config.yaml").read_text() == stored
    rep = json.loads((run / "report.json").read_text())["evaluate-tree"]
    assert (rep["mode"], rep["k"]) == ("decode", 3)
    s = rep["sets"]["mt_bench"]
    assert rep["greedy_identical"] is True and s["draft"] == {
        "mode": "tree",
        "steps": 3,
        "topk": 4,
        "num_draft_tokens": 12,
        "temperature": 0.0,
        "top_p": 1.0,
    }
    chain = json.loads((run / "report.json").read_text())["evaluate"]["sets"]["mt_bench"]
    assert s["tau"] >= chain["tau"]  # 4 candidates per depth accept no less than 1
    assert (
        list(s["per_category"]) == ["writing"]
        and s["per_category"]["writing"]["prompts"] == s["num_prompts"] == 4
    )
    assert "speedup" in res.output
    bad = CliRunner().invoke(app, ["evaluate", "--config", str(cfg_path), "--draft", "tree"])
    assert bad.exit_code != 0 and "set evaluate.mode to decode" in " ".join(bad.output.split())


def test_each_stage_runs_alone_from_the_cli(tiny_run):
    _, cfg_path, run, _ = tiny_run
    r = CliRunner()
    res = r.invoke(app, ["vocab", "--config", str(cfg_path)])
    assert res.exit_code == 0, res.output
    res = r.invoke(app, ["export", "--config", str(cfg_path), "--out", str(run / "again")])
    assert res.exit_code == 0, res.output
    assert (run / "again/model.safetensors").exists()
    res = r.invoke(app, ["export", "--config", str(cfg_path), "--out", str(run / "again")])
    assert res.exit_code == 0 and "up_to_date" in res.output  # the same checkpoint: nothing to do
    from eagle3kit.train.checkpoints import load_drafter_checkpoint, save_drafter_checkpoint

    other = load_drafter_checkpoint(run / "checkpoints/best.safetensors")
    with torch.no_grad():
        other.norm.weight.add_(1.0)
    save_drafter_checkpoint(other, run / "other.safetensors", {})
    res = r.invoke(
        app,
        [
            "export",
            "--config",
            str(cfg_path),
            "--out",
            str(run / "again"),
            "--checkpoint",
            str(run / "other.safetensors"),
        ],
    )
    assert res.exit_code == 2 and "overwrite" in res.output  # another drafter is never overwritten silently


def test_a_stage_without_its_input_says_which_stage_to_run(tmp_path):
    res = CliRunner().invoke(app, ["tokenize", "--run-dir", str(tmp_path / "nonexistent")])
    assert (
        res.exit_code == 2
        and "does not exist" in " ".join(res.output.split())
        and not (tmp_path / "nonexistent").exists()
    )
    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(app, ["tokenize", "--run-dir", str(tmp_path / "empty")])
    assert res.exit_code == 2
    out = " ".join(res.output.split()).replace("\n", "")
    assert "is missing: run `eagle3kit generate" in out


def test_evaluation_prompts_that_were_trained_on_are_refused(tiny_run, tmp_path):
    from eagle3kit.eval.evaluate import run_evaluate

    cfg, _, run, _ = tiny_run
    bad = cfg.model_copy(deep=True)
    bad.evaluate.sets[0].path = str(GSM8K)
    bad.evaluate.sets[0].limit = 3
    with pytest.raises(DataError, match="were trained on"):
        run_evaluate(bad, run)


def test_c16_shallow_target_fails_before_any_work(tmp_path, smollm2_tokenizer):
    from conftest import build_tiny_llama

    d = tmp_path / "four"
    build_tiny_llama(4).save_pretrained(d)
    smollm2_tokenizer.save_pretrained(d)
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "target": {"model": str(d)}})
    from eagle3kit.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"\[2, 2, 1\]"):
        run_all(cfg)
    assert not (tmp_path / "run" / "prompts.jsonl").exists()


def test_a_train_setting_this_machine_cannot_run_fails_before_any_stage(tmp_path, tiny_target_dir):
    from eagle3kit.core.config import ConfigError

    for bad in ({"precision": "tf32"}, {"attention": "flex"}):
        cfg = load_config(
            None, {"run_dir": str(tmp_path / "run"), "target": {"model": str(tiny_target_dir)}, "train": bad}
        )
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            run_all(cfg)
        assert not (tmp_path / "run" / "prompts.jsonl").exists()


def test_train_rerun_resumes_and_never_deletes_earlier_checkpoints(tiny_run):
    from eagle3kit.train.stage import run_train

    cfg, _, run, report = tiny_run
    target = None
    again = run_train(cfg, run, target)  # every epoch is done: nothing is retrained
    assert again["history"] == report["train"]["history"]
    before = (run / "checkpoints/best.safetensors").read_bytes()
    changed = cfg.model_copy(deep=True)
    changed.train.epochs = 1
    run_train(changed, run)  # other inputs: the old state is set aside, not lost
    assert (run / "checkpoints.prev-1/best.safetensors").read_bytes() == before
    assert (run / "checkpoints.prev-1/train_log.jsonl").exists()
    # the first inputs again: their set-aside checkpoints are put back and resumed (all done), and
    # the other run's are set aside in turn
    back = run_train(cfg, run)
    assert back["history"] == report["train"]["history"]
    assert (run / "checkpoints/best.safetensors").read_bytes() == before
    assert not (run / "checkpoints.prev-1").exists()
    assert len(back["history"]) == cfg.train.epochs != 1
    assert len(json.loads((run / "checkpoints.prev-2/train_log.jsonl").read_text().splitlines()[-1])) > 0


def test_train_refuses_a_vocab_built_with_another_tokenizer(tiny_run, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from eagle3kit.core.config import ConfigError
    from eagle3kit.train.stage import run_train

    cfg, _, run, _ = tiny_run
    other = RunDir(tmp_path / "other")
    for name in ("tokens.safetensors", "vocab.safetensors"):
        shutil.copy(run / name, other / name)
    save_file(
        load_file(str(other / "vocab.safetensors")),
        str(other / "vocab.safetensors"),
        metadata={"tokenizer_sha256": "0" * 64},
    )
    with pytest.raises(ConfigError, match="another tokenizer"):
        run_train(cfg, other)


def test_rows_from_other_settings_or_other_prompts_never_reach_training(tiny_run, tmp_path):
    import shutil

    from eagle3kit.core.config import ConfigError
    from eagle3kit.data.generate import run_generate
    from eagle3kit.data.tokenize import run_tokenize
    from eagle3kit.eval.evaluate import run_evaluate

    cfg, _, run, _ = tiny_run
    other = RunDir(tmp_path / "r")
    for name in ("prompts.jsonl", "conversations.jsonl", "vocab.safetensors", "manifest.json"):
        shutil.copy(run / name, other / name)
    shutil.copytree(run / "drafter", other / "drafter")
    c2 = cfg.model_copy(deep=True)
    c2.run_dir = str(other.path)
    c2.generate.max_new_tokens = 16  # other sampling settings: refuse to mix
    with pytest.raises(
        ConfigError, match=r"other settings — sampling: .*max_new_tokens.: 32.* but now .*max_new_tokens.: 16"
    ):
        run_generate(c2, other)
    # the prompt set shrinks: old conversations stay on disk but are not tokenized ... (the prompt file is
    # cut by hand here, which lineage would refuse — tests/test_lineage.py — so this run dir is one
    # without lineage records, as runs made before them are)
    m = json.loads((other / "manifest.json").read_text())
    m.pop("lineage", None)
    (other / "manifest.json").write_text(json.dumps(m))
    rows = (other / "prompts.jsonl").read_text().splitlines()
    (other / "prompts.jsonl").write_text("\n".join(rows[:30]) + "\n")
    counts = run_tokenize(cfg, other)
    assert counts["dropped_not_in_prompts"] == 10 and counts["rows_in"] == 40
    # ... and an evaluation set holding one of them is still refused as trained-on
    import json as _json

    dropped = _json.loads(rows[35])
    (tmp_path / "ev.jsonl").write_text(_json.dumps({"messages": dropped["messages"]}) + "\n")
    c3 = cfg.model_copy(deep=True)
    c3.evaluate.sets[0].path = str(tmp_path / "ev.jsonl")
    with pytest.raises(DataError, match="were trained on"):
        run_evaluate(c3, other)


def test_evaluate_refuses_a_drafter_trained_for_another_target(tiny_run, tmp_path, smollm2_tokenizer):
    from conftest import build_tiny_llama

    from eagle3kit.core.config import ConfigError
    from eagle3kit.core.lineage import StaleInput
    from eagle3kit.eval.evaluate import run_evaluate

    cfg, _, run, _ = tiny_run
    d = tmp_path / "other-tiny"
    build_tiny_llama(8, seed=1).save_pretrained(d)
    smollm2_tokenizer.save_pretrained(d)
    c2 = cfg.model_copy(deep=True)
    c2.target.model = str(d)
    with pytest.raises(ConfigError, match="trained on another target"):  # the drafter's own record
        run_evaluate(c2, run, drafter_dir=str(run / "drafter"))
    with pytest.raises(StaleInput, match="other target weights"):  # the run's chain, first
        run_evaluate(c2, run)


def test_an_empty_evaluation_set_is_an_error_not_tau_1(tiny_run, tmp_path):
    from eagle3kit.core.config import ConfigError
    from eagle3kit.eval.evaluate import run_evaluate

    cfg, _, run, _ = tiny_run
    c2 = cfg.model_copy(deep=True)
    c2.evaluate.sets[0].start = 10**6  # past the end of the file: no rows
    with pytest.raises(
        ConfigError, match="hold no prompts"
    ):  # (the folder: other tests here retrain the run)
        run_evaluate(c2, run, drafter_dir=str(run / "drafter"))


def test_a_variant_trained_with_an_lk_loss_says_so_in_its_report_and_logs_alpha(tiny_run, tmp_path):
    """The pipeline's own data, one epoch of a P-EAGLE drafter under lk_lambda (CLI): the train report
    names the variant and the loss, every step's log record holds α per TTT step, the export is P-EAGLE."""
    import shutil

    from typer.testing import CliRunner

    from eagle3kit.cli import app
    from eagle3kit.model.folder import load_exported

    _, cfg_path, run, _ = tiny_run
    copy = tmp_path / "run"
    copy.mkdir()
    for f in ("tokens.safetensors", "vocab.safetensors", "manifest.json", "report.json"):
        shutil.copy(run / f, copy / f)
    text = cfg_path.read_text() + "drafter: {variant: p-eagle}\n"
    text = text.replace("train: {epochs: 12,", "train: {loss: lk_lambda, epochs: 1,")
    (tmp_path / "c.yaml").write_text(text)
    for stage in ("train", "export"):
        res = CliRunner().invoke(app, [stage, "-c", str(tmp_path / "c.yaml"), "--run-dir", str(copy)])
        assert res.exit_code == 0, res.output
    rep = json.loads((copy / "report.json").read_text())["train"]
    assert rep["loss"] == "lk_lambda" and rep["drafter_variant"] == "p-eagle"
    recs = [json.loads(x) for x in (copy / "train_log.jsonl").read_text().splitlines()]
    assert recs and all(len(r["alpha"]) == 3 and all(0 <= a <= 1 for a in r["alpha"]) for r in recs)
    assert load_exported(copy / "drafter").config.parallel_drafting


def test_export_names_the_verifier_the_serving_machine_loads(tiny_run):
    """`export --format speculators --verifier ID` writes ID as the target `vllm serve` loads; another
    verifier over an existing folder needs --overwrite; --verifier without the speculators format is refused."""
    _, _, run, _ = tiny_run
    folder = run / "drafter-speculators"
    before = json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]
    base = ["export", "--run-dir", str(run.path), "--format", "speculators", "--verifier", "org/target-8b"]
    refused = CliRunner().invoke(app, base)
    assert "already holds" in " ".join(refused.output.split()) or "--overwrite" in refused.output, (
        refused.output
    )
    assert (
        refused.exit_code != 0
        and json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"] == before
    )  # nothing overwritten unasked
    res = CliRunner().invoke(app, [*base, "--overwrite"])
    assert res.exit_code == 0, res.output
    verifier = json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "org/target-8b", "architectures": ["LlamaForCausalLM"]}
    res = CliRunner().invoke(app, ["export", "--run-dir", str(run.path), "--verifier", "org/target-8b"])
    assert res.exit_code == 2 and "--format speculators" in res.output


def test_run_keeps_the_verifier_an_export_named_and_refuses_an_empty_one(tiny_run):
    """After `export --verifier ID`, `run` (the same drafter) leaves the folder and the target it names."""
    from eagle3kit.pipeline import export_for_vllm_alone

    cfg, _, run, _ = tiny_run
    folder = run / "drafter-speculators"
    res = CliRunner().invoke(
        app,
        [
            "export",
            "--run-dir",
            str(run.path),
            "--format",
            "speculators",
            "--verifier",
            "org/x",
            "--overwrite",
        ],
    )
    assert res.exit_code == 0, res.output
    aside = len(list(run.path.glob("drafter-speculators.prev-*")))
    export_for_vllm_alone(cfg, run, None)
    assert (
        json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
        == "org/x"
    )
    assert len(list(run.path.glob("drafter-speculators.prev-*"))) == aside  # nothing moved aside
    res = CliRunner().invoke(
        app, ["export", "--run-dir", str(run.path), "--format", "speculators", "--verifier", " "]
    )
    assert res.exit_code == 2 and "--verifier is empty" in res.output
    res = CliRunner().invoke(
        app,
        ["export", "--run-dir", str(run.path), "--format", "speculators", "--verifier", "/no/such/target"],
    )
    assert res.exit_code == 2 and "no such folder here" in res.output


def test_run_with_a_run_dir_alone_reads_its_config_and_never_starts_the_default_over_a_run(
    tiny_run, tmp_path
):
    _, _, run, _ = tiny_run
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text("{}")  # a run whose config.yaml was lost
    res = CliRunner().invoke(app, ["run", "--run-dir", str(tmp_path / "old")])
    assert res.exit_code == 2 and "holds a run but no config.yaml" in res.output
    assert (tmp_path / "old" / "manifest.json").read_text() == "{}"  # left as it was


def test_export_and_evaluate_refuse_the_runs_drafter_of_another_kind_than_the_config(tiny_run):
    """A config naming DFlash over a run whose checkpoint and export are EAGLE-3.1's: export would say up to
    date and keep the EAGLE folder, evaluate would report the EAGLE drafter's τ as DFlash's. Both refuse,
    naming both kinds; an explicitly named checkpoint or folder is still read as what it is."""
    from eagle3kit.core.config import ConfigError
    from eagle3kit.eval.evaluate import run_evaluate
    from eagle3kit.serve.export import run_export

    cfg, cfg_path, run, _ = tiny_run
    other = load_config(cfg_path, {"drafter": {"variant": "dflash"}})
    before = (run / "drafter" / "model.safetensors").read_bytes()
    with pytest.raises(
        ConfigError,
        match=r"best.safetensors holds a drafter of kind EAGLE-3, but the config.s drafter.variant dflash trains",
    ):
        run_export(other, run)
    with pytest.raises(
        ConfigError,
        match=r"drafter holds a drafter of kind EAGLE-3, but the config's drafter.variant dflash trains DFlash",
    ):
        run_evaluate(other, run)
    assert (run / "drafter" / "model.safetensors").read_bytes() == before
    # exporting a named checkpoint under another config leaves the run's recipe as it was
    stored = (run / "config.yaml").read_text()
    other_path = cfg_path.parent / "other.yaml"
    other_path.write_text(cfg_path.read_text() + "drafter: {variant: dflash}\n")
    best = str(run / "checkpoints" / "best.safetensors")
    res = CliRunner().invoke(
        app,
        [
            "export",
            "-c",
            str(other_path),
            "--checkpoint",
            best,
            "--out",
            str(cfg_path.parent / "named-export"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (run / "config.yaml").read_text() == stored
    rep = run_evaluate(other, run, drafter_dir=str(run / "drafter"), section="evaluate-named")
    assert rep["sets"]["mt_bench"]["tau"] > 1.0


def test_training_another_kind_in_a_run_sets_the_old_checkpoints_aside_and_switching_back_puts_them_back(
    tiny_run, tmp_path, capsys
):
    """The same run folder trained as DFlash after EAGLE-3.1: the EAGLE checkpoints, log and state move to
    checkpoints.prev-N (as docs/training.md promises), the message names the changed field, the new log holds
    DFlash's epochs alone; switching back to EAGLE-3.1 puts its checkpoints back instead of blaming a kill."""
    import shutil

    from eagle3kit.core.rundir import read_jsonl
    from eagle3kit.train.stage import run_train

    _, cfg_path, run0, _ = tiny_run
    run = tmp_path / "run"
    shutil.copytree(run0.path, run, ignore=shutil.ignore_patterns("drafter*", "evaluate*"))
    eagle = load_config(cfg_path, {"run_dir": str(run)})
    old_best = (run / "checkpoints" / "best.safetensors").read_bytes()
    n_old = len(list(read_jsonl(run / "train_log.jsonl")))
    dflash = load_config(cfg_path, {"run_dir": str(run), "drafter": {"variant": "dflash", "num_layers": 1},
                                    "train": {"epochs": 1}})  # fmt: skip
    capsys.readouterr()
    run_train(dflash, RunDir(run))
    said = " ".join(capsys.readouterr().err.split())
    assert re.search(r"checkpoints/ were made from other inputs \(changed: [^)]*train\.drafter", said), said
    assert "moved them to" in said and "checkpoints.prev-1" in said
    prev = run / "checkpoints.prev-1"
    assert (prev / "best.safetensors").read_bytes() == old_best and (prev / "train_state.pt").exists()
    assert len(list(read_jsonl(prev / "train_log.jsonl"))) == n_old
    epochs = [r["epoch"] for _, r in read_jsonl(run / "train_log.jsonl")]
    assert epochs and set(epochs) == {1}  # DFlash's one epoch alone, not EAGLE's twelve before it
    capsys.readouterr()
    run_train(eagle, RunDir(run))
    said = " ".join(capsys.readouterr().err.split())
    assert "checkpoints.prev-1/ was made from this run's inputs; put it back" in said and "a kill" not in said
    assert (run / "checkpoints" / "best.safetensors").read_bytes() == old_best


def test_dflash_evaluate_reports_the_untrained_baseline_and_the_token_cap_share_as_eagle_does(
    tiny_run, tmp_path
):
    """DFlash's evaluate section carries what the EAGLE section does: τ of an untrained drafter of the same
    shape (per set and pooled) and the share of continuations that hit the token cap — the same share as the
    EAGLE run's, since both measure the target's own continuations of the same prompts."""
    import shutil

    from eagle3kit.eval.evaluate import run_evaluate
    from eagle3kit.serve.export import run_export
    from eagle3kit.train.stage import run_train

    _, cfg_path, run0, report0 = tiny_run
    run = tmp_path / "run"
    skip = ("drafter*", "evaluate*", "checkpoints*", "train_log.jsonl", "tensorboard")
    shutil.copytree(run0.path, run, ignore=shutil.ignore_patterns(*skip))
    cfg = load_config(cfg_path, {"run_dir": str(run), "drafter": {"variant": "dflash", "num_layers": 1},
                                 "train": {"epochs": 2}})  # fmt: skip
    run_train(cfg, RunDir(run))
    run_export(cfg, RunDir(run))
    rep = run_evaluate(cfg, RunDir(run))
    s, e = rep["sets"]["mt_bench"], report0["evaluate"]["sets"]["mt_bench"]
    assert rep["drafter_kind"] == "dflash" and s["num_prompts"] == e["num_prompts"] == 4
    assert s["hit_max_new_tokens_share"] == e["hit_max_new_tokens_share"]
    assert 1.0 <= s["untrained_tau"] <= 1.0 + rep["k"] and rep["untrained_tau"] == s["untrained_tau"]
