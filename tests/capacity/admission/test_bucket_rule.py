"""One bucket rule: the pure rule (capacity.admission.bucket.split: GCRA with partial
spillover), the Redis Lua script that the live admission runs, the fallback's LocalBuckets and
the fleet simulator's admission decide every request of one sequence alike.

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
from capacity.admission.redis_layout import GCRA_LUA
from simulation.engine import TokenBucketAdmission
from simulation.engine.traces import TraceRequest

# Decisions whose margin is below this are ties that float rounding may break either way: the
# Lua script stores a TAT as text with 14 significant digits.
TIE_MS = 1e-6

_DRIVER = (
    GCRA_LUA
    + """
local class, g_mu, be_mu, wait = gcra_split(
  KEYS[1], KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
  tonumber(ARGV[5]), 60000)
return {class, tostring(g_mu), tostring(be_mu), tostring(wait),
        redis.call('GET', KEYS[1]) or '', redis.call('GET', KEYS[2]) or ''}
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
rates = st.one_of(st.just(0.0), st.floats(min_value=1, max_value=10_000))


@pytest.fixture(scope="module")
def lua_split():
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    script = client.register_script(_DRIVER)

    def run(keys, *, g_rate, be_rate, now_ms, cost_mu, burst_seconds):
        args = [repr(v) for v in (g_rate, be_rate, now_ms, cost_mu, burst_seconds * 1000)]
        class_, g_mu, be_mu, wait, g_tat, be_tat = script(keys=keys, args=args)
        return (
            class_.decode(), float(g_mu), float(be_mu), float(wait),
            float(g_tat) if g_tat else None, float(be_tat) if be_tat else None,
        )  # fmt: skip

    yield run
    client.close()


def _margin_ms(g_tat, be_tat, now_ms, cost_mu, g_rate, be_rate, burst_seconds):
    """The smallest distance of any comparison the rule makes from its tie."""
    burst_ms = burst_seconds * 1000
    margins = []
    left = 0.0
    if g_rate > 0:
        if g_tat is not None:
            margins.append(abs(g_tat - now_ms))  # full or not
        tat = now_ms if g_tat is None or g_tat < now_ms else g_tat
        margins.append(abs(tat + cost_mu * 60_000 / g_rate - burst_ms - now_ms))
        left = max(0.0, (now_ms + burst_ms - tat) * g_rate / 60_000)
    if be_rate > 0:
        if be_tat is not None:
            margins.append(abs(be_tat - now_ms))
        tat = now_ms if be_tat is None or be_tat < now_ms else be_tat
        margins.append(abs(tat + (cost_mu - left) * 60_000 / be_rate - burst_ms - now_ms))
    return min(margins, default=float("inf"))


@hypothesis_settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    g_rate=rates,
    be_rate=rates,
    burst_seconds=st.sampled_from([1, 5, 10, 60]),
    sequence=steps,
)
def test_the_pure_rule_the_lua_script_the_fallback_and_the_simulator_decide_alike(
    lua_split, g_rate, be_rate, burst_seconds, sequence
):
    # Keys no earlier run can have left behind (the clock here is the test's, not Redis's).
    keys = [f"test:gcra:g:{uuid.uuid4().hex}", f"test:gcra:be:{uuid.uuid4().hex}"]
    fallback = bucket.LocalBuckets(burst_seconds=burst_seconds)
    simulator = TokenBucketAdmission(
        guaranteed_mu_per_minute={"a": g_rate},
        best_effort_mu_per_minute={"a": be_rate},
        burst_seconds=burst_seconds,
    )
    now_ms = 1_000.0
    redis_g = redis_be = None  # the state Redis holds
    chain_g = chain_be = None  # the pure rule's own state, decision after decision
    sim_g = sim_be = None
    for gap_ms, cost_mu in sequence:
        now_ms += gap_ms
        rule = {
            "now_ms": now_ms, "cost_mu": cost_mu, "guaranteed_mu_per_minute": g_rate,
            "best_effort_mu_per_minute": be_rate, "burst_seconds": burst_seconds,
        }  # fmt: skip
        # The Lua script against the pure rule, both from the state Redis holds.
        on_redis_state = bucket.split(
            guaranteed_tat_ms=redis_g, best_effort_tat_ms=redis_be, **rule
        )
        class_, g_mu, be_mu, _, stored_g, stored_be = lua_split(
            keys, g_rate=g_rate, be_rate=be_rate, now_ms=now_ms, cost_mu=cost_mu,
            burst_seconds=burst_seconds,
        )  # fmt: skip
        if _margin_ms(redis_g, redis_be, now_ms, cost_mu, g_rate, be_rate, burst_seconds) > TIE_MS:
            assert class_ == on_redis_state.admission_class, (now_ms, cost_mu, redis_g, redis_be)
            assert g_mu == pytest.approx(on_redis_state.guaranteed_mu, rel=1e-9, abs=1e-9)
            assert be_mu == pytest.approx(on_redis_state.best_effort_mu, rel=1e-9, abs=1e-9)
            assert g_mu + be_mu == pytest.approx(cost_mu if class_ != "refused" else 0.0)
        redis_g, redis_be = stored_g, stored_be

        # The fallback and the simulator keep their own state: exactly the pure rule's chain.
        chained = bucket.split(guaranteed_tat_ms=chain_g, best_effort_tat_ms=chain_be, **rule)
        if chained.guaranteed_tat_ms is not None:
            chain_g = chained.guaranteed_tat_ms
        if chained.best_effort_tat_ms is not None:
            chain_be = chained.best_effort_tat_ms
        local = fallback.split(
            "g", "be", cost_mu=cost_mu, guaranteed_mu_per_minute=g_rate,
            best_effort_mu_per_minute=be_rate, now_ms=now_ms,
        )  # fmt: skip
        assert local == chained
        # The simulator's clock is in seconds: its chain is the pure rule's at that clock.
        now_s = now_ms / 1000
        simulated = bucket.split(
            guaranteed_tat_ms=sim_g, best_effort_tat_ms=sim_be, **{**rule, "now_ms": now_s * 1000}
        )
        if simulated.guaranteed_tat_ms is not None:
            sim_g = simulated.guaranteed_tat_ms
        if simulated.best_effort_tat_ms is not None:
            sim_be = simulated.best_effort_tat_ms
        simulator.decide(TraceRequest(now_s, 1, 1, client="a"), cost_mu, now_s)
        assert simulator.last_split == simulated


