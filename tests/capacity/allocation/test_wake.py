"""Wake-ups of the tick (capacity/allocation/wake.py), against the real Redis broker."""

import redis
from django.conf import settings

from capacity.allocation.wake import DEBOUNCE_KEY, request_tick


def _queued_ticks(client) -> int:
    # Celery's Redis transport keeps a queue as a list named after it.
    return client.llen("allocation")


def test_a_storm_of_wake_ups_queues_one_tick_but_newly_ready_replicas_always_queue_one():
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    client.delete("allocation", DEBOUNCE_KEY)
    try:
        assert request_tick(reason="requests waiting for llama-8b") is True
        # The gateways' holds ask every second per model: within the second, one tick.
        assert request_tick(reason="requests waiting for llama-8b") is False
        assert _queued_ticks(client) == 1
        # Replicas became ready a moment after a gateway's wake-up: the allowances that let
        # the held requests through must not wait for the beat's next tick.
        assert request_tick(reason="ready replicas changed", debounce=False) is True
        assert _queued_ticks(client) == 2
    finally:
        client.delete("allocation", DEBOUNCE_KEY)
