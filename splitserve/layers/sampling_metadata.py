"""What the sampler needs to know about the rows of a step, as plain per-row data.

The worker builds it from its persistent batch (worker/sampling_metadata.py) for the rows that
sample, in logits-row order. Arrays are host numpy arrays (the sampler copies what it uses to the
device); rare features (penalties, min_tokens, seeded generators) are listed only for the rows that
use them, so a plain greedy step carries no per-row Python objects at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch


@dataclass
class PenaltyRow:
    """A row with repetition / presence / frequency penalties and the tokens they read."""
    row: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # sampled so far (all known on the host: such steps sync)


@dataclass
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    # Per row, set when not all_greedy (None otherwise): greedy flags, temperature (raw; the sampler
    # floors it at 1e-5), top_k (0: off), top_p, min_p. Floats are the parameters' own (float64):
    # the sampler decides on them and sends them to the device as float32.
    greedy: np.ndarray | None = None        # [S] bool
    temperature: np.ndarray | None = None   # [S] float64
    top_k: np.ndarray | None = None         # [S] int64
    top_p: np.ndarray | None = None         # [S] float64
    min_p: np.ndarray | None = None         # [S] float64
    # Rows that draw from their own generator (seeded, not greedy), ascending by row: a seeded
    # request's tokens do not depend on the rest of the batch.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None     # the largest `logprobs` asked for among the rows, if any
    penalties: list[PenaltyRow] = field(default_factory=list)
    # Rows still under their min_tokens, with the ids they may not sample yet (stop ids, EOS).
    min_tokens_bans: list[tuple[int, Sequence[int]]] = field(default_factory=list)

    @property
    def needs_penalties(self) -> bool:
        return bool(self.penalties)
