"""Masked reductions over ``[B, T]`` token tensors (verl ``verl.utils.torch_functional`` semantics).

All functions are pure: tensors in, tensors out, no process groups. ``mask`` is a bool/int/float tensor of the
same shape as ``values``; non-zero entries are selected. Values outside the mask never contaminate a result, even
when they are NaN or inf.
"""

from __future__ import annotations

import torch

Axis = int | tuple[int, ...] | None

MEAN_EPS = 1e-8  # verl adds 1e-8 to the denominator of every masked mean
WHITEN_EPS = 1e-8  # verl: (x - mean) * rsqrt(var + 1e-8)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Axis = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero, reduced over ``axis`` (all elements when None).

    Entries outside the mask are replaced by 0 before multiplying, so NaN/inf padding is harmless. A float mask
    weights the entries (as in verl).
    """
    valid = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    if axis is None:
        return (valid * mask).sum()
    return (valid * mask).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Axis = None) -> torch.Tensor:
    """``masked_sum / (mask.sum() + 1e-8)``; a fully masked input gives 0 (verl semantics)."""
    denom = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / (denom + MEAN_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased (Bessel-corrected) variance over all masked elements (scalar), as verl.

    Raises ``ValueError`` when fewer than two elements are selected (verl does the same: the correction would
    divide by zero).
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    count = mask.sum()
    if count == 0:
        raise ValueError("masked_var: the mask selects no element; at least two are needed")
    if count == 1:
        raise ValueError("masked_var: the mask selects one element; the unbiased variance needs at least two")
    return var * (count / (count - 1))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(values - mean) * rsqrt(var + 1e-8)`` with mean/unbiased var over the masked elements of the whole tensor.

    Output has the shape of ``values``; masked-out positions are transformed too (multiply by the mask if zeros
    are wanted).
    """
    mean = masked_mean(values, mask)
    return (values - mean) * torch.rsqrt(masked_var(values, mask) + WHITEN_EPS)
