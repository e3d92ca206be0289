"""Batched sampling on the device: penalties, min_tokens, temperature, top-k/top-p/min-p, logprobs.

Sampling draws the token as argmax(probs / q) with q ~ Exp(1) per vocabulary entry (the exponential
race, equivalent to sampling from probs). A seeded request draws its q from its own generator, so its
tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.request import Request


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                  # [B] int64
    logprobs: torch.Tensor | None = None     # [B, 1 + k]: sampled token's logprob, then the top k
    logprob_ids: torch.Tensor | None = None  # [B, 1 + k] the matching token ids
    # Penalties read a request's previous tokens on the host: the next step cannot be launched
    # before these tokens are known there.
    needs_host_tokens: bool = False


def _to_device(values: list, device: torch.device, dtype=None) -> torch.Tensor:
    """A small per-step tensor from host values, copied without synchronising the stream (a copy
    from pageable memory would wait for the device: the engine overlaps steps)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        device = logits.device
        params = [r.sampling_params for r in requests]
        num_top = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        needs_penalties = any(p.needs_penalties for p in params)
        greedy = [p.greedy for p in params]  # decided on the host: no device sync
        if num_top is not None or needs_penalties or not all(greedy):
            # Softmax and penalties in fp32. A plain greedy batch skips the copy (1,000 rows of a
            # 128k vocabulary: 0.5 GB written and read again per step) and takes the argmax of the
            # model-dtype logits, which is the same token.
            logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if num_top is not None else None

        if needs_penalties:
            logits = self._apply_penalties(logits, requests)
        self._mask_min_tokens(logits, requests)

        tokens = logits.argmax(dim=-1)
        if not all(greedy):
            sampled = self._sample(logits, requests)
            tokens = torch.where(_to_device(greedy, device), tokens, sampled)

        out = SamplerOutput(tokens, needs_host_tokens=needs_penalties)
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens[:, None])
            ids = tokens[:, None]
            if num_top > 0:
                top_vals, top_ids = raw_logprobs.topk(num_top, dim=-1)
                chosen, ids = torch.cat([chosen, top_vals], 1), torch.cat([ids, top_ids], 1)
            out.logprobs, out.logprob_ids = chosen, ids
        return out

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        logits = logits.clone()
        B, V = logits.shape
        device = logits.device
        for i, r in enumerate(requests):  # only rows that ask for penalties; rare in serving
            p = r.sampling_params
            if not p.needs_penalties:
                continue
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), device=device, dtype=torch.long)
                seen = seen[seen < V]
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
                counts = torch.bincount(torch.tensor(r.output_token_ids, device=device), minlength=V)[:V].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
        for i, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
                banned = [t for t in banned if t < logits.shape[1]]
                if banned:
                    logits[i, banned] = float("-inf")

    @staticmethod
    def _sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        device = logits.device
        params = [r.sampling_params for r in requests]
        temperature = _to_device([max(p.temperature, 1e-5) for p in params], device)
        logits = logits / temperature[:, None]
        top_k = [p.top_k for p in params]
        if any(top_k):
            V = logits.shape[1]
            k = _to_device([k if k > 0 else V for k in top_k], device).clamp(max=V)
            sorted_logits = logits.sort(dim=-1, descending=True).values
            kth = sorted_logits.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = _to_device([p.top_p for p in params], device)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep a token if the mass before it is below top_p (the first token is always kept).
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if any(p.min_p > 0 for p in params):
            min_p = _to_device([p.min_p for p in params], device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        q = torch.empty_like(probs)
        seeded = []
        for i, r in enumerate(requests):
            if r.sampling_params.seed is not None and not r.sampling_params.greedy:
                if r.generator is None:
                    r.generator = torch.Generator(device=device).manual_seed(r.sampling_params.seed)
                q[i].exponential_(generator=r.generator)
                seeded.append(i)
        if len(seeded) < len(requests):
            unseeded = torch.ones(len(requests), dtype=torch.bool)
            unseeded[seeded] = False
            idx = _to_device(unseeded.nonzero().squeeze(1).tolist(), device, torch.long)
            q[idx] = torch.empty((len(idx), probs.shape[1]), device=device).exponential_()
        return (probs / q).argmax(dim=-1)
