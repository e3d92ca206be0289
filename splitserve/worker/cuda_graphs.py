"""CUDA graphs: full-model graphs for pure-decode steps, piecewise graphs for every other step.

A decode step of B sequences is one token per sequence: its launch sequence depends only on B. We
capture the whole model (batchful layers, attention op, LM head) once per batch size in a list, with
every input read from static buffers, and replay the smallest graph that fits: padding rows get
slot -1 (not stored) and sequence length 0 (attention writes zeros), and their logits are ignored.

A mixed or prefill step's attention depends on its ragged layout, so only the batchful segments
between attention ops are captured (per token-count bucket); attention runs eagerly between them on
the real tokens. Padding rows are harmless there: every batchful layer treats rows independently.

All graphs share one memory pool. That is safe because a step replays one bucket's graphs in capture
order and no data passes between different buckets' graphs through pool memory.

An encoder-decoder model's decode graphs also hold its cross-attention ops (`cross_blocks`: the
widest cross block table): the cross metadata (each row's encoder length and cross blocks) has
static buffers of its own, filled by the backend's `prepare_cross_replay` like the self-attention's;
padding rows get encoder length 0. Encoders run eagerly before the forward, in the step that admits
a request (a decoder prompt of one start token makes that step a decode step too, so it may replay).

With LoRA (`lora_state`: the wrappers' shared flag, lora/layers.py) the graphs are captured with the
delta op, which reads the step's layout from static buffers, so steps with adapters replay them too.
Decode graphs are captured twice, with and without the delta, and a step without adapters replays
the plain one (its decode step then costs exactly what it costs without LoRA); piecewise graphs only
with it (a step without adapters runs the delta's launches, which return at once).
"""
from __future__ import annotations

import logging
import time

import torch

from splitserve.attention.backend import AttentionBackend, AttentionMetadata
from splitserve.attention.layer import ForwardContext, forward_context
from splitserve.models.interfaces import capabilities_of

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """The attention metadata's static buffers, how a graph's capture-time metadata is built from
    them and how they are refilled before a replay belong to the backend (decode_graph_state,
    capture_metadata, prepare_replay); the model's inputs and the logits are kept here.

    With use_graphs=False, run() refills the same buffers and runs the capture-time forward eagerly
    instead of replaying (CPU tests of the plumbing: the backend's hooks, padding, the logits buffer)."""

    def __init__(self, model, backend: AttentionBackend, sizes: list[int], max_blocks_per_seq: int,
                 max_model_len: int, num_kv_heads: int, device: torch.device, use_graphs: bool = True,
                 lora_state=None, cross_blocks: int = 0, block_size: int = 0, features=None):
        """features: (model, input_ids, positions) -> (final hidden states, [T, F] features) run
        instead of the model (an EAGLE head's inputs, worker/eagle_head.py); the graphs then also
        write the features into `self.features`."""
        self.model = model
        self.features_fn, self.features = features, None
        self.backend = backend
        self.use_graphs = use_graphs
        self.lora_state = lora_state
        # the captured variants: without the LoRA delta, and with it when the model has LoRA
        self.variants = (False,) if lora_state is None else (False, True)
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        n, dev = self.max_size, device
        # Static inputs are inference tensors like every other input of the compiled layers: a normal
        # tensor has another dispatch key set, and dynamo would compile the layers again for it.
        with torch.inference_mode():
            self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
            self.positions = torch.zeros(n, dtype=torch.long, device=dev)
            self.attn_state = backend.decode_graph_state(n, max_blocks_per_seq, max_model_len, num_kv_heads, dev)
            self.cross_state = backend.cross_graph_state(n, cross_blocks, block_size, dev) if cross_blocks else None
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        # Every graph writes its logits here: one [max_size, vocab] buffer in the model's dtype
        # instead of one per graph (together ~1 GB at 8B/128k vocab for sizes up to 512, taken from
        # the KV cache).
        self.logits: torch.Tensor | None = None

    def _forward(self, bs: int) -> None:
        meta = self.backend.capture_metadata(self.attn_state, bs)
        if self.cross_state is not None:
            meta.cross = self.backend.capture_cross_metadata(self.cross_state, bs)
        ctx = ForwardContext(meta, self.backend)
        with forward_context(ctx):
            if self.features_fn is None:
                hidden = self.model(self.input_ids[:bs], self.positions[:bs])
            else:
                hidden, features = self.features_fn(self.model, self.input_ids[:bs], self.positions[:bs])
                if self.features is None:
                    self.features = features.new_empty(self.max_size, features.shape[1])
                self.features[:bs].copy_(features)
        if self.logits is None:  # the first (warm-up, uncaptured) run: learn the vocabulary size
            logits = self.model.compute_logits(hidden)
            self.logits = torch.empty(self.max_size, logits.shape[1], dtype=logits.dtype, device=logits.device)
            self.logits[:bs].copy_(logits)
        else:
            self.model.compute_logits(hidden, out=self.logits[:bs])

    @torch.inference_mode()
    def capture(self, pool, stream: torch.cuda.Stream) -> None:
        start = time.perf_counter()
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            for lora in self.variants:
                t = time.perf_counter()
                if self.lora_state is not None:
                    self.lora_state.active = lora
                with torch.cuda.stream(stream):
                    self._forward(bs)  # warm-up: compile, autotune, allocate outside the graph
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._forward(bs)
                self.graphs[bs, lora] = graph
                logger.debug("decode graph for %d sequences%s captured in %.2f s", bs, " with LoRA" * lora,
                             time.perf_counter() - t)
        if self.lora_state is not None:
            self.lora_state.active = False
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d%s) in %.1f s", len(self.graphs),
                    self.sizes[0], self.max_size, ", with and without LoRA" if len(self.variants) > 1 else "",
                    time.perf_counter() - start)

    def padded_size(self, num_seqs: int) -> int | None:
        for bs in self.sizes:
            if bs >= num_seqs:
                return bs
        return None

    def run(self, num_seqs: int, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, lora: bool = False) -> torch.Tensor:
        """Copies the step's inputs (device tensors of num_seqs rows, one token each) into the static
        buffers, replays (the LoRA variant when the step has adapters; their layout is already in its
        buffers), and returns the logits of the real rows."""
        bs = self.padded_size(num_seqs)
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.backend.prepare_replay(self.attn_state, meta, bs)
        if self.cross_state is not None:
            self.backend.prepare_cross_replay(self.cross_state, meta.cross, bs)
        if self.use_graphs:
            self.graphs[bs, lora and self.lora_state is not None].replay()
        else:
            self._forward(bs)
        return self.logits[:num_seqs]


