"""Run SpecForge 0.2.0's offline EAGLE-3 trainer on eagle3kit's training data (benchmarks only).

SpecForge trains offline from a folder of per-sample ``.ckpt`` files that its own
``scripts/prepare_hidden_states.py`` writes with SGLang. This module writes that folder (and the
draft config, vocabulary map, target folder and run config SpecForge needs) from eagle3kit's
samples, builds the command that trains, and exports the result with SpecForge's own exporter so
that ``eagle3kit import`` reads it. No SpecForge code is copied here; the formats were read from
SpecForge 0.2.0 (PyPI wheel ``specforge-0.2.0-py3-none-any.whl``), file by file:

Offline feature folder (:func:`write_offline_features`)
    * ``runtime/data_plane/offline_reader.py``: ``list_feature_files`` walks the folder recursively
      and takes every file ending ``.ckpt`` or ``.ckpt.gz`` (sorted by path; other files, such as
      this module's ``specforge_adapter.json``, are ignored); no index or manifest is read.
      ``_OFFLINE_EAGLE3_KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")``.
    * ``runtime/data_plane/feature_store.py``: ``load_feature_file`` is
      ``torch.load(path, weights_only=False, mmap=True)`` (gzip for ``.gz``): one dict per file.
    * ``algorithms/eagle3/data.py``: ``normalize_offline_sample`` reads
      ``aux_hidden_state.squeeze(0)[:max_len]``, ``hidden_state.squeeze(0)[:max_len]``,
      ``input_ids[:max_len]`` and ``loss_mask[:max_len]`` (so ids and mask are 1-D [T], the states
      [1, T, D] or [T, D]), sets ``loss_mask[-1] = 0`` and names them ``hidden_state`` (the aux
      states) and ``target`` (the last state).
    * The layout written is the one of SpecForge's ``scripts/prepare_hidden_states.py``
      (``HiddenStatesGenerator``): ``rows_{g}-{g+2000}/data_{i}.ckpt`` holding
      ``{"input_ids": int64 [T], "loss_mask": int64 [T], "hidden_state": bf16 [1, T, H],
      "aux_hidden_state": bf16 [1, T, 3H]}`` (``torch.save`` of its ``DataPoint`` dataclass).
    * ``hidden_state`` is the target's LAST hidden state after the final norm (what SGLang hands
      its logits processor; ``offline_capture/sglang_backend/utils.py`` stores ``pruned_states``),
      i.e. HF ``output_hidden_states[-1]``, not logits: the EAGLE-3 offline contract allows only the
      ``hidden_state`` target representation (``algorithms/eagle3/providers.py``), and
      ``training/strategies/base.py`` ``_prepare_eagle_target`` re-runs the frozen target
      ``lm_head`` (``modeling/target/target_head.py`` ``TargetHead``) on it.
    * ``aux_hidden_state`` is the three aux states concatenated in ascending layer order. SpecForge
      names a layer j for "output of decoder layer j" = HF ``output_hidden_states[j + 1]``
      (SGLang's ``set_eagle3_layers_to_capture`` captures at the input of layer j + 1); its default
      (``algorithms/model_providers.py`` ``resolve_eagle_capture_layers``) is
      ``[1, N//2 - 1, N - 4]`` = HF ``(2, N//2, N - 3)``, EAGLE-3's and eagle3kit's default.
    * Alignment (``TargetHead.preprocess`` shifts ids and target left by one, not the mask;
      ``algorithms/eagle3/model.py`` ``OnlineEagle3Model.forward`` shifts the mask by one more per
      TTT step and masks positions whose target argmax is outside the draft vocabulary): at TTT
      step k, position t reads token x[t+k+1] and the teacher at t+k+1 and is supervised when
      ``loss_mask[t+k]``. eagle3kit (``train/batches.py`` ``make_batch``) supervises the same
      (t, k) when ``mask[t+k+1]``. ``mask_alignment="eagle3kit"`` (default) therefore writes
      ``loss_mask[i] = mask[i+1]`` so both tools supervise exactly the same positions;
      ``"as_is"`` writes the mask unchanged (SpecForge's own data preparation: 1 on assistant
      tokens).

Vocabulary map (:func:`write_vocab_mapping`)
    ``modeling/draft/base.py`` ``Eagle3DraftModel.load_vocab_mapping``: ``torch.load(path)`` of a
    dict ``{"d2t": int64 [Vd], "t2d": bool [V]}``; ``d2t`` holds offsets (target id = draft id +
    d2t[draft id], ``data/preprocessing.py`` ``process_token_dict_to_mappings``), eagle3kit's
    convention. Given as ``model.vocab_mapping_path``, SpecForge uses it instead of counting tokens
    (``training/assembly.py`` ``_ensure_offline_vocab_mapping``), so both tools share one vocabulary.

Draft config (:func:`draft_config_dict`)
    ``training/model_loading.py`` ``_generate_draft_config`` / ``_draft_config_from_dict`` and
    ``algorithms/eagle3/providers.py``: ``architectures: ["LlamaForCausalLMEagle3"]``,
    ``model_type: llama``, ``num_hidden_layers: 1``, the target's architecture fields
    (``_TARGET_ARCHITECTURE_FIELDS``), ``tie_word_embeddings: false``, ``draft_vocab_size``.
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge numbering) is added so the export
    states its layers (SpecForge's training ignores it offline; eagle3kit's importer reads it).

Target folder (:func:`write_target_dir`)
    Offline, SpecForge reads from ``model.target_model_path`` only ``config.json``
    (``AutoConfig``), the embedding (``Eagle3DraftModel.load_embedding``, key
    ``model.embedding_key``) and the LM head (``TargetHead.load_weights``, key
    ``model.lm_head_key``), and ``TargetHead`` REQUIRES a ``*.index.json`` (a single
    ``model.safetensors`` fails) and a real ``lm_head.weight`` key (a tied target such as SmolLM2
    has none). No tokenizer is loaded offline (``online_needs_input_tools``). This module therefore
    writes a small folder: ``config.json``, ``model.safetensors`` with ``model.embed_tokens.weight``
    and ``lm_head.weight`` (the embedding again for a tied target), and its index.

Run config and command (:func:`write_run_config`, :func:`build_train_command`)
    ``cli.py`` ``main``: ``specforge train --config run.yaml [section.field=value ...]``; with
    ``deployment.trainer`` 1 × 1 and no ``RANK`` in the environment, ``launch_plan.py``
    ``build_launch_plan`` runs the worker in-process and ``cli._bootstrap_single_process_env`` sets
    RANK/WORLD_SIZE/MASTER_* itself (no torchrun). The schema is ``config/schema.py`` (strict:
    unknown keys fail). Offline = ``data.hidden_states_path`` set; ``training.role: all``,
    ``deployment.mode: local_colocated`` (defaults). ``training/schedule.py``: the optimizer
    horizon is ``(N // batch_size) * epochs // accumulation_steps`` and a plan whose micro-batches
    do not divide into whole accumulation windows is REFUSED unless ``max_steps`` stops at the last
    whole one, which :func:`plan_accumulation` sets. The device is ``cuda`` when available
    (``utils.get_device_type``; ``SPECFORGE_DEVICE`` overrides), with NCCL (``gloo`` on CPU).

Checkpoints and export (:func:`final_checkpoint_dir`, :func:`export_to_hf_folder`)
    ``training/checkpoint.py`` ``CheckpointManager``: ``{output_dir}/{run_id}-step{N}/
    training_state.pt`` (+ ``training_state_rank0.pt``) and a ``{run_id}-latest`` symlink; the
    trainer always saves the final step (``training/trainer.py`` ``Trainer.fit``). The shared state
    holds ``draft_state_dict`` (the draft's weights with the frozen embedding left out, ``d2t``/
    ``t2d`` included). ``export/to_hf.py`` ``export_to_hf(checkpoint, draft_config, out,
    vocab_mapping_path=, embedding_source=)`` writes ``config.json`` + ``model.safetensors``;
    ``eagle3kit import --aux-layer-ids 2,15,27`` reads that layout (``specforge``).

Dependencies on the offline path (verified by running it, on CPU here and on an H200)
    Imported and needed: torch, transformers, accelerate (``set_seed``), safetensors,
    huggingface_hub, pydantic (``config/schema.py``), pyyaml, numpy, tqdm, triton (``core/loss.py``,
    the fused loss kernel; the GPU image's torch brings it) and ``datasets`` (``data/utils.py``
    imports ``Dataset`` at module level, only as a type hint, for the offline collator
    ``DataCollatorWithPadding``; a one-line stub ``class Dataset: pass`` would do). Not imported
    offline (nothing to stub): sglang (``offline_capture`` and online capture only), yunchang
    (``distributed._load_yunchang_globals``, USP sequence parallelism only), wandb / swanlab /
    mlflow / tensorboard (only with ``tracking.report_to``), openai-harmony (``data/parse.py``,
    online prompt preparation only), flash_attn (``attention_backend: fa`` only; it warns on
    import). The wheel pins ``torch==2.11.0``, ``transformers==5.8.1`` and ``sglang==0.5.14``:
    install it with ``pip install --no-deps``. :data:`GPU_WHEELS` lists what the GPU image lacks.

CPU (tests only): ``SPECFORGE_DEVICE=cpu`` runs everything on gloo except two places:
``training/backend.py`` ``prepare_model`` wraps in FSDP, which refuses a CPU-only machine
("FSDP needs a non-CPU accelerator device") unless ``training.fsdp_sharding=NO_SHARD`` (DDP), and
``core/loss.py`` ``LogSoftmaxLoss`` launches a triton kernel, which needs a GPU (on CPU, replace
its ``apply`` with the same formula in torch). On one GPU FSDP switches itself to NO_SHARD.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

SPECFORGE_VERSION = "0.2.0"
DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
FEATURE_KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
FILE_GROUP_SIZE = 2000  # prepare_hidden_states.py --file-group-size default
MANIFEST = "specforge_adapter.json"  # ignored by SpecForge's reader (not *.ckpt)
EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"

#: Wheels the GPU image (Python 3.12, torch 2.11, transformers 5.17; no pydantic, no datasets)
#: needs for the offline path, all from PyPI, installed with ``pip install --no-deps --target``.
GPU_WHEELS = (
    "specforge==0.2.0",  # py3-none-any, 385,203 bytes
    "pydantic==2.14.4",  # py3-none-any, 494,865
    "pydantic-core==2.50.5",  # cp312 manylinux_2_17_x86_64, 2,264,846
    "annotated-types==0.8.0",  # py3-none-any, 13,427
    "typing-inspection==0.4.5",  # py3-none-any, 14,874
    "datasets==5.2.0",  # py3-none-any, 608,276 (or the one-line stub)
    "dill==0.4.1",  # py3-none-any, 120,019 (datasets' need)
    "multiprocess==0.70.19",  # py312-none-any, 150,281 (datasets' need)
)

# The fields SpecForge copies from the target into a generated draft config
# (training/model_loading.py _TARGET_ARCHITECTURE_FIELDS).
TARGET_ARCHITECTURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "initializer_range",
    "attention_bias",
    "attention_dropout",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
)

#: SmolLM2-135M(-Instruct)'s config.json fields that matter to the draft (30 layers).
SMOLLM2_135M_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.041666666666666664,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


# ---------------------------------------------------------------------------- layer numbering


def hf_default_aux_indices(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers as HF ``output_hidden_states`` indices: (2, N//2, N−3)."""
    return [2, num_layers // 2, num_layers - 3]


def specforge_layer_ids(hf_indices: Sequence[int]) -> list[int]:
    """HF ``output_hidden_states`` indices → SpecForge's "output of layer j" ids (j = index − 1)."""
    ids = [int(i) - 1 for i in hf_indices]
    if any(i < 0 for i in ids):
        raise ValueError(f"HF indices {list(hf_indices)}: index 0 (the embeddings) has no SpecForge id")
    return ids


# ---------------------------------------------------------------------------- feature folder


def _field(sample: Any, *names: str):
    for n in names:
        v = sample.get(n) if isinstance(sample, Mapping) else getattr(sample, n, None)
        if v is not None:
            return v
    raise KeyError(f"sample has none of {names}")


def to_specforge_sample(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    aux: torch.Tensor,
    last: torch.Tensor,
    mask_alignment: str = "eagle3kit",
) -> dict[str, torch.Tensor]:
    """One sample as the dict SpecForge's ``load_feature_file`` returns.

    Args:
        input_ids: int [T] token ids.
        loss_mask: bool/int [T], eagle3kit's mask (True on completion tokens).
        aux: [T, 3H] (ascending layers, HF (2, N//2, N−3) by default) or [T, 3, H].
        last: [T, H], the target's last hidden state after the final norm (HF
            ``output_hidden_states[-1]``).
        mask_alignment: ``"eagle3kit"``: ``loss_mask[i] = mask[i+1]`` so SpecForge supervises the
            TTT positions eagle3kit does (see the module docstring); ``"as_is"``: unchanged.
    Returns:
        ``{"input_ids": int64 [T], "loss_mask": int64 [T], "hidden_state": bf16 [1, T, H],
        "aux_hidden_state": bf16 [1, T, 3H]}``, each a compact tensor of its own (a view would make
        ``torch.save`` write the whole parent storage).
    Raises:
        ValueError: shapes disagree, a state is not finite, or an unknown ``mask_alignment``.
    """
    ids = torch.as_tensor(input_ids).reshape(-1).to(torch.int64)
    mask = torch.as_tensor(loss_mask).reshape(-1).bool()
    T = ids.numel()
    if mask.numel() != T:
        raise ValueError(f"loss_mask has {mask.numel()} entries for {T} tokens")
    aux = torch.as_tensor(aux)
    if aux.dim() == 3 and aux.shape[0] == T and aux.shape[1] == 3:
        aux = aux.reshape(T, -1)
    aux = aux.reshape(aux.shape[-2], aux.shape[-1]) if aux.dim() == 3 and aux.shape[0] == 1 else aux
    last = torch.as_tensor(last)
    last = last.reshape(last.shape[-2], last.shape[-1]) if last.dim() == 3 and last.shape[0] == 1 else last
    if last.dim() != 2 or last.shape[0] != T:
        raise ValueError(f"last hidden state has shape {tuple(last.shape)}, expected [{T}, H]")
    H = last.shape[1]
    if tuple(aux.shape) != (T, 3 * H):
        raise ValueError(f"aux states have shape {tuple(aux.shape)}, expected [{T}, {3 * H}] (3 × H)")
    for name, x in (("aux", aux), ("last", last)):
        if not x.is_floating_point() or not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} states are not finite floating point")
    if mask_alignment == "eagle3kit":
        sf_mask = torch.zeros(T, dtype=torch.int64)
        sf_mask[:-1] = mask[1:].to(torch.int64)
    elif mask_alignment == "as_is":
        sf_mask = mask.to(torch.int64)
    else:
        raise ValueError(f"mask_alignment {mask_alignment!r}: 'eagle3kit' or 'as_is'")
    return {
        "input_ids": ids.clone().contiguous(),
        "loss_mask": sf_mask.contiguous(),
        "hidden_state": last.to(torch.bfloat16).reshape(1, T, H).clone().contiguous(),
        "aux_hidden_state": aux.to(torch.bfloat16).reshape(1, T, 3 * H).clone().contiguous(),
    }


