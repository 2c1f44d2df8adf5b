"""Admission that survives a late tick (issue 33, item 1): a reservation's guaranteed rate is
its floor, written when the sale changes and never by the tick, with the steps its terms fix
(a later start, an end), so a stalled tick never takes a reservation away; the tick's
best-effort allowances lose their worth as its heartbeat ages.

The floor and the staleness are rules of capacity.admission.bucket (`Floor.at`,
`best_effort_now`) restated in the live Lua script (FLOOR_LUA): both are fed the same cases.
"""

import time
import uuid
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.utils import timezone
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from capacity.admission import gate as admission
from capacity.admission.bucket import Floor, best_effort_now
from capacity.admission.floors import floor_from_terms, floors_of
from capacity.admission.redis_layout import (
    FLOOR_LUA,
    LIMITS_TICK_KEY,
    floor_key,
    limits_key,
    queue_floors,
)
from capacity.allocation.policy import Allowance
from capacity.selling.reservations import (
    reservation_amend,
    reservation_cancel,
    reservation_create,
    reservations_refresh_status,
)
from tests.capacity.admission.test_admission import ask

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.both_databases,
    pytest.mark.usefixtures("clean_admission"),
]

_DRIVER = (
    FLOOR_LUA
    + """
return {tostring(floor_at(KEYS[1], tonumber(ARGV[1])) or -1),
        tostring(best_effort_now(KEYS[2], KEYS[3], tonumber(ARGV[1]), tonumber(ARGV[2]),
                                 tonumber(ARGV[3])) or -1)}
"""
)


@pytest.fixture(scope="module")
def lua():
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    script = client.register_script(_DRIVER)
    yield client, script
    client.close()


# Steps within the next ~12 days, and moments around them: what floors_of writes (only later
# steps), so the writer keeps every key it is given (a key whose last step is long past has
# expired).
BASE_MS = float(round(time.time() * 1000))
floors = st.builds(
    lambda now_mu, steps: Floor(now_mu, tuple(sorted(steps))),
    st.floats(min_value=0.001, max_value=10_000, allow_nan=False),
    st.lists(
        st.tuples(
            st.integers(min_value=1, max_value=10**9).map(lambda ms: BASE_MS + ms),
            st.floats(min_value=0.001, max_value=10_000, allow_nan=False),
        ),
        max_size=6,
        unique_by=lambda step: step[0],
    ),
)


@hypothesis_settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    floor=floors,
    now_ms=st.integers(min_value=-(10**8), max_value=11 * 10**8).map(lambda ms: BASE_MS + ms),
    allowance=st.one_of(st.none(), st.floats(min_value=0, max_value=10_000, allow_nan=False)),
    tick_age_ms=st.one_of(st.none(), st.floats(min_value=0, max_value=1e6, allow_nan=False)),
)
def test_the_live_script_and_the_rule_agree_on_floors_and_stale_allowances(
    lua, floor, now_ms, allowance, tick_age_ms
):
    client, script = lua
    keys = [f"adm:t:floor:{uuid.uuid4()}", f"adm:t:lim:{uuid.uuid4()}", f"adm:t:tk:{uuid.uuid4()}"]
    fresh_ms, stale_ms = 60_000.0, 180_000.0
    pipe = client.pipeline(transaction=True)
    queue_floors(pipe, {(1, 1): floor}, idle_ttl_ms=600_000, pairs=[(1, 1)])
    pipe.execute()
    client.rename(floor_key(1, 1), keys[0])
    if allowance is not None:
        client.hset(keys[1], "be", repr(allowance))
    age = None
    if tick_age_ms is not None:
        written = repr(now_ms - tick_age_ms)
        client.set(keys[2], written)
        age = now_ms - float(written)  # what the script reads back
    try:
        lua_floor, lua_be = script(keys=keys, args=[repr(now_ms), fresh_ms, stale_ms])
    finally:
        client.delete(*keys)
    assert float(lua_floor) == pytest.approx(floor.at(now_ms), abs=1e-9)
    expected_be = (
        -1.0
        if allowance is None
        else best_effort_now(allowance, tick_age_ms=age, fresh_ms=fresh_ms, stale_ms=stale_ms)
    )
    assert float(lua_be) == pytest.approx(expected_be, rel=1e-9, abs=1e-9)


def test_a_floor_steps_at_every_later_start_and_end():
    now = timezone.now()
    hour = timedelta(hours=1)
    floor = floor_from_terms(
        [
            (now - hour, now + hour, 60.0),
            (now + 2 * hour, None, 30.0),
            (now + hour, now + 3 * hour, 10.0),
        ],
        now=now,
    )
    ms = lambda moment: moment.timestamp() * 1000  # noqa: E731
    assert floor.mu_per_minute == 60.0
    assert floor.at(ms(now + 0.5 * hour)) == 60.0
    assert floor.at(ms(now + 1.5 * hour)) == 10.0  # the first ended as the third began
    assert floor.at(ms(now + 2.5 * hour)) == 40.0
    assert floor.at(ms(now + 4 * hour)) == 30.0  # open-ended
    assert floor.ends_ms is None


