"""Comparing two different computations of the same values, with a bound that holds on every CPU.

Two kernels, layouts or orders of summation round differently, and by how much depends on the
CPU: ATen picks its vectorised kernels (AVX512, AVX2 or none) at run time, and they add in
different orders. An absolute bound tuned on one machine (``atol=1e-6``) is a few ulps there
and fails on another. The bound here is stated in ulps of the values' scale instead, which is
what float rounding actually bounds. The same computation replayed is compared bitwise
(``torch.equal``), never with this.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def assert_close_to_scale(actual: torch.Tensor | float | Sequence[float],
                          expected: torch.Tensor | float | Sequence[float], *, ulps: float,
                          scale: float | None = None, dtype: torch.dtype | None = None,
                          msg: str | None = None) -> None:
    """Assert ``|actual - expected| <= ulps * eps(dtype) * scale`` elementwise.

    The scale is the largest magnitude of the whole ``expected`` tensor, not each element's:
    an element that is a sum of cancelling terms (a gradient, an attention output) may be near
    zero while its rounding error is set by the terms' size, which the tensor's scale
    measures. A zero ``expected`` therefore demands zeros.

    Args:
        actual: the values from the computation under test: a tensor, or Python floats.
        expected: the reference values, of the same shape.
        ulps: how many units in the last place of the scale the two may differ by: a few per
            reduction that is computed differently (the reason belongs in the caller's comment).
        scale: the values' scale where ``expected``'s own is not it: a tensor that cancels as a
            whole (the gradient of a key bias, which softmax ignores, is rounding noise alone)
            is held to the scale of the tensors its terms come from.
        dtype: the precision the values were computed in, whose epsilon is the ulp; defaults to
            ``expected``'s dtype, float64 for Python floats (pass ``torch.float32`` for float32
            losses logged as Python floats).
        msg: a prefix for the failure message (a parameter's name, a layout).

    Raises:
        AssertionError: the dtypes or shapes differ, ``dtype`` is not a floating type, or some
            element is off by more than the bound; the message names the worst element, its
            error in ulps of the scale and the bound.
    """
    # Python floats and lists as float64, so that the conversion rounds nothing away.
    actual, expected = (value if isinstance(value, torch.Tensor)
                        else torch.tensor(value, dtype=torch.float64)
                        for value in (actual, expected))
    prefix = f"{msg}: " if msg else ""
    assert actual.dtype == expected.dtype, (
        f"{prefix}dtypes differ: {actual.dtype} against {expected.dtype}")
    assert actual.shape == expected.shape, (
        f"{prefix}shapes differ: {tuple(actual.shape)} against {tuple(expected.shape)}")
    dtype = dtype or expected.dtype
    assert dtype.is_floating_point, f"{prefix}{dtype} has no ulp: pass dtype=torch.float32"
    eps = torch.finfo(dtype).eps
    # float64 for the check itself, so that it adds no rounding of its own.
    got, want = actual.detach().double().cpu(), expected.detach().double().cpu()
    if scale is None:
        scale = float(want.abs().max()) if want.numel() else 0.0
    bound = ulps * eps * scale
    # A NaN or infinity anywhere is the worst error there is, not one that compares False.
    error = (got - want).abs()
    error = torch.where(error.isnan(), float("inf"), error)
    if error.numel() == 0 or float(error.max()) <= bound:
        return
    worst = int(error.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), want.shape))
    off = float(error.flatten()[worst])
    in_ulps = off / (eps * scale) if scale else float("inf")
    mine, theirs = float(got.flatten()[worst]), float(want.flatten()[worst])
    raise AssertionError(
        f"{prefix}{int((error > bound).sum())} of {want.numel()} elements differ by more than "
        f"{ulps:g} ulps of the scale {scale:.6g} ({bound:.3g} in {dtype}); the worst, at "
        f"{index}: {mine:.9g} against {theirs:.9g}, off by {off:.3g} = {in_ulps:.3g} ulps")


def assert_tensors_close_to_scale(actual: Mapping[str, torch.Tensor],
                                  expected: Mapping[str, torch.Tensor], *, ulps: float,
                                  shared_scale: bool = False, msg: str | None = None) -> None:
    """:func:`assert_close_to_scale` for each tensor of a state dict, each at its own scale.

    Args:
        actual: the computation under test's tensors, under the same keys as ``expected``.
        expected: the reference tensors.
        ulps: as for :func:`assert_close_to_scale`.
        shared_scale: hold every tensor to the largest magnitude of all of them instead, where
            one may cancel as a whole (gradients, momenta: see its ``scale``).
        msg: a prefix for the failure message, before the key.

    Raises:
        AssertionError: the keys differ, or one tensor is off by more than ``ulps`` of its
            scale (the message names the key).
    """
    assert actual.keys() == expected.keys(), (
        f"{msg + ': ' if msg else ''}keys differ: {sorted(actual)} against {sorted(expected)}")
    scale = max((float(t.detach().abs().max()) for t in expected.values() if t.numel()),
                default=0.0) if shared_scale else None
    for name, tensor in expected.items():
        assert_close_to_scale(actual[name], tensor, ulps=ulps, scale=scale,
                              msg=f"{msg}: {name}" if msg else name)
