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
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import Config, ConfigError
from .drafter import DrafterConfig, Eagle3Drafter
from .metrics import AcceptanceStats, match_runs, walk_chain
from .rundir import RunDir, load_safetensors, set_aside, sha256_json, sha256_state, sha256_tensors
from .target import Target, pick_device, resolve_aux_layer_ids, target_features, teacher_argmax, teacher_logits
from .tokenize import load_shard
from .ui import Timer, console, progress
from .vocab import DraftVocab, load_vocab


@dataclass
class Sample:
    """One training sequence and (when cached) its target features.

    ids int64 [T]; mask bool [T] (completion tokens); aux [T, 3·Ht]; last [T, Ht] post-norm;
    argmax int64 [T] target full-vocabulary argmax at each position; or, from top-K features,
    ``topk_values``/``topk_ids``/``top1_in_draft`` in place of ``last``/``argmax``."""

    ids: torch.Tensor
    mask: torch.Tensor
    aux: torch.Tensor | None = None
    last: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    topk_values: torch.Tensor | None = None     # [T, K] fp32 teacher logits (features extracted with topk:K)
    topk_ids: torch.Tensor | None = None        # [T, K] int64 draft ids
    top1_in_draft: torch.Tensor | None = None   # [T] bool: the target's top-1 is in the draft vocabulary


def length_batches(lengths: list[int], tokens_per_batch: int, shuffle: bool, rng: random.Random) -> list[list[int]]:
    """Group sample indices by similar length so that B · T_max ≤ ``tokens_per_batch`` (a longer
    sample forms a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, lengths[i])
        if cur and m * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    if shuffle:
        rng.shuffle(batches)
    return batches


def _pad(seqs: list[torch.Tensor], value=0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=value)


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
            for j, i in enumerate(b):
                n = samples[i].ids.numel()
                s = samples[i]
                s.aux, s.last = aux[j, :n].to(store_device), last[j, :n].to(store_device)
                s.argmax = teacher_argmax(target, last[j, :n]).to(store_device)
                done_tokens += n
            bar.update(task, advance=len(b), tokens=done_tokens)


def make_batch(samples: list[Sample], idx: list[int], steps: int, device) -> dict:
    """Pad a batch and build per-step shifted tokens and masks.

    Returns dict with ``ids`` [B, T], ``aux`` [B, T, 3Ht], ``last`` [B, T, Ht], ``argmax`` [B, T],
    ``key_mask`` [B, T] and per step k ``tok[k]`` [B, T] (x_{t+k+1}, 0 past the end) and
    ``sup[k]`` [B, T] (input token is a completion token, DESIGN.md §4).
    """
    ss = [samples[i] for i in idx]
    ids = _pad([s.ids for s in ss]).to(device)
    mask = _pad([s.mask for s in ss], False).to(device)
    key_mask = _pad([torch.ones(s.ids.numel(), dtype=torch.bool) for s in ss], False).to(device)
    B, T = ids.shape
    tok, sup = [], []
    for k in range(steps):
        sh = k + 1
        t_k = torch.zeros_like(ids)
        m_k = torch.zeros_like(mask)
        if sh < T:
            t_k[:, : T - sh] = ids[:, sh:]
            m_k[:, : T - sh] = mask[:, sh:]
        tok.append(t_k)
        sup.append(m_k)
    out = {"ids": ids, "key_mask": key_mask, "tok": tok, "sup": sup,
           "positions": torch.arange(T, device=device)[None].expand(B, T)}
    if ss[0].aux is not None:
        out["aux"] = _pad([s.aux for s in ss]).to(device)
        if ss[0].topk_ids is not None:
            out["topk_values"] = _pad([s.topk_values for s in ss]).to(device)
            out["topk_ids"] = _pad([s.topk_ids for s in ss]).to(device)
            out["top1_in_draft"] = _pad([s.top1_in_draft for s in ss], False).to(device)
        else:
            out["last"] = _pad([s.last for s in ss]).to(device)
            out["argmax"] = _pad([s.argmax for s in ss]).to(device)
    return out


def shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t + k] at t (zero-filled past the end), for [B, T, ...] tensors."""
    out = torch.zeros_like(x)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


