"""tests/helpers/tolerance.py: bounds in ulps of the values' scale pass and fail where they
should, and a failure names the worst element."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tolerance import assert_close_to_scale, assert_tensors_close_to_scale

EPS = torch.finfo(torch.float32).eps  # 2**-23


def test_a_bound_in_ulps_of_the_whole_tensors_scale() -> None:
    expected = torch.tensor([4.0, -2.0, 0.0])
    # 2 ulps of the scale 4 is 8 eps, on every element: near zero as well as at the largest.
    assert_close_to_scale(expected + torch.tensor([8, -8, 8]) * EPS, expected, ulps=2)
    assert_close_to_scale(expected.clone(), expected, ulps=0)
    with pytest.raises(AssertionError, match="1 of 3 elements differ"):
        assert_close_to_scale(expected + torch.tensor([0, 0, 12]) * EPS, expected, ulps=2)


def test_an_element_near_zero_is_held_to_the_scale_not_to_itself() -> None:
    # A sum of cancelling terms of ~1: its rounding is ~1e-7 whatever its own size, which a
    # per-element relative bound (rtol) would call a 100 % error.
    terms = torch.tensor([1.0, 1e-7])
    got = torch.tensor([1.0, 1e-7 + 2 * EPS])
    assert_close_to_scale(got, terms, ulps=4)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, terms, rtol=1e-6, atol=0)


def test_the_failure_names_the_worst_element_its_ulps_and_the_bound() -> None:
    expected = torch.tensor([[4.0, -2.0], [0.0, 1.0]])
    actual = expected + torch.tensor([[4, 0], [12, -8]]) * EPS
    with pytest.raises(AssertionError) as failure:
        assert_close_to_scale(actual, expected, ulps=1.5, msg="layers.0.weight")
    assert str(failure.value) == (
        "layers.0.weight: 2 of 4 elements differ by more than 1.5 ulps of the scale 4 "
        "(7.15e-07 in torch.float32); the worst, at (1, 0): 1.43051147e-06 against 0, off by "
        "1.43e-06 = 3 ulps")


def test_a_nan_or_an_infinity_fails() -> None:
    expected = torch.tensor([1.0, 2.0])
    for bad in (float("nan"), float("inf")):
        with pytest.raises(AssertionError, match=r"the worst, at \(1,\): (nan|inf) against 2"):
            assert_close_to_scale(torch.tensor([1.0, bad]), expected, ulps=1e6)


def test_a_zero_reference_demands_zeros() -> None:
    assert_close_to_scale(torch.zeros(3), torch.zeros(3), ulps=100)
    with pytest.raises(AssertionError, match="= inf ulps"):
        assert_close_to_scale(torch.tensor([0.0, 1e-30, 0.0]), torch.zeros(3), ulps=100)


def test_shapes_and_dtypes_must_match() -> None:
    with pytest.raises(AssertionError, match=r"shapes differ: \(2,\) against \(3,\)"):
        assert_close_to_scale(torch.zeros(2), torch.zeros(3), ulps=1)
    with pytest.raises(AssertionError, match="dtypes differ: torch.float64 against torch.float32"):
        assert_close_to_scale(torch.zeros(2, dtype=torch.float64), torch.zeros(2), ulps=1)
    with pytest.raises(AssertionError, match="torch.int64 has no ulp"):
        assert_close_to_scale(torch.tensor([1]), torch.tensor([1]), ulps=1)


def test_python_floats_are_held_to_the_precision_they_were_computed_in() -> None:
    # float32 losses logged as Python floats: one float32 ulp apart at 3.
    a, b = 3.0, 3.0 + 2 * EPS
    assert_close_to_scale([a], [b], ulps=1, dtype=torch.float32)
    # Read as float64, the same gap is ~4e8 ulps.
    with pytest.raises(AssertionError, match="in torch.float64"):
        assert_close_to_scale(a, b, ulps=1e6)


def test_a_state_dict_is_compared_tensor_by_tensor_at_each_scale() -> None:
    expected = {"big": torch.tensor([1000.0]), "small": torch.tensor([1e-3])}
    # Two float32 steps at 1000 (1.2e-4, 1.02 ulps of the scale) pass; 1e-4 at 1e-3, ~8e5
    # ulps of that tensor's scale, does not: each tensor has its own scale.
    assert_tensors_close_to_scale({"big": torch.tensor([1000.0001]),
                                   "small": torch.tensor([1e-3])}, expected, ulps=2)
    with pytest.raises(AssertionError, match="^step 2: small: 1 of 1 elements"):
        assert_tensors_close_to_scale({"big": torch.tensor([1000.0]),
                                       "small": torch.tensor([1.1e-3])}, expected, ulps=2,
                                      msg="step 2")
    with pytest.raises(AssertionError, match=r"keys differ: \['big'\] against"):
        assert_tensors_close_to_scale({"big": torch.tensor([1000.0])}, expected, ulps=1)


def test_a_tensor_that_cancels_as_a_whole_is_held_to_the_scale_of_its_terms() -> None:
    # Gradients: one of ~1, and one that is zero but for rounding (a key bias, whose terms
    # are also ~1): its noise is thousands of ulps of its own scale, a few of the terms'.
    expected = {"weight": torch.tensor([1.0, -0.5]), "bias": torch.tensor([3e-8, 0.0])}
    actual = {"weight": torch.tensor([1.0, -0.5]), "bias": torch.tensor([-2e-7, 1e-7])}
    with pytest.raises(AssertionError, match="^bias: 2 of 2 elements"):
        assert_tensors_close_to_scale(actual, expected, ulps=4)
    assert_tensors_close_to_scale(actual, expected, ulps=4, shared_scale=True)
    assert_close_to_scale(actual["bias"], expected["bias"], ulps=4, scale=1.0)
    with pytest.raises(AssertionError, match="of the scale 1 "):
        assert_close_to_scale(actual["bias"], expected["bias"], ulps=1, scale=1.0)
