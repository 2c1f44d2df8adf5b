"""AsyncBuckets (the gateway's admission, redis.asyncio): the same script as Buckets, so the same
decisions and records; decisions asked for together share a round trip; a script Redis lost is
loaded again; a Redis that is down or silent is a RedisError within the timeout."""

import asyncio
import socket
import threading
import time
import uuid

import pytest
import redis
import redis.asyncio
from django.conf import settings

from capacity.admission.redis_async import ADMISSION_CONNECTION_NAME, AsyncBuckets
from capacity.admission.redis_layout import ADMIT_LUA, GUARANTEED, REFUSED, limits_key
from tests.support.admission import set_rates

from .conftest import MODEL_ID, sync_buckets


def _async_buckets(url: str | None = None, timeout_seconds: float = 0.5) -> AsyncBuckets:
    return AsyncBuckets(
        redis.asyncio.Redis.from_url(url or settings.ADMISSION_REDIS_URL),
        burst_seconds=10,
        idle_ttl_seconds=600,
        record_ttl_s=3600,
        timeout_seconds=timeout_seconds,
    )


def test_decisions_asked_together_are_the_scripts_own_and_recorded(customer):
    # 60 MU/min with a 10 s burst: 10 MU admitted at once, then refused.
    sync = sync_buckets()
    set_rates(sync, {(customer, MODEL_ID): (60.0, 0.0)}, ttl_s=600)

    async def ask():
        buckets = _async_buckets()
        try:
            return await asyncio.gather(
                *(
                    buckets.admit(
                        customer_id=customer, model_id=MODEL_ID, cost_mu=1.0, request_id=f"r{i}"
                    )
                    for i in range(15)
                )
            )
        finally:
            await buckets.close()

    decisions = asyncio.run(ask())

    assert [d.admission_class for d in decisions] == [GUARANTEED] * 10 + [REFUSED] * 5
    assert all(d.guaranteed_mu_per_minute == 60.0 for d in decisions)
    assert decisions[-1].retry_after_ms > 0
    records = sync.records([(customer, MODEL_ID, f"r{i}") for i in (0, 9, 10)])
    assert [(r.admission_class, r.estimated_mu) for r in records] == [
        ("guaranteed", 1.0),
        ("guaranteed", 1.0),
        ("refused_guaranteed", 1.0),
    ]
    # The synchronous client sees the same bucket: empty.
    again = sync.admit(customer_id=customer, model_id=MODEL_ID, cost_mu=1.0, request_id=None)
    assert again.admission_class == REFUSED


def test_a_script_redis_does_not_hold_is_loaded_and_the_decision_taken(customer):
    set_rates(sync_buckets(), {(customer, MODEL_ID): (600.0, 0.0)}, ttl_s=600)

    async def ask():
        buckets = _async_buckets()
        # The same script under a SHA Redis has never seen (no SCRIPT FLUSH on a shared server).
        buckets._script = buckets.client.register_script(ADMIT_LUA + f"\n-- {uuid.uuid4()}\n")
        try:
            return await asyncio.gather(
                *(
                    buckets.admit(
                        customer_id=customer, model_id=MODEL_ID, cost_mu=1.0, request_id=None
                    )
                    for _ in range(3)
                )
            )
        finally:
            await buckets.close()

    assert [d.admission_class for d in asyncio.run(ask())] == [GUARANTEED] * 3
    assert redis.Redis.from_url(settings.ADMISSION_REDIS_URL).exists(limits_key(customer, MODEL_ID))


