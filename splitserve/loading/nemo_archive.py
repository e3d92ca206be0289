"""NeMo `.nemo` archives: unpacked once into a cache directory the rest of the engine reads like a
model directory, and NeMo (Megatron) weight names mapped onto the engine's decoder.

A `.nemo` file is a tar (plain or gzip'd) holding `model_config.yaml`, the weights and the
tokenizer's files (named in the config as `nemo:<member>`). Weights: `model_weights.ckpt` (a torch
state dict), or one per tensor-parallel rank (`mp_rank_NN/model_weights.ckpt`), merged here along
each projection's split dimension. Newer NeMo writes a `model_weights/` directory of a distributed
(torch_dist / zarr) checkpoint: not read; the error says so.

The cache directory (`$SPLITSERVE_CACHE_DIR` or ~/.cache/splitserve, `nemo/<key>`, keyed by the
file's path, size and mtime) holds:
    config.json              {"architectures": ["NevaForCausalLM"], "vocab_size", "weights": [...], ...}
    archive/                 the archive's members
    tokenizer files          an HF tokenizer made from the archive's (HF files as they are; a
                             sentencepiece model through transformers), with the conversation template
                             of the config as its chat template (loading/neva_nemo.py)
    preprocessor_config.json the vision tower's image processor
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tarfile
from typing import Iterator

import torch

logger = logging.getLogger(__name__)

NEMO_FORMAT_VERSION = 2  # bump when the unpacked layout changes: old cache entries are rebuilt
_WEIGHTS_FILE = "model_weights.ckpt"


def is_nemo_file(path: str) -> bool:
    return path.endswith(".nemo") and os.path.isfile(path)


def _cache_root() -> str:
    base = os.environ.get("SPLITSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "splitserve")
    return os.path.join(base, "nemo")


def _extract(path: str, dest: str) -> None:
    try:
        with tarfile.open(path, "r:*") as tar:  # r:* reads plain and gzip'd archives alike
            tar.extractall(dest, filter="data")  # refuses absolute paths, links out of dest, devices
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ValueError(f"{path} is not a readable .nemo archive (a tar of model_config.yaml and "
                         f"weights): {e}") from None


def _find(root: str, name: str) -> str | None:
    """A member by file name anywhere in the unpacked archive (members may sit under ./)."""
    for folder, dirs, files in os.walk(root):
        if name in files or name in dirs:
            return os.path.join(folder, name)
    return None


def weight_files(archive: str) -> list[str]:
    """The archive's torch state dicts, in tensor-parallel rank order."""
    single = _find(archive, _WEIGHTS_FILE)
    ranks = sorted((os.path.join(folder, _WEIGHTS_FILE) for folder, _, files in os.walk(archive)
                    if _WEIGHTS_FILE in files and re.fullmatch(r"(mp_rank_\d+|tp_rank_\d+(_pp_rank_000)?)",
                                                               os.path.basename(folder))),
                   key=lambda p: int(re.search(r"_rank_(\d+)", os.path.basename(os.path.dirname(p))).group(1)))
    if any(re.search(r"pp_rank_0*[1-9]", folder) for folder, _, _ in os.walk(archive)):
        raise ValueError("this .nemo archive is split into pipeline-parallel stages (tp_rank_*_pp_rank_*); "
                         "only tensor-parallel splits (mp_rank_*) and single checkpoints are read")
    if ranks:
        return ranks
    if single is not None:
        return [single]
    if _find(archive, "model_weights") is not None:
        raise ValueError("this .nemo archive holds a distributed checkpoint (a model_weights/ directory of "
                         "torch_dist or zarr shards, written by newer NeMo); splitserve reads the "
                         "model_weights.ckpt layout (one torch state dict, or mp_rank_NN/model_weights.ckpt "
                         "per tensor-parallel rank): convert it with NeMo first")
    raise ValueError(f"this .nemo archive has no {_WEIGHTS_FILE} (members: model_config.yaml and the weights "
                     f"expected)")


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """One rank's state dict, memory-mapped; only tensors are accepted (no pickled code runs)."""
    try:
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} could not be read as a torch state dict of tensors: {e}") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]  # a Lightning checkpoint
    if not isinstance(sd, dict):
        raise ValueError(f"{path} does not hold a state dict")
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


