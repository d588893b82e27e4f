"""PretrainConfig: every knob of a pretraining run, loaded from YAML and checked strictly.

A typo in a config silently falling back to a default would waste a GPU run, so unknown keys and
bad values raise ValueError naming the field and how to fix it. The model is a GPTConfig preset
name or a mapping of GPTConfig fields (optionally on top of a `preset`); its vocab_size comes from
the data's manifest and its max_seq_len from seq_len unless given.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..config_fields import check_float, check_int, check_keys, read_yaml, suggest
from ..models.gpt import GPTConfig
from ..nn.recipe import recipe as get_recipe
from ..nn.recipe_files import read_recipe_file
from ..optim.state_transforms import TRANSFORMS

OPTIMIZERS = ("adamw", "muon", "root")
STATE_FORMATS = ("fp32", "nvfp4")
# An optimizer with NVFP4 states, whatever the recipe says.
ALIASES = {"adamw4": ("adamw", "nvfp4"), "muon4": ("muon", "nvfp4"), "root4": ("root", "nvfp4")}


def check_optimizer(value: Any) -> None:
    """ValueError naming the `optimizer` field and its choices unless `value` is one of them
    (fp4stack.train.optimizers builds what they name)."""
    if value not in OPTIMIZERS + tuple(ALIASES):
        raise ValueError(f"optimizer {value!r} is unknown; choose one of {list(OPTIMIZERS)} (the "
                         "recipe's optimizer_states picks fp32 or NVFP4 states; 'adamw4', "
                         "'muon4' and 'root4' also name adamw, muon and root with NVFP4 states)")


def optimizer_states(optimizer: str, recipe_states: str) -> str:
    """The state format a run's optimizer keeps: an alias's (NVFP4), else the recipe's."""
    return ALIASES[optimizer][1] if optimizer in ALIASES else recipe_states


MODEL_PRESETS = {"tiny": GPTConfig.tiny, "tiny-moe": GPTConfig.tiny_moe,
                 "small": GPTConfig.small, "small-moe": GPTConfig.small_moe}
DISTRIBUTED = ("ddp", "fsdp2")
GATHERS = ("fp32", "nvfp4")  # what FSDP2 all-gathers FP4 linear weights as (fsdp_gather)


def check_gather(gather: str, distributed: str) -> None:
    """ValueError naming the field and the fix unless `gather` is a GATHERS entry that the
    wrapping `distributed` can take (an NVFP4 all-gather needs FSDP2)."""
    if gather not in GATHERS:
        raise ValueError(f"fsdp_gather must be one of {GATHERS}, got {gather!r}")
    if gather != "fp32" and distributed != "fsdp2":
        raise ValueError(f"fsdp_gather: {gather} needs distributed: fsdp2 (got {distributed!r});"
                         " DDP keeps whole weights and gathers none")


# How the presets' data directories are built (named in the error when one is missing).
DATA_COMMANDS = {
    "runs/data/tiny": "fp4stack data build --sources wikipedia --vocab-size 4096 "
                      "--max-chars 3000000 --out runs/data/tiny",
    "runs/data/small": "fp4stack data build --sources wikipedia linux-docs python-docs "
                       "--vocab-size 8192 --out runs/data/small",
    "runs/data/docs": "fp4stack data build --sources docs-mix --vocab-size 8192 "
                      "--out runs/data/docs",
}


# torch.compile's modes, as PretrainConfig.compile names them.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# Modes that replay the compiled forward and backward as CUDA graphs: on an H200 (torch 2.11,
# 2026-12-03) the backward then read a forward output that the next replay had overwritten, for
# BF16 as for NVFP4 and with a step mark before every micro-batch, so training refuses them.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile(value: bool | str) -> None:
    """A config's `compile`: true, false or a torch.compile mode without CUDA graphs."""
    if value in CUDA_GRAPH_MODES:
        raise ValueError(f"compile: {value} replays the training step as CUDA graphs, whose "
                         "backward read overwritten forward outputs on the H200 (torch 2.11); "
                         "use compile: true, or max-autotune-no-cudagraphs")
    if value not in (False, True, *COMPILE_MODES):
        raise ValueError(f"compile must be true, false or a torch.compile mode "
                         f"{list(COMPILE_MODES)}, got {value!r}")


