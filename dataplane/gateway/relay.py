"""An engine's answer on its way to the client (the `Sink` of dataplane/gateway/upstream.py).

A streamed answer with status 200 is relayed as it comes: each piece of the engine's body
that completes SSE events is passed through byte for byte (only an event whose `usage` is not
null is parsed), written to the client's socket from the engine connection's callback, with
no task woken per chunk. Anything else (a non-streamed answer, an error status) is collected
whole and handed to the request's task.

`first` resolves once the answer is past the point of no retry: the first bytes reached the
client (a stream), or the whole answer was collected. Before that, a failure (the engine
gone, no byte within the token timeout) fails `first`, and the request may be retried on
another replica. `finished` resolves when a stream has ended, whichever way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from typing import Any

from .http import ClientGone, Exchange
from .metrics import TTFT
from .upstream import EngineConnection, EngineError
from .usage import Usage

# In an SSE data event: a "usage" that is not null (the engine's counts: its final chunk, or
# every chunk with continuous usage stats). Only such events are parsed.
_USAGE = re.compile(rb'"usage"\s*:\s*(?!null)')
# A choice's generated text that is not empty: "text" (completions) or "content" (a chat delta).
# A quote inside a JSON string is escaped, so these bytes are a key, never a string's content.
_TEXT = re.compile(rb'"(?:text|content)"\s*:\s*"(?!")')


class Retry(Exception):  # noqa: N818 - a signal, not a failure the client sees
    """An attempt failed before the client got a byte: another replica may take it."""

    def __init__(
        self,
        reason: str,
        status: int = 502,
        body: bytes = b"",
        *,
        connection_lost: bool = False,
        unreachable: bool = False,
    ):
        super().__init__(reason)
        self.status = status
        self.body = body
        # The engine's connection closed (rather than an answer, or a timeout).
        self.connection_lost = connection_lost
        # No connection could be made (refused: nothing listens there yet): the request
        # reached no engine.
        self.unreachable = unreachable


class EngineAnswer:
    """One attempt's answer from one engine connection (see the module's docstring)."""

    __slots__ = (
        "_buffer",
        "_chunks",
        "_collect",
        "_connection",
        "_delivered",
        "_done",
        "_exchange",
        "_include_usage",
        "_loop",
        "_paused",
        "_request_id",
        "_since",
        "_started_at",
        "_stream",
        "_timeout_seconds",
        "_timer",
        "arrived",
        "content_type",
        "finished",
        "first",
        "status",
        "usage",
    )

    def __init__(
        self,
        *,
        connection: EngineConnection,
        exchange: Exchange,
        usage: Usage,
        stream: bool,
        include_usage: bool,
        timeout_seconds: float,
        arrived: float,
        started_at: float,
    ):
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._connection = connection
        self._exchange = exchange
        self.usage = usage
        self._stream = stream
        self._include_usage = include_usage
        self._timeout_seconds = timeout_seconds
        self.arrived = arrived  # perf_counter at the request's arrival (the TTFT histogram)
        self._started_at = started_at
        self._collect = True  # until a 200 head of a stream says otherwise
        self._chunks: list[bytes] = []
        self._buffer = b""
        self._done = False  # [DONE] came
        self._delivered = False  # [DONE] written to the client: a disconnect is no cancel
        self._paused = False
        self.status = 0
        self.content_type = ""
        self.first: asyncio.Future[None] = loop.create_future()
        self.finished: asyncio.Future[None] = loop.create_future()
        # The token timeout: one timer, moved on only when it fires early (never per chunk).
        self._since = loop.time()  # waiting for the engine since
        self._timer = loop.call_at(self._since + timeout_seconds, self._check)
        usage.output_tokens = 0
        exchange.on_gone = self._client_gone
        exchange.on_writable = self._writable

    @property
    def complete(self) -> bool:
        return self.finished.done()

    # -- the Sink -------------------------------------------------------------------------

    def reading(self, begun: bool) -> None:
        if begun:
            self._exchange.cork()
        else:
            self._exchange.uncork()

    def head(self, status: int, content_type: str) -> None:
        self.status = status
        self.content_type = content_type
        self._collect = not (self._stream and status == 200)
        self._since = self._loop.time()

    def body(self, data: bytes) -> None:
        self._since = self._loop.time()
        if self._collect:
            self._chunks.append(data)
            return
        buffer = self._buffer + data if self._buffer else data
        if buffer.endswith(b"\n\n"):  # the engine writes whole events
            complete, self._buffer = buffer, b""
        elif b"\n\n" in buffer:
            complete, _, self._buffer = buffer.rpartition(b"\n\n")
            complete += b"\n\n"
        else:
            self._buffer = buffer
            return
        self._relay(complete)

    def done(self) -> None:
        if self._collect:
            self._end_first()
            self._settle()
            return
        if self._buffer.strip():
            self._relay(self._buffer)
            self._buffer = b""
        if self.finished.done():
            return
        if not self._exchange.started:
            if not self._done:
                self._fail_first(Retry("the replica closed the stream without an answer"))
                return
            self._start()
        if not self._done:
            self.usage.outcome = "error"
            self._error_event("the replica ended the stream early")
        else:
            self.usage.outcome = "completed"
            self._exchange.end()
        self._settle()

    def failed(self, error: Exception) -> None:
        if self.finished.done():
            return
        if self._collect or not self._exchange.started:
            self._fail_first(
                Retry(
                    f"{type(error).__name__}: {error}",
                    connection_lost=isinstance(error, EngineError),
                )
            )
            return
        self.usage.outcome = "error"
        self._error_event("the replica failed mid-stream")
        self._settle()

    # -- the client's side ------------------------------------------------------------------

    def _client_gone(self) -> None:
        """The client closed its connection: the engine's request is aborted with it."""
        if self.finished.done():
            return
        self._connection.abort()
        self.usage.outcome = "completed" if self._delivered else "cancelled"
        if not self.first.done():
            self.first.set_exception(ClientGone("the client closed its connection"))
            self.first.exception()  # retrieved: the task learns it from its cancellation
        self._settle()

    def _writable(self, writable: bool) -> None:
        """The client stopped (or went on) reading: so does the relay from the engine, and the
        token timeout does not count meanwhile."""
        self._paused = not writable
        self._connection.pause(not writable)
        if writable:
            self._since = self._loop.time()

    # -- within ------------------------------------------------------------------------------

    def _relay(self, complete: bytes) -> None:
        out, finished = pass_events(complete, self._include_usage, self.usage)
        self._done = self._done or finished
        if not out:
            return
        if not self._exchange.started:
            self._start()
        try:
            self._exchange.write(out)
        except ClientGone:
            self._client_gone()
            return
        self._delivered = self._done

    def _start(self) -> None:
        usage = self.usage
        self._exchange.start(
            200,
            content_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": usage.request_id},
        )
        usage.ttft_ms = (time.time() - self._started_at) * 1000.0
        TTFT.observe(time.perf_counter() - self.arrived)
        if not self.first.done():
            self.first.set_result(None)

    def _error_event(self, reason: str) -> None:
        error = {"error": {"message": reason, "type": "api_error", "param": None, "code": 504}}
        with contextlib.suppress(ClientGone):
            self._exchange.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
        self._exchange.end()

    def _check(self) -> None:
        if self.finished.done():
            return
        now = self._loop.time()
        if self._paused:  # the client is not reading: not the engine's delay
            self._timer = self._loop.call_at(now + self._timeout_seconds, self._check)
            return
        due = self._since + self._timeout_seconds
        if now < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self._connection.abort()
        reason = f"no data from the engine within {self._timeout_seconds:g} s"
        if self._collect or not self._exchange.started:
            self._fail_first(Retry(f"TimeoutError: {reason}"))
            return
        self.usage.outcome = "error"
        self._error_event(f"no token within {self._timeout_seconds:g} s")
        self._settle()

    def _end_first(self) -> None:
        if not self.first.done():
            self.first.set_result(None)

    def _fail_first(self, error: Exception) -> None:
        self._connection.abort()
        if not self.first.done():
            self.first.set_exception(error)
        self._settle()

    def _settle(self) -> None:
        self._timer.cancel()
        self._exchange.on_gone = None
        self._exchange.on_writable = None
        if not self.finished.done():
            self.finished.set_result(None)

    def collected(self) -> bytes:
        return self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)


