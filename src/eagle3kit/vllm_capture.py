"""A vLLM KV-connector plugin that writes the aux hidden states vLLM's ``extract_hidden_states``
speculative method captures, on the CPU build as on GPUs (issue 11).

vLLM 0.32's ``ExampleHiddenStatesConnector`` copies each finished request's states to pinned host
memory on a CUDA stream; on the CPU build that stops the engine with ``RuntimeError: pin_memory=True
requires a CUDA or other accelerator backend`` (``example_hidden_states_connector.py``,
``_submit_async_write``). This subclass keeps everything else and, when the cache lives on the CPU,
writes synchronously. It is loaded through vLLM's own plugin mechanism, never by editing vLLM:

    kv_transfer_config={"kv_connector": "CPUHiddenStatesConnector",
                        "kv_connector_module_path": "eagle3kit.vllm_capture", "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"shared_storage_path": DIR}}

Each request's file holds ``hidden_states`` [T, n_aux, H] and ``token_ids`` [T]. A finished
request is reported as done sending, as the parent class does once its copy completes, so vLLM
frees its cache blocks.
"""
from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)


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
        tensors = {"hidden_states": extract_from_kv_cache(self._kv_cache, slots, n).clone(),
                   "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        # reported as done sending by get_finished, so the scheduler frees the request's cache blocks
        # (without it the cache fills after a few dozen requests and the engine waits forever)
        self._req_copy_events[pending.req_id] = _Done()


def engine_model_folder(target, engine_model: str | None) -> str:
    """The checkpoint vLLM loads for capture: ``engine_model`` when given (the checkpoint you serve,
    quantized or not), else the target's own safetensors folder, else (a GGUF target) a float32
    safetensors export of it in eagle3kit's cache (DESIGN.md §2).

    Raises:
        ConfigError: ``engine_model`` is not a folder holding ``config.json``."""
    from .config import ConfigError
    from .target import cache_dir, export_fp32_folder

    if engine_model:
        p = os.path.expanduser(engine_model)
        if not os.path.isfile(os.path.join(p, "config.json")):
            raise ConfigError(f"extract.engine_model {engine_model!r} is not a model folder with config.json; give the "
                              "folder of the checkpoint vLLM serves (or leave it unset to use the target)")
        return p
    path = target.source.get("path")
    if path and not target.source.get("gguf_file") and os.path.isfile(os.path.join(path, "config.json")):
        return path
    return str(export_fp32_folder(target, cache_dir() / "fp32" / (target.source.get("weights_fingerprint") or "model")[:16]))


class VLLMCapture:
    """An in-process vLLM engine that returns, for token samples, the hidden states it computes
    while serving them: its ``extract_hidden_states`` speculative method with
    :class:`CPUHiddenStatesConnector` (which defers to vLLM's own connector on GPUs).

    The captured ids are the aux ids and the last layer's id N (vLLM numbers a state by the layer it
    enters, as HF's ``hidden_states`` index does, DESIGN.md §3; id N is the pre-norm output of the
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

    def __init__(self, model: str, layer_ids: list[int], store, max_model_len: int, dtype: str = "auto",
                 engine_args: dict | None = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.store = str(store)
        os.makedirs(self.store, exist_ok=True)
        kw = {"model": model, "dtype": dtype, "max_model_len": max_model_len + 8, "enable_prefix_caching": False,
              "max_num_seqs": 8, "seed": 0}
        if not torch.cuda.is_available():      # the CPU build: no CUDA graphs, a fixed KV-cache size
            kw |= {"enforce_eager": True, "kv_cache_memory_bytes": int(os.environ.get("EAGLE3KIT_VLLM_KV_BYTES", 1 << 30))}
        kw |= dict(engine_args or {})
        kw["speculative_config"] = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
        kw["kv_transfer_config"] = {"kv_connector": "CPUHiddenStatesConnector", "kv_role": "kv_producer",
                                    "kv_connector_module_path": "eagle3kit.vllm_capture",
                                    "kv_connector_extra_config": {"shared_storage_path": self.store}}
        try:
            self.llm = LLM(**kw)
        except (TypeError, ValueError) as e:      # an unknown argument, or a value vLLM refuses
            from .config import ConfigError

            shutil.rmtree(self.store, ignore_errors=True)
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise ConfigError(f"vLLM refused the capture engine's settings ({first}); check extract.engine_args "
                              f"{dict(engine_args or {})} and extract.engine_model {model!r}") from None
        except BaseException:
            shutil.rmtree(self.store, ignore_errors=True)
            raise
        self.n_ids = len(layer_ids)

    def capture(self, samples: list[torch.Tensor]) -> list[torch.Tensor]:
        """The captured states of each sample (int64 [T] token ids): ``[T, n_ids, H]`` in the
        engine's dtype, on the CPU, in the order given.

        Raises:
            RuntimeError: vLLM wrote no file for a sample, or one for other tokens."""
        from safetensors.torch import load_file
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": [int(t) for t in s]} for s in samples]
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        outs = self.llm.generate(prompts, greedy, use_tqdm=False)
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        if any(p is None for p in paths):
            raise RuntimeError("vLLM returned no hidden_states_path: the extract_hidden_states method or the "
                               "eagle3kit.vllm_capture connector was not active in this engine")
        if not all(os.path.exists(p) for p in paths):     # the last finished request is written at the next step
            flush = self.llm.generate([{"prompt_token_ids": prompts[0]["prompt_token_ids"][:4]}], greedy, use_tqdm=False)
            paths.append(flush[0].kv_transfer_params["hidden_states_path"])
        states = []
        for s, p in zip(samples, paths):
            if not os.path.exists(p):
                raise RuntimeError(f"vLLM wrote no hidden states for a sample of {len(s)} tokens ({p})")
            t = load_file(p)
            if t["token_ids"][: len(s)].tolist() != s.tolist():
                raise RuntimeError(f"vLLM captured other tokens than the sample's ({p})")
            h = t["hidden_states"][: len(s)]
            if h.shape[1] != self.n_ids:
                raise RuntimeError(f"vLLM captured {h.shape[1]} states per token, expected {self.n_ids}")
            states.append(h)
        for p in paths:
            for f in (p, p + ".lock"):
                if os.path.exists(f):
                    os.remove(f)
        return states

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        import gc

        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del self.llm
        gc.collect()
        shutil.rmtree(self.store, ignore_errors=True)
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
