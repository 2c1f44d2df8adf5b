"""The API's JSON parser: DRF's, after a check of the body's nesting depth, and refusing
strings that are not Unicode text.

Python's `json` recurses once per nested array or object, so a body of 50,000 nested arrays
(100 kB) raises RecursionError and answers 500. No legitimate body nests deeper than a few
levels (the deepest, a deployment with its actuator config or a usage batch, nests three), so
a body nested deeper than `API_MAX_JSON_DEPTH` is refused with 400 `too_deep` before it is
parsed. The depth is counted without recursion and without a loop in Python, over the bytes
with numpy: quotes not escaped by an odd run of backslashes open and close strings, and the
running sum of opening minus closing brackets outside strings is the depth.

JSON's `\\ud800` escape spells half of a UTF-16 surrogate pair; alone it decodes to a Python
string that UTF-8 cannot encode, so an error message echoing it (a scope that is not one, a
rejected event's id), or a database write, answered 500. A body holding one is refused with
400 naming the field (`scopes.0`, `events.3.event_id`). A whole pair (`\\ud83d\\ude00`)
decodes to its one character and is fine.
"""

import codecs
import re

import numpy as np
from django.conf import settings
from rest_framework.exceptions import ParseError, ValidationError
from rest_framework.parsers import JSONParser, get_encoding
from rest_framework.utils import json

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


# Only a body with a surrogate escape can decode to a lone surrogate (UTF-8 cannot encode
# one, so the decoded text holds none): the walk over the data runs for those bodies only.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
NOT_UNICODE_RULE = "must be Unicode text: it holds half of a UTF-16 surrogate pair ({})."


class TooDeep(ParseError):
    default_detail = "The JSON body is nested too deeply."
    default_code = "too_deep"


def json_depth(data: bytes) -> int:
    """How deeply arrays and objects nest in the UTF-8 JSON `data` (0 for a scalar, 1 for
    `[1, 2]`). Exact for valid JSON; for broken JSON any answer will do, since it fails to
    parse anyway. In UTF-8 no byte of a multi-byte character is a quote, backslash or bracket.
    """
    body = np.frombuffer(data, dtype=np.uint8)
    if body.size == 0:
        return 0
    quotes = body == _QUOTE
    backslashes = np.flatnonzero(np.diff(body == _BACKSLASH, prepend=False, append=False))
    if backslashes.size:
        # Runs of backslashes [start, end): an odd run escapes the byte at `end`.
        starts, ends = backslashes[0::2], backslashes[1::2]
        escaped = ends[((ends - starts) % 2 == 1) & (ends < body.size)]
        quotes[escaped] = False
    steps = _STEP[body]
    if quotes.any():
        # Parity of the quotes up to here (a uint8 count wraps, its parity does not): odd
        # means inside a string, where brackets nest nothing.
        inside = (np.cumsum(quotes, dtype=np.uint8) & 1).astype(bool)
        steps[inside] = 0
    return max(0, int(np.cumsum(steps, dtype=np.int32).max()))


def _shown(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def lone_surrogate(data) -> tuple[str, str] | None:
    """(field path, the string shown with escapes) of the first string, value or key, in
    parsed JSON `data` that holds a lone surrogate; None when there is none. The path is
    dotted with list indexes, as the error body's `fields` are. Without recursion: the data
    nests at most API_MAX_JSON_DEPTH deep, but a loop needs no such argument."""
    pending: list[tuple[str, object]] = [("", data)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                return path or "non_field_errors", _shown(value)[:40]
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                child = f"{path}.{_shown(key)}" if path else _shown(key)
                if _LONE_SURROGATE.search(key):
                    return child, _shown(key)[:40]
                items.append((child, item))
            pending.extend(reversed(items))
        elif isinstance(value, list):
            indexed = [(f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value)]
            pending.extend(reversed(indexed))
    return None


class BoundedJSONParser(JSONParser):
    """DRF's JSON parser, refusing bodies nested deeper than `API_MAX_JSON_DEPTH`."""

    def parse(self, stream, media_type=None, parser_context=None):
        parser_context = parser_context or {}
        encoding = get_encoding(parser_context)
        raw = stream.read()
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        utf8 = raw if codecs.lookup(encoding).name == "utf-8" else text.encode("utf-8")
        depth, limit = json_depth(utf8), settings.API_MAX_JSON_DEPTH
        if depth > limit:
            raise TooDeep(
                f"The JSON body nests arrays and objects {depth} levels deep; at most {limit} "
                "levels are accepted."
            )
        try:
            parse_constant = json.strict_constant if self.strict else None
            data = json.loads(text, parse_constant=parse_constant)
        except (ValueError, RecursionError) as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        if _SURROGATE_ESCAPE.search(text) and (found := lone_surrogate(data)) is not None:
            path, shown = found
            raise ValidationError({path: [NOT_UNICODE_RULE.format(shown)]})
        return data
