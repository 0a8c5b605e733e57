"""The command that starts a vLLM capture server for ``train --online-from`` (``eagle3kit
capture-server``): the config's target as the engine loads it, its aux layer ids and N, the connector,
and the interpreter or ``vllm`` command of this environment, every path absolute so the printed line
runs from any folder and shell."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from eagle3kit.core.config import Config, ConfigError
from eagle3kit.core.engines import vllm_cpu_build
from eagle3kit.core.ui import console
from eagle3kit.model.target import resolve_aux_layer_ids
from eagle3kit.model.target_files import load_target_config, locate_target
from eagle3kit.train.online import capture_server_command

_CAPTURE_OWNS = {
    "--port": "--port",
    "--dtype": "target.dtype in the config",
    "--speculative-config": "the config's target.aux_layer_ids",
    "-sc": "the config's target.aux_layer_ids",
    "--kv-transfer-config": "--transport / --vllm-connector",
    "--served-model-name": "nothing (the trainer asks for the model the server lists)",
    "--model": "--engine-model",
}


def vllm_args_list(text: str) -> list[str]:
    """``--vllm-args`` as a list; refuses unbalanced quotes and the options capture-server sets itself."""
    try:
        args = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"--vllm-args {text!r}: {e}; quote it as a shell would") from None
    for a in args:
        own = _CAPTURE_OWNS.get(a.split("=")[0])
        if own:
            raise ConfigError(
                f"--vllm-args sets {a.split('=')[0]}, which capture-server sets itself: use {own}"
            )
    return args


def capture_server_for(
    cfg: Config,
    engine_model: str | None = None,
    transport: str | None = None,
    port: int = 8000,
    vllm_connector: bool = False,
    vllm_args: str = "",
) -> tuple[list[str], list[int]]:
    """The capture server's command for ``cfg`` (:func:`~eagle3kit.train.online.capture_server_command`)
    and the layer ids it captures (the aux ids, then N).

    ``engine_model``: the checkpoint the server loads (default: the target's folder or hub id);
    ``transport``: ``file`` or ``fp8`` (default ``train.online_transport``); ``vllm_connector``: vLLM's
    and hs-connectors' own connectors (CUDA) instead of eagle3kit's; ``vllm_args``: more ``vllm serve``
    options, as a shell would split them.

    Raises:
        ConfigError: an unknown transport, a port outside 1 … 65535, ``vllm_args`` that do not split or
            set what the command sets itself, a GGUF target without ``engine_model``.
    """
    if transport not in (None, "file", "fp8"):
        raise ConfigError(f"--transport {transport!r}: give file or fp8 (train.online_transport's values)")
    extra = vllm_args_list(vllm_args)
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port {port}: give a TCP port in 1 … 65535")
    loc = locate_target(cfg.target)
    if engine_model is None and loc["gguf_file"]:
        raise ConfigError(
            f"the target {cfg.target.model} is a GGUF file, which vLLM does not serve here: write its safetensors "
            "folder with `eagle3kit target-folder` and pass that folder as --engine-model"
        )
    _, text = load_target_config(cfg.target)
    n = int(text.num_hidden_layers)
    ids = [*resolve_aux_layer_ids(cfg.target, n, cfg.drafter), n]
    cpu = vllm_cpu_build()
    if cpu and vllm_connector:
        console.print(
            "[yellow]capture-server: --vllm-connector names connectors that need CUDA; this vLLM is the CPU build"
        )
    here = (
        Path(sys.executable).parent / "vllm"
    )  # vLLM beside eagle3kit, else the one on PATH (its own environment)
    if engine_model is not None and Path(engine_model).expanduser().exists():
        engine_model = str(Path(engine_model).expanduser().resolve())
    cmd = capture_server_command(
        engine_model or (loc["path"] if Path(loc["path"]).is_dir() else cfg.target.model),
        ids,
        Path(cfg.run_dir).resolve() / "online-buffer",
        cfg.target.dtype,
        transport or cfg.train.online_transport,
        port,
        cpu_build=cpu,
        own=not vllm_connector,
        extra=extra,
        python=sys.executable,
        vllm=str(here) if here.is_file() and not vllm_connector else "vllm",
    )
    return cmd, ids
