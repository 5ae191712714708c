"""Learning-rate schedules (algorithm/schedules.py), worked by hand."""

import pytest

from grpo.algorithm.schedules import LR_SCHEDULES, lr_lambda


def test_linear_warmup_then_linear_decay_to_zero():
    warm = lr_lambda(warmup=4, total=12, schedule="linear")
    assert [round(warm(s), 4) for s in (0, 3, 4, 8, 12)] == [0.25, 1.0, 1.0, 0.5, 0.0]


def test_cosine_is_half_way_at_the_middle_and_zero_at_the_end():
    cosine = lr_lambda(warmup=0, total=10, schedule="cosine")
    assert cosine(0) == 1.0 and cosine(5) == pytest.approx(0.5) and cosine(10) == pytest.approx(0.0)
    assert cosine(20) == pytest.approx(0.0)  # past the planned steps it stays at the end value


def test_constant_after_warmup():
    constant = lr_lambda(2, 10, "constant")
    assert [constant(s) for s in (0, 1, 7)] == [0.5, 1.0, 1.0]


def test_unknown_schedule_names_the_valid_ones():
    with pytest.raises(ValueError, match="cosine"):
        lr_lambda(0, 10, "exponential")
    assert set(LR_SCHEDULES) == {"constant", "linear", "cosine"}
