"""The shape of one usage event as gateways send it, checked with pydantic.

pydantic's core is compiled, so a batch of 5,000 events is checked in milliseconds; DRF's
serializers would take most of a second. Numbers must be JSON numbers (strict), so a token
count sent as "12" is refused rather than guessed at.
"""

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StrictInt, model_validator

MAX_TOKENS = 2_000_000_000  # the database column is a 32-bit integer

TokenCount = Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS)]


class UsageEventIn(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, frozen=True)

    event_id: Annotated[str, Field(min_length=1, max_length=100)]
    customer: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    model: Annotated[str, Field(min_length=1, max_length=100)]
    deployment: Annotated[str, Field(min_length=1, max_length=100)] | None = None
    started_at: AwareDatetime
    finished_at: AwareDatetime
    input_tokens: TokenCount
    cached_input_tokens: TokenCount = 0
    output_tokens: TokenCount
    images: TokenCount = 0
    outcome: Literal["completed", "cancelled", "error", "refused"]
    # What the sender believes; the admission record of `event_id` decides (capacity.usage).
    admission_class: Literal["guaranteed", "best_effort", "none"] | None = None
    ttft_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "UsageEventIn":
        if self.finished_at < self.started_at:
            raise ValueError("finished_at is before started_at")
        if self.cached_input_tokens > self.input_tokens:
            raise ValueError("cached_input_tokens exceeds input_tokens")
        return self


def reasons_from(error) -> list[str]:
    """pydantic's errors as 'field: reason' lines."""
    reasons = []
    for item in error.errors(include_url=False):
        location = ".".join(str(part) for part in item["loc"])
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "is not a field of a usage event"
        reasons.append(f"{location}: {message}" if location else message)
    return reasons


def minute_of(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(second=0, microsecond=0)
