"""Every option of the engine, in one place: the CLI flags (`splitserve serve|generate|chat`,
`bench throughput`) and the offline `LLM(model, **kwargs)` keywords are generated from these fields
(see arg_utils.py), so a new option is one field here with its help text."""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.arg_utils import CliOptions, option
from splitserve.layers.quantization import QUANTIZATION_METHODS

DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("torch_ref", "triton")


@dataclass
class EngineArgs(CliOptions):
    model: str | None = option(
        None, positional=True, default_text="SmolLM2-135M-Instruct",
        help="HF model directory, .gguf file, or a repo id already in the local Hugging Face cache")
    dtype: str = option(
        "auto", choices=DTYPES,
        help="weights and activations; auto: float32 on CPU, else the checkpoint's float16/bfloat16 "
             "(bfloat16 when it names neither)")
    quantization: str | None = option(
        None, choices=QUANTIZATION_METHODS, default_text="the checkpoint's quantization_config, else none",
        help="linear-layer quantization, by vLLM's names: fp8 quantizes a float checkpoint's weights to FP8 "
             "at load (per-channel weights, per-token activations); compressed-tensors (FP8, W8A8 INT8) and "
             "modelopt (FP8) name the format of an already quantized checkpoint, which is found without the "
             "flag. GGUF files are dequantized at load")
    device: str | None = option(None, default_text="cuda if available, else cpu", help="cuda or cpu")
    max_model_len: int | None = option(
        None, default_text="the model's context length",
        help="longest sequence (prompt + output) in tokens; at most the model's context length")
    max_num_seqs: int = option(256, help="most sequences in one step's batch")
    max_num_batched_tokens: int = option(
        8192, help="token budget of one step; longer prompts are prefilled in chunks")
    block_size: int = option(16, help="tokens per KV-cache block (8, 16, 32, 64 or 128)")
    num_blocks: int | None = option(
        None, default_text="sized from free GPU memory, or --cpu-kv-cache-gib on CPU",
        help="KV-cache blocks")
    gpu_memory_utilization: float = option(
        0.9, help="fraction of the GPU's memory the engine may use, KV cache included")
    cpu_kv_cache_gib: float = option(1.0, help="KV-cache size on CPU, in GiB")
    enable_prefix_caching: bool = option(
        True, negative_aliases=("--no-prefix-caching",),
        help="reuse the KV blocks of identical prompt prefixes across requests")
    attention_backend: str | None = option(
        None, choices=ATTENTION_BACKENDS, default_text="triton on CUDA, torch_ref on CPU",
        help="attention kernels")
    enforce_eager: bool = option(False, help="no torch.compile and no CUDA graphs")
    random_weights: bool = option(False, help="random weights from the model's config (benchmarks)")
    async_scheduling: bool | None = option(
        None, default_text="on with CUDA",
        help="schedule the next step while the device runs the current one")
    # Here rather than with the server's options: the engine names its model with it (the name the
    # server answers to, /v1/models and the metrics' label all come from the engine).
    served_model_name: str | None = option(
        None, default_text="the model's directory or file name, or its repo id",
        help="the model name clients send and /v1/models shows")

    @classmethod
    def cli_title(cls) -> str:
        return "engine options"
