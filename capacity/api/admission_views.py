"""POST /api/v1/admission: may this request run, in which class (capacity/admission/gate.py);
/api/v1/request-limits/: the RPM, TPM and concurrency limits planners set
(capacity/admission/limits.py)."""

import math

from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts import scopes as S
from accounts.models import ApiKey, Customer
from accounts.permissions import scoped_permission
from accounts.principals import principal_of
from capacity.admission import limits as request_limits
from capacity.admission.gate import admit
from capacity.models import RequestLimit
from core.api.mixins import AuditedPatchMixin
from core.api.serializers import (
    StrictModelSerializer,
    StrictSerializer,
    identifier_validator,
)
from core.audit import actor_of
from core.errors import DomainError

MAX_TOKENS_LIMIT = 10_000_000


# The ids `python -m dataplane.gateway` mints for its requests ("gw-" and 32 hex digits).
GATEWAY_REQUEST_ID_PREFIX = "gw-"


class AdmissionRequest(StrictSerializer):
    model = serializers.CharField(max_length=200)
    input_tokens = serializers.IntegerField(min_value=0, max_value=MAX_TOKENS_LIMIT)
    cached_input_tokens = serializers.IntegerField(
        min_value=0, max_value=MAX_TOKENS_LIMIT, default=0
    )
    max_tokens = serializers.IntegerField(min_value=1, max_value=MAX_TOKENS_LIMIT)
    request_id = serializers.CharField(
        max_length=100,
        required=False,
        validators=[identifier_validator()],
        help_text="The id the request's usage event will carry (event_id): it settles the "
        "estimate against what the request used.",
    )
    customer = serializers.SlugField(
        required=False, help_text="Platform keys only: the customer the request is for."
    )
    api_key = serializers.CharField(
        max_length=16,
        required=False,
        help_text="Platform keys only: the prefix of the customer's key the request came with, "
        "whose own request limits apply too. A customer key's own limits always apply.",
    )

    def validate(self, data):
        if data["cached_input_tokens"] > data["input_tokens"]:
            raise serializers.ValidationError({"cached_input_tokens": "cannot exceed input_tokens"})
        request_id = data.get("request_id") or ""
        principal = principal_of(self.context["request"]) if "request" in self.context else None
        platform = principal is not None and (principal.is_service or principal.is_planner)
        if request_id.startswith(GATEWAY_REQUEST_ID_PREFIX) and not platform:
            # The gateway's own ids (answered to clients as X-Request-Id): a customer key
            # asking admission under one would take over the gateway's request.
            raise serializers.ValidationError(
                {
                    "request_id": f"ids starting with '{GATEWAY_REQUEST_ID_PREFIX}' are the "
                    "gateway's; a customer key names its own requests otherwise"
                }
            )
        return data


AdmissionResponse = inline_serializer(
    "Admission",
    {
        "admitted": serializers.BooleanField(),
        "class": serializers.ChoiceField(["guaranteed", "best_effort", "refused"]),
        "priority": serializers.IntegerField(allow_null=True),
        "estimated_mu": serializers.FloatField(),
        "retry_after_ms": serializers.IntegerField(allow_null=True),
        "limits": serializers.DictField(),
        "degraded": serializers.BooleanField(),
        "reason": serializers.CharField(),
        "max_tokens": serializers.IntegerField(
            allow_null=True, help_text="Set while degraded: cap the request's max_tokens here."
        ),
        "fallback_model": serializers.CharField(
            allow_null=True, help_text="Set while degraded: send the refused request here."
        ),
        "degradation_level": serializers.IntegerField(),
        "guaranteed_mu": serializers.FloatField(
            help_text="Of estimated_mu, the part within the guarantee (what was left of it)."
        ),
        "best_effort_mu": serializers.FloatField(
            help_text="Of estimated_mu, the part beyond the guarantee: best-effort."
        ),
        "limit": serializers.ChoiceField(
            ["mu", "rpm", "tpm", "concurrency", "budget", "degradation"],
            allow_null=True,
            help_text="Refused: the limit that bit (null when admitted); budget: the monthly "
            "budget of the customer (or, with limit_scope api_key, of the key) is spent and its "
            "hard cap refuses best-effort.",
        ),
        "limit_scope": serializers.ChoiceField(
            ["customer", "api_key"],
            allow_null=True,
            help_text="Refused by a request limit or a budget's hard cap: whose (the "
            "customer's or the key's).",
        ),
    },
)