def test_a_request_beyond_the_guarantees_remainder_spills_only_the_rest_to_best_effort():
    # 60 MU/min with a 10 s burst holds 10 MU; 6 MU used leaves 4.
    first = bucket.split(
        guaranteed_tat_ms=None, best_effort_tat_ms=None, now_ms=0, cost_mu=6,
        guaranteed_mu_per_minute=60, best_effort_mu_per_minute=60, burst_seconds=10,
    )  # fmt: skip
    assert (first.admission_class, first.guaranteed_mu) == ("guaranteed", 6)
    # 1.5 × the remainder: 4 MU guaranteed, 2 MU best-effort, 6 MU in all.
    second = bucket.split(
        guaranteed_tat_ms=first.guaranteed_tat_ms, best_effort_tat_ms=None, now_ms=0, cost_mu=6,
        guaranteed_mu_per_minute=60, best_effort_mu_per_minute=60, burst_seconds=10,
    )  # fmt: skip
    assert second.admission_class == "best_effort"
    assert second.guaranteed_mu == pytest.approx(4)
    assert second.best_effort_mu == pytest.approx(2)
    # The guarantee is spent (its TAT a whole burst ahead), the best-effort bucket took 2 MU.
    assert second.guaranteed_tat_ms == pytest.approx(10_000)
    assert second.best_effort_tat_ms == pytest.approx(2_000)


def test_a_refused_request_changes_neither_bucket():
    # 4 MU left of the guarantee, 1 MU of best-effort burst: 6 MU fits neither way.
    refused = bucket.split(
        guaranteed_tat_ms=6_000, best_effort_tat_ms=9_000, now_ms=0, cost_mu=6,
        guaranteed_mu_per_minute=60, best_effort_mu_per_minute=60, burst_seconds=10,
    )  # fmt: skip
    assert refused.admission_class == "refused"
    assert (refused.guaranteed_tat_ms, refused.best_effort_tat_ms) == (None, None)
    # The guaranteed bucket takes 6 MU whole in 2 s; the best-effort one takes the 2 MU of
    # the rest once 1 more MU has refilled, in 1 s: the sooner.
    assert refused.wait_ms == pytest.approx(1_000)


def test_an_oversized_request_is_admitted_into_debt_when_the_bucket_is_full():
    # 60 MU/min with a 10 s burst holds 10 MU; a 25 MU request fits no burst, and there is no
    # best-effort rate to spill to.
    first = bucket.split(
        guaranteed_tat_ms=None, best_effort_tat_ms=None, now_ms=0, cost_mu=25,
        guaranteed_mu_per_minute=60, best_effort_mu_per_minute=0, burst_seconds=10,
    )  # fmt: skip
    assert (first.admission_class, first.guaranteed_mu) == ("guaranteed", 25)
    # It put the bucket 25 s in debt: the next MU waits until the debt is paid down to the burst.
    second = bucket.split(
        guaranteed_tat_ms=first.guaranteed_tat_ms, best_effort_tat_ms=None, now_ms=1_000,
        cost_mu=1, guaranteed_mu_per_minute=60, best_effort_mu_per_minute=0, burst_seconds=10,
    )  # fmt: skip
    assert not second.admitted
    assert second.wait_ms == pytest.approx(15_000)


def test_over_any_interval_a_bucket_admits_at_most_its_rate_and_burst_plus_one_request():
    buckets = bucket.LocalBuckets(burst_seconds=10)
    admitted_mu = sum(
        cost
        for now_ms, cost in ((i * 100.0, 3.0) for i in range(600))  # 60 s, 30 MU/s offered
        if buckets.split(
            "g",
            "be",
            cost_mu=cost,
            guaranteed_mu_per_minute=120,
            best_effort_mu_per_minute=0,
            now_ms=now_ms,
        ).admitted  # fmt: skip
    )
    # 120 MU/min over 60 s is 120 MU, plus a 20 MU burst, plus one request.
    assert 120 <= admitted_mu <= 120 + 20 + 3


def test_the_simulator_bursts_as_the_live_default_unless_told(settings):
    import os

    # The live default (settings, when the environment sets none) is the simulator's default.
    if "ADMISSION_BURST_SECONDS" not in os.environ:
        assert settings.ADMISSION_BURST_SECONDS == bucket.DEFAULT_BURST_SECONDS
    assert TokenBucketAdmission().burst_seconds == bucket.DEFAULT_BURST_SECONDS
