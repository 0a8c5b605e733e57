"""Stage ``train``: EAGLE-3 with training-time test (DESIGN.md §4).

Data: ``tokens.safetensors`` + ``vocab.safetensors`` + the target (online features). With
``train.feature_cache`` (default) the target runs once over every sample and its aux states,
post-norm last hidden state and full-vocabulary argmax are kept in memory for all epochs
(not full-vocabulary logits: 197 KB a token for a 49K vocabulary); without it the target runs
inside every step.

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
import math
import os
import random
from pathlib import Path

import torch

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.lineage import check_inputs
from eagle3kit.core.metrics import AcceptanceStats, match_runs, walk_chain
from eagle3kit.core.rundir import (
    REWRITE,
    DataError,
    RunDir,
    load_safetensors,
    open_safetensors,
    require_free,
    sha256_json,
    sha256_tensors,
)
from eagle3kit.core.ui import Timer, console, progress
from eagle3kit.data.tokenize import load_shard
from eagle3kit.model.draft_vocab import DraftVocab, load_vocab
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.target import (
    Target,
    embed_tokens,
    load_target,
    pick_device,
    resolve_aux_layer_ids,
    target_features,
    teacher_argmax,
    tokenizer_hash,
    weights_fingerprint,
)
from eagle3kit.train.batches import Sample, _pad, length_batches, make_batch, packed_batches
from eagle3kit.train.checkpoints import (
    _set_aside,
    init_from_drafter,
    save_drafter_checkpoint,
)
from eagle3kit.train.distributed import full_state, init_world, load_full_state
from eagle3kit.train.extract import feature_inputs
from eagle3kit.train.features import load_features
from eagle3kit.train.log import TrainLog
from eagle3kit.train.ttt import implied_tau, ttt_loss


@torch.no_grad()
def compute_features(target: Target, samples: list[Sample], aux_ids, tokens_per_batch: int, device, store_device,
                     label: str = "target features") -> None:
    """Fill ``aux``, ``last`` and ``argmax`` of every sample with one target pass (in place)."""
    batches = length_batches([s.ids.numel() for s in samples], tokens_per_batch, False, random.Random(0))
    with progress() as bar:
        task = bar.add_task(label, total=len(samples), tokens=0, note="")
        done_tokens = 0
        for b in batches:
            ids = _pad([samples[i].ids for i in b]).to(device)
            am = _pad([torch.ones_like(samples[i].ids) for i in b]).to(device)
            aux, last = target_features(target, ids, am, aux_ids)
            lengths = [samples[i].ids.numel() for i in b]
            # the full-vocabulary top-1 of the batch's completion tokens (the only ones training reads) in
            # one pass (right padding: row j's first n_j are real), not one small product per sample
            completion = torch.cat([samples[i].mask.bool() for i in b])
            top1 = teacher_argmax(target, last[am.bool()], where=completion).split(lengths)
            for j, (i, n) in enumerate(zip(b, lengths)):
                s = samples[i]
                s.aux, s.last = aux[j, :n].to(store_device), last[j, :n].to(store_device)
                s.argmax = top1[j].to(store_device)
                done_tokens += n
            bar.update(task, advance=len(b), tokens=done_tokens)


@torch.no_grad()
def simulate_samples(drafter: Eagle3Drafter, target: Target, samples: list[Sample], k: int, device) -> AcceptanceStats:
    """Greedy-chain τ on samples whose completion is the target's greedy output (TTT unroll with
    the data tokens, DESIGN.md §7). Each sample's chain starts at its last prompt position."""
    stats = AcceptanceStats(k)
    drafter.eval()
    for s in samples:
        b = make_batch([s], [0], k, device)
        embeds = [embed_tokens(target, t, drafter.fc.weight) for t in b["tok"]]
        outs = drafter(b["aux"].to(drafter.fc.weight.dtype), embeds, b["positions"], b["key_mask"])   # forward: FSDP hooks
        draft = torch.stack([drafter.draft_to_target(drafter.logits(o[0]).argmax(-1)) for o in outs], dim=1).cpu()
        runs = match_runs(draft, s.ids.cpu())
        first = int(s.mask.long().argmax())
        walk_chain(runs, first - 1, s.ids.numel(), k, stats)
    return stats


