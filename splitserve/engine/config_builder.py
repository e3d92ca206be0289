"""EngineArgs -> EngineConfig, once. Reads the model's configuration (HF config.json, a GGUF's metadata,
a .nemo archive's), never its weights; the front calls it before any engine process starts, so a bad
argument fails here, and the result is all that crosses into the engine core and its ranks."""
from __future__ import annotations

import os

from splitserve.config import (CacheConfig, CompileConfig, EngineConfig, LoadConfig, LoRAConfig, ModelConfig,
                               MultiModalConfig, OnnxConfig, ParallelConfig, SchedulerConfig, parse_kv_transfer_config,
                               SpeculativeConfig)


def check_device(device: str) -> None:
    import torch
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA GPU is visible to torch (torch {torch.__version__}"
                         f"{', built without CUDA' if torch.version.cuda is None else ''}); use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"--device must be cuda, cuda:N or cpu, got {device!r}")


def lora_config(args) -> LoRAConfig | None:
    """The LoRA section, parsed once (the registry and the manager read this, not the arguments)."""
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    from splitserve.lora.registry import parse_lora_modules
    env = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true", "yes")
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras, parse_lora_modules(args.lora_modules),
                      args.allow_runtime_lora or env, args.lora_allowed_dir)


def onnx_config(args, source, device: str):
    """The ONNX Runtime section (None: torch), checked: an exported directory, one rank, no LoRA, a
    plain KV cache, and the dtype it was exported in (returned as the dtype to run in)."""
    from splitserve.loading.onnx_export import is_export_dir, read_manifest
    exported = source.gguf_file is None and is_export_dir(source.directory)
    if args.backend == "torch" or (args.backend == "auto" and not exported):
        if exported:
            raise ValueError(f"{source.directory} is an ONNX export (splitserve_export.json): it runs on the "
                             f"onnxruntime backend only")
        return None, None
    if not exported:
        raise ValueError(f"--backend onnxruntime serves a directory written by `splitserve export`; {source.path} "
                         f"is not one: run `splitserve export {args.model or ''} --output DIR` and serve DIR")
    try:
        import onnxruntime
        import onnxruntime_extensions  # noqa: F401 (the plugin's Python ops)
    except ImportError as e:
        raise ValueError(f"--backend onnxruntime needs onnxruntime and onnxruntime-extensions ({e}); "
                         f"pip install 'splitserve[onnx]'") from None
    if device.startswith("cuda") and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        raise ValueError("--backend onnxruntime on CUDA needs onnxruntime-gpu (CUDAExecutionProvider is not "
                         "available); install it or use --device cpu")
    manifest = read_manifest(source.directory)
    problems = [what for what, bad in (
        ("tensor/pipeline parallelism", args.tensor_parallel_size * args.pipeline_parallel_size * args.nnodes > 1),
        ("--enable-lora", args.enable_lora), ("--kv-cache-dtype fp8", args.kv_cache_dtype != "auto"),
        ("--quantization", args.quantization is not None)) if bad]
    if problems:
        raise ValueError(f"the onnxruntime backend does not support {', '.join(problems)}")
    if args.dtype not in ("auto", manifest.dtype) and {"half": "float16", "float": "float32"}.get(args.dtype) != manifest.dtype:
        raise ValueError(f"--dtype {args.dtype}: {source.directory} was exported in {manifest.dtype}")
    if manifest.dtype not in ("float32", "float16"):
        raise ValueError(f"{source.directory} was exported in {manifest.dtype}; ONNX Runtime serving takes "
                         f"float32 or float16 exports")
    return OnnxConfig(source.directory), manifest.dtype


def kv_transfer_config(args, world_size: int):
    """The KV-transfer section (None without a connector), checked against what runs it."""
    kv = parse_kv_transfer_config(args.kv_transfer_config, args.kv_offload_gb)
    if kv is not None and world_size > 1 and kv.kv_connector == "NixlConnector":
        raise ValueError(f"NixlConnector runs one rank per engine (-tp 1 for prefill and decode; this engine has "
                         f"{world_size}); a tensor-parallel prefill engine to a one-rank decode engine works "
                         f"with TcpConnector")
    if kv is not None and world_size > 1 and not (
            kv.kv_connector == "TcpConnector" and kv.kv_role == "kv_producer" and args.pipeline_parallel_size == 1
            and args.nnodes == 1 and kv.kv_port):
        raise ValueError(f"--kv-transfer-config / --kv-offload-gb with several ranks (tensor x pipeline parallel = "
                         f"{world_size}) work only for a TcpConnector kv_producer with tensor parallelism on one "
                         f"host and a fixed kv_port (its ranks serve on kv_port + 1 + rank); run other roles with -tp 1")
    if kv is not None and kv.kv_connector == "NixlConnector":
        from splitserve.kv_transfer.registry import check_available
        check_available(kv.kv_connector)
    return kv


