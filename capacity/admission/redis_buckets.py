"""The control plane's client of the admission store (capacity.admission.redis_layout): one
EVALSHA per decision on a connection of each thread's own, spoken to at the protocol level, and
the writes of what admission decides by (limits, floors, request limits, the tick's
heartbeat)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import redis

# redis[hiredis]: RESP packed and parsed in C (redis-py packs in Python, 7x slower).
from hiredis import HiredisError, Reader
from hiredis import pack_command as _pack
from redis.exceptions import NoScriptError

from capacity.admission.bucket import Floor
from capacity.admission.redis_layout import (
    ADMIT_LUA,
    BEST_EFFORT,
    GUARANTEED,
    LIMITS_FRESH_KEY,
    LIMITS_TICK_KEY,
    OPEN_REQUESTS_KEY,
    PUBLISH_LIMITS_CHUNK,
    PUBLISH_LIMITS_LUA,
    RECONCILE_LUA,
    RELEASE_LUA,
    REQUEST_LIMITS_INDEX,
    TICK_HEARTBEAT_LUA,
    AdmissionRecord,
    BucketDecision,
    DecisionParameters,
    admit_keys_and_args,
    bucket_key,
    decision_of,
    floor_key,
    in_flight_keys,
    limits_key,
    limits_refresh_seconds,
    open_member,
    parse_record,
    queue_floors,
    queue_request_limits,
    record_key,
    reply_error,
)

log = logging.getLogger(__name__)


class _Wire:
    """One thread's connection for Buckets' scripts, spoken to at the protocol level: the
    command packed by hiredis, written with one sendall, the reply read into a hiredis Reader.
    redis-py's Connection still makes the connection (host and port, a Unix socket or TLS, its
    timeouts, AUTH and SELECT), but its command and reply machinery cost a decision about as
    much as Redis's own work on it (bench_admission)."""

    def __init__(self, pool: redis.ConnectionPool):
        self.connection = pool.connection_class(**pool.connection_kwargs)
        self.socket: Any = None  # set on connecting, with a Reader of its own
        self.reader: Reader | None = None

    def call(self, command: tuple[Any, ...]) -> Any:
        """The command's reply; an error reply raised as redis-py raises it, and a connection
        that failed, timed out or answered what cannot be read closed and raised as a
        redis.ConnectionError or TimeoutError (the next call connects again)."""
        sock, reader = self.socket, self.reader
        if sock is None or reader is None:
            self.connection.connect()  # its handshake is answered within
            sock = self.socket = self.connection._sock
            reader = self.reader = Reader(replyError=reply_error)
        try:
            sock.sendall(_pack(command))
            while (reply := reader.gets()) is False:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionResetError("closed by the server")
                reader.feed(data)
        except TimeoutError:  # socket.timeout
            self.close()
            raise redis.TimeoutError("Redis did not answer within the socket timeout") from None
        except (OSError, HiredisError) as error:
            self.close()
            raise redis.ConnectionError(f"the connection to Redis failed: {error}") from error
        if isinstance(reply, redis.ResponseError):
            raise reply
        return reply

    def close(self) -> None:
        self.socket = self.reader = None
        self.connection.disconnect()


