"""`train` under torchrun (issue 7): two CPU processes (gloo) with a DistributedDataParallel or an
FSDP2-sharded drafter, a run killed mid-epoch and resumed from its step checkpoint logs exactly the
loss curve of an uninterrupted run, and the two parallel modes train alike; TensorBoard events are
written. Each launch is a real
``python -m torch.distributed.run --nproc-per-node 2 -m eagle3kit train``."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from eagle3kit.core.rundir import RunDir
from eagle3kit.data.tokenize import save_shard
from eagle3kit.model.draft_vocab import DraftVocab, save_vocab

STEPS_BEFORE_KILL = 5


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, tiny_target):
    """tokens + a 256-token draft vocabulary for the tiny 8-layer target: 24 samples of 10–30
    tokens; the draft vocabulary holds the target's own top-1 picks, so most positions train."""
    from eagle3kit.train.batches import Sample
    from eagle3kit.train.samples import compute_features

    d = tmp_path_factory.mktemp("dist-base")
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(24):
        n = 10 + (i * 13) % 21
        samples.append((torch.randint(3, 2000, (n,), generator=g).tolist(), [0] * 4 + [1] * (n - 4)))
    save_shard(d / "tokens.safetensors", samples)
    online = [Sample(torch.tensor(i), torch.tensor(m, dtype=torch.bool)) for i, m in samples]
    compute_features(tiny_target, online, (2, 4, 5), 4096, torch.device("cpu"), torch.device("cpu"))
    top1 = sorted({int(t) for s in online for t in s.argmax})[:256]
    rest = [i for i in range(3, 49152, 97) if i not in top1][: 256 - len(top1)]
    save_vocab(
        d / "vocab.safetensors", DraftVocab(ids=torch.tensor(sorted(top1 + rest)), vocab_size=49152), {}
    )
    return d


#: the DFlash drafter of the ``dflash`` runs: one layer, blocks of 4 (3 draft tokens), 8 anchors a sample
DFLASH = "drafter: {variant: dflash, num_layers: 1, block_size: 4, max_anchors: 8}\n"


def _cfg_file(run_dir, target_dir, dtype: str, train: str, drafter: str = ""):
    """``run_dir/c.yaml``: the tiny target on the CPU, a 256-token draft vocabulary, TTT 2, and
    ``train`` (the rest of the train section, as YAML flow items); ``drafter``: a drafter section line."""
    cfg = run_dir / "c.yaml"
    cfg.write_text(
        f"run_dir: {run_dir}\ntarget: {{model: {target_dir}, dtype: {dtype}, device: cpu}}\n"
        "vocab: {draft_vocab_size: 256}\n"
        f"train: {{ttt_steps: 2, lr: 0.003, val_fraction: 0.1, device: cpu, {train}}}\nevaluate: {{k: 2}}\n"
        + drafter
    )
    return cfg


def _write_cfg(run_dir, target_dir, parallel: str = "ddp"):
    """``parallel``: ddp or fsdp (the EAGLE-3.1 drafter), or dflash (a DFlash drafter under DDP)."""
    return _cfg_file(
        run_dir,
        target_dir,
        "float64",
        f"epochs: 2, tokens_per_step: 64, checkpoint_every: 3, parallel: {'ddp' if parallel == 'dflash' else parallel}",
        DFLASH if parallel == "dflash" else "",
    )


def _launch(
    run_dir, target_dir, stop_after: int | None = None, parallel: str = "ddp"
) -> subprocess.CompletedProcess:
    return _train(_write_cfg(run_dir, target_dir, parallel), 2, stop_after)


