"""Thin Celery adapters for the billing app."""

from datetime import timedelta

from celery import shared_task
from django.utils import timezone

from billing.budgets import budgets_check
from billing.generation import invoice_generate


@shared_task(name="billing.generate_last_month")
def generate_last_month() -> dict:
    """The previous month's drafts (run on the 1st; re-running replaces drafts only)."""
    first_of_this_month = timezone.now().date().replace(day=1)
    last_month = (first_of_this_month - timedelta(days=1)).replace(day=1)
    result = invoice_generate(period=last_month)
    return {"period": result.period, "drafts": result.drafts, "skipped": result.skipped_issued}


@shared_task(name="billing.check_budgets")
def check_budgets() -> dict:
    """Budgets against month-to-date spend (alerts, hard cap) and reservations' last week."""
    return budgets_check()
