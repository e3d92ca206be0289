"""--seed: the random state unseeded sampling draws from, set where the model runs (each rank too)."""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seeds torch's generators (CUDA's included), Python's and numpy's, as vLLM's --seed does."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)
