"""The engine's one configuration: `EngineConfig`, frozen and sectioned, built once from `EngineArgs`
(engine/args.py) and the only configuration that crosses into the engine core, the executor and the
ranks. Nothing below engine/ reads the raw arguments. Validation raises ValueError naming the field."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# KV-cache element types by their option names (vLLM's spellings). "auto" is the model's dtype; "fp8"
# is e4m3 (the format with per-tensor k/v scales that checkpoints carry), so both names mean one dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: Any) -> Any:
    """The torch dtype of the KV cache for an option value (see KV_CACHE_DTYPES)."""
    import torch
    _require(kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the model, read from an HF config (or a GGUF's metadata)."""
    hf_config: Any
    architecture: str
    dtype: Any  # torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    quant_config: Any = None  # a layers.quantization QuantConfig, or None for float weights

    @property
    def quantization(self) -> str | None:
        """What runs, for the log and /v1/models, led by vLLM's name of the quantization: e.g.
        "fp8: FP8 per-channel weights, dynamic per-token activations (quantized at load)"."""
        q = self.quant_config
        return None if q is None else q.describe()

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # None: sized from free memory (CUDA) or cpu_kv_cache_gib (CPU)
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        resolve_kv_cache_dtype(self.kv_cache_dtype, None)  # validates the name
        _require(self.block_size in (8, 16, 32, 64, 128), f"block_size must be one of 8..128 (power of two), got {self.block_size}")
        _require(0 < self.gpu_memory_utilization <= 1, f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.num_blocks is None or self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")
        _require(self.cpu_kv_cache_gib > 0, f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")


SCHEDULING_POLICIES = ("fcfs", "priority")

# Linear-layer quantization methods by vLLM's names (layers/quantization/ implements them).
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt", "gptq", "awq")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # per-step token budget; prompts longer than it are chunked
    # fcfs: arrival order; priority: by each request's priority (lower first), then arrival.
    policy: str = "fcfs"
    # Image tokens whose towers may run ahead of their requests' admission per step, beside the step
    # (core/scheduler.py's encoder budget); 0: every image is encoded in the step that admits it.
    mm_encoder_budget: int = 8192

    def __post_init__(self) -> None:
        _require(self.mm_encoder_budget >= 0, f"mm_encoder_budget must be >= 0, got {self.mm_encoder_budget}")
        _require(self.policy in SCHEDULING_POLICIES,
                 f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class CompileConfig:
    enforce_eager: bool = False
    cudagraph_batch_sizes: tuple[int, ...] = field(
        # Padding to the next size wastes at most ~20% of a decode step; fewer graphs start faster.
        # No size 1: a single sequence runs padded to 2 (the same weight reads), so the compiled
        # layers never see one token and Inductor compiles no extra size-1 specialisation, unless a
        # linear method costs less at one token (decode_graph_sizes' one_row).
        default_factory=lambda: (2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                                 320, 384, 448, 512, 640, 768, 896, 1024))
    # Token counts of mixed/prefill steps captured as piecewise graphs. Above the largest, a step's
    # GPU time dwarfs the launch cost of running the compiled segments without graphs.
    # Dense enough that padding wastes at most ~12% of a step's batchful work: a 1024-token prompt
    # with its step's decode rows (~1,050 tokens) ran padded to 1,536 before, 47% of wasted GEMM rows.
    # Measured on the H100 (BENCHMARKS.md, "engine core process"): running steps above 512 tokens
    # eagerly instead wastes nothing but costs more at 24 req/s (median TPOT 19.8 vs 17.8 ms).
    piecewise_token_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1088, 1152,
                                              1280, 1408, 1536, 1792, 2048)

    def decode_graph_sizes(self, max_num_seqs: int, one_row: bool = False) -> list[int]:
        """The decode graphs' batch sizes, ascending: those up to max_num_seqs, or the smallest when
        none is (max_num_seqs 1 pads to it). one_row: the model's layers cost less at one token than
        at two (layers/linear.py cheaper_at_one_row), so one sequence gets a graph of size 1."""
        sizes = sorted(b for b in self.cudagraph_batch_sizes if b <= max_num_seqs)
        if one_row and 1 not in sizes:
            sizes.insert(0, 1)
        return sizes or sorted(self.cudagraph_batch_sizes)[:1]


DATA_PARALLEL_BACKENDS = ("mp", "ray")
EXECUTOR_BACKENDS = ("mp", "ray")
# Ray's placement-group strategies: PACK fills a node and spills to the next when it runs out;
# STRICT_SPREAD puts every rank on a node of its own.
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor x pipeline parallel ranks, and the hosts they span (torchrun's names)."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node only)
    distributed_timeout_s: float = 600.0  # bound on the ranks' start-up and on any collective
    step_timeout_s: float = 300.0  # a step no rank answered within this counts as a hung rank
    # Who starts the ranks: "mp" (processes of this host, --nnodes for more hosts) or "ray" (Ray actors
    # placed by a placement group over a Ray cluster's nodes; executor/ray_ranks.py).
    distributed_executor_backend: str = "mp"
    ray_address: str | None = None  # None: $RAY_ADDRESS, else the latest local cluster, else a new one
    ray_placement_strategy: str = "PACK"  # one of RAY_PLACEMENT_STRATEGIES
    ray_bundle_resource: tuple[str, float] | None = None  # a custom resource each rank's bundle also takes
    # Engine cores behind the one front (engine/replicas.py), each with its own tp x pp ranks.
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"  # one of DATA_PARALLEL_BACKENDS: where the replicas' cores run

    def __post_init__(self) -> None:
        _require(self.distributed_executor_backend in EXECUTOR_BACKENDS,
                 f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                 f"got {self.distributed_executor_backend!r}")
        _require(self.ray_placement_strategy in RAY_PLACEMENT_STRATEGIES,
                 f"ray_placement_strategy must be one of {', '.join(RAY_PLACEMENT_STRATEGIES)}, "
                 f"got {self.ray_placement_strategy!r}")
        _require(self.distributed_executor_backend != "ray" or self.nnodes == 1,
                 "--distributed-executor-backend ray places the ranks on the Ray cluster's nodes itself: drop "
                 "--nnodes (start the other hosts with `ray start --address HEAD_IP:6379`)")
        _require(isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1,
                 f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}")
        _require(self.data_parallel_backend in DATA_PARALLEL_BACKENDS,
                 f"data_parallel_backend must be one of {', '.join(DATA_PARALLEL_BACKENDS)}, "
                 f"got {self.data_parallel_backend!r}")
        _require(self.data_parallel_size == 1 or self.nnodes == 1,
                 "--data-parallel-size > 1 runs on one host (or on Ray with --data-parallel-backend ray); "
                 "it cannot be combined with --nnodes")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class LoRAConfig:
    """--enable-lora: slots, the largest rank, the host cache and the adapters named at start-up."""
    max_loras: int
    max_rank: int
    max_cpu_loras: int | None
    modules: tuple[tuple[str, str], ...]  # (name, path) of --lora-modules
    allow_runtime: bool
    allowed_dir: str | None

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1 and self.max_rank >= 1,
                 f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_rank}")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                 f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# vLLM's keys of --speculative-config that splitserve reads; any other key is an error at start-up.
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                     "draft_tensor_parallel_size", "disable_by_batch_size",
                     # splitserve's own: the adaptive draft count (core/spec_control.py)
                     "adaptive", "adaptive_knee_tokens", "adaptive_verify_overhead")


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config (vLLM's JSON keys). Drafts are proposed by the worker after each step
    (n-gram prompt lookup on the host, or a draft model in the same worker), verified in the next
    step as extra tokens of their sequence, and rolled back where rejected (worker/spec_decode.py)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched against the earlier context
    prompt_lookup_max: int = 3  # ngram: longest suffix tried first
    model: str | None = None    # draft_model: its checkpoint (shares the target's tokenizer); eagle/eagle3: the head's
    draft_tensor_parallel_size: int = 1
    # No drafts in a step whose running batch has at least this many sequences (speculation costs
    # more than it saves on a loaded server). None: always speculate.
    disable_by_batch_size: int | None = None
    # Adaptive draft count (core/spec_control.py): per step, each sequence verifies as many drafts as
    # its measured acceptance pays for under the step cost model 1 + tokens / adaptive_knee_tokens
    # (in plain batch-1 decode steps) plus adaptive_verify_overhead for a step that verifies; 0 drafts
    # when none pays. False: always up to num_speculative_tokens.
    adaptive: bool = True
    adaptive_knee_tokens: float = 64.0
    adaptive_verify_overhead: float = 0.1
    # Filled by the config builder for draft_model: the draft's loading.resolve.ModelSource and config.
    draft_source: Any = None
    draft_hf_config: Any = None  # (eagle / eagle3: the head's models.eagle.HeadInfo)

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS,
                 f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        _require(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 32,
                 f"speculative_config: num_speculative_tokens must be an integer in [1, 32], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            _require(isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi,
                     f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
            _require(self.model is None, "speculative_config: method ngram takes no model")
        else:
            _require(bool(self.model), f"speculative_config: method {self.method} needs a model")
        _require(self.draft_tensor_parallel_size == 1,
                 f"speculative_config: draft_tensor_parallel_size must be 1, got {self.draft_tensor_parallel_size}")
        b = self.disable_by_batch_size
        _require(b is None or (isinstance(b, int) and b >= 2),
                 f"speculative_config: disable_by_batch_size must be an integer >= 2, got {b!r}")
        _require(isinstance(self.adaptive, bool),
                 f"speculative_config: adaptive must be true or false, got {self.adaptive!r}")
        knee, over = self.adaptive_knee_tokens, self.adaptive_verify_overhead
        _require(isinstance(knee, (int, float)) and not isinstance(knee, bool) and knee > 0,
                 f"speculative_config: adaptive_knee_tokens must be a number > 0, got {knee!r}")
        _require(isinstance(over, (int, float)) and not isinstance(over, bool) and 0 <= over,
                 f"speculative_config: adaptive_verify_overhead must be a number >= 0, got {over!r}")

    @classmethod
    def parse(cls, value: "str | dict") -> "SpeculativeConfig":
        """From the JSON text of --speculative-config or the dict of LLM(speculative_config=...)."""
        import json
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        _require(isinstance(value, dict), f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
        _require(not unknown, f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                              f"known: {', '.join(_SPECULATIVE_KEYS)}")
        _require("method" in value and "num_speculative_tokens" in value,
                 "speculative_config needs method and num_speculative_tokens")
        return cls(**value)

    @property
    def lookahead_slots(self) -> int:
        """KV slots a speculating request holds beyond its verified tokens: a draft model writes its
        drafts' K/V there at the end of the verify step (an EAGLE head too). N-gram drafts need none."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens


STRUCTURED_OUTPUT_FILLS = ("process", "inline")

# KV transfer (kv_transfer/): connectors by vLLM's names, the roles and load-failure policies it spells.
KV_CONNECTORS = ("TcpConnector", "NixlConnector", "OffloadingConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# vLLM's KVTransferConfig keys: accepted (those without a meaning here are ignored); any other is an error.
KV_TRANSFER_KEYS = ("kv_connector", "kv_role", "engine_id", "kv_ip", "kv_port", "kv_load_failure_policy",
                    "kv_connector_extra_config", "kv_buffer_device", "kv_buffer_size", "kv_rank",
                    "kv_parallel_size", "kv_connector_module_path", "enable_permute_local_kv")
# Keys of kv_connector_extra_config that splitserve reads.
KV_EXTRA_KEYS = ("kv_lease_duration", "kv_load_timeout", "cpu_bytes_to_use", "num_threads")


@dataclass(frozen=True)
class KVTransferConfig:
    """--kv-transfer-config (vLLM's JSON) and --kv-offload-gb: which connector moves KV blocks between
    this engine and others (or host memory), and this engine's role in it."""
    kv_connector: str
    kv_role: str = "kv_both"
    engine_id: str = ""                 # "" : made unique at start-up
    kv_ip: str = "127.0.0.1"            # where a producer serves its held blocks
    kv_port: int = 14579                # vLLM's default; 0: any free port
    kv_load_failure_policy: str = "recompute"  # a failed load: prefill locally, or fail the request
    kv_lease_duration: float = 30.0     # s a producer holds blocks nobody has read (vLLM's name)
    kv_load_timeout: float = 10.0       # s a consumer waits on a producer before the load fails
    offload_bytes: int = 0              # OffloadingConnector: host memory for evicted prefix blocks
    num_threads: int = 0                # NixlConnector: UCX workers posting a long READ in parallel (vLLM's key;
                                        # vLLM uses 4; 0 until the GPU benchmark says what it buys)

    def __post_init__(self) -> None:
        _require(self.kv_connector in KV_CONNECTORS,
                 f"kv_transfer_config: kv_connector must be one of {', '.join(KV_CONNECTORS)}, got {self.kv_connector!r}")
        _require(self.kv_role in KV_ROLES,
                 f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        _require(self.kv_load_failure_policy in KV_LOAD_FAILURE_POLICIES,
                 f"kv_transfer_config: kv_load_failure_policy must be one of "
                 f"{', '.join(KV_LOAD_FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}")
        _require(isinstance(self.kv_port, int) and 0 <= self.kv_port <= 65535,
                 f"kv_transfer_config: kv_port must be in [0, 65535], got {self.kv_port!r}")
        _require(self.kv_lease_duration > 0 and self.kv_load_timeout > 0,
                 "kv_transfer_config: kv_lease_duration and kv_load_timeout must be > 0")
        _require(isinstance(self.num_threads, int) and 0 <= self.num_threads <= 64,
                 f"kv_transfer_config: kv_connector_extra_config.num_threads must be an integer in [0, 64], "
                 f"got {self.num_threads!r}")
        _require(self.kv_connector != "OffloadingConnector" or self.offload_bytes > 0,
                 "OffloadingConnector needs host memory: --kv-offload-gb N (or kv_connector_extra_config."
                 "cpu_bytes_to_use)")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(text: str | dict | None, offload_gb: float | None = None) -> KVTransferConfig | None:
    """vLLM's --kv-transfer-config JSON (and --kv-offload-gb) -> the section, or None (no connector).
    Unknown keys, connectors, roles and policies are ValueErrors naming them."""
    import json
    if offload_gb is not None and offload_gb <= 0:
        raise ValueError(f"kv_offload_gb must be > 0, got {offload_gb}")
    if text is None or text == "":
        if offload_gb is None:
            return None
        return KVTransferConfig("OffloadingConnector", "kv_both", offload_bytes=int(offload_gb * (1 << 30)))
    if isinstance(text, str):
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from None
    else:
        raw = dict(text)
    _require(isinstance(raw, dict), "kv_transfer_config must be a JSON object")
    unknown = sorted(set(raw) - set(KV_TRANSFER_KEYS))
    _require(not unknown, f"kv_transfer_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(KV_TRANSFER_KEYS)})")
    _require("kv_connector" in raw and "kv_role" in raw, "kv_transfer_config needs kv_connector and kv_role")
    extra = raw.get("kv_connector_extra_config") or {}
    _require(isinstance(extra, dict), "kv_transfer_config: kv_connector_extra_config must be an object")
    unknown = sorted(set(extra) - set(KV_EXTRA_KEYS))
    _require(not unknown, f"kv_transfer_config: unknown kv_connector_extra_config key(s) {', '.join(unknown)} "
                          f"(known: {', '.join(KV_EXTRA_KEYS)})")
    offload = int(offload_gb * (1 << 30)) if offload_gb is not None else int(extra.get("cpu_bytes_to_use", 0))
    kwargs = {k: raw[k] for k in ("engine_id", "kv_ip", "kv_port", "kv_load_failure_policy") if raw.get(k) is not None}
    if "kv_port" in kwargs:
        try:
            kwargs["kv_port"] = int(kwargs["kv_port"])
        except (TypeError, ValueError):
            raise ValueError(f"kv_transfer_config: kv_port must be an integer, got {raw['kv_port']!r}") from None
    for key in ("kv_lease_duration", "kv_load_timeout"):
        if key in extra:
            kwargs[key] = float(extra[key])
    if "num_threads" in extra:
        kwargs["num_threads"] = extra["num_threads"]
    return KVTransferConfig(raw["kv_connector"], raw["kv_role"], offload_bytes=offload, **kwargs)



@dataclass(frozen=True)
class LoadConfig:
    """Where the weights and the tokenizer come from (loading.resolve.ModelSource each)."""
    source: Any
    tokenizer_source: Any = None  # None: the model's own
    random_weights: bool = False


@dataclass(frozen=True)
class OnnxConfig:
    """The ONNX Runtime backend: the batchful part runs as an exported directory's graphs
    (`splitserve export`), the batchless part in the engine's paged attention (worker/onnx_runner.py)."""
    directory: str


@dataclass(frozen=True)
class MultiModalConfig:
    """The front's image preprocessing: tensor ops on this device (multimodal/tensor_preprocess.py),
    or None for the model's Hugging Face image processor (the reference)."""
    preprocess_device: str | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    compile: CompileConfig
    device: str
    attention_backend: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    load: LoadConfig | None = None  # None only in tests that hand a built model to a runner
    lora: LoRAConfig | None = None  # None: LoRA off
    onnx: OnnxConfig | None = None  # None: the torch model (else the ONNX Runtime backend)
    kv_transfer: KVTransferConfig | None = None  # None: no KV connector
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    structured_outputs_fill: str = "process"  # one of STRUCTURED_OUTPUT_FILLS
    seed: int | None = None
    async_scheduling: bool | None = None  # None: on with CUDA
    # Every name clients may send (the first is the one responses show), and the request defaults of
    # the model's generation config (loading/generation_config.py).
    served_model_names: tuple[str, ...] = ()
    sampling_defaults: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(self.structured_outputs_fill in STRUCTURED_OUTPUT_FILLS,
                 f"structured_outputs_fill must be one of {', '.join(STRUCTURED_OUTPUT_FILLS)}, "
                 f"got {self.structured_outputs_fill!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def runs_async(self) -> bool:
        """Whether the core launches step N+1 before collecting step N (the default on CUDA)."""
        return self.device.startswith("cuda") if self.async_scheduling is None else self.async_scheduling
