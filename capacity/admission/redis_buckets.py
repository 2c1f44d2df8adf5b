"""Admission buckets in Redis: GCRA for a guaranteed and a best-effort bucket per (customer,
model), one atomic round trip per decision (a Lua script), time from Redis's `TIME`.

GCRA keeps one number per bucket, its theoretical arrival time (TAT, ms). A bucket with rate
`r` MU/min spends `T = 60,000 / r` ms per MU and tolerates `burst_seconds` of rate ahead of
time: a request of `c` MU is admitted when `max(TAT, now) + c·T − burst ≤ now`, which bounds
what a bucket admits over any interval t to `r·t + burst` (+ one request: a request larger
than the whole burst is admitted when the bucket is full, and puts it in debt). The script
tries the guaranteed bucket, then the best-effort one, and records the admitted class and MU
under the request id so that the request's usage event can settle the difference later
(`reconcile`).

Limits (MU/min) live in Redis too, in a hash per (customer, model) that every allocation tick
rewrites and that expires when ticks stop giving it, so departed tenants leave nothing behind.
Every key carries a TTL.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from redis.exceptions import NoScriptError

try:  # redis[hiredis]: RESP packed in C (redis.asyncio packs in Python, 7x slower)
    from hiredis import pack_command as _pack
except ImportError:  # pragma: no cover - hiredis is a dependency
    _pack = None

GUARANTEED, BEST_EFFORT, REFUSED = "guaranteed", "best_effort", "refused"
# Recorded (never answered) for a refusal of a customer that holds a reservation.
REFUSED_GUARANTEED = "refused_guaranteed"
PREFIX = "adm"

# The one bucket rule (capacity.admission.bucket.take) in Lua, since a script cannot call Python:
# the bucket's TAT lives at `key`. Kept as its own text so that the rule's property test
# (tests/capacity/admission/test_bucket_rule.py) runs these very lines with a chosen clock.
GCRA_LUA = """
local function gcra_take(key, rate, now, cost, burst_ms, ttl_ms)
  if rate == nil or rate <= 0 then return false, -1 end
  local per_mu = 60000 / rate
  local tat = tonumber(redis.call('GET', key)) or now
  if tat < now then tat = now end
  local new_tat = tat + cost * per_mu
  -- A request larger than the whole burst is admitted when the bucket is full.
  local allow_at = math.min(new_tat - burst_ms, tat)
  if allow_at <= now then
    redis.call('SET', key, tostring(new_tat), 'PX', math.floor(new_tat - now + ttl_ms))
    return true, 0
  end
  return false, allow_at - now
end
"""

# KEYS: limits hash, guaranteed TAT, best-effort TAT, request record (or "" for none)
# ARGV: cost MU, burst seconds, bucket TTL ms, record TTL s
#
# The record ("<class>:<estimated MU>", then ":s" once settled) is what later decides the
# class its usage event is billed in; the latest decision for a request id is the one kept.
_ADMIT = (
    GCRA_LUA
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local limits = redis.call('HMGET', KEYS[1], 'g', 'be')
local cost = tonumber(ARGV[1])
local burst_ms = tonumber(ARGV[2]) * 1000
local ttl_ms = tonumber(ARGV[3])
local g = tonumber(limits[1])
local be = tonumber(limits[2])

local function try(key, rate)
  return gcra_take(key, rate, now, cost, burst_ms, ttl_ms)
end

local ok, g_wait = try(KEYS[2], g)
local class = 'guaranteed'
local wait = 0
if not ok then
  local ok_be, be_wait = try(KEYS[3], be)
  if ok_be then
    class = 'best_effort'
  else
    class = 'refused'
    if g_wait < 0 then wait = be_wait
    elseif be_wait < 0 then wait = g_wait
    else wait = math.min(g_wait, be_wait) end
  end
end
if KEYS[4] ~= '' then
  local recorded = class
  -- A refusal of a customer that holds a reservation is a refused *guaranteed* request: the
  -- one kind that can earn an SLA credit.
  if class == 'refused' and g ~= nil and g > 0 then recorded = 'refused_guaranteed' end
  redis.call('SET', KEYS[4], recorded .. ':' .. ARGV[1], 'EX', tonumber(ARGV[4]))
end
return {class, tostring(wait), tostring(g or -1), tostring(be or -1)}
"""
)

