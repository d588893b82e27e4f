"""Test set-up shared by every test file.

- Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before
  any @triton.jit function is defined, hence here, before the tests import fp4stack.kernels.
- Hypothesis example counts are sized for CI on 2 CPU cores.
- Under pytest-xdist each worker takes its share of the cores for torch's threads.
"""

import os

import pytest
import torch
from hypothesis import settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (make test) the cores are shared out among the worker processes, so that
# two workers' torch thread pools do not fight over the same cores.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

# HYPOTHESIS_PROFILE=thorough for a longer hunt.
settings.register_profile("fp4stack", max_examples=100, deadline=None, print_blob=True)
settings.register_profile("thorough", max_examples=2000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fp4stack"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny tensors: with several threads on a busy machine,
    OpenMP hand-offs cost more than the maths (a 64x64 matmul took milliseconds, not
    microseconds). Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