@dataclass
class PretrainConfig:
    """One pretraining run. Batch sizes count sequences of seq_len tokens."""

    model: str | dict[str, Any] = "tiny"  # preset name, or {preset: NAME, <GPTConfig field>: ...}
    data: str = "runs/data/tiny"  # train.bin / val.bin / manifest.json (fp4stack data build)
    seq_len: int = 128
    global_batch_size: int = 16  # sequences per optimizer step, all ranks together
    micro_batch_size: int = 16  # sequences per forward on one rank; the rest is accumulation
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    max_steps: int = 200
    lr_decay_steps: int | None = None  # length of the cosine; None: max_steps
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    eval_every: int = 50  # steps between validation losses (and always after the last step)
    eval_batches: int = 8  # validation windows: eval_batches * micro_batch_size sequences
    log_every: int = 10
    ckpt_every: int = 0  # steps between checkpoints; 0: only the final one
    keep_checkpoints: int = 2
    seed: int = 0  # model init, data order and stochastic rounding
    recipe: str | dict[str, Any] = "bf16"  # preset name, or {preset: NAME, <field>: ...}
    # adamw, muon or root (ROOT, arXiv 2511.20626); the recipe's optimizer_states picks fp32 or
    # NVFP4 states (train/optimizers.py: adamw4, muon4 and root4 name them with NVFP4 states
    # whatever the recipe)
    optimizer: str = "adamw"
    muon_lr: float = 0.02  # learning rate of Muon's (and ROOT's) matrices (the rest use lr)
    # How AdamW4 (NVFP4 states) stores v: a transform of fp4stack.optim.state_transforms, e.g.
    # sqrt-center-hadamard (Full-Stack FP4's); None: AdamW4's default (rank1)
    adamw4_transform: str | None = None
    max_nan_skips: int = 5  # consecutive non-finite steps skipped before training stops
    out: str = "runs/pretrain/{recipe}"  # "{recipe}" is replaced by the recipe name
    distributed: str = "ddp"  # under torchrun with several processes: ddp or fsdp2
    # What FSDP2 all-gathers the blocks' FP4 linear weights as: fp32 (the master weights) or
    # nvfp4 (each rank's rows quantized, the same Q(W) bit for bit; train/fsdp_nvfp4.py)
    fsdp_gather: str = "fp32"
    device: str = "auto"  # auto (cuda if available), cpu, cuda, cuda:N
    tensorboard: bool = True  # also write TensorBoard scalars when tensorboard is installed
    deterministic: bool = False  # bitwise-reproducible runs: no cuDNN attention (train/determinism)
    weight_flips: bool = False  # log how often NVFP4 forward weights flip (analysis/weight_flips)
    # Fraction of the learning-rate schedule (decay_steps), at its end, whose GEMMs and attention
    # run in BF16 (a precision switch, fp4stack.convert.to_high_precision); 0: none.
    high_precision_tail: float = 0.0
    # The model's training forward (and so its backward) through torch.compile: true, or a
    # torch.compile mode without CUDA graphs (COMPILE_MODES); false: eager.
    compile: bool | str = False

    def __post_init__(self) -> None:
        self.betas = _betas(self.betas)
        for name in ("seq_len", "global_batch_size", "micro_batch_size", "max_steps",
                     "eval_every", "eval_batches", "log_every", "keep_checkpoints"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("warmup_steps", "ckpt_every", "max_nan_skips", "seed"):
            check_int(name, getattr(self, name), minimum=0)
        if self.lr_decay_steps is not None:
            check_int("lr_decay_steps", self.lr_decay_steps, minimum=1)
        for name in ("lr", "min_lr", "weight_decay", "eps", "grad_clip", "muon_lr"):
            setattr(self, name, check_float(name, getattr(self, name)))
        self.high_precision_tail = check_float("high_precision_tail", self.high_precision_tail)
        if self.high_precision_tail >= 1:
            raise ValueError(f"high_precision_tail is the fraction of the schedule run in BF16 "
                             f"at its end, in [0, 1), got {self.high_precision_tail}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size {self.global_batch_size} must be a multiple of "
                             f"micro_batch_size {self.micro_batch_size}")
        try:
            recipe = get_recipe(self.recipe)
        except ValueError as e:  # a mapping's errors already name their field
            raise ValueError(str(e) if isinstance(self.recipe, dict) else f"recipe: {e}") from e
        quantized_w = recipe.w.format == "nvfp4"
        if self.high_precision_tail and recipe.weight_storage == "packed":
            raise ValueError(f"high_precision_tail: recipe {self.recipe_name!r} packs its weights "
                             "and keeps no master weight to compute in BF16 with; use a recipe "
                             "with weight_storage 'master' or set high_precision_tail: 0")
        if self.weight_flips and not quantized_w:
            raise ValueError(f"weight_flips: recipe {self.recipe_name!r} does not quantize its "
                             "weights to NVFP4, so no weight can flip; use an NVFP4 recipe or "
                             "set weight_flips: false")
        check_optimizer(self.optimizer)
        if recipe.adamw4_transform is not None and recipe.adamw4_transform not in TRANSFORMS:
            raise ValueError(f"recipe {self.recipe_name!r}: adamw4_transform "
                             f"{recipe.adamw4_transform!r} is unknown; choose one of "
                             f"{list(TRANSFORMS)}")
        if self.adamw4_transform is not None:
            if self.adamw4_transform not in TRANSFORMS:
                raise ValueError(f"adamw4_transform {self.adamw4_transform!r} is unknown; choose "
                                 f"one of {list(TRANSFORMS)}, or remove it for AdamW4's default")
            if optimizer_states(self.optimizer, recipe.optimizer_states) != "nvfp4":
                raise ValueError(f"adamw4_transform: optimizer {self.optimizer!r} with recipe "
                                 f"{self.recipe_name!r} keeps fp32 states, so no AdamW4 runs; "
                                 "use adamw4, muon4 or root4 (or a recipe whose "
                                 "optimizer_states is nvfp4), or remove adamw4_transform")
        if self.distributed not in DISTRIBUTED:
            raise ValueError(f"distributed must be one of {DISTRIBUTED}, got {self.distributed!r}")
        check_gather(self.fsdp_gather, self.distributed)
        if self.fsdp_gather == "nvfp4" and self.high_precision_tail:
            raise ValueError("fsdp_gather: nvfp4 gathers Q(W), and high_precision_tail trains "
                             "with W itself: use fsdp_gather: fp32 with a high-precision tail")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("data", "out"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty path, got {getattr(self, name)!r}")
        check_compile(self.compile)
        for name in ("tensorboard", "deterministic", "weight_flips"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self.model_config(vocab_size=None)  # fail now, not after the data is loaded

    @property
    def decay_steps(self) -> int:
        return self.lr_decay_steps if self.lr_decay_steps is not None else self.max_steps

    @property
    def switch_step(self) -> int | None:
        """The first step run in high precision (high_precision_tail), or None. Counted on the
        schedule's length, so a run split by lr_decay_steps switches where the whole run does."""
        if not self.high_precision_tail:
            return None
        return self.decay_steps - round(self.high_precision_tail * self.decay_steps)

    @property
    def recipe_name(self) -> str:
        """The recipe's name: the preset's, or a mapping's `name` (fp4stack.nn.recipe_mapping)."""
        return get_recipe(self.recipe).name

    @property
    def out_dir(self) -> Path:
        return Path(self.out.replace("{recipe}", self.recipe_name))

    def model_config(self, vocab_size: int | None) -> GPTConfig:
        """The GPTConfig of this run for data with `vocab_size` tokens (None: the preset's)."""
        spec = {"preset": self.model} if isinstance(self.model, str) else dict(self.model)
        preset = spec.pop("preset", None)
        if preset is not None and preset not in MODEL_PRESETS:
            raise ValueError(f"model preset {preset!r} is unknown; choose one of "
                             f"{sorted(MODEL_PRESETS)} or give GPTConfig fields")
        known = {f.name for f in fields(GPTConfig)}
        for key in spec:
            if key not in known:
                raise ValueError(f"model.{key}: unknown GPTConfig field{suggest(key, known)}; "
                                 f"known fields: {sorted(known)}")
        given_vocab = spec.get("vocab_size")
        if vocab_size is not None:
            if given_vocab is not None and given_vocab < vocab_size:
                raise ValueError(f"model.vocab_size {given_vocab} is smaller than the data's "
                                 f"vocabulary ({vocab_size}); remove it to use the data's")
            spec.setdefault("vocab_size", vocab_size)
        if spec.get("max_seq_len", self.seq_len) < self.seq_len:
            raise ValueError(f"model.max_seq_len {spec['max_seq_len']} is smaller than seq_len "
                             f"{self.seq_len}; remove it or raise it")
        spec.setdefault("max_seq_len", self.seq_len)
        try:
            return MODEL_PRESETS[preset](**spec) if preset else GPTConfig(**spec)
        except (TypeError, ValueError) as e:
            raise ValueError(f"model: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    def with_overrides(self, **overrides: Any) -> PretrainConfig:
        """A validated copy with the non-None overrides applied (CLI flags)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def _betas(value: Any) -> tuple[float, float]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                       for b in value)):
        raise ValueError(f"betas must be two numbers in [0, 1), e.g. [0.9, 0.95], got {value!r}")
    return float(value[0]), float(value[1])


def from_dict(d: dict[str, Any], source: str = "config") -> PretrainConfig:
    """A PretrainConfig from a mapping; unknown keys raise ValueError."""
    check_keys(d, PretrainConfig, source)
    try:
        return PretrainConfig(**d)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def recipe_arg(value: str) -> str | dict[str, Any]:
    """A --recipe(s) value: a preset name as it is, or the recipe mapping that a YAML file (.yaml,
    .yml) holds, top-level or under a `recipe` key (fp4stack.nn.recipe_mapping), checked."""
    if not value.endswith((".yaml", ".yml")):
        return value
    path = Path(value)
    if not path.is_file():
        raise FileNotFoundError(f"recipe file {value} not found")
    mapping = read_recipe_file(path)
    try:
        get_recipe(mapping)
    except ValueError as e:
        raise ValueError(f"{value}: {e}") from e
    return mapping


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> PretrainConfig:
    """Read a YAML config (None: the defaults) and apply CLI overrides (None values ignored)."""
    d: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"config {path} not found (presets: configs/pretrain/*.yaml)")
        d = read_yaml(path) or {}
    cfg = from_dict(d, source=str(path or "config"))
    try:
        return cfg.with_overrides(**overrides)
    except ValueError as e:
        raise ValueError(f"{path or 'config'} with overrides {overrides}: {e}") from e


__all__ = ["DATA_COMMANDS", "MODEL_PRESETS", "PretrainConfig", "from_dict", "load_config",
           "recipe_arg"]