# KEYS: request record, guaranteed TAT, best-effort TAT, limits hash
# ARGV: actual MU, bucket TTL ms
# The record stays (marked settled) for the whole usage lateness window: the usage event's
# class is read from it, and a second event with the same id must not settle again.
_RECONCILE = """
local record = redis.call('GET', KEYS[1])
if not record then return {'', '0'} end
if string.sub(record, -2) == ':s' then return {'', '0'} end
redis.call('SET', KEYS[1], record .. ':s', 'KEEPTTL')
local sep = string.find(record, ':')
local class = string.sub(record, 1, sep - 1)
if class ~= 'guaranteed' and class ~= 'best_effort' then return {class, '0'} end
local estimate = tonumber(string.sub(record, sep + 1))
local delta = tonumber(ARGV[1]) - estimate
local key, field = KEYS[2], 'g'
if class == 'best_effort' then key, field = KEYS[3], 'be' end
local rate = tonumber(redis.call('HGET', KEYS[4], field))
if rate == nil or rate <= 0 then return {class, tostring(delta)} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local tat = tonumber(redis.call('GET', key)) or now
if tat < now then tat = now end
-- A refund never lifts the bucket above full (TAT below now).
local new_tat = math.max(now, tat + delta * 60000 / rate)
redis.call('SET', key, tostring(new_tat), 'PX', math.floor(new_tat - now + tonumber(ARGV[2])))
return {class, tostring(delta)}
"""


@dataclass(frozen=True)
class BucketDecision:
    admission_class: str  # GUARANTEED, BEST_EFFORT or REFUSED
    retry_after_ms: float  # 0 when admitted; -1: never at the current limits
    guaranteed_mu_per_minute: float
    best_effort_mu_per_minute: float


def limits_key(customer_id: int, model_id: int) -> str:
    return f"{PREFIX}:lim:{model_id}:{customer_id}"


def _bucket_key(customer_id: int, model_id: int, admission_class: str) -> str:
    return f"{PREFIX}:{'g' if admission_class == GUARANTEED else 'be'}:{model_id}:{customer_id}"


def _record_key(customer_id: int, model_id: int, request_id: str) -> str:
    return f"{PREFIX}:req:{model_id}:{customer_id}:{request_id}"


# What an admission record says about its request (the first part of the stored value).
RECORD_CLASSES = frozenset({GUARANTEED, BEST_EFFORT, REFUSED_GUARANTEED, REFUSED})


@dataclass(frozen=True)
class AdmissionRecord:
    admission_class: str  # one of RECORD_CLASSES
    estimated_mu: float
    spooled: bool = False  # from the Redis-down fallback's spool, not from Redis

    @property
    def admitted(self) -> bool:
        return self.admission_class in (GUARANTEED, BEST_EFFORT)


def parse_record(raw: bytes | str | None) -> AdmissionRecord | None:
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    parts = text.split(":")
    if len(parts) < 2 or parts[0] not in RECORD_CLASSES:
        return None
    try:
        return AdmissionRecord(parts[0], float(parts[1]))
    except ValueError:
        return None


def _admit_keys_and_args(
    buckets: Buckets | AsyncBuckets,
    customer_id: int,
    model_id: int,
    cost_mu: float,
    request_id: str | None,
) -> tuple[list[str], list[Any]]:
    keys = [
        limits_key(customer_id, model_id),
        _bucket_key(customer_id, model_id, GUARANTEED),
        _bucket_key(customer_id, model_id, BEST_EFFORT),
        _record_key(customer_id, model_id, request_id) if request_id else "",
    ]
    args = [repr(float(cost_mu)), buckets.burst_seconds, buckets.idle_ttl_ms, buckets.record_ttl_s]
    return keys, args


