import codecs
import io
from datetime import UTC, timedelta

from django.http import StreamingHttpResponse
from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django_filters import rest_framework as filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import ParseError, PermissionDenied
from rest_framework.generics import GenericAPIView
from rest_framework.parsers import get_encoding
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from accounts import scopes as S
from accounts.permissions import ReadScope
from accounts.principals import principal_of
from accounts.selectors import customers_visible_to
from accounts.throttling import ReadThrottle, UsageThrottle
from capacity.metering.events import DecodedEvents, decode_batch
from capacity.metering.ingestion import MAX_BATCH_EVENTS, usage_ingest
from capacity.metering.selectors import (
    RECEIPT_COLUMNS,
    RECEIPT_ORDERING,
    receipts_of,
    usage_receipts,
)
from capacity.metering.utilisation import MAX_RANGE, customer_utilisation, model_capacity_summary
from capacity.models import AdmissionClass, Outcome, ServedModel
from capacity.selling.selectors import reservations_at_risk_of_customer
from core.api.errors import error_body
from core.api.filters import BoundedFilterBackend
from core.api.pagination import KeysetPagination, keyset_after
from core.api.parsers import BoundedJSONParser
from core.api.throttle_scopes import EXPORTS
from core.bounds import INSTANT_RULE, has_control_characters, plausible_instant
from core.csv_export import spreadsheet_writer
from core.errors import DomainError

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


class ReceiptSerializer(serializers.Serializer):
    """One usage event as its customer audits it (the schema of a receipt; rows are built by
    capacity.metering.selectors.receipts_of)."""

    event_id = serializers.CharField(help_text="The request id the gateway sent.")
    customer = serializers.CharField(help_text="The customer's slug.")
    model = serializers.CharField()
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(help_text="When it is billed (its minute's month).")
    input_tokens = serializers.IntegerField(help_text="All prompt tokens, cached included.")
    cached_input_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    images = serializers.IntegerField()
    outcome = serializers.ChoiceField(choices=Outcome.choices)
    admission_class = serializers.ChoiceField(
        choices=AdmissionClass.choices, help_text="The class its admission record decided."
    )
    verification = serializers.CharField(help_text="Where the class came from.")
    self_reported = serializers.BooleanField(help_text="Posted by the customer's own key.")
    api_key = serializers.CharField(
        allow_null=True,
        help_text="The prefix of the customer's key the request was admitted under, as its "
        "admission record names it (null: none recorded). What a key's budget is spent from.",
    )
    ttft_ms = serializers.FloatField(
        allow_null=True,
        help_text="Time to first token as the gateway measured it, from the end of any hold "
        "for a cold start; null for a non-streamed request (its first byte is its end).",
    )
    held_ms = serializers.FloatField(
        allow_null=True,
        help_text="How long the request waited for a model at zero before it was admitted "
        "(null: not held).",
    )
    streamed = serializers.BooleanField(
        allow_null=True, help_text="Whether the answer was streamed (null: not said)."
    )
    prompts = serializers.IntegerField(
        help_text="Engine requests its tokens count (a completion's list of prompts)."
    )
    sequences = serializers.IntegerField(help_text="Sequences its output counts (n per prompt).")
    mu = serializers.FloatField(help_text="MU the request used (0 for a refused request).")
    guaranteed_mu = serializers.FloatField(help_text="Of mu: the part admitted as guaranteed.")
    best_effort_mu = serializers.FloatField(
        help_text="Of mu: the part billed as best-effort (the invoice's best-effort lines sum "
        "these)."
    )
    estimated_mu = serializers.FloatField(
        allow_null=True, help_text="A refused request: what it would have cost."
    )
    cost_model_id = serializers.IntegerField(help_text="The cost model that priced it.")
    cost_model_version = serializers.IntegerField(help_text="That cost model's version.")


def _visible_customers(request):
    return customers_visible_to(principal_of(request))


class UsageReceiptFilter(filters.FilterSet):
    """The filters of the receipts and their CSV: model, finished_at range, outcome, class;
    `customer` narrows a planner's (or platform key's) view to one customer."""

    customer = filters.ModelChoiceFilter(
        field_name="customer",
        to_field_name="slug",
        queryset=_visible_customers,
        help_text="A customer's slug (planners and platform keys; a customer sees its own).",
    )
    model = filters.ModelChoiceFilter(
        field_name="served_model",
        to_field_name="name",
        queryset=ServedModel.objects.all(),
        help_text="A model's name.",
    )
    outcome = filters.ChoiceFilter(choices=Outcome.choices)
    admission_class = filters.ChoiceFilter(choices=AdmissionClass.choices)

    class Meta:
        fields = ["customer", "model", "outcome", "admission_class"]


# `from` is a Python keyword: the range filters are added by name.
UsageReceiptFilter.base_filters["from"] = filters.IsoDateTimeFilter(
    field_name="finished_at",
    lookup_expr="gte",
    label="Finished at or after (ISO 8601; no offset: UTC).",
)
UsageReceiptFilter.base_filters["to"] = filters.IsoDateTimeFilter(
    field_name="finished_at", lookup_expr="lt", label="Finished before (ISO 8601; no offset: UTC)."
)


class _ReceiptsMixin:
    """What the receipts list and their CSV share: who may read them, and the filters."""

    permission_classes = [ReadScope]
    filter_backends = [BoundedFilterBackend]
    filterset_class = UsageReceiptFilter
    keyset_ordering = RECEIPT_ORDERING

    def get_queryset(self):
        principal = principal_of(self.request)
        # The ids themselves, not a subquery: `customer_id = 5` lets the database read one
        # customer's receipts in order from the index instead of sorting all of them.
        visible = None if principal.sees_all_customers else sorted(principal.customer_ids)
        return usage_receipts(customer_ids=visible)


