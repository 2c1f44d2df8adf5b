"""Invoices for customers (their own) and planners (all); the live month-to-date estimate;
CSV, PDF and JSON exports."""

from decimal import Decimal

from django.shortcuts import get_object_or_404
from django.utils import timezone
from django_filters import rest_framework as filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import mixins, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts import scopes as S
from accounts.models import ApiKey, Customer
from accounts.permissions import scoped_permission
from accounts.principals import principal_of
from accounts.selectors import customers_visible_to
from billing import budgets
from billing.exports import invoice_download
from billing.generation import invoice_estimate, invoice_issue
from billing.latency import MAX_TTFT_OBJECTIVE_MS
from billing.line_rows import LINE_COLUMNS
from billing.margin import model_margins
from billing.models import Budget, Invoice, InvoiceLine, RateCard
from billing.periods import period_bounds
from billing.rates import rate_card_create, rate_card_update
from capacity.models import ServedModel
from core.api.mixins import AuditedPatchMixin
from core.api.serializers import InstantField, StrictModelSerializer, StrictSerializer
from core.api.throttle_scopes import EXPORTS
from core.audit import actor_of

# The exports' columns (billing.line_rows), and the evidence the JSON carries nested.
LINE_FIELDS = [*LINE_COLUMNS, "evidence"]


class ReadPermission(BasePermission):
    message = "Reading invoices needs the read scope."

    def has_permission(self, request, view) -> bool:
        return principal_of(request).has_scope(S.READ)


class InvoiceLineSerializer(serializers.ModelSerializer):
    model = serializers.SlugRelatedField(source="served_model", slug_field="name", read_only=True)
    reservation = serializers.PrimaryKeyRelatedField(read_only=True)

    class Meta:
        model = InvoiceLine
        fields = LINE_FIELDS


class InvoiceSerializer(serializers.ModelSerializer):
    customer = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    period = serializers.SerializerMethodField()

    class Meta:
        model = Invoice
        fields = [
            "id",
            "customer",
            "period",
            "status",
            "currency",
            "subtotal",
            "credits",
            "total",
            "generated_at",
            "issued_at",
        ]

    def get_period(self, invoice) -> str:
        return f"{invoice.period_start:%Y-%m}"


class InvoiceDetailSerializer(InvoiceSerializer):
    lines = InvoiceLineSerializer(many=True, read_only=True)

    class Meta(InvoiceSerializer.Meta):
        fields = [*InvoiceSerializer.Meta.fields, "lines"]


class InvoiceFilter(filters.FilterSet):
    customer = filters.CharFilter(field_name="customer__slug")
    status = filters.ChoiceFilter(choices=Invoice.Status.choices)
    period = filters.CharFilter(method="filter_period")

    class Meta:
        model = Invoice
        fields = ["customer", "status", "period"]

    def filter_period(self, queryset, name, value):
        first, _, _ = period_bounds(value)
        return queryset.filter(period_start=first)


class InvoiceViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """A customer's invoices (customers see their own; planners all). `GET .../{id}/csv` exports
    the lines as CSV and `GET .../{id}/pdf` as a PDF of the same lines; the detail is the JSON
    export. Planners issue drafts (`POST .../issue`)."""

    permission_classes = [ReadPermission]
    filterset_class = InvoiceFilter
    # The downloads set EXPORTS (a PDF takes most of a second): API_THROTTLE_EXPORTS.
    throttle_scope: str | None = None

    def get_queryset(self):
        visible = customers_visible_to(principal_of(self.request))
        queryset = Invoice.objects.filter(customer__in=visible).select_related("customer")
        if self.action == "retrieve":
            queryset = queryset.prefetch_related("lines__served_model")
        return queryset.order_by("-period_start", "customer__slug", "pk")

    def get_serializer_class(self):
        return InvoiceDetailSerializer if self.action == "retrieve" else InvoiceSerializer

    @extend_schema(responses={(200, "text/csv"): str})
    @action(detail=True, methods=["get"], throttle_scope=EXPORTS)
    def csv(self, request, pk=None):
        # The rendering is billing.exports' (the portal downloads the same file).
        return invoice_download(self.get_object(), "csv")

    @extend_schema(
        description="The invoice as PDF: the CSV's lines, the totals, and each credit with "
        "its evidence.",
        responses={(200, "application/pdf"): OpenApiTypes.BINARY},
    )
    @action(detail=True, methods=["get"], throttle_scope=EXPORTS)
    def pdf(self, request, pk=None):
        return invoice_download(self.get_object(), "pdf")

    @extend_schema(request=None, responses=InvoiceSerializer)
    @action(detail=True, methods=["post"])
    def issue(self, request, pk=None):
        if not principal_of(request).is_planner:
            raise PermissionDenied("Only planners issue invoices.")
        invoice = invoice_issue(invoice=self.get_object())
        return Response(InvoiceSerializer(invoice).data)


