"""Quantized GEMM/GEMV kernels (Triton, and Gluon on Hopper) for the linear layers' quantization methods.

- fp8/fp8_gemm.py: W8A8 FP8 (e4m3) for few-token shapes, activation quantization, fp8_linear (dispatcher).
- int8/int8_gemm.py: W8A8 INT8 (int32 accumulation, scales and bias in the epilogue), per-token int8
  quantization, int8_linear (the INT8 layers' GPU path, every token count).
- act_quant.py: silu(gate) * up fused with the per-token fp8 / int8 quantization (the down projection's
  input), and the FP8 / INT8 dispatchers that take gate_up instead of the activations.
- wna16/wna16_gemm.py: weight-only int4 / int8 with group scales and zero points, wna16_linear (dispatcher).
- wna16/wna16_layout.py: the canonical packed int layout and conversions from GPTQ / AWQ / compressed-tensors.
- reference.py: plain torch definitions (the tests' references and the CPU path).

Triton is imported lazily by the kernel modules; importing this package imports nothing heavy.
"""
