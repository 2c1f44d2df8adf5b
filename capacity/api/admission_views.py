"""POST /api/v1/admission: may this request run, in which class (capacity/admission/gate.py)."""

import math

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts import scopes as S
from accounts.models import Customer
from accounts.principals import principal_of
from capacity.admission.gate import admit
from controlplane.api.serializers import StrictSerializer, identifier_validator
from controlplane.errors import DomainError

MAX_TOKENS_LIMIT = 10_000_000


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

    def validate(self, data):
        if data["cached_input_tokens"] > data["input_tokens"]:
            raise serializers.ValidationError({"cached_input_tokens": "cannot exceed input_tokens"})
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
    },
)


class AdmissionView(APIView):
    """Admit a request as guaranteed (within the customer's reservation), best-effort (within
    the latest tick's allowance), or refuse it: 429 with Retry-After and the same body.
    `priority` is what to pass to vLLM's priority scheduling (lower runs first)."""

    # Gateways ask once per request; admission's own buckets are the limit, not the write throttle.
    throttle_classes = []

    @extend_schema(
        request=AdmissionRequest, responses={200: AdmissionResponse, 429: AdmissionResponse}
    )
    def post(self, request):
        principal = principal_of(request)
        if not (principal.has_scope(S.ADMISSION) or principal.is_planner):
            raise PermissionDenied("Asking for admission needs the admission scope.")
        body = AdmissionRequest(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        customer_id = _customer_id(principal, data.get("customer"))
        decision = admit(
            customer_id=customer_id,
            model=data["model"],
            input_tokens=data["input_tokens"],
            cached_input_tokens=data["cached_input_tokens"],
            max_tokens=data["max_tokens"],
            request_id=data.get("request_id"),
        )
        if decision.admitted:
            return Response(decision.as_dict())
        response = Response(decision.as_dict(), status=status.HTTP_429_TOO_MANY_REQUESTS)
        if decision.retry_after_ms is not None:
            response["Retry-After"] = str(max(1, math.ceil(decision.retry_after_ms / 1000)))
        return response


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
