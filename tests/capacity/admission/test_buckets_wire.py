"""Buckets' own connection (capacity.admission.redis_buckets._Wire: the decision's EVALSHA packed
and its reply read at the protocol level, on a connection redis-py makes): what redis-py
guaranteed before still holds against the real Redis. A connection Redis closed fails one call
with a RedisError (what the gate's local fallback catches) and is made again for the next; a
script Redis lost is loaded again; the URL's user and password are used; a silent server is a
TimeoutError within the socket timeout; a script's error reply is a ResponseError."""

import socket
import threading
import time
import uuid

import pytest
import redis
from django.conf import settings

from capacity.admission.redis_buckets import Buckets
from capacity.admission.redis_layout import ADMIT_LUA, GUARANTEED
from tests.support.admission import set_rates

from .conftest import MODEL_ID, sync_buckets


def _decide(buckets: Buckets, customer: int, request_id: str | None = None):
    return buckets.admit(
        customer_id=customer, model_id=MODEL_ID, cost_mu=1.0, request_id=request_id
    )


def test_a_connection_redis_closed_fails_one_call_and_is_made_again(customer):
    name = f"wire-test-{uuid.uuid4().hex[:8]}"
    buckets = sync_buckets(client_name=name)
    set_rates(buckets, {(customer, MODEL_ID): (600.0, 0.0)}, ttl_s=600)
    assert _decide(buckets, customer, "before").admission_class == GUARANTEED
    admin = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    mine = [c["id"] for c in admin.client_list() if c.get("name") == name]
    assert mine  # the decision's connection carries the client's name (redis-py's handshake)
    for connection_id in mine:
        admin.client_kill_filter(_id=connection_id)

    # The killed connection's call fails as redis-py's did (the gate decides it locally);
    # it is never retried, since Redis may have taken a decision whose reply was lost.
    with pytest.raises(redis.ConnectionError):
        _decide(buckets, customer, "lost")
    assert _decide(buckets, customer, "after").admission_class == GUARANTEED
    records = buckets.records([(customer, MODEL_ID, "before"), (customer, MODEL_ID, "after")])
    assert [r.admission_class for r in records] == [GUARANTEED, GUARANTEED]


def test_a_script_redis_does_not_hold_is_loaded_and_the_decision_taken(customer):
    buckets = sync_buckets()
    set_rates(buckets, {(customer, MODEL_ID): (600.0, 0.0)}, ttl_s=600)
    # The same script under a SHA Redis has never seen (no SCRIPT FLUSH on a shared server).
    buckets._admit = buckets.client.register_script(ADMIT_LUA + f"\n-- {uuid.uuid4()}\n")
    assert not buckets.client.script_exists(buckets._admit.sha)[0]
    assert _decide(buckets, customer, "reloaded").admission_class == GUARANTEED
    assert buckets.client.script_exists(buckets._admit.sha)[0]


def test_the_urls_username_and_password_are_used(customer, redis_user):
    password, url = redis_user
    assert _decide(sync_buckets(url(password)), customer).admission_class == GUARANTEED
    with pytest.raises(redis.AuthenticationError):  # refused by AUTH: nothing is decided
        _decide(sync_buckets(url("wrong-" + password)), customer)


def test_a_silent_server_is_a_timeout_error_within_the_socket_timeout():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    port = server.getsockname()[1]
    buckets = Buckets(
        # The handshake itself would wait for the silent server: no database, no password.
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.3, socket_connect_timeout=0.3),
        burst_seconds=10,
        idle_ttl_seconds=600,
        record_ttl_s=3600,
    )
    started = time.monotonic()
    try:
        with pytest.raises(redis.TimeoutError):
            _decide(buckets, 1)
        assert time.monotonic() - started < 1.5
    finally:
        server.close()
        for connection in accepted:
            connection.close()


def test_an_error_reply_is_a_response_error_and_the_connection_stays_usable(customer):
    buckets = sync_buckets()
    set_rates(buckets, {(customer, MODEL_ID): (600.0, 0.0)}, ttl_s=600)
    assert _decide(buckets, customer).admission_class == GUARANTEED
    # The guaranteed bucket's key holding a hash (another writer's bug): the script's GET of
    # it fails in Redis with WRONGTYPE, and says so.
    bucket_key = f"adm:g:{MODEL_ID}:{customer}"
    buckets.client.delete(bucket_key)
    buckets.client.hset(bucket_key, "not", "a tat")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        _decide(buckets, customer)
    buckets.client.delete(bucket_key)
    assert _decide(buckets, customer).admission_class == GUARANTEED