def pass_events(data: bytes, include_usage: bool, usage: Usage) -> tuple[bytes, bool]:
    """(what to pass to the client, whether [DONE] came) of whole events (`data` ends with
    a blank line, or is the stream's unterminated end). The bytes pass through as they
    came; only an event whose `usage` is not null (the engine's usage chunk) is parsed: it
    gives the token counts, and is dropped when it has no choices and the client did not
    ask for it. Until the engine's usage comes, the choices with text are counted (by
    their bytes, not parsed), which is what a stream cut short is charged."""
    # The common read: whole data events, none of them [DONE] or the usage: the bytes as they
    # came, their text choices counted in one scan (what the loop below does, event by event).
    if (
        data.endswith(b"\n\n")
        and data.startswith(b"data:")
        and data.count(b"\n\n") == data.count(b"\n\ndata:") + 1
        and b"[DONE]" not in data
        and not (b'"usage"' in data and _USAGE.search(data))
    ):
        if not usage.engine_usage:
            usage.output_tokens += len(_TEXT.findall(data))
        return data, False
    events = data.split(b"\n\n")
    terminated = not events[-1]
    if terminated:
        events.pop()
    kept: list[bytes] | None = None  # None: every event passed on unchanged
    done = False
    for index, event in enumerate(events):
        payload = event.strip()
        keep = bool(payload)
        if payload.startswith(b"data:"):
            text = payload[5:].strip()
            if text == b"[DONE]":
                done = True
            elif b'"usage"' in text and _USAGE.search(text):
                keep = _usage_event(text, include_usage, usage)
            elif not usage.engine_usage:
                usage.output_tokens += len(_TEXT.findall(text))
        if keep and kept is not None:
            kept.append(event)
        elif not keep and kept is None:
            kept = events[:index]
    if kept is None and terminated:
        return data, done
    parts = events if kept is None else kept
    return b"".join(event + b"\n\n" for event in parts), done


def _usage_event(text: bytes, include_usage: bool, usage: Usage) -> bool:
    """Takes the engine's usage from a data event that has some; whether to pass it on."""
    try:
        doc: Any = json.loads(text)
    except ValueError:
        return True
    if not isinstance(doc, dict):
        return True
    choices = doc.get("choices")
    if doc.get("usage"):
        usage.take_engine_usage(doc["usage"])
        if not choices and not include_usage:
            return False
    if choices and not usage.engine_usage:
        usage.output_tokens += sum(
            1
            for c in choices
            if isinstance(c, dict) and (c.get("text") or (c.get("delta") or {}).get("content"))
        )
    return True
