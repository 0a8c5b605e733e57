"""The EAGLE-3 family's training step: its drafter built for the target, the TTT loss of one micro-batch
(:func:`chain_loss`; :func:`train_step` for one process's whole step), and the fast-path settings it runs with
(:func:`resolve_speed`)."""

from __future__ import annotations

import contextlib

import torch

from eagle3kit.core.config import ConfigError
from eagle3kit.model.draft_vocab import DraftVocab
from eagle3kit.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3kit.model.target import Target
from eagle3kit.train.memory_device import LOSS_CHUNK, UNCHUNKED_LOSS_BYTES, unchunked_loss_fits
from eagle3kit.train.samples import mask_token
from eagle3kit.train.ttt import ttt_loss


@contextlib.contextmanager
def tf32_matmuls(on: bool):
    """fp32 matrix products (and convolutions) on TF32 tensor cores inside the block when ``on``
    (10-bit mantissa operands, fp32 accumulation, relative error near 3e-4 — NVIDIA's A100
    whitepaper, "TF32"), set through PyTorch's ``fp32_precision`` settings (the API PyTorch ≥ 2.9
    asks for; mixing it with the legacy ``allow_tf32`` flags raises); the exact previous values
    are restored after, so a process-wide setting outlives the block."""
    if not on:
        yield
        return
    knobs = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)
    old = [k.fp32_precision for k in knobs]
    for k in knobs:
        k.fp32_precision = "tf32"
    try:
        yield
    finally:
        for k, v in zip(knobs, old):
            k.fp32_precision = v


# positions per chunk of the fused forward-KL loss (``loss_chunk: auto`` with ``loss: kl`` on CUDA):
# the fastest of 0 / 4096 / 8192 on the H200 at the 8B shape (benchmarks/results/peers.json)
FUSED_LOSS_CHUNK = 8192


def unchunked_loss_bytes(tokens_per_step: int, draft_vocab: int, ttt_steps: int) -> int:
    """Bytes the unchunked draft-vocabulary loss keeps for the backward pass at most (every
    position of a ``tokens_per_step`` batch supervised): 8 · tokens · Vd · TTT steps."""
    return UNCHUNKED_LOSS_BYTES * tokens_per_step * draft_vocab * ttt_steps


def resolve_speed(tc, device: torch.device, draft_vocab: int | None = None) -> dict:
    """The fast-path settings for ``device``: flex attention, bf16 autocast and the drafter layer
    compiled on CUDA, the readable reference (dense attention, fp32) elsewhere. ``loss_chunk``
    unset, on CUDA: for ``loss: kl`` :data:`FUSED_LOSS_CHUNK` (the fused lm_head + loss of
    :class:`~eagle3kit.train.ttt.FusedDraftCE`, its element-wise work one compiled kernel); for the
    LK objectives 0 (unchunked) unless that loss (:func:`unchunked_loss_bytes`, ``draft_vocab``
    entries) would take more than a quarter of the device's memory (or ``draft_vocab`` is not
    given), then 4096-position checkpointed chunks. Elsewhere 0. Measured on the H200 at the 8B
    shape, compiled (benchmarks/results/peers.json): fused chunks of 8192 28,982 tokens/s, of 4096
    28,583, unchunked 27,070.

    Raises:
        ConfigError: ``attention: flex`` or ``precision: tf32`` off CUDA."""
    cuda = device.type == "cuda"
    if tc.attention == "flex" and not cuda:
        raise ConfigError(
            f"train.attention: flex needs a CUDA device (flex attention has no backward pass on "
            f"{device.type}); use attention: auto or reference here"
        )
    if tc.precision == "tf32" and not cuda:
        raise ConfigError(
            f"train.precision: tf32 needs a CUDA device (TF32 is a tensor-core mode; {device.type} has "
            "none); use precision: fp32 or auto here"
        )
    fsdp = tc.parallel == "fsdp"  # FSDP2 shards the layer and the lm_head: neither compiled nor fused
    chunk = tc.loss_chunk
    if chunk is None:
        chunk = 0
        if cuda and tc.loss == "kl" and not fsdp:
            chunk = FUSED_LOSS_CHUNK
        elif cuda:
            fits = draft_vocab is not None and unchunked_loss_fits(
                unchunked_loss_bytes(tc.tokens_per_step, draft_vocab, tc.ttt_steps), device
            )
            chunk = 0 if fits else LOSS_CHUNK
    return {
        "attention": tc.attention if tc.attention != "auto" else ("flex" if cuda else "reference"),
        "bf16": tc.precision == "bf16" or (tc.precision == "auto" and cuda),
        "tf32": tc.precision == "tf32",
        "loss_chunk": chunk,
        "compile": tc.compile if tc.compile is not None else (cuda and not fsdp),
    }


