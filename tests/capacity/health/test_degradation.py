"""Degradation policies with time control: capacity halved for longer than the window →
lower tiers refused first, then max_tokens capped, then the fallback model; capacity back →
lifted after the hysteresis window, with no flapping in between."""

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from capacity.admission import gate as admission
from capacity.allocation.policy import Allowance
from capacity.health import degradation
from capacity.models import (
    DegradationChange,
    DegradationPolicy,
    DegradationState,
    Replica,
)
from tests.support.admission import publish_allowances
from tests.support.factories import ServedModelFactory

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.both_databases,
    pytest.mark.usefixtures("clean_admission"),
]

SMALL = {"input_tokens": 100, "max_tokens": 400}


@pytest.fixture
def fleet(sellable, served_model):
    """Four probed replicas of llama-8b, and a policy with every level configured."""
    deployment = served_model.deployments.get()
    replicas = [
        Replica.objects.create(deployment=deployment, key=f"process:{i}", url=f"http://r{i}")
        for i in range(4)
    ]
    fallback = ServedModelFactory(
        name="llama-1b", reference_gpu_type=served_model.reference_gpu_type
    )
    policy = DegradationPolicy.objects.create(
        served_model=served_model,
        degrade_below=0.75,
        recover_at=0.9,
        window_seconds=60,
        hysteresis_seconds=180,
        max_tokens_cap=64,
        fallback_model=fallback,
    )
    return replicas, policy


def set_unhealthy(replicas, count):
    for index, replica in enumerate(replicas):
        replica.state = Replica.State.UNHEALTHY if index < count else Replica.State.HEALTHY
        replica.save()


def level(served_model) -> int:
    state = DegradationState.objects.filter(served_model=served_model).first()
    return state.level if state else 0


def test_one_bad_sample_changes_nothing(fleet, served_model):
    replicas, _ = fleet
    start = timezone.now()
    with time_machine.travel(start, tick=False) as clock:
        set_unhealthy(replicas, 2)
        degradation.evaluate_all()
        clock.shift(30)
        set_unhealthy(replicas, 0)
        degradation.evaluate_all()
        clock.shift(45)  # 75 s after the bad sample: the window would have passed
        set_unhealthy(replicas, 2)
        degradation.evaluate_all()
        clock.shift(59)  # a new window started with the new bad sample
        degradation.evaluate_all()
    assert level(served_model) == 0
    assert not DegradationChange.objects.exists()


def test_halved_capacity_degrades_in_order_and_recovers_after_hysteresis_without_flapping(
    fleet, served_model
):
    replicas, _ = fleet
    start = timezone.now()
    levels = []
    with time_machine.travel(start, tick=False) as clock:

        def sample(after_seconds):
            clock.move_to(start + timedelta(seconds=after_seconds))
            degradation.evaluate_all()
            degradation.forget()
            levels.append(
                (after_seconds, level(served_model), degradation.current(served_model.pk))
            )

        set_unhealthy(replicas, 2)  # half the capacity
        for t in range(0, 400, 10):
            sample(t)
        # Capacity returns, with a dip between the thresholds (3 of 4 = 75 %: neither side).
        set_unhealthy(replicas, 0)
        for t in range(400, 500, 10):
            sample(t)
        set_unhealthy(replicas, 1)
        sample(500)
        set_unhealthy(replicas, 0)
        for t in range(510, 720, 10):
            sample(t)

    # One step per full window below the threshold. Level 1 sheds the four migrated tiers one
    # window each (60, 120, 180, 240 s), then level 2 (300 s) and level 3 (360 s).
    first_at = {lvl: next(t for t, seen, _ in levels if seen == lvl) for lvl in (1, 2, 3)}
    assert first_at == {1: 60, 2: 300, 3: 360}
    shed = {t: (d.shed_tiers, d.refuse_best_effort) for t, _, d in levels if t in range(0, 310, 60)}
    assert shed == {
        0: ((), False),
        60: (("free",), False),
        120: (("free", "standard"), False),
        180: (("free", "standard", "premium"), False),
        240: ((), True),  # the last tier shed: all best-effort is refused
        300: ((), True),
    }
    # Held through recovery and the dip; lifted 180 s after the share stayed high (from 510).
    assert all(seen == 3 for t, seen, _ in levels if 360 <= t < 690)
    assert [seen for t, seen, _ in levels if t >= 690] == [0, 0, 0]
    assert levels[-1][2] == degradation.NORMAL
    changes = list(DegradationChange.objects.order_by("at"))
    assert [(c.from_level, c.to_level) for c in changes] == [
        (0, 1), (1, 1), (1, 1), (1, 1), (1, 2), (2, 3), (3, 0)
    ]  # fmt: skip
    assert "best-effort traffic of tier free is refused" in changes[0].reason
    assert "tier standard is refused too" in changes[1].reason
    assert "tier enterprise is refused too" in changes[3].reason
    assert "max_tokens is capped" in changes[4].reason
    assert "fallback model" in changes[5].reason
    assert "lifted" in changes[6].reason and changes[6].healthy_share == 1.0
    assert DegradationState.objects.get(served_model=served_model).tiers_shed == 0


