"""Triton 3.6 interpreter fixes for the kernel tests (CPU only; compiled kernels on a GPU are
unaffected). Installed by the Triton test modules; a no-op unless TRITON_INTERPRET=1.

1. A 1-element tensor becomes a Python int through int(ndarray), which NumPy >= 2.4 rejects, so
   `for k in range(runtime_start, runtime_end, STEP)` fails (triton-lang/triton#9171).
2. tl.dot on bf16 operands multiplies their raw uint16 bit patterns: widen them to fp32 first.
3. fp32 -> fp8 e4m3 conversion mis-rounds (a mantissa carry is dropped: 1.9375 * 2^e can become
   1.0 * 2^e) and fp32 -> bf16 truncates; the GPU rounds both to nearest even, as torch does, so
   these conversions go through torch.
"""
import os

import numpy as np
import torch


def install() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter
    if getattr(interpreter, "_quant_kernel_shims", False):
        return
    orig_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    builder = interpreter.InterpreterBuilder

    orig_dot = builder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot

    # destination triton dtype -> (torch dtype to round to, torch dtype whose bits numpy holds)
    torch_round = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.bfloat16: (torch.bfloat16, torch.int16)}
    orig_fp_to_fp = builder.create_fp_to_fp
    orig_cast = builder.cast_impl

    def through_torch(src, dst_scalar):
        dt, bits = torch_round[dst_scalar]
        data = torch.from_numpy(np.ascontiguousarray(src.data)).to(dt).view(bits).numpy()
        return interpreter.TensorHandle(data.view(interpreter._get_np_dtype(dst_scalar)), dst_scalar)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar in torch_round:
            return through_torch(src, dst_type.scalar)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return through_torch(src, tl.bfloat16)
        return orig_cast(self, src, dst_type)

    builder.create_fp_to_fp = create_fp_to_fp
    builder.cast_impl = cast_impl
    builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    interpreter._quant_kernel_shims = True