RECEIPTS_DESCRIPTION = """The caller's usage receipts: one per request, newest first, by cursor.

Each event with its MU, its guaranteed and best-effort parts (the invoice's best-effort lines
sum `best_effort_mu`) and the cost-model version that priced it. Filter by `model`,
`from`/`to` (on `finished_at`, the time it is billed at: from inclusive, to exclusive),
`outcome` and `admission_class`. A customer (its members and keys with `read`) reads only its
own; planners and platform keys with `read` read every customer's, narrowed with `customer`.
Page with the `next` and `previous` links (`page_size` up to 1,000): pages continue after the
last row of the one before, so the millionth row costs what the first does and events arriving
meanwhile never shift a page. `GET /api/v1/usage/events/csv` exports the same rows."""

INGEST_DESCRIPTION = """Post a batch of usage events (up to 5,000; keys with `usage:write`).

`{"events": [...]}` or a bare list. Answers 200 when every event was stored or was a
duplicate, 207 when some were rejected and others stored, 400 when all were rejected;
the body always says which: accepted, duplicates (ignored, never counted twice) and
rejected (by index, with reasons)."""


class UsageBatchParser(BoundedJSONParser):
    """A usage batch decoded and checked in one pass (capacity.metering.events.decode_batch),
    as DecodedEvents; any body the fast path is unsure of is parsed as every other JSON body
    is, so bad input gets the same answers as before."""

    def parse(self, stream, media_type=None, parser_context=None):
        raw = stream.read() if stream is not None else b""
        try:
            utf8 = codecs.lookup(get_encoding(parser_context or {})).name == "utf-8"
        except ParseError:
            utf8 = False  # the JSON parser gives the reason
        if utf8:
            events = decode_batch(raw)
            if events is not None:
                return events
        return super().parse(io.BytesIO(raw), media_type, parser_context)


class UsageEventsView(_ReceiptsMixin, GenericAPIView):
    """GET: a customer's usage receipts (RECEIPTS_DESCRIPTION); POST: a gateway's batch of
    usage events (INGEST_DESCRIPTION)."""

    pagination_class = KeysetPagination
    serializer_class = ReceiptSerializer
    parser_classes = [
        UsageBatchParser if parser is BoundedJSONParser else parser
        for parser in api_settings.DEFAULT_PARSER_CLASSES
    ]

    def get_permissions(self):
        # POST checks its own scope (usage:write) in the view: a gateway's key need not read.
        if self.request.method == "POST":
            return [IsAuthenticated()]
        return super().get_permissions()

    def get_throttles(self):
        # Batches count against API_THROTTLE_USAGE, not the write limit; reads as every read.
        return [UsageThrottle(), ReadThrottle()]

    @extend_schema(
        summary="Usage receipts", description=RECEIPTS_DESCRIPTION,
        responses=ReceiptSerializer(many=True),
    )  # fmt: skip
    def get(self, request):
        queryset = self.filter_queryset(self.get_queryset())
        rows = self.paginate_queryset(queryset)
        return self.get_paginated_response(receipts_of(rows))

    @extend_schema(request=inline_serializer("UsageBatch", {"events": serializers.ListField(
        child=serializers.DictField(), max_length=MAX_BATCH_EVENTS)}),
        responses={200: IngestResponse, 207: IngestResponse}, filters=False,
        summary="Post usage events", description=INGEST_DESCRIPTION)  # fmt: skip
    def post(self, request):
        principal = principal_of(request)
        if not (principal.is_planner or principal.has_scope(S.USAGE_WRITE)):
            raise PermissionDenied("Posting usage needs the usage:write scope.")
        body = request.data
        events = body.get("events") if isinstance(body, dict) else body
        if isinstance(body, DecodedEvents):
            pass  # decoded and checked already (UsageBatchParser)
        elif isinstance(body, dict) and set(body) != {"events"}:
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


CSV_CHUNK_ROWS = 5_000


class UsageEventsCsvView(_ReceiptsMixin, GenericAPIView):
    """The receipts as CSV, with the list's filters: every matching row, newest first,
    streamed in chunks (each chunk one keyset range, so no query holds the table open)."""

    # Every matching row in one answer: counted against API_THROTTLE_EXPORTS too.
    throttle_scope = EXPORTS

    @extend_schema(
        summary="Usage receipts as CSV",
        responses={(200, "text/csv"): OpenApiTypes.STR},
        filters=True,
        operation_id="v1_usage_events_csv",
    )
    def get(self, request):
        queryset = self.filter_queryset(self.get_queryset())
        response = StreamingHttpResponse(self._lines(queryset), content_type="text/csv")
        response["Content-Disposition"] = 'attachment; filename="usage-events.csv"'
        return response

    def _lines(self, queryset):
        buffer = io.StringIO()
        # Values as receipts_of types them: numbers stay numbers, text that a spreadsheet
        # would run as a formula (an event id "=HYPERLINK(...)") is neutralised.
        writer = spreadsheet_writer(buffer)

        def flush() -> str:
            text = buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
            return text

        writer.writerow(RECEIPT_COLUMNS)
        yield flush()
        position = None
        while True:
            chunk = (
                queryset if position is None else keyset_after(queryset, RECEIPT_ORDERING, position)
            )
            rows = list(chunk[:CSV_CHUNK_ROWS])
            for receipt in receipts_of(rows):
                writer.writerow([receipt[column] for column in RECEIPT_COLUMNS])
            if rows:
                yield flush()
            if len(rows) < CSV_CHUNK_ROWS:
                return
            position = (rows[-1]["finished_at"], rows[-1]["id"])


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
