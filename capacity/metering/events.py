"""The shape of one usage event as gateways send it: checked with msgspec on the fast path
(`decode_batch`: a whole batch's bytes in one pass), else with pydantic (`UsageEventIn`), which
words the reasons an event is refused.

Both cores are compiled; DRF's serializers would take most of a second for 5,000 events, and
one pydantic model per event after the stdlib's JSON parse is about a third of a batch's time
(py-spy, issue 24). Numbers must be JSON numbers (strict), so a token
count sent as "12" is refused rather than guessed at.
"""

from datetime import UTC, datetime
from typing import Annotated, Literal

import msgspec
import numpy as np
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)

from core.bounds import IDENTIFIER_PATTERN, IDENTIFIER_RULE

MAX_TOKENS = 2_000_000_000  # the database column is a 32-bit integer
# A first token later than an hour is no latency measurement.
MAX_TTFT_MS = 3_600_000
# A first token may be stamped a little after the request's end by another clock.
TTFT_CLOCK_SLACK_MS = 1_000

TokenCount = Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS)]
# A gateway's own bounds are lower (GATEWAY_MAX_PROMPTS, GATEWAY_MAX_N); these only keep a
# sender's numbers sane.
MAX_PROMPTS = 10_000
MAX_SEQUENCES = 1_000_000
# What a gateway's Redis-down fallback decided: admitted within its share of the reservation,
# or refused (with a reservation behind the customer, or without).
FallbackClass = Literal["guaranteed", "refused_guaranteed", "refused"]
# More than any one request can cost (a whole context on the slowest GPU is far below it):
# a sender's estimate above it is a bug, refused rather than stored as demand.
MAX_ESTIMATED_MU = 1_000_000.0
EstimatedMu = Annotated[StrictFloat, Field(ge=0, le=MAX_ESTIMATED_MU, allow_inf_nan=False)]
# A prompt's text in bytes: within a 32-bit column, far above any request body a gateway takes.
MAX_PROMPT_BYTES = 2_000_000_000


def _identifier(max_length: int):
    return Annotated[str, Field(min_length=1, max_length=max_length, pattern=IDENTIFIER_PATTERN)]


def _in_utc(moment: datetime) -> datetime:
    try:
        return moment.astimezone(UTC)
    except OverflowError:  # 0001-01-01T00:00:00+01:00 is in year 0
        raise ValueError("is out of range") from None


Instant = Annotated[AwareDatetime, AfterValidator(_in_utc)]


