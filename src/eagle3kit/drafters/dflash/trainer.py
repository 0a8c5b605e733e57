"""Stage ``train`` for ``drafter.variant: dflash``: the DFlash drafter (:mod:`eagle3kit.drafters.dflash.network`)
trained with its block objective (:mod:`eagle3kit.drafters.dflash.objective`) on the run's tokens, its target states
from stored features (``train.features``, extracted for the DFlash layers) or from the target loaded
here.

What it shares with the EAGLE-3 trainer: the inputs' lineage, the tokenizer and template checks, the
seeded validation split, AdamW with warmup and cosine decay, bf16 autocast on a GPU, gradient
clipping, ``checkpoints/best.safetensors`` by validation τ, the report and the manifest. What it does
not do yet: distributed training, online states (``train.online_from``), mid-epoch resume (a rerun
resumes at the last finished epoch).
"""

from __future__ import annotations

import json
import math
import random
import time

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.lineage import check_inputs
from eagle3kit.core.rundir import DataError, RunDir, open_safetensors, sha256_tensors
from eagle3kit.core.ui import console, progress
from eagle3kit.data.tokenize import load_shard
from eagle3kit.drafters.dflash.network import DFlashConfig, DFlashDrafter
from eagle3kit.drafters.dflash.objective import (
    default_gamma,
    dflash_batch,
    dflash_loss,
    pick_anchors,
    simulate_block_tau,
)
from eagle3kit.model.target import (
    chat_template_hash,
    load_target,
    pick_device,
    resolve_aux_layer_ids,
    tokenizer_hash,
)
from eagle3kit.model.target_files import weights_fingerprint
from eagle3kit.train.batches import Sample, length_batches
from eagle3kit.train.extract import feature_inputs
from eagle3kit.train.features import load_features
from eagle3kit.train.memory import print_plan, training_plan
from eagle3kit.train.samples import compute_features, mask_token, trained_settings, warmup_cosine

#: the metadata key that marks a DFlash checkpoint (export and evaluate read it)
KIND_KEY = "drafter"


def is_dflash_checkpoint(path) -> bool:
    """Whether the safetensors file at ``path`` is a DFlash checkpoint of this stage."""
    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get(KIND_KEY) == "dflash"


def load_dflash_checkpoint(path) -> tuple[DFlashDrafter, dict]:
    """The drafter (float32) and the provenance stored in a checkpoint of this stage."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    d = DFlashDrafter(DFlashConfig(**json.loads(meta["config"])))
    d.load_state_dict(load_file(str(path)), strict=False)
    return d.float(), json.loads(meta.get("provenance", "{}"))


def _save(drafter: DFlashDrafter, path, epoch: int, provenance: dict) -> None:
    tensors = {
        k: v.detach().float().cpu().contiguous()
        for k, v in drafter.state_dict().items()
        if not k.startswith("rotary.")
    }
    tmp = path.with_name(path.name + ".tmp")
    meta = {
        KIND_KEY: "dflash",
        "config": json.dumps(drafter.cfg.to_dict()),
        "epoch": str(epoch),
        "provenance": json.dumps(provenance),
    }
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def run_dflash_train(cfg: Config, run: RunDir, target=None) -> dict:
    """Train the DFlash drafter; writes ``checkpoints/best.safetensors`` (by validation τ at
    ``evaluate.k``), ``checkpoints/last.safetensors`` + ``dflash_state.pt`` (resume at the next epoch)
    and ``train_log.jsonl``; returns the report section.

    Raises:
        ConfigError: online states asked for, tokens or vocabulary of another tokenizer or template, no
            supervised token, a mask token that occurs in the data. DataError: stored features that are
            not this run's (other tokens, layers or target)."""
    tc, dc = cfg.train, cfg.drafter
    if tc.online_from:
        raise ConfigError(
            "a DFlash drafter trains from stored features or the target loaded here: unset train.online_from"
        )
    device = pick_device(tc.device)
    shard = run.require("tokens.safetensors", "tokenize")
    fp = target.source.get("weights_fingerprint") if target is not None else weights_fingerprint(cfg.target)
    consumed = check_inputs(run, "train", ["tokens.safetensors", "vocab.safetensors"], target=fp)
    target = target if target is not None else load_target(cfg.target, device=device)
    meta = open_safetensors(shard).metadata() or {}
    if meta.get("tokenizer_sha256") not in (None, tokenizer_hash(target.tokenizer)) or meta.get(
        "chat_template_sha256"
    ) not in (None, chat_template_hash(target.tokenizer)):
        raise ConfigError(
            f"{shard} was made with another tokenizer or chat template than {cfg.target.model}'s; rerun "
            f"`eagle3kit tokenize --run-dir {run.path}`"
        )
    aux_ids = resolve_aux_layer_ids(cfg.target, target.num_layers, dc)
    samples = [s for s in (Sample(i, m) for i, m in load_shard(shard)) if s.mask[1:].any()]
    if not samples:
        raise ConfigError(f"{shard} holds no supervised tokens; check the tokenize stage's report")
    mask_id = mask_token(samples, target.tokenizer, target.vocab_size, dc.mask_token_id)
    dcfg = DFlashConfig.from_target(
        target.config, mask_id, dc.num_layers, dc.block_size, [a - 1 for a in aux_ids]
    )
    with torch.device("meta"):
        shaped = DFlashDrafter(dcfg)
    speed = {"loss_chunk": 0, "bf16": device.type == "cuda", "compile": False, "attention": "flex"}
    params = sum(p.numel() for p in shaped.parameters())
    plan = training_plan(
        tc,
        speed,
        target,
        params,
        len(aux_ids),
        None,
        samples,
        [],
        device,
        1,
        "stored" if tc.features else None,
    )
    print_plan(plan)
    store = device if plan.cache == "device" else ("host" if device.type == "cuda" else device)
    if tc.features:
        load_features(
            tc.features,
            samples,
            feature_inputs(
                consumed["tokens.safetensors"], aux_ids, target, consumed.get("vocab.safetensors")
            ),
            target,
            device if store == device else torch.device("cpu"),
        )
    else:
        compute_features(
            target,
            samples,
            aux_ids,
            max(tc.tokens_per_step, 4096),
            device,
            store,
            label="target states (DFlash layers)",
        )
    if dc.objective == "kl" and any(s.last is None for s in samples):
        raise ConfigError(
            f"drafter.objective kl distils the target's whole distribution, and the features in {tc.features} keep "
            "only its top-K: extract them with extract.teacher: last, or use drafter.objective: ce"
        )
    return _Trainer(cfg, run, target, dcfg, samples, consumed, device).fit()