def _decision(reply: Any) -> BucketDecision:
    admission_class, wait, guaranteed, best_effort = reply
    return BucketDecision(
        admission_class=admission_class.decode(),
        retry_after_ms=float(wait),
        guaranteed_mu_per_minute=max(0.0, float(guaranteed)),
        best_effort_mu_per_minute=max(0.0, float(best_effort)),
    )


class Buckets:
    """The Redis side of admission. Raises redis.RedisError when Redis cannot be reached."""

    def __init__(self, client, *, burst_seconds: float, idle_ttl_seconds: float, record_ttl_s: int):
        self.client = client
        self.burst_seconds = burst_seconds
        self.idle_ttl_ms = int(idle_ttl_seconds * 1000)
        self.record_ttl_s = record_ttl_s
        self._local = threading.local()
        self._admit = client.register_script(_ADMIT)
        self._reconcile = client.register_script(_RECONCILE)

    def _evalsha(self, script, keys: list[str], args: list):
        """EVALSHA on this thread's own connection: a decision is one round trip, and the
        pool's checkout and the client's command machinery would cost as much as Redis does."""
        connection = getattr(self._local, "connection", None)
        if connection is None:
            pool = self.client.connection_pool
            connection = pool.connection_class(**pool.connection_kwargs)
            self._local.connection = connection
        for attempt in (1, 2):
            try:
                connection.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
                return connection.read_response()
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                self.client.script_load(script.script)  # Redis restarted or flushed its scripts
            except redis.RedisError:
                connection.disconnect()
                raise
        raise AssertionError("unreachable")

    def admit(
        self, *, customer_id: int, model_id: int, cost_mu: float, request_id: str | None
    ) -> BucketDecision:
        keys, args = _admit_keys_and_args(self, customer_id, model_id, cost_mu, request_id)
        return _decision(self._evalsha(self._admit, keys, args))

    def reconcile(
        self, *, customer_id: int, model_id: int, request_id: str, actual_mu: float, pipe=None
    ):
        """Settle an admitted request's estimate against what it used (once; a request
        without a record, or settled already, changes nothing)."""
        keys = [
            _record_key(customer_id, model_id, request_id),
            _bucket_key(customer_id, model_id, GUARANTEED),
            _bucket_key(customer_id, model_id, BEST_EFFORT),
            limits_key(customer_id, model_id),
        ]
        return self._reconcile(
            keys=keys, args=[repr(float(actual_mu)), self.idle_ttl_ms], client=pipe
        )

    def records(self, requests: list[tuple[int, int, str]]) -> list[AdmissionRecord | None]:
        """The admission records of (customer id, model id, request id)s, in one round trip."""
        if not requests:
            return []
        raw = self.client.mget([_record_key(c, m, r) for c, m, r in requests])
        return [parse_record(value) for value in raw]

    def publish_limits(self, limits: dict[tuple[int, int], tuple[float, float]], ttl_s: int):
        """Write every (customer, model)'s (guaranteed, best-effort) MU/min, each with a TTL."""
        pipe = self.client.pipeline(transaction=False)
        for (customer_id, model_id), (guaranteed, best_effort) in limits.items():
            key = limits_key(customer_id, model_id)
            pipe.hset(key, mapping={"g": repr(guaranteed), "be": repr(best_effort)})
            pipe.expire(key, ttl_s)
        pipe.execute()

    def forget_limits(self, keys: list[tuple[int, int]]) -> None:
        if keys:
            self.client.delete(*(limits_key(c, m) for c, m in keys))


Orphaned = Callable[[BucketDecision | BaseException], None] | None


