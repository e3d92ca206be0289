"""Start-up machinery that runs beside the engine's own start-up: forked children that byte-compile the
compiler stack (bytecode.py) and precompile the attention backend's kernels (kernel_precompile.py)."""
