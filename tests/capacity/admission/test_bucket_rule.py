"""One bucket rule: the pure GCRA (capacity.admission.bucket), the Redis Lua script that the live
admission runs, and the fleet simulator's admission decide every request of one sequence alike.

The Lua side runs the very text of the live script's rule (GCRA_LUA) on the real Redis server,
with the clock chosen by the test instead of Redis's TIME; the simulator side is its admission
as the fleet simulator calls it, one request at a time in arrival order.
"""

import uuid

import pytest
import redis
from django.conf import settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from capacity.admission import bucket
from capacity.admission.redis_buckets import GCRA_LUA
from simulation.engine import TokenBucketAdmission
from simulation.engine.traces import TraceRequest

# Decisions whose margin is below this are ties that float rounding may break either way: the
# Lua script stores a TAT as text with 14 significant digits.
TIE_MS = 1e-6

_DRIVER = (
    GCRA_LUA
    + """
local ok, wait = gcra_take(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
                           tonumber(ARGV[4]), 60000)
return {ok and 1 or 0, tostring(wait), redis.call('GET', KEYS[1]) or ''}
"""
)

steps = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=120_000, allow_nan=False),  # ms since the last request
        st.floats(min_value=0.001, max_value=5_000, allow_nan=False),  # the request's MU
    ),
    min_size=1,
    max_size=40,
)


@pytest.fixture(scope="module")
def lua_take():
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    script = client.register_script(_DRIVER)
    yield lambda key, *, rate, now_ms, cost_mu, burst_seconds: script(
        keys=[key], args=[repr(rate), repr(now_ms), repr(cost_mu), repr(burst_seconds * 1000)]
    )
    client.close()


def _margin_ms(tat_ms, now_ms, cost_mu, rate, burst_seconds):
    tat = now_ms if tat_ms is None or tat_ms < now_ms else tat_ms
    allow_at = min(tat + cost_mu * 60_000 / rate - burst_seconds * 1000, tat)
    return abs(allow_at - now_ms)


@hypothesis_settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rate=st.floats(min_value=1, max_value=10_000),
    burst_seconds=st.sampled_from([1, 5, 10, 60]),
    sequence=steps,
)
def test_the_pure_rule_the_lua_script_and_the_simulator_decide_alike(
    lua_take, rate, burst_seconds, sequence
):
    # A key no earlier run can have left behind (the clock here is the test's, not Redis's).
    key = f"test:gcra:{uuid.uuid4().hex}"
    simulator = TokenBucketAdmission(
        guaranteed_mu_per_minute={"a": rate}, burst_seconds=burst_seconds
    )
    now_ms, tat_ms, simulator_tat_ms = 1_000.0, None, None
    for gap_ms, cost_mu in sequence:
        now_ms += gap_ms
        pure = bucket.take(
            tat_ms=tat_ms, now_ms=now_ms, cost_mu=cost_mu, mu_per_minute=rate,
            burst_seconds=burst_seconds,
        )  # fmt: skip
        admitted, _, stored = lua_take(
            key, rate=rate, now_ms=now_ms, cost_mu=cost_mu, burst_seconds=burst_seconds
        )
        request = TraceRequest(arrival_s=now_ms / 1000, input_tokens=1, output_tokens=1, client="a")
        simulated = simulator.admit(request, cost_mu, now_ms / 1000)
        if _margin_ms(tat_ms, now_ms, cost_mu, rate, burst_seconds) > TIE_MS:
            assert bool(admitted) == pure.admitted, (now_ms, cost_mu, tat_ms)
        if _margin_ms(simulator_tat_ms, now_ms, cost_mu, rate, burst_seconds) > TIE_MS:
            on_simulator_state = bucket.take(
                tat_ms=simulator_tat_ms, now_ms=now_ms, cost_mu=cost_mu, mu_per_minute=rate,
                burst_seconds=burst_seconds,
            )  # fmt: skip
            assert simulated == on_simulator_state.admitted, (now_ms, cost_mu, simulator_tat_ms)
        if simulated:
            simulator_tat_ms = bucket.take(
                tat_ms=simulator_tat_ms, now_ms=now_ms, cost_mu=cost_mu, mu_per_minute=rate,
                burst_seconds=burst_seconds,
            ).tat_ms  # fmt: skip
        # Both go on from the state Redis holds (rounding aside, the pure rule's own).
        tat_ms = float(stored) if stored else None
        if pure.admitted and admitted:
            assert tat_ms == pytest.approx(pure.tat_ms, rel=1e-12, abs=1e-6)


def test_an_oversized_request_is_admitted_into_debt_when_the_bucket_is_full():
    # 60 MU/min with a 10 s burst holds 10 MU; a 25 MU request fits no burst.
    first = bucket.take(tat_ms=None, now_ms=0, cost_mu=25, mu_per_minute=60, burst_seconds=10)
    assert first.admitted
    # It put the bucket 25 s in debt: the next MU waits until the debt is paid down to the burst.
    second = bucket.take(
        tat_ms=first.tat_ms, now_ms=1_000, cost_mu=1, mu_per_minute=60, burst_seconds=10
    )
    assert not second.admitted
    assert second.wait_ms == pytest.approx(15_000)


def test_over_any_interval_a_bucket_admits_at_most_its_rate_and_burst_plus_one_request():
    buckets = bucket.LocalBuckets(burst_seconds=10)
    admitted_mu = sum(
        cost
        for now_ms, cost in ((i * 100.0, 3.0) for i in range(600))  # 60 s, 30 MU/s offered
        if buckets.take("k", cost_mu=cost, mu_per_minute=120, now_ms=now_ms)
    )
    # 120 MU/min over 60 s is 120 MU, plus a 20 MU burst, plus one request.
    assert 120 <= admitted_mu <= 120 + 20 + 3


def test_the_simulator_bursts_as_the_live_default_unless_told(settings):
    import os

    # The live default (settings, when the environment sets none) is the simulator's default.
    if "ADMISSION_BURST_SECONDS" not in os.environ:
        assert settings.ADMISSION_BURST_SECONDS == bucket.DEFAULT_BURST_SECONDS
    assert TokenBucketAdmission().burst_seconds == bucket.DEFAULT_BURST_SECONDS
