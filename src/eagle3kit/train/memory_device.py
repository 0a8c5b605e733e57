"""What a device offers a training process and what the process already holds there: the inputs of
the memory plan (:mod:`eagle3kit.train.memory`) that are measured, not estimated."""

from __future__ import annotations

import torch

GiB = 1 << 30
# Bytes an unchunked draft loss keeps for the backward pass per logit: the fp32 log-softmax and the fp32
# teacher rows (the product's saved inputs); measured on the H200 at the 8B shape (benchmarks/peers.py:
# 16,384 positions, Vd 32,000, TTT 7)
UNCHUNKED_LOSS_BYTES = 8
# the share of the GPU's memory an unchunked loss may take before ``loss_chunk: auto`` chunks it, and the
# rows of a checkpointed chunk then
UNCHUNKED_LOSS_SHARE, LOSS_CHUNK = 0.25, 4096


def unchunked_loss_fits(need: int, device: torch.device) -> bool:
    """Whether an unchunked loss keeping ``need`` bytes for the backward pass (:data:`UNCHUNKED_LOSS_BYTES`
    a logit) fits :data:`UNCHUNKED_LOSS_SHARE` of the CUDA ``device``'s memory: the rule ``loss_chunk:
    auto`` follows for every drafter kind."""
    return need <= UNCHUNKED_LOSS_SHARE * torch.cuda.get_device_properties(device).total_memory


def resident_bytes(model, device: torch.device) -> dict[str, int]:
    """Bytes of ``model``'s parameters and buffers per device name (tied tensors once, ``meta`` ones
    not at all): the target's weights as loaded, on the training device and on the others a
    ``device_map`` spread it over."""
    seen, out = set(), {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
    return out


def host_available() -> int | None:
    """Bytes the host can still give (``MemAvailable`` of /proc/meminfo), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_capacity(device: torch.device, counted: int = 0) -> int | None:
    """Bytes this process may still plan with on a CUDA ``device``: what is free, what its allocator
    holds unused, and ``counted`` (tensors already allocated that the plan counts itself: the loaded
    target). Another process's share of the GPU (a capture server's) and this process's other live
    tensors are not counted. None elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) + counted


def memory_limit(limit_gib: float | None, device: torch.device, resident: int = 0) -> int | None:
    """The bytes a training process may use on ``device``: ``train.memory_limit_gib`` when set, else
    what a CUDA device offers (:func:`device_capacity`), else (the CPU, whose memory is the host's)
    what the host has available; both plus ``resident``, the bytes this process already holds there
    that the plan counts (the loaded target). None where unknown."""
    if limit_gib is not None:
        return int(limit_gib * GiB)
    if device.type == "cuda":
        return device_capacity(device, resident)
    avail = host_available()
    return None if avail is None else avail + resident


def capped_limit(limit_gib: float | None, device: torch.device, resident: int = 0) -> tuple[int | None, str]:
    """:func:`memory_limit`, never above what the device offers: ``train.memory_limit_gib`` caps the plan
    below the device, a larger one is planned with what the device offers. Returns (bytes or None, a
    note for the plan when the limit was lowered, else "")."""
    capacity = memory_limit(limit_gib, device, resident)
    if limit_gib is None or capacity is None:
        return capacity, ""
    offered = memory_limit(None, device, resident)
    if offered is None or capacity <= offered:
        return capacity, ""
    return offered, (
        f"train.memory_limit_gib {limit_gib:g} is more than {device} offers ({offered / GiB:.2f} GiB): planned "
        "with what it offers"
    )
