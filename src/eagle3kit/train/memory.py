"""What a training process will hold on its device, estimated before the first step, and where the
target states go.

:func:`plan_memory` adds up, in bytes, what ``train`` keeps on the training device: the target's
weights (counted from the loaded model, exact), the drafter with its gradients and AdamW's two
moments (fp32: 16 bytes a parameter, divided over the processes under FSDP), the feature cache (every
training sample's aux states, post-norm last state, teacher top-1 and, for the LK losses, the
log-normaliser), the validation split's states, and the peak of one optimizer step at
``train.tokens_per_step`` tokens and the configured TTT steps (:func:`step_activation_bytes`), or of
one target forward when the target runs in the step (:func:`target_forward_bytes`). It then places the
feature cache and the validation states where they fit: on the device when they fit with room to
spare (:data:`SPARE`), else in pinned host memory, else nowhere (the target runs again for them: in
every step for the training samples, at every validation for the validation split). A plan whose
fixed part does not fit the device is refused, naming the key that changes the biggest part.

The activation formula counts the tensors autograd keeps for the backward pass of the drafter
layer's TTT unroll (:meth:`eagle3kit.model.drafter.Eagle3Drafter.ttt_forward`) and of the loss
(:mod:`eagle3kit.train.ttt`): per token and TTT step 30·H + 6·Q + 4·KV + 6·I bytes in bf16 autocast
(H the drafter's width, Q and KV the query and key/value widths, I the MLP's; the fp32 norm inputs
and residuals at 4 bytes, the matrix-product inputs at 2), step k's concatenated keys and values
(k + 1)·KV·4, under compilation in bf16 each TTT step's own bf16 copy of the q/k/v and MLP weights
(2 bytes a parameter a step: a compiled call saves the cast it multiplied by, where eager autocast
caches one), and per batch the teacher table (4 bytes × draft vocabulary per position), the fused
loss's fp32 ∂W per step (4·Vd·H) and one chunk's logits and gradient (6 bytes × chunk × Vd), or the
unchunked loss's 8 bytes × Vd per position and step. Checked against the peaks ``torch`` measured at
the 8B shape on an H200 (benchmarks/results/peers.json: 45.6, 46.2 and 71.5 GB for fused chunks of 4096,
8192 and the unchunked loss) and at SmolLM2's (2.8 GB), and against the recipes' own runs on an H100
(benchmarks/results/recipe_8b_shape.json: the whole plan within 1.5% of the peaks of the SmolLM2
recipe, the 8B shape and DeepSeek-V3's width).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch

from eagle3kit.core.config import ConfigError
from eagle3kit.core.ui import console
from eagle3kit.train.memory_device import GiB, capped_limit, host_available, resident_bytes

#: a cache or the validation states go on the device only when the plan then leaves this share free
SPARE = 0.10
#: what the device must keep free beyond the estimate: on CUDA the context, compile workspaces and the
#: estimate's own error (within 1.5% of the peaks of the recipes' runs on an H100, either side), this
#: share of the device and at least MARGIN_MIN bytes; on the CPU, MARGIN_SHARE_CPU of what the host offers
MARGIN_SHARE, MARGIN_MIN, MARGIN_SHARE_CPU = 0.08, 1 * GiB, 0.05
#: host memory the caches may take: this share of what the host has available
HOST_SHARE = 0.8
PLACES = ("device", "host", "off")
#: the drafter layer's projections inside its compiled pieces (qkv and finish; o_proj runs eager)
COMPILED_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@dataclass(frozen=True)
class DrafterShape:
    """The widths the activation estimate reads, from a drafter (on any device, ``meta`` included).

    hidden H, target_hidden Ht, n_aux aux layers, q_dim / kv_dim (heads × head dim), intermediate I,
    draft_vocab Vd, params (trainable parameters), compiled_weights (parameters of the q/k/v and MLP
    projections, which the compiled layer pieces read: :meth:`Eagle3Drafter.compile_layer`)."""

    hidden: int
    target_hidden: int
    n_aux: int
    q_dim: int
    kv_dim: int
    intermediate: int
    draft_vocab: int
    params: int
    compiled_weights: int = 0

    @classmethod
    def of(cls, drafter) -> "DrafterShape":
        """From an :class:`~eagle3kit.model.drafter.Eagle3Drafter` (its config and parameters)."""
        c = drafter.config
        layer = getattr(drafter, "midlayer", None)
        compiled = sum(
            p.numel()
            for n, p in (layer.named_parameters() if layer is not None else ())
            if n.rsplit(".", 1)[0] in COMPILED_PROJECTIONS
        )
        return cls(
            hidden=c.hidden_size,
            target_hidden=c.target_hidden_size,
            n_aux=drafter.num_aux,
            q_dim=c.num_attention_heads * c.head_dim,
            kv_dim=c.num_key_value_heads * c.head_dim,
            intermediate=c.intermediate_size,
            draft_vocab=c.draft_vocab_size,
            params=sum(p.numel() for p in drafter.parameters() if p.requires_grad),
            compiled_weights=compiled,
        )


@dataclass(frozen=True)
class StepSetup:
    """One optimizer step as ``train`` runs it: ``tokens`` padded tokens (``train.tokens_per_step``,
    or the longest sample when longer), ``longest`` sample, TTT ``steps``, ``loss_chunk`` (0:
    unchunked), ``fused`` (loss kl with a chunk: :class:`~eagle3kit.train.ttt.FusedDraftCE`),
    ``bf16`` autocast, ``compile`` (the layer compiled), ``attention`` (flex or reference)."""

    tokens: int
    longest: int
    steps: int
    loss_chunk: int
    fused: bool
    bf16: bool
    compile: bool
    attention: str


def state_bytes_per_token(n_aux: int, target_hidden: int, dtype_bytes: int, lse: bool) -> int:
    """Bytes of one token's cached target states: n_aux aux states and the post-norm last state in
    the target's dtype, the teacher's top-1 (int64) and, for the LK losses, its log-normaliser (fp32).
    Example: Llama-3.1-8B in bf16, 3 aux layers: 4 × 4096 × 2 + 8 = 32,776 bytes (32 KiB)."""
    return (n_aux + 1) * target_hidden * dtype_bytes + 8 + (4 if lse else 0)


def weight_copy_bytes(d: DrafterShape, s: StepSetup) -> int:
    """Bytes of the bf16 weight copies the TTT unroll keeps for its backward pass: compiled in bf16,
    each call of a compiled layer piece saves its own cast of the weights it multiplies (eager autocast
    caches one, counted in the eager factor), so TTT steps × 2 bytes × ``d.compiled_weights``; 0
    otherwise. Examples, TTT 7: 2.95 GiB at Llama-3.1-8B's width, 9.76 GiB at DeepSeek-V3's."""
    return s.steps * 2 * d.compiled_weights if s.compile and s.bf16 else 0


def step_activation_bytes(d: DrafterShape, s: StepSetup, state_bytes: int) -> dict[str, int]:
    """The peak one training step adds, by part (bytes; module docstring's formula).

    Returns ``{"layer": the TTT unroll's kept tensors, "loss": teacher table, ∂W and chunk (or the
    unchunked loss), "batch": the batch's target states and fc input}``."""
    a = 2 if s.bf16 else 4  # matrix-product inputs and outputs under autocast
    H, Q, KV, Im, Vd, T, S = d.hidden, d.q_dim, d.kv_dim, d.intermediate, d.draft_vocab, s.tokens, s.steps
    per_step = 20 * H + a * (5 * H) + a * (3 * Q + 2 * KV) + 3 * a * Im
    layer = T * (S * per_step + 2 * a * KV * S * (S + 1) // 2)
    if not s.compile:  # eager keeps the norms' and rotary's intermediates too (+18% measured at 8B)
        layer = layer * 118 // 100
    layer += weight_copy_bytes(d, s)
    if s.attention == "reference":  # dense scores and probabilities per step, fp32, [B, heads, T, T]
        heads = max(1, Q // 64)
        layer += S * T * s.longest * heads * 8
    table = T * (4 * Vd + 4)
    if s.loss_chunk and s.fused:
        loss = table + S * 4 * Vd * H + 6 * min(s.loss_chunk, T) * Vd
    elif s.loss_chunk:
        loss = table + 12 * min(s.loss_chunk, T) * Vd
    else:
        loss = table + 8 * T * Vd * S
    batch = T * (state_bytes + a * d.n_aux * d.target_hidden)
    return {"layer": layer, "loss": loss, "batch": batch}


def target_forward_bytes(config, tokens: int, dtype_bytes: int, n_aux: int) -> int:
    """The peak of one target forward over ``tokens`` tokens without gradients (the target in the
    step): one decoder layer's MLP and attention intermediates, the captured aux states and the
    full-vocabulary logits of a 1,024-position chunk (fp32, twice: the product and its top-1/normaliser).
    ``config``: the target's text config (``hidden_size``, ``intermediate_size``, ``vocab_size`` and,
    for a mixture of experts, ``moe_intermediate_size`` × ``num_experts_per_tok``)."""
    Ht = int(config.hidden_size)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * Ht)
    moe = int(getattr(config, "moe_intermediate_size", 0) or 0) * int(
        getattr(config, "num_experts_per_tok", 0) or 0
    )
    layer = tokens * dtype_bytes * (6 * Ht + 3 * max(inter, moe))
    return layer + tokens * (n_aux + 1) * Ht * dtype_bytes + 2 * 1024 * int(config.vocab_size) * 4


def drafter_state_bytes(params: int, world: int = 1, fsdp: bool = False) -> int:
    """fp32 weights, gradients and AdamW's two moments (16 bytes a parameter); FSDP shards them over
    ``world`` processes, DDP adds a gradient bucket copy (4 bytes a parameter)."""
    if fsdp:
        return -(-16 * params // max(world, 1))
    return 16 * params + (4 * params if world > 1 else 0)


@dataclass
class Row:
    """One line of the plan: ``part``, ``bytes``, ``where`` (device, host, off, or a device name),
    ``key``: the config key that changes it."""

    part: str
    bytes: int
    where: str
    key: str = ""


@dataclass
class MemoryPlan:
    """The plan :func:`plan_memory` made; ``cache`` and ``val`` say where the training samples' and
    the validation split's states live (device, host, off; ``servers`` when they come from capture
    servers); ``capacity`` what the device offers (None: unknown); ``peak`` the estimated peak on the
    device; ``fixed`` what the device holds whatever the placement (target, drafter state, the step)."""

    device: str
    capacity: int | None
    host: int | None
    rows: list[Row] = field(default_factory=list)
    cache: str = "device"
    val: str = "device"
    peak: int = 0
    fixed: int = 0
    margin: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The plan as the report stores it (bytes)."""
        return asdict(self)

    def lines(self) -> list[str]:
        """The plan as printed before training: one line per part, then the total against the device."""
        out = []
        where = {"device": self.device, "host": "host (pinned)", "off": "not kept (computed again)"}
        for r in self.rows:
            size = f"{r.bytes / GiB:7.2f} GiB"
            out.append(f"  {r.part:<44} {size:>12}  {where.get(r.where, r.where):<26} {r.key}")
        if self.capacity:
            cap = f"{(self.capacity - self.margin) / GiB:.2f} GiB usable ({self.capacity / GiB:.2f} less a margin)"
        else:
            cap = "a size not known here"
        out.append(f"  {'estimated peak on ' + self.device:<44} {self.peak / GiB:7.2f} GiB  of {cap}")
        return out + [f"  {n}" for n in self.notes]


def print_plan(plan: MemoryPlan) -> None:
    """The plan as ``train`` prints it before its first step."""
    console.print(
        f"train: memory plan for {plan.device} (estimated; where each part lives, and the key that changes it)"
    )
    for line in plan.lines():
        console.print(line, highlight=False, markup=False)


def _gib(b: int) -> str:
    return f"{b / GiB:.2f} GiB"


def _place(size: int, device_left: int, host_left: int | None) -> str:
    if size <= device_left:
        return "device"
    if host_left is not None and size <= host_left:
        return "host"
    return "off"


def plan_memory(
    *,
    device: str,
    capacity: int | None,
    host: int | None,
    target_bytes: int,
    drafter_state: int,
    step: dict[str, int],
    target_step: int,
    cache_bytes: int,
    val_bytes: int,
    want: str = "auto",
    can_recompute: bool = True,
    source: str | None = None,
    setup: StepSetup | None = None,
    estimated: bool = True,
) -> MemoryPlan:
    """Place the feature cache and the validation states, and check the plan fits.

    Args:
        device: the training device's name (``cuda:0``, ``cpu``); capacity: its bytes for this process
            (None: unchecked); host: host bytes the caches may take (None: the host is the device).
        target_bytes: the target's weights on this device. drafter_state: :func:`drafter_state_bytes`.
        step: :func:`step_activation_bytes`' parts. target_step: :func:`target_forward_bytes` when the
            target can run in the step (0: it cannot).
        cache_bytes / val_bytes: the training / validation samples' states.
        want: ``train.feature_cache`` (auto, device, host, off). can_recompute: the target is loaded
            here and can compute states again (false for extracted features and capture servers).
        source: ``stored`` (extracted features) or ``servers`` (capture servers) for the cache's origin.
        estimated: False where the drafter kind's step is not estimated (its row says so).
    Returns: the :class:`MemoryPlan`.
    Raises:
        ConfigError: the fixed part does not fit, a forced place that cannot hold the cache, or states
            that fit nowhere and cannot be computed again — each naming the key to change.
    """
    act = sum(step.values())
    cuda = device.startswith("cuda")
    margin = int((MARGIN_SHARE if cuda else MARGIN_SHARE_CPU) * capacity) if capacity else 0
    if capacity and cuda:
        margin = max(MARGIN_MIN, margin)
    usable = capacity - margin if capacity else None
    fixed = target_bytes + drafter_state + max(act, target_step)
    roomy = int(capacity * (1 - SPARE)) - fixed if capacity else None
    host_left = int(host * HOST_SHARE) if host is not None else None
    plan = MemoryPlan(device=device, capacity=capacity, host=host, fixed=fixed, margin=margin)

    def refuse(what: str, fix: str, room: bool = True) -> None:
        has = f", and {device} has {_gib(capacity or 0)} for this process (the plan below keeps {_gib(margin)} free)"
        raise ConfigError(f"train: {what}{has if room else ''}: {fix}\n" + "\n".join(plan.lines()))

    if source == "servers":  # streamed: no cache; the validation states are fetched once and kept
        plan.cache = "servers"
        cache_bytes = 0
    left = roomy if roomy is not None else (usable - fixed if usable is not None else 1 << 62)
    _placements(plan, want, cache_bytes, val_bytes, left, host_left, can_recompute)
    _rows(plan, target_bytes, drafter_state, step, target_step, cache_bytes, val_bytes, source, setup)
    if not estimated:
        for r in plan.rows:
            r.part = (
                "step: not estimated for this drafter kind" if r.part.startswith("step: drafter") else r.part
            )
    _check(plan, want, cache_bytes, val_bytes, host_left, can_recompute, source, refuse, usable)
    _fits(
        plan,
        want,
        cache_bytes,
        val_bytes,
        usable,
        refuse,
        lambda: _fix(step, target_bytes, drafter_state, setup, cuda),
    )
    return plan


def _check(plan, want, cache_bytes, val_bytes, host_left, can_recompute, source, refuse, usable) -> None:
    """Refuse a forced place that cannot be: ``off`` where nothing computes the states again, ``host``
    beyond the host's share, states that fit nowhere and cannot be computed again (when the rest fits:
    else the peak's refusal names the cause)."""
    if not can_recompute and want == "off":
        refuse(
            "train.feature_cache: off asks for the states to be computed again in every step, which "
            + (
                "states from stored features or capture servers cannot be"
                if source
                else "this drafter kind's trainer does not do"
            ),
            "set train.feature_cache: auto, device or host",
            room=False,
        )
    on_host = (cache_bytes if plan.cache == "host" else 0) + (val_bytes if plan.val == "host" else 0)
    if host_left is not None and on_host > host_left:
        refuse(
            f"train.feature_cache: {want} puts {_gib(on_host)} of target states in host memory, which has "
            f"{_gib(host_left)} for them",
            "set train.feature_cache: auto (it places them where they fit) or off",
            room=False,
        )
    if not can_recompute and "off" in (plan.cache, plan.val) and (usable is None or plan.fixed <= usable):
        what = (
            "the validation states"
            if plan.cache != "off"
            else f"the {source or ''} states".replace("  ", " ")
        )
        refuse(
            f"{what} ({_gib(cache_bytes + val_bytes)}) fit neither the device nor the host",
            "train with the target in the step (no train.features, no train.online_from), lower "
            "train.val_fraction, or give the run more memory",
        )


def _fits(plan, want, cache_bytes, val_bytes, usable, refuse, fix) -> None:
    """Refuse a plan whose peak exceeds what is usable: for a forced cache place that is what breaks it,
    else ``fix()`` names the keys that shrink the biggest parts."""
    if usable is not None and plan.peak > usable:
        if want in ("device", "host") and plan.peak - _on_device(plan, cache_bytes, val_bytes) <= usable:
            refuse(
                f"train.feature_cache: {want} puts {_gib(cache_bytes + val_bytes)} of target states where they "
                "do not fit",
                "set train.feature_cache: auto (it places them where they fit) or off",
            )
        refuse(
            f"the plan needs {_gib(plan.peak)} at its peak",
            fix(),
        )


def _placements(
    plan, want: str, cache_bytes: int, val_bytes: int, left: int, host_left, can_recompute
) -> None:
    """Set ``plan.cache`` and ``plan.val``: ``want`` when forced, else each where it fits (the cache
    first, then the validation states in what is left); on a CPU (no ``host_left``) host is the device."""
    if want == "auto":
        room = f"{max(left, 0) / GiB:.2f} GiB"
        host = f"{host_left / GiB:.2f} GiB" if host_left is not None else None
        if plan.cache != "servers":
            plan.cache = _place(cache_bytes, left, host_left)
        if plan.cache == "device":
            left -= cache_bytes
        elif plan.cache == "host" and host_left is not None:
            host_left -= cache_bytes
        plan.val = _place(val_bytes, left, host_left)
        if (
            "device" not in (plan.cache, plan.val)
            or plan.cache in ("host", "off")
            or plan.val in ("host", "off")
        ):
            plan.notes.append(
                f"(train.feature_cache: auto: the device has {room} left with 10% of it to spare"
                + (f", the host {host} for states" if host else "")
                + "; what does not fit there is kept in host memory, else computed again)"
            )
        return
    if plan.cache != "servers":
        plan.cache = want
    plan.val = want if want != "off" or can_recompute else "device"
    if want == "host" and host_left is None:
        plan.cache = plan.val = "device"  # the host is the device here


def _on_device(plan: MemoryPlan, cache_bytes: int, val_bytes: int) -> int:
    return (cache_bytes if plan.cache == "device" else 0) + (val_bytes if plan.val == "device" else 0)


def _rows(plan, target_bytes, drafter_state, step, target_step, cache_bytes, val_bytes, source, setup):
    """Fill ``plan.rows`` and ``plan.peak`` (what the device holds at the step's peak)."""
    S = setup
    act_key = "train.tokens_per_step, train.ttt_steps" + (
        ", train.loss_chunk" if S is not None and not S.loss_chunk else ""
    )
    cuda = plan.device.startswith("cuda")
    plan.rows = [
        Row(
            "target weights",
            target_bytes,
            plan.device,
            "target.device_map, train.online_from" if cuda else "target.dtype",
        ),
        Row(
            "drafter, gradients, AdamW state (fp32)",
            drafter_state,
            plan.device,
            "train.parallel: fsdp" if cuda else "",
        ),
    ]
    origin = {"stored": " (from train.features)", "servers": " (streamed from the servers)"}.get(
        source or "", ""
    )
    if plan.cache != "servers":
        plan.rows.append(Row(f"feature cache{origin}", cache_bytes, plan.cache, "train.feature_cache"))
    plan.rows.append(Row("validation states", val_bytes, plan.val, "train.val_fraction"))
    label = f"at {S.tokens} tokens, TTT {S.steps}" if S is not None else ""
    plan.rows += [
        Row(f"step: drafter layer {label}", step["layer"], plan.device, act_key),
        Row("step: loss (teacher table, ∂W, chunk)", step["loss"], plan.device, "train.loss_chunk"),
        Row("step: batch states", step["batch"], plan.device, "train.tokens_per_step"),
    ]
    if target_step and plan.cache == "off":
        plan.rows.append(Row("target forward in the step (transient)", target_step, plan.device, act_key))
    act = sum(step.values())
    moment = max(act, target_step if plan.cache == "off" else 0)
    plan.peak = target_bytes + drafter_state + _on_device(plan, cache_bytes, val_bytes) + moment


def _fix(
    step: dict, target_bytes: int, drafter_state: int, setup: StepSetup | None, cuda: bool = True
) -> str:
    """The keys that shrink the plan, biggest part first (on the CPU only what applies there)."""
    parts = [
        (
            sum(step.values()),
            "lower train.tokens_per_step or train.ttt_steps (the step's activations scale with both)"
            + ("" if setup is None or setup.loss_chunk else ", or set train.loss_chunk: 4096"),
        ),
        (
            target_bytes,
            "shard the target with target.device_map: auto, or train from capture servers "
            "(train.online_from) or extracted features (train.features)"
            if cuda
            else "load the target in half the bytes (target.dtype: bfloat16), or train from extracted "
            "features (train.features)",
        ),
        (drafter_state, "under torchrun, shard the drafter with train.parallel: fsdp"),
    ]
    if not cuda:  # a CPU: no GPUs to shard over; the memory limit is the last thing left to change
        parts = parts[:2] + [(-1, "or raise train.memory_limit_gib if the host has more")]
    return "; ".join(f for _, f in sorted(parts, key=lambda p: -p[0]))


def training_plan(
    tc,
    speed: dict,
    target,
    params: int,
    n_aux: int,
    shape: DrafterShape | None,
    train: list,
    val: list,
    device: torch.device,
    world_size: int = 1,
    source: str | None = None,
) -> MemoryPlan:
    """:func:`plan_memory` for one training process, from what the trainer holds.

    Args:
        tc: the ``train`` config section (``tokens_per_step``, ``ttt_steps``, ``loss``, ``parallel``,
            ``feature_cache``, ``memory_limit_gib``). speed: the resolved ``attention``, ``bf16``,
            ``loss_chunk``, ``compile``. target: the loaded :class:`~eagle3kit.model.target.Target`
            (its weights counted per device). params: the drafter's trainable parameters. n_aux: the
            target layers whose states are cached (besides the last). shape: the drafter's widths, whose
            step is estimated (:func:`step_activation_bytes`); None: not estimated (its row says so),
            and the states are never computed again in the step. train / val: this process's samples
            (``ids`` int64 [T]).
        source: None (the target is loaded here and computes the states), ``stored`` or ``servers``.
    Returns: the plan; the caller prints :meth:`MemoryPlan.lines`."""
    dtype_bytes = target.dtype.itemsize
    state = state_bytes_per_token(n_aux, target.hidden_size, dtype_bytes, tc.loss != "kl")
    lengths = [s.ids.numel() for s in [*train, *val]] or [1]
    # a batch pads to its longest sample and holds at most tokens_per_step (a longer sample alone), and
    # never more than the training samples padded to the longest
    per_step = min(max(tc.tokens_per_step, max(lengths)), max(1, len(train)) * max(lengths))
    setup = StepSetup(
        tokens=per_step,
        longest=max(lengths),
        steps=tc.ttt_steps,
        loss_chunk=speed["loss_chunk"],
        fused=tc.loss == "kl" and tc.parallel != "fsdp",  # FSDP2's sharded lm_head: checkpointed chunks
        bf16=speed["bf16"],
        compile=speed["compile"],
        attention=speed["attention"],
    )
    step = (
        step_activation_bytes(shape, setup, state)
        if shape is not None
        else {"layer": 0, "loss": 0, "batch": setup.tokens * state}
    )
    if (
        device.type == "cuda" and device.index is None
    ):  # "cuda" is the current device, named as tensors name it
        device = torch.device("cuda", torch.cuda.current_device())
    held = resident_bytes(target.model, device)
    here = held.pop(str(device), 0)
    capacity, capped = capped_limit(tc.memory_limit_gib, device, here)
    host = host_available() if device.type == "cuda" else None
    if host is not None:  # the processes of a node share its host memory: each plans with its share
        host //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    plan = plan_memory(
        device=str(device),
        capacity=capacity,
        host=host,
        target_bytes=here,
        drafter_state=drafter_state_bytes(params, world_size, tc.parallel == "fsdp"),
        step=step,
        target_step=target_forward_bytes(target.config, setup.tokens, dtype_bytes, n_aux)
        if source is None
        else 0,
        cache_bytes=sum(s.ids.numel() for s in train) * state,
        val_bytes=sum(s.ids.numel() for s in val) * state,
        want=tc.feature_cache,
        can_recompute=source is None and shape is not None,
        source=source,
        setup=setup,
        estimated=shape is not None,
    )
    plan.rows[1:1] = [Row(f"target weights on {d}", b, d, "target.device_map") for d, b in held.items()]
    if capped:
        plan.notes.append(capped)
    return plan
