"""Every option of the engine, in one place: the CLI flags (`splitserve serve|generate|chat`,
`bench throughput`) and the offline `LLM(model, **kwargs)` keywords are generated from these fields
(see arg_utils.py), so a new option is one field here with its help text."""
from __future__ import annotations

import os
from dataclasses import dataclass

from splitserve.arg_utils import CliOptions, option
from splitserve.config import (DATA_PARALLEL_BACKENDS, EXECUTOR_BACKENDS, KV_CACHE_DTYPES, QUANTIZATION_METHODS,
                               RAY_PLACEMENT_STRATEGIES, SCHEDULING_POLICIES, STRUCTURED_OUTPUT_FILLS, EngineConfig)

# half and float are vLLM's (and torch's) other spellings of float16 and float32.
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")
ATTENTION_BACKENDS = ("torch_ref", "triton")
BACKENDS = ("auto", "torch", "onnxruntime")


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
    num_frames: int | None = option(
        None, default_text="the model's (Video NeVA: data.num_frames of its config, else 8)",
        help="frames sampled evenly from each video input (models that take videos)")
    mm_preprocess: str = option(
        "auto", help="image preprocessing (resize, normalise, patchify) of vision-language models: auto (tensor "
                     "ops on the GPU when the engine runs on one, else the Hugging Face processor), hf, cpu or "
                     "cuda[:N] (tensor ops there)")
    max_num_seqs: int = option(256, help="most sequences in one step's batch")
    max_num_batched_tokens: int = option(
        8192, help="token budget of one step; longer prompts are prefilled in chunks")
    scheduling_policy: str = option(
        "fcfs", choices=SCHEDULING_POLICIES,
        help="fcfs: requests run in arrival order; priority: by each request's `priority` (lower first, "
             "then arrival), and when KV blocks run out the lowest-priority running request is preempted "
             "first")
    mm_encoder_budget: int = option(
        8192, help="vision-language models: image tokens per step whose towers run ahead of their requests' "
                   "admission, beside the step (a request with images that arrives while others decode waits one "
                   "step for its tower); 0: every image is encoded in the step that admits it")
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
    backend: str = option(
        "auto", choices=BACKENDS,
        help="what runs the batchful part: torch (splitserve's modules), or onnxruntime: the graphs of a "
             "directory written by `splitserve export`, with attention in splitserve's paged KV cache; auto: "
             "onnxruntime for an exported directory, else torch")
    random_weights: bool = option(False, help="random weights from the model's config (benchmarks)")
    async_scheduling: bool | None = option(
        None, default_text="on with CUDA",
        help="schedule the next step while the device runs the current one")
    structured_outputs_fill: str = option(
        "process", choices=STRUCTURED_OUTPUT_FILLS,
        help="where grammar masks of structured outputs are filled: process: a grammar process beside the "
             "engine core, overlapping the core's host work (the in-process fill takes over if it cannot "
             "start); inline: threads of the engine core")
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
    speculative_config: str | None = option(
        None, metavar="JSON", default_text="none: no speculative decoding",
        help="speculative decoding, vLLM's keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
             "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 3}' (drafts copied from earlier context), "
             "'{\"method\": \"eagle3\", \"model\": HEAD_DIR, ...}' (an EAGLE-3 head in the public layout; "
             "\"eagle\" for EAGLE-1 heads) or "
             "'{\"method\": \"draft_model\", \"model\": DIR, \"num_speculative_tokens\": 4}' (a small model "
             "with the same tokenizer); optional \"disable_by_batch_size\": no drafts in steps with that many "
             "running sequences; drafts per sequence follow measured acceptance and batch size unless "
             "\"adaptive\": false (cost model: \"adaptive_knee_tokens\", \"adaptive_verify_overhead\"). "
             "LLM() also takes a dict")
    # -- parallelism (executor/: one worker process per device when the world is larger than 1) --
    tensor_parallel_size: int = option(
        1, aliases=("-tp",), help="devices each layer is split across (one worker process each)")
    pipeline_parallel_size: int = option(
        1, aliases=("-pp",), help="pipeline stages the decoder layers are split into (across hosts, say)")
    nnodes: int | None = option(
        None, default_text="$NNODES, else 1",
        help="hosts the model spans (torchrun's name); each runs tp*pp/nnodes ranks")
    node_rank: int | None = option(
        None, default_text="$NODE_RANK, else 0",
        help="this host's index among --nnodes; 0 runs the engine core and the API, the others only "
             "their worker processes (headless)")
    master_addr: str | None = option(
        None, default_text="$MASTER_ADDR, else 127.0.0.1",
        help="address of node 0, which every rank reaches (torch.distributed's store on --master-port, "
             "the step messages on --master-port + 1, the results on --master-port + 2)")
    master_port: int | None = option(
        None, default_text="$MASTER_PORT, else a free port (one node only)",
        help="port of node 0 for torch.distributed's rendezvous (required with --nnodes > 1)")
    distributed_timeout_s: float = option(
        600.0, help="bound on the ranks' start-up (joining, loading) and on any collective")
    step_timeout_s: float = option(
        300.0, help="a model step that no rank has answered after this many seconds counts as a hung "
                    "rank: the engine fails its requests and stops every process")
    distributed_executor_backend: str = option(
        "mp", choices=EXECUTOR_BACKENDS,
        help="who starts the tp*pp ranks: mp: processes of this host (--nnodes for more hosts); ray: Ray "
             "actors placed over a Ray cluster's nodes by a placement group (pip install splitserve[ray])")
    ray_address: str | None = option(
        None, default_text="$RAY_ADDRESS, else the cluster last started on this host, else a new local one",
        help="the Ray cluster to join with --distributed-executor-backend ray (e.g. HEAD_IP:6379)")
    ray_placement_strategy: str = option(
        "PACK", choices=RAY_PLACEMENT_STRATEGIES,
        help="how Ray places the ranks' bundles (one per rank: its CPU, its GPU on CUDA): PACK fills a node "
             "and spills onto the next, STRICT_SPREAD puts each rank on a node of its own")
    ray_bundle_resource: str | None = option(
        None, metavar="NAME[=AMOUNT]",
        help="a custom Ray resource (`ray start --resources`) each rank's bundle also takes (amount 1 unless "
             "given), to keep the ranks on the nodes that have it")

    data_parallel_size: int = option(
        1, aliases=("-dp",), help="engine cores (replicas, each with tp*pp devices) behind the one API "
                                   "server, which routes each request by prefix affinity and load")
    data_parallel_backend: str = option(
        "mp", choices=DATA_PARALLEL_BACKENDS,
        help="where the replicas' engine cores run: local processes (mp) or Ray actors (ray)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

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

    # KV transfer between engines (prefill/decode disaggregation) and to host memory (vLLM's names).
    kv_transfer_config: str | None = option(
        None, metavar="JSON", default_text="none",
        help="KV connector, as vLLM's JSON: '{\"kv_connector\": \"TcpConnector\"|\"NixlConnector\"|"
             "\"OffloadingConnector\", \"kv_role\": \"kv_producer\"|\"kv_consumer\"|\"kv_both\", "
             "\"kv_ip\": ..., \"kv_port\": ..., \"kv_load_failure_policy\": \"recompute\"|\"fail\", "
             "\"kv_connector_extra_config\": {\"kv_lease_duration\": 30}}'. A producer serves a request's "
             "blocks when it carries kv_transfer_params.do_remote_decode; a consumer loads them for "
             "do_remote_prefill")
    kv_offload_gb: float | None = option(
        None, default_text="none",
        help="host memory (GiB) for evicted prefix-cache blocks, brought back on a prefix hit "
             "(the OffloadingConnector, when --kv-transfer-config names no other)")

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):  # LLM(served_model_name="x"), the older form
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and not self.served_model_name:
            self.served_model_name = None  # a bare --served-model-name: the default name
        # Checked here too (CacheConfig checks it again) so LLM(kv_cache_dtype=...) fails at once.
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        self._resolve_distributed()

    def _resolve_distributed(self) -> None:
        """Fills the torchrun-style fields from the environment (NNODES, NODE_RANK, MASTER_ADDR,
        MASTER_PORT) where they were not given, and checks them together."""
        env = os.environ

        def env_int(name: str) -> int | None:
            value = env.get(name)
            if value in (None, ""):
                return None
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None
        if self.nnodes is None:
            self.nnodes = env_int("NNODES") or 1
        if self.node_rank is None:
            self.node_rank = env_int("NODE_RANK") or 0
        if self.master_addr is None:
            self.master_addr = env.get("MASTER_ADDR") or "127.0.0.1"
        if self.master_port is None:
            self.master_port = env_int("MASTER_PORT")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes) = [0, {self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks do not "
                             f"divide evenly over nnodes={self.nnodes} hosts")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("--nnodes > 1 needs --master-port (or $MASTER_PORT): every host must reach node 0 on it")
        if self.master_port is not None and not 1 <= self.master_port <= 65533:
            raise ValueError(f"master_port must be in [1, 65533] (it and the next two ports are used), "
                             f"got {self.master_port}")
        if self.distributed_timeout_s <= 0 or self.step_timeout_s <= 0:
            raise ValueError("distributed_timeout_s and step_timeout_s must be > 0")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        self.bundle_resource()  # checks its form now (ParallelConfig checks the backend against --nnodes)

    def bundle_resource(self) -> tuple[str, float] | None:
        """--ray-bundle-resource as (name, amount)."""
        spec = self.ray_bundle_resource
        if not spec:
            return None
        name, _, amount = spec.partition("=")
        try:
            value = float(amount) if amount else 1.0
        except ValueError:
            value = -1.0
        if not name or value <= 0:
            raise ValueError(f"ray_bundle_resource must be NAME or NAME=AMOUNT with AMOUNT > 0, got {spec!r}")
        return name, value

    @classmethod
    def cli_title(cls) -> str:
        return "engine options"

    def create_engine_config(self) -> EngineConfig:
        """The frozen EngineConfig these arguments describe: the model's config read (no weights), every
        section checked. Bad arguments fail here, before any process starts."""
        from splitserve.engine.config_builder import build_engine_config
        return build_engine_config(self)
