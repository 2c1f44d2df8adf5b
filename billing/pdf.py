"""An invoice as a PDF a finance team can send: the rows and columns of its CSV
(billing.line_rows), its totals, its credits with their evidence and the latency SLA's
attainment when no credit is due, laid out by WeasyPrint (HTML and CSS, through Debian's Pango)
from the template billing/invoice_pdf.html.

WeasyPrint would fetch what a document links to (images, style sheets); an invoice links to
nothing, so every fetch is refused: nothing in a line's text can make the server reach out.
"""

from django.template.loader import render_to_string

from billing.line_rows import COLUMNS, LineColumn, invoice_lines, line_row
from billing.models import Invoice, InvoiceLine


def credit_evidence(line: InvoiceLine) -> str:
    """What a credit (or the latency SLA's line without one) rests on, in a sentence."""
    evidence = line.evidence or {}
    if evidence.get("sla") == "ttft" and line.kind == InvoiceLine.Kind.LATENCY_SLA:
        without = evidence.get("requests_without_ttft") or 0
        if evidence.get("attainment_percent") is None:
            text = (
                f"No guaranteed request reported a time to first token against the "
                f"{evidence['ttft_objective_ms']:,} ms objective: attainment not measured."
            )
        else:
            text = (
                f"Attainment {evidence['attainment_percent']:.3f} %: "
                f"{evidence['requests_within_objective']:,} of {evidence['requests_counted']:,} "
                f"guaranteed requests had their first token within "
                f"{evidence['ttft_objective_ms']:,} ms; no credit is due."
            )
        text += f" {without:,} requests reported no TTFT and are not counted."
        return text
    if evidence.get("sla") == "ttft":
        text = (
            f"Attainment {evidence['attainment_percent']:.3f} %: "
            f"{evidence['requests_within_objective']:,} of {evidence['requests_counted']:,} "
            f"guaranteed requests had their first token within "
            f"{evidence['ttft_objective_ms']:,} ms; below {evidence['below_attainment_percent']:g}"
            f" % credits {evidence['credit_percent']:g} % of the commitment "
            f"({evidence['commitment']})."
        )
        if evidence.get("requests_without_ttft"):
            text += (
                f" {evidence['requests_without_ttft']:,} requests reported no TTFT and are not "
                "counted."
            )
        return text
    if "minutes" in evidence:
        minutes = evidence["minutes"]
        refused = sum(m.get("guaranteed_refused", 0) for m in minutes)
        return (
            f"{len(minutes):,} minute(s) in which {refused:,} guaranteed request(s) were refused "
            f"while under the reservation; {evidence.get('share', '')} of each minute's "
            "commitment credited."
        )
    return ""


def _cell(column: LineColumn, text: str) -> dict[str, str]:
    """A cell of the PDF's table: an instant to the minute (invoices prorate to the minute),
    without the T; decimals right-aligned."""
    if column.instant:
        return {"text": text[:16].replace("T", " "), "class": "when"}
    return {"text": text, "class": "num" if column.number else ""}


def invoice_pdf(invoice: Invoice) -> bytes:
    """The invoice as PDF bytes."""
    # Imported when used: importing WeasyPrint loads Pango and its fonts (about half a second),
    # which every process importing billing (each web and Celery worker) would pay otherwise.
    from weasyprint import HTML
    from weasyprint.urls import URLFetcher

    lines = invoice_lines(invoice)
    rows = [line_row(line) for line in lines]
    table = [[_cell(column, row[column.name]) for column in COLUMNS] for row in rows]
    credits = [
        {"row": row, "evidence": credit_evidence(line)}
        for line, row in zip(lines, rows, strict=True)
        if line.kind == InvoiceLine.Kind.CREDIT
    ]
    # The latency SLA's attainment in the months no credit is due (billing.latency).
    latency = [
        {"row": row, "evidence": credit_evidence(line)}
        for line, row in zip(lines, rows, strict=True)
        if line.kind == InvoiceLine.Kind.LATENCY_SLA
    ]
    html = render_to_string(
        "billing/invoice_pdf.html",
        {
            "invoice": invoice,
            "columns": COLUMNS,
            "table": table,
            "credits": credits,
            "latency": latency,
        },
    )
    # No protocol allowed: any URL a document names is refused, never fetched.
    refuse_all = URLFetcher(allowed_protocols=frozenset())
    return HTML(string=html, url_fetcher=refuse_all).write_pdf()