def speculative_options(args, hf_config, max_model_len: int) -> SpeculativeConfig | None:
    """The speculative-decoding section: the options checked, a draft model's config read (not its
    weights) and checked against the target's vocabulary."""
    if args.speculative_config is None:
        return None
    spec = SpeculativeConfig.parse(args.speculative_config)
    # Tensor parallelism: every rank proposes the same n-gram drafts from its own copy of the tokens;
    # the sampling rank verifies and broadcasts the outcome (executor/rank_worker.py).
    if args.pipeline_parallel_size > 1 or (args.tensor_parallel_size > 1 and spec.method != "ngram"):
        raise ValueError("speculative_config: speculative decoding runs with pipeline_parallel_size 1, and "
                         "with tensor_parallel_size > 1 for method ngram only for now")
    if spec.method != "draft_model":
        return spec
    from dataclasses import replace

    from splitserve.loading.resolve import resolve_model
    from splitserve.models.loader import load_hf_config
    source = resolve_model(spec.model)
    draft = load_hf_config(source)
    if draft.vocab_size != hf_config.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.vocab_size} tokens) differs from "
                         f"the target's ({hf_config.vocab_size}); a draft model must share the target's tokenizer")
    context = getattr(draft, "max_position_embeddings", None) or 2048
    if context < max_model_len:
        raise ValueError(f"speculative_config: the draft model's context ({context}) is shorter than max_model_len "
                         f"({max_model_len})")
    return replace(spec, draft_source=source, draft_hf_config=draft)


def speculative_config(args, hf_config, max_model_len: int) -> SpeculativeConfig | None:
    """The speculative-decoding section (`speculative_options`); for eagle / eagle3 the head
    directory's config and tensor shapes checked against the target's (models/eagle.inspect_head),
    kept as the section's draft_hf_config."""
    spec = speculative_options(args, hf_config, max_model_len)
    if spec is None or spec.method not in ("eagle", "eagle3"):
        return spec
    from dataclasses import replace

    from splitserve.loading.resolve import resolve_model
    from splitserve.models.eagle import inspect_head
    path = os.path.expanduser(spec.model)  # a local folder, else a hub id in the local cache
    directory = path if os.path.isdir(path) else resolve_model(spec.model).directory
    return replace(spec, draft_hf_config=inspect_head(directory, spec.method, hf_config))


def build_engine_config(args) -> EngineConfig:
    """`args`: an engine.args.EngineArgs (called by its create_engine_config)."""
    import torch

    from splitserve.layers.quantization.config import resolve_quant_config
    from splitserve.loading.generation_config import sampling_defaults
    from splitserve.loading.hf_config import read_generation_eos, resolve_dtype
    from splitserve.loading.resolve import resolve_model
    from splitserve.models.loader import load_hf_config
    from splitserve.models.registry import get_model_class
    from splitserve.multimodal.tensor_preprocess import resolve_preprocess_device
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)
    source = resolve_model(args.model)
    tokenizer_source = resolve_model(args.tokenizer) if args.tokenizer else None
    defaults = sampling_defaults(args.generation_config, source.directory, bool(source.gguf_file),
                                 args.override_generation_config)
    hf_config = load_hf_config(source)
    if args.num_frames is not None:  # frames sampled per video (Video NeVA); the model reads it
        if args.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {args.num_frames}")
        hf_config.num_frames = args.num_frames
    onnx, onnx_dtype = onnx_config(args, source, device)
    dtype = resolve_dtype(onnx_dtype or args.dtype, hf_config, device)
    quant_config = resolve_quant_config(args.quantization, hf_config, None if source.gguf_file else source.directory)
    context = getattr(hf_config, "max_position_embeddings", None) or 2048
    if args.max_model_len is not None and args.max_model_len > context:
        raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's context of {context} tokens")
    max_model_len = args.max_model_len or context
    eos = {hf_config.eos_token_id} if isinstance(hf_config.eos_token_id, int) else set(hf_config.eos_token_id or [])
    eos |= set(read_generation_eos(source))
    arch, _ = get_model_class(hf_config.architectures, hf_config)
    backend = args.attention_backend or ("triton" if device.startswith("cuda") else "torch_ref")
    return EngineConfig(
        model=ModelConfig(hf_config, arch, dtype, max_model_len, hf_config.vocab_size, tuple(sorted(eos)),
                          quant_config),
        cache=CacheConfig(args.block_size, args.gpu_memory_utilization, args.num_blocks,
                          args.cpu_kv_cache_gib, args.enable_prefix_caching, args.kv_cache_dtype),
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.scheduling_policy,
                                  args.mm_encoder_budget),
        compile=CompileConfig(enforce_eager=args.enforce_eager),
        device=device, attention_backend=backend,
        parallel=ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size, args.nnodes, args.node_rank,
                                args.master_addr, args.master_port, args.distributed_timeout_s, args.step_timeout_s,
                                distributed_executor_backend=args.distributed_executor_backend,
                                ray_address=args.ray_address, ray_placement_strategy=args.ray_placement_strategy,
                                ray_bundle_resource=args.bundle_resource(),
                                data_parallel_size=args.data_parallel_size,
                                data_parallel_backend=args.data_parallel_backend),
        load=LoadConfig(source, tokenizer_source, args.random_weights),
        lora=lora_config(args), onnx=onnx,
        kv_transfer=kv_transfer_config(args, args.world_size),
        speculative=speculative_config(args, hf_config, max_model_len),
        multimodal=MultiModalConfig(resolve_preprocess_device(args.mm_preprocess, device)),
        structured_outputs_fill=args.structured_outputs_fill,
        seed=args.seed, async_scheduling=args.async_scheduling,
        served_model_names=tuple(args.served_model_name or (source.name,)),
        sampling_defaults=defaults)
