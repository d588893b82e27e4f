"""RLConfig: every knob of a GRPO run, loaded from YAML and checked strictly (ValueError naming
the field and the fix), like PretrainConfig."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config_fields import check_float, check_int, check_keys, read_yaml, suggest
from ..train.config import check_compile
from .fast_rollout import ENGINES
from .rollout import PRECISIONS
from .schedule import OFF_POLICY

TRAINERS = ("bf16", "qat-w")
SFT_RECIPES = ("bf16", "qat-w", "nvfp4@forward")
# The fields an rl-compare run's name, its seed and its directory set.
RUN_FIELDS = ("rollout", "trainer", "correction", "compensation", "compensation_mode", "seed",
              "out", "device")
_QAT_ROLLOUTS = ("quads", "quads-token", "w4a16")  # weight-quantizing rollouts: qat-w trainer


def default_trainer(rollout: str) -> str:
    """The trainer of an rl-compare run that names none: qat-w for the weight-quantizing
    rollouts, else bf16."""
    return "qat-w" if rollout in _QAT_ROLLOUTS else "bf16"
CORRECTIONS = ("none", "token-tis", "token-mis", "seq-tis", "seq-mis")
ALARM_ACTIONS = ("off", "warn", "stop")
ENGINE_PROCESS = "process"  # engine_device: the engine as rank 1 of a two-process torchrun
# The keys a policy of each kind takes (a gpt policy's are GPTConfig fields and `preset`).
POLICY_KEYS = {"gpt": (), "smollm2": ("kind", "as_gpt"), "hf": ("kind", "path", "as_gpt")}


@dataclass
class RLConfig:
    """One GRPO run: policy, task, rollout precision, trainer recipe and the loop's sizes."""

    # policy: {kind: gpt, <GPTConfig field>: ...} (trained from scratch, SFT warm-up first),
    # {kind: smollm2} or {kind: hf, path: DIR}; as_gpt: true loads a smollm2 / hf policy's
    # weights into fp4stack's GPT (the fast engine's model); upcycle: {n_experts: E, top_k: k}
    # for dense ones (split: true makes each expert a slice of the MLP, not a copy).
    policy: dict[str, Any] = field(default_factory=lambda: {"kind": "gpt", "preset": "tiny-moe"})
    upcycle: dict[str, Any] | None = None
    task: str = "arithmetic:add"  # built-in name or package.module:callable
    task_options: dict[str, Any] = field(default_factory=dict)
    sft_steps: int = 300  # SFT warm-up on the task's reference completions (0: none)
    sft_lr: float = 3e-3
    sft_batch_size: int = 64
    # The warm-up's linear layers: "bf16" (as they are), "qat-w" (weights fake-quantized to
    # NVFP4, straight-through gradients) or "nvfp4@forward" (weights and activations, a W4A4
    # forward; backward in high precision). A quantization-aware start, for a policy small
    # enough that NVFP4 rollouts of its BF16 warm-up would break it (docs/results/rl.md).
    sft_recipe: str = "bf16"
    rollout: str = "quads"  # a rollout.PRECISIONS key: bf16, fp8, nvfp4, quads, w4a16, ...
    # quads: the fraction of input channels compensated, and how they are chosen: "static"
    # fixes them once, before the first rollout, from calibration_size task examples (prompt
    # and reference completion) the run never trains on, as the paper's fixed top-k%;
    # "dynamic" picks each layer's channels per batch by residual energy. Defaults from the
    # upcycled SmolLM2 arms (docs/results/rl.md): at 50%, static ended at 0.445 greedy pass@1
    # against dynamic's 0.405 with half its mean k3, and decodes at NVFP4's speed (0.98x)
    # where dynamic costs its per-batch choice. 50% is the paper's choice and, of the static
    # shares run (12.5 / 25 / 50 / 100%), the smallest that learned as W4A16 rollouts do;
    # 100% is W4A16 in its numbers.
    compensation: float = 0.5
    compensation_mode: str = "static"
    calibration_size: int = 64
    # NVFP4 block scales by Four Over Six (each block's maximum mapped to 4 or to 6, whichever
    # quantizes it with the lower error) in the rollout engine and the qat-w trainer alike: a
    # lower weight error for a policy that plain NVFP4 weights would break (docs/results/rl.md).
    # No effect on bf16 and fp8 rollouts or a bf16 trainer.
    four_over_six: bool = False
    logprobs: str = "score"  # the engine's log-probs: "score" (one forward) or "sample"
    # engine: "fast" (static KV cache, CUDA-graph decoding, device sampling; fp4stack GPT
    # policies only: kind gpt or as_gpt), "reference" (RolloutEngine, eager) or "auto": fast on
    # CUDA for GPT policies
    engine: str = "auto"
    # engine_device: the rollout engine's own device ("same": the trainer's; e.g. cuda:1 on a
    # host of two GPUs: the refit is a device-to-device copy, self-checked as always), or
    # "process": under torchrun --nproc_per_node=2, rank 1 runs the engine on its own device
    # and the refit goes over torch.distributed (NCCL or gloo), self-checked the same way.
    # off_policy: 1 samples step s+1's rollouts while step s trains (one step of policy lag).
    engine_device: str = "same"
    off_policy: int = 0
    trainer: str = "qat-w"  # bf16 or qat-w
    # The trainer's compute: "float32", or "bfloat16" (autocast, as mixed-precision trainers
    # such as Megatron's run; weights and optimizer states stay float32 either way).
    trainer_dtype: str = "float32"
    correction: str = "none"  # rollout correction: none, token-tis, token-mis, seq-tis, seq-mis
    correction_cap: float = 2.0
    routing_replay: bool = False
    steps: int = 50
    max_minutes: float = 0.0  # stop after the step that would overrun this wall time (0: none)
    prompts_per_step: int = 16
    group_size: int = 8
    micro_batch_size: int = 64  # sequences per trainer forward (halved while out of memory)
    # The trainer's forward (and so its backward) through torch.compile: true, or a mode
    # without CUDA graphs; false: eager. Fewer launches; sums may round differently from eager.
    compile: bool | str = False
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0  # k3 KL to the initial policy (kept in BF16); 0: no reference model
    eval_every: int = 10  # steps between pass@1 evaluations on the task's test set
    eval_size: int = 200  # test prompts per evaluation (greedy, in the rollout precision)
    eval_pass_k: int = 0  # also pass@k from 2k samples per test prompt when > 1 (0: off)
    # Every N steps (0: off) the per-layer W4A4 error of the trainer's policy on rows of that
    # step's rollouts (activation-only, weight-only, naive, compensated): activation_error.jsonl.
    activation_error_every: int = 0
    alarm_k3: float = 0.05  # k3 threshold of the mismatch alarm
    alarm: str = "warn"  # off, warn or stop
    seed: int = 0
    device: str = "auto"
    out: str = "runs/rl/{rollout}-{trainer}"

    @property
    def out_dir(self) -> Path:
        return Path(self.out.replace("{rollout}", self.rollout).replace("{trainer}", self.trainer))

    @property
    def run_name(self) -> str:
        extra = f"+{self.correction}" if self.correction != "none" else ""
        return f"{self.rollout}{extra}"

    def __post_init__(self) -> None:
        choices = {"rollout": tuple(PRECISIONS), "trainer": TRAINERS, "sft_recipe": SFT_RECIPES,
                   "correction": CORRECTIONS,
                   "alarm": ALARM_ACTIONS, "logprobs": ("score", "sample"), "engine": ENGINES,
                   "compensation_mode": ("dynamic", "static"),
                   "trainer_dtype": ("float32", "bfloat16")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got "
                                 f"{getattr(self, name)!r}")
        if self.off_policy not in OFF_POLICY:
            raise ValueError(f"off_policy must be 0 (on-policy) or 1 (rollouts sampled one step "
                             f"ahead, while the trainer trains), got {self.off_policy!r}")
        if not isinstance(self.engine_device, str):
            raise ValueError(f"engine_device must be 'same', '{ENGINE_PROCESS}' or a device name "
                             f"(cpu, cuda:1), got {self.engine_device!r}")
        for name, minimum in (("sft_steps", 0), ("sft_batch_size", 1), ("steps", 1),
                              ("prompts_per_step", 1), ("group_size", 2),
                              ("micro_batch_size", 1), ("max_new_tokens", 1),
                              ("eval_every", 0), ("eval_size", 1), ("eval_pass_k", 0),
                              ("activation_error_every", 0), ("calibration_size", 1),
                              ("seed", 0)):
            check_int(name, getattr(self, name), minimum)
        for name in ("sft_lr", "lr", "weight_decay", "grad_clip", "clip_low", "clip_high",
                     "kl_coef", "alarm_k3", "temperature", "correction_cap", "max_minutes"):
            setattr(self, name, check_float(name, getattr(self, name)))
        if not 0 < float(self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 < float(self.compensation) <= 1:
            raise ValueError(f"compensation is a fraction of channels in (0, 1], got "
                             f"{self.compensation!r}")
        if self.correction_cap <= 0:
            raise ValueError("correction_cap must be > 0")
        if not isinstance(self.four_over_six, bool):
            raise ValueError(f"four_over_six must be true or false, got {self.four_over_six!r}")
        check_compile(self.compile)
        check_policy(self.policy)
        if self.engine == "fast" and not is_gpt_policy(self.policy):
            raise ValueError(f"engine 'fast' runs fp4stack GPT policies only, not policy.kind "
                             f"{self.policy['kind']!r}: set policy.as_gpt: true (its weights "
                             "in fp4stack's GPT) or engine: reference (or auto)")
        if self.engine == "fast" and self.routing_replay and self.logprobs == "sample":
            raise ValueError("engine 'fast' records MoE routing from the scoring forward only: "
                             "routing_replay with logprobs: sample needs engine: reference (or "
                             "logprobs: score)")
        if self.upcycle is not None:
            self._check_upcycle()

    def _check_upcycle(self) -> None:
        keys = set(self.upcycle)
        if keys - {"n_experts", "top_k", "split", "expert_noise"} \
                or not {"n_experts", "top_k"} <= keys:
            raise ValueError("upcycle takes n_experts, top_k and optionally split (true: each "
                             "expert a slice of the MLP) and expert_noise (each copy's weights "
                             f"times 1 + noise * N(0, 1)), got {sorted(self.upcycle)}")
        if not isinstance(self.upcycle.get("split", False), bool):
            raise ValueError(f"upcycle.split must be true or false, got "
                             f"{self.upcycle['split']!r}")
        noise = self.upcycle.get("expert_noise", 0.0)
        if isinstance(noise, bool) or not isinstance(noise, int | float) or not 0 <= noise < 1:
            raise ValueError(f"upcycle.expert_noise must be a number in [0, 1), got {noise!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, **overrides: Any) -> RLConfig:
        """A validated copy with the non-None overrides applied (CLI flags)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def check_policy(policy: Any) -> None:
    """ValueError naming the field unless `policy` is a valid `RLConfig.policy` mapping (a gpt
    policy's GPTConfig fields are checked when the model is built)."""
    if not isinstance(policy, dict) or "kind" not in policy:
        raise ValueError("policy must be a mapping with a kind: gpt, smollm2 or hf")
    kind = policy["kind"]
    if kind not in POLICY_KEYS:
        raise ValueError(f"policy.kind must be gpt, smollm2 or hf, got {kind!r}")
    if kind == "gpt":
        if "as_gpt" in policy:
            raise ValueError("policy.as_gpt applies to kinds smollm2 and hf (their weights "
                             "loaded into fp4stack's GPT); a gpt policy is one already")
        return
    known = POLICY_KEYS[kind]
    for key in policy:
        if key not in known:
            raise ValueError(f"policy.{key} is unknown for kind {kind}"
                             f"{suggest(str(key), known)}; it takes {list(known)}")
    if kind == "hf" and not isinstance(policy.get("path"), str | os.PathLike):
        raise ValueError("policy.path: kind hf needs path: a directory saved with "
                         f"save_pretrained, got {policy.get('path')!r}")
    if not isinstance(policy.get("as_gpt", False), bool):
        raise ValueError(f"policy.as_gpt must be true or false, got {policy['as_gpt']!r}")


def is_gpt_policy(policy: dict[str, Any]) -> bool:
    """Whether the policy is built as fp4stack's GPT (kind gpt, or as_gpt: true)."""
    return policy["kind"] == "gpt" or bool(policy.get("as_gpt", False))


def load_rl_config(path: str | os.PathLike | None = None, **overrides: Any) -> RLConfig:
    """Read a YAML config (None: the defaults) and apply overrides (None values ignored)."""
    d: dict[str, Any] = {}
    source = str(path or "config")
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"config {path} not found (presets: configs/rl/*.yaml)")
        d = read_yaml(path) or {}
    check_keys(d, RLConfig, source)
    try:
        return RLConfig(**d).with_overrides(**overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from e
