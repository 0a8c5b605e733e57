"""Stage ``train``: EAGLE-3 with training-time test (docs/conventions.md, alignment).

Data: ``tokens.safetensors`` + ``vocab.safetensors`` + the target (its states computed here), stored
features (``train.features``) or capture servers (``train.online_from``, online training). Where
``train.feature_cache`` and the memory plan put them (:mod:`eagle3kit.train.memory`: the device, pinned
host memory), the target runs once over every sample and its aux states, post-norm last hidden state
and full-vocabulary argmax are kept for all epochs (not full-vocabulary logits: 197 KB a token for a 49K
vocabulary); where they fit nowhere, the target runs inside every step.

Per TTT step k (0-based), position t is supervised when its input token x_{t+k+1} is a
completion token and the target's argmax at t+k+1 lies in the draft vocabulary; the label is the
target's softmax at t+k+1 restricted to the draft vocabulary (fp32). Loss = Σ_k w^k · CE_k, each
CE_k normalised by its own number of supervised positions (a step with none contributes 0, never
NaN). Logged per step: loss, per-step top-1 agreement, and the acceptance length it implies,
1 + Σ_k Π_{j≤k} acc_j.

Every epoch: simulated τ on the held-out validation split (greedy chain, K = ``evaluate.k``);
the best epoch is kept as ``checkpoints/best.safetensors``. Resume: ``checkpoints/last.*`` holds
model, optimizer, scheduler, epoch and RNG state; a rerun continues after the last finished epoch.
"""

from __future__ import annotations

import json
import os
import time

import torch

from eagle3kit.core.config import Config, dump_config
from eagle3kit.core.kinds import DrafterKind, kind_for_config
from eagle3kit.core.rundir import (
    DataError,
    RunDir,
    require_free,
)
from eagle3kit.core.ui import Timer, console, progress
from eagle3kit.model.target import (
    Target,
)
from eagle3kit.train.checkpoints import (
    init_from_drafter,
)
from eagle3kit.train.distributed import Launch
from eagle3kit.train.log import TrainLog
from eagle3kit.train.loop_inputs import _Inputs
from eagle3kit.train.loop_report import _Report
from eagle3kit.train.loop_resume import _Resume, _truncate_log
from eagle3kit.train.online import sample_key
from eagle3kit.train.optimizer_step import optimizer_step, rank_micros
from eagle3kit.train.samples import compute_features, warmup_cosine
from eagle3kit.train.ttt import implied_tau

# optimizer steps of a run left out of its steady tokens/s (flex attention's compilation, the
# allocator's and autotuner's warm-up)
WARM_STEPS = 3


def run_train(cfg: Config, run: RunDir, target: Target | None = None) -> dict:
    """Train the drafter; writes ``checkpoints/``, ``train_log.jsonl`` and ``tensorboard/``; returns
    the report section.

    Under ``torchrun`` (see :mod:`eagle3kit.train.distributed`) every process trains on its own share of
    the training samples with the drafter in DistributedDataParallel; rank 0 validates, writes
    checkpoints, the log and the report. Resume: ``checkpoints/last.safetensors`` +
    ``train_state.pt`` (optimizer, scheduler, data position within the epoch, RNG state) written
    at the end of every epoch and every ``train.checkpoint_every`` steps; a rerun with the same
    inputs continues from there and logs the same loss curve an uninterrupted run would.

    Raises:
        ConfigError: missing stage outputs, a vocabulary or tokenizer made for another target, no
        supervised tokens, torchrun ranks given other configs. DataError: another ``eagle3kit train``
        holds this run directory (rank 0 holds ``.train.lock`` while it trains, so two trainings never
        write the same checkpoints).
    """
    kind = kind_for_config(cfg)
    Launch.from_env().agree("config-train", dump_config(cfg))  # torchrun: every rank trains the same config
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: the other ranks write nothing of their own
        return _run_train(cfg, run, target, kind)
    with run.lock("train"):
        return _run_train(cfg, run, target, kind)


