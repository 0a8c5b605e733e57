"""speculators 0.9.0's DFlash row of benchmarks/variants.py: its trainer on the same training split,
tokens, target layers and target states as eagle3kit's ``dflash`` row, then eagle3kit's reader and the
same τ measurement (:func:`train_speculators_dflash`).

The training split is eagle3kit's (``train.val_fraction`` held out by the seeded shuffle of ``eagle3kit
train``, :func:`peers.specforge_run.training_split`); the held-out samples follow it in the dataset
and are speculators' validation rows. The states are the target's, computed here with eagle3kit's
target code (``capture_layer_inputs``): the aux states of the ``dflash`` row's layers (a
``drafter: {variant: dflash}`` section's defaults: 5 layers, blocks of 8, ``default_target_layer_ids``
+ 1 = HF ``output_hidden_states`` indices, speculators' numbering) and the final state before the
final norm (speculators computes its teacher as ``lm_head(norm(last))``). The mask token is the one
eagle3kit's DFlash picks (``mask_token``: an id the data never uses). The vocabulary is the full
target vocabulary, as eagle3kit's DFlash drafter's (it has no draft vocabulary).

speculators keeps its own defaults except what must match: 12 epochs (``train.epochs``), learning
rate 6e-4 (the ``dflash`` row's), the seed, block 8, 5 layers, every layer full attention and so
non-causal inside the block (eagle3kit's network; speculators' default is a 2048-token sliding window,
causal inside the block unless ``--sliding-window-non-causal``, which is passed so that its config
says non-causal as vLLM and eagle3kit's ``check`` read it),
about ``train.tokens_per_step`` tokens a step (one packed row of ``--total-seq-len`` tokens a step, no
accumulation). Its defaults kept: loss ``ce`` = cross-entropy on the target's argmax (distils the
target's top-1 at each slot, where eagle3kit's ``dflash`` row trains on the data's tokens), D-PACE
position weights (γ 4 otherwise), Muon + AdamW, linear schedule, 512 anchors per packed row, bf16
autocast, flex attention, gradient clip 1. Its loss runs unfused (``--loss-implementation eager``): its
fused Triton kernel stops under the GPU image's torch 2.11 compile. Its final epoch is measured (no best checkpoint).

eagle3kit's ``run_import`` reads EAGLE-3 layouts only; a DFlash folder of speculators' layout is read
by ``eagle3kit.drafters.dflash.folder.read_dflash`` (which ``heldout_tau`` uses) and checked with
``eagle3kit.serve.check.check_drafter``, so the checkpoint is copied to ``vdir/drafter``, checked and
measured as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch
from common import gpu_processes

from peers import speculators_dflash_adapter as sda
from peers.specforge_run import training_split


def dflash_defaults():
    """The ``drafter`` section of eagle3kit's ``dflash`` row (benchmarks/variants.py ROWS)."""
    from eagle3kit.core.config_train import DrafterVariantConfig

    return DrafterVariantConfig(variant="dflash")


def write_verifier(target, out: Path) -> Path:
    """speculators' verifier folder for ``target``: its config, embedding, final norm and lm_head
    (:func:`speculators_dflash_adapter.write_verifier_dir`)."""
    p = target.parts
    return sda.write_verifier_dir(
        target.config, p.embed.weight, p.final_norm.weight, getattr(p.lm_head, "weight", None), out
    )


def target_state_rows(target, samples, aux_ids, tokens_per_batch: int, device):
    """Yield ``(ids, mask, aux, last_prenorm)`` per sample, in order: one target pass over consecutive
    samples of at most ``tokens_per_batch`` padded tokens (right padding), the aux states at HF indices
    ``aux_ids`` (inputs of those decoder layers) and the final norm's input."""
    from eagle3kit.model.target import capture_layer_inputs

    parts = target.parts
    i = 0
    while i < len(samples):
        j, longest = i + 1, samples[i].ids.numel()
        while j < len(samples) and max(longest, samples[j].ids.numel()) * (j + 1 - i) <= tokens_per_batch:
            longest = max(longest, samples[j].ids.numel())
            j += 1
        group = samples[i:j]
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        am = torch.zeros(len(group), longest, dtype=torch.long)
        for r, s in enumerate(group):
            ids[r, : s.ids.numel()] = s.ids
            am[r, : s.ids.numel()] = 1
        with (
            torch.no_grad(),
            capture_layer_inputs(parts.layers, aux_ids, final_norm=parts.final_norm) as store,
        ):
            parts.decoder(input_ids=ids.to(device), attention_mask=am.to(device), use_cache=False)
        aux = torch.cat([store[a] for a in aux_ids], dim=-1)
        for r, s in enumerate(group):
            n = s.ids.numel()
            yield s.ids, s.mask, aux[r, :n].cpu(), store["final"][r, :n].cpu()
        i = j


