"""Reading a directory of safetensors files as (HF name, tensor) pairs.

Its own module because both the generic loader and families with their own layout (VILA's part
folders) read safetensors, and the loader in turn asks those families about their layouts.
"""
from __future__ import annotations

import glob
import os
from typing import Iterator

import torch
from tqdm import tqdm


def iter_safetensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    for path in tqdm(files, desc="loading safetensors", disable=len(files) < 2):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