class AsyncBuckets:
    """`Buckets.admit` for an asyncio event loop (redis.asyncio): the same script, one EVALSHA
    per decision, on one connection of its own. Decisions asked for while a round trip is under
    way are pipelined together in the next one, so under load a round trip carries many
    decisions (one write and one read for all of them) and never blocks the loop.

    `submit` queues a decision and returns its future; `admit` awaits it. A caller cancelled
    while it waits cancels the future, not the decision (Redis takes and records it all the
    same): `orphaned`, when given, is then called with it (or with the RedisError). The future
    raises redis.RedisError when Redis does not answer within `timeout_seconds`."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        burst_seconds: float,
        idle_ttl_seconds: float,
        record_ttl_s: int,
        timeout_seconds: float,
    ):
        self.client = client
        self.burst_seconds = burst_seconds
        self.idle_ttl_ms = int(idle_ttl_seconds * 1000)
        self.record_ttl_s = record_ttl_s
        self.timeout_seconds = timeout_seconds
        self._script = client.register_script(_ADMIT)
        self._queue: list[tuple[tuple[Any, ...], asyncio.Future[BucketDecision], Orphaned]] = []
        self._sender: asyncio.Task[None] | None = None
        self._connection: redis.asyncio.connection.AbstractConnection | None = None

    def submit(
        self,
        *,
        customer_id: int,
        model_id: int,
        cost_mu: float,
        request_id: str | None,
        orphaned: Orphaned = None,
    ) -> asyncio.Future[BucketDecision]:
        keys, args = _admit_keys_and_args(self, customer_id, model_id, cost_mu, request_id)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[BucketDecision] = loop.create_future()
        command = ("EVALSHA", self._script.sha, len(keys), *keys, *args)
        self._queue.append((command, future, orphaned))
        if self._sender is None:
            self._sender = loop.create_task(self._send())
        return future

    async def admit(
        self, *, customer_id: int, model_id: int, cost_mu: float, request_id: str | None
    ) -> BucketDecision:
        return await self.submit(
            customer_id=customer_id, model_id=model_id, cost_mu=cost_mu, request_id=request_id
        )

    async def close(self) -> None:
        if self._sender is not None:
            await asyncio.gather(self._sender, return_exceptions=True)
        if self._connection is not None:
            await self._connection.disconnect()
            self._connection = None

    async def _send(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    replies: list[Any] = await self._round_trip([item[0] for item in batch])
                except redis.RedisError as error:
                    replies = [type(error)(*error.args) for _ in batch]
                for (_, future, orphaned), reply in zip(batch, replies, strict=True):
                    outcome: BucketDecision | BaseException
                    if isinstance(reply, BaseException):
                        outcome = reply
                    else:
                        try:
                            outcome = _decision(reply)
                        except (ValueError, TypeError, AttributeError) as error:
                            outcome = redis.ResponseError(f"bad reply: {error}")
                    if future.done():  # its caller was cancelled
                        if orphaned is not None:
                            orphaned(outcome)
                    elif isinstance(outcome, BaseException):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)
        finally:
            self._sender = None

    async def _round_trip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        connection = self._connection
        if connection is None:
            pool = self.client.connection_pool
            # No per-command timeout: the whole round trip has one (below), cheaper than two
            # timers per command.
            kwargs = {**pool.connection_kwargs, "socket_timeout": None}
            connection = pool.connection_class(**kwargs)
            self._connection = connection
        try:
            async with asyncio.timeout(self.timeout_seconds):
                replies = await self._pipelined(connection, commands)
                missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
                if missing:  # Redis restarted or flushed its scripts
                    await connection.send_command("SCRIPT", "LOAD", self._script.script)
                    await connection.read_response()
                    again = await self._pipelined(connection, [commands[i] for i in missing])
                    for i, reply in zip(missing, again, strict=True):
                        replies[i] = reply
                return replies
        except TimeoutError:
            await connection.disconnect(nowait=True)
            raise redis.TimeoutError(
                f"Redis did not answer within {self.timeout_seconds:g} s"
            ) from None
        except OSError as error:
            await connection.disconnect(nowait=True)
            raise redis.ConnectionError(str(error)) from None

    @staticmethod
    async def _pipelined(
        connection: redis.asyncio.connection.AbstractConnection, commands: list[tuple[Any, ...]]
    ) -> list[Any]:
        if _pack is not None:  # hiredis's packer, as the synchronous client uses: the same bytes
            packed: Any = b"".join([_pack(command) for command in commands])
        else:
            packed = connection.pack_commands(commands)
        await connection.send_packed_command(packed, check_health=False)
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await connection.read_response())
            except redis.ResponseError as error:  # this command's own error reply
                replies.append(error)
        return replies
