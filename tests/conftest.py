"""Without CUDA the Triton kernels run in the interpreter, which Triton decides when it is imported: set
it here, before any test module (the kernel tests, but also unit tests that import the kernels'
modules) imports triton, so the outcome does not depend on which test runs first."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
