"""Training checkpoints: everything a run needs to continue exactly where it stopped.

DIR/checkpoints/step_00000100/ holds
  model.safetensors   full (unsharded) model state: master weights and buffers (low-rank factors
                      and their refresh counters)
  optimizer.pt        full optimizer state (torch.save): torch's keyed by parameter name,
                      fp4stack's NVFP4-state optimizers' own state_dict
  rng_rank{r}.pt      each rank's torch RNG states (CPU generator: stochastic-rounding seeds)
  state.json          step, token count, NaN-skip counters, config
A checkpoint is written into a hidden temporary directory and renamed into place, so a crash
mid-save leaves the previous checkpoint intact and never a half-written one under a step_ name
(the next save deletes that temporary directory); files get the umask's mode like any other;
only the last `keep` are kept. State dicts go through torch.distributed.checkpoint's full-state
helpers, so the same files serve single-process, DDP and FSDP2 runs (and a change of world size).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..files import new_file_mode
from .distributed import DistEnv, barrier, gather_to_main, unwrap

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dirs(out_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories are not listed)."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / "state.json").exists()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    dirs = checkpoint_dirs(out_dir)
    return dirs[-1] if dirs else None


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _unshared(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors sharing storage (tied embeddings): store such aliases as copies.
    seen: set[tuple[int, int]] = set()
    out = {}
    for k, t in sd.items():
        t = t.detach().contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[k] = t.clone() if key in seen else t
        seen.add(key)
    return out


def _gather_states(state: dict[str, Any], env: DistEnv) -> list[dict[str, Any]] | None:
    """Every rank's state dict on the main rank, each sent as torch.save's bytes (pickled
    tensors would unpickle onto the sending rank's GPU, and some dtypes not at all)."""
    blob = io.BytesIO()
    torch.save(state, blob)
    blobs = gather_to_main(blob.getvalue(), env)
    if blobs is None:
        return None
    return [torch.load(io.BytesIO(b), map_location="cpu", weights_only=True) for b in blobs]


def _fsync_dir_files(path: Path) -> None:
    for f in path.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())


def _by_name(optimizer: torch.optim.Optimizer) -> bool:
    # torch's optimizers go through DCP's helpers (keyed by parameter name, FSDP2-aware);
    # fp4stack's NVFP4-state optimizers hold inner optimizers and packed states that those
    # helpers do not know, so their own state_dict (keyed by position) is saved as is.
    return type(optimizer).__module__.startswith("torch.")


def save_checkpoint(out_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], env: DistEnv, keep: int) -> Path:
    """Write the checkpoint of `step` atomically; every rank calls this (FSDP2 gathers)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = (get_optimizer_state_dict(model, optimizer, options=options)
                if _by_name(optimizer) else optimizer.state_dict())
    if getattr(optimizer, "shard_local", False):  # each rank's own states, gathered on rank 0
        optim_sd = {"shard_local": _gather_states(optim_sd, env), "world_size": env.world_size}
    root = Path(out_dir) / CHECKPOINTS
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a crash mid-save
            shutil.rmtree(stale)
        tmp.mkdir()
    barrier(env)
    torch.save(rng_state(env.device), tmp / f"rng_rank{env.rank}.pt")
    if env.is_main:
        meta = {"step": str(step), "recipe": str(state.get("recipe", ""))}
        save_file(_unshared(model_sd), str(tmp / "model.safetensors"), metadata=meta)
        os.chmod(tmp / "model.safetensors", new_file_mode())  # safetensors writes it 0600
        torch.save(optim_sd, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))
    barrier(env)
    if env.is_main:
        _fsync_dir_files(tmp)
        old = None
        if final.exists():  # re-saving a step: keep the old copy until the new one is in place
            old = root / f".old-step_{step:08d}"
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old)
        for stale in checkpoint_dirs(out_dir)[:-keep]:
            shutil.rmtree(stale)
    barrier(env)
    return final


def _add_legacy_counters(model_sd: dict[str, torch.Tensor], model: nn.Module,
                         counters: dict[str, int]) -> None:
    # Checkpoints written before the low-rank refresh counters were module state hold them in
    # state.json (module name -> training forwards): each goes into the 0-d integer buffer of
    # its module that the weights lack, so that such a run still resumes exactly.
    for key, t in unwrap(model).state_dict().items():
        module = key.rpartition(".")[0]
        if module in counters and key not in model_sd and t.ndim == 0 and not (
                t.is_floating_point() or t.is_complex()):
            model_sd[key] = torch.tensor(counters[module], dtype=t.dtype)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    env: DistEnv) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from `path`; returns its state.json."""
    state = json.loads((path / "state.json").read_text())
    model_sd = load_file(str(path / "model.safetensors"), device="cpu")
    if "lowrank_counters" in state:
        _add_legacy_counters(model_sd, model, state.pop("lowrank_counters"))
    set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True))
    optim_sd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    if _by_name(optimizer):
        set_optimizer_state_dict(model, optimizer, optim_sd,
                                 options=StateDictOptions(full_state_dict=True))
    elif getattr(optimizer, "shard_local", False) or "shard_local" in optim_sd:
        ranks = optim_sd.get("shard_local")
        sharded_here = getattr(optimizer, "shard_local", False)
        if ranks is None or not sharded_here or len(ranks) != env.world_size:
            saved = (f"sharded over {len(ranks)} FSDP2 ranks" if ranks is not None
                     else "unsharded (a single-process or DDP run)")
            here = (f"{env.world_size} FSDP2 ranks" if sharded_here
                    else f"{env.world_size} process(es) without FSDP2")
            raise ValueError(f"{path / 'optimizer.pt'} holds NVFP4 optimizer states {saved}; "
                             f"this run has {here}: resume it as it was saved (the same "
                             "number of processes and --distributed)")
        optimizer.load_state_dict(ranks[env.rank])
    else:
        optimizer.load_state_dict(optim_sd)
    rng = path / f"rng_rank{env.rank}.pt"
    if not rng.exists():  # resumed with more ranks than were saved: rank 0's stream
        rng = path / "rng_rank0.pt"
    set_rng_state(torch.load(rng, weights_only=True), env.device)
    return state
