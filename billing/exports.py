"""The files an invoice downloads as: THE list of formats (`INVOICE_FORMATS`), and an invoice's
lines as rows of text, the one source of its CSV and its PDF (billing.pdf), so the two can never
show different lines or amounts. The API's downloads and the customer portal's links both come
from here, so a new format is one entry below and appears wherever invoices are downloaded.

Formats are the API's: instants in ISO 8601 UTC with a Z, decimals at their stored places
(quantity and unit price to 6, amounts to cents), a model by name, a reservation by id.
"""

import io
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from django.http import HttpResponse

from billing.models import Invoice, InvoiceLine
from core.csv_export import spreadsheet_writer

# The CSV's columns, in order: the JSON export's line fields without `evidence` (a nested
# object; the JSON detail and the PDF carry it).
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
    # As the JSON export writes decimals: the column's places, never an exponent.
    return f"{value.quantize(Decimal(1).scaleb(-places)):f}"


def _instant(value: datetime | None) -> str:
    # As the JSON export writes instants (DRF's ISO 8601, UTC as Z).
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


def _csv_cell(column: str, text: str) -> str | Decimal:
    # The amounts as numbers (the same digits: a Decimal keeps the text's places), so the
    # spreadsheet writer leaves a credit's "-20.00" a number; every other cell is text, and
    # text a spreadsheet would run as a formula is neutralised.
    return Decimal(text) if column in _PLACES else text


def invoice_csv(invoice: Invoice) -> bytes:
    """One row per line, in the invoice's order."""
    buffer = io.StringIO()
    writer = spreadsheet_writer(buffer)
    writer.writerow(LINE_COLUMNS)
    for row in invoice_rows(invoice):
        writer.writerow([_csv_cell(column, row[column]) for column in LINE_COLUMNS])
    return buffer.getvalue().encode()


def _invoice_pdf(invoice: Invoice) -> bytes:
    # billing.pdf builds on the rows above, and loads Pango when it renders.
    from billing.pdf import invoice_pdf

    return invoice_pdf(invoice)


@dataclass(frozen=True)
class InvoiceFormat:
    name: str  # the file extension and the URL's word: "csv"
    label: str  # what a download link says: "CSV"
    content_type: str
    render: Callable[[Invoice], bytes]


# Every format an invoice downloads as, in the order links show them.
INVOICE_FORMATS: dict[str, InvoiceFormat] = {
    "csv": InvoiceFormat(name="csv", label="CSV", content_type="text/csv", render=invoice_csv),
    "pdf": InvoiceFormat(
        name="pdf", label="PDF", content_type="application/pdf", render=_invoice_pdf
    ),
}


def export_filename(invoice: Invoice, extension: str) -> str:
    return f"invoice-{invoice.customer.slug}-{invoice.period_start:%Y-%m}-{invoice.pk}.{extension}"


def invoice_download(invoice: Invoice, format_name: str) -> HttpResponse:
    """The invoice as an attachment in the named format (one of INVOICE_FORMATS; a name
    outside it is the caller's 404)."""
    invoice_format = INVOICE_FORMATS[format_name]
    response = HttpResponse(
        invoice_format.render(invoice), content_type=invoice_format.content_type
    )
    filename = export_filename(invoice, invoice_format.name)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response