def _train(cfg, processes: int, stop_after: int | None = None) -> subprocess.CompletedProcess:
    """``eagle3kit train -c cfg`` in one process, or under torchrun in ``processes`` (gloo);
    ``stop_after``: the run stops after that many steps (EAGLE3KIT_STOP_AFTER_STEPS)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("EAGLE3KIT_STOP_AFTER_STEPS", None)
    if stop_after:
        env["EAGLE3KIT_STOP_AFTER_STEPS"] = str(stop_after)
    launch = [sys.executable]
    if processes > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    return subprocess.run(
        [*launch, "-m", "eagle3kit", "train", "-c", str(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _log(run_dir) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def whole_runs(base_run, tmp_path_factory, tiny_target_dir) -> dict:
    """The uninterrupted two-process run in each parallel mode, launched once each, whichever test
    asks first: ``{parallel: (run folder, completed process)}``."""
    out = {}
    for parallel in ("ddp", "fsdp", "dflash"):
        d = tmp_path_factory.mktemp(f"whole-{parallel}") / "run"
        shutil.copytree(base_run, d)
        out[parallel] = (d, _launch(d, tiny_target_dir, parallel=parallel))
    return out


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "dflash"])
def test_a_resumed_two_process_run_logs_the_uninterrupted_loss_curve(
    base_run, whole_runs, tmp_path, tiny_target_dir, parallel
):
    """The EAGLE-3.1 drafter under DDP and FSDP2, and a DFlash drafter under DDP (the same training loop)."""
    whole_dir, whole = whole_runs[parallel]
    killed_dir = tmp_path / "killed"
    shutil.copytree(base_run, killed_dir)
    runs = {"whole": whole_dir, "killed": killed_dir}
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = _launch(runs["killed"], tiny_target_dir, stop_after=STEPS_BEFORE_KILL, parallel=parallel)
    assert killed.returncode != 0 and "stopped after 5 steps" in killed.stderr, killed.stderr[-3000:]
    assert len(_log(runs["killed"])) == STEPS_BEFORE_KILL  # step 5 was logged, then the "kill"
    resumed = _launch(runs["killed"], tiny_target_dir, parallel=parallel)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at epoch 1 of 2, step 3 of" in " ".join(
        resumed.stderr.split()
    )  # last checkpoint: step 3
    a, b = _log(runs["whole"]), _log(runs["killed"])
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(1, len(a) + 1))
    assert len(a) >= 2 * STEPS_BEFORE_KILL  # the curve goes on well past the kill
    assert [r["loss"] for r in b] == [r["loss"] for r in a]  # the same curve, to the logged digit
    assert [r["lr"] for r in b] == [r["lr"] for r in a]
    assert a[-1]["loss"] < a[0]["loss"]
    report = json.loads((runs["whole"] / "report.json").read_text())["train"]
    attention = "sdpa" if parallel == "dflash" else "reference"
    assert report["processes"] == 2 and report["attention"] == attention and report["precision"] == "fp32"
    # what the drafter was wrapped in, read from the module
    assert report["parallel"] == ("ddp" if parallel == "dflash" else parallel)
    assert report["drafter_variant"] == ("dflash" if parallel == "dflash" else "eagle3.1")
    # clocks differ run to run, and so does the memory the host has available (the plan's capacity and
    # the margin it keeps): the plan's parts and placement are compared on their own
    timing = ("tokens_per_s", "tokens_per_s_wall", "tokens_per_s_steady", "seconds", "memory")
    killed = json.loads((runs["killed"] / "report.json").read_text())["train"]
    assert report == killed | {k: report.get(k) for k in timing}
    for key in ("rows", "cache", "val", "peak", "fixed"):
        assert report["memory"][key] == killed["memory"][key], key
    assert (report["memory"]["cache"], report["memory"]["val"]) == ("device", "device")
    assert any(f.name.startswith("events.out.tfevents") for f in (runs["whole"] / "tensorboard").iterdir())
    assert RunDir(runs["whole"]).path.joinpath("checkpoints/best.safetensors").exists()
    if parallel == "dflash":  # the resumed run ends with the uninterrupted run's drafter, bit for bit
        from safetensors.torch import load_file

        wa, wb = (load_file(str(runs[r] / "checkpoints/last.safetensors")) for r in ("whole", "killed"))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_checkpoints_of_the_earlier_dflash_trainer_are_set_aside_not_overwritten(
    base_run, tmp_path, tiny_target_dir
):
    """A run folder trained by the earlier DFlash trainer (checkpoints/ with dflash_state.pt, no
    train_state.pt) cannot be resumed exactly: its checkpoints are moved to checkpoints.prev-1 (named in
    the output) and the run trains from the start, never writing over them."""
    import io

    from rich.console import Console

    from eagle3kit.core.config import load_config
    from eagle3kit.train import loop_resume
    from eagle3kit.train.stage import run_train

    d = tmp_path / "run"
    shutil.copytree(base_run, d)
    (d / "checkpoints").mkdir()
    old = {n: f"old {n}".encode() for n in ("last.safetensors", "best.safetensors", "dflash_state.pt")}
    for n, b in old.items():
        (d / "checkpoints" / n).write_bytes(b)
    cfg = _cfg_file(d, tiny_target_dir, "float64", "epochs: 1, tokens_per_step: 64", DFLASH)
    buf = io.StringIO()
    saved = loop_resume.console
    loop_resume.console = Console(file=buf, width=300)
    try:
        rep = run_train(load_config(cfg), RunDir(d))
    finally:
        loop_resume.console = saved
    assert (
        "written by the earlier DFlash trainer" in buf.getvalue() and "checkpoints.prev-1" in buf.getvalue()
    )
    assert {n: (d / "checkpoints.prev-1" / n).read_bytes() for n in old} == old
    assert rep["drafter_variant"] == "dflash" and (d / "checkpoints" / "train_state.pt").exists()


@pytest.mark.parametrize("parallel", ["dflash", "ddp"])
def test_one_process_accumulating_two_micro_batches_trains_what_two_processes_train(
    base_run, whole_runs, tmp_path, tiny_target_dir, parallel
):
    """The two-process run (DDP, one micro-batch of 64 tokens each a step; a DFlash drafter, and the
    EAGLE-3.1 drafter) against one process with ``accumulate: 2`` at the same seed: the same steps,
    the same loss every step and the same trained drafter within 1e-4 (the step's loss is the
    weighted mean over both micro-batches; each sample's DFlash anchors are drawn from its own seed,
    not from which process holds it)."""
    from safetensors.torch import load_file

    two_dir, two = whole_runs[parallel]
    assert two.returncode == 0, two.stderr[-3000:]
    one_dir = tmp_path / "one"
    shutil.copytree(base_run, one_dir)
    cfg = _cfg_file(
        one_dir,
        tiny_target_dir,
        "float64",
        "epochs: 2, tokens_per_step: 64, checkpoint_every: 3, accumulate: 2",
        DFLASH if parallel == "dflash" else "",
    )
    one = _train(cfg, 1)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = _log(two_dir), _log(one_dir)
    assert len(a) >= 2 * STEPS_BEFORE_KILL and [r["step"] for r in b] == [r["step"] for r in a]
    assert [r["tokens"] for r in b] == [r["tokens"] for r in a]  # the same samples each step
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-4, abs=1e-6)
    assert [r["n"] for r in b] == [r["n"] for r in a]  # the log's counts are the step's, not rank 0's
    for x, y in zip(b, a):
        assert x["acc"] == pytest.approx(y["acc"], abs=2e-4)
    assert json.loads((one_dir / "report.json").read_text())["train"]["processes"] == 1
    wa, wb = (load_file(str(d / "checkpoints" / "last.safetensors")) for d in (two_dir, one_dir))
    assert wa.keys() == wb.keys()
    for k, v in wa.items():
        torch.testing.assert_close(wb[k], v, rtol=1e-4, atol=1e-4, msg=k)


def test_the_sharded_and_the_replicated_drafter_train_alike(whole_runs):
    """FSDP2 and DDP on the same data and seed: the same loss curve (to 1e-4 relative), every step, and
    the same trained drafter — each run really in its mode (its report reads the mode off the module)."""
    from safetensors.torch import load_file

    curves, best = {}, {}
    for parallel in ("ddp", "fsdp"):
        d, done = whole_runs[parallel]
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads((d / "report.json").read_text())["train"]["parallel"] == parallel
        curves[parallel] = [r["loss"] for r in _log(d)]
        best[parallel] = load_file(str(d / "checkpoints" / "best.safetensors"))
    assert len(curves["ddp"]) >= 2 * STEPS_BEFORE_KILL
    assert curves["fsdp"] == pytest.approx(curves["ddp"], rel=1e-4)
    assert best["fsdp"].keys() == best["ddp"].keys()
    for k, v in best["ddp"].items():
        torch.testing.assert_close(best["fsdp"][k], v, rtol=1e-4, atol=1e-6, msg=k)


def test_one_process_resume_survives_setting_changes_and_refuses_mismatched_files(
    base_run, tmp_path, tiny_target_dir, monkeypatch
):
    """Changing a setting that does not change what is trained keeps the progress; weights and
    state from different steps (a kill between the two writes) are set aside, naming why; the log
    never holds a step twice; a finished run's report is kept as it was."""
    from safetensors.torch import load_file, save_file

    from eagle3kit.core.config import load_config
    from eagle3kit.core.ui import console
    from eagle3kit.train.stage import run_train

    d = tmp_path / "one"
    shutil.copytree(base_run, d)
    cfg = load_config(_write_cfg(d, tiny_target_dir))
    monkeypatch.setenv("EAGLE3KIT_STOP_AFTER_STEPS", "5")
    with pytest.raises(SystemExit):
        run_train(cfg, RunDir(d))  # checkpoint at step 3, "killed" after step 5
    cfg.train.loss_chunk, cfg.train.tensorboard = 7, False  # logistics changed: progress kept
    with pytest.raises(SystemExit):
        run_train(cfg, RunDir(d))  # resumes at 3, stops after 8
    assert not (d / "checkpoints.prev-1").exists()
    assert [r["step"] for r in _log(d)] == list(range(1, 9))
    last = d / "checkpoints/last.safetensors"
    save_file(
        load_file(str(last)), str(last), metadata={"step": "1"}
    )  # weights from another step than the state
    monkeypatch.delenv("EAGLE3KIT_STOP_AFTER_STEPS")
    with console.capture() as cap:
        res = run_train(cfg, RunDir(d))
    assert "from another step than train_state.pt" in " ".join(cap.get().split())
    assert (d / "checkpoints.prev-1" / "train_log.jsonl").exists()
    assert [r["step"] for r in _log(d)] == list(range(1, len(_log(d)) + 1)) and len(_log(d)) > 8
    again = run_train(cfg, RunDir(d))  # all done: the report is kept as it was
    assert again["last_step"] == res["last_step"] and again["tokens_per_s"] == res["tokens_per_s"]


