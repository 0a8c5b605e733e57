"""How captured states travel from a vLLM capture engine to eagle3kit: hs-connectors' file
backends (PyPI ``hs-connectors`` 0.9, the library speculators' online trainer reads vLLM's
states with), shared by ``extract --backend vllm`` and ``train.online_from``.

A capture engine writes one safetensors file per request where the request's
``kv_transfer_params.hidden_states_path`` says (vLLM's ``ExampleHiddenStatesConnector`` layout):

* ``file``: ``hidden_states`` [T, n_ids, Ht] in the engine's dtype, ``token_ids`` int64 [T];
* ``fp8``: the same with ``hidden_states`` in float8 e4m3 and ``hidden_states_scales`` fp32
  [T, 1, 1], one scale per token over all its states (``hs_connectors.fp8_utils``: scale =
  amax / 448, restored = fp8 · scale), about a quarter of the fp32 bytes and half of bf16.

Reading is hs-connectors' (:class:`hs_connectors.FP8Transfer`, which waits for the writer's lock,
loads the file and dequantizes an fp8 one); what eagle3kit adds is the check that a file holds
the sample's own tokens and the transport the trainer was told (a server writing fp8 while the
trainer reserves bf16 bytes would be a silent mismatch; the other way round, its buffer bound
would not hold). The writers on vLLM's side are :mod:`eagle3kit.train.vllm_capture`'s
connectors (hs-connectors' own need CUDA); between machines hs-connectors' Mooncake backend is the
plan (docs/online.md), not wired in.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hs_connectors import FP8Transfer
from hs_connectors.fp8_utils import SCALES_KEY
from safetensors import SafetensorError, safe_open

from eagle3kit.core.rundir import DataError
from eagle3kit.train.state_checks import FP8_REPEAT_TOLERANCE, state_problem

TRANSPORTS = ("file", "fp8")


class DamagedCaptureError(DataError):
    """A capture file that cannot be read (cut short, or not a capture file): the sample's states
    can be requested again."""


CONNECTORS = {"file": "CPUHiddenStatesConnector", "fp8": "CPUFP8HiddenStatesConnector"}
CONNECTOR_MODULE = "eagle3kit.train.vllm_capture"
#: the same layouts written by vLLM's and hs-connectors' own connectors (CUDA only): a capture server in
#: an environment without eagle3kit (they record no layer ids in the file)
ENGINE_CONNECTORS = {
    "file": (
        "ExampleHiddenStatesConnector",
        "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
    ),
    "fp8": ("FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector"),
}


def connector_config(transport: str, store: str | Path, custom_paths: bool = False, own: bool = True) -> dict:
    """vLLM's ``kv_transfer_config`` for a capture engine writing ``transport``'s files to
    ``store`` (or, with ``custom_paths``, where each request's ``hidden_states_path`` says), through
    eagle3kit's connectors (``own``; they run on the CPU build too) or vLLM's / hs-connectors' own
    (:data:`ENGINE_CONNECTORS`).

    Raises:
        ValueError: an unknown transport (the config's Literal refuses it first)."""
    if transport not in CONNECTORS:
        raise ValueError(f"transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
    extra: dict = {"shared_storage_path": str(store)}
    if custom_paths:
        extra["allow_custom_save_path"] = True
    name, module = (CONNECTORS[transport], CONNECTOR_MODULE) if own else ENGINE_CONNECTORS[transport]
    return {
        "kv_connector": name,
        "kv_role": "kv_producer",
        "kv_connector_module_path": module,
        "kv_connector_extra_config": extra,
    }


HEADER_BYTES = 1024  # a capture file's safetensors header (about 150-250 bytes) and more: per file


def bytes_per_token(transport: str, n_ids: int, hidden: int, dtype_bytes: int) -> int:
    """Bytes of one token in a capture file: its int64 token id and its states, ``n_ids · hidden ·
    dtype_bytes`` (``file``, the engine's dtype) or ``n_ids · hidden + 4`` (``fp8``: one byte a
    value, one fp32 scale). A file of T tokens takes at most ``T · bytes_per_token + HEADER_BYTES``."""
    return 8 + (n_ids * hidden + 4 if transport == "fp8" else n_ids * hidden * dtype_bytes)


def states_reader(folder: str | Path) -> FP8Transfer:
    """hs-connectors' reader for capture files (plain or fp8; fp8 dequantized to float32)."""
    return FP8Transfer(Path(folder), dequantize_dtype=torch.float32)


def read_captured(
    reader: FP8Transfer,
    path: str | Path,
    ids: torch.Tensor,
    n_ids: int,
    transport: str | None = None,
    layer_ids: list[int] | None = None,
) -> torch.Tensor:
    """A capture file's states for a sample: ``hidden_states[:T]`` [T, n_ids, Ht] (the engine's
    dtype; float32 for fp8) after checking its ``token_ids`` are the sample's ``ids`` [T] and,
    when ``transport`` is given, that the file is of that transport and, when ``layer_ids`` is given
    and the writer recorded them (eagle3kit's connectors on the CPU build do; vLLM's own GPU write
    does not), that it captured those layers.

    Raises:
        DataError: no file, a damaged one, a file of other tokens, of another number of states a
            token, or of another transport than the one named (naming the setting to change)."""
    path = str(path)
    try:
        fp8 = captured = None
        if transport is not None and Path(path).exists():
            with safe_open(path, "pt") as f:  # the keys and header only
                fp8 = SCALES_KEY in f.keys()
                captured = (f.metadata() or {}).get("layer_ids")
        got = reader.get_generated({"hidden_states_path": path})
        if got is not None and not {"token_ids", "hidden_states"} <= set(got):
            raise KeyError(f"it holds {sorted(got)}, not token_ids and hidden_states")
    except (SafetensorError, OSError, TimeoutError, KeyError, ValueError) as e:
        raise DamagedCaptureError(
            f"{path}: not a readable capture file ({type(e).__name__}: {str(e)[:200]}), written by a "
            "server that stopped mid-write or by another program; delete it and rerun (train resumes "
            "and requests that sample again)"
        ) from None
    if fp8 is not None and fp8 != (transport == "fp8"):
        raise DataError(
            f"{path}: the capture server writes {'fp8' if fp8 else 'plain'} states but "
            f"train.online_transport is {transport}; set it to {'fp8' if fp8 else 'file'} (or start the "
            "server with the command `eagle3kit capture-server --transport …` prints)"
        )
    if got is None:
        raise DataError(f"{path}: the capture engine wrote no states there")
    if layer_ids is not None and captured is not None and json.loads(captured) != list(layer_ids):
        raise DataError(
            f"{path}: the capture server captures layers {json.loads(captured)}, this trainer needs "
            f"{list(layer_ids)} (its aux ids, then N); start the server with the command "
            "`eagle3kit capture-server -c CONFIG` prints for this run's config"
        )
    tok, h = got["token_ids"], got["hidden_states"]
    n = ids.numel()
    if tok[:n].tolist() != ids.tolist():
        raise DataError(f"{path}: holds the states of other tokens than the sample's; delete it and rerun")
    if h.shape[1] != n_ids:
        raise DataError(
            f"{path}: {h.shape[1]} states a token, expected {n_ids} (the server captures other layers)"
        )
    if h.shape[0] < n:
        raise DataError(
            f"{path}: holds {h.shape[0]} rows of states for the sample's {n} tokens (its token ids are all there): "
            "the engine wrote part of the request's states; delete it and rerun, and if it recurs, the server's "
            "connector is at fault"
        )
    names = [f"layer {i}" for i in layer_ids] if layer_ids else [f"state {j}" for j in range(n_ids)]
    if (
        fp8 is None
    ):  # the file's transport, when the caller named none: fp8 copies of one vector differ a little
        with safe_open(path, "pt") as f:
            fp8 = SCALES_KEY in f.keys()
    problem = state_problem(h[:n], names, FP8_REPEAT_TOLERANCE if fp8 else 1e-6, ids=ids.reshape(-1)[:n])
    if problem:
        raise DataError(
            f"{path}: {problem}, which no target computes: the engine wrote states it did not fill (a connector "
            "or capture fault) or the file was overwritten; delete it and rerun, and if it recurs, check the server"
        )
    return h[:n]
