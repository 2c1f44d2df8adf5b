"""An invoice's lines as rows of text: THE columns of an invoice line (`COLUMNS`), each with its
heading and how its text is written. The CSV (billing.exports), the PDF (billing.pdf) and the
JSON export's line fields (billing.api) all read them here, so none can show other lines,
columns or amounts than the others.

Formats are the API's: instants in ISO 8601 UTC with a Z, decimals at their stored places
(quantity and unit price to 6, amounts to cents), a model by name, a reservation by id.
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from billing.models import Invoice, InvoiceLine


def _decimal(value: Decimal, places: int) -> str:
    # As the JSON export writes decimals: the column's places, never an exponent.
    return f"{value.quantize(Decimal(1).scaleb(-places)):f}"


def _instant(value: datetime | None) -> str:
    # As the JSON export writes instants (DRF's ISO 8601, UTC as Z).
    if value is None:
        return ""
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class LineColumn:
    name: str  # the CSV's header and the JSON export's field
    heading: str  # what the PDF's table heads it with
    pdf_width: str  # its share of the PDF's table (a CSS width; the columns sum to 100 %)
    text: Callable[[InvoiceLine], str]
    number: bool = False  # a decimal: a number in the CSV, right-aligned in the PDF
    instant: bool = False  # an instant: the PDF shows it to the minute


# The columns, in order: the JSON export's line fields without `evidence` (a nested object; the
# JSON detail and the PDF carry it).
COLUMNS = (
    LineColumn("kind", "Kind", "8%", lambda line: line.kind),
    LineColumn(
        "model", "Model", "8%", lambda line: line.served_model.name if line.served_model_id else ""
    ),
    LineColumn(
        "reservation",
        "Reservation",
        "7.5%",
        lambda line: str(line.reservation_id) if line.reservation_id else "",
    ),
    LineColumn("description", "Description", "25.5%", lambda line: line.description),
    LineColumn(
        "starts_at", "From (UTC)", "9%", lambda line: _instant(line.starts_at), instant=True
    ),
    LineColumn("ends_at", "To (UTC)", "9%", lambda line: _instant(line.ends_at), instant=True),
    LineColumn("quantity", "Quantity", "10%", lambda line: _decimal(line.quantity, 6), number=True),
    LineColumn("unit", "Unit", "9%", lambda line: line.unit),
    LineColumn(
        "unit_price", "Unit price", "7%", lambda line: _decimal(line.unit_price, 6), number=True
    ),
    LineColumn("amount", "Amount", "7%", lambda line: _decimal(line.amount, 2), number=True),
)
LINE_COLUMNS = tuple(column.name for column in COLUMNS)


def line_row(line: InvoiceLine) -> dict[str, str]:
    """The line's text in every column, by column name."""
    return {column.name: column.text(line) for column in COLUMNS}


def invoice_lines(invoice: Invoice) -> list[InvoiceLine]:
    """The invoice's lines in the order every export shows them (kind, then as made)."""
    return list(invoice.lines.select_related("served_model").order_by("kind", "pk"))


def invoice_rows(invoice: Invoice) -> list[dict[str, str]]:
    """The invoice's lines as rows (`line_row`), in the exports' order."""
    return [line_row(line) for line in invoice_lines(invoice)]
