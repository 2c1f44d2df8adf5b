"""django-filter's backend, with date-time filters held to what the database can compare."""

from datetime import UTC, timedelta

from django import forms
from django.core.exceptions import ValidationError
from django_filters.rest_framework import DjangoFilterBackend

# Real UTC offsets run from −12:00 to +14:00; PostgreSQL refuses anything past ±15:59.
MAX_UTC_OFFSET = timedelta(hours=14)


def comparable_instant(value) -> None:
    if value is None:
        return
    offset = value.utcoffset()
    if offset is not None and abs(offset) > MAX_UTC_OFFSET:
        raise ValidationError("has a UTC offset beyond ±14:00.", code="out_of_range")
    try:
        value.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:59:59-01:00 is in year 10000
        raise ValidationError("is out of range.", code="out_of_range") from None


class BoundedFilterBackend(DjangoFilterBackend):
    """Every date-time filter (`created_at__gte`, ...) refuses, with a 400 naming it, a value
    the database would fail on: an offset of −23:00, or a moment past year 9999 in UTC."""

    def get_filterset(self, request, queryset, view):
        filterset = super().get_filterset(request, queryset, view)
        if filterset is not None:
            for field in filterset.form.fields.values():
                if isinstance(field, forms.DateTimeField):
                    field.validators.append(comparable_instant)
        return filterset
