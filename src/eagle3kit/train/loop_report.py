"""The end of each epoch and of the stage in the training loop: the epoch's record and validation τ,
the best checkpoint, and the report section with the lineage of ``best.safetensors``
(:class:`_Report`, a base of :class:`eagle3kit.train.stage._Training`, whose attributes it reads)."""

from __future__ import annotations

import json
import time

import torch

from eagle3kit.core.metrics import AcceptanceStats
from eagle3kit.core.rundir import DataError, sha256_tensors
from eagle3kit.core.ui import console
from eagle3kit.train.distributed import full_state, parallel_mode
from eagle3kit.train.samples import compute_features


class _Report:
    """Validation, the best checkpoint and the stage's report, for :class:`~eagle3kit.train.stage._Training`."""

    def validate(self, epoch: int, sums: list) -> None:
        """The epoch's record (train loss, step-0 accuracy, validation τ), the best checkpoint by
        rank 0's score, and ``last.*`` for resume."""
        world, cfg = self.world, self.cfg
        ep_loss, ep_acc0, ep_n, _ = world.sum_floats(sums)
        if ep_n == 0:
            if self.kind.whole_vocab:
                raise DataError(
                    f"train: epoch {epoch + 1} supervised no block slot: no anchor had a completion token after it; "
                    "check the tokenize stage's report (replies of at least two tokens)"
                )
            raise DataError(
                f"train: epoch {epoch + 1} supervised no position: the target's top-1 is never in the draft "
                f"vocabulary ({self.vocab_path}) at a completion token. The vocabulary or the tokens were "
                "built from another target's outputs; rerun `eagle3kit generate`, `tokenize` and `vocab` for "
                "this target (a new run_dir)"
            )
        t_val = time.perf_counter()
        val_stats = self._simulate_val() if self.val else None
        self.seconds["validation"] += time.perf_counter() - t_val
        acc0 = f"train_{self.kind.first_accuracy}"
        epoch_rec = {
            "epoch": epoch + 1,
            "train_loss": round(ep_loss / max(ep_n, 1), 5),
            acc0: round(ep_acc0 / max(ep_n, 1), 4),
            "val_tau": round(val_stats.tau, 4) if val_stats else None,
        }
        self.history.append(epoch_rec)
        self.logger.epoch(epoch_rec, self.step)
        if world.main:
            console.print(
                f"epoch {epoch + 1}: loss {epoch_rec['train_loss']:.4f}  "
                f"{self.kind.first_accuracy_label} {epoch_rec[acc0]:.3f}"
                + (f"  val τ(K={cfg.evaluate.k}) {val_stats.tau:.3f}" if val_stats else "")
            )
        score = val_stats.tau if val_stats else -epoch_rec["train_loss"]
        score = world.sum_floats([score if world.main else 0.0])[0]  # rank 0's verdict, on every process
        if score > self.best["val_tau"]:
            self.best = {"val_tau": score, "epoch": epoch + 1}
            model_state, _ = full_state(self.drafter)
            if world.main:
                self.kind.save_checkpoint(
                    self.drafter,
                    self.ckpt / "best.safetensors",
                    {"epoch": epoch + 1, "provenance": json.dumps(self.provenance)},
                    model_state,
                )
        self.save(epoch + 1, 0, None)
        if self.stopped_early() and world.main:
            what = (
                "validation τ" if val_stats else "the training loss (no sample was held out for validation)"
            )
            console.print(
                f"train: {what} has not beaten epoch {self.best['epoch']}'s for {self.tc.patience} epochs: "
                f"stopping after epoch {epoch + 1} of {self.tc.epochs} (train.patience)"
            )

    def stopped_early(self) -> bool:
        """True once the best score (validation τ; the negated training loss when no sample was held out) is
        ``train.patience`` or more epochs older than the last epoch run, and epochs were left; False when
        patience is unset. Read
        from the history and best that a resume restores, so a resumed run that had stopped stays stopped."""
        patience = self.tc.patience
        if patience is None or not self.history:
            return False
        last = self.history[-1]["epoch"]
        return last < self.tc.epochs and last - self.best["epoch"] >= patience

    def _simulate_val(self) -> AcceptanceStats:
        """Simulated τ on the validation split; when its states are kept nowhere
        (``memory.val == "off"``), the target computes them again, a few steps' tokens at a time."""
        k = self.cfg.evaluate.k
        if self.memory.val != "off":
            return self.kind.validate(self.drafter, self.target, self.val, k, self.device)
        stats, group, size = AcceptanceStats(k), [], 0
        self.drafter.eval()
        for i, s in enumerate(self.val):
            group.append(s)
            size += s.ids.numel()
            if size < 4 * self.tc.tokens_per_step and i + 1 < len(self.val):
                continue
            compute_features(
                self.target,
                group,
                self.aux_ids,
                self.tc.tokens_per_step,
                self.device,
                self.device,
                label="validation states",
            )
            stats.merge(self.kind.validate(self.drafter, self.target, group, k, self.device))
            for g in group:
                g.aux = g.last = g.argmax = g.lse = None
            group, size = [], 0
        return stats

    def write(self) -> dict:
        """The report section (``report.json`` ``train``), the lineage of best.safetensors and the
        manifest's aux layer ids (rank 0); returns the section."""
        tc, world = self.tc, self.world
        self.logger.close()
        final = self.history[-1] if self.history else {}
        result = {
            "final_loss": final.get("train_loss"),
            self.kind.first_accuracy: final.get(f"train_{self.kind.first_accuracy}"),
            "best_epoch": self.best["epoch"],
            "best_val_tau": round(self.best["val_tau"], 4) if self.n_val else None,
            "epochs": tc.epochs,
            "epochs_run": final.get("epoch", 0),
            "stopped_early": self.stopped_early(),
            **self.kind.report(self.cfg, self.drafter),
            "train_samples": len(self.samples) - self.n_val,
            "val_samples": self.n_val,
            "history": self.history,
            "last_step": self.last_stats,
            "processes": world.size,
            "parallel": parallel_mode(self.model),
            "attention": self.speed["attention"],
            "precision": "bf16" if self.speed["bf16"] else ("tf32" if self.speed["tf32"] else "fp32"),
            "loss_chunk": self.speed["loss_chunk"],
            "compile": self.speed["compile"],
            "memory": self.memory.as_dict(),
            "seconds": {k: round(v, 1) for k, v in self.seconds.items()}
            | {"stage": round(self.timer.seconds, 1)},
        }
        if self.device.type == "cuda":  # what torch's allocator held at most (the plan's peak estimates it)
            result["memory"]["measured_peak"] = torch.cuda.max_memory_allocated(self.device)
        if self.init:
            result.update({k: self.init[k] for k in ("init_from", "lm_head_rows_copied")})
        if self.feeder is not None:
            result["online"] = {
                "servers": list(tc.online_from),
                "target_loaded": self.target.source.get("loaded", "whole"),
                **self.feeder.close(),
            }
        if self.trained_tokens:
            # wall: every token over the stage's clock (features, compilation, validation and
            # checkpoints included); steady: the optimizer steps after the run's first WARM_STEPS
            result["tokens_per_s"] = result["tokens_per_s_wall"] = round(
                self.trained_tokens / self.timer.seconds, 1
            )
            if self.steady[1] > 0:
                result["tokens_per_s_steady"] = round(self.steady[0] / self.steady[1], 1)
        if world.main:
            best_sha = sha256_tensors(self.ckpt / "best.safetensors")
            self.run.record_stage(
                "train",
                self.inputs,
                result,
                {"checkpoints/best.safetensors": best_sha},
                consumed=self.consumed,
                target=self.target.source.get("weights_fingerprint"),
            )
            self.run.update_manifest(
                aux_layer_ids={"convention": "hf_output_hidden_states_index", "ids": list(self.aux_ids)}
            )
        world.barrier()
        return result
