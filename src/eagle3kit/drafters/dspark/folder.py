"""DSpark drafter folders: the layout vLLM's GPU model runner loads for ``method: dspark``
(``architectures: ["Qwen3DSparkModel"]``, read by ``model_executor/models/qwen3_dspark.py``), written and
read back strictly; and the checkpoint a DSpark trainer writes.

What vLLM reads from ``config.json`` (its ``hf_config``, a transformers ``Qwen3Config`` with the extra
fields kept as attributes):

- the Qwen3 layer fields (``model_type: qwen3``) of the draft layers, and ``target_hidden_size``;
- the target layers: the first of ``eagle_aux_hidden_state_layer_ids`` (aux ids as they are),
  ``dflash_config.target_layer_ids``, ``dspark_target_layer_ids``, ``target_layer_ids`` (0-based decoder
  layers, vLLM adds 1) — ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``; eagle3kit writes
  ``dspark_target_layer_ids``;
- the mask token: the first of ``dflash_config.mask_token_id``, ``mask_token_id``,
  ``dspark_noise_token_id``, ``pard_token``, ``ptd_token_id`` (``v1/worker/gpu/spec_decode/utils.py``);
- ``sample_from_anchor`` (default true, ``dspark/speculator.py``), ``markov_rank``, ``draft_vocab_size``
  (default ``vocab_size``), ``enable_confidence_head`` and ``confidence_head_with_markov`` (default
  false, ``qwen3_dspark.py``).

Tensor names (no ``model.`` prefix: vLLM's ``load_weights`` adds it to every name but ``lm_head``):
DFlash's backbone (``fc``, ``hidden_norm``, ``norm``, ``layers.N.…``), ``markov_head.markov_w1.weight``
``[V, r]``, ``markov_head.markov_w2.weight`` ``[Vd, r]``, ``confidence_head.proj.weight`` ``[1, H (+ r)]``
and ``confidence_head.proj.bias`` ``[1]``. The target's embedding and lm_head are shared, not written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3kit.core.config import ConfigError
from eagle3kit.drafters.dflash.folder import _layer_config, layer_fields
from eagle3kit.drafters.dspark.network import DSparkConfig, DSparkDrafter

#: the architecture vLLM maps to ``qwen3_dspark.Qwen3DSparkForCausalLM`` (``model_executor/models/registry.py``)
ARCHITECTURE = "Qwen3DSparkModel"
#: the metadata key and value that mark a DSpark checkpoint (as DFlash's trainer marks its own)
KIND_KEY, KIND_VALUE = "drafter", "dspark"
#: tensors vLLM's loader accepts that the drafter does not hold (its own head, the training-only map)
SHARED = ("embed_tokens.weight", "lm_head.weight", "t2d")


def vllm_dspark_config(c: DSparkConfig, dtype: str, provenance: dict | None = None) -> dict:
    """``config.json`` of the layout vLLM's ``Qwen3DSparkForCausalLM`` loads (module docstring)."""
    return {
        "architectures": [ARCHITECTURE],
        **_layer_config(c, dtype),
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "target_hidden_size": c.target_hidden_size,
        "dspark_target_layer_ids": list(c.target_layer_ids),
        "mask_token_id": c.mask_token_id,
        "sample_from_anchor": c.sample_from_anchor,
        "draft_vocab_size": c.vocab_size,
        "markov_rank": c.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": c.confidence_head,
        "confidence_head_with_markov": c.confidence_with_markov,
        "use_aux_hidden_state": True,
        "eagle3kit": {"drafter": "dspark", **(provenance or {})},
    }


