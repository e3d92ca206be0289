"""The front-side processor of a built (or weightless, meta-device) model: the generic placeholder-run
processor (multimodal/processor.py) for image-taking models, a model's own class where it has one
(Pix2Struct, Nougat: prompts that are not placeholder runs), None for text-only models. Chosen from
the model's capabilities (models/interfaces.py), not by probing it."""
from __future__ import annotations

from splitserve.models.interfaces import capabilities_of
from splitserve.multimodal.processor import MultiModalProcessor


def build_mm_processor(model, source, tokenizer):
    """The processor for a vision-language model, None for a text-only one."""
    caps = capabilities_of(model)
    if not caps.multimodal:
        return None
    cls = model.mm_processor_class() if caps.own_processor else MultiModalProcessor
    return cls(model, source.directory, tokenizer)
