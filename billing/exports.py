"""The files an invoice downloads as: THE list of formats (`INVOICE_FORMATS`), each rendered
from the invoice's stored lines. The API's `GET /api/v1/invoices/{id}/csv/` and the customer
portal's download links both come from here, so a new format (a PDF, billing/pdf.py) is one
entry below and appears wherever invoices are downloaded.
"""

import csv
import io
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from django.http import HttpResponse

from billing.models import Invoice

# The CSV's columns, in order: the JSON export's line fields without `evidence` (a nested
# object; the JSON detail carries it).
CSV_COLUMNS = [
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
]


def _instant(moment: datetime | None) -> str:
    # As the JSON export writes instants (DRF's ISO 8601, UTC as Z).
    if moment is None:
        return ""
    text = moment.astimezone(UTC).isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def _fixed(value: Decimal, places: int) -> str:
    # As the JSON export writes decimals: the column's places, never an exponent.
    return f"{value.quantize(Decimal(1).scaleb(-places)):f}"


def invoice_csv(invoice: Invoice) -> bytes:
    """One row per line, in the invoice's order (kind, then as made)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(CSV_COLUMNS)
    for line in invoice.lines.select_related("served_model").order_by("kind", "pk"):
        writer.writerow(
            [
                line.kind,
                line.served_model.name if line.served_model_id else "",
                line.reservation_id or "",
                line.description,
                _instant(line.starts_at),
                _instant(line.ends_at),
                _fixed(line.quantity, 6),
                line.unit,
                _fixed(line.unit_price, 6),
                _fixed(line.amount, 2),
            ]
        )
    return buffer.getvalue().encode()


@dataclass(frozen=True)
class InvoiceFormat:
    name: str  # the file extension and the URL's word: "csv"
    label: str  # what a download link says: "CSV"
    content_type: str
    render: Callable[[Invoice], bytes]


# Every format an invoice downloads as, in the order links show them. billing/pdf.py adds
# "pdf" here.
INVOICE_FORMATS: dict[str, InvoiceFormat] = {
    "csv": InvoiceFormat(name="csv", label="CSV", content_type="text/csv", render=invoice_csv),
}


def invoice_filename(invoice: Invoice, invoice_format: InvoiceFormat) -> str:
    return (
        f"invoice-{invoice.customer.slug}-{invoice.period_start:%Y-%m}-{invoice.pk}"
        f".{invoice_format.name}"
    )


def invoice_download(invoice: Invoice, format_name: str) -> HttpResponse:
    """The invoice as an attachment in the named format (one of INVOICE_FORMATS; a name
    outside it is the caller's 404)."""
    invoice_format = INVOICE_FORMATS[format_name]
    response = HttpResponse(
        invoice_format.render(invoice), content_type=invoice_format.content_type
    )
    filename = invoice_filename(invoice, invoice_format)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response