def test_patience_stops_when_validation_tau_stops_rising_and_a_rerun_stays_stopped(
    base_run, tmp_path, tiny_target_dir
):
    """train.patience 1 with a learning rate too small to move validation τ: epoch 1 is the best, epoch 2
    does not beat it, so training stops after 2 of 6 epochs, says so, and the report records it; a rerun
    trains nothing more, and one without patience resumes at epoch 3 (patience is not hashed into the
    run's inputs, so runs made before it existed resume too); without patience all 6 run."""
    from eagle3kit.core.config import load_config
    from eagle3kit.core.ui import console
    from eagle3kit.train.stage import run_train

    runs = {}
    for name, extra in (("patient", "patience: 1, "), ("all", "")):
        d = tmp_path / name
        shutil.copytree(base_run, d)
        train = f"{extra}epochs: 6, tokens_per_step: 256, tensorboard: false"
        cfg = load_config(_cfg_file(d, tiny_target_dir, "float64", train))
        cfg.train.lr = 1.0e-12
        with console.capture() as cap:
            runs[name] = run_train(cfg, RunDir(d))
        said = " ".join(cap.get().split())
        if name == "patient":
            assert (
                "has not beaten epoch 1's for 1 epochs: stopping after epoch 2 of 6 (train.patience)" in said
            )
            with console.capture() as cap:
                again = run_train(cfg, RunDir(d))
            assert "already stopped at epoch 2 (train.patience)" in " ".join(cap.get().split())
            assert [h["epoch"] for h in again["history"]] == [1, 2]
            cfg.train.patience = (
                None  # when to stop is not what an epoch trains: the run goes on from epoch 3
            )
            with console.capture() as cap:
                on = run_train(cfg, RunDir(d))
            assert "starting fresh" not in cap.get() and [h["epoch"] for h in on["history"]] == [
                1,
                2,
                3,
                4,
                5,
                6,
            ]
            cfg.train.patience = 1
    patient, whole = runs["patient"], runs["all"]
    assert [h["epoch"] for h in patient["history"]] == [1, 2] and patient["best_epoch"] == 1
    assert patient["stopped_early"] is True and patient["epochs_run"] == 2 and patient["epochs"] == 6
    assert whole["stopped_early"] is False and whole["epochs_run"] == 6