class _Trainer:
    """One DFlash training run's state (see :func:`run_dflash_train`)."""

    def __init__(self, cfg, run, target, dcfg, samples, consumed, device):
        self.cfg, self.rd, self.target, self.device, self.consumed = cfg, run, target, device, consumed
        tc = self.tc = cfg.train
        order = list(range(len(samples)))
        random.Random(tc.seed).shuffle(order)
        n_val = (
            max(1, round(len(samples) * tc.val_fraction)) if tc.val_fraction > 0 and len(samples) > 1 else 0
        )
        self.val = [samples[i] for i in order[:n_val]]
        self.train = [samples[i] for i in order[n_val:]]
        torch.manual_seed(tc.seed)
        self.drafter = DFlashDrafter(dcfg).to(device)
        self.gamma = cfg.drafter.gamma or default_gamma(dcfg.block_size)
        self.bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")
        self.opt = torch.optim.AdamW(
            self.drafter.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay
        )
        lengths = [s.ids.numel() for s in self.train]
        self.epoch_batches = [
            length_batches(lengths, tc.tokens_per_step, True, random.Random(tc.seed + e))
            for e in range(tc.epochs)
        ]
        lr_at = warmup_cosine(sum(len(b) for b in self.epoch_batches), tc.warmup_ratio)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_at)
        self.inputs = {
            "tokens": consumed["tokens.safetensors"],
            "aux_layer_ids": dcfg.aux_layer_ids,
            "train_config": json.dumps(trained_settings(cfg), sort_keys=True),
            "target": target.source.get("weights_fingerprint"),
            "mask_token_id": dcfg.mask_token_id,
            "features": tc.features and str(tc.features),
        }
        self.provenance = {
            "target": {
                "model": cfg.target.model,
                "weights_fingerprint": target.source.get("weights_fingerprint"),
            },
            "tokenizer_sha256": tokenizer_hash(target.tokenizer),
            "aux_layer_ids": {"convention": "hf_output_hidden_states_index", "ids": dcfg.aux_layer_ids},
        }
        self.ckpt = run / "checkpoints"
        self.ckpt.mkdir(exist_ok=True)
        self.history, self.best, self.start = [], {"val_tau": -math.inf, "epoch": 0}, 0
        self.tokens, self.seconds = 0, 0.0

    def _resume(self) -> None:
        state_path = self.ckpt / "dflash_state.pt"
        if not state_path.is_file() or not (self.ckpt / "last.safetensors").is_file():
            return
        st = torch.load(state_path, map_location="cpu", weights_only=True)
        if st.get("inputs") != self.inputs:
            console.print("[yellow]train: the checkpoints were made from other inputs; training from scratch")
            return
        self.drafter.load_state_dict(load_file(str(self.ckpt / "last.safetensors")), strict=False)
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.history, self.best, self.start = st["history"], st["best"], st["epoch"]
        console.print(f"train: resuming after epoch {self.start}")

    def _epoch(self, epoch: int, bar, task) -> dict:
        tc, d = self.tc, self.drafter
        gen = torch.Generator().manual_seed(tc.seed * 1000 + epoch)
        sums = {"loss": 0.0, "n": 0, "accepted": 0, "blocks": 0, "correct": 0}
        t0 = time.perf_counter()
        for b in self.epoch_batches[epoch]:
            batch = dflash_batch(self.train, b, self.device)
            anchors = pick_anchors(
                batch["mask"],
                [self.train[i].ids.numel() for i in b],
                d.cfg.block_size,
                self.cfg.drafter.max_anchors,
                gen,
            )
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                loss, st = dflash_loss(d, self.target, batch, anchors, self.gamma, self.cfg.drafter.objective)
            self.opt.zero_grad(set_to_none=True)
            if st["n"]:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(d.parameters(), tc.grad_clip)
                self.opt.step()
            self.sched.step()
            sums["loss"] += float(loss.detach()) * st["n"]
            for key in ("n", "accepted", "blocks"):
                sums[key] += st[key]
            sums["correct"] += st["correct"][0]
            n_tok = int(batch["valid"].sum())
            self.tokens += n_tok
            bar.update(task, advance=1, tokens=self.tokens, note=f"loss {float(loss.detach()):.3f}")
        self.seconds += time.perf_counter() - t0
        if not sums["n"]:
            raise DataError(
                f"train: epoch {epoch + 1} supervised no block slot; check the tokenize stage's report"
            )
        return sums

    def fit(self) -> dict:
        self._resume()
        tc, cfg = self.tc, self.cfg
        with progress() as bar:
            task = bar.add_task(
                "train (DFlash)",
                total=sum(len(b) for b in self.epoch_batches[self.start :]),
                tokens=0,
                note="",
            )
            for epoch in range(self.start, tc.epochs):
                sums = self._epoch(epoch, bar, task)
                val = (
                    simulate_block_tau(self.drafter, self.target, self.val, cfg.evaluate.k, self.device)
                    if self.val
                    else None
                )
                rec = {
                    "epoch": epoch + 1,
                    "train_loss": round(sums["loss"] / sums["n"], 5),
                    "train_slot1_accuracy": round(sums["correct"] / max(1, sums["blocks"]), 4),
                    "train_block_tau": round(1 + sums["accepted"] / max(1, sums["blocks"]), 4),
                    "val_tau": round(val.tau, 4) if val else None,
                }
                self.history.append(rec)
                with open(self.rd / "train_log.jsonl", "a") as f:
                    f.write(json.dumps(rec) + "\n")
                console.print(
                    f"epoch {epoch + 1}: loss {rec['train_loss']:.4f}  slot-1 acc {rec['train_slot1_accuracy']:.3f}  "
                    f"block τ {rec['train_block_tau']:.3f}"
                    + (f"  val τ(K={cfg.evaluate.k}) {val.tau:.3f}" if val else "")
                )
                score = val.tau if val else -rec["train_loss"]
                if score > self.best["val_tau"]:
                    self.best = {"val_tau": score, "epoch": epoch + 1}
                    _save(self.drafter, self.ckpt / "best.safetensors", epoch + 1, self.provenance)
                _save(self.drafter, self.ckpt / "last.safetensors", epoch + 1, self.provenance)
                torch.save(
                    {
                        "inputs": self.inputs,
                        "opt": self.opt.state_dict(),
                        "sched": self.sched.state_dict(),
                        "history": self.history,
                        "best": self.best,
                        "epoch": epoch + 1,
                    },
                    self.ckpt / "dflash_state.pt",
                )
        return self._write()

    def _write(self) -> dict:
        final = self.history[-1] if self.history else {}
        d = self.drafter.cfg
        result = {
            "drafter_variant": "dflash",
            "block_size": d.block_size,
            "num_layers": d.num_hidden_layers,
            "target_layer_ids": d.target_layer_ids,
            "mask_token_id": d.mask_token_id,
            "objective": self.cfg.drafter.objective,
            "gamma": self.gamma,
            "final_loss": final.get("train_loss"),
            "best_epoch": self.best["epoch"],
            "best_val_tau": round(self.best["val_tau"], 4) if self.val else None,
            "epochs": self.tc.epochs,
            "train_samples": len(self.train),
            "val_samples": len(self.val),
            "history": self.history,
            "precision": "bf16" if self.bf16 else "fp32",
        }
        if self.tokens and self.seconds:
            result["tokens_per_s"] = round(self.tokens / self.seconds, 1)
        best = self.ckpt / "best.safetensors"
        self.rd.record_stage(
            "train",
            self.inputs,
            result,
            {"checkpoints/best.safetensors": sha256_tensors(best)},
            consumed=self.consumed,
            target=self.target.source.get("weights_fingerprint"),
        )
        self.rd.update_manifest(
            aux_layer_ids={"convention": "hf_output_hidden_states_index", "ids": d.aux_layer_ids}
        )
        return result
