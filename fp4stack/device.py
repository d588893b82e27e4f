"""The torch.device a run computes on, from the name a config or a command line gives."""

from __future__ import annotations

import torch

NAMES = "auto, cpu, cuda or cuda:N"


def resolve_device(name: str | torch.device, local_rank: int | None = None) -> torch.device:
    """The device `name` means: "auto" is cuda when CUDA is available, else cpu; cpu, cuda,
    cuda:N and any other torch device name stand for themselves.

    With `local_rank` (a torchrun process's LOCAL_RANK), a bare cuda becomes cuda:local_rank, the
    process's own GPU; without it, cuda stays torch's current device. ValueError when the name
    is no device, or names a GPU that is not here.
    """
    text = str(name)
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cuda" and local_rank is not None:
        text = f"cuda:{local_rank}"
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be {NAMES}, got {text!r}") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {text!r} requested but CUDA is not available; "
                             "use device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {text!r} requested but only {torch.cuda.device_count()} "
                             "CUDA device(s) are visible; use cuda:0 to cuda:"
                             f"{torch.cuda.device_count() - 1}")
    return device


__all__ = ["resolve_device"]