def build_drafter(target: Target, vocab: DraftVocab, aux_ids, seed: int) -> Eagle3Drafter:
    """A freshly initialised drafter shaped after the target (seeded)."""
    torch.manual_seed(seed)
    dcfg = DrafterConfig.from_target(target.config, vocab.size, aux_ids, vocab_size=target.vocab_size)
    d = Eagle3Drafter(dcfg)
    d.set_vocab(vocab)
    return d


def train_step(model, opt, target: Target, batch: dict, draft_ids: torch.Tensor, tc, speed: dict, world=None):
    """One optimizer step on one batch: the TTT loss (:func:`eagle3kit.train.ttt.ttt_loss`) under bf16
    autocast when ``speed["bf16"]``, backward, gradient clipping to ``tc.grad_clip``, AdamW.

    Args:
        model: the drafter, or the drafter in DistributedDataParallel.
        tc: the ``train`` config section (``ttt_steps``, ``step_weight``, ``grad_clip``).
        speed: ``{"attention", "bf16", "loss_chunk"}`` (see :func:`_resolve_speed`).
        world: the :class:`~eagle3kit.train.distributed.World`; no step is taken when no process had a
            supervised position (every process still calls backward, as DDP needs).
    Returns:
        (loss scalar, per-step stats of :func:`eagle3kit.train.ttt.ttt_loss` plus ``tokens``, the batch's
        real tokens summed over every process).
    """
    drafter = getattr(model, "module", model)
    with torch.autocast(batch["ids"].device.type, dtype=torch.bfloat16, enabled=speed["bf16"]):
        loss, st = ttt_loss(model, target, batch, draft_ids, tc.ttt_steps, tc.step_weight,
                            attention=speed["attention"], loss_chunk=speed["loss_chunk"])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    mine = [float(sum(st["n"])), float(batch["key_mask"].sum())]
    n, tokens = world.sum_floats(mine) if world is not None else mine      # one collective for both
    st["tokens"] = int(tokens)
    if n > 0:
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
        opt.step()
    return loss, st


# settings left out of the train-config hash: logistics that do not change what is trained, and
# inputs hashed on their own (the features' and the init drafter's content, not their paths)
_LOGISTICS = {"checkpoint_every", "tensorboard", "wandb_project", "features", "init_from", "parallel", "compile",
              "loss_chunk", "attention", "precision", "device", "serve_engine"}


def feature_source_warning(source: str | None, serve_engine: str | None) -> str | None:
    """The warning when training features come from another source than the serving engine: a
    drafter trained on one engine's numerics and served by another's loses acceptance (issue 11).
    ``source`` is the features' tag (``vllm 0.32.0 (…)``; None = the transformers backend)."""
    src = source or "transformers (the target loaded by eagle3kit)"
    if serve_engine is None or src.split()[0] == serve_engine:
        return None
    fix = ("extract them with `eagle3kit extract --backend vllm`, or compare the two sources with `eagle3kit parity` "
           "before a long run" if serve_engine == "vllm" else
           "eagle3kit has no SGLang capture backend, so the difference cannot be measured here: check τ in SGLang "
           "(`eagle3kit bench`) before a long run")
    return (f"train: the features come from {src}, but train.serve_engine is {serve_engine}: their numerics can differ "
            f"(quantization, kernels, pre/post-norm states); {fix}")


def _resolve_speed(tc, device: torch.device) -> dict:
    """The fast-path settings for ``device``: flex attention, bf16 autocast and a chunked loss on
    CUDA; the readable reference (dense attention, fp32, unchunked loss) elsewhere."""
    cuda = device.type == "cuda"
    if tc.attention == "flex" and not cuda:
        raise ConfigError(f"train.attention: flex needs a CUDA device (flex attention has no backward pass on "
                          f"{device.type}); use attention: auto or reference here")
    return {"attention": tc.attention if tc.attention != "auto" else ("flex" if cuda else "reference"),
            "bf16": tc.precision == "bf16" or (tc.precision == "auto" and cuda),
            "loss_chunk": tc.loss_chunk if tc.loss_chunk is not None else (4096 if cuda else 0)}


