"""Every option of the engine, in one place: the CLI flags (`splitserve serve|generate|chat`,
`bench throughput`) and the offline `LLM(model, **kwargs)` keywords are generated from these fields
(see arg_utils.py), so a new option is one field here with its help text."""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.arg_utils import CliOptions, option
from splitserve.config import KV_CACHE_DTYPES
from splitserve.layers.quantization import QUANTIZATION_METHODS

# half and float are vLLM's (and torch's) other spellings of float16 and float32.
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")
ATTENTION_BACKENDS = ("torch_ref", "triton")


@dataclass
class EngineArgs(CliOptions):
    model: str | None = option(
        None, positional=True, default_text="SmolLM2-135M-Instruct",
        help="HF model directory, .gguf file, or a repo id already in the local Hugging Face cache; "
             "given as --model or as the first positional argument")
    tokenizer: str | None = option(
        None, default_text="the model's",
        help="HF directory, .gguf file or cached repo id to take the tokenizer (and chat template) from")
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
    seed: int | None = option(
        None, default_text="none: unseeded requests draw fresh randomness",
        help="seeds the engine's random state, so unseeded sampling repeats from run to run")
    max_model_len: int | None = option(
        None, default_text="the model's context length",
        help="longest sequence (prompt + output) in tokens; at most the model's context length")
    max_num_seqs: int = option(256, help="most sequences in one step's batch")
    max_num_batched_tokens: int = option(
        8192, help="token budget of one step; longer prompts are prefilled in chunks")
    block_size: int = option(16, help="tokens per KV-cache block (8, 16, 32, 64 or 128)")
    num_blocks: int | None = option(
        None, default_text="sized from free GPU memory, or --cpu-kv-cache-gib on CPU",
        aliases=("--num-gpu-blocks-override",), help="KV-cache blocks (also as --num-gpu-blocks-override)")
    gpu_memory_utilization: float = option(
        0.9, help="fraction of the GPU's memory the engine may use, KV cache included")
    cpu_kv_cache_gib: float = option(1.0, help="KV-cache size on CPU, in GiB")
    kv_cache_dtype: str = option(
        "auto", choices=KV_CACHE_DTYPES,
        help="KV-cache element type; auto: the model's dtype; fp8 (the same as fp8_e4m3): FP8 e4m3 with "
             "per-layer k/v scales from the checkpoint (1.0 when it has none), twice the tokens of a "
             "bf16 cache in the same memory (CUDA needs compute capability 8.9+)")
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
    served_model_name: list[str] | None = option(
        None, default_text="the model's directory or file name, or its repo id",
        help="the model names clients may send (several allowed); the first is the one responses and "
             "metrics show")
    generation_config: str = option(
        "auto", metavar="auto|vllm|DIR",
        help="where request defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens) come "
             "from: auto: the model's generation_config.json; vllm: none (temperature 1.0, ...); DIR: the "
             "generation_config.json in that directory")
    override_generation_config: str | None = option(
        None, metavar="JSON", default_text="none",
        help="JSON object of defaults that replace those of the generation config, "
             "e.g. '{\"temperature\": 0.5}'")

    # LoRA (vLLM's flag names).
    enable_lora: bool = option(False, help="serve LoRA adapters (PEFT format) over the base model")
    max_loras: int = option(1, help="LoRA adapters a step can run at once (GPU slots)")
    max_lora_rank: int = option(16, help="largest LoRA rank accepted; slots are sized for it")
    max_cpu_loras: int | None = option(None, default_text="max_loras",
                                       help="LoRA adapters kept loaded in host memory (an LRU)")
    lora_modules: list[str] | None = option(
        None, metavar="NAME=PATH",
        help="adapters clients select with model=NAME: NAME=PATH, or vLLM's JSON form "
             "'{\"name\": NAME, \"path\": PATH, \"base_model_name\": ...}'")
    allow_runtime_lora: bool = option(
        False, default_text="off, or on when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true",
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    lora_allowed_dir: str | None = option(
        None, default_text="none: runtime loading is refused",
        help="runtime-loaded adapters must lie under this directory")

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):  # LLM(served_model_name="x"), the older form
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and not self.served_model_name:
            self.served_model_name = None  # a bare --served-model-name: the default name
        # Checked here too (CacheConfig checks it again) so LLM(kv_cache_dtype=...) fails at once.
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

    @classmethod
    def cli_title(cls) -> str:
        return "engine options"