class AdmissionView(APIView):
    """Admit a request as guaranteed (within the customer's reservation), best-effort (what is
    left of the reservation, the rest within the latest tick's allowance), or refuse it: 429
    with Retry-After and the same body, `limit` naming what bit (the MU buckets, or the
    customer's or key's RPM, TPM or concurrency limit). `priority` is what to pass to vLLM's
    priority scheduling (lower runs first)."""

    # Gateways ask once per request; admission's own buckets are the limit, not the write throttle.
    throttle_classes = []

    @extend_schema(
        request=AdmissionRequest, responses={200: AdmissionResponse, 429: AdmissionResponse}
    )
    def post(self, request):
        principal = principal_of(request)
        if not (principal.has_scope(S.ADMISSION) or principal.is_planner):
            raise PermissionDenied("Asking for admission needs the admission scope.")
        body = AdmissionRequest(data=request.data, context={"request": request})
        body.is_valid(raise_exception=True)
        data = body.validated_data
        customer_id = _customer_id(principal, data.get("customer"))
        api_key_prefix = _api_key_prefix(principal, customer_id, data.get("api_key"))
        decision = admit(
            customer_id=customer_id,
            model=data["model"],
            input_tokens=data["input_tokens"],
            cached_input_tokens=data["cached_input_tokens"],
            max_tokens=data["max_tokens"],
            request_id=data.get("request_id"),
            api_key_prefix=api_key_prefix,
            owner=_owner(principal),
        )
        if decision.admitted:
            return Response(decision.as_dict())
        response = Response(decision.as_dict(), status=status.HTTP_429_TOO_MANY_REQUESTS)
        if decision.retry_after_ms is not None:
            response["Retry-After"] = str(max(1, math.ceil(decision.retry_after_ms / 1000)))
        return response


def _owner(principal) -> str:
    """Who asks, kept in the admission record: the only one who may ask again under the same
    request id (while it was refused)."""
    if principal.api_key is not None:
        return "k" + principal.api_key.prefix
    user = principal.user
    return f"u{user.pk}" if user is not None else ""


def _customer_id(principal, slug: str | None) -> int:
    own = principal.api_key.customer if principal.api_key is not None else None
    if own is not None:
        if slug and slug != own.slug:
            raise DomainError("A customer key asks for its own customer only.", field="customer")
        return own.pk
    if not (principal.is_service or principal.is_planner):
        raise PermissionDenied("Only customer keys, platform keys and planners ask for admission.")
    if not slug:
        raise DomainError("Name the customer the request is for.", field="customer")
    customer = Customer.objects.filter(slug=slug).first()
    if customer is None:
        raise DomainError(f"No customer '{slug}'.", field="customer")
    return customer.pk


def _api_key_prefix(principal, customer_id: int, named: str | None) -> str | None:
    """The customer key whose request limits apply: the caller's own, or the one a platform
    key names (it must be one of the customer's)."""
    own = principal.api_key if principal.api_key is not None else None
    if own is not None and own.customer_id is not None:
        if named and named != own.prefix:
            raise DomainError("A customer key asks for its own requests only.", field="api_key")
        return own.prefix
    if not named:
        return None
    if not ApiKey.objects.filter(prefix=named, customer_id=customer_id).exists():
        raise DomainError(f"No key '{named}' of this customer.", field="api_key")
    return named


# --- Request limits: RPM, TPM and concurrency per customer and per key ------------------------

RequestLimitPermission = scoped_permission(
    "RequestLimitPermission",
    message="Only planners or a service key with the customers:write scope set request limits.",
    write_scope=S.CUSTOMERS_WRITE,
)