def test_patience_without_validation_samples_is_refused_by_name():
    from pydantic import ValidationError

    from eagle3kit.core.config import Config

    with pytest.raises(
        ValidationError, match=r"train.patience 2 stops on validation τ, and train.val_fraction is 0"
    ):
        Config.model_validate({"train": {"patience": 2, "val_fraction": 0}})


def _mixed_cfg(run_dir, target_dir, shuffle: str = "samples"):
    cfg = _cfg_file(
        run_dir,
        target_dir,
        "float32",
        f"epochs: 3, tokens_per_step: 46, checkpoint_every: 4, shuffle: {shuffle}, tensorboard: false",
    )
    from eagle3kit.core.config import load_config

    return load_config(cfg)


def test_mixed_batches_resume_to_the_uninterrupted_steps_when_epochs_differ_in_length(
    base_run, tmp_path, tiny_target_dir, monkeypatch
):
    """train.shuffle: samples makes each epoch's batches anew, so epochs can differ in their number
    of steps: every epoch trains all of its own batches (not the first epoch's count), and a run
    killed in a later epoch resumes to exactly the uninterrupted run's steps and losses (its step
    numbers once ran one ahead, a killed run's record kept twice). Switching to ``shuffle: batches``
    and back, the middle attempt killed before its first checkpoint, puts the first run back with
    its own log (the middle attempt's log once stayed in its place)."""
    from eagle3kit.train.stage import run_train

    whole = tmp_path / "whole"
    shutil.copytree(base_run, whole)
    run_train(_mixed_cfg(whole, tiny_target_dir), RunDir(whole))
    a = _log(whole)
    per_epoch = [sum(r["epoch"] == e for r in a) for e in range(1, 4)]
    assert len(set(per_epoch)) > 1, per_epoch  # the case: epochs of different lengths
    assert [r["step"] for r in a] == list(range(1, len(a) + 1))
    cut_at = sum(per_epoch[:1]) + 6  # inside epoch 2, past a checkpoint made in it
    d = tmp_path / "cut"
    shutil.copytree(base_run, d)
    monkeypatch.setenv("EAGLE3KIT_STOP_AFTER_STEPS", str(cut_at))
    with pytest.raises(SystemExit):
        run_train(_mixed_cfg(d, tiny_target_dir), RunDir(d))
    monkeypatch.setenv("EAGLE3KIT_STOP_AFTER_STEPS", "2")  # another training, killed before a checkpoint
    with pytest.raises(SystemExit):
        run_train(_mixed_cfg(d, tiny_target_dir, "batches"), RunDir(d))
    monkeypatch.delenv("EAGLE3KIT_STOP_AFTER_STEPS")
    run_train(_mixed_cfg(d, tiny_target_dir), RunDir(d))  # the first put back, resumed in epoch 2
    b = _log(d)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    assert [r["epoch"] for r in b] == [r["epoch"] for r in a]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-9)
    assert len(_log(next(tmp_path.glob("cut/checkpoints.prev-*")))) == 2  # the middle attempt's log, aside