def ttt_loss(
    drafter: Eagle3Drafter, target: Target, batch: dict, draft_ids: torch.Tensor, steps: int, step_weight: float
) -> tuple[torch.Tensor, dict]:
    """The EAGLE-3 TTT loss on one batch (see module docstring).

    ``draft_ids``: int64 [Vd] target ids of the draft vocabulary. Returns (loss scalar, stats)
    where stats holds per step ``loss``, ``acc`` (top-1 agreement) and ``n`` (supervised positions).
    """
    embed = target.parts.embed
    embeds = [embed(t).to(drafter.fc.weight.dtype) for t in batch["tok"]]
    outs = drafter.ttt_forward(batch["aux"].to(drafter.fc.weight.dtype), embeds, batch["positions"], batch["key_mask"])
    in_draft = drafter.t2d
    total = outs[0].new_zeros(())
    stats = {"loss": [], "acc": [], "n": []}
    topk = "topk_ids" in batch
    for k in range(steps):
        nxt = k + 1
        if topk:
            sup = batch["sup"][k] & shift(batch["top1_in_draft"], nxt)
        else:
            sup = batch["sup"][k] & in_draft[shift(batch["argmax"], nxt)]
        n = int(sup.sum())
        if n == 0:
            stats["loss"].append(0.0), stats["acc"].append(0.0), stats["n"].append(0)
            continue
        if topk:        # the target's softmax over its K largest draft-vocab logits, 0 elsewhere
            vals = torch.softmax(shift(batch["topk_values"], nxt)[sup].float(), dim=-1)
            teacher = torch.zeros(n, draft_ids.numel(), device=vals.device).scatter_(1, shift(batch["topk_ids"], nxt)[sup], vals)
        else:
            teacher = torch.softmax(teacher_logits(target, shift(batch["last"], nxt)[sup], draft_ids), dim=-1)
        logq = torch.log_softmax(drafter.logits(outs[k][sup]).float(), dim=-1)
        ce = -(teacher * logq).sum() / n
        total = total + (step_weight ** k) * ce
        acc = (logq.argmax(-1) == teacher.argmax(-1)).float().mean()
        stats["loss"].append(float(ce.detach())), stats["acc"].append(float(acc)), stats["n"].append(n)
    return total, stats


def implied_tau(acc: list[float]) -> float:
    """1 + Σ_k Π_{j≤k} acc_j: the acceptance length per-step top-1 agreement implies (chain, greedy)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


@torch.no_grad()
def simulate_samples(drafter: Eagle3Drafter, target: Target, samples: list[Sample], k: int, device) -> AcceptanceStats:
    """Greedy-chain τ on samples whose completion is the target's greedy output (TTT unroll with
    the data tokens, DESIGN.md §7). Each sample's chain starts at its last prompt position."""
    stats = AcceptanceStats(k)
    drafter.eval()
    for s in samples:
        b = make_batch([s], [0], k, device)
        embeds = [target.parts.embed(t).to(drafter.fc.weight.dtype) for t in b["tok"]]
        outs = drafter.ttt_forward(b["aux"].to(drafter.fc.weight.dtype), embeds, b["positions"], b["key_mask"])
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


