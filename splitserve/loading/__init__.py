"""Reading checkpoints, below models/: resolving a model path (`resolve.py`: ModelSource, tokenizers),
configs (`hf_config.py`, `text_config.py`, `generation_config.py`), tensors (`safetensors_io.py`,
`gguf_io.py`, `nemo_archive.py`) and special-token ids (`checkpoint_tokens.py`). Building a model
from them (registry lookup, construction, weight loading) is models/loader.py's."""
