"""splitserve: batchful layers on the flat token stream, batchless paged attention."""
from splitserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name):
    if name == "LLM":  # lazy: importing torch and transformers is slow
        from splitserve.engine.llm import LLM
        return LLM
    if name == "LoRARequest":
        from splitserve.protocol.lora import LoRARequest
        return LoRARequest
    raise AttributeError(name)
