"""What the sampler needs to know about the rows of a step, as plain per-row data.

The worker builds it from its persistent batch (worker/sampling_metadata.py) for the rows that
sample, in logits-row order. Arrays are host numpy arrays (the sampler copies what it uses to the
device); rare features (penalties, min_tokens, seeded generators) are listed only for the rows that
use them, so a plain greedy step carries no per-row Python objects at all.

Per-request changes of logits come as flat data, applied in one operation each, whatever the number
of rows: a sparse bias (row, token, value) for logit_bias, bans (min_tokens, bad words: value
`BANNED`), the allowed tokens of rows with allowed_token_ids, and the grammar bitmask rows of
constrained requests (structured outputs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

BANNED = float("-inf")  # the bias of a token that may not be sampled


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
    # Added to logits[bias_rows[i], bias_token_ids[i]] (accumulated: a ban stays a ban): logit_bias,
    # and bans (BANNED) of stop ids / EOS under min_tokens and of bad words. None when no row has any.
    bias_rows: np.ndarray | None = None       # [N] int64
    bias_token_ids: np.ndarray | None = None  # [N] int64
    bias_values: np.ndarray | None = None     # [N] float32
    # allowed_token_ids: rows that may sample only the listed tokens, as (row, token) pairs.
    allowed_rows: np.ndarray | None = None       # [M] int64
    allowed_token_ids: np.ndarray | None = None  # [M] int64
    # Structured outputs: the rows of constrained requests and their token bitmasks ([G, ceil(V/32)]
    # int32 on the host; bit t % 32 of word t // 32 set: token t allowed).
    grammar_rows: np.ndarray | None = None    # [G] int64
    grammar_bitmask: torch.Tensor | None = None
    # The bitmask arrived after the step's forward was launched (the engine core fills it while the
    # device runs the model, having taken in the tokens of the step before first).
    grammar_after_launch: bool = False
    # Rows whose sampling reads earlier tokens on the host (bad words of several tokens).
    reads_history: bool = False

    @property
    def needs_penalties(self) -> bool:
        return bool(self.penalties)

    @property
    def needs_host_tokens(self) -> bool:
        """The next step must not be launched before this one's tokens are on the host: penalties and
        bad words read them, and a grammar's next mask needs them (unless the core fills masks after
        launching: it takes in the tokens it waits for before it fills the next one)."""
        return (bool(self.penalties) or self.reads_history
                or (self.grammar_rows is not None and not self.grammar_after_launch))