def feature_file_path(out_dir: str | Path, index: int, file_group_size: int = FILE_GROUP_SIZE) -> Path:
    """``rows_{g}-{g+size}/data_{index}.ckpt`` (prepare_hidden_states.py ``_get_file_path``)."""
    g = (index // file_group_size) * file_group_size
    return Path(out_dir) / f"rows_{g}-{g + file_group_size}" / f"data_{index}.ckpt"


def write_offline_features(
    samples: Iterable[Any],
    out_dir: str | Path,
    *,
    mask_alignment: str = "eagle3kit",
    file_group_size: int = FILE_GROUP_SIZE,
    max_length: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Write ``samples`` as a SpecForge 0.2.0 offline feature folder (``data.hidden_states_path``).

    Args:
        samples: iterable (a generator is fine: one sample is held at a time) of mappings or objects
            with ``input_ids``/``ids`` (int64 [T]), ``loss_mask``/``mask`` (bool [T]),
            ``aux_hidden_state``/``aux`` (bf16 [T, 3H] or [T, 3, H], ascending layers) and
            ``hidden_state``/``last`` (bf16 [T, H], post-norm last state); an eagle3kit
            ``train.batches.Sample`` with ``aux`` and ``last`` filled qualifies.
        mask_alignment: see :func:`to_specforge_sample`.
        max_length: if given, truncate to it here (SpecForge truncates to ``data.max_length`` on
            load anyway); leave None to write whole samples.
        overwrite: replace an existing folder; otherwise a non-empty ``out_dir`` is refused.
    Returns:
        The manifest also written to ``out_dir/specforge_adapter.json``: samples, tokens,
        positions with a loss mask (after alignment, TTT step 0, before the draft-vocabulary
        filter), hidden size, mean/max length.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} is not empty; pass overwrite=True to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    n = tokens = supervised = longest = 0
    hidden = None
    for i, s in enumerate(samples):
        rec = to_specforge_sample(
            _field(s, "input_ids", "ids"),
            _field(s, "loss_mask", "mask"),
            _field(s, "aux_hidden_state", "aux"),
            _field(s, "hidden_state", "last"),
            mask_alignment,
        )
        if max_length is not None:
            rec = {k: (v[:max_length] if v.dim() == 1 else v[:, :max_length]).clone() for k, v in rec.items()}
        H = rec["hidden_state"].shape[-1]
        if hidden is None:
            hidden = H
        elif H != hidden:
            raise ValueError(f"sample {i}: hidden size {H}, earlier samples {hidden}")
        path = feature_file_path(out, i, file_group_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(rec, tmp)
        os.replace(tmp, path)
        T = rec["input_ids"].numel()
        n += 1
        tokens += T
        longest = max(longest, T)
        # positions with a loss mask at TTT step 0 (before the in-draft-vocabulary filter); its
        # normalizer zeroes loss_mask[-1]
        supervised += int(rec["loss_mask"][:-1].sum())
    if n == 0:
        raise ValueError("no samples to write")
    manifest = {
        "format": "specforge_hidden_states_v1",
        "specforge_version": SPECFORGE_VERSION,
        "writer": "eagle3kit benchmarks/peers/specforge_adapter.py",
        "samples": n,
        "tokens": tokens,
        "loss_mask_positions": supervised,
        "mean_tokens": tokens / n,
        "max_tokens": longest,
        "hidden_size": hidden,
        "mask_alignment": mask_alignment,
        "file_group_size": file_group_size,
        "keys": {
            "input_ids": "int64 [T]",
            "loss_mask": "int64 [T]",
            "hidden_state": "bfloat16 [1, T, H]",
            "aux_hidden_state": "bfloat16 [1, T, 3H]",
        },
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(features_dir: str | Path) -> dict:
    return json.loads((Path(features_dir) / MANIFEST).read_text())


# ---------------------------------------------------------------------------- vocabulary map


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """eagle3kit's invariants (``model/draft_vocab.py`` ``check_maps``) that SpecForge relies on
    without checking: ``arange(Vd) + d2t`` strictly increasing inside [0, V) and equal to
    ``t2d.nonzero()``."""
    tid = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.long()
    V = t2d.numel()
    if tid.numel() and (int(tid.min()) < 0 or int(tid.max()) >= V):
        raise ValueError("d2t maps outside the target vocabulary: d2t must hold offsets, not ids")
    if tid.numel() > 1 and not bool((tid[1:] > tid[:-1]).all()):
        raise ValueError("arange(Vd) + d2t is not strictly increasing")
    if not torch.equal(t2d.bool().nonzero().flatten(), tid):
        raise ValueError("t2d and d2t describe different vocabularies")


def write_vocab_mapping(
    path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor | None = None, vocab_size: int | None = None
) -> Path:
    """Write SpecForge's vocab-mapping file (``model.vocab_mapping_path``): ``torch.save`` of
    ``{"d2t": int64 [Vd] offsets, "t2d": bool [V]}`` — eagle3kit's own maps, unchanged.
    ``t2d`` is built from ``d2t`` when not given (then ``vocab_size`` is required)."""
    d2t = torch.as_tensor(d2t).reshape(-1).to(torch.int64).clone()
    if t2d is None:
        if vocab_size is None:
            raise ValueError("give t2d or vocab_size")
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[torch.arange(d2t.numel()) + d2t] = True
    t2d = torch.as_tensor(t2d).reshape(-1).bool().clone()
    if vocab_size is not None and t2d.numel() != vocab_size:
        raise ValueError(f"t2d has {t2d.numel()} entries, target vocabulary {vocab_size}")
    check_vocab_maps(d2t, t2d)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"d2t": d2t, "t2d": t2d}, path)
    return path


# ---------------------------------------------------------------------------- configs


def _target_config_dict(target_config: Any) -> dict:
    """A target config as a plain dict: a dict, a ``PretrainedConfig``, a config.json path or a
    model folder; a multimodal config's ``text_config`` is used."""
    if isinstance(target_config, Mapping):
        cfg = dict(target_config)
    elif hasattr(target_config, "to_dict"):
        cfg = target_config.to_dict()
    else:
        p = Path(target_config)
        cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    text = cfg.get("text_config")
    if isinstance(text, Mapping) and "hidden_size" not in cfg:
        cfg = dict(text)
    return cfg


def draft_config_dict(
    target_config: Any = SMOLLM2_135M_CONFIG,
    draft_vocab_size: int = 8192,
    aux_layer_ids: Sequence[int] | None = None,
) -> dict:
    """The ``LlamaForCausalLMEagle3`` draft config SpecForge 0.2.0 would generate for the target
    (``training/model_loading.py`` ``_generate_draft_config``), with ``draft_vocab_size``.

    Args:
        target_config: see :func:`_target_config_dict`; default SmolLM2-135M.
        aux_layer_ids: the aux layers the features hold, HF ``output_hidden_states`` indices
            (default EAGLE-3's (2, N//2, N−3)); stored in SpecForge numbering under
            ``eagle_config`` so the exported folder states them.
    """
    t = _target_config_dict(target_config)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers") if k not in t]
    if missing:
        raise ValueError(f"target config lacks {missing}")
    cfg: dict[str, Any] = {}
    for k in TARGET_ARCHITECTURE_FIELDS:
        if t.get(k) is not None:
            cfg[k] = t[k]
    cfg["vocab_size"] = int(t.get("padded_vocab_size") or t["vocab_size"])
    if "head_dim" not in cfg:
        cfg["head_dim"] = int(t["hidden_size"]) // int(t["num_attention_heads"])
    if "rope_theta" not in cfg and isinstance(cfg.get("rope_parameters"), Mapping):
        cfg["rope_theta"] = cfg["rope_parameters"].get("rope_theta")
    if not (1 <= draft_vocab_size <= cfg["vocab_size"]):
        raise ValueError(f"draft_vocab_size {draft_vocab_size} outside [1, {cfg['vocab_size']}]")
    N = int(t["num_hidden_layers"])
    hf_ids = list(aux_layer_ids) if aux_layer_ids is not None else hf_default_aux_indices(N)
    if len(hf_ids) != 3 or not all(1 <= i <= N for i in hf_ids):
        raise ValueError(f"aux_layer_ids {hf_ids}: three HF indices in [1, {N}]")
    cfg.update(
        {
            "architectures": [DRAFT_ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "use_cache": True,
            "draft_vocab_size": int(draft_vocab_size),
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": specforge_layer_ids(sorted(hf_ids)),
                "use_aux_hidden_state": True,
            },
        }
    )
    if cfg.get("pad_token_id") is None:
        cfg["pad_token_id"] = 0
    return cfg


def write_draft_config(
    path: str | Path,
    target_config: Any = SMOLLM2_135M_CONFIG,
    draft_vocab_size: int = 8192,
    aux_layer_ids: Sequence[int] | None = None,
) -> Path:
    """Write :func:`draft_config_dict` as JSON (``model.draft_model_config``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(draft_config_dict(target_config, draft_vocab_size, aux_layer_ids), indent=2) + "\n"
    )
    return path


# ---------------------------------------------------------------------------- target folder


def write_target_dir(
    out_dir: str | Path,
    config: Any,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor | None = None,
) -> dict:
    """The folder SpecForge's offline run reads as ``model.target_model_path``: ``config.json``,
    ``model.safetensors`` with ``model.embed_tokens.weight`` and ``lm_head.weight`` (the embedding
    again when ``lm_head_weight`` is None: a tied target), ``model.safetensors.index.json``.
    Returns ``{"path", "embedding_key", "lm_head_key"}``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _target_config_dict(config) if not isinstance(config, Mapping) else dict(config)
    emb = embed_weight.detach().to("cpu").contiguous().clone()
    head = (
        (lm_head_weight if lm_head_weight is not None else embed_weight)
        .detach()
        .to("cpu")
        .contiguous()
        .clone()
    )
    V, H = emb.shape
    if tuple(head.shape) != (V, H):
        raise ValueError(f"lm_head {tuple(head.shape)} and embedding {tuple(emb.shape)} differ")
    if int(cfg.get("vocab_size", V)) != V or int(cfg.get("hidden_size", H)) != H:
        raise ValueError(
            f"config vocab/hidden {cfg.get('vocab_size')}/{cfg.get('hidden_size')} ≠ weights {V}/{H}"
        )
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
    save_file({EMBED_KEY: emb, LM_HEAD_KEY: head}, str(out / "model.safetensors"), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": emb.numel() * emb.element_size() + head.numel() * head.element_size()},
        "weight_map": {EMBED_KEY: "model.safetensors", LM_HEAD_KEY: "model.safetensors"},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"path": str(out), "embedding_key": EMBED_KEY, "lm_head_key": LM_HEAD_KEY}


def write_target_dir_from_hf_folder(src: str | Path, out_dir: str | Path) -> dict:
    """:func:`write_target_dir` from an HF safetensors folder (single file or sharded)."""
    from safetensors import safe_open

    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    found: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in (EMBED_KEY, LM_HEAD_KEY):
                if k in h.keys() and k not in found:
                    found[k] = h.get_tensor(k)
    if EMBED_KEY not in found:
        raise FileNotFoundError(f"{src}: no {EMBED_KEY} in its *.safetensors")
    return write_target_dir(out_dir, cfg, found[EMBED_KEY], found.get(LM_HEAD_KEY))


def write_target_dir_from_model(model: Any, out_dir: str | Path) -> dict:
    """:func:`write_target_dir` from a loaded HF causal LM (e.g. the target eagle3kit trained with,
    including one dequantized from GGUF), so SpecForge's teacher head and embedding are the same
    weights (SpecForge casts them to bf16: ``TargetHead.from_pretrained``, ``torch_dtype``)."""
    head = model.get_output_embeddings().weight
    emb = model.get_input_embeddings().weight
    tied = head.data_ptr() == emb.data_ptr()
    cfg = (
        model.config.get_text_config().to_dict()
        if hasattr(model.config, "get_text_config")
        else model.config.to_dict()
    )
    cfg["architectures"] = list(getattr(model.config, "architectures", None) or [type(model).__name__])
    return write_target_dir(out_dir, cfg, emb, None if tied else head)


# ---------------------------------------------------------------------------- run config, command


def plan_accumulation(
    num_samples: int,
    num_epochs: int,
    batch_size: int = 1,
    accumulation_steps: int | None = None,
    mean_tokens: float | None = None,
    tokens_per_step: int = 8192,
) -> dict:
    """SpecForge's optimizer plan (``training/schedule.py``).

    ``accumulation_steps`` defaults to round(tokens_per_step / (batch_size · mean_tokens)) so an
    optimizer step sees about ``tokens_per_step`` real tokens (SpecForge counts samples, not
    tokens). ``max_steps`` is set to the last whole accumulation window when the micro-batches do
    not divide evenly (SpecForge refuses such a plan otherwise). Returns ``{"batch_size",
    "accumulation_steps", "max_steps", "optimizer_steps", "micro_batches"}``."""
    if accumulation_steps is None:
        if not mean_tokens:
            raise ValueError("give accumulation_steps or mean_tokens")
        accumulation_steps = max(1, round(tokens_per_step / (batch_size * mean_tokens)))
    micro = (num_samples // batch_size) * num_epochs
    steps, rem = divmod(micro, accumulation_steps)
    if steps < 1:
        raise ValueError(f"{num_samples} samples × {num_epochs} epochs give no optimizer step")
    return {
        "batch_size": batch_size,
        "accumulation_steps": accumulation_steps,
        "max_steps": steps if rem else None,
        "optimizer_steps": steps,
        "micro_batches": micro,
    }


def run_config_dict(
    *,
    target_dir: str | Path,
    draft_config: str | Path,
    vocab_mapping: str | Path | None,
    features_dir: str | Path,
    output_dir: str | Path,
    num_epochs: int = 12,
    learning_rate: float = 3e-4,
    max_length: int = 2048,
    batch_size: int = 1,
    accumulation_steps: int | None = None,
    tokens_per_step: int = 8192,
    ttt_length: int = 7,
    seed: int = 0,
    warmup_ratio: float = 0.03,
    lr_scheduler: str = "cosine",
    max_grad_norm: float = 0.5,
    attention_backend: str = "flex_attention",
    dataloader_num_workers: int = 4,
    log_interval: int = 10,
    run_id: str = "specforge-bench",
    torch_dtype: str = "bfloat16",
    num_samples: int | None = None,
    mean_tokens: float | None = None,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict:
    """The ``specforge train`` config (``config/schema.py``) for an offline single-GPU run.

    Set here to eagle3kit's recipe: ``ttt_length``, ``num_epochs``, ``learning_rate``,
    ``max_length``, ``warmup_ratio`` (SpecForge's default 0.015), ``max_grad_norm`` (0.5, also
    SpecForge's default), ``lr_scheduler`` cosine, ``seed`` (SpecForge's default 42), the draft
    vocabulary (``vocab_mapping``). Everything else is SpecForge's default (AdamW betas (0.9,
    0.999), weight decay 0, bf16 draft with fp32 master weights, loss decay 0.8, flex attention,
    FSDP, which switches itself to NO_SHARD on one GPU). ``num_samples``/``mean_tokens`` default
    to the features folder's manifest; ``extra`` merges further ``{section: {field: value}}``.
    """
    features_dir = Path(features_dir)
    if num_samples is None or mean_tokens is None:
        m = read_manifest(features_dir)
        num_samples = m["samples"] if num_samples is None else num_samples
        mean_tokens = min(m["mean_tokens"], max_length) if mean_tokens is None else mean_tokens
    plan = plan_accumulation(
        num_samples, num_epochs, batch_size, accumulation_steps, mean_tokens, tokens_per_step
    )
    cfg: dict[str, Any] = {
        "run_id": run_id,
        "output_dir": str(Path(output_dir).resolve()),
        "model": {
            "target_model_path": str(Path(target_dir).resolve()),
            "draft_model_config": str(Path(draft_config).resolve()),
            "vocab_mapping_path": str(Path(vocab_mapping).resolve()) if vocab_mapping else "",
            "embedding_key": EMBED_KEY,
            "lm_head_key": LM_HEAD_KEY,
            "load_target_embedding": True,
            "torch_dtype": torch_dtype,
        },
        "data": {
            "hidden_states_path": str(features_dir.resolve()),
            "max_length": max_length,
            "dataloader_num_workers": dataloader_num_workers,
            "cache_dir": str((Path(output_dir) / "cache").resolve()),
        },
        "training": {
            "strategy": "eagle3",
            "num_epochs": num_epochs,
            "batch_size": plan["batch_size"],
            "accumulation_steps": plan["accumulation_steps"],
            "learning_rate": learning_rate,
            "lr_scheduler": lr_scheduler,
            "warmup_ratio": warmup_ratio,
            "max_grad_norm": max_grad_norm,
            "ttt_length": ttt_length,
            "attention_backend": attention_backend,
            "seed": seed,
            "log_interval": log_interval,
            "save_interval": 0,
        },
        "tracking": {"report_to": "none"},
    }
    if plan["max_steps"] is not None:
        cfg["training"]["max_steps"] = plan["max_steps"]
    for section, fields in (extra or {}).items():
        cfg.setdefault(section, {}).update(fields)
    return cfg


def write_run_config(path: str | Path, **kwargs) -> dict:
    """Write :func:`run_config_dict` as YAML (JSON is also accepted by SpecForge; YAML is its
    documented form). Returns the dict."""
    import yaml

    cfg = run_config_dict(**kwargs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def build_train_command(
    config_path: str | Path,
    *,
    python: str = sys.executable,
    pythonpath: str | Path | None = None,
    cuda_device: str | None = "0",
    overrides: Sequence[str] = (),
    cpu: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` that runs SpecForge's offline trainer on one GPU: ``python -m specforge.cli
    train --config <yaml> --role all [section.field=value ...]``. ``env`` holds only what to add to
    the current environment: ``PYTHONPATH`` (``pythonpath``, where the wheels were installed with
    ``pip install --no-deps --target``, before any inherited one), ``CUDA_VISIBLE_DEVICES``,
    ``TOKENIZERS_PARALLELISM=false``, ``PYTHONUNBUFFERED=1``. RANK/WORLD_SIZE/MASTER_* must NOT be
    set (SpecForge sets them for a single process). ``cpu`` (tests only) adds
    ``SPECFORGE_DEVICE=cpu`` and ``training.fsdp_sharding=NO_SHARD``; the fused triton loss still
    needs a GPU then (see the module docstring)."""
    overrides = list(overrides)
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if pythonpath is not None:
        inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        pp = [str(pythonpath)] + [q for q in inherited if q and q != str(pythonpath)]
        env["PYTHONPATH"] = os.pathsep.join(pp)
    if cpu:
        env["SPECFORGE_DEVICE"] = "cpu"
        overrides.append("training.fsdp_sharding=NO_SHARD")
    elif cuda_device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(cuda_device)
    argv = [python, "-m", "specforge.cli", "train", "--config", str(config_path), "--role", "all", *overrides]
    return argv, env


# ---------------------------------------------------------------------------- its log


def log_records(text: str) -> list[dict]:
    """The metric records SpecForge's trainer prints, one per ``log_interval`` optimizer steps
    (``step N: {...}`` lines of ``training/controller.py``'s logger), in order."""
    import ast
    import re

    return [ast.literal_eval(m) for m in re.findall(r"^step \d+: (\{.*\})$", text, re.M)]


def steady_samples_per_s(text: str) -> tuple[float, int]:
    """SpecForge's steady rate from its log: the mean of ``perf/global_samples_per_second`` over
    the log windows after the first (which holds its compilation), in samples a second, and how
    many windows were averaged.

    Raises:
        ValueError: fewer than two windows logged (no steady window to average)."""
    rates = [
        r["perf/global_samples_per_second"]
        for r in log_records(text)
        if "perf/global_samples_per_second" in r
    ]
    if len(rates) < 2:
        raise ValueError(f"SpecForge logged {len(rates)} step-rate records; need 2 or more")
    return sum(rates[1:]) / len(rates[1:]), len(rates) - 1


# ---------------------------------------------------------------------------- checkpoint, export


def final_checkpoint_dir(output_dir: str | Path, run_id: str = "specforge-bench") -> Path:
    """The newest ``{run_id}-step{N}`` checkpoint (via ``{run_id}-latest`` when present)."""
    out = Path(output_dir)
    latest = out / f"{run_id}-latest"
    if latest.exists():
        return latest.resolve()
    steps = []
    for p in out.glob(f"{run_id}-step*"):
        tail = p.name[len(run_id) + len("-step") :]
        if tail.isdigit() and (p / "training_state.pt").is_file():
            steps.append((int(tail), p))
    if not steps:
        raise FileNotFoundError(f"no {run_id}-step*/training_state.pt under {out}")
    return max(steps)[1]


def export_to_hf_folder(
    output_dir: str | Path,
    draft_config: str | Path,
    export_dir: str | Path,
    target_dir: str | Path,
    vocab_mapping: str | Path | None = None,
    run_id: str = "specforge-bench",
) -> Path:
    """SpecForge's own exporter (``specforge.export.to_hf.export_to_hf``) on the final checkpoint:
    ``config.json`` + ``model.safetensors`` (``midlayer.*``, ``fc``, ``norm``, ``lm_head``,
    ``d2t``/``t2d``, the target's embedding). Needs ``specforge`` importable (run it with the
    same PYTHONPATH as training)."""
    from specforge.export.to_hf import export_to_hf

    ckpt = final_checkpoint_dir(output_dir, run_id)
    export_to_hf(
        str(ckpt),
        str(draft_config),
        str(export_dir),
        vocab_mapping_path=str(vocab_mapping) if vocab_mapping else None,
        embedding_source=str(target_dir),
        embedding_key=EMBED_KEY,
    )
    return Path(export_dir)


# ---------------------------------------------------------------------------- one call


def prepare_run(
    samples: Iterable[Any],
    work_dir: str | Path,
    *,
    target_config: Any,
    embed_weight: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    target_model: Any = None,
    target_hf_folder: str | Path | None = None,
    d2t: torch.Tensor,
    t2d: torch.Tensor | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    mask_alignment: str = "eagle3kit",
    pythonpath: str | Path | None = None,
    python: str = sys.executable,
    overwrite: bool = False,
    **run_settings,
) -> dict:
    """Everything under ``work_dir``: ``features/``, ``target/`` (from ``target_model``,
    ``target_hf_folder`` or ``embed_weight``/``lm_head_weight``), ``draft_config.json``,
    ``vocab_mapping.pt``, ``run.yaml``; ``output/`` is where SpecForge will write. Returns the
    paths, the manifest, the run config and ``argv``/``env`` of the training command.
    ``run_settings`` go to :func:`run_config_dict` (``num_epochs``, ``learning_rate``,
    ``batch_size``, ``seed``, ...)."""
    w = Path(work_dir)
    w.mkdir(parents=True, exist_ok=True)
    manifest = write_offline_features(
        samples, w / "features", mask_alignment=mask_alignment, overwrite=overwrite
    )
    if target_model is not None:
        tgt = write_target_dir_from_model(target_model, w / "target")
    elif target_hf_folder is not None:
        tgt = write_target_dir_from_hf_folder(target_hf_folder, w / "target")
    elif embed_weight is not None:
        tgt = write_target_dir(w / "target", _target_config_dict(target_config), embed_weight, lm_head_weight)
    else:
        raise ValueError("give target_model, target_hf_folder or embed_weight")
    dvs = int(torch.as_tensor(d2t).numel())
    draft = write_draft_config(w / "draft_config.json", target_config, dvs, aux_layer_ids)
    vocab = write_vocab_mapping(
        w / "vocab_mapping.pt", d2t, t2d, int(_target_config_dict(target_config)["vocab_size"])
    )
    cfg = write_run_config(
        w / "run.yaml",
        target_dir=tgt["path"],
        draft_config=draft,
        vocab_mapping=vocab,
        features_dir=w / "features",
        output_dir=w / "output",
        num_samples=manifest["samples"],
        mean_tokens=manifest["mean_tokens"],
        **run_settings,
    )
    argv, env = build_train_command(w / "run.yaml", python=python, pythonpath=pythonpath)
    return {
        "features": str(w / "features"),
        "target": tgt["path"],
        "draft_config": str(draft),
        "vocab_mapping": str(vocab),
        "run_config": str(w / "run.yaml"),
        "output_dir": cfg["output_dir"],
        "run_id": cfg["run_id"],
        "manifest": manifest,
        "config": cfg,
        "argv": argv,
        "env": env,
    }
