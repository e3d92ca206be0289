"""Batched sampling on the device: penalties, logit changes by request (allowed tokens, logit_bias,
min_tokens and bad-word bans, grammar bitmasks), temperature, top-k/top-p/min-p, logprobs.

Sampling draws the token as argmax(probs / q) with q ~ Exp(1) per vocabulary entry (the exponential
race, equivalent to sampling from probs). A seeded request draws its q from its own generator, so its
tokens do not depend on what else is in the batch.

The sampler reads tensors and plain per-row data (`SamplingMetadata`), never request objects.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitserve.layers.sampling_metadata import PenaltyRow, SamplingMetadata

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "PenaltyRow", "token_logprobs"]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                  # [B] int64
    logprobs: torch.Tensor | None = None     # [B, 1 + k]: sampled token's logprob, then the top k
    logprob_ids: torch.Tensor | None = None  # [B, 1 + k] the matching token ids
    logprob_ranks: torch.Tensor | None = None  # [B] the sampled token's rank by logprob (1: the likeliest)
    # Penalties, bad words and grammars read a request's previous tokens on the host: the next step
    # cannot be launched before these tokens are known there.
    needs_host_tokens: bool = False


def _to_device(values, device: torch.device, dtype=None) -> torch.Tensor:
    """A small per-step tensor from host values (a list or a numpy array), copied without
    synchronising the stream (a copy from pageable memory would wait for the device: the engine
    overlaps steps)."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(values))
        if dtype is not None:
            host = host.to(dtype)
        if device.type == "cuda":
            host = host.pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


