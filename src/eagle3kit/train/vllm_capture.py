"""A vLLM KV-connector plugin that writes the aux hidden states vLLM's ``extract_hidden_states``
speculative method captures, on the CPU build as on GPUs.

vLLM 0.32's ``ExampleHiddenStatesConnector`` copies each finished request's states to pinned host
memory on a CUDA stream; on the CPU build that stops the engine with ``RuntimeError: pin_memory=True
requires a CUDA or other accelerator backend`` (``example_hidden_states_connector.py``,
``_submit_async_write``). This subclass keeps everything else and, when the cache lives on the CPU,
writes synchronously. It is loaded through vLLM's own plugin mechanism, never by editing vLLM:

    kv_transfer_config={"kv_connector": "CPUHiddenStatesConnector",
                        "kv_connector_module_path": "eagle3kit.train.vllm_capture", "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"shared_storage_path": DIR}}

Each request's file holds ``hidden_states`` [T, n_aux, H] and ``token_ids`` [T]. A finished
request is reported as done sending, as the parent class does once its copy completes, so vLLM
frees its cache blocks. :class:`CPUFP8HiddenStatesConnector` does the same for hs-connectors' fp8
connector (the ``fp8`` transport); both files are read through hs-connectors
(:mod:`eagle3kit.train.transport`).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector
from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from eagle3kit.core.config import ConfigError
from eagle3kit.core.engines import launched_env, vllm_launch
from eagle3kit.data.backends import release_vllm_engine, shutdown_vllm
from eagle3kit.model.target_export import serving_folder
from eagle3kit.train.transport import connector_config, read_captured, states_reader


class _Done:
    """A copy event that has completed (the CPU write is synchronous)."""

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous write when the cache is on the CPU."""

    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + block_ids[:, None] * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        tensors = {
            "hidden_states": extract_from_kv_cache(self._kv_cache, slots, n).clone(),
            "token_ids": pending.token_ids.clone(),
        }
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            self.save_states(tensors, pending.filename, self._capture_metadata())
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        # reported as done sending by get_finished, so the scheduler frees the request's cache blocks
        # (without it the cache fills after a few dozen requests and the engine waits forever)
        self._req_copy_events[pending.req_id] = _Done()

    def _capture_metadata(self) -> dict | None:
        """``{"layer_ids": "[…]"}``, the layer ids this engine captures (the trainer checks them)."""
        try:
            hf = self._vllm_config.speculative_config.draft_model_config.hf_config
            return {"layer_ids": json.dumps([int(i) for i in hf.eagle_aux_hidden_state_layer_ids])}
        except (AttributeError, TypeError):
            return None

    @staticmethod
    def save_states(tensors: dict[str, torch.Tensor], filename: str, metadata: dict | None = None) -> None:
        """Write one request's ``hidden_states`` [T, n_ids, H] and ``token_ids`` [T] as they are
        (``metadata``: the safetensors header's, the captured ``layer_ids``)."""
        save_file(tensors, filename, metadata=metadata)


class CPUFP8HiddenStatesConnector(CPUHiddenStatesConnector, FP8HiddenStatesConnector):
    """hs-connectors' ``FP8HiddenStatesConnector`` (per-token float8 e4m3 states, the ``fp8``
    transport of :mod:`eagle3kit.train.transport`) with the same synchronous CPU write: on GPUs
    its own asynchronous write runs, on the CPU build the states are quantized by hs-connectors'
    ``quantize_tensor_to_fp8`` and written here."""

    @staticmethod
    def save_states(tensors: dict[str, torch.Tensor], filename: str, metadata: dict | None = None) -> None:
        """Write ``hidden_states`` as float8 e4m3 [T, n_ids, H] with ``hidden_states_scales`` fp32
        [T, 1, 1] (hs-connectors' layout, which its ``FP8Transfer`` reads) and ``token_ids`` [T]."""
        fp8, scales = quantize_tensor_to_fp8(tensors["hidden_states"])
        save_file({**tensors, "hidden_states": fp8, SCALES_KEY: scales}, filename, metadata=metadata)