class UsageEventIn(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, frozen=True)

    # Printable ASCII (core.bounds.IDENTIFIER_PATTERN): no NUL or line breaks.
    event_id: _identifier(100)
    customer: _identifier(64) | None = None
    model: _identifier(100)
    deployment: _identifier(100) | None = None
    # The engine endpoint (its base URL) the gateway sent the request to.
    replica: _identifier(500) | None = None
    started_at: Instant
    finished_at: Instant
    input_tokens: TokenCount
    cached_input_tokens: TokenCount = 0
    output_tokens: TokenCount
    images: TokenCount = 0
    outcome: Literal["completed", "cancelled", "error", "refused"]
    # What the sender believes; the admission record of `event_id` decides
    # (capacity.metering.ingestion).
    admission_class: Literal["guaranteed", "best_effort", "none"] | None = None
    # The prefix of the customer's key the request came with, as the sender believes. Checked
    # against the admission record, which alone decides the key stored (and whose budget the
    # request spends): never taken from the sender.
    api_key: _identifier(16) | None = None
    ttft_ms: Annotated[float, Field(ge=0, le=MAX_TTFT_MS, allow_inf_nan=False)] | None = None
    # A refused request's estimated MU, as the sender's admission computed it. Stored only for
    # refused events, and only when the control plane has no admission record of its own.
    estimated_mu: EstimatedMu | None = None
    # The bytes of prompt text the sender measured, for a request whose input_tokens are the
    # engine's own count: the calibration of the model's bytes per token. Ignored otherwise.
    prompt_bytes: Annotated[StrictInt, Field(ge=0, le=MAX_PROMPT_BYTES)] | None = None
    # How long the gateway held the request for a model at zero (its cold start) before
    # admitting it; ttft_ms counts from the end of the hold.
    held_ms: Annotated[float, Field(ge=0, le=MAX_TTFT_MS, allow_inf_nan=False)] | None = None
    # Whether the answer was streamed: a non-streamed answer has no first token before its
    # end, so its ttft_ms is not stored (billing.latency counts it apart).
    streamed: StrictBool | None = None
    # What the gateway's own fallback decided while Redis could not be reached (no admission
    # record exists): taken only from a platform key, checked against the reservations sold
    # (capacity.metering.ingestion).
    fallback_class: FallbackClass | None = None
    # A request of several prompts (a completion's list: one engine request each) or of `n`
    # sequences a prompt: its tokens are the engine's totals, priced as that work
    # (capacity.pricing.features.batch_replica_seconds) and held to the context per prompt.
    prompts: Annotated[StrictInt, Field(ge=1, le=MAX_PROMPTS)] | None = None
    sequences: Annotated[StrictInt, Field(ge=1, le=MAX_SEQUENCES)] | None = None
    # The engine's status when it refused the request before any work (a 4xx, outcome error):
    # billed 0 MU when a platform key says so.
    engine_status: Annotated[StrictInt, Field(ge=400, le=499)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "UsageEventIn":
        if self.finished_at < self.started_at:
            raise ValueError("finished_at is before started_at")
        if self.cached_input_tokens > self.input_tokens:
            raise ValueError("cached_input_tokens exceeds input_tokens")
        duration_ms = (self.finished_at - self.started_at).total_seconds() * 1000
        if self.ttft_ms is not None and self.ttft_ms > duration_ms + TTFT_CLOCK_SLACK_MS:
            raise ValueError(
                f"ttft_ms ({self.ttft_ms:g}) exceeds the request's own duration "
                f"(finished_at - started_at = {duration_ms:g} ms)"
            )
        if (self.sequences or 1) < (self.prompts or 1):
            raise ValueError("sequences must be at least prompts (each prompt has n of them)")
        if self.engine_status is not None and self.outcome != "error":
            raise ValueError("engine_status is the status of an engine's refusal: outcome error")
        if self.held_ms is not None and self.held_ms > duration_ms + TTFT_CLOCK_SLACK_MS:
            raise ValueError(
                f"held_ms ({self.held_ms:g}) exceeds the request's own duration "
                f"(finished_at - started_at = {duration_ms:g} ms)"
            )
        return self


def context_problems(
    context_length_tokens: int,
    input_tokens: int,
    output_tokens: int,
    *,
    prompts: int = 1,
    sequences: int = 1,
) -> dict:
    """The field at fault when a request's tokens do not fit the model's context, or {}: per
    prompt and sequence, for a request of several (each runs in a context of its own)."""
    prompts, sequences = max(1, prompts), max(1, sequences)
    per_prompt = input_tokens / prompts
    per_sequence = output_tokens / sequences
    several = " per prompt" if prompts > 1 else ""
    if per_prompt > context_length_tokens:
        return {
            "input_tokens": [
                f"exceeds the model's context ({context_length_tokens} tokens){several}"
            ]
        }
    if per_prompt + per_sequence > context_length_tokens:
        if prompts == sequences == 1:
            return {
                "output_tokens": [
                    f"input_tokens + output_tokens = {input_tokens + output_tokens} exceeds the "
                    f"model's context ({context_length_tokens} tokens)"
                ]
            }
        return {
            "output_tokens": [
                f"{per_prompt:g} input tokens a prompt + {per_sequence:g} output tokens a "
                f"sequence exceed the model's context ({context_length_tokens} tokens)"
            ]
        }
    return {}


def reasons_from(error) -> list[str]:
    """pydantic's errors as 'field: reason' lines."""
    reasons = []
    for item in error.errors(include_url=False):
        location = ".".join(str(part) for part in item["loc"])
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "is not a field of a usage event"
        elif item["type"] == "string_pattern_mismatch":
            message = IDENTIFIER_RULE
        reasons.append(f"{location}: {message}" if location else message)
    return reasons


def minute_of(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(second=0, microsecond=0)


# The fast path: a whole batch decoded and checked by msgspec in one pass over the bytes, with
# no per-event Python objects besides the events themselves. It accepts a subset of what
# UsageEventIn accepts, with the same values: whatever it is unsure of (a bad event, a string
# pydantic would strip, a datetime pydantic would read differently) sends the whole body down
# the pydantic path, which gives the reasons the API has always given.

# `\Z`, not `$`: Python's `$` also matches before a final line break, pydantic's does not.
_FAST_IDENTIFIER_PATTERN = IDENTIFIER_PATTERN.removesuffix("$") + r"\Z"


def _fast_identifier(max_length: int):
    return Annotated[
        str, msgspec.Meta(min_length=1, max_length=max_length, pattern=_FAST_IDENTIFIER_PATTERN)
    ]


_FastInstant = Annotated[datetime, msgspec.Meta(tz=True)]
_FastTokenCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]


def _has_sub_microsecond_digits(body: bytes) -> bool:
    """Whether a time of day in `body` has more than 6 digits of a second (`:SS.fffffff`):
    msgspec rounds them to the microsecond, pydantic truncates. Vectorised: a regular
    expression over a batch's megabyte took 15-20 ms, more than msgspec's whole decode."""
    data = np.frombuffer(body, dtype=np.uint8)
    digit = (data - np.uint8(ord("0"))) < 10  # bytes below "0" wrap around to large values
    points = np.flatnonzero((data == ord(".")) | (data == ord(",")))
    points = points[(points >= 4) & (points + 7 < data.size)]
    if points.size == 0:
        return False
    suspect = digit[points - 4] & (data[points - 3] == ord(":")) & digit[points - 2]
    suspect &= digit[points - 1]
    for offset in range(1, 8):
        suspect &= digit[points + offset]
    return bool(suspect.any())


class UsageEventStruct(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """UsageEventIn's fields, bounds and defaults, for msgspec (see UsageEventIn for what each
    means). Mutable only so that decode_batch can move the instants to UTC in place.

    gc=False: the garbage collector does not track these (they hold strings, numbers and
    instants, so never a reference cycle); a batch's 5,000 of them set off its collections,
    which walked them all again and again (27.0 us of CPU an event in process before, 19.4
    after)."""

    event_id: _fast_identifier(100)  # type: ignore[valid-type]
    model: _fast_identifier(100)  # type: ignore[valid-type]
    started_at: _FastInstant
    finished_at: _FastInstant
    input_tokens: _FastTokenCount
    output_tokens: _FastTokenCount
    outcome: Literal["completed", "cancelled", "error", "refused"]
    customer: _fast_identifier(64) | None = None  # type: ignore[valid-type]
    deployment: _fast_identifier(100) | None = None  # type: ignore[valid-type]
    replica: _fast_identifier(500) | None = None  # type: ignore[valid-type]
    cached_input_tokens: _FastTokenCount = 0
    images: _FastTokenCount = 0
    admission_class: Literal["guaranteed", "best_effort", "none"] | None = None
    api_key: _fast_identifier(16) | None = None  # type: ignore[valid-type]
    # JSON has no NaN or infinity, and a number too large for a float is above the bound.
    ttft_ms: Annotated[float, msgspec.Meta(ge=0, le=MAX_TTFT_MS)] | None = None
    estimated_mu: Annotated[float, msgspec.Meta(ge=0, le=MAX_ESTIMATED_MU)] | None = None
    prompt_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_PROMPT_BYTES)] | None = None
    held_ms: Annotated[float, msgspec.Meta(ge=0, le=MAX_TTFT_MS)] | None = None
    streamed: bool | None = None
    fallback_class: FallbackClass | None = None
    prompts: Annotated[int, msgspec.Meta(ge=1, le=MAX_PROMPTS)] | None = None
    sequences: Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQUENCES)] | None = None
    engine_status: Annotated[int, msgspec.Meta(ge=400, le=499)] | None = None