def test_a_sale_admits_at_once_without_any_tick_and_its_cancellation_ends_it_at_once(
    sellable, served_model, acme, django_capture_on_commit_callbacks
):
    assert ask(acme, served_model).admission_class == "refused"
    with django_capture_on_commit_callbacks(execute=True):
        reservation = reservation_create(
            customer=acme, served_model=served_model, mu_per_minute=120, actor="test"
        )
    # No tick has run: the sale itself wrote the floor (120 MU/min: a 20 MU burst).
    assert ask(acme, served_model).admission_class == "guaranteed"
    assert ask(acme, served_model).admission_class == "guaranteed"
    with django_capture_on_commit_callbacks(execute=True):
        reservation_amend(reservation=reservation, mu_per_minute=0.5, actor="test")
    # 0.5 MU/min: what the two requests took now lasts minutes.
    assert ask(acme, served_model).admission_class == "refused"
    with django_capture_on_commit_callbacks(execute=True):
        reservation_cancel(reservation=reservation, actor="test")
    assert ask(acme, served_model).admission_class == "refused"


def test_a_reservation_starts_and_expires_on_time_with_nobody_awake_to_write_it(
    sellable, served_model, acme, django_capture_on_commit_callbacks, clean_admission
):
    now = timezone.now()
    with django_capture_on_commit_callbacks(execute=True):
        reservation_create(
            customer=acme,
            served_model=served_model,
            mu_per_minute=600,
            starts_at=now + timedelta(seconds=1.5),
            ends_at=now + timedelta(seconds=3.5),
            actor="test",
        )
    assert ask(acme, served_model).admission_class == "refused"  # not started yet
    time.sleep(max(0.0, (now + timedelta(seconds=1.6) - timezone.now()).total_seconds()))
    assert ask(acme, served_model).admission_class == "guaranteed"  # started: no tick ran
    time.sleep(max(0.0, (now + timedelta(seconds=3.6) - timezone.now()).total_seconds()))
    assert ask(acme, served_model).admission_class == "refused"  # expired: no task ran
    # The floor's key goes once its last term is over (the limits' idle TTL after it).
    assert clean_admission.pttl(floor_key(acme.pk, served_model.pk)) > 0
    with django_capture_on_commit_callbacks(execute=True):
        assert reservations_refresh_status() == {"activated": 0, "expired": 1}
    assert not floors_of(now=timezone.now(), pairs=[(acme.pk, served_model.pk)])


SMALL_MU = 0.35 * 100 / 60


def _burst_admitted_mu(customer, served_model, asks=200):
    """MU admitted by `asks` small requests in a row, and how long they took."""
    started = time.monotonic()
    admitted = sum(ask(customer, served_model).admitted for _ in range(asks))
    return admitted * SMALL_MU, time.monotonic() - started


def test_a_stalled_tick_keeps_the_reservation_and_lets_best_effort_decay_to_nothing(
    sellable, served_model, acme, globex, clean_admission, settings,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    settings.ADMISSION_TICK_STALE_SECONDS = 60
    settings.ADMISSION_BEST_EFFORT_MAX_STALENESS_SECONDS = 180
    admission.reset()
    with django_capture_on_commit_callbacks(execute=True):
        reservation_create(customer=acme, served_model=served_model, mu_per_minute=600, actor="t")
    admission.publish_limits(
        [
            Allowance(acme.pk, served_model.pk, 600.0, 0.0),
            Allowance(globex.pk, served_model.pk, 0.0, 600.0),
        ]
    )
    assert ask(globex, served_model).admission_class == "best_effort"

    def tick_aged(seconds):
        redis_s, micros = clean_admission.time()
        clean_admission.set(LIMITS_TICK_KEY, repr(redis_s * 1000 + micros / 1000 - seconds * 1000))
        clean_admission.delete(*clean_admission.keys("adm:be:*"), *clean_admission.keys("adm:g:*"))

    # Half-way from fresh (60 s) to worthless (180 s): 300 MU/min, so a 10 s burst of 50 MU.
    tick_aged(120)
    mu, seconds = _burst_admitted_mu(globex, served_model)
    assert 50.0 - SMALL_MU <= mu <= 50.0 + SMALL_MU + 300.0 / 60 * seconds
    # Past the stated maximum staleness: no best-effort at all.
    tick_aged(181)
    assert ask(globex, served_model).admission_class == "refused"
    # And the tick's limits hashes, which it no longer refreshes, gone (their TTL): the
    # reservation's floor holds whole all the same, its 100 MU burst.
    clean_admission.delete(limits_key(acme.pk, served_model.pk))
    mu, seconds = _burst_admitted_mu(acme, served_model)
    assert 100.0 - SMALL_MU <= mu <= 100.0 + SMALL_MU + 600.0 / 60 * seconds
