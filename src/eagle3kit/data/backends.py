"""Local generation backends: the target itself through ``transformers`` or vLLM's offline ``LLM``.

``transformers``: batched, left-padded ``generate`` (always available). ``vllm``: vLLM's offline
``LLM`` class, when vLLM is installed, served from a float32 safetensors copy of the target; one
engine is kept per process and released before anything else needs the memory. Both return, per
prompt, exactly the token ids the target emitted (end-of-turn included when emitted). The
OpenAI-compatible server backend is :mod:`eagle3kit.data.server_backend`; the stage that picks a
backend is :mod:`eagle3kit.data.generate`.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import warnings
from typing import Sequence

import torch

from eagle3kit.core.config import ConfigError
from eagle3kit.core.engines import installed_vllm, launched_env, vllm_cpu_build, vllm_launch
from eagle3kit.model.target import Target
from eagle3kit.model.target_export import serving_folder


def render_prompt_ids(tokenizer, messages: list[dict], template_flags: dict | None = None) -> list[int]:
    """Prompt ids: the chat template over ``messages`` with ``add_generation_prompt=True``."""
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, **(template_flags or {})
    )
    return list(enc["input_ids"])


def _cut_at_end_of_turn(ids: Sequence[int], eot: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eot:
            return list(ids[: i + 1])
    return list(ids)


@torch.no_grad()
def transformers_generate(
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[list[int]]:
    """Generate completions for a batch of prompt id lists with ``model.generate``.

    Left-padded; greedy when ``temperature == 0``. Returns, per prompt, the emitted ids up to
    and including the first end-of-turn token (or ``max_new_tokens`` ids when none came).
    """
    tok = target.tokenizer
    eot = target.end_of_turn_ids()
    pad = tok.pad_token_id if tok.pad_token_id is not None else eot[0]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kw: dict = {"do_sample": False}
    if temperature > 0:
        torch.manual_seed(seed)
        kw = {"do_sample": True, "temperature": temperature, "top_p": top_p}
    out = target.model.generate(
        input_ids=ids.to(target.device),
        attention_mask=mask.to(target.device),
        max_new_tokens=max_new_tokens,
        eos_token_id=eot,
        pad_token_id=pad,
        top_k=None,
        **kw,
    )
    gen = out[:, width:].tolist()
    return [_cut_at_end_of_turn(g, set(eot)) for g in gen]


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_engine_args(
    cpu_build: bool,
    dtype: str,
    memory: tuple[int, int] | None = None,
    user_args: dict | None = None,
) -> dict:
    """``vllm.LLM`` arguments for eagle3kit's in-process engine (generation, greedy references).

    CPU build (docs/architecture.md, engines): ``dtype`` float32, ``enforce_eager``, a fixed KV cache of
    ``EAGLE3KIT_VLLM_KV_BYTES`` bytes (default 2 GiB). A GPU build: the target's ``dtype`` (for
    example ``bfloat16``) and ``gpu_memory_utilization`` from ``memory`` = (free, total) bytes of
    the device, what ``torch.cuda.mem_get_info`` returns: the free share less 0.05, at least 0.05,
    since the target that transformers holds on the same GPU (``eagle3kit run`` loads it once)
    stays where it is and vLLM refuses a share it cannot have. ``user_args``
    (``generate.engine_args``: ``tensor_parallel_size``, ``gpu_memory_utilization``, …) win.
    """
    if cpu_build:
        args: dict = {
            "dtype": "float32",
            "enforce_eager": True,
            "kv_cache_memory_bytes": int(os.environ.get("EAGLE3KIT_VLLM_KV_BYTES", 2 << 30)),
        }
    else:
        free, total = memory or (1, 1)
        args = {"dtype": dtype, "gpu_memory_utilization": round(max(0.05, free / total - 0.05), 3)}
    return {**args, **(user_args or {})}


def vllm_engine(target: Target, max_model_len: int = 4096, seed: int = 0, engine_args: dict | None = None):
    """One in-process vLLM ``LLM`` over the target's own safetensors folder (a float32 export of a
    GGUF target), cached per process, with what the target needs set at launch
    (:func:`eagle3kit.core.engines.vllm_launch`) and the arguments of :func:`vllm_engine_args`.

    Uses ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (unless the target needs its engine core in its own
    process) and, on the CPU build, ``enforce_eager`` and a fixed KV-cache size
    (``EAGLE3KIT_VLLM_KV_BYTES``, default 2 GiB), as that build needs (docs/architecture.md, engines).
    """
    key = id(target)
    if key in _VLLM and _VLLM[key].llm_engine.model_config.max_model_len >= max_model_len:
        return _VLLM[key]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

    warnings.filterwarnings("ignore", category=FutureWarning, module="vllm")

    folder = serving_folder(target)
    launch = vllm_launch(folder, speculative=False)
    from vllm import LLM

    release_vllm_engine()  # one engine per process: the old one's teardown would break a new one's groups
    cpu = vllm_cpu_build()
    memory = None if cpu else torch.cuda.mem_get_info(target.device if target.device.type == "cuda" else 0)
    dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    kwargs = {
        **launch.engine_args,
        **vllm_engine_args(cpu, dtype, memory, engine_args),
    }  # the user's args win
    with launched_env(launch):
        try:
            llm = LLM(model=str(folder), max_model_len=max_model_len, seed=seed, **kwargs)
        except (
            TypeError,
            ValueError,
        ) as e:  # an unknown argument, or one of the wrong type (pydantic's error)
            if not engine_args or not any(k in str(e) for k in engine_args):
                raise
            raise ConfigError(
                f"generate.engine_args {engine_args}: vLLM refused them: {str(e).splitlines()[0][:300]}"
            ) from None
    _VLLM[key] = llm
    return llm


def release_vllm_engine() -> None:
    """Shut down the cached in-process engine and vLLM's process-wide parallel state, so that a
    later :func:`vllm_engine` for another target starts clean (no-op when none is cached)."""
    if _VLLM:
        shutdown_vllm(_VLLM.pop(next(iter(_VLLM))))


def shutdown_vllm(llm) -> None:
    """Shut down an in-process ``vllm.LLM`` and vLLM's process-wide parallel state, so that a later
    engine in this process starts clean (the capture engine of ``extract --backend vllm`` too)."""

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def vllm_version() -> str | None:
    """The vLLM version generation ran with: the installed distribution's, else the module's own."""

    version = installed_vllm()
    if version is None:
        try:
            import vllm

            version = vllm.__version__
        except Exception:
            pass
    return version


def vllm_generate(
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    engine_args: dict | None = None,
) -> list[list[int]]:
    """Same contract as :func:`transformers_generate`, through vLLM's offline engine
    (``engine_args``: more ``vllm.LLM`` arguments, :func:`vllm_engine_args`)."""
    from vllm import SamplingParams

    need = max(4096, max(len(p) for p in prompts) + max_new_tokens + 8)
    context = target_context(target)  # vLLM refuses a max_model_len past the model's own
    llm = vllm_engine(target, max_model_len=min(need, context) if context else need, engine_args=engine_args)
    eot = target.end_of_turn_ids()
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p if temperature > 0 else 1.0,
        max_tokens=max_new_tokens,
        seed=seed if temperature > 0 else None,
        stop_token_ids=eot,
        detokenize=False,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [_cut_at_end_of_turn(list(o.outputs[0].token_ids), set(eot)) for o in outs]


_VLLM: dict = {}


def target_context(target: Target) -> int | None:
    """The target's context in tokens (its config's ``max_position_embeddings``), None if unknown."""
    n = getattr(target.config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None
