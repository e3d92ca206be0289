"""The model interface, explicit: what the worker, the runner, the pipeline stages, LoRA and the front's
processor call on a model, as typing.Protocol classes, and the capabilities a model has, computed once
when it is built (`capabilities_of`, called by models/loader.load_model) instead of being probed with
getattr/hasattr where they are used.

- TextModel: every model. The runner's flat token stream: `forward(input_ids, positions, ...)` returns
  hidden states [T, hidden], `compute_logits(hidden, out=None)` the logits; `load_weights` takes
  (checkpoint name, tensor) pairs and returns the parameter names it filled.
- SupportsImagePrompts: models that take images through placeholder runs (decoder-only VLMs, BLIP-2
  T5): the image token id and `num_image_tokens`; the optional hooks are the attributes of
  models/prompt_hooks.ImagePromptHooks, None where a model has none (multimodal/ reads them as plain
  attributes: it sits below models/ and cannot import this module, so the contract is written here).
  Models with a processor of their own (`mm_processor_class`: Pix2Struct, Nougat) are exempt.
- SupportsImageInput: images in the decoder's input (decoder-only VLMs): also `encode_images`,
  `embed` (multimodal/step.py).
- EncoderDecoder: `encode` (a step's encoder inputs -> encoder hidden states) and `store_cross_kv`
  (worker/encoder_decoder.py).
- SupportsPiecewise: the decoder in segments for piecewise CUDA graphs (worker/cuda_graphs.py):
  `layers` split at attention (`attn_inputs` / `attn_outputs`), `start`, `norm`.
- SupportsLoRA: decoder `layers` whose projections lora/layers.attach_lora wraps.
- SupportsPipeline: `forward(..., intermediate=...)` runs this pipeline stage's layers
  (parallel/pipeline.py); without it every stage holds the whole model.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch


@runtime_checkable
class TextModel(Protocol):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *args, **kwargs) -> Any: ...

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...


@runtime_checkable
class SupportsImagePrompts(Protocol):
    """The front's side: what multimodal/processor.MultiModalProcessor reads (with the optional hooks
    of models/prompt_hooks.ImagePromptHooks)."""
    is_multimodal: bool
    image_token_id: int | None

    def num_image_tokens(self, num_tiles: int, image_size: tuple[int, int]) -> int: ...


@runtime_checkable
class SupportsImageInput(SupportsImagePrompts, Protocol):
    """Images in the decoder's input embeddings: what multimodal/step.py calls each step."""

    def encode_images(self, items) -> list[torch.Tensor]: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class EncoderDecoder(Protocol):
    is_encoder_decoder: bool

    def encode(self, inputs: list) -> torch.Tensor: ...

    def store_cross_kv(self, hidden: torch.Tensor, slots: torch.Tensor, backend) -> None: ...


@runtime_checkable
class SupportsPiecewise(Protocol):
    layers: Any
    norm: Any

    def start(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class SupportsLoRA(Protocol):
    layers: Any  # decoder layers with self_attn / mlp projections (lora/layers._WRAPPED)


@runtime_checkable
class SupportsPipeline(Protocol):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
                intermediate=None) -> Any: ...


@dataclass(frozen=True)
class ModelCapabilities:
    """What a built model supports; the runner and the worker read this instead of probing the model."""
    multimodal: bool         # takes images (the front builds a processor; see own_processor)
    encoder_decoder: bool    # runs an encoder per request and cross-attention (worker/encoder_decoder.py)
    decoder_images: bool     # images enter the decoder's input embeddings (multimodal/step.py)
    own_processor: bool      # brings its own front-side processor class (mm_processor_class)
    piecewise: bool          # the decoder can run in piecewise CUDA graph segments
    lora: bool               # has decoder layers LoRA can wrap
    pipeline_stages: bool    # forward takes `intermediate`: a stage runs its own layers
    # (directory, lazy) -> (name, tensor) pairs, for a family whose checkpoint is not one safetensors
    # folder (VILA's part folders, NeVA's .nemo); None: loading/safetensors_io.iter_safetensors
    weight_reader: Callable[..., Iterator[tuple[str, torch.Tensor]]] | None = None
    image_steps_eager: bool = False  # its steps with image tokens never replay piecewise graphs (CogVLM)


