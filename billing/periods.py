"""A billing period: one calendar month in UTC, named '2026-11'. Generation, rate cards,
budgets and margins all bill by it, so it lives below them all."""

import calendar
from datetime import UTC, date, datetime, timedelta

from core.bounds import EARLIEST, LATEST, ascii_whole_number
from core.errors import DomainError


def period_bounds(period: str | date) -> tuple[date, datetime, datetime]:
    """'2026-11' (or a date in the month) -> (first day, start, end) in UTC."""
    if isinstance(period, str):
        # ASCII digits only: int() would read '٢٠٢٦' and ' 2026', and a year of eleven digits
        # overflows date() (OverflowError, not ValueError: a 500).
        year_text, _, month_text = period.partition("-")
        year = ascii_whole_number(year_text, max_digits=4)
        month = ascii_whole_number(month_text, max_digits=2)
        if year is None or month is None or not 1 <= month <= 12:
            raise DomainError(f"'{period[:40]}' is not a month: use YYYY-MM.", field="period")
        if not EARLIEST.year <= year < LATEST.year:
            raise DomainError(
                f"'{period}' is not a month billed here: use {EARLIEST:%Y-%m} to "
                f"{LATEST.year - 1}-12.",
                field="period",
            )
        first = date(year, month, 1)
    else:
        first = period.replace(day=1)
    days = calendar.monthrange(first.year, first.month)[1]
    start = datetime(first.year, first.month, 1, tzinfo=UTC)
    return first, start, start + timedelta(days=days)
