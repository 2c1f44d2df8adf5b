"""One decision per request, made once (issue 33, item 2): degradation sheds best-effort inside
the admission script, so nothing Redis admitted and recorded is refused afterwards. A shed
request is recorded as the refusal it is: its usage event is accepted and counted as demand, a
reservation holder's earns the refusal's standing, and a request that would have spilled over
takes nothing from its guarantee."""

from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from accounts import scopes as S
from capacity.admission import gate as admission
from capacity.admission.redis_layout import parse_record, record_key
from capacity.allocation.policy import Allowance
from capacity.health import degradation
from capacity.models import DegradationState, UsageEvent
from tests.capacity.health.test_degradation import fleet
from tests.support.admission import publish_allowances

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.both_databases,
    pytest.mark.usefixtures("clean_admission"),
]
__all__ = ["fleet"]  # a fixture used here

# 100 prompt tokens and 10 output: 0.35 replica-seconds, 0.583 MU with the fixtures' model.
SMALL = {"input_tokens": 100, "max_tokens": 10}
SMALL_MU = 0.35 * 100 / 60


def ask(customer, served_model, request_id, **shape):
    return admission.admit(
        customer_id=customer.pk,
        model=served_model.name,
        input_tokens=shape.get("input_tokens", SMALL["input_tokens"]),
        max_tokens=shape.get("max_tokens", SMALL["max_tokens"]),
        request_id=request_id,
    )


def record_of(customer, served_model, request_id):
    client = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    return parse_record(client.get(record_key(customer.pk, served_model.pk, request_id)))


def shed_everyone(served_model):
    DegradationState.objects.create(served_model=served_model, level=1, tiers_shed=4)
    degradation.forget()


@pytest.fixture
def gateway(make_key, key_client):
    _, plaintext = make_key(service_name="gateway", scopes=[S.USAGE_WRITE, S.ADMISSION])
    return key_client(plaintext)


def refused_event(event_id, customer, estimated_mu) -> dict:
    finished = timezone.now() - timedelta(seconds=1)
    return {
        "event_id": event_id,
        "customer": customer.slug,
        "model": "llama-8b",
        "started_at": (finished - timedelta(milliseconds=5)).isoformat(),
        "finished_at": finished.isoformat(),
        "input_tokens": SMALL["input_tokens"],
        "output_tokens": 0,
        "outcome": "refused",
        "estimated_mu": estimated_mu,
    }


def test_a_shed_request_is_recorded_refused_and_its_event_is_kept_as_demand(
    fleet, served_model, globex, gateway
):
    publish_allowances([Allowance(globex.pk, served_model.pk, 0.0, 600.0)])
    shed_everyone(served_model)
    decision = ask(globex, served_model, "shed-1")
    assert (decision.admitted, decision.limit) == (False, "degradation")
    # Recorded as what it was: a refusal (best-effort demand), never an admission.
    assert record_of(globex, served_model, "shed-1").admission_class == "refused"
    response = gateway.post(
        "/api/v1/usage/events",
        {"events": [refused_event("shed-1", globex, decision.estimated_mu)]},
        format="json",
    )
    assert response.status_code == 200, response.json()
    assert response.json()["accepted"] == ["shed-1"]
    stored = UsageEvent.objects.get(event_id="shed-1")
    assert (stored.outcome, stored.admission_class, stored.verification) == (
        "refused",
        "best_effort",
        "recorded",
    )
    assert stored.estimated_mu == pytest.approx(decision.estimated_mu)


def test_a_shed_reservation_holder_keeps_its_guarantee_and_its_refusal_counts_as_guaranteed(
    fleet, served_model, acme, gateway
):
    # 6 MU/min reserved: a 1 MU burst, one small request (0.58 MU) fits, the next would spill
    # over into best-effort (0.42 MU left of the guarantee, the rest best-effort).
    publish_allowances([Allowance(acme.pk, served_model.pk, 6.0, 600.0)])
    assert ask(acme, served_model, "a-1").admission_class == "guaranteed"
    shed_everyone(served_model)
    # Would spill over: shed whole, taking nothing from what is left of the guarantee...
    spilled = ask(acme, served_model, "a-2", max_tokens=12)
    assert (spilled.admitted, spilled.limit) == (False, "degradation")
    assert record_of(acme, served_model, "a-2").admission_class == "refused_guaranteed"
    # ...so a request within what is left of the reservation is still admitted, guaranteed.
    tiny = ask(acme, served_model, "a-3", input_tokens=10, max_tokens=5)
    assert (tiny.admitted, tiny.admission_class) == (True, "guaranteed")
    response = gateway.post(
        "/api/v1/usage/events",
        {"events": [refused_event("a-2", acme, spilled.estimated_mu)]},
        format="json",
    )
    assert response.json()["accepted"] == ["a-2"]
    # A refusal of the reservation holder: guaranteed demand, what an SLA credit is made of.
    assert UsageEvent.objects.get(event_id="a-2").admission_class == "guaranteed"
