"""Run speculators 0.9.0's DFlash trainer on eagle3kit's training data (benchmarks only).

speculators trains offline from a folder its own ``speculators prepare-data`` (a ``datasets`` folder)
and ``speculators generate-offline-data`` (vLLM's hidden-state files) write. This module writes that
folder from eagle3kit's samples and target states (:func:`write_offline_data`), a small verifier folder
(:func:`write_verifier_dir`), and builds the command that trains (:func:`build_train_command`). No
speculators code is copied here; the formats were read from speculators 0.9.0 (the wheel installed in
``.venv``), file by file:

Dataset folder (:func:`write_offline_data`)
    * ``train/data.py`` ``ArrowDataset``: ``datasets.load_from_disk(data_path)`` (so a
      ``Dataset.save_to_disk`` folder), columns ``input_ids`` (compared with ``torch.equal`` to the
      hidden-state file's ``token_ids``, so int64), ``loss_mask`` and ``seq_len`` (``_compute_approx_lengths``
      reads it ``with_format(None)``: plain ints); ``data_generation/preprocessing.py`` stores the rows
      with ``dataset.set_format(type="torch")`` and ``loss_mask`` as int64 (1 on assistant tokens).
    * The split is by row order: ``split_idx = int(len(data) * train_data_ratio)``, rows before it
      train, rows after it validate; ``train/dataloader.py`` requires ``0 < train_data_ratio < 1``.
      This module writes eagle3kit's training split first and its validation split after, and
      :func:`data_ratio` picks the ratio whose ``int(N · r)`` is exactly the training count.
    * Hidden states: ``hs_connectors/transfer.py`` ``FileBackend.from_train_args`` reads
      ``--hidden-states-path`` or ``<data_path>/hidden_states``; ``FileTransfer.get_cached(i)`` is
      ``safetensors.torch.load_file("hs_{i}.safetensors")`` with ``i`` the row's index in the whole
      dataset (``ArrowDataset._map_to_file_idx``). ``ArrowDataset._get_raw_data`` reads
      ``token_ids`` [T] and ``hidden_states`` [T, L + 1, H]: ``[:, :-1].flatten(1)`` are the aux
      states concatenated in file order ([T, L·H], the model's ``fc`` input) and ``[:, -1]`` is
      ``verifier_last_hidden_states``. ``--on-missing raise`` makes a missing file fatal instead of
      asking a vLLM server (the default ``generate``).
    * The last state is the target's final state BEFORE its final norm: ``models/dflash/core.py``
      ``_backbone_forward`` computes the teacher as ``verifier_lm_head(verifier_norm(last))`` with
      ``verifier_norm`` loaded from the verifier's ``model.norm.weight`` (``model.py``
      ``_load_verifier_weights``). eagle3kit's ``Sample.last`` is post-norm, so the run module
      captures the final norm's input (``eagle3kit.model.target.capture_layer_inputs(final_norm=…)``).
    * Layer ids: speculators names aux states by Hugging Face ``output_hidden_states`` index
      (``models/utils.py`` ``resolve_target_layer_ids``: valid ids 0 … N, default [2, N//2, N − 3];
      ``convert/dflash/converter.py`` maps z-lab's ``dflash_config.target_layer_ids`` t to t + 1),
      eagle3kit's ``resolve_aux_layer_ids`` convention too; eagle3kit's ``capture_layer_inputs`` takes
      HF index i as the input of decoder layer i, i.e. ``output_hidden_states[i]``.
    * ``train/data.py`` ``CollateFn``: samples are packed into one row of ``total_seq_len`` tokens
      (``document_ids`` separate them); ``train/distributed_batch_sampler.py`` truncates samples
      longer than ``total_seq_len``, so :func:`build_train_command` never sets it below the longest.

Loss mask (``models/dflash/utils.py`` ``select_anchors``, ``core.py`` ``_backbone_forward``)
    Anchors are positions p with ``loss_mask[p]`` (not in the packed row's last ``block_size``); slot
    k ≥ 1 of the block at p is trained on the teacher at p + k − 1 (it predicts token p + k) where
    ``loss_mask[p + k]``. eagle3kit's DFlash (``train/dflash.py``) supervises the same slots (mask at
    p + k) but also anchors at the last prompt token (p with ``mask[p + 1]``). No single mask can
    give both, so the mask is written as speculators' own data preparation writes it: eagle3kit's
    completion mask unchanged (1 on reply tokens).

Vocabulary
    ``train/cli.py`` ``_load_mappings``: ``--d2t-path``/``--t2d-path`` are ``numpy.load`` files;
    ``train/vocab_mapping.py`` ``build_vocab_mappings_from_distribution``: d2t int64 [Vd] of offsets
    (target id = draft id + d2t[draft id]), t2d bool [V] — eagle3kit's convention. Without them and
    without ``--draft-vocab-size`` (``parse_vocab_mappings``) speculators uses the full verifier
    vocabulary. eagle3kit's DFlash drafter has no draft vocabulary (``model/dflash.py``: the target's
    lm_head, full vocabulary), and its DFlash reader drops a reduced ``lm_head`` (``read_dflash``),
    so the benchmark row trains with the full vocabulary and passes neither file.

Verifier folder (:func:`write_verifier_dir`)
    ``AutoConfig.from_pretrained`` / ``PretrainedConfig.get_config_dict`` (``config.json``: layer count,
    widths, heads, rope, ``architectures`` for ``VerifierConfig.from_pretrained``) and
    ``utils/loading.py`` ``load_model_layers(["embed_tokens.weight", "lm_head.weight",
    "model.norm.weight"])`` (an index or a single ``model.safetensors``; suffix matching; a missing
    ``lm_head.weight`` falls back to the embedding). No tokenizer is read when ``--mask-token-id`` is
    given (``train/utils.py`` ``resolve_mask_token_id``).

Command (:func:`build_train_command`)
    ``train/__main__.py``: ``python -m speculators.train`` = ``main(TrainConfig.resolve())`` (the
    ``speculators train`` console command's body); flags from ``train/config/schema.py``
    (``--flag-name`` per field). Without ``LOCAL_RANK`` (``train/distributed.py``) it runs one process;
    ``train/trainer.py`` then moves the model to ``local_rank`` 0, i.e. ``cuda:0`` (no CPU path).
    DFlash defaults (``schema.py`` ``_resolve_derived_defaults``): ``--loss-fn ce`` (``losses``: cross
    entropy on the argmax of the verifier's logits over the draft vocabulary, i.e. the target's greedy
    token — distillation of its top-1, not of the data's tokens), ``--per-position-loss-weight dpace``,
    5 layers, block 16 (set to 8 here), optimizer muon (+AdamW for non-matrices), linear schedule,
    every layer sliding-window 2048 unless ``--full-attention-indices``. Checkpoints:
    ``train/checkpointer.py`` ``SingleGPUCheckpointer.save_checkpoint``: ``<save_path>/<epoch>/``
    (``save_pretrained``: ``config.json`` with ``speculators_model_type: dflash`` and
    ``model.safetensors`` in bf16 without embedding, verifier head/norm or a full-vocabulary lm_head),
    every ``checkpoint_freq`` epochs and always after epoch 0 (``trainer.py`` ``maybe_save_checkpoint``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECULATORS_VERSION = "0.9.0"
#: what the GPU image lacks for this row (carried as wheels, see the device notes in
#: benchmarks/variants_device.sh); imports checked there: speculators, speculators.train.trainer.
#: openai 2.x: openai 3.x imports ``httpx2``, which the image lacks (seen on the device 2026-12-05).
GPU_WHEELS = (
    "speculators==0.9.0",
    "hs-connectors==0.9.0",
    "loguru==0.7.3",
    "pydantic-settings==2.16.3",
    "python-dotenv==1.2.4",
    "openai==2.54.0",
    "jiter==0.19.0",
    "distro==1.9.0",
    "sniffio==1.3.1",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "datasets==5.1.0",
    "dill==0.4.1",
    "multiprocess==0.70.19",
)


def data_ratio(n_train: int, n_total: int) -> float:
    """The ``--train-data-ratio`` r with ``int(n_total * r) == n_train`` (speculators' split rule).

    Raises ValueError when a count is not an int or no row is left to validate (speculators requires
    r < 1)."""
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (n_train, n_total)):
        raise ValueError(f"row counts must be ints, not {n_train!r} and {n_total!r}")
    if not 0 < n_train < n_total:
        raise ValueError(
            f"need 0 < training rows ({n_train}) < all rows ({n_total}): speculators validates on the rest"
        )
    r = (n_train + 0.5) / n_total
    if int(n_total * r) != n_train:
        raise ValueError(f"no float ratio splits {n_total} rows at {n_train}")
    return r


def write_offline_data(
    out_dir: str | Path,
    rows: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """Write speculators' offline data folder: ``out_dir`` (a ``datasets`` folder with ``input_ids``,
    ``loss_mask``, ``seq_len``) and ``out_dir/hidden_states/hs_{i}.safetensors``.

    ``rows`` yields, in dataset order, ``(ids int [T], mask [T], aux [T, L·H], last [T, H])`` with
    ``aux`` the L aux states concatenated in ascending layer order and ``last`` the target's final
    state before its final norm. Rows are written as they come (the states are never all in memory).
    Returns a summary (rows, layers, hidden size, longest row).

    Raises ValueError on no rows, a row of no tokens, aux of no layers, ids of a non-integer dtype,
    a mask of a non-integer, non-bool dtype or with values other than 0 and 1, or mismatched shapes."""
    from datasets import Dataset

    out = Path(out_dir)
    hs = out / "hidden_states"
    hs.mkdir(parents=True, exist_ok=True)
    ids_col, mask_col, len_col = [], [], []
    layers = hidden = None
    for i, (ids, mask, aux, last) in enumerate(rows):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"row {i}: ids must be integers, not {ids.dtype}")
        if mask.dtype.is_floating_point or mask.dtype.is_complex:
            raise ValueError(f"row {i}: the loss mask must be integers or bools, not {mask.dtype}")
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError(f"row {i}: the loss mask holds values other than 0 and 1")
        ids = ids.reshape(-1).to(torch.int64).cpu()
        T, H = last.shape
        if T == 0:
            raise ValueError(f"row {i}: no tokens")
        if aux.shape[0] != T or ids.numel() != T or mask.numel() != T or aux.shape[1] % H:
            raise ValueError(
                f"row {i}: ids {tuple(ids.shape)}, mask {tuple(mask.shape)}, "
                f"aux {tuple(aux.shape)}, last {tuple(last.shape)}"
            )
        L = aux.shape[1] // H
        if L == 0:
            raise ValueError(f"row {i}: aux {tuple(aux.shape)} holds no layer")
        if layers is None:
            layers, hidden = L, H
        elif (L, H) != (layers, hidden):
            raise ValueError(f"row {i}: {L} layers of {H}, earlier rows {layers} of {hidden}")
        states = torch.cat([aux.reshape(T, L, H), last.reshape(T, 1, H)], dim=1).to(dtype).cpu().contiguous()
        save_file({"hidden_states": states, "token_ids": ids.contiguous()}, str(hs / f"hs_{i}.safetensors"))
        ids_col.append(ids.tolist())
        mask_col.append(mask.reshape(-1).to(torch.int64).cpu().tolist())
        len_col.append(T)
    if not len_col:
        raise ValueError(f"{out}: no rows to write")
    ds = Dataset.from_dict({"input_ids": ids_col, "loss_mask": mask_col, "seq_len": len_col})
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    summary = {
        "rows": len(len_col),
        "aux_layers": layers,
        "hidden_size": hidden,
        "longest": max(len_col, default=0),
        "tokens": sum(len_col),
        "dtype": str(dtype).removeprefix("torch."),
    }
    (out / "speculators_adapter.json").write_text(json.dumps(summary, indent=2))
    return summary


def write_verifier_dir(
    target_config, embed: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor | None, out_dir
) -> Path:
    """The verifier folder speculators reads offline: ``config.json`` (the target's text config) and
    ``model.safetensors`` with ``model.embed_tokens.weight``, ``model.norm.weight`` and
    ``lm_head.weight`` (the embedding again for a tied target), in the target's dtype."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    head = embed if lm_head is None else lm_head
    tensors = {"model.embed_tokens.weight": embed, "model.norm.weight": norm, "lm_head.weight": head}
    save_file(
        {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(out / "model.safetensors")
    )
    return out


def build_train_command(
    *,
    verifier: str | Path,
    data_path: str | Path,
    save_path: str | Path,
    log_dir: str | Path,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    train_ratio: float,
    epochs: int,
    lr: float,
    seed: int,
    total_seq_len: int,
    block_size: int = 8,
    num_layers: int = 5,
    full_attention: bool = True,
    attn_impl: str | None = None,
    loss_implementation: str | None = None,
    num_workers: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """argv of ``python -m speculators.train`` for DFlash on the folders this module writes.

    ``target_layer_ids``: HF ``output_hidden_states`` indices (speculators' convention).
    ``full_attention``: every draft layer full attention (eagle3kit's DFlash network, what its reader
    and evaluator run), not speculators' default sliding window of 2048, with
    ``--sliding-window-non-causal`` (no effect on full-attention layers, which train non-causal in the
    block; it writes ``sliding_window_non_causal: true``, without which vLLM 0.32 and eagle3kit's
    ``check`` read the drafter as causal in the block). ``attn_impl``/
    ``loss_implementation``: left to speculators' defaults (flex attention, fused loss) unless given
    (``sdpa``/``eager`` on a CPU). A checkpoint after epoch 0 and the last (``--checkpoint-freq``
    ``epochs``)."""
    argv = [python, "-m", "speculators.train", "--speculator-type", "dflash"]
    argv += ["--verifier-name-or-path", str(verifier), "--data-path", str(data_path)]
    argv += ["--hidden-states-backend", "file", "--on-missing", "raise"]
    argv += ["--save-path", str(save_path), "--log-dir", str(log_dir), "--no-resume-from-checkpoint"]
    argv += ["--target-layer-ids", *map(str, target_layer_ids), "--mask-token-id", str(mask_token_id)]
    argv += ["--num-layers", str(num_layers), "--block-size", str(block_size)]
    if full_attention:
        # full-attention layers train non-causal whatever this says (models/dflash/attention.py); it
        # only makes the config say so, else vLLM's speculators reader serves the block causal
        argv += ["--full-attention-indices", *map(str, range(num_layers)), "--sliding-window-non-causal"]
    argv += ["--train-data-ratio", repr(train_ratio), "--total-seq-len", str(total_seq_len)]
    argv += ["--epochs", str(epochs), "--lr", repr(lr), "--seed", str(seed)]
    argv += ["--checkpoint-freq", str(epochs)]
    if attn_impl:
        argv += ["--draft-attn-impl", attn_impl]
    if loss_implementation:
        argv += ["--loss-implementation", loss_implementation]
    if num_workers is not None:
        argv += ["--num-workers", str(num_workers)]
    return argv


def final_checkpoint(save_path: str | Path, epochs: int) -> Path:
    """``<save_path>/<epochs − 1>``: the last epoch's folder (speculators keeps no best unless asked).
    ValueError when ``epochs`` < 1 (no epoch, no folder)."""
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, not {epochs}")
    folder = Path(save_path) / str(epochs - 1)
    if not (folder / "config.json").is_file() or not list(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"{folder}: no speculators checkpoint (config.json + *.safetensors)")
    return folder


def train_env(speculators_path: str | None) -> dict:
    """Environment additions: ``PYTHONPATH`` for a speculators outside the interpreter's site-packages,
    and no hub access (everything is local)."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if speculators_path:
        import os

        env["PYTHONPATH"] = os.pathsep.join(p for p in (speculators_path, os.environ.get("PYTHONPATH")) if p)
    return env
