"""The files an invoice downloads as: THE list of formats (`INVOICE_FORMATS`). Every format
renders the same rows (billing.line_rows), so the CSV and the PDF can never show different lines
or amounts. The API's downloads and the customer portal's links both come from here, so a new
format is one entry below and appears wherever invoices are downloaded.
"""

import io
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

from django.http import HttpResponse

from billing.line_rows import COLUMNS, LINE_COLUMNS, LineColumn, invoice_rows
from billing.models import Invoice
from billing.pdf import invoice_pdf
from core.csv_export import spreadsheet_writer


def _csv_cell(column: LineColumn, text: str) -> str | Decimal:
    # The amounts as numbers (the same digits: a Decimal keeps the text's places), so the
    # spreadsheet writer leaves a credit's "-20.00" a number; every other cell is text, and
    # text a spreadsheet would run as a formula is neutralised.
    return Decimal(text) if column.number else text


def invoice_csv(invoice: Invoice) -> bytes:
    """One row per line, in the invoice's order."""
    buffer = io.StringIO()
    writer = spreadsheet_writer(buffer)
    writer.writerow(LINE_COLUMNS)
    for row in invoice_rows(invoice):
        writer.writerow([_csv_cell(column, row[column.name]) for column in COLUMNS])
    return buffer.getvalue().encode()


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
        name="pdf", label="PDF", content_type="application/pdf", render=invoice_pdf
    ),
}


def export_filename(invoice: Invoice, extension: str) -> str:
    """The download's file name: the customer, the month and the invoice's id."""
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
