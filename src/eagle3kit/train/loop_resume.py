"""Resume and checkpoints of the training loop: ``last.safetensors`` + ``train_state.pt`` written at
every epoch and every ``train.checkpoint_every`` steps, read back when made from the same inputs, set
aside (or a set-aside one put back) when not (:class:`_Resume`, a base of
:class:`eagle3kit.train.stage._Training`)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from eagle3kit.core.kinds import all_kinds
from eagle3kit.core.rundir import (
    REWRITE,
    DataError,
    load_safetensors,
    open_safetensors,
    sha256_tensors,
)
from eagle3kit.core.ui import console
from eagle3kit.train.checkpoints import (
    _set_aside,
)
from eagle3kit.train.distributed import full_state, load_full_state


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _truncate_log(path: Path, last_step: int) -> None:
    """Drop log records past ``last_step`` (steps a killed run logged after its last checkpoint;
    the resumed run logs them again)."""
    if not path.exists():
        return
    keep = [
        ln
        for ln in path.read_text().splitlines()
        if ln.strip() and json.loads(ln).get("step", 0) <= last_step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    tmp.replace(path)


class _Resume:
    """Resume and checkpoints (see the module docstring); the state is :class:`~eagle3kit.train.stage._Training`'s."""

    def restore(self) -> None:
        """Resume from ``checkpoints/last.safetensors`` + ``train_state.pt`` when they were made from
        the same inputs at the same step; else move ``checkpoints/`` to ``checkpoints.prev-N`` (and
        the same for a ``best.safetensors`` that is not the one train wrote)."""
        world, ckpt, state_path, log_path = self.world, self.ckpt, self.state_path, self.log_path
        # the best score so far: validation τ, or −train loss without validation (any first epoch beats it)
        self.start_epoch, self.start_batch, self.history = 0, 0, []
        self.best = {"val_tau": float("-inf"), "epoch": -1}
        self.acc_state = None
        best_rec = self.run.manifest.get("lineage", {}).get("checkpoints/best.safetensors") or {}
        swapped = self._swap_back() if world.main else None
        # every process learns it (a put-back run that is all done writes its report again)
        self.swapped = world.sum_floats([1.0 if swapped else 0.0])[0] > 0
        if (
            world.main
            and swapped is None
            and state_path.exists()
            and best_rec.get("sha256")
            and (ckpt / "best.safetensors").exists()
            and sha256_tensors(ckpt / "best.safetensors") != best_rec["sha256"]
        ):
            keep = _set_aside(ckpt, log_path)
            console.print(
                f"[yellow]train: checkpoints/best.safetensors is not the one train wrote (replaced or edited); "
                f"moved checkpoints/ to {keep} and starting fresh"
            )
        world.barrier()
        if not state_path.exists():
            # files an earlier trainer of some kind kept instead of train_state.pt, each with why
            stale = {n: why for k in all_kinds() for n, why in k.stale_checkpoint_files.items()}
            stray = [n for n in ("last.safetensors", "best.safetensors", *stale) if (ckpt / n).exists()]
            if (
                stray and world.main
            ):  # checkpoints without their resume state: an earlier trainer's, or a kill
                keep = _set_aside(ckpt, log_path)
                why = next(
                    (stale[n] for n in stray if n in stale), "without train_state.pt (a kill while saving)"
                )
                console.print(
                    f"[yellow]train: checkpoints/ holds {', '.join(stray)} {why}: they cannot be resumed exactly; "
                    f"moved checkpoints/ to {keep} and starting fresh"
                )
            world.barrier()
            return
        try:
            st = torch.load(state_path, weights_only=True)
        except Exception as e:  # truncated or foreign: an interrupted copy, a full disk
            raise DataError(
                f"{state_path} is unreadable ({type(e).__name__}); {REWRITE['last.safetensors']}"
            ) from None
        weights_step = None
        if (ckpt / "last.safetensors").exists():
            with open_safetensors(ckpt / "last.safetensors") as f:
                weights_step = (f.metadata() or {}).get("step")
        if (
            st.get("inputs") == self.inputs
            and weights_step is not None
            and weights_step == str(st.get("step"))
        ):
            self._resume(st)
            return
        world.barrier()
        if world.main:
            keep = _set_aside(ckpt, log_path)
            changed, hint = self._stale_inputs(st)
            console.print(
                f"[yellow]train: checkpoints/ were made from other inputs (changed: {', '.join(changed)}); "
                f"moved them to {keep} and starting fresh{hint}"
            )
        world.barrier()

    def _stale_inputs(self, st: dict) -> tuple[list[str], str]:
        """What differs between this run's inputs and those ``train_state.pt`` (``st``) was made
        from, as ``train.<field>`` names where the train config changed, and a hint on how to
        resume when the difference is one of the defaults that changed (the drafter variant, the optimizer and
        batches), an empty hint when none applies."""
        changed = sorted(
            k
            for k in set(self.inputs) | set(st.get("inputs", {}))
            if self.inputs.get(k) != st.get("inputs", {}).get(k)
        )
        old_tc = json.loads(st.get("train_config") or "{}")
        if "train_config" in changed and old_tc:
            changed.remove("train_config")
            changed += [
                f"train.{k}"
                for k in sorted(set(old_tc) | set(self.tc_fields))
                if old_tc.get(k) != self.tc_fields.get(k)
            ]
        if not changed:
            changed = [
                "last.safetensors is missing or from another step than train_state.pt (a kill during a save)"
            ]
        hint = ""
        if (
            "train.drafter" in changed
            and old_tc.get("drafter") is None
            and "drafter" not in self.cfg.model_fields_set
        ):
            hint = (
                " (they are a plain EAGLE-3 drafter's, and a config without a drafter section trains "
                "EAGLE-3.1: write drafter: {variant: eagle3} to resume them)"
            )
        if (
            old_tc.get("betas") == [0.9, 0.95]
            and old_tc.get("shuffle", "batches") == "batches"
            and {"train.betas", "train.shuffle"} & set(changed)
        ):
            hint += (
                " (they were trained with the optimizer and batches of before 2026-12-04: write train: "
                "{betas: [0.9, 0.95], shuffle: batches} to resume them)"
            )
        return changed, hint

    def _swap_back(self) -> Path | None:
        """When ``checkpoints/`` was made from other inputs (or holds none) and a set-aside
        ``checkpoints.prev-N`` was made from this run's inputs, put that one back (the newest such;
        its log and TensorBoard events too) and set the current one aside; returns the folder put
        back, or None. Main process only."""
        run_dir, ckpt = self.ckpt.parent, self.ckpt

        def inputs_of(folder: Path):
            sp = folder / "train_state.pt"
            if not sp.exists() or not (folder / "last.safetensors").exists():
                return None
            try:
                return torch.load(sp, weights_only=True, mmap=True).get("inputs")
            except Exception:  # unreadable: never swapped in
                return None

        if ckpt.exists() and inputs_of(ckpt) == self.inputs:
            return None
        prevs = [p for p in run_dir.glob(f"{ckpt.name}.prev-*") if p.name.rsplit("-", 1)[1].isdigit()]
        for prev in sorted(prevs, key=lambda p: int(p.name.rsplit("-", 1)[1]), reverse=True):
            if inputs_of(prev) != self.inputs:
                continue
            keep = None
            # the current attempt's checkpoints, or only its log and events (killed before its first
            # checkpoint): set aside, so the folder put back brings its own log
            stray = self.log_path.exists() or (run_dir / "tensorboard").exists()
            if (ckpt.exists() and any(ckpt.iterdir())) or stray:
                ckpt.mkdir(exist_ok=True)
                keep = _set_aside(ckpt, self.log_path)
            if ckpt.exists():
                ckpt.rmdir()  # empty (or just emptied by the move)
            prev.rename(ckpt)
            for name, dest in (("train_log.jsonl", self.log_path), ("tensorboard", run_dir / "tensorboard")):
                if (ckpt / name).exists() and not dest.exists():
                    (ckpt / name).rename(dest)
            console.print(
                f"[green]train: {prev.name}/ was made from this run's inputs; put it back as checkpoints/"
                + (f" (what was there, checkpoints or a log, moved to {keep.name}/)" if keep else "")
            )
            return prev
        return None

    def _resume(self, st: dict) -> None:
        """Load weights, optimizer, schedule, data position and RNG state from ``st`` (train_state.pt)."""
        tc, world = self.tc, self.world
        last = load_safetensors(self.ckpt / "last.safetensors", REWRITE["last.safetensors"])
        load_full_state(self.drafter, last, self.opt, st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        self.start_epoch, self.start_batch = st["next_epoch"], st["next_batch"]
        self.history, self.best = json.loads(st["history"]), json.loads(st["best"])
        self.acc_state = st["epoch_sums"][world.rank] if st.get("epoch_sums") else None
        torch.set_rng_state(st["rng"]["torch"])
        random.setstate(
            tuple(st["rng"]["python"]) if isinstance(st["rng"]["python"], list) else st["rng"]["python"]
        )
        if "cuda" in st["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["rng"]["cuda"])
        if world.main and self.start_epoch < tc.epochs:
            # past the ckpt
            _truncate_log(self.log_path, self.steps_before(self.start_epoch, self.start_batch))
            console.print(
                f"[green]train: resuming at epoch {self.start_epoch + 1} of {tc.epochs}, "
                f"step {self.start_batch} of {self.epoch_steps[self.start_epoch]}"
            )

    def save(self, next_epoch: int, next_batch: int, sums) -> None:
        """``last.safetensors`` + ``train_state.pt`` (whole, then renamed): resume continues at
        ``next_epoch``/``next_batch`` with each process's running epoch ``sums``."""
        world = self.world
        sums = world.gather_floats(sums) if sums is not None else None
        model_state, opt_state = full_state(self.drafter, self.opt)  # collective under FSDP
        if world.main:
            meta = {"epoch": next_epoch, "step": self.step, "provenance": json.dumps(self.provenance)}
            self.kind.save_checkpoint(self.drafter, self.ckpt / "last.safetensors", meta, model_state)
            tmp = self.state_path.with_name(self.state_path.name + ".tmp")
            torch.save(
                {
                    "inputs": self.inputs,
                    "optimizer": opt_state,
                    "scheduler": self.sched.state_dict(),
                    "step": self.step,
                    "next_epoch": next_epoch,
                    "next_batch": next_batch,
                    "epoch_sums": sums,
                    "train_config": json.dumps(self.tc_fields),
                    "history": json.dumps(self.history),
                    "best": json.dumps(self.best),
                    "rng": _rng_state(),
                },
                tmp,
            )
            os.replace(tmp, self.state_path)
        world.barrier()
