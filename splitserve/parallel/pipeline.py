"""The pipeline-parallel side of a step: how a stage runs its part of the model and hands the
intermediate state (hidden, residual) to the next stage. The only place that knows the model's stage
API, so adapting to it is one edit.

Model API assumed (the tensor-parallel model side): `model(input_ids, positions, inputs_embeds,
intermediate=(hidden, residual) or None)` runs this rank's layers; it returns the final hidden states
[T, hidden] on the last stage and the pair (hidden, residual) on the others. A model without an
`intermediate` parameter holds every layer (replicated on every stage): then every stage but the last
runs it whole and sends its final hidden states, and the last stage takes what it receives as its
output, so the transfer itself is what decides the tokens (the plumbing's test until the model side
splits the layers).

Transfers are synchronous point-to-point sends over torch.distributed (gloo on CPU, NCCL on CUDA)
between the same tensor-parallel rank of consecutive stages, one stacked [2, T, hidden] tensor a step.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist


def has_stage_api(model: torch.nn.Module) -> bool:
    return "intermediate" in inspect.signature(model.forward).parameters


def stage_forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                  inputs_embeds: torch.Tensor | None, intermediate: tuple[torch.Tensor, torch.Tensor] | None,
                  is_last: bool):
    """This stage's output: the final hidden states on the last stage, else (hidden, residual)."""
    if has_stage_api(model):
        return model(input_ids, positions, inputs_embeds, intermediate=intermediate)
    # Replicated model: see the module docstring.
    if is_last and intermediate is not None:
        return intermediate[0]
    hidden = model(input_ids, positions) if inputs_embeds is None else model(input_ids, positions, inputs_embeds)
    return hidden if is_last else (hidden, torch.zeros_like(hidden))


def send_intermediate(pair: tuple[torch.Tensor, torch.Tensor], dst: int) -> None:
    dist.send(torch.stack(pair).contiguous(), dst)


def recv_intermediate(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                      src: int) -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
    dist.recv(buf, src)
    return buf[0], buf[1]
