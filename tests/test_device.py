"""fp4stack.device.resolve_device: "auto", names, a torchrun process's GPU, clear errors; and the
trainer, RL and quant-error all going through it."""

from __future__ import annotations

import pytest
import torch

from fp4stack.analysis import quant_error
from fp4stack.device import resolve_device
from fp4stack.rl.config import RLConfig
from fp4stack.rl.trainer import run_rl
from fp4stack.train import distributed


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` GPUs (0: none), so every branch runs on any machine."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


@pytest.mark.parametrize("n, expected", [(0, "cpu"), (2, "cuda")])
def test_auto_is_cuda_when_available(gpus, n, expected):
    gpus(n)
    assert resolve_device("auto") == torch.device(expected)


def test_local_rank_picks_the_process_gpu(gpus):
    gpus(4)
    assert resolve_device("auto", local_rank=2) == torch.device("cuda:2")
    assert resolve_device("cuda", local_rank=3) == torch.device("cuda:3")
    assert resolve_device("cuda") == torch.device("cuda")  # torch's current device
    assert resolve_device("cuda:1", local_rank=3) == torch.device("cuda:1")  # named: kept
    assert resolve_device("cpu", local_rank=3) == torch.device("cpu")


def test_names_and_devices_stand_for_themselves(gpus):
    gpus(0)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "auto-cuda"])
def test_cuda_without_gpus_is_a_clear_error(gpus, name):
    gpus(0)
    if name == "auto-cuda":
        with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
            resolve_device(name)
    else:
        with pytest.raises(ValueError, match=f"device '{name}' requested but CUDA is not "
                           "available; use device cpu"):
            resolve_device(name)


def test_a_gpu_that_is_not_here_is_a_clear_error(gpus):
    gpus(2)
    with pytest.raises(ValueError, match="only 2 CUDA device.*use cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda", local_rank=5)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "", "cpu:-1:2"])
def test_unknown_names_are_a_clear_error(gpus, name):
    gpus(0)
    with pytest.raises(ValueError, match=f"device must be auto, cpu, cuda or cuda:N, got "
                       f"'{name}'"):
        resolve_device(name)


def test_callers_resolve_through_it(gpus, monkeypatch, tmp_path):
    gpus(2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # A single trainer process takes GPU 0 by index, as a torchrun rank takes its LOCAL_RANK's.
    assert distributed.setup("auto").device == torch.device("cuda:0")
    gpus(0)
    assert distributed.setup("auto").device == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        distributed.setup("cuda")
    assert quant_error.metadata(4, 16, 0, "auto")["device"] == "cpu"
    with pytest.raises(ValueError, match="device must be"):
        quant_error.error_table(4, 16, 0, "gpu")
    with pytest.raises(ValueError, match="CUDA is not available"):  # before any output is written
        run_rl(RLConfig(device="cuda", out=str(tmp_path / "rl")))
    assert not (tmp_path / "rl").exists()
