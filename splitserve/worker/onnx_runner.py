"""The ONNX Runtime backend's model runner: an exported directory (`splitserve export`) served by the
engine's own scheduler, KV pool and sampler.

It is the ModelRunner (persistent batch, step layout, sampling) with the forward swapped: each step's
flat token stream goes through embed_tokens.onnx (and visual_encoder.onnx for image tokens), then
batchful.onnx in an ONNX Runtime session, whose BatchlessAttention nodes call back into the engine's
paged attention (attention/onnx_plugin.py) on the step's metadata. Why here, in worker/: the runner is
what the executor drives (executor/in_process.py builds it instead of loading torch weights), and it
needs the worker's batch layout; export/ sits above the engine and is needed only to write a directory.

The model object the runner keeps is the architecture built on the meta device (no weights): it
gives the KV layout (attention layers, KV heads, windows) and the multimodal hooks, whose `embed` and
`encode_images` are pointed at the ONNX sessions.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from splitserve.attention import onnx_plugin
from splitserve.attention.layer import ForwardContext, forward_context
from splitserve.config import EngineConfig
from splitserve.loading.onnx_export import OP_DOMAIN, OP_TYPE, ExportManifest, read_manifest
from splitserve.models.registry import get_model_class
from splitserve.multimodal.processor import to_device_pixels
from splitserve.worker.model_runner import ForwardBatch, ModelRunner

logger = logging.getLogger(__name__)
_NP_DTYPES = {"float32": np.float32, "float16": np.float16}


def build_shell(config: EngineConfig) -> torch.nn.Module:
    """The model's architecture on the meta device: structure without weights."""
    _, cls = get_model_class(config.model.hf_config.architectures, config.model.hf_config)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(config.model.dtype)
    try:
        with torch.device("meta"):
            model = cls(config.model.hf_config, None)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def plugin_model_bytes(path: str, dtype: str) -> bytes:
    """batchful.onnx with its BatchlessAttention nodes turned into the plugin's Python op (the
    extensions' domain), serialized without its weights: the session reads them from the directory."""
    import onnx
    from onnx import TensorProto, helper
    model = onnx.load(path, load_external_data=False)
    nodes, turned = [], 0
    for node in model.graph.node:
        if node.domain != OP_DOMAIN or node.op_type != OP_TYPE:
            nodes.append(node)
            continue
        node.domain, node.op_type = onnx_plugin.CONTRIB_DOMAIN, onnx_plugin.OP_NAME
        turned += 1
        if dtype != "float32":  # the Python op takes fp32: cast q, k, v in and the output back
            for i in range(3):
                cast = f"{node.name or 'cut'}_{turned}_in{i}_f32"
                nodes.append(helper.make_node("Cast", [node.input[i]], [cast], to=TensorProto.FLOAT))
                node.input[i] = cast
            out = node.output[0]
            node.output[0] = f"{out}_f32"
            nodes += [node, helper.make_node("Cast", [node.output[0]], [out], to=TensorProto.FLOAT16)]
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if turned == 0:
        raise ValueError(f"{path}: no {OP_DOMAIN}::{OP_TYPE} node; not a splitserve export")
    if not any(o.domain == onnx_plugin.CONTRIB_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(onnx_plugin.CONTRIB_DOMAIN, 1))
    return model.SerializeToString()


def providers_for(device: str) -> list:
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class OnnxModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None):
        import onnxruntime as ort
        self.manifest: ExportManifest = read_manifest(config.onnx.directory)
        if self.manifest.dtype not in _NP_DTYPES:
            raise ValueError(f"{config.onnx.directory}: ONNX Runtime serving takes float32 or float16 exports, "
                             f"this one is {self.manifest.dtype}")
        super().__init__(config, build_shell(config) if model is None else model)
        self.np_dtype = _NP_DTYPES[self.manifest.dtype]
        providers = providers_for(config.device)
        library = onnx_plugin.register()
        opts = ort.SessionOptions()
        opts.register_custom_ops_library(library)
        # The weights stay in the directory's .data files; the rewritten graph arrives as bytes.
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", self.manifest.directory)
        self.batchful = ort.InferenceSession(plugin_model_bytes(self.manifest.path("batchful"), self.manifest.dtype),
                                             opts, providers=providers)
        self.embed_session = ort.InferenceSession(self.manifest.path("embed_tokens"), providers=providers)
        visual = self.manifest.path("visual_encoder")
        self.visual_session = None if visual is None else ort.InferenceSession(visual, providers=providers)
        if self.mm is not None:  # the multimodal step encoder calls these on the model
            if self.visual_session is None:
                raise ValueError(f"{config.onnx.directory}: a vision-language model needs visual_encoder.onnx; "
                                 f"export it (--parts ...,visual_encoder)")
            self.model.embed = self.embed
            self.model.encode_images = self.encode_images
        logger.info("ONNX Runtime backend: %s on %s", self.manifest.directory, self.batchful.get_providers()[0])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        super().allocate_kv_cache(num_blocks)
        onnx_plugin.bind_kv_caches(self.kv_caches)

    def setup_fast_path(self) -> None:
        """Nothing to compile or capture: ONNX Runtime optimises the graph when the session starts."""

    def one_row_graph(self) -> bool:
        return False

    # -- the forward -------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, = self.embed_session.run(None, {"input_ids": input_ids.cpu().numpy()})
        return torch.from_numpy(out).to(self.device)

    def encode_images(self, items) -> list[torch.Tensor]:
        pixels = to_device_pixels(items, torch.device("cpu"), self.config.model.dtype)
        feats, = self.visual_session.run(None, {"pixel_values": pixels.numpy().astype(self.np_dtype, copy=False)})
        feats = torch.from_numpy(feats).to(self.device)
        return [f.reshape(-1, f.shape[-1]) for f in feats.split([it.pixel_values.shape[0] for it in items])]

    def _forward_logits(self, batch: ForwardBatch) -> torch.Tensor | None:
        if batch.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available on the onnxruntime backend")
        self.steps_by_path["eager"] += 1
        embeds = batch.inputs_embeds if batch.inputs_embeds is not None else self.embed(batch.input_ids)
        # A step that samples nothing (a prefill chunk) still stores its K/V: one row of logits, unused.
        rows = batch.logits_indices if batch.sample_requests else batch.positions.new_zeros(1)
        feeds = {"inputs_embeds": embeds.cpu().numpy().astype(self.np_dtype, copy=False),
                 "positions": batch.positions.cpu().numpy(), "logits_indices": rows.cpu().numpy()}
        with forward_context(ForwardContext(batch.meta, self.backend)):
            logits, = self.batchful.run(None, feeds)
        if not batch.sample_requests:
            return None
        return torch.from_numpy(logits).to(self.device)