def init_from_drafter(drafter: Eagle3Drafter, folder: str | Path, target_cfg) -> dict:
    """Start ``drafter`` (freshly built for this run) from the weights of the drafter in ``folder``
    (any layout :func:`eagle3kit.importer.read_drafter` reads): every tensor is copied, except
    ``lm_head`` rows, which are matched by target token id (row of draft id i ↔ target id
    i + d2t[i]) so a source with another draft vocabulary still lends every token both share.

    Returns:
        ``{"init_from", "init_from_sha256", "lm_head_rows_copied", "lm_head_rows"}``.
    Raises:
        ConfigError: the source's widths, target vocabulary or aux layer ids differ from this run's
        (naming both values and the setting to change)."""
    from .importer import read_drafter

    src = read_drafter(folder, target=target_cfg).drafter
    a, b = src.config, drafter.config
    if list(a.aux_layer_ids) != list(b.aux_layer_ids):
        raise ConfigError(f"train.init_from {folder} reads aux layers {a.aux_layer_ids} but this run trains on "
                          f"{b.aux_layer_ids}; set target.aux_layer_ids: {a.aux_layer_ids}")
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "target_hidden_size", "vocab_size")
    bad = [f"{f} {getattr(a, f)} ≠ {getattr(b, f)}" for f in fields if getattr(a, f) != getattr(b, f)]
    if bad:
        raise ConfigError(f"train.init_from {folder} has another shape than this run's drafter: {'; '.join(bad)}")
    state = src.state_dict()
    own = drafter.state_dict()
    with torch.no_grad():
        for k, v in state.items():
            if k not in ("d2t", "t2d", "lm_head.weight"):
                own[k].copy_(v.to(own[k].dtype))
        row_of = torch.full((b.vocab_size,), -1, dtype=torch.int64)
        row_of[torch.arange(a.draft_vocab_size) + src.d2t.cpu()] = torch.arange(a.draft_vocab_size)
        j = row_of[torch.arange(b.draft_vocab_size) + drafter.d2t.cpu()]
        hit = j >= 0
        drafter.lm_head.weight[hit.to(drafter.lm_head.weight.device)] = \
            src.lm_head.weight[j[hit]].to(drafter.lm_head.weight.dtype).to(drafter.lm_head.weight.device)
    return {"init_from": str(folder), "init_from_sha256": sha256_state(state), "lm_head_rows_copied": int(hit.sum()),
            "lm_head_rows": b.draft_vocab_size}


def save_drafter_checkpoint(drafter: Eagle3Drafter, path: Path, meta: dict) -> None:
    """Drafter weights (+ d2t/t2d) as safetensors with the drafter config in the metadata."""
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(path), metadata={"drafter_config": json.dumps(drafter.config.to_dict()), **{k: str(v) for k, v in meta.items()}})


def load_drafter_checkpoint(path: Path, device="cpu") -> Eagle3Drafter:
    """Inverse of :func:`save_drafter_checkpoint` (strict: no missing or unexpected key)."""
    from safetensors import safe_open

    tensors = load_safetensors(path, "give a checkpoint written by `eagle3kit train` (checkpoints/*.safetensors)")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "drafter_config" not in meta:
        raise ConfigError(f"{path}: not an eagle3kit drafter checkpoint (no drafter_config metadata)")
    d = Eagle3Drafter(DrafterConfig(**json.loads(meta["drafter_config"])))
    missing, unexpected = d.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{path}: drafter checkpoint is incomplete or foreign (missing {missing[:4]}, unexpected {unexpected[:4]})")
    return d.to(device)


def checkpoint_provenance(path: Path) -> dict:
    """The provenance ``run_train`` stored in a checkpoint (target, tokenizer, vocab, aux ids)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("provenance", "{}"))


def _set_aside(ckpt: Path, log: Path) -> Path:
    """Move a previous run's checkpoints (and its log) to ``checkpoints.prev-N``; never delete them."""
    dest = set_aside(ckpt)
    if log.exists():
        log.rename(dest / log.name)
    ckpt.mkdir()
    return dest


