"""An invoice's lines as rows of text: the one source of its CSV and its PDF (billing.pdf), so
the two can never show different lines or amounts.

Formats are the API's: instants in ISO 8601 UTC with a Z, decimals at their stored places
(quantity and unit price to 6, amounts to cents), a model by name, a reservation by id.
"""

import csv
import io
from datetime import UTC, datetime
from decimal import Decimal

from billing.models import Invoice, InvoiceLine

LINE_COLUMNS = (
    "kind",
    "model",
    "reservation",
    "description",
    "starts_at",
    "ends_at",
    "quantity",
    "unit",
    "unit_price",
    "amount",
)

_PLACES = {"quantity": 6, "unit_price": 6, "amount": 2}


def _decimal(value: Decimal, places: int) -> str:
    return f"{value.quantize(Decimal(1).scaleb(-places)):f}"


def _instant(value: datetime | None) -> str:
    if value is None:
        return ""
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def line_row(line: InvoiceLine) -> dict[str, str]:
    return {
        "kind": line.kind,
        "model": line.served_model.name if line.served_model_id else "",
        "reservation": str(line.reservation_id) if line.reservation_id else "",
        "description": line.description,
        "starts_at": _instant(line.starts_at),
        "ends_at": _instant(line.ends_at),
        "quantity": _decimal(line.quantity, _PLACES["quantity"]),
        "unit": line.unit,
        "unit_price": _decimal(line.unit_price, _PLACES["unit_price"]),
        "amount": _decimal(line.amount, _PLACES["amount"]),
    }


def invoice_lines(invoice: Invoice) -> list[InvoiceLine]:
    """The invoice's lines in the order every export shows them (kind, then as made)."""
    return list(invoice.lines.select_related("served_model").order_by("kind", "pk"))


def invoice_rows(invoice: Invoice) -> list[dict[str, str]]:
    return [line_row(line) for line in invoice_lines(invoice)]


def invoice_csv(invoice: Invoice) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(LINE_COLUMNS)
    for row in invoice_rows(invoice):
        writer.writerow([row[column] for column in LINE_COLUMNS])
    return buffer.getvalue()


def export_filename(invoice: Invoice, extension: str) -> str:
    return f"invoice-{invoice.customer.slug}-{invoice.period_start:%Y-%m}-{invoice.pk}.{extension}"