def engine_model_folder(target, engine_model: str | None) -> str:
    """The checkpoint vLLM loads for capture: ``engine_model`` when given (the checkpoint you serve,
    quantized or not), else :func:`eagle3kit.model.target_export.serving_folder` (the target's own folder, or a
    float32 export of a GGUF target).

    Raises:
        ConfigError: ``engine_model`` is not a folder holding ``config.json``."""

    if engine_model:
        p = os.path.expanduser(engine_model)
        if not os.path.isfile(os.path.join(p, "config.json")):
            raise ConfigError(
                f"extract.engine_model {engine_model!r} is not a model folder with config.json; give the "
                "folder of the checkpoint vLLM serves (or leave it unset to use the target)"
            )
        return p
    return str(serving_folder(target))


#: vllm.LLM arguments eagle3kit sets itself for capture; extract.engine_args may not replace them
RESERVED_ARGS = ("model", "speculative_config", "kv_transfer_config")


def check_engine_model(folder: str, target) -> int:
    """Refuse an engine checkpoint that is not the target's model: its ``config.json`` must give
    the target's layer count, hidden size and vocabulary size (a quantized copy of the target
    passes). Returns its context limit in tokens (``max_position_embeddings``, 0 when unknown).

    Raises:
        ConfigError: a mismatch (both values named), or an unreadable ``config.json``."""

    try:
        cfg = json.loads(open(os.path.join(folder, "config.json")).read())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot read {folder}/config.json ({e}); give extract.engine_model a model folder"
        ) from None
    text = cfg.get("text_config") or cfg
    for key, want in (
        ("num_hidden_layers", target.num_layers),
        ("hidden_size", target.hidden_size),
        ("vocab_size", target.vocab_size),
    ):
        got = text.get(key, cfg.get(key))
        if got is not None and int(got) != int(want):
            raise ConfigError(
                f"extract.engine_model {folder} is not the target's model: its {key} is {got}, the "
                f"target's {want}; give the checkpoint of the target you serve (quantized is fine)"
            )
    return int(text.get("max_position_embeddings", cfg.get("max_position_embeddings")) or 0)


