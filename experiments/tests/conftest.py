"""Set-up for the studies' tests: the study scripts import as modules, the interpreter runs
Triton kernels without a GPU, and the pretraining tests' tiny fixtures are shared."""

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT / "tests"))  # test_train's tiny config and data