def _silent_server():
    """A TCP server that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted = []

    def accept():
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, accepted


def test_redis_down_or_silent_is_a_redis_error_within_the_timeout():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed_port = unused.getsockname()[1]
    server, accepted = _silent_server()
    silent_port = server.getsockname()[1]

    async def ask(url):
        buckets = _async_buckets(url, timeout_seconds=0.2)
        started = time.monotonic()
        try:
            with pytest.raises(redis.RedisError):
                await buckets.admit(customer_id=1, model_id=MODEL_ID, cost_mu=1.0, request_id="x")
            return time.monotonic() - started
        finally:
            await buckets.close()

    try:
        assert asyncio.run(ask(f"redis://127.0.0.1:{closed_port}/0")) < 0.5
        assert asyncio.run(ask(f"redis://127.0.0.1:{silent_port}/0")) < 0.5
    finally:
        server.close()
        for connection in accepted:
            connection.close()


def test_a_caller_cancelled_while_redis_decides_gets_the_decision_through_orphaned(customer):
    set_rates(sync_buckets(), {(customer, MODEL_ID): (600.0, 0.0)}, ttl_s=600)

    async def ask():
        buckets = _async_buckets()
        seen = []
        try:
            waiting = asyncio.ensure_future(
                buckets.admit(customer_id=customer, model_id=MODEL_ID, cost_mu=1.0, request_id="x")
            )
            pending = buckets.submit(
                customer_id=customer,
                model_id=MODEL_ID,
                cost_mu=1.0,
                request_id="gone",
                orphaned=seen.append,
            )
            pending.cancel()  # as a cancelled caller's await does
            await waiting
            return seen
        finally:
            await buckets.close()

    (decision,) = asyncio.run(ask())
    assert decision.admission_class == GUARANTEED
    (record,) = sync_buckets().records([(customer, MODEL_ID, "gone")])
    assert record.admission_class == GUARANTEED


def test_commands_are_packed_to_the_bytes_redis_py_packs():
    from capacity.admission.redis_async import _pack
    from capacity.admission.redis_layout import admit_keys_and_args

    buckets = _async_buckets()
    connection = buckets.client.connection_pool.connection_class(
        **buckets.client.connection_pool.connection_kwargs
    )
    for cost in (0.0123, 1e-9, 12345.678, 3.0):
        keys, args = admit_keys_and_args(buckets, 7, 9, cost, "gw-" + "a" * 32)
        command = ("EVALSHA", buckets._script.sha, len(keys), *keys, *args)
        assert _pack(command) == b"".join(connection.pack_command(*command))


def _admission_connection_ids(client: redis.Redis) -> list[int]:
    return [c["id"] for c in client.client_list() if c.get("name") == ADMISSION_CONNECTION_NAME]


def test_a_connection_redis_closed_is_made_again_for_the_next_decision(customer):
    sync = sync_buckets()
    set_rates(sync, {(customer, MODEL_ID): (600.0, 0.0)}, ttl_s=600)

    async def ask():
        buckets = _async_buckets()
        try:
            first = await buckets.admit(
                customer_id=customer, model_id=MODEL_ID, cost_mu=1.0, request_id="before"
            )
            mine = set(_admission_connection_ids(sync.client))
            for connection_id in mine:
                sync.client.client_kill_filter(_id=connection_id)
            await asyncio.sleep(0.2)  # the close reaches the loop
            second = await buckets.admit(
                customer_id=customer, model_id=MODEL_ID, cost_mu=1.0, request_id="after"
            )
            return first, second, mine
        finally:
            await buckets.close()

    first, second, killed = asyncio.run(ask())
    assert killed  # the connection is named in CLIENT LIST
    assert (first.admission_class, second.admission_class) == (GUARANTEED, GUARANTEED)
    records = sync.records([(customer, MODEL_ID, "before"), (customer, MODEL_ID, "after")])
    assert [r.admission_class for r in records] == [GUARANTEED, GUARANTEED]


def test_the_urls_username_and_password_are_used(customer, redis_user):
    password, url = redis_user

    async def ask(secret):
        buckets = _async_buckets(url(secret))
        try:
            return await buckets.admit(
                customer_id=customer, model_id=MODEL_ID, cost_mu=1.0, request_id=None
            )
        finally:
            await buckets.close()

    assert asyncio.run(ask(password)).admission_class == GUARANTEED
    with pytest.raises(redis.RedisError):  # refused by AUTH: nothing is decided
        asyncio.run(ask("wrong-" + password))
