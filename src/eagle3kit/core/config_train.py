"""The training sections of the run configuration: the drafter kind and variant (drafter:, with the keys
its kind adds) and how it is trained (train:); validated like the rest of :mod:`eagle3kit.core.config`."""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from eagle3kit.core.config_base import ConfigError, StrictSection
from eagle3kit.core.kinds import kind_settings, variants_reading

VARIANT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "parallel_drafting")
VARIANTS = {  # drafter.variant → its flags (docs/training.md, drafter variants; model/drafter.py's table)
    "eagle3": {},
    "eagle3.1": {"fc_norm": True, "norm_output": True},  # the EAGLE-3.1 paper's per-layer norms
    "p-eagle": {"parallel_drafting": True},
}


def variant_name(flags: dict) -> str:
    """A drafter's variant as a person names it (``eagle3``, ``eagle3.1``, ``p-eagle``), from the
    flags that are on; flags no preset has are listed after ``EAGLE-3 +``."""
    on = {k: v for k, v in flags.items() if v and k != "mask_token_id"}
    for name, preset in VARIANTS.items():
        if on == {k: v for k, v in preset.items() if v}:
            return name
    return "EAGLE-3 + " + ", ".join(sorted(on))


#: the drafter a config without a ``drafter`` section trains (docs/training.md, "Which drafter by default")
DEFAULT_VARIANT = "eagle3.1"