class Buckets(DecisionParameters):
    """The Redis side of admission. Raises redis.RedisError when Redis cannot be reached.
    The parameters are DecisionParameters'."""

    def __init__(self, client: Any, **parameters: Any):
        super().__init__(**parameters)
        self.client = client
        self._local = threading.local()
        self._admit = client.register_script(ADMIT_LUA)
        self._reconcile = client.register_script(RECONCILE_LUA)
        self._release = client.register_script(RELEASE_LUA)
        self._publish_limits = client.register_script(PUBLISH_LIMITS_LUA)
        self._tick_heartbeat = client.register_script(TICK_HEARTBEAT_LUA)

    def _evalsha(self, script, keys: list[str], args: list):
        """EVALSHA on this thread's own connection: a decision is one round trip, and the
        pool's checkout and the client's command machinery would cost as much as Redis does."""
        wire = getattr(self._local, "wire", None)
        if wire is None:
            wire = self._local.wire = _Wire(self.client.connection_pool)
        for attempt in (1, 2):
            try:
                return wire.call(("EVALSHA", script.sha, len(keys), *keys, *args))
            except NoScriptError:
                if attempt == 2:
                    raise
                self.client.script_load(script.script)  # Redis restarted or flushed its scripts
        raise AssertionError("unreachable")

    def admit(
        self,
        *,
        customer_id: int,
        model_id: int,
        cost_mu: float,
        request_id: str | None,
        tokens: int = 0,
        api_key_prefix: str | None = None,
        shed: bool = False,
        owner: str = "",
    ) -> BucketDecision:
        """Decide a request of `cost_mu` MU and `tokens` tokens (what TPM counts) under the
        customer's MU buckets and request limits, and the key's when `api_key_prefix` names
        one: one round trip. `shed`: the model's degradation refuses this customer's
        best-effort traffic; `owner`: the gateway worker answering the request."""
        keys, args = admit_keys_and_args(
            self, customer_id, model_id, cost_mu, request_id, tokens, api_key_prefix, shed, owner
        )
        return decision_of(self._evalsha(self._admit, keys, args), cost_mu)

    def reconcile(
        self,
        *,
        customer_id: int,
        model_id: int,
        request_id: str,
        actual_mu: float,
        api_key_prefix: str | None = None,
        pipe=None,
    ):
        """Settle an admitted request's estimate against what it used (once; a request
        without a record, or settled already, changes nothing), and free its slot in flight."""
        keys = [
            record_key(customer_id, model_id, request_id),
            bucket_key(customer_id, model_id, GUARANTEED),
            bucket_key(customer_id, model_id, BEST_EFFORT),
            limits_key(customer_id, model_id),
            *in_flight_keys(customer_id, api_key_prefix),
            floor_key(customer_id, model_id),
            OPEN_REQUESTS_KEY,
        ]
        return self._reconcile(
            keys=keys,
            args=[
                repr(float(actual_mu)),
                self.idle_ttl_ms,
                request_id,
                open_member(customer_id, model_id, request_id),
            ],
            client=pipe,
        )

    def release(self, *, customer_id: int, request_id: str, api_key_prefix: str | None = None):
        """Free the concurrency slot a request holds (its end); freeing one not held is a
        no-op."""
        return self._evalsha(
            self._release, [], [request_id, *in_flight_keys(customer_id, api_key_prefix)]
        )

    def records(self, requests: list[tuple[int, int, str]]) -> list[AdmissionRecord | None]:
        """The admission records of (customer id, model id, request id)s, in one round trip."""
        if not requests:
            return []
        raw = self.client.mget([record_key(c, m, r) for c, m, r in requests])
        return [parse_record(value) for value in raw]

    def publish_limits(
        self,
        limits: dict[tuple[int, int], float],
        ttl_s: int,
        *,
        changed: Collection[tuple[int, int]] | None = None,
    ) -> int:
        """Write (customer, model)'s best-effort MU/min, each with a TTL, then the tick's
        heartbeat (the allowances are as fresh as it); returns how many pairs were written.

        `changed`: the pairs whose limits moved since the last publication (the tick's stored
        allowances). While a whole publication is fresh (LIMITS_FRESH_KEY), only those are
        written: tens of thousands of stable pairs rewritten every 15 s were a tenth of the
        tick. Otherwise, or without `changed`, every pair is written and the marker set again,
        so a Redis that lost its data, or a pair a failed publication missed, is whole again
        within limits_refresh_seconds.

        The chunks are pipelined on one connection, their replies read after the last is sent:
        Redis runs a chunk while the next is built and packed (tens of thousands of pairs a
        tick, whose building cost as much as Redis's writing them)."""
        whole = changed is None or not self.client.exists(LIMITS_FRESH_KEY)
        if whole:
            items = list(limits.items())
        else:
            items = [(pair, limits[pair]) for pair in changed if pair in limits]
        try:
            self._write_limits(items, ttl_s)
        except BaseException:
            # Some pairs may be unwritten: the next tick writes them all.
            with contextlib.suppress(redis.RedisError):
                self.client.delete(LIMITS_FRESH_KEY)
            raise
        if whole:
            self.client.set(LIMITS_FRESH_KEY, "1", ex=limits_refresh_seconds(ttl_s))
        self._tick_heartbeat(keys=[LIMITS_TICK_KEY])
        return len(items)

    def _write_limits(self, items: list, ttl_s: int) -> None:
        if not items:
            return
        script = self._publish_limits
        # Loaded first (idempotent), so that no chunk's EVALSHA meets a flushed script cache.
        self.client.script_load(script.script)
        pool = self.client.connection_pool
        connection = pool.get_connection()
        try:
            sent = 0
            for start in range(0, len(items), PUBLISH_LIMITS_CHUNK):
                chunk = items[start : start + PUBLISH_LIMITS_CHUNK]
                args: list = [int(ttl_s)]
                for _, best_effort in chunk:
                    args.append(repr(float(best_effort)))
                keys = [limits_key(c, m) for (c, m), _ in chunk]
                connection.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
                sent += 1
            for _ in range(sent):
                connection.read_response()
        except BaseException:
            # Replies may be left unread: the connection is not reused.
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

    def publish_floors(
        self, floors: Mapping[tuple[int, int], Floor], *, pairs: Collection[tuple[int, int]]
    ) -> None:
        """Make the reservation floors of `pairs` exactly `floors` in one transaction (the
        control plane writes them with its gateway publication: capacity.publication)."""
        pipe = self.client.pipeline(transaction=True)
        queue_floors(pipe, floors, idle_ttl_ms=self.idle_ttl_ms, pairs=pairs)
        pipe.execute()

    def open_requests(self, *, decided_before_ms: float, count: int) -> list[tuple[str, float]]:
        """Open requests (decided, no usage event yet) decided before the moment, oldest first:
        (member, decided at ms)."""
        rows = self.client.zrangebyscore(
            OPEN_REQUESTS_KEY, "-inf", decided_before_ms, start=0, num=count, withscores=True
        )
        return [(m.decode() if isinstance(m, bytes) else m, float(at)) for m, at in rows]

    def close_open(self, members: Iterable[str]) -> None:
        members = list(members)
        if members:
            self.client.zrem(OPEN_REQUESTS_KEY, *members)

    def forget_limits(self, keys: list[tuple[int, int]]) -> None:
        if keys:
            self.client.delete(*(limits_key(c, m) for c, m in keys))

    def publish_request_limits(self, limits: Mapping[str, Mapping[str, int]]) -> None:
        """Make the published request limits exactly `limits`, in one transaction (the
        control plane publishes them with the gateway documents, capacity.publication)."""
        previous = self.client.smembers(REQUEST_LIMITS_INDEX)
        pipe = self.client.pipeline(transaction=True)
        queue_request_limits(pipe, limits, previous)
        pipe.execute()