def _flag(model, name: str) -> bool:
    # Class-level flags of the interface (is_multimodal, is_encoder_decoder): a model that does not
    # declare one does not have the capability. The one place they are read off the model.
    return bool(inspect.getattr_static(model, name, False))


def protocol_members(protocol: type) -> frozenset[str]:
    """The names a Protocol class asks for: its annotated attributes and its public methods, its
    protocol bases' included."""
    names: set[str] = set()
    for base in protocol.__mro__:
        if base is Protocol or not getattr(base, "_is_protocol", False):
            continue
        names |= set(vars(base).get("__annotations__", {}))
        names |= {name for name, value in vars(base).items() if callable(value) and not name.startswith("_")}
    return frozenset(names)


def satisfies(obj, protocol: type) -> bool:
    """isinstance(obj, protocol) for a runtime_checkable Protocol, the same on every Python. Python 3.12
    looks the members up with inspect.getattr_static, which misses what nn.Module.__getattr__ finds (a
    module's submodules, such as `layers`, live in its _modules) and a compiled layer's wrapped methods
    (torch.compile's OptimizedModule forwards them by __getattr__): there every model would lose its
    capabilities. hasattr sees them."""
    return all(hasattr(obj, name) for name in protocol_members(protocol))


def _compute(model) -> ModelCapabilities:
    multimodal = _flag(model, "is_multimodal")
    encoder_decoder = _flag(model, "is_encoder_decoder")
    own_processor = multimodal and inspect.getattr_static(model, "mm_processor_class", None) is not None
    if encoder_decoder and not satisfies(model, EncoderDecoder):
        raise TypeError(f"{type(model).__name__} says is_encoder_decoder but lacks encode/store_cross_kv")
    if multimodal and not own_processor and not satisfies(model, SupportsImagePrompts):
        raise TypeError(f"{type(model).__name__} says is_multimodal but lacks the SupportsImagePrompts members "
                        f"(models/interfaces.py)")
    if multimodal and not encoder_decoder and not satisfies(model, SupportsImageInput):
        raise TypeError(f"{type(model).__name__} says is_multimodal but lacks the SupportsImageInput methods "
                        f"(models/interfaces.py)")
    layers = model.layers if satisfies(model, SupportsLoRA) else None
    piecewise = (satisfies(model, SupportsPiecewise) and bool(layers)
                 and all(satisfies(layer, _SplitLayer) for layer in layers))
    stages = "intermediate" in inspect.signature(type(model).forward).parameters
    reader = inspect.getattr_static(model, "iter_weights", None)
    return ModelCapabilities(multimodal=multimodal, encoder_decoder=encoder_decoder,
                             decoder_images=multimodal and not encoder_decoder, own_processor=own_processor,
                             piecewise=piecewise, lora=bool(layers), pipeline_stages=stages,
                             image_steps_eager=_flag(model, "image_steps_eager"),
                             weight_reader=reader.__func__ if isinstance(reader, staticmethod) else reader)


@runtime_checkable
class _SplitLayer(Protocol):
    """A decoder layer split at attention (models/decoder.DecoderLayer): what piecewise graphs and the
    compiled halves (worker/model_runner.compile_layers) run."""

    def attn_inputs(self, *args, **kwargs) -> Any: ...


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def capabilities_of(model) -> ModelCapabilities:
    """The model's capabilities, checked against the protocols once per model object (at load:
    models/loader.load_model) and remembered; a model that claims a capability without its methods
    is refused there."""
    caps = _CACHE.get(model)
    if caps is None:
        caps = _CACHE[model] = _compute(model)
    return caps