def test_a_policy_without_cap_or_fallback_has_one_level(fleet, served_model):
    replicas, policy = fleet
    policy.max_tokens_cap = None
    policy.fallback_model = None
    policy.save()
    set_unhealthy(replicas, 3)
    start = timezone.now()
    with time_machine.travel(start, tick=False) as clock:
        for t in range(0, 600, 30):
            clock.move_to(start + timedelta(seconds=t))
            degradation.evaluate_all()
    assert level(served_model) == 1
    # Level 1 itself, then the three further tiers it sheds, and nothing after.
    assert DegradationChange.objects.count() == 4


def test_turning_the_policy_off_lifts_its_levels(fleet, served_model):
    replicas, policy = fleet
    DegradationState.objects.create(served_model=served_model, level=2)
    policy.enabled = False
    policy.save()
    degradation.evaluate_all()
    assert level(served_model) == 0
    assert DegradationChange.objects.get().reason == "the degradation policy is off"


def ask(customer, served_model, **shape):
    return admission.admit(
        customer_id=customer.pk,
        model=served_model.name,
        input_tokens=shape.get("input_tokens", SMALL["input_tokens"]),
        max_tokens=shape.get("max_tokens", SMALL["max_tokens"]),
    )


def test_admission_refuses_lower_tiers_first_then_caps_then_sends_overflow_to_the_fallback(
    fleet, served_model, acme, globex
):
    # acme has a reservation (a 100 MU burst: about 7 requests of 13.6 MU), globex only
    # best-effort room.
    publish_allowances(
        [
            Allowance(acme.pk, served_model.pk, 600.0, 0.0),
            Allowance(globex.pk, served_model.pk, 0.0, 600.0),
        ]
    )
    normal_acme, normal_globex = ask(acme, served_model), ask(globex, served_model)
    assert (normal_acme.admission_class, normal_globex.admission_class) == (
        "guaranteed",
        "best_effort",
    )
    assert normal_acme.max_tokens is None and normal_acme.degradation_level == 0

    # Level 1 once every tier is shed (four windows with the migrated tiers).
    state = DegradationState.objects.create(served_model=served_model, level=1, tiers_shed=4)
    degradation.forget()
    refused = ask(globex, served_model)
    assert not refused.admitted and "best-effort traffic is refused" in refused.reason
    assert refused.fallback_model is None
    assert ask(acme, served_model).admission_class == "guaranteed"

    state.level = 2
    state.save()
    degradation.forget()
    capped = ask(acme, served_model)
    assert capped.admitted and capped.max_tokens == 64
    assert capped.estimated_mu < normal_acme.estimated_mu

    state.level = 3
    state.save()
    degradation.forget()
    answers = [ask(acme, served_model) for _ in range(60)]
    overflow = [a for a in answers if not a.admitted]
    assert overflow, "acme's burst should run out"
    assert {a.fallback_model for a in overflow} == {"llama-1b"}
    assert all(a.fallback_model is None for a in answers if a.admitted)
    assert ask(globex, served_model).fallback_model == "llama-1b"


def test_the_admission_api_carries_the_degradation(fleet, served_model, acme, make_key, key_client):
    from accounts import scopes as S

    publish_allowances([Allowance(acme.pk, served_model.pk, 60.0, 0.0)])
    DegradationState.objects.create(served_model=served_model, level=2)
    _, plaintext = make_key(customer=acme, scopes=[S.ADMISSION])
    response = key_client(plaintext).post(
        "/api/v1/admission", {"model": "llama-8b", **SMALL}, format="json"
    )
    assert response.status_code == 200
    body = response.json()
    assert (body["max_tokens"], body["degradation_level"], body["fallback_model"]) == (64, 2, None)


def test_level_1_refuses_the_free_tier_and_admits_the_paid_one_through_the_api(
    fleet, served_model, acme, globex, make_key, key_client
):
    from accounts import scopes as S

    acme.tier_id, globex.tier_id = "free", "premium"
    acme.save()
    globex.save()
    # Both customers are best-effort only (no reservation), with room to spare.
    publish_allowances(
        [
            Allowance(acme.pk, served_model.pk, 0.0, 600.0),
            Allowance(globex.pk, served_model.pk, 0.0, 600.0),
        ]
    )
    replicas, _ = fleet
    set_unhealthy(replicas, 2)
    start = timezone.now()
    with time_machine.travel(start, tick=False) as clock:
        degradation.evaluate_all()
        clock.shift(60)  # one full window below the threshold: level 1
        degradation.evaluate_all()
    assert level(served_model) == 1
    degradation.forget()

    def post(customer):
        _, plaintext = make_key(customer=customer, scopes=[S.ADMISSION])
        response = key_client(plaintext).post(
            "/api/v1/admission", {"model": "llama-8b", **SMALL}, format="json"
        )
        return response.status_code, response.json()

    (free_status, free), (paid_status, paid) = post(acme), post(globex)
    assert (free_status, paid_status) == (429, 200)
    assert not free["admitted"] and free["degradation_level"] == 1
    assert "best-effort traffic for tier(s) free is refused" in free["reason"]
    assert paid["admitted"] and paid["class"] == "best_effort", paid
