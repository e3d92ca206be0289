"""The one packed layout the WNA16 kernels read, and conversions into it from GPTQ, AWQ and
compressed-tensors checkpoints (done once, at load time).

Canonical layout for a linear layer with weight W [N, K] (N outputs, K inputs), `bits` in {4, 8},
P = 32 // bits values per word, group size G (G divides K; G = K means one group per channel):

    qweight  int32 [K // P, N]   word qweight[i, n] holds q[n, P*i + ORDER[j]] in bits [bits*j, bits*j + bits),
                                 j = 0..P-1 (lowest bits first); q is unsigned, 0 .. 2**bits - 1.
                                 ORDER is (0, 2, 4, 6, 1, 3, 5, 7) for 4 bits and (0, 1, 2, 3) for 8.
                                 Shaped as GPTQ's qweight (P consecutive K in one word, N contiguous, so
                                 a tile of N columns is one coalesced read per row of words), but with
                                 the 4-bit values interleaved: (w >> 4s) & 0x000F000F then holds K = 2s
                                 and 2s + 1 in its two halves, which the kernel turns into a pair of
                                 16-bit floats with one AND-OR (see wna16_gemm.py).
    scales   [K // G, N]         fp16 / bf16 / fp32 (the kernels compute in fp32).
    zeros    None, or uint8 [K // G, N]: unsigned zero points. None means symmetric: zero = 2**(bits-1).
    perm     None, or int32 [K]: act-order (GPTQ desc_act). Packed input position i holds original
                                 input channel perm[i]; the kernels read x[:, perm[i]] for it.

    W[n, perm[k]] = (q[n, k] - zero[k // G, n]) * scale[k // G, n]     (perm = identity when None)

Source formats, as their packers write them:
- GPTQ (AutoGPTQ / GPTQModel, "gptq"): qweight as above; qzeros int32 [K // G, N // P] packed the
  same way but along N; checkpoint_format "gptq" (v1) stores zero - 1, "gptq_v2" stores zero;
  scales [K // G, N]; g_idx [K] (group of each input channel; unsorted with desc_act).
- AWQ (AutoAWQ GEMM): qweight int32 [K, N // 8] packed along N with nibble j holding column
  8*w + AWQ_ORDER[j]; qzeros [K // G, N // 8] packed the same way; scales [K // G, N]; zeros as is.
- compressed-tensors pack-quantized: weight_packed int32 [N, K // P] packed along K (lowest bits
  first) with q_signed + 2**(bits-1) stored; weight_scale [N, K // G]; weight_zero_point (asymmetric)
  signed [N, K // G], or packed int32 [ceil(N / P), K // G] along N, offset the same way;
  weight_g_idx [K] with actorder.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column 8*w + AWQ_ORDER[j]
NATURAL = {4: tuple(range(8)), 8: tuple(range(4))}
CANONICAL_ORDER = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 1, 2, 3)}  # value j of a word holds K offset ORDER[j]


@dataclass
class WNA16Weight:
    """A linear layer's weight in the canonical layout (see the module docstring)."""
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_canonical(self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.perm)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * (32 // self.bits)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]


def check_canonical(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                    group_size: int, perm: torch.Tensor | None = None) -> None:
    """ValueError with the reason when the tensors are not a valid canonical weight."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be int32 [K // {32 // bits}, N], got {qweight.dtype} {tuple(qweight.shape)}")
    K, N = qweight.shape[0] * (32 // bits), qweight.shape[1]
    if group_size <= 0 or K % group_size:
        raise ValueError(f"group_size {group_size} must divide K={K}")
    if tuple(scales.shape) != (K // group_size, N) or not scales.is_floating_point():
        raise ValueError(f"scales must be float [{K // group_size}, {N}], got {scales.dtype} {tuple(scales.shape)}")
    if zeros is not None and (zeros.dtype != torch.uint8 or tuple(zeros.shape) != (K // group_size, N)):
        raise ValueError(f"zeros must be uint8 [{K // group_size}, {N}], got {zeros.dtype} {tuple(zeros.shape)}")
    if perm is not None and (perm.dtype != torch.int32 or tuple(perm.shape) != (K,)):
        raise ValueError(f"perm must be int32 [{K}], got {perm.dtype} {tuple(perm.shape)}")



def largest_pow2_divisor(g: int, cap: int, floor: int = 16) -> int:
    """The largest power of two <= cap dividing g, at least `floor` (ValueError if none does)."""
    b = cap
    while b > floor and g % b:
        b //= 2
    if g % b:
        raise ValueError(f"group size {g} is not a multiple of {floor}")
    return b


def check_wna16_call(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     bits: int, group_size: int, perm: torch.Tensor | None, bias: torch.Tensor | None
                     ) -> tuple[int, int, int]:
    """The checks both W4A16 / W8A16 kernels make of their call (x bf16/fp16 [M, K], a canonical
    weight of the same K, bias [N]); returns (M, K, N)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"activations must be bfloat16 or float16, got {x.dtype}")
    check_canonical(qweight, scales, zeros, bits, group_size, perm)
    (M, K), N = x.shape, qweight.shape[1]
    if qweight.shape[0] * (32 // bits) != K:
        raise ValueError(f"x has K={K} but qweight {tuple(qweight.shape)} packs K={qweight.shape[0] * (32 // bits)}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must have shape [{N}], got {tuple(bias.shape)}")
    return M, K, N

# ---------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------

def pack_along_dim0(q: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """q [R, C] unsigned ints -> int32 [R // P, C], word i holding row P*i + order[j] at bits*j
    (order defaults to natural: row P*i + j)."""
    P = 32 // bits
    if q.shape[0] % P:
        raise ValueError(f"cannot pack {q.shape[0]} rows into words of {P}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) >= 1 << bits):
        raise ValueError(f"values to pack must lie in [0, {(1 << bits) - 1}]")
    if order is not None:
        q = q.reshape(q.shape[0] // P, P, q.shape[1])[:, list(order)].reshape(q.shape)
    shifts = (torch.arange(P, device=q.device, dtype=torch.int64) * bits).view(1, P, 1)
    words = (q.to(torch.int64).view(q.shape[0] // P, P, q.shape[1]) << shifts).sum(1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_along_dim0(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> int32 [R * P, C]: the inverse of pack_along_dim0."""
    P = 32 // bits
    shifts = (torch.arange(P, device=words.device, dtype=torch.int32) * bits).view(1, P, 1)
    vals = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # [R, P, C]: vals[:, j] is row P*i + order[j]
    if order is not None:
        vals = vals[:, [order.index(r) for r in range(P)]]
    return vals.reshape(words.shape[0] * P, words.shape[1])


def pack_qweight(q_nk: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned q [N, K] -> canonical qweight int32 [K // P, N]."""
    return pack_along_dim0(q_nk.t().contiguous(), bits, CANONICAL_ORDER[bits]).contiguous()


def unpack_qweight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Canonical qweight [K // P, N] -> unsigned q int32 [N, K]."""
    return unpack_along_dim0(qweight, bits, CANONICAL_ORDER[bits]).t()


def dequantize(w: WNA16Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The canonical weight as a dense [N, K] matrix in packed K order (torch ops; reference only)."""
    q = unpack_qweight(w.qweight, w.bits).to(torch.float32)
    g = torch.arange(q.shape[1], device=q.device) // w.group_size
    zero = w.zeros.to(torch.float32) if w.zeros is not None else torch.full_like(
        w.scales, float(1 << (w.bits - 1)), dtype=torch.float32)
    return ((q - zero.t()[:, g]) * w.scales.to(torch.float32).t()[:, g]).to(dtype)


def dense_in_original_order(w: WNA16Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight with input channels in the checkpoint's order (perm undone)."""
    dense = dequantize(w, dtype)
    if w.perm is None:
        return dense
    out = torch.empty_like(dense)
    out[:, w.perm.long()] = dense
    return out


def quantize_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128,
                 symmetric: bool = True) -> WNA16Weight:
    """Round-to-nearest group quantization of a dense [N, K] weight into the canonical layout (online
    quantization and test data). group_size -1 means one group per output channel."""
    N, K = weight.shape
    G = K if group_size == -1 else group_size
    if K % G:
        raise ValueError(f"group_size {group_size} must divide K={K}")
    w = weight.to(torch.float32).reshape(N, K // G, G)
    qmax = (1 << bits) - 1
    if symmetric:
        half = 1 << (bits - 1)
        scale = w.abs().amax(-1).clamp(min=1e-10) / (qmax / 2)  # GPTQ's symmetric grid
        zero = torch.full_like(scale, float(half))
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((hi - lo) / qmax).clamp(min=1e-10)
        zero = torch.round(-lo / scale).clamp(0, qmax)
    q = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, qmax).to(torch.int32).reshape(N, K)
    scales = scale.t().contiguous().to(weight.dtype if weight.is_floating_point() else torch.float32)
    zeros = None if symmetric else zero.t().contiguous().to(torch.uint8)
    return WNA16Weight(pack_qweight(q, bits), scales, zeros, bits, G)


# ---------------------------------------------------------------------------------------------
# conversions from checkpoint formats
# ---------------------------------------------------------------------------------------------

def _perm_from_g_idx(g_idx: torch.Tensor | None, K: int, G: int) -> torch.Tensor | None:
    """The packed order for act-order checkpoints; None when g_idx is the plain k // G."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64).reshape(-1)
    if g_idx.numel() != K:
        raise ValueError(f"g_idx has {g_idx.numel()} entries, expected K={K}")
    plain = torch.arange(K, device=g_idx.device) // G
    if torch.equal(g_idx, plain):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], plain):
        raise ValueError(f"g_idx does not put exactly {G} input channels in each group")
    return perm.to(torch.int32)


def _canonical_from_natural(q_words: torch.Tensor, perm: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Words packed along K in natural order [K // P, N] -> canonical qweight, input channels in
    packed order (q[:, perm])."""
    q_kn = unpack_along_dim0(q_words, bits)
    if perm is not None:
        q_kn = q_kn[perm.long()]
    return pack_along_dim0(q_kn, bits, CANONICAL_ORDER[bits]).contiguous()


def _symmetric_or_zeros(zeros: torch.Tensor, bits: int) -> torch.Tensor | None:
    zeros = zeros.to(torch.int32)
    if int(zeros.min()) < 0 or int(zeros.max()) >= 1 << bits:
        raise ValueError(f"zero points must lie in [0, {(1 << bits) - 1}]")
    return None if bool((zeros == 1 << (bits - 1)).all()) else zeros.to(torch.uint8).contiguous()


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, bits: int,
              group_size: int, g_idx: torch.Tensor | None = None, checkpoint_format: str = "gptq") -> WNA16Weight:
    """GPTQ tensors (module docstring) -> canonical. checkpoint_format "gptq" (v1, zero stored minus
    one, what AutoGPTQ writes) or "gptq_v2"."""
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}")
    P = 32 // bits
    K, N = qweight.shape[0] * P, qweight.shape[1]
    G = K if group_size == -1 else group_size
    zeros = unpack_along_dim0(qzeros.t().contiguous(), bits).t()[:, :N]  # [K // G, N]
    if checkpoint_format == "gptq":
        zeros = (zeros + 1) & ((1 << bits) - 1)
    perm = _perm_from_g_idx(g_idx, K, G)
    return WNA16Weight(_canonical_from_natural(qweight.to(torch.int32), perm, bits), scales.contiguous(),
                       _symmetric_or_zeros(zeros, bits), bits, G, perm)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, C // 8] (packed along columns, AWQ_ORDER) -> int32 [R, C]."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * 4
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF        # [R, C // 8, 8]: nib[..., j] is column AWQ_ORDER[j]
    inverse = [AWQ_ORDER.index(c) for c in range(8)]
    return nib[..., inverse].reshape(packed.shape[0], packed.shape[1] * 8)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
             group_size: int, bits: int = 4) -> WNA16Weight:
    """AWQ GEMM tensors (module docstring; 4-bit only) -> canonical."""
    if bits != 4:
        raise ValueError(f"AWQ checkpoints are 4-bit, got bits={bits}")
    q_kn = _unpack_awq(qweight)                      # [K, N]
    K = q_kn.shape[0]
    G = K if group_size == -1 else group_size
    zeros = _unpack_awq(qzeros)[:, :q_kn.shape[1]]   # [K // G, N]
    return WNA16Weight(pack_along_dim0(q_kn, 4, CANONICAL_ORDER[4]).contiguous(), scales.contiguous(),
                       _symmetric_or_zeros(zeros, 4), 4, G)


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor, *, bits: int,
                            group_size: int, weight_zero_point: torch.Tensor | None = None,
                            weight_g_idx: torch.Tensor | None = None,
                            weight_shape: tuple[int, int] | None = None) -> WNA16Weight:
    """compressed-tensors pack-quantized tensors (module docstring) -> canonical. group_size -1 (or
    a [N, 1] scale) is the channel strategy."""
    P = 32 // bits
    N = weight_packed.shape[0] if weight_shape is None else int(weight_shape[0])
    K = weight_packed.shape[1] * P if weight_shape is None else int(weight_shape[1])
    if K % P or weight_packed.shape[1] * P != K:
        raise ValueError(f"K={K} must be a multiple of {P} (padded packing is not supported)")
    G = K if group_size == -1 else group_size
    offset = 1 << (bits - 1)
    zeros = None
    if weight_zero_point is not None and weight_zero_point.numel():
        zp = weight_zero_point
        if zp.dtype == torch.int32 and zp.shape[0] != N:  # packed along N
            zp = unpack_along_dim0(zp, bits)[:N].to(torch.int32)  # stored offset: unsigned already
        else:
            zp = zp.to(torch.int32) + offset
        zeros = _symmetric_or_zeros(zp.t().reshape(K // G, N), bits)
    perm = _perm_from_g_idx(weight_g_idx, K, G)
    qweight = _canonical_from_natural(weight_packed[:N].to(torch.int32).t().contiguous(), perm, bits)
    return WNA16Weight(qweight, weight_scale[:N].reshape(N, K // G).t().contiguous(),
                       zeros, bits, G, perm)