def serving_tensors(drafter: DSparkDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The drafter's tensors by the names vLLM loads, on the CPU in ``dtype`` (the confidence head in
    float32, the dtype vLLM creates it in); the rotary tables are left out."""
    return {
        k: v.detach().to("cpu", torch.float32 if k.startswith("confidence_head.") else dtype).contiguous()
        for k, v in drafter.state_dict().items()
        if not k.startswith("rotary.")
    }


def write_dspark(
    drafter: DSparkDrafter,
    folder: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    provenance: dict | None = None,
) -> Path:
    """Write ``model.safetensors`` and ``config.json`` of ``drafter`` into ``folder`` (created; the two
    files replaced, the weights atomically)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    save_file(serving_tensors(drafter, dtype), str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    config = vllm_dspark_config(drafter.cfg, str(dtype).removeprefix("torch."), provenance)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def is_dspark_config(config: dict) -> bool:
    """Whether a drafter folder's ``config.json`` (as a dict) is a Qwen3 DSpark drafter's: vLLM's
    architecture, or ``DSparkDraftModel`` with ``model_type: qwen3`` (which vLLM renames to it,
    ``config/speculative.py``)."""
    archs = config.get("architectures") or []
    return ARCHITECTURE in archs or ("DSparkDraftModel" in archs and config.get("model_type") == "qwen3")


def vllm_aux_ids(config: dict) -> list[int] | None:
    """The target states vLLM reads for the drafter (HF ``output_hidden_states`` indices), resolved in
    its order (``eagle3_utils.get_eagle3_aux_layers_from_config``; module docstring); None: none named."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    dc = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    for ids in (
        dc.get("target_layer_ids"),
        config.get("dspark_target_layer_ids"),
        config.get("target_layer_ids"),
    ):
        if ids:
            return [int(i) + 1 for i in ids]
    return None


def vllm_mask_token(config: dict) -> int | None:
    """The token vLLM fills a block's slots with (``get_parallel_drafting_token_id``); None: none named."""
    dc = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    if "mask_token_id" in dc:
        return int(dc["mask_token_id"])
    for key in ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if config.get(key) is not None:
            return int(config[key])
    return None


def _required(config: dict, where: str) -> tuple[list[int], int, int, int]:
    """(aux ids, mask token, block size, Markov rank) as vLLM reads them.

    Raises:
        ConfigError: any of them missing (named), or a field vLLM refuses or eagle3kit cannot read."""
    aux, mask = vllm_aux_ids(config), vllm_mask_token(config)
    block = config.get("block_size", config.get("dspark_block_size"))
    rank = config.get("markov_rank")
    missing = [
        n
        for n, v in (
            ("dspark_target_layer_ids", aux),
            ("mask_token_id", mask),
            ("block_size", block),
            ("markov_rank", rank),
        )
        if v is None
    ]
    if missing:
        raise ConfigError(f"{where}: a DSpark config without {', '.join(missing)}")
    if (config.get("dflash_config") or {}).get("sample_from_anchor"):
        raise ConfigError(
            f"{where}: dflash_config.sample_from_anchor true — vLLM's DFlash speculator (which DSpark's extends) "
            "refuses it; write the top-level sample_from_anchor"
        )
    draft_vocab = config.get("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) != int(config["vocab_size"]):
        raise ConfigError(
            f"{where}: draft_vocab_size {draft_vocab} ≠ vocab_size {config['vocab_size']}: eagle3kit reads DSpark "
            "drafters over the target's whole vocabulary only (no d2t)"
        )
    return aux, mask, int(block), int(rank)


def read_dspark_config(config: dict, where: str = "config.json") -> DSparkConfig:
    """A :class:`DSparkConfig` from vLLM's Qwen3 DSpark ``config.json``, every field as vLLM reads it.

    Raises:
        ConfigError: not a Qwen3 DSpark config, a required field missing (named), or a value vLLM or
            eagle3kit refuses."""
    if not is_dspark_config(config):
        raise ConfigError(
            f"{where}: not a Qwen3 DSpark drafter (architectures {config.get('architectures')})"
        )
    aux, mask, block, rank = _required(config, where)
    try:
        fields = layer_fields(config)
        return DSparkConfig(
            **fields,
            target_hidden_size=int(config.get("target_hidden_size") or fields["hidden_size"]),
            num_target_layers=int(config.get("num_target_layers") or max(aux)),
            target_layer_ids=[i - 1 for i in aux],
            block_size=block,
            mask_token_id=mask,
            markov_rank=rank,
            sample_from_anchor=bool(config.get("sample_from_anchor", True)),
            confidence_head=bool(config.get("enable_confidence_head", False)),
            confidence_with_markov=bool(config.get("confidence_head_with_markov", False)),
        )
    except KeyError as e:
        raise ConfigError(f"{where}: a DSpark config without {e.args[0]}") from None


def expected_shapes(c: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the drafter of ``c`` holds and its shape (built on the meta device)."""
    with torch.device("meta"):
        d = DSparkDrafter(c)
    return {k: tuple(v.shape) for k, v in d.state_dict().items() if not k.startswith("rotary.")}


def _load(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no *.safetensors file")
    tensors: dict = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return {k.removeprefix("model."): v for k, v in tensors.items()}


def read_dspark(folder: str | Path) -> DSparkDrafter:
    """Load a DSpark drafter folder (float32), every tensor required and none left over but the ones
    vLLM accepts and shares (its own embedding or lm_head, ``t2d``). A config that enables the
    confidence head with no ``confidence_head.*`` tensor gives a drafter without one, as vLLM does;
    such tensors beside a config that does not enable it are ignored, as vLLM ignores them.

    Raises:
        ConfigError: not a DSpark folder; a tensor missing, misshapen or unknown (named)."""
    folder = Path(folder)
    c = read_dspark_config(json.loads((folder / "config.json").read_text()), str(folder / "config.json"))
    tensors = _load(folder)
    has_conf = any(k.startswith("confidence_head.") for k in tensors)
    if c.confidence_head and not has_conf:
        c = dataclasses.replace(c, confidence_head=False)
    if not c.confidence_head:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("confidence_head.")}
    want = expected_shapes(c)
    bad = [
        f"{k} {tuple(tensors[k].shape)} (want {s})"
        for k, s in want.items()
        if k in tensors and tensors[k].shape != s
    ]
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want) - set(SHARED))
    if bad or missing or extra:
        said = [f"missing {missing[:4]}" if missing else "", f"misshapen {bad[:4]}" if bad else ""]
        said.append(f"unknown {extra[:4]}" if extra else "")
        raise ConfigError(
            f"{folder}: the weights do not match its config: " + "; ".join(p for p in said if p)
        )
    d = DSparkDrafter(c)
    d.load_state_dict({k: tensors[k].float() for k in want}, strict=False)
    return d.float()


def is_dspark_checkpoint(path: str | Path) -> bool:
    """Whether the safetensors file at ``path`` is a DSpark checkpoint (metadata ``drafter: dspark``)."""
    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get(KIND_KEY) == KIND_VALUE


def load_dspark_checkpoint(path: str | Path) -> tuple[DSparkDrafter, dict]:
    """The drafter (float32, every tensor required) and the provenance of a DSpark checkpoint.

    Raises:
        RuntimeError: a tensor missing or unknown (torch's strict load names it)."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    d = DSparkDrafter(DSparkConfig(**json.loads(meta["config"])))
    tensors = load_file(str(path))
    missing, unexpected = d.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise RuntimeError(f"{path}: DSpark checkpoint missing {missing[:4]}, unknown {unexpected[:4]}")
    return d.float(), json.loads(meta.get("provenance", "{}"))
