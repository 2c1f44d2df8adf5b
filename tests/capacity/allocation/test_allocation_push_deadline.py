"""One hanging actuator does not stall the tick: each push has an enforced deadline."""

import time

import pytest
from django.utils import timezone

from capacity.allocation.tick import allocation_tick
from capacity.models import AllocationDecision, Deployment, UsageMinute
from tests.support.factories import DeploymentFactory, GpuPoolFactory, ServedModelFactory
from tests.support.webhook_receiver import HANG, WebhookReceiver

pytestmark = pytest.mark.django_db

DEADLINE_SECONDS = 1.0


@pytest.fixture
def receivers():
    hanging, answering = WebhookReceiver(secret=None).start(), WebhookReceiver(secret=None).start()
    hanging.fail_next(*[HANG] * 5)
    yield hanging, answering
    hanging.stop()
    answering.stop()


def demanded_deployment(name, gpu_type, url, globex):
    """A webhook deployment at 1 replica whose model's demand asks for more."""
    from tests.conftest import make_cost_model

    model = ServedModelFactory(name=f"{name}-model", reference_gpu_type=gpu_type)
    make_cost_model(model, gpu_type)
    deployment = DeploymentFactory(
        name=name,
        served_model=model,
        gpu_pool=GpuPoolFactory(gpu_type=gpu_type, gpu_count=8),
        max_replicas=8,
        current_replicas=1,
        target_utilisation=1.0,
        actuator_kind="webhook",
        # Configured to wait far longer than the deadline: the tick caps it.
        actuator_config={"url": url, "timeout_seconds": 30},
    )
    now = timezone.now().replace(second=0, microsecond=0)
    UsageMinute.objects.bulk_create(
        UsageMinute(
            customer=globex,
            served_model=model,
            minute=now - timezone.timedelta(minutes=m),
            requests=10,
            mu=300,
        )
        for m in range(1, 6)
    )
    return deployment


def test_a_hanging_webhook_fails_at_the_deadline_and_the_others_are_pushed(
    receivers, gpu_type, globex, settings
):
    settings.ALLOCATION_PUSH_DEADLINE_SECONDS = DEADLINE_SECONDS
    settings.ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS = True  # the receivers check no signature
    hanging, answering = receivers
    stuck = demanded_deployment("stuck", gpu_type, hanging.url, globex)
    healthy = demanded_deployment("healthy", gpu_type, answering.url, globex)

    started = time.monotonic()
    result = allocation_tick()
    elapsed = time.monotonic() - started

    assert elapsed < DEADLINE_SECONDS + 2.0, elapsed
    assert (result.applied, result.failed) == (1, 1)
    failed = AllocationDecision.objects.get(deployment=stuck)
    assert failed.actuator_ok is False
    assert failed.actuator_error
    pushed = AllocationDecision.objects.get(deployment=healthy)
    assert pushed.actuator_ok is True
    healthy.refresh_from_db()
    assert healthy.current_replicas == pushed.target_replicas > 1

    # Whatever the hanging push does afterwards, it is never applied: no further attempt
    # reaches the receiver, and the deployment keeps the replicas the tick saw.
    attempts = len(hanging.received)
    time.sleep(DEADLINE_SECONDS * 1.5)
    assert len(hanging.received) == attempts
    stuck.refresh_from_db()
    assert stuck.current_replicas == 1
    assert AllocationDecision.objects.get(deployment=stuck).actuator_ok is False


def test_a_push_that_outlives_its_deadline_is_abandoned_and_its_late_answer_dropped(
    gpu_type, globex, settings, monkeypatch
):
    """An actuator that ignores every timeout: the tick still ends at the deadline, and its
    answer, arriving after the tick moved on, is recorded nowhere."""
    import threading

    from capacity.actuation import registry
    from capacity.actuation.base import Actuator

    settings.ALLOCATION_PUSH_DEADLINE_SECONDS = DEADLINE_SECONDS
    settings.ACTUATOR_ALLOW_UNSIGNED_WEBHOOKS = True  # the receivers check no signature
    answered = threading.Event()

    class Stubborn(Actuator):
        kind = "webhook"

        def apply(self, request):
            time.sleep(DEADLINE_SECONDS * 2)
            answered.set()
            return request.target_replicas

    monkeypatch.setattr(registry, "actuator_for", lambda kind: Stubborn())
    slow = demanded_deployment("slow", gpu_type, "http://127.0.0.1:9/hook", globex)

    started = time.monotonic()
    allocation_tick()
    assert time.monotonic() - started < DEADLINE_SECONDS + 2.0
    assert not answered.is_set()
    decision = AllocationDecision.objects.get(deployment=slow)
    assert decision.actuator_ok is False
    assert "push deadline" in decision.actuator_error

    assert answered.wait(timeout=5)  # it answered success, late
    time.sleep(0.2)
    decision.refresh_from_db()
    assert decision.actuator_ok is False
    assert Deployment.objects.get(pk=slow.pk).current_replicas == 1