def _limit_field(help_text: str):
    return serializers.IntegerField(
        min_value=1,
        max_value=request_limits.MAX_LIMIT,
        allow_null=True,
        required=False,
        help_text=help_text + " Null: no limit.",
    )


_RPM_HELP = "Requests admitted in any sliding 60 s window."
_TPM_HELP = "input_tokens + max_tokens of the requests admitted in any sliding 60 s window."
_CONCURRENCY_HELP = (
    "Requests in flight at once: freed at the gateway's end of the request or by its usage "
    "event, at the latest after ADMISSION_CONCURRENCY_TTL_SECONDS."
)


class RequestLimitSerializer(StrictModelSerializer):
    customer = serializers.SlugRelatedField(slug_field="slug", queryset=Customer.objects.all())
    api_key = serializers.SlugRelatedField(
        slug_field="prefix",
        queryset=ApiKey.objects.filter(customer__isnull=False),
        allow_null=True,
        required=False,
        help_text="The prefix of one of the customer's keys; null: the customer's limits, over "
        "all its keys. A request sent with a key is under both.",
    )
    requests_per_minute = _limit_field(_RPM_HELP)
    tokens_per_minute = _limit_field(_TPM_HELP)
    concurrent_requests = _limit_field(_CONCURRENCY_HELP)

    class Meta:
        model = RequestLimit
        fields = [
            "id",
            "customer",
            "api_key",
            "requests_per_minute",
            "tokens_per_minute",
            "concurrent_requests",
            "updated_at",
            "updated_by",
        ]
        read_only_fields = ["id", "updated_at", "updated_by"]
        # One row per customer or key is the service's to say (409, naming it), not a 400.
        validators: list = []


class RequestLimitChangeSerializer(StrictSerializer):
    unknown_field_message = "cannot be changed; delete the limit and create another."

    requests_per_minute = _limit_field(_RPM_HELP)
    tokens_per_minute = _limit_field(_TPM_HELP)
    concurrent_requests = _limit_field(_CONCURRENCY_HELP)


class RequestLimitFilter(filters.FilterSet):
    customer = filters.CharFilter(field_name="customer__slug")

    class Meta:
        model = RequestLimit
        fields = ["customer"]


class RequestLimitViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    AuditedPatchMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Requests per minute, tokens per minute and requests in flight per customer (api_key
    null) or per customer key, beside the MU buckets. Customers read their own; planners and
    provisioning services (customers:write) write. Enforced by admission and gateways in the
    same Redis round trip as the MU buckets; published at once after every change."""

    serializer_class = RequestLimitSerializer
    change_serializer_class = RequestLimitChangeSerializer
    put_refused_message = "Change request limits with PATCH."
    permission_classes = [RequestLimitPermission]
    filterset_class = RequestLimitFilter

    def get_queryset(self):
        principal = principal_of(self.request)
        queryset = RequestLimit.objects.select_related("customer", "api_key").order_by("pk")
        if principal.sees_all_customers or self.request.method not in ("GET", "HEAD", "OPTIONS"):
            # Writers provision every customer, whether or not their key may read them.
            return queryset
        return queryset.filter(customer_id__in=principal.customer_ids)

    def perform_create(self, serializer):
        data = serializer.validated_data
        serializer.instance = request_limits.request_limit_set(
            customer=data["customer"],
            api_key=data.get("api_key"),
            requests_per_minute=data.get("requests_per_minute"),
            tokens_per_minute=data.get("tokens_per_minute"),
            concurrent_requests=data.get("concurrent_requests"),
            replace=False,
            actor=actor_of(principal_of(self.request)),
        )

    def perform_audited_update(self, instance, *, changes):
        return request_limits.request_limit_update(
            limit=instance, changes=changes, actor=actor_of(principal_of(self.request))
        )

    def perform_destroy(self, instance):
        request_limits.request_limit_delete(
            limit=instance, actor=actor_of(principal_of(self.request))
        )

    def get_object(self):
        try:
            return super().get_object()
        except NotFound:
            raise NotFound("No such request limit.") from None
