"""The sellability programmes, pure: whole replicas decide, the relaxation explains (no database).

Two models on one 8-GPU pool: llama's replicas take 1 GPU, qwen's 2, and each sells 90 MU/min."""

import numpy as np
import pytest

from capacity.selling.feasibility import PoolSpec, Programme, UnitSpec

LLAMA, QWEN, POOL = 1, 2, 10


@pytest.fixture
def programme() -> Programme:
    return Programme(
        pools=[PoolSpec(POOL, "shared-h100", 8)],
        units=[
            UnitSpec(100, "llama-h100", LLAMA, POOL, 1, 8, 90.0),
            UnitSpec(200, "qwen-h100", QWEN, POOL, 2, 4, 90.0),
        ],
        model_ids=[LLAMA, QWEN],
    )


def sold(*moments: tuple[float, float]) -> np.ndarray:
    """Rows of (llama, qwen) MU/min sold, one per moment."""
    return np.array(moments, dtype=float)


def test_what_fits_only_in_split_replicas_does_not_fit_whole(programme):
    # 4.5 + 2 × 1.75 = 8 GPUs split; 5 + 2 × 2 = 9 whole.
    llama_sold = sold((405.0, 0.0))
    assert programme.available(llama_sold, QWEN).mu_per_minute == pytest.approx(157.5)
    assert programme.whole_fits(llama_sold, QWEN, 157.5) is False
    assert programme.whole_fits(llama_sold, QWEN, 90.0) is True
    value, row = programme.whole_available(llama_sold, QWEN)
    assert (value, row) == (pytest.approx(90.0), 0)
    # The relaxation names the pool that binds.
    assert programme.available(llama_sold, QWEN).binding.pools == (POOL,)


def test_every_moment_is_checked_on_its_own_when_the_peak_does_not_fit(programme):
    # Llama's 405 and qwen's 157.5 never run at once: the peak (405, 157.5) needs 9 GPUs,
    # each moment alone fits.
    apart = sold((405.0, 0.0), (0.0, 157.5))
    assert programme.whole_fits(apart, QWEN, 0.0) is True
    assert programme.whole_fits(apart, QWEN, 90.0) is True  # 5 + 2, then 0 + 6 GPUs
    assert programme.whole_fits(apart, QWEN, 91.0) is False  # the first moment: 5 + 4
    # What qwen can still take at both: 90 beside llama's 405, 202.5 later (4 replicas).
    value, row = programme.whole_available(apart, QWEN)
    assert (value, row) == (pytest.approx(90.0), 0)
    # Llama: 8 replicas beside nothing (720 − 405), 4 beside qwen's 2 (360 − 0).
    value, row = programme.whole_available(apart, LLAMA)
    assert (value, row) == (pytest.approx(315.0), 0)


def test_a_model_whose_own_sales_do_not_fit_whole_has_less_than_nothing_to_take(programme):
    both = sold((405.0, 157.5))
    assert programme.available(both, LLAMA).mu_per_minute == pytest.approx(0.0)
    # Qwen's 157.5 takes 2 whole replicas (4 GPUs): llama's 4 serve 360 of its 405.
    value, row = programme.whole_available(both, LLAMA)
    assert (value, row) == (pytest.approx(-45.0), 0)
    # Others that cannot be served at all leave nothing to compute.
    assert programme.whole_available(sold((0.0, 400.0)), LLAMA) == (None, 0)


def test_out_of_time_is_undecided_never_a_guess(programme):
    apart = sold((405.0, 0.0), (0.0, 157.5))
    assert programme.whole_fits(apart, QWEN, 90.0, seconds=0.0) is None
    assert programme.whole_available(apart, QWEN, seconds=0.0) is None
