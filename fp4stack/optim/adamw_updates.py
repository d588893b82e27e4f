"""The AdamW arithmetic of AdamW4, as pure functions on fp32 tensors (in place).

`adamw_update` and `adamw_update_foreach` are torch.optim.AdamW's single-tensor and multi-tensor
paths, op for op, so the fp32 states AdamW4 keeps for small tensors give torch's results bit for
bit; `quantized_update` is the same maths spelled as single-rounding float32 operations, so the
NVFP4-state path gives the same bits on every device and the fused kernel repeats it exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .state_transforms import sqrt_rn


def adamw_update(
    param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: float,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
) -> None:
    """One AdamW step in place on fp32 tensors, the same operations in the same order as
    torch.optim.AdamW's single-tensor path (so fp32 states give its results bit for bit)."""
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


def adamw_update_foreach(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    steps: list[float], lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
) -> None:
    """`adamw_update` of many fp32 tensors at once, with torch's multi-tensor (foreach) ops in
    the order of torch.optim.AdamW(foreach=True); `steps`: each tensor's step count, this step
    included. Off CUDA the foreach ops loop over the tensors with the single-tensor kernels, so
    the results equal adamw_update's there bit for bit."""
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    step_sizes = [-(lr / (1 - beta1**step)) for step in steps]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [(1 - beta2**step) ** 0.5 for step in steps])
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)


def quantized_update(
    param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: float,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
) -> None:
    """The AdamW step of the NVFP4-state path, in place on fp32 tensors.

    The same maths as `adamw_update`, spelled out as single float32 operations (each tensor op
    one rounding; scalars are Python floats rounded to float32), so that it gives the same bits
    on every device and the fused kernel (fp4stack/kernels/adamw4.py) repeats it exactly:
    torch's lerp_, addcmul_ and addcdiv_ may contract to FMAs depending on the device and the
    build. The order follows torch's CPU kernels, except that sqrt(v) is multiplied by the
    reciprocal of the bias correction (one division per element fewer in the kernel).
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.add_((grad - exp_avg) * (1 - beta1))
    exp_avg_sq.mul_(beta2).add_((grad * (1 - beta2)) * grad)
    bias_correction1 = 1 - beta1**step
    inv_bias_correction2_sqrt = 1.0 / (1 - beta2**step) ** 0.5
    denom = (sqrt_rn(exp_avg_sq) * inv_bias_correction2_sqrt).add_(eps)
    param.add_((exp_avg * -(lr / bias_correction1)) / denom)