class EstimateView(APIView):
    """The live estimate of a customer's invoice for a month (default: this month, to date):
    the same computation as the invoice, not stored."""

    permission_classes = [ReadPermission]

    @extend_schema(
        parameters=[OpenApiParameter("period", str, description="YYYY-MM")],
        responses=inline_serializer(
            "InvoiceEstimate",
            {
                "customer": serializers.CharField(),
                "period": serializers.CharField(),
                "subtotal": serializers.DecimalField(max_digits=16, decimal_places=2),
                "credits": serializers.DecimalField(max_digits=16, decimal_places=2),
                "total": serializers.DecimalField(max_digits=16, decimal_places=2),
                "lines": InvoiceLineSerializer(many=True),
            },
        ),
    )
    def get(self, request, slug):
        customer = get_object_or_404(customers_visible_to(principal_of(request)), slug=slug)
        period = request.query_params.get("period") or f"{timezone.now():%Y-%m}"
        estimate = invoice_estimate(customer=customer, period=period)
        estimate["lines"] = InvoiceLineSerializer(estimate["lines"], many=True).data
        for name in ("subtotal", "credits", "total"):
            estimate[name] = str(estimate[name])  # as the invoices' amounts: exact decimals
        return Response(estimate)


class MarginView(APIView):
    """Planners: revenue per model for a month beside its GPU cost (GPU-hours from the
    allocation decisions × the GPU type's hourly cost)."""

    @extend_schema(
        parameters=[OpenApiParameter("period", str, description="YYYY-MM")],
        responses=inline_serializer(
            "ModelMargins",
            {"period": serializers.CharField(), "models": serializers.ListField()},
        ),
    )
    def get(self, request):
        if not principal_of(request).is_planner:
            raise PermissionDenied("Margins are for planners.")
        period = request.query_params.get("period") or f"{timezone.now():%Y-%m}"
        return Response(model_margins(period))


class RateCardSerializer(StrictModelSerializer):
    model = serializers.SlugRelatedField(
        source="served_model", slug_field="name", queryset=ServedModel.objects.all()
    )
    effective_from = InstantField()
    reserved_price_per_mu_minute_hour = serializers.DecimalField(
        max_digits=14, decimal_places=6, min_value=Decimal(0)
    )
    best_effort_price_per_1000_mu = serializers.DecimalField(
        max_digits=14, decimal_places=6, min_value=Decimal(0)
    )
    keep_warm_price_per_mu_minute_hour = serializers.DecimalField(
        max_digits=14,
        decimal_places=6,
        min_value=Decimal(0),
        required=False,
        default=Decimal(0),
        help_text="Premium per MU/min reserved with keep-warm, per hour, on top of the "
        "reserved price; billed as its own invoice line (kind keep_warm). Default 0.",
    )
    currency = serializers.RegexField(r"^[A-Za-z]{3}$", required=False, default="USD")
    ttft_objective_ms = serializers.IntegerField(
        min_value=1,
        max_value=MAX_TTFT_OBJECTIVE_MS,
        required=False,
        allow_null=True,
        default=None,
        help_text="The latency SLA: time-to-first-token objective of guaranteed requests, in "
        "ms (null: none). Comes with latency_credit_tiers.",
    )
    latency_credit_tiers = serializers.JSONField(
        required=False,
        default=list,
        help_text='Attainment to credit: [{"below_attainment_percent": 99, "credit_percent": '
        '10}, {"below_attainment_percent": 95, "credit_percent": 25}] credits 10 % of the '
        "month's commitment when fewer than 99 % of a customer's guaranteed requests got "
        "their first token within the objective, 25 % below 95 %. Requests without a TTFT "
        "are counted on the credit's evidence, not in the attainment.",
    )

    class Meta:
        model = RateCard
        fields = [
            "id",
            "model",
            "effective_from",
            "currency",
            "reserved_price_per_mu_minute_hour",
            "best_effort_price_per_1000_mu",
            "keep_warm_price_per_mu_minute_hour",
            "ttft_objective_ms",
            "latency_credit_tiers",
            "created_at",
        ]
        read_only_fields = ["id", "created_at"]
        # A second card for the same model and date conflicts with what exists: the service
        # answers 409, not a validation 400.
        validators = []


