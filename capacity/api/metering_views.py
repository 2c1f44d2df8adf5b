from datetime import UTC, timedelta

from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts import scopes as S
from accounts.permissions import ReadScope
from accounts.principals import principal_of
from accounts.selectors import customers_visible_to
from accounts.throttling import UsageThrottle
from capacity.metering.ingestion import MAX_BATCH_EVENTS, usage_ingest
from capacity.metering.utilisation import MAX_RANGE, customer_utilisation, model_capacity_summary
from capacity.models import ServedModel
from capacity.selling.selectors import reservations_at_risk_of_customer
from controlplane.api.errors import error_body
from controlplane.bounds import INSTANT_RULE, has_control_characters, plausible_instant
from controlplane.errors import DomainError

IngestResponse = inline_serializer(
    "UsageIngestResponse",
    {
        "accepted_count": serializers.IntegerField(),
        "duplicate_count": serializers.IntegerField(),
        "rejected_count": serializers.IntegerField(),
        "accepted": serializers.ListField(child=serializers.CharField()),
        "duplicates": serializers.ListField(child=serializers.CharField()),
        "rejected": serializers.ListField(child=serializers.DictField()),
    },
)


class UsageEventsView(APIView):
    """Post a batch of usage events (up to 5,000).

    `{"events": [...]}` or a bare list. Answers 200 when every event was stored or was a
    duplicate, 207 when some were rejected and others stored, 400 when all were rejected;
    the body always says which: accepted, duplicates (ignored, never counted twice) and
    rejected (by index, with reasons).
    """

    # Batches count against API_THROTTLE_USAGE, not the write limit.
    throttle_classes = [UsageThrottle]

    @extend_schema(request=inline_serializer("UsageBatch", {"events": serializers.ListField(
        child=serializers.DictField(), max_length=MAX_BATCH_EVENTS)}),
        responses={200: IngestResponse, 207: IngestResponse})  # fmt: skip
    def post(self, request):
        principal = principal_of(request)
        if not (principal.is_planner or principal.has_scope(S.USAGE_WRITE)):
            raise PermissionDenied("Posting usage needs the usage:write scope.")
        body = request.data
        events = body.get("events") if isinstance(body, dict) else body
        if isinstance(body, dict) and set(body) != {"events"}:
            # A batch is {"events": [...]} and nothing else: another key is a mistake.
            unknown = sorted(str(key) for key in body if key != "events")[:20]
            fields = {key: ['is not a field here; send {"events": [...]}.'] for key in unknown}
            if "events" not in body:
                fields["events"] = ['is required: send {"events": [...]}.']
            raise DomainError(
                'Send {"events": [...]}' + (f"; not {', '.join(unknown)}." if unknown else "."),
                fields=fields,
            )
        customer = principal.api_key.customer if principal.api_key is not None else None
        may_name = principal.is_planner or principal.is_service
        if customer is None and not may_name:
            raise PermissionDenied("Only customer keys, platform keys and planners post usage.")
        result = usage_ingest(events=events, customer=customer, may_name_customer=may_name)
        body = result.as_dict()
        if result.rejected and not (result.accepted or result.duplicates):
            code = status.HTTP_400_BAD_REQUEST
            first = result.rejected[0]
            body["error"] = error_body(
                status_code=code,
                code="all_rejected",
                message=f"Every event was rejected; event {first['index']}: "
                + "; ".join(first["reasons"]),
            )["error"]
        elif result.rejected:
            code = status.HTTP_207_MULTI_STATUS
        else:
            code = status.HTTP_200_OK
        return Response(body, status=code)


