"""Activations of the decoder MLPs, by the names configs give them (`hidden_act`, `hidden_activation`,
`activation_function`). A gated MLP computes act(gate) * up from [gate | up]; a plain one act(x)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# Config name -> element-wise function. gelu_new is transformers' spelled-out tanh approximation
# (the same formula as gelu_pytorch_tanh).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu_pytorch_tanh": gelu_tanh, "gelu_new": gelu_tanh,
    "gelu": F.gelu, "relu": F.relu, "relu2": relu_squared,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def gated_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """[gate | up] -> act(gate) * up. SiLU keeps silu_and_mul itself (the Llama path's function)."""
    act = activation(name)
    if act is F.silu:
        return silu_and_mul

    def act_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up
    return act_and_mul
