"""Bounds every input is held to at the edge, in one place (pure: no Django, no DRF).

A value outside them is refused with 400 naming its field, instead of overflowing somewhere
inside (a date past year 9999, a control character the database cannot store).
"""

import re
from datetime import UTC, datetime

# Identifiers (event and request ids, names looked up in the catalog): printable ASCII, spaces
# only inside. Anything else (NUL, newlines, invisible characters) is refused.
IDENTIFIER_PATTERN = r"^[!-~](?:[ -~]*[!-~])?$"
IDENTIFIER_RULE = "must be printable ASCII (letters, digits, punctuation; spaces only inside)"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# Free text may hold tabs and line breaks, and no other control character.
_TEXT_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# Notes, descriptions: what a person types, not a document.
FREE_TEXT_MAX_CHARS = 2_000

# Instants the control plane reasons about: nothing it bills or meters predates the Unix
# epoch, and a year far ahead still leaves room for arithmetic (datetime ends at 9999).
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(3000, 1, 1, tzinfo=UTC)
INSTANT_RULE = "must be from 1970-01-01 to 2999-12-31 (UTC)"


def has_control_characters(text: str) -> bool:
    """Whether the text holds any C0 or C1 control character (identifiers, one-line text)."""
    return _CONTROL.search(text) is not None


def has_text_control_characters(text: str) -> bool:
    """Likewise for free text, which may hold tabs and line breaks."""
    return _TEXT_CONTROL.search(text) is not None


def plausible_instant(moment: datetime) -> bool:
    """Whether an aware datetime lies in [EARLIEST, LATEST)."""
    try:
        return EARLIEST <= moment < LATEST
    except OverflowError:  # an offset that takes it past year 9999 or before year 1
        return False


_ASCII_DIGITS = re.compile(r"[0-9]+")
# A bigint holds 18 digits whatever they are: a longer number overflows a lookup.
WHOLE_NUMBER_MAX_DIGITS = 18


def ascii_whole_number(text: str, *, max_digits: int = WHOLE_NUMBER_MAX_DIGITS) -> int | None:
    """The whole number `text` spells in ASCII digits and nothing else (at most `max_digits`
    of them), else None. Not `str.isdigit()`, which passes superscripts ('²') that int() then
    refuses (a 500), nor int() alone, which reads '٢٠', '２', ' 7 ', '+7' and '1_000'."""
    if len(text) > max_digits or _ASCII_DIGITS.fullmatch(text) is None:
        return None
    return int(text)