def train_speculators_dflash(args, key: str, vdir: Path, heldout_tau, open_run, ks) -> dict:
    """Target states, speculators' DFlash training, eagle3kit's reader and τ, for ``key``
    (``speculators_dflash:SEED``); returns the row's result (written to ``vdir/result.json`` by the
    caller)."""
    from eagle3kit.data.tokenize import load_shard
    from eagle3kit.drafters.dflash.folder import read_dflash
    from eagle3kit.model.target import resolve_aux_layer_ids
    from eagle3kit.serve.check import check_drafter
    from eagle3kit.train.batches import Sample
    from eagle3kit.train.samples import mask_token

    seed = int(key.split(":")[1])
    base, cfg, device, target = open_run(str(Path(args.work) / "base"))
    dc = dflash_defaults()
    every = [
        s for s in (Sample(i, m) for i, m in load_shard(base / "tokens.safetensors")) if s.mask[1:].any()
    ]
    train = training_split(every, cfg.train.seed, cfg.train.val_fraction)
    kept = {id(s) for s in train}
    val = [s for s in every if id(s) not in kept]
    aux_ids = list(resolve_aux_layer_ids(cfg.target, target.num_layers, dc))
    mask_id = mask_token(every, target.tokenizer, target.vocab_size, dc.mask_token_id)
    work = vdir / "speculators"
    if work.exists():
        shutil.rmtree(work)
    write_verifier(target, work / "verifier")
    t = time.perf_counter()
    data = sda.write_offline_data(
        work / "data",
        target_state_rows(target, train + val, aux_ids, max(cfg.train.tokens_per_step, 4096), device),
    )
    states_seconds = time.perf_counter() - t
    on_gpu = torch.cuda.is_available()
    settings = {
        "target_layer_ids": aux_ids,
        "mask_token_id": mask_id,
        "train_ratio": sda.data_ratio(len(train), len(train) + len(val)),
        "epochs": cfg.train.epochs,
        "lr": 6e-4,
        "seed": seed,
        "total_seq_len": max(cfg.train.tokens_per_step, data["longest"]),
        "block_size": dc.block_size,
        "num_layers": dc.num_layers,
        "full_attention": True,
        # speculators' defaults on a GPU (flex attention, fused loss); a CPU has neither
        "attn_impl": None if on_gpu else "sdpa",
        # eager on the GPU too: speculators' fused Triton loss stops under the device image's torch 2.11
        # compile (2026-12-05, H100: dynamo "ListVariable ... is already tracked for mutation" at
        # losses/fused.py loss_backward_kernel.configs, 4 minutes into epoch 1); the same CE, unfused
        "loss_implementation": "eager",
        "num_workers": None if on_gpu else 0,
    }
    argv = sda.build_train_command(
        verifier=work / "verifier",
        data_path=work / "data",
        save_path=work / "checkpoints",
        log_dir=work / "logs",
        **settings,
    )
    env = sda.train_env(os.environ.get("SPECULATORS_PATH"))
    (work / "command.json").write_text(json.dumps({"argv": argv, "env": env}, indent=2))
    train_tokens = sum(min(s.ids.numel(), settings["total_seq_len"]) for s in train) * cfg.train.epochs
    seen = {"at_start": gpu_processes(), "launched_together": args.parallel}
    t = time.perf_counter()
    with open(vdir / "speculators.log", "w") as log:
        rc = subprocess.run(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t
    seen["at_end"] = gpu_processes()
    if rc:
        raise SystemExit(f"speculators' trainer exited with {rc}: see {vdir / 'speculators.log'}")
    ckpt = sda.final_checkpoint(work / "checkpoints", cfg.train.epochs)
    drafter = vdir / "drafter"
    if drafter.exists():
        shutil.rmtree(drafter)
    drafter.mkdir(parents=True)
    for f in [ckpt / "config.json", *ckpt.glob("*.safetensors")]:
        shutil.copy2(f, drafter / f.name)
    d = read_dflash(drafter)  # every tensor of eagle3kit's DFlash network present, none unknown
    if d.cfg.aux_layer_ids != aux_ids or d.cfg.mask_token_id != mask_id or d.cfg.block_size != dc.block_size:
        raise SystemExit(f"{ckpt}: not the drafter asked for ({d.cfg.aux_layer_ids}, {d.cfg.mask_token_id})")
    findings = check_drafter(drafter, cfg.target)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise SystemExit(f"{drafter} would not serve: {errors}")
    tau, counts = heldout_tau(base, target, args.shared, {key: drafter}, device, ks=ks, **args.eval)
    return {
        "key": key,
        "tau": tau[key],
        "prompts": counts,
        "train_seconds": round(seconds, 1),
        "tokens_per_s": round(train_tokens / seconds),
        "tokens_per_s_wall": round(train_tokens / seconds),
        "tokens_per_s_note": "wall: speculators' whole training subprocess (start-up, compilation and its "
        "validation epochs included) over the training split's tokens × epochs",
        "target_states_seconds": round(states_seconds, 1),
        "train_samples": len(train),
        "val_samples": len(val),
        "import_layout": "speculators-dflash (read by eagle3kit's read_dflash; run_import reads EAGLE-3 only)",
        "import_notes": [f"{f.severity}: {getattr(f, 'message', f)}" for f in findings],
        "speculators_settings": {
            **{k: v for k, v in settings.items() if v is not None},
            "checkpoint": str(ckpt),
            "defaults_kept": "loss ce (target argmax), dpace weights, muon, linear schedule, max_anchors 512",
        },
        "speculators_version": sda.SPECULATORS_VERSION,
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "gpu_processes": seen,
    }


if __name__ == "__main__":
    print(json.dumps({"speculators_dflash_adapter": sda.SPECULATORS_VERSION}))
