"""The base of every serializer that reads a request body.

DRF drops keys it does not know, and read-only ones, without a word: a typo (`max_replica`)
or a field that cannot be set here (`headroom` on a model) answered 2xx and changed nothing.
Here such a key is a 400 naming it, on every write endpoint.
"""

from collections.abc import Mapping

from django.core.validators import RegexValidator
from rest_framework import serializers
from rest_framework.relations import ManyRelatedField, RelatedField

from core.bounds import (
    FREE_TEXT_MAX_CHARS,
    IDENTIFIER_PATTERN,
    IDENTIFIER_RULE,
    INSTANT_RULE,
    has_control_characters,
    has_text_control_characters,
    plausible_instant,
)

# Keys a browser's form post carries beside the fields.
_FORM_KEYS = frozenset({"csrfmiddlewaretoken"})
# A body with thousands of unknown keys gets this many named.
_MAX_NAMED = 20


class StrictFieldsMixin:
    """Refuses input keys that are not writable fields of the serializer (400, each named).

    Also refuses control characters in names given for related objects (`"model":
    "llama\\u0000"`): the lookup would reach the database, which cannot compare them.
    """

    unknown_field_message: str | None = None  # default: names the writable fields
    read_only_field_message = "is read-only: it cannot be set here."

    def to_internal_value(self, data):
        refused, unsafe = self._refused_keys(data) if isinstance(data, Mapping) else ({}, False)
        if unsafe:  # validating the fields would take the names to the database
            raise serializers.ValidationError(refused)
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if refused and isinstance(exc.detail, Mapping):
                raise serializers.ValidationError({**exc.detail, **refused}) from None
            raise
        if refused:
            raise serializers.ValidationError(refused)
        return value

    def _refused_keys(self, data: Mapping) -> tuple[dict[str, list[str]], bool]:
        """Per refused key its reason; and whether a related name holds control characters."""
        fields = self.fields
        writable = [name for name, field in fields.items() if not field.read_only]
        unknown = self.unknown_field_message or (
            "is not a field here; the fields you may set: " + ", ".join(writable) + "."
        )
        refused: dict[str, list[str]] = {}
        unsafe = False
        for key in data:
            if len(refused) == _MAX_NAMED:
                break
            if key in _FORM_KEYS:
                continue
            field = fields.get(key)
            if field is None:
                refused[str(key)] = [unknown]
            elif field.read_only:
                refused[key] = [self.read_only_field_message]
            elif isinstance(field, RelatedField | ManyRelatedField):
                value = data[key]
                names = value if isinstance(value, list) else [value]
                if any(isinstance(name, str) and has_control_characters(name) for name in names):
                    refused[key] = ["must not contain control characters."]
                    unsafe = True
        return refused, unsafe


class StrictSerializer(StrictFieldsMixin, serializers.Serializer):
    pass


class StrictModelSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    pass


def identifier_validator() -> RegexValidator:
    """Event and request ids: printable ASCII (core.bounds.IDENTIFIER_PATTERN)."""
    return RegexValidator(IDENTIFIER_PATTERN, IDENTIFIER_RULE + ".")


def no_control_characters(value: str) -> str:
    """Names: any printable character, no control character (NUL, line breaks, ...)."""
    if has_control_characters(value):
        raise serializers.ValidationError("must not contain control characters.")
    return value


def no_text_control_characters(value: str) -> str:
    """Free text: tabs and line breaks, but no other control character."""
    if has_text_control_characters(value):
        raise serializers.ValidationError(
            "must not contain control characters other than tabs and line breaks."
        )
    return value


class FreeTextField(serializers.CharField):
    """Notes and descriptions: at most FREE_TEXT_MAX_CHARS characters."""

    def __init__(self, **kwargs):
        kwargs.setdefault("max_length", FREE_TEXT_MAX_CHARS)
        kwargs.setdefault("allow_blank", True)
        kwargs.setdefault("required", False)
        super().__init__(**kwargs)
        self.validators.append(no_text_control_characters)


class InstantField(serializers.DateTimeField):
    """A date-time from 1970 to 2999 (core.bounds), in UTC."""

    def to_internal_value(self, value):
        moment = super().to_internal_value(value)
        if not plausible_instant(moment):
            raise serializers.ValidationError(INSTANT_RULE + ".")
        return moment