class DrafterVariantConfig(StrictSection):
    """Which drafter is trained. ``variant`` names the drafter kind's preset: the EAGLE-3 family's
    flags (of :mod:`eagle3kit.model.drafter`, exported under the names vLLM reads) are this section's
    own keys; ``variant`` names a preset (:data:`VARIANTS`); flags written out add to it, and one that
    turns a flag of the preset off, or any flag beside ``eagle3``, is refused. Another kind's keys
    (its ``settings`` module, :func:`eagle3kit.core.kinds.kind_settings`) are checked by that kind and
    read as attributes of this section (``cfg.drafter.<key>``); :attr:`settings` holds them."""

    model_config = ConfigDict(extra="allow")

    variant: str | None = Field(
        default=None,
        description="the drafter kind and preset: eagle3 (2025's drafter), eagle3.1 (fc_norm + norm_output), "
        "p-eagle (parallel_drafting) of the EAGLE-3 family, whose flags written out add to it (turning one of "
        "its own off is refused); or another kind eagle3kit trains, whose own keys follow (the drafter "
        "kinds below). A config without a drafter section trains eagle3.1; a section that names no variant, plain "
        "eagle3 with the flags it writes",
    )
    _settings: Any = PrivateAttr(default=None)

    norm_before_residual: StrictBool = Field(
        default=False,
        description="the decoder layer's residual is hidden_norm(feature) (speculators' default)",
    )
    norm_before_fc: StrictBool = Field(
        default=False,
        description="one RMSNorm over the concatenated aux states before fc (EAGLE-3.1, gpt-oss)",
    )
    fc_norm: StrictBool = Field(
        default=False, description="one RMSNorm per aux state before fc (EAGLE-3.1 paper)"
    )
    norm_output: StrictBool = Field(
        default=False, description="feed the post-norm output back to the next draft step (EAGLE-3.1)"
    )
    parallel_drafting: StrictBool = Field(
        default=False,
        description="P-EAGLE: all K drafts from one forward over K−1 mask slots; serve with "
        '"parallel_drafting": true in vLLM\'s speculative config',
    )
    mask_token_id: StrictInt | None = Field(
        default=None,
        ge=0,
        description="P-EAGLE's and a block drafter's: the mask slots' input token (default: the tokenizer's first "
        "reserved token the training data never uses, not its end, begin, padding or unknown token; one that "
        "occurs is refused)",
    )

    @property
    def settings(self):
        """The kind's own keys, validated (its ``SETTINGS`` model), or None for the EAGLE-3 family."""
        return self._settings

    @model_validator(mode="after")
    def _preset(self):
        mod = kind_settings(self.variant)  # KindError is a ValueError: pydantic reports it under drafter
        extra = dict(self.__pydantic_extra__ or {})
        if mod.SETTINGS is not None:
            flags = [k for k in VARIANT_FLAGS if k in self.model_fields_set and getattr(self, k)]
            if flags:
                raise ValueError(
                    f"drafter.variant {self.variant} is its own network; {', '.join(flags)} "
                    f"{'is an EAGLE-3 flag' if len(flags) == 1 else 'are EAGLE-3 flags'}: drop "
                    f"{'it' if len(flags) == 1 else 'them'}"
                )
            try:
                self._settings = mod.SETTINGS.model_validate(extra)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(x) for x in err["loc"])
                msg = err["msg"].removeprefix("Value error, ")
                near = difflib.get_close_matches(where, list(mod.SETTINGS.model_fields), 1)
                if err["type"] == "extra_forbidden" and near:
                    msg += f"; did you mean drafter.{near[0]}?"
                raise ValueError(f"drafter.{where}: {msg} (got {err.get('input')!r})") from None
            self.__pydantic_extra__ = self._settings.model_dump()
            return self
        if extra:
            key = next(iter(extra))
            readers = variants_reading(key)
            if readers:
                raise ValueError(f"drafter.{key} is read only with drafter.variant: {' or '.join(readers)}")
            near = difflib.get_close_matches(key, list(type(self).model_fields), 1)
            hint = f"; did you mean drafter.{near[0]}?" if near else ""
            raise ValueError(f"drafter.{key}: an unknown key (Extra inputs are not permitted){hint}")
        preset = VARIANTS.get(self.variant or "eagle3", {})
        off = [k for k, v in preset.items() if k in self.model_fields_set and getattr(self, k) != v]
        if off:
            raise ValueError(
                f"drafter.variant {self.variant} sets {', '.join(off)}: true; writing it false contradicts the "
                "preset (drop drafter.variant and write the flags you want)"
            )
        on = [k for k in VARIANT_FLAGS if k in self.model_fields_set and getattr(self, k)]
        if self.variant == "eagle3" and on:
            raise ValueError(
                f"drafter.variant eagle3 is the plain drafter, and {', '.join(on)} make another; drop one of them"
            )
        for k, v in preset.items():
            setattr(self, k, v)
        by = f" (drafter.variant {self.variant} sets {{}})" if self.variant else ""
        if self.norm_before_fc and self.fc_norm:
            raise ValueError(
                "drafter.norm_before_fc and drafter.fc_norm are exclusive: keep one"
                + (by.format("fc_norm") if "fc_norm" in preset else "")
            )
        if self.parallel_drafting and self.norm_output:
            raise ValueError(
                "drafter.norm_output has no effect with drafter.parallel_drafting (a P-EAGLE drafter feeds no "
                "output back): keep one"
                + (
                    by.format(", ".join(k for k in ("norm_output", "parallel_drafting") if k in preset))
                    if preset
                    else ""
                )
            )
        if self.mask_token_id is not None and not self.parallel_drafting:
            raise ValueError("drafter.mask_token_id is read only with drafter.parallel_drafting: true")
        return self

    def flags(self, tokenizer=None, vocab_size: int | None = None, unused_id: int | None = None) -> dict:
        """The :class:`~eagle3kit.model.drafter.DrafterConfig` keyword arguments, with the mask
        token resolved when parallel drafting leaves it unset: ``unused_id`` (what train picks: an id
        that never occurs in the training data and is no special token), else the tokenizer's mask,
        pad or unk token, else 0.

        Raises:
            ConfigError: a ``mask_token_id`` outside the target's vocabulary (``vocab_size``)."""
        out = self.model_dump(exclude={"variant", "mask_token_id", *(self.__pydantic_extra__ or {})})
        if self.parallel_drafting:
            mid = self.mask_token_id
            if mid is None and unused_id is not None:
                mid = unused_id
            if mid is None:
                ids = [getattr(tokenizer, a, None) for a in ("mask_token_id", "pad_token_id", "unk_token_id")]
                mid = next((int(i) for i in ids if isinstance(i, int)), 0)
            if vocab_size is not None and not 0 <= mid < vocab_size:
                raise ConfigError(
                    f"drafter.mask_token_id {mid} lies outside the target's vocabulary of {vocab_size}"
                )
            out["mask_token_id"] = mid
        return out