def build_drafter(
    target: Target, vocab: DraftVocab, aux_ids, seed: int, variant=None, samples: list | None = None
) -> Eagle3Drafter:
    """A freshly initialised drafter shaped after the target (seeded); ``variant``: the run's
    ``drafter`` section (:class:`~eagle3kit.core.config.DrafterVariantConfig`, None: EAGLE-3);
    ``samples``: the training data, from which a P-EAGLE drafter's mask token is picked
    (:func:`mask_token`)."""
    torch.manual_seed(seed)
    unused = None
    if variant is not None and variant.parallel_drafting and samples:
        unused = mask_token(
            samples, target.tokenizer, target.vocab_size, variant.mask_token_id, target.end_of_turn_ids()
        )
    flags = variant.flags(target.tokenizer, target.vocab_size, unused) if variant is not None else {}
    dcfg = DrafterConfig.from_target(
        target.config, vocab.size, aux_ids, vocab_size=target.vocab_size, **flags
    )
    d = Eagle3Drafter(dcfg)
    d.set_vocab(vocab)
    return d


def chain_loss(model, target: Target, batch: dict, draft_ids: torch.Tensor, tc, speed: dict):
    """The TTT loss (:func:`eagle3kit.train.ttt.ttt_loss`) of one micro-batch, forward only, under bf16
    autocast when ``speed["bf16"]`` (fp32 matmuls on TF32 tensor cores when ``speed["tf32"]``; the
    training loop runs the backward under the same setting).

    Args:
        model: the drafter, or the drafter in DistributedDataParallel.
        tc: the ``train`` config section (``ttt_steps``, ``step_weight``, ``loss`` and its
            ``lk_kl_scale``/``lk_kl_decay``).
        speed: ``{"attention", "bf16", "tf32", "loss_chunk"}`` (see :func:`resolve_speed`).
    Returns:
        (loss scalar, per-step stats of :func:`eagle3kit.train.ttt.ttt_loss` plus ``tokens``, the
        micro-batch's real tokens).
    """
    with (
        tf32_matmuls(speed.get("tf32", False)),
        torch.autocast(batch["ids"].device.type, dtype=torch.bfloat16, enabled=speed["bf16"]),
    ):
        loss, st = ttt_loss(
            model,
            target,
            batch,
            draft_ids,
            tc.ttt_steps,
            tc.step_weight,
            attention=speed["attention"],
            loss_chunk=speed["loss_chunk"],
            loss=tc.loss,
            lk_kl_scale=tc.lk_kl_scale,
            lk_kl_decay=tc.lk_kl_decay,
        )
    st["tokens"] = int(batch["key_mask"].sum())
    return loss, st


def train_step(model, opt, target: Target, batch: dict, draft_ids: torch.Tensor, tc, speed: dict):
    """One optimizer step of one process on one batch (what the benchmarks time): :func:`chain_loss`,
    backward, gradient clipping to ``tc.grad_clip``, AdamW when a position was supervised. ``train``
    itself steps through :func:`eagle3kit.train.optimizer_step.optimizer_step` (micro-batches,
    processes). Returns :func:`chain_loss`'s (loss, stats)."""
    drafter = getattr(model, "module", model)
    loss, st = chain_loss(model, target, batch, draft_ids, tc, speed)
    opt.zero_grad(set_to_none=True)
    with tf32_matmuls(speed.get("tf32", False)):
        loss.backward()
    if sum(st["n"]) > 0:
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
        opt.step()
    return loss, st
