"""The billing app's periodic task, written into django-celery-beat's tables by name."""

from django.db import transaction
from django_celery_beat.models import CrontabSchedule, PeriodicTask

NAME = "billing: last month's draft invoices"


@transaction.atomic
def billing_schedules_sync() -> int:
    # 03:00 UTC on the 1st, after the month's last rollups have settled.
    monthly, _ = CrontabSchedule.objects.get_or_create(
        minute="0", hour="3", day_of_month="1", month_of_year="*", day_of_week="*", timezone="UTC"
    )
    PeriodicTask.objects.update_or_create(
        name=NAME,
        defaults={"task": "billing.generate_last_month", "crontab": monthly, "interval": None,
                  "queue": "default", "enabled": True},
    )  # fmt: skip
    return 1