class VLLMCapture:
    """An in-process vLLM engine that returns, for token samples, the hidden states it computes
    while serving them: its ``extract_hidden_states`` speculative method with
    :class:`CPUHiddenStatesConnector` (which defers to vLLM's own connector on GPUs).

    The captured ids are the aux ids and the last layer's id N (vLLM numbers a state by the layer it
    enters, as HF's ``hidden_states`` index does (docs/conventions.md, layer ids); id N is the pre-norm output of the
    last layer, from which the teacher is computed as ``final_norm(h_N)``, the norm applied once).

    Args:
        model: the folder vLLM loads (:func:`engine_model_folder`).
        layer_ids: the HF indices to capture, ascending (aux ids, then N).
        store: a scratch folder for the connector's files (emptied as they are read).
        max_model_len: the longest sample in tokens (one more is generated).
        dtype: the engine's dtype (``float32``, ``bfloat16``, ``auto``).
        engine_args: more ``vllm.LLM`` arguments, overriding the defaults here (for example
            ``quantization``, ``tensor_parallel_size``, ``gpu_memory_utilization``).
    """

    def __init__(
        self,
        model: str,
        layer_ids: list[int],
        store,
        max_model_len: int,
        dtype: str = "auto",
        engine_args: dict | None = None,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

        clash = sorted(set(engine_args or {}) & set(RESERVED_ARGS))
        if clash:
            raise ConfigError(
                f"extract.engine_args may not set {', '.join(clash)}: eagle3kit sets them for capture "
                "(give the checkpoint as extract.engine_model)"
            )
        kv = os.environ.get("EAGLE3KIT_VLLM_KV_BYTES", str(1 << 30))
        if not kv.isdigit():
            raise ConfigError(
                f"EAGLE3KIT_VLLM_KV_BYTES={kv!r} must be a whole number of bytes (for example 1073741824)"
            )
        from vllm import LLM  # noqa: PLC0415 (after the environment above: vLLM reads it on import)

        release_vllm_engine()  # one engine per process: a cached generate engine's groups would clash
        self.store = str(store)
        os.makedirs(self.store, exist_ok=True)
        kw = {
            "model": model,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "enable_prefix_caching": False,
            "max_num_seqs": 8,
            "seed": 0,
        }
        if not torch.cuda.is_available():  # the CPU build: no CUDA graphs, a fixed KV-cache size
            kw |= {"enforce_eager": True, "kv_cache_memory_bytes": int(kv)}

        launch = vllm_launch(model, speculative=True)  # the settings the serving engine (EAGLE-3) runs with
        kw |= launch.engine_args | dict(engine_args or {})
        kw["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        }
        kw["kv_transfer_config"] = connector_config("file", self.store)
        try:
            with launched_env(launch):
                self.llm = LLM(**kw)
        except (
            Exception
        ) as e:  # an unknown argument, a value vLLM refuses, no room for the cache, bad weights
            shutil.rmtree(self.store, ignore_errors=True)
            first = " ".join(str(e).split())[:400] or type(e).__name__
            raise ConfigError(
                f"vLLM could not start the capture engine ({type(e).__name__}: {first}); check "
                f"extract.engine_args {dict(engine_args or {})}, the checkpoint {model} (a damaged "
                "float32 export in eagle3kit's cache: delete that folder and rerun) and, on a CPU, "
                "EAGLE3KIT_VLLM_KV_BYTES (the KV cache size in bytes)"
            ) from None
        except BaseException:
            shutil.rmtree(self.store, ignore_errors=True)
            raise
        self.n_ids = len(layer_ids)

    def capture(self, samples: list[torch.Tensor]) -> list[torch.Tensor]:
        """The captured states of each sample (int64 [T] token ids): ``[T, n_ids, H]`` in the
        engine's dtype, on the CPU, in the order given.

        Raises:
            ConfigError: vLLM refused a sample (longer than its ``max_model_len``, say).
            RuntimeError: vLLM returned no ``hidden_states_path`` (the capture method is not active).
            DataError: vLLM wrote no file for a sample, or one for other tokens or layers
                (:func:`eagle3kit.train.transport.read_captured`)."""
        from vllm import SamplingParams  # noqa: PLC0415 (the engine's own module, imported once it runs)

        prompts = [{"prompt_token_ids": [int(t) for t in s]} for s in samples]
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        try:
            outs = self.llm.generate(prompts, greedy, use_tqdm=False)
            # the last finished request's save is submitted at the engine's next step: one tiny request
            flush = self.llm.generate(
                [{"prompt_token_ids": prompts[0]["prompt_token_ids"][:4]}], greedy, use_tqdm=False
            )
        except ValueError as e:
            raise ConfigError(
                f"vLLM refused a sample ({' '.join(str(e).split())[:300]}); the longest here has "
                f"{max(len(s) for s in samples)} tokens: raise max_model_len in extract.engine_args "
                "or drop longer samples (tokenize.max_length)"
            ) from None
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        if any(p is None for p in paths):
            raise RuntimeError(
                "vLLM returned no hidden_states_path: the extract_hidden_states method or the "
                "eagle3kit.train.vllm_capture connector was not active in this engine"
            )
        reader = states_reader(self.store)  # waits for vLLM's asynchronous writer (GPUs) to finish
        states = [read_captured(reader, p, s, self.n_ids) for s, p in zip(samples, paths)]
        for p in paths + [(flush[0].kv_transfer_params or {}).get("hidden_states_path") or ""]:
            for f in (p, p + ".lock"):
                if f and os.path.exists(f):
                    os.remove(f)
        return states

    def close(self) -> None:
        """Shut the engine down, free its memory and remove the scratch folder."""

        shutdown_vllm(self.__dict__.pop("llm"))  # no reference left here while vLLM tears down
        shutil.rmtree(self.store, ignore_errors=True)