# Bits of each byte value, to unpack a bitmask one byte at a time: [256, 8] bool.
_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets logits[rows[i], t] to -inf where bit t % 32 of bitmask[i, t // 32] is clear, for all rows
    at once (xgrammar's layout). Tokens past the bitmask's width (a vocabulary padded beyond it) are
    not allowed. The int32 words are read as little-endian bytes, so token t is bit t % 8 of byte
    t // 8 (x86 and CUDA are little-endian)."""
    device = logits.device
    table = _BYTE_BITS.get(device)
    if table is None:
        table = _BYTE_BITS[device] = ((torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device))
                                      & 1).bool()
    num_rows, vocab = len(rows), logits.shape[1]
    banned = ~table[bitmask.contiguous().view(torch.uint8).long()].view(num_rows, -1)
    if banned.shape[1] >= vocab:
        banned = banned[:, :vocab]
    else:
        banned = torch.nn.functional.pad(banned, (0, vocab - banned.shape[1]), value=True)
    sub = logits[rows]
    sub.masked_fill_(banned, float("-inf"))
    logits[rows] = sub


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                   num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of [B, V] logprobs: ([B, 1 + k] values, [B, 1 + k] ids) of the given token then the
    top k, and [B] the given token's rank (1 + how many tokens are strictly likelier)."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ids = token_ids[:, None]
    ranks = (logprobs > chosen).sum(1) + 1
    if num_top > 0:
        top_vals, top_ids = logprobs.topk(num_top, dim=-1)
        chosen, ids = torch.cat([chosen, top_vals], 1), torch.cat([ids, top_ids], 1)
    return chosen, ids, ranks


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        device = logits.device
        num_top = meta.max_num_logprobs
        logits, raw_logprobs = self.process(logits, meta)
        tokens = logits.argmax(dim=-1)
        if not meta.all_greedy:
            sampled = self.race(self.probs(logits, meta), meta)
            tokens = torch.where(_to_device(meta.greedy, device), tokens, sampled)

        out = SamplerOutput(tokens, needs_host_tokens=meta.needs_host_tokens)
        if raw_logprobs is not None:
            out.logprobs, out.logprob_ids, out.logprob_ranks = token_logprobs(raw_logprobs, tokens, num_top)
        return out

    def process(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits every row samples from, after penalties and the per-request changes (allowed
        tokens, biases and bans, grammar masks), and the raw log-probabilities when a row asks for
        logprobs. Shared with the speculative verifier (layers/rejection_sampler.py)."""
        device = logits.device
        num_top = meta.max_num_logprobs
        needs_penalties = meta.needs_penalties
        if num_top is not None or needs_penalties or not meta.all_greedy:
            # Softmax and penalties in fp32. A plain greedy batch skips the copy (1,000 rows of a
            # 128k vocabulary: 0.5 GB written and read again per step) and takes the argmax of the
            # model-dtype logits, which is the same token.
            logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if num_top is not None else None

        if needs_penalties:
            logits = self._apply_penalties(logits, meta.penalties)
        if meta.allowed_rows is not None:
            self._keep_allowed(logits, meta)
        if meta.bias_rows is not None:
            logits.index_put_((_to_device(meta.bias_rows, device), _to_device(meta.bias_token_ids, device)),
                              _to_device(meta.bias_values, device).to(logits.dtype), accumulate=True)
        if meta.grammar_rows is not None:
            apply_token_bitmask(logits, _to_device(meta.grammar_rows, device),
                                _to_device(meta.grammar_bitmask.numpy(), device))
        return logits, raw_logprobs

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, penalties: list[PenaltyRow]) -> torch.Tensor:
        logits = logits.clone()
        B, V = logits.shape
        device = logits.device
        for p in penalties:  # only rows that ask for penalties; rare in serving
            row = logits[p.row]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(p.prompt_token_ids) | set(p.output_token_ids)), device=device,
                                    dtype=torch.long)
                seen = seen[seen < V]
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and p.output_token_ids:
                counts = torch.bincount(torch.tensor(p.output_token_ids, device=device), minlength=V)[:V].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    @staticmethod
    def _keep_allowed(logits: torch.Tensor, meta: SamplingMetadata) -> None:
        """Rows with allowed_token_ids keep only those tokens' logits."""
        device = logits.device
        rows = np.unique(meta.allowed_rows)
        local = np.searchsorted(rows, meta.allowed_rows)  # each pair's row among the restricted rows
        keep = torch.zeros((len(rows), logits.shape[1]), dtype=torch.bool, device=device)
        keep[_to_device(local, device), _to_device(meta.allowed_token_ids, device)] = True
        rows_t = _to_device(rows, device)
        logits[rows_t] = logits[rows_t].masked_fill(~keep, float("-inf"))

    @staticmethod
    def probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Each row's sampling weights over the vocabulary (temperature, top-k, top-p, min-p applied;
        not renormalised after the cuts: the exponential race does not need it)."""
        device = logits.device
        temperature = _to_device(np.maximum(meta.temperature, 1e-5).astype(np.float32), device)
        logits = logits / temperature[:, None]
        if meta.top_k.any():
            V = logits.shape[1]
            k = _to_device(np.where(meta.top_k > 0, meta.top_k, V).astype(np.int64), device).clamp(max=V)
            sorted_logits = logits.sort(dim=-1, descending=True).values
            kth = sorted_logits.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        if (meta.top_p < 1.0).any():
            top_p = _to_device(meta.top_p.astype(np.float32), device)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep a token if the mass before it is below top_p (the first token is always kept).
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if (meta.min_p > 0).any():
            min_p = _to_device(meta.min_p.astype(np.float32), device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    @staticmethod
    def race(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """One token per row, drawn in proportion to the row's weights (the exponential race); a
        row with a generator draws from it."""
        device = probs.device
        q = torch.empty_like(probs)
        for i in sorted(meta.generators):
            q[i].exponential_(generator=meta.generators[i])
        num_rows = probs.shape[0]
        if len(meta.generators) < num_rows:
            unseeded = torch.ones(num_rows, dtype=torch.bool)
            unseeded[list(meta.generators)] = False
            idx = _to_device(unseeded.nonzero().squeeze(1).tolist(), device, torch.long)
            q[idx] = torch.empty((len(idx), probs.shape[1]), device=device).exponential_()
        return (probs / q).argmax(dim=-1)
