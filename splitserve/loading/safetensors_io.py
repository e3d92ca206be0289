"""Reading a directory of safetensors files as (HF name, tensor) pairs.

Its own module because both the generic loader and families with their own layout (VILA's part
folders) read safetensors, and the loader in turn asks those families about their layouts.

With `lazy=True` (tensor or pipeline parallelism) the pairs carry `LazySlice`s instead of tensors:
nothing is read until the layer that takes the tensor has cut its rank's part out of it
(`narrow`), so each rank reads only its slices of the file (safetensors' `get_slice`), and a
pipeline stage reads nothing of the layers it does not hold.
"""
from __future__ import annotations

import glob
import os
from typing import Iterator

import torch
from tqdm import tqdm


class LazySlice:
    """A checkpoint tensor not read yet: its shape, and `narrow` / `materialize` like a tensor's.
    Valid while its file is open (the reader's loop: consume each pair before asking for the next)."""

    def __init__(self, source, shape: tuple[int, ...], index: tuple[slice, ...] | None = None):
        self._source = source
        self.shape = torch.Size(shape)
        self._index = index or tuple(slice(0, n) for n in shape)

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> "LazySlice":
        dim = dim % len(self.shape)
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"slice [{start}, {start + length}) is outside dimension {dim} of {tuple(self.shape)}")
        base = self._index[dim].start
        index = self._index[:dim] + (slice(base + start, base + start + length),) + self._index[dim + 1:]
        shape = self.shape[:dim] + (length,) + self.shape[dim + 1:]
        return LazySlice(self._source, tuple(shape), index)

    def materialize(self) -> torch.Tensor:
        if not self.shape:  # a scalar: slicing does not apply
            return self._source[()]
        return self._source[self._index]


def iter_safetensors(directory: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazySlice]]:
    from safetensors.torch import safe_open
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    for path in tqdm(files, desc="loading safetensors", disable=len(files) < 2):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if lazy:
                    piece = f.get_slice(name)
                    yield name, LazySlice(piece, tuple(piece.get_shape()))
                else:
                    yield name, f.get_tensor(name)
