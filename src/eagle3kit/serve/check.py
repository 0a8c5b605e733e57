"""``eagle3kit check``: every fault in an exported drafter that would cost a server start, found in
seconds, each with its fix (docs/conventions.md).

Reads ``config.json`` and the safetensors header (shapes only; ``d2t``/``t2d`` values are
loaded to check their invariants) and the target's config; never loads the target's weights.
Checked: the drafter generation (an EAGLE-1 head given as EAGLE-3, inferred from shapes), every
tensor an engine creates (missing ones would be created empty), stray tensors, widths (``fc``
input = 3 × target hidden), vocab sizes and the ``d2t``/``t2d`` invariants, ``lm_head`` rows,
tied embeddings, aux ids (present, in range, in both conventions, equal to the ids the features
were trained on, and for SGLang what it will really capture on this target family), max
positions against the serving length, rope settings against the target, text fields nested in
``text_config``, the speculators layout (vLLM ≥ 0.10.1 only, never SGLang), and engine support:
vLLM's EAGLE-3 gate by release (:data:`eagle3kit.serve.engine_rules.VLLM_EAGLE3_GATE`) and whether the
installed vLLM's class for the target implements EAGLE-3. Speculators-layout folders are read as such.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from eagle3kit.core.config import TargetConfig
from eagle3kit.core.config_train import variant_name
from eagle3kit.core.engines import (
    uses_mla,
)
from eagle3kit.core.kinds import kind_for_folder
from eagle3kit.model.contract import (
    DrafterImportError,
    drafter_fields,
    engine_variant,
    served_config,
)
from eagle3kit.model.target import rope_conflict, rope_settings, same_rope
from eagle3kit.model.target_files import load_target_config, one_command, target_architectures
from eagle3kit.serve.check_folder import (
    DrafterFolder,
    aux_in_weights,
    check_layer_count,
    check_tensors,
    check_variant,
    check_vocab_maps,
    check_widths,
    is_int,
    read_folder,
)
from eagle3kit.serve.engine_rules import (
    SGLANG_AUX_RULE,
    parse_version,
    raw_target_config,
    sglang_captured,
    vllm_support_findings,
    vllm_target_config_findings,
)
from eagle3kit.serve.findings import Finding


def verifier_of(drafter_dir: str | Path) -> str | None:
    """The target a speculators-layout folder names (``speculators_config.verifier.name_or_path``, what
    ``vllm serve FOLDER`` loads), or None (another layout, or an unreadable config)."""
    try:
        cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
        name = cfg["speculators_config"]["verifier"]["name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) and name else None


def _check_verifier(config: dict, target: TargetConfig) -> list[Finding]:
    """A speculators folder's verifier: a local path that is not there is an error (``vllm serve FOLDER``
    would fail to start); one other than the target checked against is a warning."""
    spec = config.get("speculators_config")
    if not isinstance(spec, dict):
        return []  # not a speculators folder
    verifier = spec.get("verifier")
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    if not isinstance(name, str) or not name.strip():
        return [
            Finding(
                "verifier_missing",
                "speculators_config.verifier names no target (name_or_path missing or empty): `vllm serve` on this "
                "folder refuses the config",
                "export again naming the target: `eagle3kit export --format speculators --verifier ID_OR_FOLDER "
                "--overwrite`",
            )
        ]
    fix = (
        "export again naming the target as the serving machine reads it: "
        "`eagle3kit export --format speculators --verifier ID_OR_FOLDER --overwrite`"
    )
    local = name.startswith(("/", ".", "~"))
    if local and not Path(name).expanduser().is_dir():
        return [
            Finding(
                "verifier_missing",
                f"the folder names its target {name}, which does not exist here: `vllm serve` on this folder fails",
                fix,
            )
        ]
    same = (
        Path(name).expanduser().resolve() == Path(target.model).expanduser().resolve()
        if local
        else name == target.model
    )
    if same:
        return []
    if local and target.model.startswith("pkg:"):  # a packaged target has no folder: compare the shapes
        return _verifier_shape(name, target, fix)
    return [_verifier_differs(name, f"; this check compared it with {target.model}", fix)]


def _verifier_differs(name: str, said: str, fix: str) -> Finding:
    """The ``verifier_differs`` warning: `vllm serve` loads ``name``, then ``said`` (against what)."""
    return Finding(
        "verifier_differs",
        f"`vllm serve` on this folder loads {name}{said}",
        f"check with --target {name}, or " + fix.split(": ", 1)[1],
        "warning",
    )


#: the sizes a verifier folder and a packaged target must share to be one model
_VERIFIER_SIZES = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")


def _verifier_shape(name: str, target: TargetConfig, fix: str) -> list[Finding]:
    """A local verifier folder beside a packaged target (``pkg:``, no folder to compare paths with):
    ``verifier_differs`` (warning) when its config.json's sizes are not the target's, ``verifier_unreadable``
    (error) when that config is missing, unreadable or empty; [] when the sizes agree."""
    try:
        mine = json.loads((Path(name).expanduser() / "config.json").read_text())
    except (OSError, ValueError) as e:
        mine, why = None, f"{type(e).__name__}: {str(e)[:120]}"
    else:
        why = "it is not a mapping of the model's settings"
    if isinstance(mine, dict) and isinstance(mine.get("text_config"), dict):
        mine = mine["text_config"]
    if not isinstance(mine, dict) or not mine:
        return [
            Finding(
                "verifier_unreadable",
                f"the folder names its target {name}, whose config.json cannot be read ({why}): `vllm serve` on "
                "this folder fails",
                fix,
            )
        ]
    theirs = load_target_config(target)[1]
    differ = [
        f"{k} {mine.get(k)} against {getattr(theirs, k, None)}"
        for k in _VERIFIER_SIZES
        if mine.get(k) is not None and mine.get(k) != getattr(theirs, k, None)
    ]
    if not differ:
        return []
    return [_verifier_differs(name, f", another model than {target.model} ({', '.join(differ)})", fix)]


def check_drafter(
    drafter_dir: str | Path,
    target: TargetConfig,
    engine: str = "vllm",
    engine_version: str | None = None,
    max_model_len: int | None = None,
    num_speculative_tokens: int | None = None,
) -> list[Finding]:
    """All findings for serving ``drafter_dir`` beside ``target`` on ``engine``; empty = servable.
    A speculators folder's verifier is checked first, for every kind; then the folder's drafter kind
    (:func:`eagle3kit.core.kinds.kind_for_folder`) applies its own rules; for
    the EAGLE-3 family (:func:`check_chain_folder`) the checks run in this order, each a function below:
    the folder's files, the config's fields,
    the drafter generation and widths, the tensors against the contract, the vocab maps, positions
    and rope, the aux ids, then what the engine (release, layout, target class) supports.

    The target is located once and its config files read once for every rule
    (:func:`~eagle3kit.model.target_files.one_command`).

    Raises:
        ConfigError: the target cannot be located (names it).
    """
    d = Path(drafter_dir)
    cfg_path, st_path = d / "config.json", d / "model.safetensors"
    missing = [
        Finding("missing_file", f"{p} does not exist", "export the drafter with `eagle3kit export`")
        for p in (cfg_path, st_path)
        if not p.is_file()
    ]
    if missing:
        return missing
    with one_command():  # one location and one read of the target's config for every rule
        try:  # a speculators folder's verifier, whatever the kind (an unreadable config: the kind's check names it)
            verifier = _check_verifier(json.loads(cfg_path.read_text()), target)
        except (OSError, ValueError, AttributeError):
            verifier = []
        return verifier + kind_for_folder(d).check(
            d, target, engine, engine_version, max_model_len, num_speculative_tokens
        )


def check_chain_folder(
    d: Path,
    target: TargetConfig,
    engine: str = "vllm",
    engine_version: str | None = None,
    max_model_len: int | None = None,
    num_speculative_tokens: int | None = None,
) -> list[Finding]:
    """:func:`check_drafter` for an EAGLE-3 family folder whose files exist (its kind's
    :meth:`~eagle3kit.core.kinds.DrafterKind.check`)."""
    cfg_path, st_path = d / "config.json", d / "model.safetensors"
    try:
        folder = read_folder(cfg_path, st_path)
    except Exception as e:
        return [Finding("unreadable", f"{d}: {type(e).__name__}: {str(e)[:160]}", "re-export the drafter")]
    try:
        fields, _ = drafter_fields(folder.config, str(cfg_path))
        variant, variant_notes = engine_variant(folder.config, fields, set(folder.shapes), str(cfg_path))
    except DrafterImportError as e:
        return [
            Finding("config_invalid", str(e), "fix these fields (or export again with `eagle3kit export`)")
        ]
    tcfg, tc = load_target_config(target)
    out, stop = check_widths(folder, fields, tc)
    if stop:
        return out
    if fields.draft_vocab_size is None:
        return out + [
            Finding(
                "config_key",
                "config.json lacks draft_vocab_size (engines would assume the full vocabulary)",
                "export again with `eagle3kit export`",
            )
        ]
    # vLLM sizes fc by the drafter's own target_hidden_size; a drafter of another target is named above
    out += _check_engine_fields(
        folder, fields, fields.target_hidden_size or fields.hidden_size, str(cfg_path)
    )
    out += check_tensors(folder, fields, tc, variant)
    out += _check_as_exported(folder, variant, engine)
    out += check_variant(variant, engine, engine_version, d)
    out += check_vocab_maps(folder, fields, int(tc.vocab_size))
    out += _check_positions(served_config(folder.config, str(cfg_path)), fields, tc, max_model_len)
    out += _check_aux(folder.config, int(tc.num_hidden_layers), tcfg, tc, engine)
    out += _check_attention(folder, raw_target_config(target), engine)
    out += _check_engine(folder, target, tcfg, tc, engine, engine_version)
    out += [
        Finding("nested_flag", note, "write the flag at the top level", "warning")
        for note in variant_notes
        if note.startswith("eagle_config.")
    ]
    return out


def _check_as_exported(folder: DrafterFolder, variant: dict, engine: str) -> list[Finding]:
    """Non-finite weights, and the variant an engine reads against the one eagle3kit exported
    (``eagle3kit.drafter_variant``): a flag edited by hand serves another network."""
    out = [
        Finding(
            "non_finite",
            f"{k} holds NaN or inf values: the engine would load it and draft garbage",
            "export again from a checkpoint of a run whose loss stayed finite",
        )
        for k in folder.nonfinite
    ]
    trained = (
        (folder.config.get("eagle3kit") or {}).get("drafter_variant")
        if isinstance(folder.config.get("eagle3kit"), dict)
        else None
    )

    def on(flags: dict) -> dict:
        return {k: v for k, v in flags.items() if v}

    if isinstance(trained, dict) and on(trained) != on(variant):
        out.append(
            Finding(
                "variant_mismatch",
                f"the flags {engine} reads give {variant_name(variant)}, but eagle3kit exported this drafter "
                f"as {variant_name(trained)} (eagle3kit.drafter_variant): it would serve another network "
                "than the one trained",
                "export the drafter again with `eagle3kit export` instead of editing config.json's flags",
            )
        )
    return out


def _check_engine_fields(folder: DrafterFolder, fields, H_t: int, where: str) -> list[Finding]:
    """The fields vLLM builds the drafter from before it reads a weight (its ``llama_eagle3.py``): the
    decoder layers (``num_hidden_layers``), whether ``fc`` exists (``eagle_config.use_aux_hidden_state``),
    and fc's width: ``num_aux_hidden_states``, else the count of ``eagle_config``'s ids, else 3, times
    ``target_hidden_size`` (``H_t``: the drafter's own, as vLLM reads it); and the aux ids the target captures.
    Each against the weights."""
    pre, shapes, out = served_config(folder.config, where), folder.shapes, []
    nested = pre.get("eagle_config") if isinstance(pre.get("eagle_config"), dict) else {}
    out += check_layer_count(pre, shapes)
    if "use_aux_hidden_state" in nested and nested["use_aux_hidden_state"] is not True:
        out.append(
            Finding(
                "use_aux_hidden_state",
                f"eagle_config.use_aux_hidden_state is {nested['use_aux_hidden_state']!r}: vLLM builds no fc and never "
                "reads the aux states",
                "drop it (or set it true): an EAGLE-3 drafter reads the aux states",
            )
        )
    if "fc.weight" not in shapes or shapes["fc.weight"][1] % H_t:
        return out
    n = aux_in_weights(shapes, H_t)
    ids = fields.eagle_aux_hidden_state_layer_ids or []
    nested_ids = nested.get("eagle_aux_hidden_state_layer_ids")
    engine_n, why = pre.get("num_aux_hidden_states"), "num_aux_hidden_states"
    if engine_n is not None and not is_int(engine_n):
        out.append(
            Finding(
                "num_aux_states",
                f"num_aux_hidden_states is {engine_n!r}, not a whole number: vLLM fails to size fc from it",
                f"set num_aux_hidden_states to {n}",
            )
        )
        return out
    if engine_n is None:
        engine_n, why = (len(nested_ids), "eagle_config's ids") if nested_ids else (3, "vLLM's default")
    if engine_n != n:
        out.append(
            Finding(
                "num_aux_states",
                f"vLLM sizes fc for {engine_n} aux states ({why}) × {H_t}, but fc.weight takes {n} × {H_t}: it would "
                "fail to load, or read other layers than trained",
                f"set num_aux_hidden_states to {n}"
                + (" (or drop it and give eagle_config {n} ids)" if why == "num_aux_hidden_states" else ""),
            )
        )
    if ids and len(ids) != n:
        out.append(
            Finding(
                "aux_ids_count",
                f"{len(ids)} aux ids {ids}, but fc.weight takes {n} aux layers × {H_t}: the target would capture "
                f"{len(ids)} states for an fc of {n}",
                f"give exactly the {n} ids the drafter was trained on",
            )
        )
    return out


#: config fields and tensor names of multi-head latent attention (DeepSeek-V2/V3, Kimi)
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
MLA_TENSORS = ("kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj", "kv_a_layernorm")
#: the engine setting that picks the drafter's own attention backend beside a target of another kind
DRAFT_ATTENTION_SETTING = {
    "vllm": '"attention_backend": "FLASH_ATTN" in --speculative-config',
    "sglang": "--speculative-draft-attention-backend fa3",
}


def _check_attention(folder: DrafterFolder, target_raw: dict, engine: str) -> list[Finding]:
    """The drafter's attention (MHA, or MLA by its weights or fields) and the target's, said every time.
    Both engines' EAGLE-3 drafter classes build multi-head attention from q/k/v projections: MLA weights
    cannot be served (error), MLA fields beside q/k/v weights are ignored by the engine (warning); an MHA
    drafter beside an MLA target needs its own attention backend, named per engine (warning)."""
    dc = folder.config
    fields = [
        k for k in MLA_FIELDS if dc.get(k) is not None or (dc.get("transformer_layer_config") or {}).get(k)
    ]
    mla_weights = sorted({t for k in folder.shapes for t in MLA_TENSORS if f".{t}." in f".{k}"})
    target = "MLA" if target_raw and uses_mla(target_raw) else "MHA"
    drafter = "MLA" if mla_weights else "MHA"
    out = [Finding("attention", f"the drafter's {drafter}, the target's {target}", "", "info")]
    if mla_weights:
        out.append(
            Finding(
                "drafter_attention",
                f"the drafter holds MLA weights ({', '.join(mla_weights)}): neither vLLM's nor SGLang's EAGLE-3 "
                "drafter runs MLA (both build q/k/v multi-head attention), so it cannot be served",
                "train an EAGLE-3 drafter with multi-head attention (what eagle3kit trains, for MLA targets too)",
            )
        )
    elif fields:
        out.append(
            Finding(
                "drafter_attention",
                f"the config declares MLA fields ({', '.join(fields)}) but the weights are q/k/v multi-head attention: "
                "the engine ignores the fields and serves MHA",
                "drop the MLA fields from config.json",
                "warning",
            )
        )
    if target == "MLA" and drafter == "MHA":
        out.append(
            Finding(
                "attention_types",
                f"an MHA drafter beside an MLA target: {engine} runs the two with different attention backends; if "
                f"the one it picks for the drafter fails or is slow, set it with {DRAFT_ATTENTION_SETTING[engine]}",
                f"on a GPU build: {DRAFT_ATTENTION_SETTING[engine]}",
                "warning",
            )
        )
    return out


_ROPE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor")


def _check_positions(dc: dict, fields, tc, max_model_len: int | None) -> list[Finding]:
    """Tied embeddings, max positions against the serving length, rope against the target's."""
    out: list[Finding] = []
    if dc.get("tie_word_embeddings"):
        out.append(
            Finding(
                "tied_embeddings",
                "tie_word_embeddings is true: the engine would use the embedding as lm_head",
                "set tie_word_embeddings false (the drafter's lm_head is [Vd, H])",
            )
        )
    mpe = fields.max_position_embeddings or 0
    target_len = int(getattr(tc, "max_position_embeddings", 0) or 0)
    if max_model_len and mpe < max_model_len:
        out.append(
            Finding(
                "max_positions",
                f"max_position_embeddings {mpe} < the serving length {max_model_len}",
                "export again (it copies the target's) or serve with a shorter --max-model-len",
            )
        )
    elif not max_model_len and target_len and mpe < target_len:
        # the engines serve the target's own length by default; vLLM then caps the drafter at its
        # max_position_embeddings (SpeculativeConfig._maybe_override_draft_max_model_len): no draft past it
        out.append(
            Finding(
                "max_positions",
                f"max_position_embeddings {mpe} < {target_len}, the length the engine serves "
                f"this target at by default (its max_position_embeddings): vLLM starts, and past {mpe} tokens "
                "it drafts nothing (τ 1)",
                f"export again (it copies the target's), or serve with --max-model-len "
                f"{mpe} and pass it to check",
            )
        )
    rope, own = rope_settings(tc), rope_settings(dc)  # every spelling read as the engine reads it
    twice = rope_conflict(dc)
    if twice:
        out.append(
            Finding("rope_twice", f"the drafter's config: {twice}", "keep one spelling (export again)")
        )
    elif not same_rope(own, rope):
        out.append(
            Finding(
                "rope",
                f"the drafter's rope (theta {own['rope_theta']}, scaling {own['rope_scaling']}, as read from "
                f"{', '.join(k for k in _ROPE_KEYS if k in dc) or 'no field'}) "
                f"differs from the target's (theta {rope['rope_theta']}, scaling {rope['rope_scaling']})",
                "export again (it copies the target's)",
            )
        )
    return out


def _check_engine(
    folder: DrafterFolder, target: TargetConfig, tcfg, tc, engine: str, engine_version: str | None
) -> list[Finding]:
    """What the engine supports: the speculators layout by engine and release, SGLang's untabled
    releases, and for vLLM its EAGLE-3 gate, the target class and the target's own config."""
    dc = folder.config
    out: list[Finding] = []
    if folder.speculators:
        if engine == "sglang":
            out.append(
                Finding(
                    "layout",
                    f"a speculators-layout folder (architectures {dc.get('architectures')}): SGLang has no model "
                    "class for it",
                    "serve the dual-engine export (`eagle3kit export`) with SGLang",
                )
            )
        elif engine_version and (parse_version(engine_version) or parse_version("0.10.1")) < parse_version(
            "0.10.1"
        ):
            out.append(
                Finding(
                    "layout",
                    f"vLLM {engine_version} does not read the speculators layout (from 0.10.1 on)",
                    "serve the dual-engine export, or vLLM ≥ 0.10.1",
                )
            )
    if engine == "sglang" and engine_version:
        out.append(
            Finding(
                "engine_support",
                f"SGLang {engine_version}: eagle3kit has no table of SGLang releases; the "
                "per-family aux-id rule checked is SGLang 0.5.23's",
                "check that release's notes",
                "warning",
            )
        )
    if engine == "vllm":
        out += vllm_support_findings(
            target_architectures(tcfg),
            str(getattr(tc, "model_type", "") or getattr(tcfg, "model_type", "")),
            engine_version,
        )
        block = dc.get("eagle3kit") if isinstance(dc.get("eagle3kit"), dict) else {}
        out += vllm_target_config_findings(target, engine_version, block)
    return out


def _check_aux(dc: dict, N: int, tcfg, tc, engine: str) -> list[Finding]:
    out: list[Finding] = []
    ids = dc.get("eagle_aux_hidden_state_layer_ids")
    nested = (dc.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return [
            Finding(
                "aux_ids_missing",
                "config.json has no eagle_aux_hidden_state_layer_ids: the engine would pick "
                "its default layers, not the ones the drafter was trained on",
                "export again",
            )
        ]
    if sorted(set(ids)) != list(ids) or min(ids) < 1 or max(ids) > N - 1:
        out.append(
            Finding(
                "aux_ids_range",
                f"aux ids {ids} must be distinct, ascending, inside [1, {N - 1}] (HF index)",
                "export again with the ids the drafter was trained on",
            )
        )
    block = dc.get("eagle3kit") if isinstance(dc.get("eagle3kit"), dict) else {}
    trained = (
        block.get("aux_layer_ids", {}).get("ids") if isinstance(block.get("aux_layer_ids"), dict) else None
    )
    if trained and list(trained) != list(ids):
        out.append(
            Finding(
                "aux_ids_trained",
                f"config aux ids {ids} but the features were trained on {trained}",
                f"set eagle_aux_hidden_state_layer_ids to {trained}",
            )
        )
    if nested is not None and [i + 1 for i in nested] != list(ids):
        out.append(
            Finding(
                "aux_ids_conventions",
                f"eagle_config ids {nested} (output of layer j) do not equal the top-level "
                f"{ids} (HF index) minus 1",
                f"set eagle_config.eagle_aux_hidden_state_layer_ids to {[i - 1 for i in ids]}",
            )
        )
    if engine == "sglang":
        cfg_ids = list(nested) if nested is not None else [i - 1 for i in ids]
        got = sglang_captured(cfg_ids, str(getattr(tc, "model_type", getattr(tcfg, "model_type", ""))), N)
        want = list(trained or ids)
        if got != want:
            out.append(
                Finding(
                    "aux_ids_sglang",
                    f"SGLang will capture HF layers {got} on this {tc.model_type} target, not {want}",
                    "export ids that SGLang's rule for this family maps to the trained layers",
                )
            )
        else:
            out.append(
                Finding(
                    "aux_ids_sglang",
                    f"SGLang will capture HF layers {got} (eagle_config ids {cfg_ids} under "
                    f"its {SGLANG_AUX_RULE.get(str(tc.model_type), 'always')!r} rule for {tc.model_type}): the "
                    "trained layers",
                    "",
                    "info",
                )
            )
    return out


def findings_json(findings: list[Finding]) -> str:
    """The findings as JSON (``--json``): ``{"ok": bool, "findings": [...]}``."""
    return json.dumps(
        {"ok": not any(f.severity == "error" for f in findings), "findings": [asdict(f) for f in findings]},
        indent=2,
    )