def _run_train(cfg: Config, run: RunDir, target: Target | None, kind: DrafterKind) -> dict:
    """The stage as named steps (:class:`_Training` holds what they share), for any drafter ``kind``."""
    t = _Training(cfg, run, target, kind)  # resolve inputs: files, vocab, target, samples, features, split
    t.build()  # the drafter, init_from, optimizer and schedule
    t.restore()  # resume from checkpoints/last.*, or set foreign ones aside
    if t.start_epoch >= t.tc.epochs or t.stopped_early():
        if t.world.main:
            console.print(
                "[green]train: all epochs already done"
                if t.start_epoch >= t.tc.epochs
                else f"[green]train: already stopped at epoch {t.start_epoch} (train.patience)"
            )
        done = run.report.get("train")
        if done and not t.swapped:  # checkpoints put back: the report is theirs, written again
            return done
    t.prepare()  # pending mark, the feature cache, the log
    for epoch in range(t.start_epoch, t.tc.epochs):
        if t.stopped_early():  # a resume of a run that had stopped stays stopped
            break
        sums = t.train_epoch(epoch)
        t.validate(epoch, sums)  # val τ, the best checkpoint, last.* for resume
    return t.write()  # report.json and the manifest


class _Training(_Inputs, _Resume, _Report):
    """One ``train`` run's state, shared by the steps of :func:`_run_train`; what
    differs between drafter kinds (the drafter, its step, its validation, its checkpoint) is asked of
    ``kind`` (:class:`~eagle3kit.core.kinds.DrafterKind`).

    Attributes set by ``__init__`` (resolved inputs): ``world``, ``device``, ``speed``, ``target``,
    ``vocab``, ``aux_ids``, ``samples`` (every sample with a supervised token), ``train`` (every
    training sample, on every process), ``steps`` (per epoch, every optimizer step's micro-batches),
    ``mine`` (the training samples this process runs in some step), ``val`` (validation on rank 0,
    or on every rank under FSDP), ``features`` (the
    extracted-features index or None), ``inputs`` (hashed into ``train_state.pt``: a resume needs
    the same), ``provenance`` (stored in every checkpoint). By :meth:`build`: ``drafter``,
    ``model`` (wrapped for DDP/FSDP), ``opt``, ``sched``. By :meth:`restore`: ``start_epoch``,
    ``start_batch``, ``history``, ``best``, ``acc_state``.
    """

    def build(self) -> None:
        """The drafter (seeded; from ``train.init_from`` when set), wrapped for the world, AdamW and
        the warmup + cosine schedule over every process's common number of steps."""
        tc, world, device = self.tc, self.world, self.device
        drafter = self.kind.build(self.cfg, self.target, self.vocab, self.aux_ids, self.samples)
        # last.safetensors (weights + AdamW's two moments), best, and one of them being written
        if world.main:
            require_free(
                self.ckpt, 8 * sum(p.numel() * 4 for p in drafter.parameters()), "train's checkpoints"
            )
        self.init = init = init_from_drafter(drafter, tc.init_from, self.cfg.target) if tc.init_from else None
        if init:
            self.inputs["init_from"] = self.provenance["init_from"] = init["init_from_sha256"]
            fresh = init["lm_head_rows"] - init["lm_head_rows_copied"]
            if world.main:
                console.print(
                    f"train: starting from {tc.init_from} ({init['lm_head_rows_copied']} of "
                    f"{init['lm_head_rows']} lm_head rows shared by target id"
                    + (f"; {fresh} start fresh)" if fresh else ")")
                )
        self.drafter = drafter = drafter.to(device)
        if self.speed["compile"]:
            drafter.compile_layer()
        self.model = world.wrap(drafter, tc.parallel)
        if (world.size > 1 or tc.accumulate > 1) and world.main:
            how = (
                f"{tc.parallel.upper()} on {device.type}"
                if world.size > 1
                else f"one process on {device.type}"
            )
            console.print(
                f"train: world size {world.size} ({how}), {tc.accumulate} micro-batch(es) of ≤ "
                f"{tc.tokens_per_step} tokens each a step, from {len(self.train)} samples"
            )
        self.draft_ids = self.vocab.ids.to(device)
        self.opt = torch.optim.AdamW(
            drafter.parameters(),
            lr=tc.lr,
            betas=tuple(tc.betas),
            weight_decay=tc.weight_decay,
            fused=device.type == "cuda",
        )
        # each epoch's optimizer steps (every process forms the same ones: self.steps); with
        # train.shuffle: samples it can differ by a few between epochs
        self.epoch_steps = [len(steps) for steps in self.steps]
        lr_at = warmup_cosine(sum(self.epoch_steps), tc.warmup_ratio)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_at)

    def steps_before(self, epoch: int, batch: int) -> int:
        """Optimizer steps taken before ``batch`` of ``epoch`` (0-based)."""
        return sum(self.epoch_steps[:epoch]) + batch

    def prepare(self) -> None:
        """Mark best.safetensors pending, fill the feature cache, open the log (TensorBoard, W&B)."""
        tc, world = self.tc, self.world
        if world.main:  # until it is recorded at the end, best.safetensors is unfinished to every later stage
            self.run.mark_pending(
                "checkpoints/best.safetensors",
                "train",
                self.consumed,
                self.target.source.get("weights_fingerprint"),
            )
        # optimizer steps already taken
        self.step = self.steps_before(self.start_epoch, self.start_batch)
        if self.step == 0 and world.main:
            # steps a run killed before its first checkpoint logged: they are redone
            _truncate_log(self.log_path, 0)
        self.timer = Timer()
        self.seconds = {"features": 0.0, "validation": 0.0}  # where the stage's clock went, besides the steps
        self.steady = [0, 0.0]  # tokens and seconds of this run's optimizer steps after its first WARM_STEPS
        self.cached = self.memory.cache != "off" and self.feeder is None
        if self.feeder is not None:
            self.consumed_path = self.run.path / "online-consumed" / f"rank-{world.rank}.jsonl"
            self.consumed_path.parent.mkdir(exist_ok=True)
            _truncate_log(self.consumed_path, self.step)  # steps after the last checkpoint are redone
        if self.feeder is not None:  # every feature from the servers (no process runs the target)
            if self.start_epoch < tc.epochs and self.val:
                # not pruned: the files a killed run fetched for this epoch's rest stay for its schedule below
                self.feeder.schedule([(sample_key(s.ids), s.ids) for s in self.val], prune=False)
                self._fetch(self.val, self._store(self.memory.val))  # kept for every epoch's validation
        elif self.start_epoch < tc.epochs and self.features is None:
            t_features = time.perf_counter()
            for group, place, label in (
                (self.mine, self.memory.cache, "target features"),
                (self.val, self.memory.val, "validation states"),
            ):
                if group and place != "off":
                    compute_features(
                        self.target,
                        group,
                        self.aux_ids,
                        tc.tokens_per_step,
                        self.device,
                        self._store(place),
                        label=label,
                        lse=tc.loss != "kl",
                    )
            self.seconds["features"] += time.perf_counter() - t_features
        self.logger = TrainLog(
            self.run, tc, world.main, dict(self.speed, world_size=world.size), purge_step=self.step
        )
        # tests: emulate a kill after N steps
        self.stop_after = int(os.environ.get("EAGLE3KIT_STOP_AFTER_STEPS", "0"))
        self.trained_tokens, self.steps_run = 0, 0
        self.last_stats: dict = {}

    def train_epoch(self, epoch: int) -> list:
        """One epoch's optimizer steps (from the resumed batch); returns this process's running sums
        ``[loss·n, acc0·n, n, tokens]``."""
        tc, world, train = self.tc, self.world, self.train
        self.drafter.train()
        batches = self.steps[epoch]
        first = self.start_batch if epoch == self.start_epoch else 0
        sums = self.acc_state if (epoch == self.start_epoch and self.acc_state) else [0.0, 0.0, 0, 0]
        if self.feeder is not None:  # the servers fetch ahead, in the order the steps read
            self.feeder.schedule(
                [(sample_key(train[i].ids), train[i].ids) for g in batches[first:] for i in self._indices(g)]
            )
        with progress(disable=not world.main) as bar:
            task = bar.add_task(
                f"train epoch {epoch + 1}/{tc.epochs}", total=len(batches), completed=first, tokens=0, note=""
            )
            for j in range(first, len(batches)):
                loss, st = self._step(epoch, batches[j])
                if st["n"][0]:  # a batch with no supervised token adds nothing (no fake 0 in the mean)
                    sums = [
                        sums[0] + float(loss.detach()) * st["n"][0],
                        sums[1] + st["acc"][0] * st["n"][0],
                        sums[2] + st["n"][0],
                        sums[3],
                    ]
                sums[3] += st["tokens"]
                bar.update(
                    task,
                    advance=1,
                    tokens=sums[3],
                    note=f"batch: loss {float(loss.detach()):.2f} acc0 {st['acc'][0]:.2f}",
                )
                if tc.checkpoint_every and self.step % tc.checkpoint_every == 0 and j + 1 < len(batches):
                    self.logger.flush()
                    self.save(epoch, j + 1, sums)
                if self.stop_after and self.steps_run >= self.stop_after:
                    self.logger.close()
                    raise SystemExit(
                        f"train: stopped after {self.steps_run} steps (EAGLE3KIT_STOP_AFTER_STEPS)"
                    )
        return sums

    def _step(self, epoch: int, group: list) -> tuple:
        """One optimizer step over ``group`` (the step's micro-batches of every process): features when
        not cached, :func:`~eagle3kit.train.optimizer_step.optimizer_step`, the schedule, the log record."""
        tc, train = self.tc, self.train
        t_step = time.perf_counter()
        idx = self._indices(group)
        keys = None
        if self.feeder is not None:
            keys = self._fetch([train[i] for i in idx])
        elif not self.cached:
            compute_features(
                self.target,
                [train[i] for i in idx],
                self.aux_ids,
                tc.tokens_per_step,
                self.device,
                self.device,
                lse=tc.loss != "kl",
            )
        seed = (tc.seed * 1_000_003 + self.step) % (2**63 - 1)  # the same on every process and resume
        micros, idle = rank_micros(group, self.world.rank, tc.accumulate)
        loss, st = optimizer_step(
            self.kind,
            self.model,
            self.opt,
            self.target,
            train,
            micros,
            idle,
            self.speed,
            self.cfg,
            self.world,
            self.draft_ids,
            seed,
        )
        self.sched.step()
        self.step += 1
        self.steps_run += 1
        if not torch.isfinite(loss.detach()):
            raise DataError(
                f"train: the loss is {float(loss.detach())} at step {self.step} (epoch {epoch + 1}); nothing "
                "after the last checkpoint is kept. Lower train.lr, or check the features "
                "(`eagle3kit extract` refuses non-finite ones) and target.dtype"
            )
        self.trained_tokens += st["tokens"]
        if not self.cached:
            for i in idx:
                train[i].aux = train[i].last = train[i].argmax = None
        rec = {
            "step": self.step,
            "epoch": epoch + 1,
            "loss": round(float(loss.detach()), 5),
            "lr": self.sched.get_last_lr()[0],
            "acc": [round(a, 4) for a in st["acc"]],
            "n": st["n"],
            "implied_tau": round(implied_tau(st["acc"]), 4),
            "tokens": st["tokens"],
        }
        if self.feeder is not None:  # which samples, by their token ids' hash (resume and kill checks)
            rec["samples"] = keys
            rec["online_wait_s"] = round(self.feeder.wait_s, 3)
            # every process's own samples (rank 0's log holds only its own): the union is the epoch
            with open(self.consumed_path, "a") as fh:
                fh.write(
                    json.dumps({"step": self.step, "epoch": epoch + 1, "samples": rec["samples"]}) + "\n"
                )
        if "alpha" in st:  # the LK objectives: mean expected acceptance α per TTT step
            rec["alpha"] = [round(a, 4) for a in st["alpha"]]
        rec.update(st.get("log", {}))
        if self.steps_run > WARM_STEPS:  # the log record's float() has waited for the step's kernels
            self.steady[0] += st["tokens"]
            self.steady[1] += time.perf_counter() - t_step
        self.logger.step(rec, self.trained_tokens / max(self.timer.seconds, 1e-9))
        self.last_stats = rec
        return loss, st