def test_a_run_trained_with_the_earlier_optimizer_is_set_aside_naming_how_to_resume_it(
    base_run, tmp_path, tiny_target_dir, monkeypatch
):
    """A run killed under the defaults of before 2026-12-04 (betas (0.9, 0.95), fixed batches) and
    rerun with today's is another training: its checkpoints are set aside, and the message says
    which settings resume them."""
    from eagle3kit.core.ui import console
    from eagle3kit.train.stage import run_train

    d = tmp_path / "earlier"
    shutil.copytree(base_run, d)
    cfg = _mixed_cfg(d, tiny_target_dir, "batches")
    cfg.train.betas = (0.9, 0.95)
    monkeypatch.setenv("EAGLE3KIT_STOP_AFTER_STEPS", "4")
    with pytest.raises(SystemExit):
        run_train(cfg, RunDir(d))
    with console.capture() as cap, pytest.raises(SystemExit):
        run_train(_mixed_cfg(d, tiny_target_dir), RunDir(d))
    said = " ".join(cap.get().split())
    assert "changed: train.betas, train.shuffle" in said
    assert "write train: {betas: [0.9, 0.95], shuffle: batches} to resume them" in said


def test_a_stale_run_names_what_changed_and_how_to_resume_one_made_before_a_default_changed():
    """The set-aside message names each train field that differs; a run made before issue 24's
    default drafter (no ``drafter`` in its settings) is told to write ``drafter: {variant: eagle3}``
    only when this config names no drafter; same inputs with unmatched files name the kill."""
    from types import SimpleNamespace

    from eagle3kit.core.config import Config
    from eagle3kit.core.rundir import sha256_json
    from eagle3kit.train.samples import trained_settings
    from eagle3kit.train.stage import _Training

    def stale(cfg, old_tc, same=False):
        tc = trained_settings(cfg)
        me = SimpleNamespace(cfg=cfg, tc_fields=tc, inputs={"tokens": "a", "train_config": sha256_json(tc)})
        old = {"tokens": "a", "train_config": sha256_json(tc if same else old_tc)}
        return _Training._stale_inputs(me, {"inputs": old, "train_config": json.dumps(old_tc)})

    now = trained_settings(Config())
    before_24 = {k: v for k, v in now.items() if k != "drafter"}
    changed, hint = stale(Config(), before_24)
    assert changed == ["train.drafter"] and "write drafter: {variant: eagle3} to resume them" in hint
    named = Config.model_validate({"drafter": {"variant": "eagle3.1"}})
    changed, hint = stale(named, before_24)
    assert changed == ["train.drafter"] and hint == ""  # the user chose the drafter: no advice
    changed, hint = stale(Config(), {**now, "lr": now["lr"] * 2})
    assert changed == ["train.lr"] and hint == ""
    changed, hint = stale(Config(), now, same=True)
    assert changed == [
        "last.safetensors is missing or from another step than train_state.pt (a kill during a save)"
    ]


