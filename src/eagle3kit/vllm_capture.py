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
