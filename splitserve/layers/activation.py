import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# On CUDA one Triton kernel, opaque to the compiled layers: Inductor's own kernel for this expression
# moved memory at ~60% of the rate (layers/silu_mul_kernel.py). Triton is imported on first use, so
# that loading a model does not import it.
@torch.library.custom_op("splitserve::silu_and_mul", mutates_args=())
def _silu_and_mul_cuda(x: torch.Tensor) -> torch.Tensor:
    from splitserve.layers.silu_mul_kernel import silu_and_mul_triton
    return silu_and_mul_triton(x)


@_silu_and_mul_cuda.register_fake
def _(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
        return _silu_and_mul_cuda(x)
    return silu_and_mul_torch(x)