RateCardPermission = scoped_permission(
    "RateCardPermission",
    message="Pricing needs a planner or a key with the catalog:write scope.",
    write_scope=S.CATALOG_WRITE,
)


class RateCardViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    viewsets.GenericViewSet,
):
    """Prices per model, versioned by `effective_from`. A card an issued invoice has used
    cannot change (409): publish a new version that takes effect later."""

    serializer_class = RateCardSerializer
    permission_classes = [RateCardPermission]
    queryset = RateCard.objects.select_related("served_model").order_by(
        "served_model__name", "effective_from"
    )
    filterset_fields = {"served_model__name": ["exact"]}

    def perform_create(self, serializer):
        data = serializer.validated_data
        serializer.instance = rate_card_create(
            served_model=data["served_model"],
            effective_from=data["effective_from"],
            reserved_price_per_mu_minute_hour=data["reserved_price_per_mu_minute_hour"],
            best_effort_price_per_1000_mu=data["best_effort_price_per_1000_mu"],
            keep_warm_price_per_mu_minute_hour=data.get(
                "keep_warm_price_per_mu_minute_hour", Decimal(0)
            ),
            currency=data.get("currency", "USD"),
            ttft_objective_ms=data.get("ttft_objective_ms"),
            latency_credit_tiers=data.get("latency_credit_tiers") or [],
        )

    def perform_update(self, serializer):
        serializer.instance = rate_card_update(
            rate_card=serializer.instance, **serializer.validated_data
        )


# --- Budgets: a customer's monthly budget, its spend to date, its alerts ---------------------

BudgetPermission = scoped_permission(
    "BudgetPermission",
    message="Only planners or a service key with the customers:write scope set budgets.",
    write_scope=S.CUSTOMERS_WRITE,
)

_AMOUNT_HELP = "The most the customer means to spend in a month, in `currency`."
_CAP_HELP = "Past 100 % of the budget, admission refuses best-effort requests (429, limit budget)."
_EMAIL_HELP = "Where alerts are mailed; empty: the customer's owners."
_KEY_HELP = (
    "The prefix of one of the customer's keys: the key's own budget, spent by the requests sent "
    "with it beyond the reservations (their best-effort usage), capped for that key alone; "
    "null: the customer's budget, over all its keys (its invoice's total)."
)


class BudgetSerializer(StrictModelSerializer):
    customer = serializers.SlugRelatedField(slug_field="slug", queryset=Customer.objects.all())
    api_key = serializers.SlugRelatedField(
        slug_field="prefix",
        queryset=ApiKey.objects.filter(customer__isnull=False),
        allow_null=True,
        required=False,
        help_text=_KEY_HELP,
    )
    monthly_amount = serializers.DecimalField(
        max_digits=16, decimal_places=2, min_value=Decimal("0.01"), help_text=_AMOUNT_HELP
    )
    currency = serializers.RegexField(r"^[A-Za-z]{3}$", required=False)
    hard_cap = serializers.BooleanField(required=False, default=False, help_text=_CAP_HELP)
    alert_email = serializers.EmailField(
        required=False, allow_blank=True, default="", help_text=_EMAIL_HELP
    )

    class Meta:
        model = Budget
        fields = [
            "id", "customer", "api_key", "monthly_amount", "currency", "hard_cap",
            "alert_email", "updated_at", "updated_by",
        ]  # fmt: skip
        read_only_fields = ["id", "updated_at", "updated_by"]
        validators: list = []  # one budget per customer and per key: the service's 409