class TrainConfig(StrictSection):
    ttt_steps: int = Field(default=3, ge=1)
    step_weight: float = Field(
        default=0.8, gt=0.0, le=1.0, description="loss weight of TTT step k is step_weight**k"
    )
    epochs: int = Field(default=20, ge=1)
    patience: int | None = Field(
        default=None,
        ge=1,
        description="stop once validation τ has not beaten its best for this many epochs in a row (the "
        "best checkpoint is what export reads); unset: every epoch runs. Needs val_fraction > 0",
    )
    lr: float = Field(default=3e-4, gt=0)
    betas: tuple[float, float] = Field(
        default=(0.9, 0.999),
        description="AdamW's betas; (0.9, 0.999), torch's and SpecForge's, beat the first pilot's (0.9, 0.95) on the "
        "SmolLM2 recipe (benchmarks/results/variants.json)",
    )
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    warmup_ratio: float = Field(default=0.03, ge=0.0, lt=1.0)
    tokens_per_step: int = Field(
        default=4096,
        gt=0,
        description="tokens in one micro-batch (padded: samples × the longest; a longer sample alone); an "
        "optimizer step takes accumulate × processes micro-batches",
    )
    accumulate: int = Field(
        default=1,
        ge=1,
        description="micro-batches each process runs before an optimizer step (gradient accumulation): one "
        "process with accumulate: N trains what N processes with accumulate: 1 train, step for step",
    )
    shuffle: Literal["batches", "samples"] = Field(
        default="samples",
        description="batches: samples grouped by length once, the batches' order shuffled each epoch (the "
        "same samples share a batch every epoch); samples: samples shuffled each epoch, then grouped by "
        "length within windows of 8 batches' tokens (new batches every epoch, little more padding; a data set "
        "within one window keeps the grouped batches); not read with pack_length",
    )
    val_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    feature_cache: Literal["auto", "device", "host", "off"] = Field(
        default="auto",
        description="where the target states of every sample are kept for all epochs: device (the training "
        "GPU), host (pinned CPU memory, copied to the GPU per step), off (the target runs again in every step); "
        "auto: the device when the plan leaves 10% of it free, else the host, else off (printed before "
        "training). The validation split's states follow the same rule. true reads as auto, false as off",
    )
    memory_limit_gib: float | None = Field(
        default=None,
        gt=0,
        description="the memory train may use on its device, GiB (default: what the device has free; on the "
        "CPU what the host has available): a plan that needs more is refused before training, naming the "
        "key to change",
    )
    serve_engine: Literal["vllm", "sglang"] | None = Field(
        default=None,
        description="the engine the drafter will be served with: train warns when its features come "
        "from another source (numerics differ; measure with `eagle3kit parity`)",
    )
    device: str = "auto"
    seed: int = 0
    features: str | None = Field(
        default=None,
        description="train from the feature shards in this folder "
        "(`eagle3kit extract`) instead of running the target",
    )
    online_from: list[str] | None = Field(
        default=None,
        min_length=1,
        description="train from aux states that these vLLM capture servers produce as training runs "
        "(base URLs; docs/online.md) instead of running the target here",
    )
    online_buffer_bytes: int = Field(
        default=4 << 30,
        gt=0,
        description="most bytes of states a training process holds from the servers (files waiting "
        "to be read plus requests in flight); each file is deleted once read",
    )
    online_transport: Literal["file", "fp8"] = Field(
        default="file",
        description="what the capture servers write (hs-connectors' file layout): file (the engine's dtype) "
        "or fp8 (float8 e4m3, one scale a token: a quarter of fp32's bytes); start them with "
        "`eagle3kit capture-server --transport …`",
    )
    online_inflight: int = Field(default=4, ge=1, description="most requests to the servers in flight")
    online_timeout_s: float = Field(
        default=120.0, gt=0, description="seconds a sample's states may take before the servers count as down"
    )
    init_from: str | None = Field(
        default=None,
        description="start from this drafter folder (any layout `import` "
        "reads) instead of random weights; lm_head rows are matched by target token id",
    )
    attention: Literal["auto", "reference", "flex"] = Field(
        default="auto",
        description="TTT attention: flex (block-mask flex attention, compiled; the GPU path) or "
        "reference (dense, readable); auto: flex on CUDA, reference elsewhere",
    )
    precision: Literal["auto", "fp32", "tf32", "bf16"] = Field(
        default="auto",
        description="bf16: autocast over fp32 master weights; tf32: fp32 with the matrix products on "
        "TF32 tensor cores (CUDA only); auto: bf16 on CUDA, fp32 elsewhere",
    )
    loss_chunk: int | None = Field(
        default=None,
        ge=0,
        description="positions per checkpointed chunk of the "
        "draft-vocabulary loss (0: unchunked); default 0 unless the unchunked loss (8 bytes × "
        "tokens_per_step × draft vocabulary × TTT steps) would take more than a quarter of the CUDA "
        "device's memory, then 4096 (for loss kl the lm_head and the loss fused, gradients taken in "
        "the forward pass; for the LK losses checkpointed chunks); a block drafter: supervised slots per "
        "checkpointed chunk of its loss over the target's vocabulary, by default chunked (4096) only on CUDA "
        "when 8 bytes × slots × vocabulary would take more than a quarter of the device",
    )
    pack_length: int = Field(
        default=0,
        ge=0,
        description="pack samples into rows of this many tokens (each keeps "
        "its own positions and attends only to itself); 0: one sample per row",
    )
    parallel: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description="under torchrun: ddp (DistributedDataParallel, replicated drafter) or fsdp "
        "(FSDP2, drafter weights, gradients and optimizer state sharded over the processes)",
    )
    checkpoint_every: int = Field(
        default=0,
        ge=0,
        description="also save a resumable checkpoint every this many "
        "steps (0: at the end of each epoch only)",
    )
    compile: bool | None = Field(
        default=None,
        description="also torch.compile the drafter layer's norms, concatenation, rotary "
        "and MLP (flex attention is compiled regardless); unset: on CUDA unless parallel: fsdp",
    )
    loss: Literal["kl", "lk_alpha", "lk_lambda"] = Field(
        default="kl",
        description="kl (soft cross-entropy to the target), lk_alpha (−log expected acceptance) or lk_lambda "
        "(KL blended into 1 − acceptance as acceptance rises; SpecForge's LK losses)",
    )
    lk_kl_scale: float = Field(default=1.0, ge=0, le=1, description="lk_lambda: λ = scale · exp(−decay · α)")
    lk_kl_decay: float = Field(default=1.0, ge=0, description="lk_lambda: λ = scale · exp(−decay · α)")
    tensorboard: bool = Field(default=True, description="log to <run>/tensorboard")
    wandb_project: str | None = Field(
        default=None, description="also log to this Weights & Biases project (pip install wandb)"
    )

    @model_validator(mode="after")
    def _patience_needs_validation(self):
        if self.patience is not None and self.val_fraction == 0:
            raise ValueError(
                f"train.patience {self.patience} stops on validation τ, and train.val_fraction is 0: set "
                "train.val_fraction (e.g. 0.05), or remove train.patience"
            )
        return self

    @field_validator("memory_limit_gib")
    @classmethod
    def _memory_limit_finite(cls, v):
        """A finite size of at least a MiB (infinity would switch the check off, not allow everything)."""
        if v is not None and not (math.isfinite(v) and v >= 1 / 1024):
            raise ValueError(
                f"train.memory_limit_gib {v} must be a finite number of GiB (at least 1 MiB), as 70"
            )
        return v

    @field_validator("pack_length", mode="before")
    @classmethod
    def _pack_length_null(cls, v):
        """``pack_length: null`` (written to unset it) is 0: one sample per row."""
        return 0 if v is None else v

    @field_validator("feature_cache", mode="before")
    @classmethod
    def _feature_cache_bool(cls, v):
        """true and false, the key's values before it took places: auto and off."""
        return {True: "auto", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_are_numbers(cls, v):
        """Two numbers: a quoted string is refused, not read as 0.9 (true/false: every StrictSection field)."""
        if isinstance(v, (list, tuple)) and any(isinstance(b, str) for b in v):
            raise ValueError(f"train.betas {list(v)} must be two numbers, as [0.9, 0.999]")
        return v

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v):
        """AdamW's betas lie in [0, 1) (torch.optim.AdamW raises otherwise, after the target loaded)."""
        if not all(math.isfinite(b) and 0.0 <= b < 1.0 for b in v):
            raise ValueError(f"train.betas {list(v)} must each lie in [0, 1), as [0.9, 0.999]")
        return v

    @field_validator("init_from")
    @classmethod
    def _init_from_folder(cls, v):
        if v is not None and (not str(v).strip() or not (Path(v) / "config.json").is_file()):
            raise ValueError(f"train.init_from {v!r} must be a drafter folder holding config.json")
        return v