# -- tensor-parallel merge --------------------------------------------------------------------------
# Megatron's column-parallel layers split their output rows across ranks, row-parallel ones their
# input columns; everything else (norms, row-parallel biases, the projector, the vision tower) is
# replicated. Concatenating the column shards keeps the fused QKV's per-group interleave intact:
# each rank holds whole query groups.
_COLUMN = re.compile(r"(query_key_value|linear_qkv|dense_h_to_4h|linear_fc1|word_embeddings|output_layer)\.(weight|bias)$")
_ROW = re.compile(r"(self_attention\.dense|dense_4h_to_h|linear_proj|linear_fc2)\.weight$")
_REPLICATED = re.compile(r"adapter_layer|vision_encoder|mm_projector")


def iter_merged(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    shards = [load_state_dict(f) for f in files]
    for name, first in shards[0].items():
        if len(shards) == 1 or _REPLICATED.search(name):
            yield name, first
        elif _COLUMN.search(name):
            yield name, torch.cat([s[name] for s in shards], dim=0)
        elif _ROW.search(name):
            yield name, torch.cat([s[name] for s in shards], dim=1)
        else:
            yield name, first


# -- unpacking --------------------------------------------------------------------------------------
def unpack(path: str, write_model_files) -> str:
    """The cache directory of a .nemo file, unpacked and converted on first use. `write_model_files(out,
    archive, nemo_cfg, nemo_dir) -> dict` is the model's (loading/neva_nemo.py): what it needs beside the
    weights, and the config entries that record it (passed in: this module stays below the model)."""
    import yaml
    path = os.path.abspath(path)
    stat = os.stat(path)
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{NEMO_FORMAT_VERSION}".encode()).hexdigest()[:16]
    final = os.path.join(_cache_root(), key)
    if os.path.exists(os.path.join(final, "config.json")):
        return final
    tmp = f"{final}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    archive = os.path.join(tmp, "archive")
    os.makedirs(archive)
    try:
        _extract(path, archive)
        cfg_path = _find(archive, "model_config.yaml")
        if cfg_path is None:
            raise ValueError(f"{path} has no model_config.yaml: not a .nemo archive")
        with open(cfg_path) as f:
            nemo_cfg = yaml.safe_load(f)
        if not isinstance(nemo_cfg, dict):
            raise ValueError(f"{path}: model_config.yaml is not a mapping")
        files = weight_files(archive)
        vocab = _vocab_size(files)
        info = write_model_files(tmp, archive, nemo_cfg, os.path.dirname(path))
        # no model_type: transformers reads this file too (AutoTokenizer) and knows no "neva"
        config = {"architectures": ["NevaForCausalLM"], "vocab_size": vocab,
                  "nemo_file": path, "weights": [os.path.relpath(f, tmp) for f in files], **info}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        if os.path.exists(os.path.join(final, "config.json")):  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
            return final
        if os.path.exists(final):  # a half-written entry of an older run
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:  # lost a race to another process's rename
            if not os.path.exists(os.path.join(final, "config.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _vocab_size(files: list[str]) -> int:
    rows = 0
    for f in files:
        sd = load_state_dict(f)
        emb = [v for k, v in sd.items() if k.endswith("word_embeddings.weight") and "adapter" not in k]
        if not emb:
            raise ValueError(f"{f} has no word_embeddings.weight: not a NeMo GPT / NeVA checkpoint")
        rows += emb[0].shape[0]
    return rows


def copy_hf_files(src_dir: str, dst_dir: str, names: tuple[str, ...]) -> list[str]:
    copied = []
    for name in names:
        p = os.path.join(src_dir, name)
        if os.path.isfile(p):
            shutil.copy(p, os.path.join(dst_dir, name))
            copied.append(name)
    return copied