class BudgetChangeSerializer(StrictSerializer):
    unknown_field_message = "cannot be changed; delete the budget and create another."

    monthly_amount = serializers.DecimalField(
        max_digits=16, decimal_places=2, min_value=Decimal("0.01"), required=False
    )
    currency = serializers.RegexField(r"^[A-Za-z]{3}$", required=False)
    hard_cap = serializers.BooleanField(required=False)
    alert_email = serializers.EmailField(required=False, allow_blank=True)


class BudgetFilter(filters.FilterSet):
    customer = filters.CharFilter(field_name="customer__slug")
    api_key = filters.CharFilter(field_name="api_key__prefix")

    class Meta:
        model = Budget
        fields = ["customer", "api_key"]


class BudgetViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    AuditedPatchMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """A monthly budget of a customer (api_key null) or of one of its keys: alerts at 50, 80
    and 100 % of it (email and signed webhook, once each per month), and with `hard_cap`
    best-effort refused past 100 % (the customer's, or only the key's). Customers read their
    own; planners and provisioning services (customers:write) write. `GET .../spend`:
    month-to-date spend (a customer's from the invoice's own lines, a key's from the
    best-effort usage its requests were billed) and the alerts sent."""

    serializer_class = BudgetSerializer
    change_serializer_class = BudgetChangeSerializer
    put_refused_message = "Change a budget with PATCH."
    permission_classes = [BudgetPermission]
    filterset_class = BudgetFilter

    def get_queryset(self):
        principal = principal_of(self.request)
        queryset = Budget.objects.select_related("customer", "api_key").order_by("pk")
        if principal.sees_all_customers or self.request.method not in ("GET", "HEAD", "OPTIONS"):
            return queryset
        return queryset.filter(customer_id__in=principal.customer_ids)

    def perform_create(self, serializer):
        data = serializer.validated_data
        serializer.instance = budgets.budget_create(
            customer=data["customer"],
            api_key=data.get("api_key"),
            monthly_amount=data["monthly_amount"],
            currency=data.get("currency"),
            hard_cap=data.get("hard_cap", False),
            alert_email=data.get("alert_email", ""),
            actor=actor_of(principal_of(self.request)),
        )

    def perform_audited_update(self, instance, *, changes):
        return budgets.budget_update(
            budget=instance, changes=changes, actor=actor_of(principal_of(self.request))
        )

    def perform_destroy(self, instance):
        budgets.budget_delete(budget=instance, actor=actor_of(principal_of(self.request)))

    @extend_schema(
        responses=inline_serializer(
            "BudgetSpend",
            {
                "period": serializers.CharField(),
                "api_key": serializers.CharField(allow_null=True),
                "spend": serializers.DecimalField(max_digits=16, decimal_places=2),
                "currency": serializers.CharField(),
                "percent": serializers.FloatField(),
                "capped": serializers.BooleanField(),
                "alerts": serializers.ListField(child=serializers.DictField()),
            },
        )
    )
    @action(detail=True, methods=["get"])
    def spend(self, request, pk=None):
        budget = self.get_object()
        status = budgets.budget_status(budget)
        return Response(
            {
                "period": status.period,
                "api_key": budget.api_key.prefix if budget.api_key_id else None,
                "spend": str(status.spend),
                "currency": budget.currency,
                "percent": round(status.percent, 2),
                "capped": status.capped,
                "alerts": [
                    {
                        "period": a.period,
                        "threshold_percent": a.threshold_percent,
                        "channel": a.channel,
                        "sent_at": a.sent_at,
                        "error": a.error,
                    }
                    for a in budgets.alerts_of_budget(budget)
                ],
            }
        )
