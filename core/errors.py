"""The one domain error that services raise; the API maps it to 400 or 409
(docs/design.md#services).
"""


class DomainError(Exception):
    """A request the domain refuses.

    `field` names the input at fault (None for the request as a whole); `details` carries the
    numbers behind the refusal so that a caller can act on them (e.g. a shortfall).
    `status` is 400 for invalid input and 409 for a conflict with the current state.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        code: str = "invalid",
        status: int = 400,
        details: dict | None = None,
        fields: dict[str, list[str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.fields = fields or ({field: [message]} if field else {})
        self.message = message
        self.field = field
        self.code = code
        self.status = status
        self.details = details or {}


class ConflictError(DomainError):
    """A domain error about the state of things (taken, in use, decided already): a 409."""

    def __init__(self, message: str, **kwargs) -> None:
        kwargs.setdefault("status", 409)
        kwargs.setdefault("code", "conflict")
        super().__init__(message, **kwargs)