def test_a_world_size_without_torchrun_is_refused_by_name(monkeypatch):
    from eagle3kit.core.config import ConfigError
    from eagle3kit.train.distributed import init_world

    monkeypatch.setenv("WORLD_SIZE", "2")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(
        ConfigError, match="WORLD_SIZE is 2 but RANK, MASTER_ADDR, MASTER_PORT unset: launch with torchrun"
    ):
        init_world(torch.device("cpu"))


def test_packed_rows_train_alike_on_two_processes_and_on_one_accumulating_two(
    base_run, tmp_path, tiny_target_dir
):
    """``train.pack_length``: samples packed into rows of 64 tokens, micro-batches of rows; two DDP
    processes and one process with ``accumulate: 2`` take the same steps with the same loss (1e-4)."""
    runs = {}
    for name, nproc, acc in (("two", 2, 1), ("one", 1, 2)):
        d = tmp_path / name
        shutil.copytree(base_run, d)
        cfg = _cfg_file(
            d,
            tiny_target_dir,
            "float64",
            f"epochs: 1, tokens_per_step: 64, pack_length: 64, accumulate: {acc}",
        )
        done = _train(cfg, nproc)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = _log(d)
    assert len(runs["one"]) >= 3 and [r["tokens"] for r in runs["one"]] == [r["tokens"] for r in runs["two"]]
    assert [r["loss"] for r in runs["one"]] == pytest.approx([r["loss"] for r in runs["two"]], rel=1e-4)
