"""The billing app's periodic tasks, written into django-celery-beat's tables by name."""

from django.db import transaction
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

NAME = "billing: last month's draft invoices"
BUDGETS_NAME = "billing: budgets and spend alerts"
# How stale a hard cap may be: spend past 100 % is refused from the next check on.
BUDGET_CHECK_MINUTES = 5


@transaction.atomic
def billing_schedules_sync() -> dict[str, int]:
    """Write the billing app's beat rows (last month's drafts on the 1st, the budget check every
    BUDGET_CHECK_MINUTES); how many ("periodic")."""
    # 03:00 UTC on the 1st, after the month's last rollups have settled.
    monthly, _ = CrontabSchedule.objects.get_or_create(
        minute="0", hour="3", day_of_month="1", month_of_year="*", day_of_week="*", timezone="UTC"
    )
    PeriodicTask.objects.update_or_create(
        name=NAME,
        defaults={"task": "billing.generate_last_month", "crontab": monthly, "interval": None,
                  "queue": "default", "enabled": True},
    )  # fmt: skip
    every, _ = IntervalSchedule.objects.get_or_create(
        every=BUDGET_CHECK_MINUTES, period=IntervalSchedule.MINUTES
    )
    PeriodicTask.objects.update_or_create(
        name=BUDGETS_NAME,
        defaults={"task": "billing.check_budgets", "interval": every, "crontab": None,
                  "queue": "default", "enabled": True},
    )  # fmt: skip
    return {"periodic": 2}