def _epoch_batches(train: list[Sample], tc, epoch: int) -> list:
    """This epoch's batches (seeded by ``train.seed`` + epoch: the same on every run and resume)."""
    lengths = [s.ids.numel() for s in train]
    rng = random.Random(tc.seed + epoch)
    if tc.pack_length:
        return packed_batches(lengths, tc.tokens_per_step, tc.pack_length, True, rng)
    return length_batches(lengths, tc.tokens_per_step, True, rng)


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
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    tmp.replace(path)


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
        supervised tokens. DataError: another ``eagle3kit train`` holds this run directory (rank 0
        holds ``.train.lock`` while it trains, so two trainings never write the same checkpoints).
    """
    if int(os.environ.get("RANK", "0")) != 0:       # torchrun: the other ranks write nothing of their own
        return _run_train(cfg, run, target)
    with run.lock("train"):
        return _run_train(cfg, run, target)


def _run_train(cfg: Config, run: RunDir, target: Target | None) -> dict:

    tc = cfg.train
    if tc.wandb_project:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("train.wandb_project is set but wandb is not installed; pip install 'eagle3kit[wandb]' "
                              "or unset train.wandb_project")
    world = init_world(pick_device(tc.device))
    device = world.device
    speed = _resolve_speed(tc, device)
    shard = run.require("tokens.safetensors", "tokenize")
    vocab_path = run.require("vocab.safetensors", "vocab")
    fingerprint = target.source.get("weights_fingerprint") if target is not None else weights_fingerprint(cfg.target)
    consumed = check_inputs(run, "train", ["tokens.safetensors", "vocab.safetensors"], target=fingerprint)
    vocab, vocab_meta = load_vocab(vocab_path, expected_size=cfg.vocab.draft_vocab_size)
    if target is None:
        target = load_target(cfg.target, device=device)
    if vocab.vocab_size != target.vocab_size:
        raise ConfigError(f"{vocab_path} was built for a vocabulary of {vocab.vocab_size}, the target has {target.vocab_size}")


    tok_hash = tokenizer_hash(target.tokenizer)
    for path, meta in ((vocab_path, vocab_meta), (shard, open_safetensors(shard).metadata() or {})):
        if meta.get("tokenizer_sha256") not in (None, tok_hash):
            raise ConfigError(f"{path} was built with another tokenizer than {cfg.target.model}'s; "
                              "rerun `eagle3kit tokenize` and `eagle3kit vocab` for this target")
    aux_ids = resolve_aux_layer_ids(cfg.target, target.num_layers)
    rows = load_shard(shard)
    all_samples = [Sample(ids, mask) for ids, mask in rows]
    tokens_sha, vocab_sha = consumed["tokens.safetensors"], consumed["vocab.safetensors"]
    features = None
    if tc.features:         # extracted features: fill every sample now (the shards index all of them)

        features = load_features(tc.features, all_samples, feature_inputs(tokens_sha, aux_ids, target, vocab_sha),
                                 target, device)
        if world.main:
            console.print(f"train: features from {tc.features} ({features.get('dtype')}, teacher {features.get('teacher')}); "
                          "the target runs only for validation")
    warning = feature_source_warning((features or {}).get("source"), tc.serve_engine)
    if warning and world.main:
        console.print(f"[yellow]{warning}[/]")
    samples = [s for s in all_samples if s.mask[1:].any()]
    if not samples:
        raise ConfigError(f"{shard} holds no supervised tokens; check the tokenize stage's report")
    rng = random.Random(tc.seed)
    order = list(range(len(samples)))
    rng.shuffle(order)
    n_val = max(1, round(len(samples) * tc.val_fraction)) if tc.val_fraction > 0 and len(samples) > 1 else 0
    val = [samples[i] for i in order[:n_val]] if world.main or tc.parallel == "fsdp" else []   # FSDP: all validate
    train = [samples[i] for i in order[n_val:]][world.rank::world.size]      # this process's share
    ckpt = run / "checkpoints"
    ckpt.mkdir(exist_ok=True)
    tc_fields = tc.model_dump(mode="json", exclude=_LOGISTICS)        # what is trained (hashed, stored, diffed)
    inputs = {"tokens": tokens_sha, "vocab": vocab_sha, "aux_layer_ids": list(aux_ids),
              "train_config": sha256_json(tc_fields),
              "target": target.source.get("weights_fingerprint"), "world_size": world.size}
    if features is not None:
        inputs["features"] = sha256_json(features)

    provenance = {"target": {"model": cfg.target.model, "weights_fingerprint": target.source.get("weights_fingerprint"),
                             "fingerprint_format": target.source.get("fingerprint_format")},
                  "tokenizer_sha256": tok_hash, "draft_vocab_sha256": inputs["vocab"],
                  "aux_layer_ids": {"convention": "hf_output_hidden_states_index", "ids": list(aux_ids)},
                  # where the aux states and the teacher came from (check compares it with the serving engine)
                  "features_source": (features or {}).get("source") or "transformers"}
    drafter = build_drafter(target, vocab, aux_ids, tc.seed)
    if world.main:      # last.safetensors (weights + AdamW's two moments), best, and one of them being written
        require_free(ckpt, 8 * sum(p.numel() * 4 for p in drafter.parameters()), "train's checkpoints")
    init = init_from_drafter(drafter, tc.init_from, cfg.target) if tc.init_from else None
    if init:
        inputs["init_from"] = provenance["init_from"] = init["init_from_sha256"]
        fresh = init["lm_head_rows"] - init["lm_head_rows_copied"]
        if world.main:
            console.print(f"train: starting from {tc.init_from} ({init['lm_head_rows_copied']} of {init['lm_head_rows']} "
                          "lm_head rows shared by target id" + (f"; {fresh} start fresh)" if fresh else ")"))
    drafter = drafter.to(device)
    if tc.compile:
        drafter.compile_layer()
    model = world.wrap(drafter, tc.parallel)
    draft_ids = vocab.ids.to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay,
                            fused=device.type == "cuda")
    batches_per_epoch = world.min_int(len(_epoch_batches(train, tc, 0)))   # every process takes as many steps
    total_steps = batches_per_epoch * tc.epochs
    warmup = max(1, math.ceil(tc.warmup_ratio * total_steps))

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    # the best score so far: validation τ, or −train loss without validation (any first epoch beats it)
    start_epoch, start_batch, history, best = 0, 0, [], {"val_tau": float("-inf"), "epoch": -1}
    acc_state = None
    state_path = ckpt / "train_state.pt"
    log_path = run / "train_log.jsonl"
    best_rec = run.manifest.get("lineage", {}).get("checkpoints/best.safetensors") or {}
    if world.main and state_path.exists() and best_rec.get("sha256") and (ckpt / "best.safetensors").exists() \
            and sha256_tensors(ckpt / "best.safetensors") != best_rec["sha256"]:
        keep = _set_aside(ckpt, log_path)
        console.print(f"[yellow]train: checkpoints/best.safetensors is not the one train wrote (replaced or edited); "
                      f"moved checkpoints/ to {keep} and starting fresh")
    world.barrier()
    if state_path.exists():
        try:
            st = torch.load(state_path, weights_only=True)
        except Exception as e:  # truncated or foreign: an interrupted copy, a full disk
            raise DataError(f"{state_path} is unreadable ({type(e).__name__}); {REWRITE['last.safetensors']}") from None
        weights_step = None
        if (ckpt / "last.safetensors").exists():
            with open_safetensors(ckpt / "last.safetensors") as f:
                weights_step = (f.metadata() or {}).get("step")
        if st.get("inputs") == inputs and weights_step is not None and weights_step == str(st.get("step")):
            last = load_safetensors(ckpt / "last.safetensors", REWRITE["last.safetensors"])
            load_full_state(drafter, last, opt, st["optimizer"])   # resume
            sched.load_state_dict(st["scheduler"])
            start_epoch, start_batch = st["next_epoch"], st["next_batch"]
            history, best = json.loads(st["history"]), json.loads(st["best"])
            acc_state = st["epoch_sums"][world.rank] if st.get("epoch_sums") else None
            torch.set_rng_state(st["rng"]["torch"])
            random.setstate(tuple(st["rng"]["python"]) if isinstance(st["rng"]["python"], list) else st["rng"]["python"])
            if "cuda" in st["rng"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(st["rng"]["cuda"])
            if world.main and start_epoch < tc.epochs:
                _truncate_log(log_path, start_epoch * batches_per_epoch + start_batch)   # steps past the checkpoint
                console.print(f"[green]train: resuming at epoch {start_epoch + 1} of {tc.epochs}, "
                              f"step {start_batch} of {batches_per_epoch}")
        else:
            world.barrier()
            if world.main:
                changed = sorted(k for k in set(inputs) | set(st.get("inputs", {})) if inputs.get(k) != st.get("inputs", {}).get(k))
                if "train_config" in changed and st.get("train_config"):
                    old_tc = json.loads(st["train_config"])
                    changed.remove("train_config")
                    changed += [f"train.{k}" for k in sorted(set(old_tc) | set(tc_fields)) if old_tc.get(k) != tc_fields.get(k)]
                if not changed:
                    changed = ["last.safetensors is missing or from another step than train_state.pt (a kill during a save)"]
                keep = _set_aside(ckpt, log_path)
                console.print(f"[yellow]train: checkpoints/ were made from other inputs (changed: {', '.join(changed)}); "
                              f"moved them to {keep} and starting fresh")
            world.barrier()
    if start_epoch >= tc.epochs:
        if world.main:
            console.print("[green]train: all epochs already done")
        done = run.report.get("train")
        if done:
            return done
    if world.main:      # until it is recorded at the end, best.safetensors is unfinished to every later stage
        run.mark_pending("checkpoints/best.safetensors", "train", consumed, target.source.get("weights_fingerprint"))
    step = start_epoch * batches_per_epoch + start_batch             # optimizer steps already taken
    if step == 0 and world.main:
        _truncate_log(log_path, 0)       # steps a run killed before its first checkpoint logged: they are redone
    timer = Timer()
    cached = tc.feature_cache or features is not None
    if start_epoch < tc.epochs and tc.feature_cache and features is None:
        compute_features(target, train + val, aux_ids, tc.tokens_per_step, device, device)
    logger = TrainLog(run, tc, world.main, dict(speed, world_size=world.size), purge_step=step)
    stop_after = int(os.environ.get("EAGLE3KIT_STOP_AFTER_STEPS", "0"))   # tests: emulate a kill after this many steps
    trained_tokens, steps_run = 0, 0
    last_stats: dict = {}

    def save(next_epoch: int, next_batch: int, sums) -> None:
        sums = world.gather_floats(sums) if sums is not None else None     # each process's running epoch sums
        model_state, opt_state = full_state(drafter, opt)                  # collective under FSDP
        if world.main:
            meta = {"epoch": next_epoch, "step": step, "provenance": json.dumps(provenance)}
            save_drafter_checkpoint(drafter, ckpt / "last.safetensors", meta, model_state)
            tmp = state_path.with_name(state_path.name + ".tmp")          # whole, then renamed
            torch.save({"inputs": inputs, "optimizer": opt_state, "scheduler": sched.state_dict(), "step": step,
                        "next_epoch": next_epoch, "next_batch": next_batch, "epoch_sums": sums,
                        "train_config": json.dumps(tc_fields),
                        "history": json.dumps(history), "best": json.dumps(best), "rng": _rng_state()}, tmp)
            os.replace(tmp, state_path)
        world.barrier()

    for epoch in range(start_epoch, tc.epochs):
        drafter.train()
        batches = _epoch_batches(train, tc, epoch)[:batches_per_epoch]
        first = start_batch if epoch == start_epoch else 0
        sums = acc_state if (epoch == start_epoch and acc_state) else [0.0, 0.0, 0, 0]   # loss·n, acc0·n, n, tokens
        with progress(disable=not world.main) as bar:
            task = bar.add_task(f"train epoch {epoch + 1}/{tc.epochs}", total=len(batches), completed=first,
                                tokens=0, note="")
            for j in range(first, len(batches)):
                b = batches[j]
                idx = [i for r in b for i in (r if isinstance(r, list) else [r])]
                if not cached:
                    compute_features(target, [train[i] for i in idx], aux_ids, tc.tokens_per_step, device, device)
                batch = make_batch(train, b, tc.ttt_steps, device)
                loss, st = train_step(model, opt, target, batch, draft_ids, tc, speed, world)
                sched.step()
                step += 1
                steps_run += 1
                if not torch.isfinite(loss.detach()):
                    raise DataError(f"train: the loss is {float(loss.detach())} at step {step} (epoch {epoch + 1}); nothing "
                                    "after the last checkpoint is kept. Lower train.lr, or check the features "
                                    "(`eagle3kit extract` refuses non-finite ones) and target.dtype")
                ntok = st["tokens"]
                trained_tokens += ntok
                if not cached:
                    for i in idx:
                        train[i].aux = train[i].last = train[i].argmax = None
                rec = {"step": step, "epoch": epoch + 1, "loss": round(float(loss.detach()), 5), "lr": sched.get_last_lr()[0],
                       "acc": [round(a, 4) for a in st["acc"]], "n": st["n"], "implied_tau": round(implied_tau(st["acc"]), 4),
                       "tokens": ntok}
                logger.step(rec, trained_tokens / max(timer.seconds, 1e-9))
                if st["n"][0]:  # a batch with no supervised token adds nothing (no fake 0 in the mean)
                    sums = [sums[0] + float(loss.detach()) * st["n"][0], sums[1] + st["acc"][0] * st["n"][0],
                            sums[2] + st["n"][0], sums[3]]
                sums[3] += ntok
                last_stats = rec
                bar.update(task, advance=1, tokens=sums[3],
                           note=f"batch: loss {float(loss.detach()):.2f} acc0 {st['acc'][0]:.2f}")
                if tc.checkpoint_every and step % tc.checkpoint_every == 0 and j + 1 < len(batches):
                    logger.flush()
                    save(epoch, j + 1, sums)
                if stop_after and steps_run >= stop_after:
                    logger.close()
                    raise SystemExit(f"train: stopped after {steps_run} steps (EAGLE3KIT_STOP_AFTER_STEPS)")
        ep_loss, ep_acc0, ep_n, _ = world.sum_floats(sums)
        if ep_n == 0:
            raise DataError(f"train: epoch {epoch + 1} supervised no position: the target's top-1 is never in the draft "
                            f"vocabulary ({vocab_path}) at a completion token. The vocabulary or the tokens were built "
                            "from another target's outputs; rerun `eagle3kit generate`, `tokenize` and `vocab` for this "
                            "target (a new run_dir)")
        val_stats = simulate_samples(drafter, target, val, cfg.evaluate.k, device) if val else None
        epoch_rec = {"epoch": epoch + 1, "train_loss": round(ep_loss / max(ep_n, 1), 5),
                     "train_step0_accuracy": round(ep_acc0 / max(ep_n, 1), 4),
                     "val_tau": round(val_stats.tau, 4) if val_stats else None}
        history.append(epoch_rec)
        logger.epoch(epoch_rec, step)
        if world.main:
            console.print(f"epoch {epoch + 1}: loss {epoch_rec['train_loss']:.4f}  step-0 acc "
                          f"{epoch_rec['train_step0_accuracy']:.3f}"
                          + (f"  val τ(K={cfg.evaluate.k}) {val_stats.tau:.3f}" if val_stats else ""))
        score = val_stats.tau if val_stats else -epoch_rec["train_loss"]
        score = world.sum_floats([score if world.main else 0.0])[0]       # rank 0's verdict, on every process
        if score > best["val_tau"]:
            best = {"val_tau": score, "epoch": epoch + 1}
            model_state, _ = full_state(drafter)
            if world.main:
                save_drafter_checkpoint(drafter, ckpt / "best.safetensors",
                                        {"epoch": epoch + 1, "provenance": json.dumps(provenance)}, model_state)
        save(epoch + 1, 0, None)
    logger.close()
    final = history[-1] if history else {}
    result = {
        "final_loss": final.get("train_loss"), "step0_accuracy": final.get("train_step0_accuracy"),
        "best_epoch": best["epoch"], "best_val_tau": round(best["val_tau"], 4) if n_val else None,
        "epochs": tc.epochs, "ttt_steps": tc.ttt_steps, "train_samples": len(samples) - n_val, "val_samples": n_val,
        "history": history, "last_step": last_stats, "processes": world.size,
        "attention": speed["attention"], "precision": "bf16" if speed["bf16"] else "fp32", "loss_chunk": speed["loss_chunk"],
    }
    if init:
        result.update({k: init[k] for k in ("init_from", "lm_head_rows_copied")})
    if trained_tokens:
        result["tokens_per_s"] = round(trained_tokens / timer.seconds, 1)
    if world.main:
        best_sha = sha256_tensors(ckpt / "best.safetensors")
        run.record_stage("train", inputs, result, {"checkpoints/best.safetensors": best_sha},
                         consumed=consumed, target=target.source.get("weights_fingerprint"))
        run.update_manifest(aux_layer_ids={"convention": "hf_output_hidden_states_index", "ids": list(aux_ids)})
    world.barrier()
    return result