class _FastBatch(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    events: list[UsageEventStruct]


_BATCH_DECODER = msgspec.json.Decoder(_FastBatch | list[UsageEventStruct])


class DecodedEvents(list):
    """A batch's events, every one decoded and checked as UsageEventIn would check it."""


def decode_batch(body: bytes) -> DecodedEvents | None:
    """The events of a UTF-8 JSON batch (`{"events": [...]}` or a bare list), each as valid as
    UsageEventIn would make it; None when any part of the body needs the pydantic path (bad
    JSON, a bad event, or anything the fast path does not read exactly as pydantic does)."""
    if _has_sub_microsecond_digits(body):
        return None
    try:
        decoded = _BATCH_DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    events = decoded.events if isinstance(decoded, _FastBatch) else decoded
    for event in events:
        try:
            event.started_at = event.started_at.astimezone(UTC)
            event.finished_at = event.finished_at.astimezone(UTC)
        except OverflowError:  # pydantic words it ("is out of range")
            return None
        # UsageEventIn._consistent, whose words the pydantic path gives.
        if event.finished_at < event.started_at or event.cached_input_tokens > event.input_tokens:
            return None
        if (event.sequences or 1) < (event.prompts or 1):
            return None
        if event.engine_status is not None and event.outcome != "error":
            return None
        if event.ttft_ms is not None or event.held_ms is not None:
            duration_ms = (event.finished_at - event.started_at).total_seconds() * 1000
            if (event.ttft_ms or 0.0) > duration_ms + TTFT_CLOCK_SLACK_MS:
                return None
            if (event.held_ms or 0.0) > duration_ms + TTFT_CLOCK_SLACK_MS:
                return None
    return DecodedEvents(events)


# An event checked by either path: the two have the same fields, with the same values.
CheckedEvent = UsageEventIn | UsageEventStruct