class PiecewiseGraphs:
    """Segment j of a step at n (padded) tokens: j = 0 embeds and computes layer 0's attention inputs;
    j = 1..L finishes layer j-1 from its attention output and computes layer j's inputs (or, after
    the last layer, the final norm). Segments read and write static buffers, so one CUDA graph per
    (segment, bucket) replays them; attention between segments reads q/k/v and writes attn_out.

    A vision-language model's step with image tokens starts from its input embeddings (token
    embeddings with image features among them): segment 0 then has a second graph per bucket that
    reads a static embeddings buffer instead of the token ids, and every other segment is shared.

    With use_graphs=False the same segments run eagerly on the same buffers (CPU tests of the
    plumbing: padding, buffer slicing, segment order)."""

    def __init__(self, model, sizes: list[int], device: torch.device, use_graphs: bool = True, lora_state=None,
                 aux_layers: tuple[int, ...] = ()):
        """aux_layers: layers whose input stream (x + residual) the segments also copy into static
        buffers (EAGLE-3's features, `aux_features`)."""
        self.model = model
        self.aux_layers = tuple(aux_layers)
        self.aux_index = {layer: i for i, layer in enumerate(sorted(set(aux_layers)))}
        self.lora_state = lora_state  # captured with the LoRA delta when given
        self.layers = list(model.layers)
        self.sizes = sorted(sizes)
        self.use_graphs = use_graphs
        caps = capabilities_of(model)
        self.accepts_embeds = caps.multimodal and not caps.image_steps_eager
        n, dev = self.sizes[-1], device
        attn = self.layers[0].self_attn
        dtype = attn.o_proj.params_dtype  # the activations' dtype (a quantized weight's is not)
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        with torch.inference_mode():  # as in DecodeGraphs: one compiled graph per layer half
            self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
            self.positions = torch.zeros(n, dtype=torch.long, device=dev)
            self.q = torch.zeros(n, q_size, dtype=dtype, device=dev)
            self.k = torch.zeros(n, kv_size, dtype=dtype, device=dev)
            self.v = torch.zeros(n, kv_size, dtype=dtype, device=dev)
            self.attn_out = torch.zeros(n, q_size, dtype=dtype, device=dev)
            self.aux = [torch.zeros(n, attn.o_proj.out_features, dtype=dtype, device=dev) for _ in self.aux_index]
            if self.accepts_embeds:
                self.embeds = torch.zeros(n, model.hidden_size, dtype=dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.embed_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # segment 0 from self.embeds
        self.hidden: dict[int, torch.Tensor] = {}

    def padded_size(self, num_tokens: int) -> int | None:
        for n in self.sizes:
            if n >= num_tokens:
                return n
        return None

    def _segment(self, j: int, n: int, residual: torch.Tensor | None, from_embeds: bool = False) -> torch.Tensor:
        """Runs segment j at n tokens; returns the residual stream (the hidden states after the last).
        Segment 0 starts from the token ids, or from self.embeds when from_embeds."""
        if j == 0:
            x = self.embeds[:n] if from_embeds else self.model.embed(self.input_ids[:n])
            x, residual = self.model.start(x, self.positions[:n])
        else:
            x, residual = self.layers[j - 1].attn_outputs(self.attn_out[:n], residual)
        if j == len(self.layers):
            return self.model.norm(x, residual)[0]
        q, k, v, residual = self.layers[j].attn_inputs(x, residual)
        if j in self.aux_index:  # the stream entering layer j
            self.aux[self.aux_index[j]][:n].copy_(residual)
        self.q[:n].copy_(q)
        self.k[:n].copy_(k)
        self.v[:n].copy_(v)
        return residual

    @torch.inference_mode()
    def capture(self, pool, stream: torch.cuda.Stream) -> None:
        start = time.perf_counter()
        num_segments = len(self.layers) + 1
        if self.lora_state is not None:
            self.lora_state.active = True
        for n in reversed(self.sizes):
            with torch.cuda.stream(stream):
                residual = None
                for j in range(num_segments):  # warm-up outside the graphs (compilation, cuBLAS plans)
                    residual = self._segment(j, n, residual)
            torch.cuda.current_stream().wait_stream(stream)
            graphs, residual = [], None
            for j in range(num_segments):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._segment(j, n, residual)
                if j == 0 and self.accepts_embeds:
                    # Same output tensor as the ids variant: segment 1 reads whichever replayed.
                    with torch.cuda.stream(stream):
                        self._segment(0, n, None, from_embeds=True)  # warm-up (compilation)
                    torch.cuda.current_stream().wait_stream(stream)
                    self.embed_graphs[n] = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(self.embed_graphs[n], pool=pool, stream=stream):
                        out_e = self._segment(0, n, None, from_embeds=True)
                        out.copy_(out_e)
                # Dropping the previous residual lets later captures reuse its memory: they replay
                # after this segment, which has read it by then.
                residual = out
                graphs.append(graph)
            self.graphs[n], self.hidden[n] = graphs, residual
        if self.lora_state is not None:
            self.lora_state.active = False
        torch.cuda.synchronize()
        logger.info("captured piecewise CUDA graphs for %d token counts (%d..%d), %d segments each, in %.1f s",
                    len(self.sizes), self.sizes[0], self.sizes[-1], num_segments, time.perf_counter() - start)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
            inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's T tokens (from inputs_embeds when given: a
        model with accepts_embeds only)."""
        T = input_ids.shape[0]
        n = self.padded_size(T)
        from_embeds = inputs_embeds is not None
        if from_embeds:
            self.embeds[:T].copy_(inputs_embeds)
        else:
            self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(positions)
        residual = None
        with forward_context(ctx):
            for j in range(len(self.layers) + 1):
                if j > 0:
                    out = self.layers[j - 1].self_attn.attn(self.q[:T], self.k[:T], self.v[:T], self.positions[:T])
                    self.attn_out[:T].copy_(out)
                if self.use_graphs:
                    (self.embed_graphs[n] if j == 0 and from_embeds else self.graphs[n][j]).replay()
                else:
                    residual = self._segment(j, n, residual, from_embeds and j == 0)
        return (self.hidden[n] if self.use_graphs else residual)[:T]

    def aux_features(self, T: int) -> torch.Tensor | None:
        """The last run's streams entering aux_layers, concatenated [T, len * hidden] (None: none)."""
        if not self.aux_layers:
            return None
        return torch.cat([self.aux[self.aux_index[i]][:T] for i in self.aux_layers], dim=-1)
