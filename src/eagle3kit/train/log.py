"""Where ``train`` logs: ``<run>/train_log.jsonl`` (one record a step, the source of truth),
TensorBoard (``<run>/tensorboard``) and, when asked, Weights & Biases. Only the main process logs."""

from __future__ import annotations

import json


class TrainLog:
    """Per-step and per-epoch records to every sink the run's config turns on.

    Args:
        run: the run directory; tc: the ``train`` config section; main: whether this process logs;
        settings: extra facts written once (attention path, precision, processes);
        purge_step: the step a resumed run continues after (later TensorBoard events are dropped).
    """

    def __init__(self, run, tc, main: bool, settings: dict, purge_step: int | None = None):
        self.main = main
        self.file = self.tb = self.wandb = None
        if not main:
            return
        self.file = open(run / "train_log.jsonl", "a")
        if tc.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run drops the events a killed run logged after its last checkpoint
            self.tb = SummaryWriter(str(run / "tensorboard"), purge_step=purge_step or None)
            self.tb.add_text("settings", json.dumps(settings))
        if tc.wandb_project:  # installed: run_train checks before any work
            import wandb

            self.wandb = wandb.init(
                project=tc.wandb_project, dir=str(run), config={**tc.model_dump(mode="json"), **settings}
            )

    def step(self, rec: dict, tokens_per_s: float) -> None:
        """One optimizer step's record (``step``, ``loss``, ``lr``, ``acc`` per TTT step, ``implied_tau``,
        ``alpha`` per TTT step under the LK objectives …)."""
        if not self.main:
            return
        self.file.write(json.dumps(rec) + "\n")
        scalars = {
            "train/loss": rec["loss"],
            "train/lr": rec["lr"],
            "train/implied_tau": rec["implied_tau"],
            "train/tokens_per_s": tokens_per_s,
            **{f"train/acc_step{k}": a for k, a in enumerate(rec["acc"])},
            **{f"train/alpha_step{k}": a for k, a in enumerate(rec.get("alpha", []))},
        }
        if self.tb:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, rec["step"])
        if self.wandb:
            self.wandb.log(scalars, step=rec["step"])

    def epoch(self, rec: dict, step: int) -> None:
        """One epoch's summary (``train_loss``, ``train_step0_accuracy``, ``val_tau``)."""
        if not self.main:
            return
        scalars = {f"epoch/{k}": v for k, v in rec.items() if k != "epoch" and v is not None}
        if self.tb:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(scalars, step=step)
        self.flush()

    def flush(self) -> None:
        if self.file:
            self.file.flush()
        if self.tb:
            self.tb.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
        if self.tb:
            self.tb.close()
            self.tb = None
        if self.wandb:
            self.wandb.finish()
            self.wandb = None
