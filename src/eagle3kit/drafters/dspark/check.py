"""``check`` for a DSpark drafter folder, read as vLLM reads it (``model_executor/models/qwen3_dspark.py``,
``v1/worker/gpu/spec_decode/dspark/``): the config's required fields, every tensor against the network
the config describes, the width, vocabulary and target layers against the target, the block against
the draft length served, the attention inside the block — and that only vLLM's V2 GPU model runner
serves DSpark (``config/vllm.py`` lists ``dspark speculative decoding`` among what the V1 runner, the
one the CPU build runs, does not support)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from safetensors import safe_open

from eagle3kit.core.config import ConfigError
from eagle3kit.drafters.dflash.check import _attention, _fits_target, _rope
from eagle3kit.drafters.dspark.folder import SHARED, expected_shapes, read_dspark_config
from eagle3kit.serve.findings import Finding

GPU_ONLY = Finding(
    "dspark_gpu_only",
    "vLLM serves DSpark only on its V2 GPU model runner: the V1 runner refuses method dspark (config/vllm.py), "
    "and the V2 runner requires Triton, which vLLM's CPU build lacks",
    "serve it on a GPU build of vLLM (V2 model runner); elsewhere measure it with `eagle3kit evaluate` (simulated)",
    "warning",
)


def _shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                shapes[k.removeprefix("model.")] = tuple(st.get_slice(k).get_shape())
    return shapes


def _tensors(folder: Path, dcfg) -> list:
    """Every tensor against the config's network; the heads vLLM drops or keeps as the config says."""
    shapes, out = _shapes(folder), []
    conf = sorted(k for k in shapes if k.startswith("confidence_head."))
    if dcfg.confidence_head and not conf:
        out.append(
            Finding(
                "dspark_confidence_head",
                "enable_confidence_head is true and the folder has no confidence_head.* tensor: vLLM drops the "
                "head, and adaptive verification falls back to its online estimator",
                "export again (eagle3kit writes confidence_head.proj.weight and .bias)",
                "warning",
            )
        )
        dcfg = dataclasses.replace(dcfg, confidence_head=False)
    if conf and not dcfg.confidence_head:
        out.append(
            Finding(
                "dspark_confidence_head",
                f"the folder ships {conf} but enable_confidence_head is not true: vLLM ignores the trained head",
                "write enable_confidence_head: true",
                "warning",
            )
        )
        shapes = {k: v for k, v in shapes.items() if k not in conf}
    want = expected_shapes(dcfg)
    missing = sorted(set(want) - set(shapes))
    wrong = [f"{k} {shapes[k]} (want {want[k]})" for k in want if k in shapes and shapes[k] != want[k]]
    extra = sorted(set(shapes) - set(want) - set(SHARED))
    if missing or wrong:
        out.append(
            Finding(
                "dspark_tensors",
                f"the weights do not match the config: missing {missing[:4]}, misshapen {wrong[:4]}",
                "export again",
            )
        )
    if extra:
        out.append(Finding("dspark_tensors", f"tensors vLLM does not load: {extra[:4]}", "export again"))
    own = [k for k in ("embed_tokens.weight", "lm_head.weight") if k in shapes]
    if own:
        out.append(
            Finding(
                "dspark_own_head",
                f"the folder ships {', '.join(own)}: vLLM uses them instead of the target's",
                "leave them out unless the drafter was trained with them",
                "warning",
            )
        )
    return out


def _serving(folder: Path, dcfg, k: int | None, engine: str) -> list:
    """The summary, the engine and the draft length against the block."""
    n = k or dcfg.drafts_per_block
    out = [
        Finding(
            "dspark",
            f"DSpark drafter: {dcfg.num_hidden_layers} layers, block {dcfg.block_size} (sample_from_anchor "
            f"{dcfg.sample_from_anchor}: {dcfg.drafts_per_block} drafts), target layers {dcfg.target_layer_ids} "
            f"(aux ids {dcfg.aux_layer_ids}), mask token {dcfg.mask_token_id}, Markov rank {dcfg.markov_rank}, "
            f"confidence head {dcfg.confidence_head}; serve with --speculative-config "
            f'\'{{"method": "dspark", "model": "{folder}", "num_speculative_tokens": {n}}}\'',
            "",
            "info",
        ),
        GPU_ONLY,
    ]
    if engine != "vllm":
        out.append(
            Finding(
                "dspark_engine",
                f"DSpark is checked for vLLM only, not {engine}",
                "serve with vLLM",
                "warning",
            )
        )
    if k is not None and k > dcfg.drafts_per_block:
        out.append(
            Finding(
                "dspark_block",
                f"num_speculative_tokens {k} > the {dcfg.drafts_per_block} drafts a block of {dcfg.block_size} was "
                f"trained for (sample_from_anchor {dcfg.sample_from_anchor}): the slots past them are guesses",
                f"serve with num_speculative_tokens ≤ {dcfg.drafts_per_block}",
            )
        )
    return out


def check_dspark(folder: Path, tc, num_speculative_tokens: int | None = None, engine: str = "vllm") -> list:
    """Every finding for serving the DSpark ``folder`` beside a target of text config ``tc``: errors
    (``config_invalid``, ``dspark_tensors``, ``dspark_block``, ``target_hidden_size``, ``aux_ids_range``,
    ``dflash_mask_token``, ``dflash_causal``, ``rope``), warnings (always ``dspark_gpu_only``) and one
    ``info`` summary. ``num_speculative_tokens``: the draft length to be served (None: a block's)."""
    raw = json.loads((folder / "config.json").read_text())
    try:
        dcfg = read_dspark_config(raw, str(folder / "config.json"))
    except (ConfigError, TypeError, ValueError) as e:
        return [
            Finding(
                "config_invalid", f"{folder / 'config.json'}: {e}", "export again with `eagle3kit export`"
            ),
            GPU_ONLY,
        ]
    N, Ht, V = int(tc.num_hidden_layers), int(tc.hidden_size), int(tc.vocab_size)
    out = _serving(folder, dcfg, num_speculative_tokens, engine) + _fits_target(dcfg, N, Ht, V)
    out += _rope(raw, tc)  # DFlash's backbone: the same rope rules, against the target's
    return out + _attention(raw, raw, False, dcfg.num_hidden_layers) + _tensors(folder, dcfg)