def run_train(cfg: Config, run: RunDir, target: Target | None = None) -> dict:
    """Train the drafter; writes ``checkpoints/`` and ``train_log.jsonl``; returns the report section."""
    from .target import load_target

    tc = cfg.train
    device = pick_device(tc.device)
    shard = run.require("tokens.safetensors", "tokenize")
    vocab_path = run.require("vocab.safetensors", "vocab")
    vocab, vocab_meta = load_vocab(vocab_path, expected_size=cfg.vocab.draft_vocab_size)
    if target is None:
        target = load_target(cfg.target, device=device)
    if vocab.vocab_size != target.vocab_size:
        raise ConfigError(f"{vocab_path} was built for a vocabulary of {vocab.vocab_size}, the target has {target.vocab_size}")
    from safetensors import safe_open

    from .target import tokenizer_hash

    tok_hash = tokenizer_hash(target.tokenizer)
    for path, meta in ((vocab_path, vocab_meta), (shard, safe_open(str(shard), "pt").metadata() or {})):
        if meta.get("tokenizer_sha256") not in (None, tok_hash):
            raise ConfigError(f"{path} was built with another tokenizer than {cfg.target.model}'s; "
                              "rerun `eagle3kit tokenize` and `eagle3kit vocab` for this target")
    aux_ids = resolve_aux_layer_ids(cfg.target, target.num_layers)
    rows = load_shard(shard)
    all_samples = [Sample(ids, mask) for ids, mask in rows]
    tokens_sha, vocab_sha = sha256_tensors(shard), sha256_tensors(vocab_path)
    features = None
    if tc.features:         # extracted features: fill every sample now (the shards index all of them)
        from .extract import feature_inputs, load_features

        features = load_features(tc.features, all_samples, feature_inputs(tokens_sha, aux_ids, target, vocab_sha),
                                 target, device)
    samples = [s for s in all_samples if s.mask[1:].any()]
    if not samples:
        raise ConfigError(f"{shard} holds no supervised tokens; check the tokenize stage's report")
    rng = random.Random(tc.seed)
    order = list(range(len(samples)))
    rng.shuffle(order)
    n_val = max(1, round(len(samples) * tc.val_fraction)) if tc.val_fraction > 0 and len(samples) > 1 else 0
    val = [samples[i] for i in order[:n_val]]
    train = [samples[i] for i in order[n_val:]]
    ckpt = run / "checkpoints"
    ckpt.mkdir(exist_ok=True)
    inputs = {"tokens": tokens_sha, "vocab": vocab_sha, "aux_layer_ids": list(aux_ids),
              "train_config": sha256_json(tc.model_dump(mode="json")), "target": target.source.get("weights_fingerprint")}
    if features is not None:
        inputs["features"] = sha256_json(features)

    provenance = {"target": {"model": cfg.target.model, "weights_fingerprint": target.source.get("weights_fingerprint")},
                  "tokenizer_sha256": tok_hash, "draft_vocab_sha256": inputs["vocab"],
                  "aux_layer_ids": {"convention": "hf_output_hidden_states_index", "ids": list(aux_ids)}}
    drafter = build_drafter(target, vocab, aux_ids, tc.seed)
    init = init_from_drafter(drafter, tc.init_from, cfg.target) if tc.init_from else None
    if init:
        inputs["init_from"] = provenance["init_from"] = init["init_from_sha256"]
        fresh = init["lm_head_rows"] - init["lm_head_rows_copied"]
        console.print(f"train: starting from {tc.init_from} ({init['lm_head_rows_copied']} of {init['lm_head_rows']} "
                      "lm_head rows shared by target id" + (f"; {fresh} start fresh)" if fresh else ")"))
    drafter = drafter.to(device)
    draft_ids = vocab.ids.to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    batches_per_epoch = len(length_batches([s.ids.numel() for s in train], tc.tokens_per_step, False, rng))
    total_steps = batches_per_epoch * tc.epochs
    warmup = max(1, math.ceil(tc.warmup_ratio * total_steps))

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    start_epoch, history, best = 0, [], {"val_tau": -1.0, "epoch": -1}
    state_path = ckpt / "train_state.pt"
    if state_path.exists():
        st = torch.load(state_path, weights_only=True)
        if st.get("inputs") == inputs and (ckpt / "last.safetensors").exists():
            drafter.load_state_dict(load_file(str(ckpt / "last.safetensors")), strict=True)  # resume
            opt.load_state_dict(st["optimizer"])
            sched.load_state_dict(st["scheduler"])
            start_epoch, history, best = st["epoch"] + 1, json.loads(st["history"]), json.loads(st["best"])
            torch.set_rng_state(st["torch_rng"])  # batch order is seeded per epoch; the split is seeded once
            console.print(f"[green]train: resuming after epoch {st['epoch'] + 1} of {tc.epochs}")
        else:
            changed = sorted(k for k in set(inputs) | set(st.get("inputs", {})) if inputs.get(k) != st.get("inputs", {}).get(k))
            changed = changed or ["last.safetensors missing"]
            keep = _set_aside(ckpt, run / "train_log.jsonl")
            console.print(f"[yellow]train: checkpoints/ were made from other inputs (changed: {', '.join(changed)}); "
                          f"moved them to {keep} and starting fresh")
    if start_epoch >= tc.epochs:
        console.print("[green]train: all epochs already done")
    timer = Timer()
    cached = tc.feature_cache or features is not None
    if start_epoch < tc.epochs and tc.feature_cache and features is None:
        compute_features(target, samples, aux_ids, tc.tokens_per_step, device, device)
    log = open(run / "train_log.jsonl", "a")
    step = start_epoch * batches_per_epoch
    trained_tokens = 0
    last_stats: dict = {}
    for epoch in range(start_epoch, tc.epochs):
        drafter.train()
        batches = length_batches([s.ids.numel() for s in train], tc.tokens_per_step, True, random.Random(tc.seed + epoch))
        ep_loss, ep_acc0, ep_n, ep_tokens = 0.0, 0.0, 0, 0
        with progress() as bar:
            task = bar.add_task(f"train epoch {epoch + 1}/{tc.epochs}", total=len(batches), tokens=0, note="")
            for b in batches:
                if not cached:
                    compute_features(target, [train[i] for i in b], aux_ids, tc.tokens_per_step, device, device)
                batch = make_batch(train, b, tc.ttt_steps, device)
                loss, st = ttt_loss(drafter, target, batch, draft_ids, tc.ttt_steps, tc.step_weight)
                opt.zero_grad(set_to_none=True)
                if loss.requires_grad:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
                    opt.step()
                sched.step()
                step += 1
                ntok = int(batch["key_mask"].sum())
                trained_tokens += ntok
                ep_tokens += ntok
                if not cached:
                    for i in b:
                        train[i].aux = train[i].last = train[i].argmax = None
                rec = {"step": step, "epoch": epoch + 1, "loss": round(float(loss.detach()), 5), "lr": sched.get_last_lr()[0],
                       "acc": [round(a, 4) for a in st["acc"]], "n": st["n"], "implied_tau": round(implied_tau(st["acc"]), 4),
                       "tokens": ntok}
                log.write(json.dumps(rec) + "\n")
                if st["n"][0]:  # a batch with no supervised token adds nothing (no fake 0 in the mean)
                    ep_loss += float(loss.detach()) * st["n"][0]
                    ep_acc0 += st["acc"][0] * st["n"][0]
                    ep_n += st["n"][0]
                last_stats = rec
                bar.update(task, advance=1, tokens=ep_tokens,
                           note=f"batch: loss {float(loss.detach()):.2f} acc0 {st['acc'][0]:.2f}")
        log.flush()
        val_stats = simulate_samples(drafter, target, val, cfg.evaluate.k, device) if val else None
        epoch_rec = {"epoch": epoch + 1, "train_loss": round(ep_loss / max(ep_n, 1), 5),
                     "train_step0_accuracy": round(ep_acc0 / max(ep_n, 1), 4),
                     "val_tau": round(val_stats.tau, 4) if val_stats else None}
        history.append(epoch_rec)
        console.print(f"epoch {epoch + 1}: loss {epoch_rec['train_loss']:.4f}  step-0 acc {epoch_rec['train_step0_accuracy']:.3f}"
                      + (f"  val τ(K={cfg.evaluate.k}) {val_stats.tau:.3f}" if val_stats else ""))
        meta = {"epoch": epoch + 1, "provenance": json.dumps(provenance)}
        save_drafter_checkpoint(drafter, ckpt / "last.safetensors", meta)
        score = val_stats.tau if val_stats else -epoch_rec["train_loss"]
        if score > best["val_tau"]:
            best = {"val_tau": score, "epoch": epoch + 1}
            save_drafter_checkpoint(drafter, ckpt / "best.safetensors", meta)
        torch.save({"inputs": inputs, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "epoch": epoch,
                    "history": json.dumps(history), "best": json.dumps(best), "torch_rng": torch.get_rng_state()},
                   state_path)
    log.close()
    final = history[-1] if history else {}
    result = {
        "final_loss": final.get("train_loss"), "step0_accuracy": final.get("train_step0_accuracy"),
        "best_epoch": best["epoch"], "best_val_tau": round(best["val_tau"], 4) if val else None,
        "epochs": tc.epochs, "ttt_steps": tc.ttt_steps, "train_samples": len(train), "val_samples": len(val),
        "history": history, "last_step": last_stats,
    }
    if init:
        result.update({k: init[k] for k in ("init_from", "lm_head_rows_copied")})
    if trained_tokens:
        result["tokens_per_s"] = round(trained_tokens / timer.seconds, 1)
    run.record_stage("train", inputs, result, {"best.safetensors": sha256_tensors(ckpt / "best.safetensors")})
    run.update_manifest(aux_layer_ids={"convention": "hf_output_hidden_states_index", "ids": list(aux_ids)})
    return result
