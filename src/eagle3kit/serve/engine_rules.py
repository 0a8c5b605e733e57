"""The serving engines' rules that ``eagle3kit check`` applies, kept apart from the folder checks: what
each engine release reads from a drafter folder and a target config, as tables by engine and version
(:data:`VLLM_EAGLE3_GATE`, :data:`VLLM_VARIANT_SINCE`, :data:`SGLANG_AUX_RULE`) and the functions that turn
them into findings (:func:`vllm_target_config_findings`, :func:`vllm_support_findings`). Read from each
engine's source and measured by serving (:data:`VLLM_RULES_MEASURED`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from packaging.version import InvalidVersion, Version

from eagle3kit.core.config import TargetConfig
from eagle3kit.core.engines import (
    installed_vllm,
    is_kimi_wrapper,
    read_config_json,
    text_fields,
    uses_mla,
    vllm_cpu_build,
)
from eagle3kit.model.target_files import command_memo, locate_target
from eagle3kit.serve.findings import Finding

# where the vLLM rules were measured by serving what they pass and refuse (printed by `eagle3kit check`)
VLLM_RULES_MEASURED = (
    "0.32.0's CPU build (the EAGLE-3 family and the block drafter, in CI) and 0.26.0 on an H100 GPU (EAGLE-3.1 "
    "and block-drafter folders)"
)


# SGLang 0.5.23's +1 on the configured ids, per target family (docs/conventions.md, layer ids): "always" adds 1;
# "if_first_is_1" adds 1 only when the first id is 1 (else reads them verbatim); "verbatim_if_max_is_n"
# reads them verbatim when the largest id equals N (else adds 1).
SGLANG_AUX_RULE = {
    "deepseek_v2": "if_first_is_1",
    "deepseek_v3": "if_first_is_1",
    "kimi_k2": "if_first_is_1",
    "kimi_k25": "if_first_is_1",
    "glm4_moe_lite": "if_first_is_1",
    "gpt_oss": "verbatim_if_max_is_n",
}


def sglang_captured(config_ids: list[int], model_type: str, num_layers: int) -> list[int]:
    """The HF indices SGLang will capture for ``eagle_config`` ids on a target of ``model_type``
    (docs/conventions.md, layer ids)."""
    rule = SGLANG_AUX_RULE.get(model_type, "always")
    if rule == "if_first_is_1" and config_ids and config_ids[0] != 1:
        return list(config_ids)
    if rule == "verbatim_if_max_is_n" and config_ids and max(config_ids) == num_layers:
        return list(config_ids)
    return [i + 1 for i in config_ids]


def vllm_supports_eagle3(architectures: list[str]) -> tuple[bool | None, str | None]:
    """Whether the installed vLLM's model class for ``architectures`` implements EAGLE-3
    (``SupportsEagle3``): ``(answer, why)``, answer None when vLLM is not installed or the class is
    unknown or cannot be imported (``why``: the import error's last line; vLLM's registry would
    print its whole traceback — it is held back here, the finding names it)."""

    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_eagle3
    except Exception:
        return None, None

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.ERROR)
            self.errors: list[str] = []

        def emit(self, record):
            exc = record.exc_info[1] if record.exc_info else None
            self.errors.append(f"{type(exc).__name__}: {exc}" if exc else record.getMessage())

    log = logging.getLogger("vllm.model_executor.models.registry")
    keep, propagate = Keep(), log.propagate
    log.addHandler(keep)
    log.propagate = False
    try:
        for arch in architectures or []:
            try:
                cls = ModelRegistry._try_load_model_cls(arch)
            except Exception as e:
                keep.errors.append(f"{type(e).__name__}: {e}")
                cls = None
            if cls is not None:
                return bool(supports_eagle3(cls)), None
    finally:
        log.removeHandler(keep)
        log.propagate = propagate
    return None, (keep.errors[-1][:200] if keep.errors else None)


# the first vLLM release that reads each variant field (vLLM's release notes; 0.32's llama_eagle3.py reads all)
VLLM_VARIANT_SINCE = {
    "norm_before_residual": "0.10.2",
    "parallel_drafting": "0.16.0",
    "norm_before_fc": "0.22.0",
    "fc_norm": "0.22.0",
    "norm_output": "0.22.0",
}


def vllm_target_config_findings(
    target: TargetConfig, engine_version: str | None, provenance: dict
) -> list[Finding]:
    """Faults in the target's own config that the installed vLLM (0.32, read from its source and
    seen to fail on tiny targets of each family) refuses or silently serves differently.

    Over 80 lines because it is a table of independent rules, one per fault the installed vLLM shows on a
    family's config, each with its message.
    """

    raw = raw_target_config(target)
    installed = installed_vllm()
    if (
        not raw
        or installed is None
        or (engine_version and parse_version(engine_version) != parse_version(installed))
    ):
        return []
    out: list[Finding] = []
    text = text_fields(raw)
    if str(text.get("model_type")) in ("deepseek_v3", "kimi_k2"):
        gone = [k for k in ("topk_method", "scoring_func") if k not in text]
        if gone:
            out.append(
                Finding(
                    "moe_routing",
                    f"the target's config has no {' / '.join(gone)}: vLLM's DeepSeek-V3 then "
                    + (
                        "creates no gate.e_score_correction_bias and fails to load the checkpoint (KeyError), "
                        if "topk_method" in gone
                        else ""
                    )
                    + (
                        "routes the experts with softmax where the model (and transformers) uses sigmoid, so "
                        "the served model is silently another model"
                        if "scoring_func" in gone
                        else ""
                    ),
                    'add "topk_method": "noaux_tc" and "scoring_func": "sigmoid" to the target\'s config.json '
                    "(the hub configs of DeepSeek-V3 and Kimi carry both; transformers 5 does not write them)",
                )
            )
        other = {
            k: text[k]
            for k, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"))
            if k in text and text[k] != want
        }
        if other:
            out.append(
                Finding(
                    "moe_routing",
                    f"the target's config routes with {other}: vLLM's DeepSeek-V3 honours it "
                    + (
                        "(greedy/group-limited top-k creates no gate.e_score_correction_bias, so the checkpoint's "
                        "bias fails to load) "
                        if "topk_method" in other
                        else ""
                    )
                    + "while transformers' DeepSeek-V3 (which made the drafter's training data) always routes "
                    "with sigmoid scores and noaux_tc: the served model is another model",
                    'set "topk_method": "noaux_tc" and "scoring_func": "sigmoid" as in the DeepSeek-V3 and Kimi '
                    "hub configs (or, if the checkpoint really is another routing, it is not a DeepSeek-V3)",
                )
            )
    if is_kimi_wrapper(raw) and "media_placeholder_token_id" not in raw:
        out.append(
            Finding(
                "kimi_media_placeholder",
                f"vLLM {installed}'s EAGLE-3 proposer reads "
                "config.media_placeholder_token_id of a Kimi-K2.5 target; this config has none (transformers' "
                "Kimi_K25Config does not write it), so the server stops at start (AttributeError)",
                'add "media_placeholder_token_id": 163605 (the hub config\'s value, the <|media_pad|> id) to the '
                "target's config.json",
            )
        )
    if vllm_cpu_build() and uses_mla(raw):
        if os.environ.get("VLLM_MLA_DISABLE") != "1":
            out.append(
                Finding(
                    "mla_cpu_eagle3",
                    f"vLLM {installed} is the CPU build: MLA with EAGLE-3 does not start "
                    "in float32 (its reference CPU_MLA backend takes KV blocks of 16 and the drafter's CPU "
                    'attention a multiple of 32: "No common block size"; on a CPU with AMX the default '
                    "AMX MLA backend takes only bf16 weights). In bf16 on AMX it starts, but was not seen to be "
                    "lossless (docs/families.md)",
                    "start vLLM with VLLM_MLA_DISABLE=1 (the target's attention without MLA, the nearest path "
                    "the CPU build runs losslessly; run check with it set to confirm); GPU builds are not affected",
                )
            )
        else:
            out.append(
                Finding(
                    "mla_cpu_eagle3",
                    "VLLM_MLA_DISABLE=1: vLLM's CPU build serves this MLA target without MLA "
                    "(the nearest path to MLA + EAGLE-3 it runs)",
                    "",
                    "info",
                )
            )
        # hub form, transformers 5 form
        scaling = text.get("rope_scaling") or text.get("rope_parameters") or {}
        if (scaling.get("rope_type") or scaling.get("type") or "default") == "default":
            src = provenance.get("features_source") or "unknown"
            out.append(
                Finding(
                    "engine_numerics",
                    f"vLLM {installed}'s CPU build computes other hidden states than "
                    "transformers for this target: a DeepSeek-family attention without rope_scaling goes "
                    "through its C++ rotary kernel, which reads the 3-D [tokens, heads, dim] query as "
                    "tokens × heads rows (head h of token t rotated at position t·heads + h; "
                    f"csrc/cpu/pos_encoding.cpp). The drafter's features came from: {src}",
                    "train on features from the engine (`eagle3kit extract --backend vllm`) and compare with "
                    "`eagle3kit parity`; configs with yarn rope_scaling (the real DeepSeek-V3 and Kimi) are "
                    "not affected",
                    "info" if src.startswith("vllm") else "warning",
                )
            )
    return out


# vLLM's EAGLE-3 gate by release, read from each release's sdist on PyPI (vllm/config.py or
# vllm/config/speculative.py): (first release, model types of which one must be a substring of the
# target's text model_type; None = no such list). 0.8.5 introduced EAGLE-3; from 0.10.1 the target's
# class must also implement SupportsEagle3; from 0.22.0 that interface is the only gate. 0.15.x
# shipped no sdist and is not in the table.
VLLM_EAGLE3_GATE: list[tuple[str, list[str] | None]] = [
    ("0.8.5", ["llama"]),
    ("0.10.1", ["llama", "qwen"]),
    ("0.11.0", ["llama", "qwen", "minicpm", "gpt_oss"]),
    ("0.16.0", ["llama", "qwen", "minicpm", "gpt_oss", "hunyuan_vl", "hunyuan_v1_dense", "afmoe"]),
    (
        "0.17.0",
        ["llama", "qwen", "minicpm", "gpt_oss", "hunyuan_vl", "hunyuan_v1_dense", "afmoe", "nemotron_h"],
    ),
    (
        "0.18.0",
        [
            "llama",
            "qwen",
            "minicpm",
            "gpt_oss",
            "hunyuan_vl",
            "hunyuan_v1_dense",
            "afmoe",
            "nemotron_h",
            "deepseek_v2",
            "deepseek_v3",
            "kimi_k2",
            "kimi_k25",
        ],
    ),
    (
        "0.20.0",
        [
            "llama",
            "qwen",
            "minicpm",
            "gpt_oss",
            "hunyuan_vl",
            "hunyuan_v1_dense",
            "afmoe",
            "nemotron_h",
            "deepseek_v2",
            "deepseek_v3",
            "kimi_k2",
            "kimi_k25",
            "minimax_m2",
            "gemma4",
        ],
    ),
    (
        "0.21.0",
        [
            "llama",
            "qwen",
            "minicpm",
            "gpt_oss",
            "hunyuan_vl",
            "hunyuan_v1_dense",
            "afmoe",
            "nemotron_h",
            "deepseek_v2",
            "deepseek_v3",
            "kimi_k2",
            "kimi_k25",
            "minimax_m2",
            "gemma4",
            "laguna",
        ],
    ),
    ("0.22.0", None),
]


VLLM_TABLE_LAST = "0.33.0"  # the newest release the table was read from


def parse_version(v: str):
    """``packaging`` Version of ``v``, or None when ``v`` is not a version string."""

    try:
        return Version(v)
    except InvalidVersion:
        return None


def vllm_eagle3_gate(version: str) -> tuple[str, list[str] | None] | None:
    """The row of :data:`VLLM_EAGLE3_GATE` that applies to vLLM ``version`` (None: before 0.8.5)."""

    v = Version(version)
    rows = [r for r in VLLM_EAGLE3_GATE if Version(r[0]) <= v]
    return rows[-1] if rows else None


def vllm_support_findings(archs: list[str], model_type: str, engine_version: str | None) -> list[Finding]:
    """Whether vLLM ``engine_version`` (default: the installed one) runs EAGLE-3 on this target:
    the release's model-type allow-list, then (installed vLLM only) the class's SupportsEagle3.

    Over 80 lines because it is a table of rules by vLLM release and class, each with its message.
    """

    installed = installed_vllm()
    want = engine_version or installed
    if want is None:
        return [
            Finding(
                "engine_support",
                f"no vLLM version given and none installed: EAGLE-3 support for {model_type} not checked",
                "pass --engine-version (the vLLM that will serve)",
                "warning",
            )
        ]
    wv = parse_version(want)
    if wv is None:
        return [Finding("engine_version", f"--engine-version {want!r} is not a version", "give it as 0.11.0")]
    out: list[Finding] = []
    row = vllm_eagle3_gate(want)
    if row is None:
        return [
            Finding(
                "engine_support", f"vLLM {want} has no EAGLE-3 (it arrived in 0.8.5)", "serve on vLLM ≥ 0.8.5"
            )
        ]
    if Version("0.15") <= wv < Version("0.16") or wv > Version(VLLM_TABLE_LAST):
        out.append(
            Finding(
                "engine_support",
                f"vLLM {want} is not in eagle3kit's table (read from 0.8.5–{VLLM_TABLE_LAST}, "
                f"no 0.15); its gate is assumed to be {row[0]}'s",
                "check the release notes",
                "warning",
            )
        )
    allow = row[1]
    if allow is not None and not any(m in model_type for m in allow):
        first = next(
            (r[0] for r in VLLM_EAGLE3_GATE if r[1] is None or any(m in model_type for m in r[1])), None
        )
        out.append(
            Finding(
                "engine_support",
                f"vLLM {want} allows EAGLE-3 only for model types containing {allow}; "
                f"this target is {model_type!r} (the server refuses the speculative config at start)",
                f"serve on vLLM ≥ {first}"
                + (
                    " (if its class for this target implements SupportsEagle3)"
                    if vllm_eagle3_gate(first)[1] is None
                    else ""
                ),
            )
        )
    if installed and Version(installed).release[:3] == wv.release[:3]:
        ok, why = vllm_supports_eagle3(archs)
        if ok is None and why:
            out.append(
                Finding(
                    "engine_support",
                    f"the installed vLLM {installed} has a class for {archs} but cannot import "
                    f"it here ({why}): a server would fail the same way at start",
                    "install what the import needs (for a vision wrapper: torchvision), or serve a text-only "
                    "checkpoint of the language model",
                )
            )
        elif ok is False:
            out.append(
                Finding(
                    "engine_support",
                    f"vLLM {installed}'s class for {archs} does not implement EAGLE-3 "
                    "(SupportsEagle3): it cannot hand the drafter aux hidden states",
                    "use a vLLM version whose class for this target supports EAGLE-3",
                )
            )
        elif ok is None:
            out.append(
                Finding(
                    "engine_support",
                    f"the installed vLLM {installed} has no model class for {archs}: it would "
                    "fall back to its generic Transformers backend (seen for transformers' own "
                    "Kimi_K25ForConditionalGeneration: it then fails at start, its image processor needing "
                    "torchvision)",
                    "serve the checkpoint under an architecture vLLM has a class for (Kimi-K2.5: "
                    "the hub layout, KimiK25ForConditionalGeneration with language_model.model.layers.* names)",
                )
            )
    elif wv >= Version("0.10.1"):
        out.append(
            Finding(
                "engine_support",
                f"whether vLLM {want}'s class for {archs} implements SupportsEagle3 is not "
                f"checked here (installed: {installed or 'none'})",
                f"run check where vLLM {want} is installed",
                "warning",
            )
        )
    return out


def raw_target_config(target: TargetConfig) -> dict:
    """The target's ``config.json`` as written (what vLLM reads: transformers' classes drop or add
    keys), or {} for a GGUF target; read once per command
    (:func:`~eagle3kit.model.target_files.one_command`)."""
    return command_memo(target, "raw", lambda: _raw_target_config(target))


def _raw_target_config(target: TargetConfig) -> dict:
    """:func:`raw_target_config`, read now."""
    loc = locate_target(target)
    if loc["gguf_file"] or not (Path(loc["path"]) / "config.json").is_file():
        return {}
    return read_config_json(loc["path"])  # check_drafter read it through transformers first: it parses