def _parse_time(value: str | None, *, field: str, default):
    if not value:
        return default
    shown = value[:40]
    try:
        parsed = parse_datetime(value)
    except ValueError:  # shaped like one, but no such moment (2026-02-30, 25:00)
        parsed = None
    if parsed is None:
        raise DomainError(f"'{shown}' is not an ISO 8601 date-time.", field=field)
    if timezone.is_naive(parsed):
        raise DomainError("Give a time zone, e.g. 2026-11-01T00:00:00Z.", field=field)
    if not plausible_instant(parsed):
        raise DomainError(f"{field} {INSTANT_RULE}; got '{shown}'.", field=field)
    return parsed.astimezone(UTC)


STEP_UNITS = {"m": 60, "h": 3600, "d": 86400}


def _parse_step(value: str | None) -> timedelta:
    if not value:
        return timedelta(hours=1)
    try:
        number, unit = (value[:-1], value[-1]) if value[-1] in STEP_UNITS else (value, "")
        seconds = int(number) * STEP_UNITS.get(unit, 1)
    except (ValueError, IndexError):
        raise DomainError(
            f"'{value[:40]}' is not a step: use seconds or a number with m, h or d (e.g. 15m).",
            field="step",
        ) from None
    if seconds > MAX_RANGE.total_seconds():
        # No step is longer than the longest range (and a timedelta ends at 10⁹ days).
        raise DomainError(f"step may be at most {MAX_RANGE.days} days.", field="step")
    return timedelta(seconds=seconds)


class CustomerUtilisationView(APIView):
    """Reserved versus used MU/min per step for one customer and model."""

    permission_classes = [ReadScope]

    @extend_schema(
        parameters=[
            OpenApiParameter("model", str, required=True),
            OpenApiParameter("from", str, description="ISO 8601; default: 24 h ago"),
            OpenApiParameter("to", str, description="ISO 8601; default: now"),
            OpenApiParameter("step", str, description="e.g. 60, 15m, 1h, 1d; default 1h"),
        ],
        responses=inline_serializer("Utilisation", {"steps": serializers.ListField()}),
    )
    def get(self, request, slug):
        principal = principal_of(request)
        customer = get_object_or_404(customers_visible_to(principal), slug=slug)
        model_name = request.query_params.get("model")
        if not model_name:
            raise DomainError("Name the model: ?model=NAME.", field="model")
        if has_control_characters(model_name):
            raise DomainError("A model name holds no control characters.", field="model")
        served_model = ServedModel.objects.filter(name=model_name).first()
        if served_model is None:
            raise DomainError(f"No model named '{model_name}'.", field="model")
        now = timezone.now()
        end = _parse_time(request.query_params.get("to"), field="to", default=now)
        start = _parse_time(
            request.query_params.get("from"), field="from", default=end - timedelta(hours=24)
        )
        step = _parse_step(request.query_params.get("step"))
        steps = customer_utilisation(
            customer=customer, served_model=served_model, start=start, end=end, step=step
        )
        at_risk = reservations_at_risk_of_customer(customer, served_model=served_model)
        return Response(
            {
                "customer": customer.slug,
                "model": served_model.name,
                # Some of the customer's reservations of the model are sold beyond what the
                # fleet serves now (capacity.selling.at_risk).
                "oversold": bool(at_risk),
                "reservations_at_risk": sorted(r.pk for r in at_risk),
                "from": start.isoformat(),
                "to": end.isoformat(),
                "step_seconds": int(step.total_seconds()),
                "steps": steps,
            }
        )


class ModelCapacityView(APIView):
    """Deployable, hot, sellable, sold and used MU/min of a model, now. What the fleet has
    sold in total is the operator's business: planners and platform services only."""

    @extend_schema(responses=inline_serializer("ModelCapacity", {
        "deployable_mu_per_minute": serializers.FloatField()}))  # fmt: skip
    def get(self, request, name):
        principal = principal_of(request)
        if not (principal.is_planner or (principal.is_service and principal.has_scope(S.READ))):
            raise PermissionDenied("Only planners and platform services see fleet capacity.")
        served_model = get_object_or_404(ServedModel, name=name)
        return Response(model_capacity_summary(served_model))
