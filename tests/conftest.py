"""Test set-up shared by every test file.

- Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before
  any @triton.jit function is defined, hence here, before the tests import fp4stack.kernels.
- Hypothesis example counts are sized for CI on 2 CPU cores.
"""

import os

import torch
from hypothesis import settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# HYPOTHESIS_PROFILE=thorough for a longer hunt.
settings.register_profile("fp4stack", max_examples=100, deadline=None, print_blob=True)
settings.register_profile("thorough", max_examples=2000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fp4stack"))
