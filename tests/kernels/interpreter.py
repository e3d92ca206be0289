"""Triton interpreter fixes shared by the kernel tests (CPU only: a no-op when kernels are compiled).
Import and call before the kernels run; TRITON_INTERPRET must be set before triton is imported."""
import os


def interpreter_shims():
    """Two Triton 3.6 interpreter bugs (CPU only; compiled kernels are unaffected):
    1. A tensor becomes a Python int via int(ndarray), which NumPy >= 2.4 rejects for the
       interpreter's 1-element (non 0-d) scalars, so `for i in range(0, runtime_value, STEP)` fails
       (triton-lang/triton#9171, fixed upstream after 3.6). Re-register __index__ with an explicit item.
    2. tl.dot on bf16 operands multiplies their raw uint16 bit patterns. Widen them to fp32 first."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    if getattr(interpreter, "_splitserve_shims", False):
        return
    orig_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor

    builder_cls = interpreter.InterpreterBuilder
    orig_dot = builder_cls.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot
    interpreter._splitserve_shims = True

