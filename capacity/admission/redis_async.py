"""The gateway's client of the admission store (capacity.admission.redis_layout): `Buckets.admit`
for an asyncio event loop, the decisions asked while a round trip is under way pipelined into
the next one on one connection of its own."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

# redis[hiredis]: RESP packed and parsed in C (redis.asyncio packs in Python, 7x slower).
from hiredis import HiredisError, Reader
from hiredis import pack_command as _pack
from redis.exceptions import NoScriptError

from capacity.admission.redis_layout import (
    ADMIT_LUA,
    RELEASE_LUA,
    BucketDecision,
    DecisionParameters,
    admit_keys_and_args,
    decision_of,
    in_flight_keys,
    reply_error,
)

log = logging.getLogger(__name__)

Orphaned = Callable[[BucketDecision | BaseException], None] | None


ADMISSION_CONNECTION_NAME = "mu-admission"


def _as_is(reply: Any) -> Any:
    return reply


@dataclass(slots=True)
class _Pending:
    """A command asked of AsyncBuckets' connection; `future` None: a SCRIPT LOAD sent ahead of
    a command Redis did not know the script of, whose reply only matters if it is an error."""

    command: tuple[Any, ...]
    future: asyncio.Future[Any] | None
    orphaned: Orphaned
    parse: Callable[[Any], Any] | None
    sent_at: float = 0.0
    reloaded: bool = False


class _Replies(asyncio.Protocol):
    """Redis's replies, parsed by hiredis in the socket's callback and handed over in order."""

    def __init__(self, owner: AsyncBuckets):
        self.owner = owner
        self.reader = Reader(replyError=reply_error)

    def data_received(self, data: bytes) -> None:
        owner = self.owner
        if owner._protocol is not self:
            return  # a connection given up already
        reader = self.reader
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not False:
                if not owner._sent:
                    raise ValueError("a reply to nothing that was asked")
                owner._replied(reply)
                if owner._protocol is not self:
                    return
        except (ValueError, HiredisError) as error:
            # Replies can no longer be matched to their commands: the connection goes.
            reason = f"Redis's answer could not be read: {error}"
            owner._drop(lambda: redis.ConnectionError(reason))
            return
        owner._after_replies()

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._lost(self, exc)


class AsyncBuckets(DecisionParameters):
    """`Buckets.admit` for an asyncio event loop: the same script, one EVALSHA per decision, on
    one connection of its own spoken to at the protocol level (an asyncio Protocol whose
    callback parses the replies with hiredis and settles each decision's future: no task and
    no stream reader between Redis and the request).

    Decisions asked for while a round trip is under way are pipelined together in the next one
    (one write for all of them), so under load a round trip carries many decisions and never
    blocks the loop; on an idle connection a decision is written in the loop iteration it is
    asked in. Releases of concurrency slots ride the same pipeline.

    `submit` queues a decision and returns its future; `admit` awaits it. A caller cancelled
    while it waits cancels the future, not the decision (Redis takes and records it all the
    same): `orphaned`, when given, is then called with it (or with the RedisError). The future
    raises redis.RedisError when Redis does not answer within `timeout_seconds`.

    The connection is made from the client's URL as redis-py would (host and port, or a Unix
    socket path; TLS for rediss://; AUTH with its username and password; SELECT of its
    database)."""

    def __init__(self, client: redis.asyncio.Redis, *, timeout_seconds: float, **parameters: Any):
        super().__init__(**parameters)
        self.client = client
        self.timeout_seconds = timeout_seconds
        self._script = client.register_script(ADMIT_LUA)
        self._release_script = client.register_script(RELEASE_LUA)
        self._queue: list[_Pending] = []  # asked, not written yet
        self._sent: collections.deque[_Pending] = collections.deque()  # written, in order
        self._protocol: _Replies | None = None
        self._transport: asyncio.Transport | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._flush_soon: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None

    def submit(
        self,
        *,
        customer_id: int,
        model_id: int,
        cost_mu: float,
        request_id: str | None,
        tokens: int = 0,
        api_key_prefix: str | None = None,
        orphaned: Orphaned = None,
        shed: bool = False,
        owner: str = "",
    ) -> asyncio.Future[BucketDecision]:
        keys, args = admit_keys_and_args(
            self, customer_id, model_id, cost_mu, request_id, tokens, api_key_prefix, shed, owner
        )
        command = ("EVALSHA", self._script.sha, len(keys), *keys, *args)
        return self._enqueue(command, orphaned, lambda reply: decision_of(reply, cost_mu))

    def release(
        self, *, customer_id: int, request_id: str, api_key_prefix: str | None = None
    ) -> asyncio.Future[Any]:
        """Free the concurrency slot a request holds (its end), in the next round trip."""
        keys = in_flight_keys(customer_id, api_key_prefix)
        command = ("EVALSHA", self._release_script.sha, 0, request_id, *keys)
        return self._enqueue(command, None, lambda reply: reply)

    async def admit(
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
        return await self.submit(
            customer_id=customer_id,
            model_id=model_id,
            cost_mu=cost_mu,
            request_id=request_id,
            tokens=tokens,
            api_key_prefix=api_key_prefix,
            shed=shed,
            owner=owner,
        )

    async def close(self) -> None:
        """Once what was asked is answered (or has failed), the connection closed."""
        deadline = time.monotonic() + 2 * self.timeout_seconds + 0.1
        # Shutdown only: a short poll rather than an event every decision would have to set.
        while (self._queue or self._sent or self._connecting) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        self._disconnect()

    # -- the pipeline -------------------------------------------------------------------------

    def _enqueue(
        self, command: tuple[Any, ...], orphaned: Orphaned, parse: Callable[[Any], Any]
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append(_Pending(command, future, orphaned, parse))
        # Written at the end of this loop iteration, with whatever else it asks: unless a
        # round trip is under way, whose end writes them (_after_replies).
        if self._flush_soon is None and not self._sent:
            self._flush_soon = loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self._flush_soon = None
        if not self._queue or self._sent or self._connecting is not None:
            return  # written when the round trip or the connection's handshake is done
        if self._transport is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
            return
        self._write_queued()

    def _write_queued(self) -> None:
        """What was asked meanwhile, once nothing is in flight on a connection whose handshake
        is done (decisions asked during a round trip ride the next one)."""
        ready = self._transport is not None and self._connecting is None
        if self._queue and not self._sent and ready:
            batch, self._queue = self._queue, []
            self._write(batch)

    def _write(self, batch: list[_Pending]) -> None:
        assert self._transport is not None
        now = time.monotonic()
        for pending in batch:
            pending.sent_at = now
        self._sent.extend(batch)
        self._transport.write(b"".join([_pack(p.command) for p in batch]))
        if self._timer is None:
            self._arm_timer()

    def _replied(self, reply: Any) -> None:
        pending = self._sent.popleft()
        if isinstance(reply, NoScriptError) and not pending.reloaded and pending.parse:
            # Redis restarted or flushed its scripts: loaded again, and the command asked
            # again behind it (once).
            scripts = {s.sha: s.script for s in (self._script, self._release_script)}
            script = scripts.get(pending.command[1])
            if script is not None:
                pending.reloaded = True
                self._write([_Pending(("SCRIPT", "LOAD", script), None, None, None), pending])
                return
        self._settle(pending, reply)

    def _after_replies(self) -> None:
        if not self._sent and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._write_queued()

    @staticmethod
    def _settle(pending: _Pending, reply: Any) -> None:
        if pending.future is None or pending.parse is None:
            if isinstance(reply, BaseException):
                log.warning("Redis refused the admission connection's %s: %s",
                            pending.command[0], reply)  # fmt: skip
            return
        outcome: Any
        if isinstance(reply, BaseException):
            outcome = reply
        else:
            try:
                outcome = pending.parse(reply)
            except redis.RedisError as error:  # StateLost: decided as if Redis were down
                outcome = error
            except (ValueError, TypeError, AttributeError) as error:
                outcome = redis.ResponseError(f"bad reply: {error}")
        future = pending.future
        if future.done():  # its caller was cancelled
            if pending.orphaned is not None:
                pending.orphaned(outcome)
        elif isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def _fail(self, pendings: Iterable[_Pending], error: Callable[[], redis.RedisError]) -> None:
        for pending in pendings:
            self._settle(pending, error())  # an exception of its own each

    # -- the connection -----------------------------------------------------------------------

    async def _connect(self) -> None:
        """Connect, then the handshake (AUTH, SELECT, the name), answered before any decision
        is written: a decision pipelined behind a refused AUTH would run as Redis's default
        user."""
        loop = asyncio.get_running_loop()
        handshake: list[_Pending] = []
        try:
            async with asyncio.timeout(self.timeout_seconds):
                self._transport, self._protocol = await self._open()
                handshake = [
                    _Pending(command, loop.create_future(), None, _as_is)
                    for command in self._handshake()
                ]
                self._write(handshake)
                for pending in handshake:
                    assert pending.future is not None
                    await pending.future  # an error reply raises
        except (OSError, TimeoutError, redis.RedisError) as error:
            self._sent.clear()
            self._disconnect()
            for pending in handshake:  # retrieved, so that asyncio does not log them
                future = pending.future
                if future is not None and future.done() and not future.cancelled():
                    future.exception()
            queued, self._queue = self._queue, []
            if isinstance(error, redis.RedisError):
                failure = error
                self._fail(queued, lambda: type(failure)(*failure.args))
            elif isinstance(error, TimeoutError):
                self._fail(queued, self._timeout_error)
            else:
                reason = str(error)
                self._fail(queued, lambda: redis.ConnectionError(reason))
            return
        finally:
            self._connecting = None
            if self._transport is None and self._queue:
                # Whatever else ended the attempt (the task cancelled at shutdown): no caller
                # waits for ever.
                queued, self._queue = self._queue, []
                self._fail(queued, lambda: redis.ConnectionError("no connection to Redis"))
        self._write_queued()

    async def _open(self) -> tuple[asyncio.Transport, _Replies]:
        pool = self.client.connection_pool
        kwargs = pool.connection_kwargs
        loop = asyncio.get_running_loop()
        protocol = _Replies(self)
        if kwargs.get("path"):
            transport, _ = await loop.create_unix_connection(lambda: protocol, kwargs["path"])
        else:
            ssl_context = None
            if issubclass(pool.connection_class, redis.asyncio.SSLConnection):
                # redis-py's own TLS settings of the URL (ssl_cert_reqs, ssl_ca_certs, …).
                ssl_context = pool.connection_class(**kwargs).ssl_context.get()
            transport, _ = await loop.create_connection(
                lambda: protocol,
                kwargs.get("host", "localhost"),
                int(kwargs.get("port", 6379)),
                ssl=ssl_context,
            )
        return transport, protocol  # type: ignore[return-value]

    def _handshake(self) -> list[tuple[Any, ...]]:
        kwargs = self.client.connection_pool.connection_kwargs
        commands: list[tuple[Any, ...]] = []
        password, username = kwargs.get("password"), kwargs.get("username")
        if password is not None:
            commands.append(("AUTH", username, password) if username else ("AUTH", password))
        if int(kwargs.get("db") or 0):
            commands.append(("SELECT", int(kwargs["db"])))
        # Named, so that an operator finds the gateways' admission connections in CLIENT LIST.
        commands.append(("CLIENT", "SETNAME", ADMISSION_CONNECTION_NAME))
        return commands

    def _arm_timer(self) -> None:
        if self._sent:
            delay = self._sent[0].sent_at + self.timeout_seconds - time.monotonic()
            self._timer = asyncio.get_running_loop().call_later(max(0.0, delay), self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if not self._sent:
            return
        if time.monotonic() - self._sent[0].sent_at < self.timeout_seconds:
            self._arm_timer()
            return
        # The replies still due can no longer be matched to their commands: the connection
        # goes, and what was not written yet goes on a new one.
        self._drop(self._timeout_error)

    def _timeout_error(self) -> redis.TimeoutError:
        return redis.TimeoutError(f"Redis did not answer within {self.timeout_seconds:g} s")

    def _lost(self, protocol: _Replies, exc: Exception | None) -> None:
        if protocol is not self._protocol:
            return  # dropped already
        reason = f"the connection to Redis was lost: {exc or 'closed by the server'}"
        self._drop(lambda: redis.ConnectionError(reason))

    def _drop(self, error: Callable[[], redis.RedisError]) -> None:
        sent = list(self._sent)
        self._sent.clear()
        self._disconnect()
        self._fail(sent, error)
        if self._queue and self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self._flush)

    def _disconnect(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        transport, self._transport, self._protocol = self._transport, None, None
        if transport is not None:
            transport.abort()
