from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import SAFE_METHODS
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.permissions import OPERATORS, ReadScope, scoped_permission
from accounts.principals import principal_of
from capacity.metering.events import MAX_TOKENS, context_problems
from capacity.models import CostModel, GpuType, ServedModel
from capacity.pricing import cost_models
from capacity.pricing.estimates import price_shapes
from capacity.repricing import services as repricing
from core.api.serializers import StrictSerializer
from core.errors import ConflictError

CostModelPermission = scoped_permission(
    "CostModelPermission",
    message="Only planners activate, reject or retire cost models.",
    write_scope=None,
)
# A price review names every customer's usage: the operator's side only.
PriceChangePermission = scoped_permission(
    "PriceChangePermission",
    message="Only planners and platform services see a version's price change per customer.",
    write_scope=None,
    readers=OPERATORS,
)

# What planners and platform services see beyond the public fields: how a version came to be
# in force (or not), and who decided.
REVIEW_FIELDS = [
    "review_reason",
    "price_change",
    "approved_by",
    "approval_reason",
    "rejected_at",
    "rejected_by",
    "rejection_reason",
]


class CostModelPublicSerializer(serializers.ModelSerializer):
    """What everyone signed in reads of a version: its prices and how good the fit is."""

    served_model = serializers.SlugRelatedField(slug_field="name", read_only=True)
    gpu_type = serializers.SlugRelatedField(slug_field="name", read_only=True)
    # benchmarking's reference to the version (benchmarking.CostModelSource), by the run's id.
    source_run = serializers.IntegerField(source="source_run_id", read_only=True, allow_null=True)

    class Meta:
        model = CostModel
        fields = [
            "id",
            "served_model",
            "gpu_type",
            "gpus_per_replica",
            "version",
            "status",
            "features",
            "weights_replica_seconds",
            "replica_mu_per_minute",
            "alpha_mu_per_input_token",
            "beta_mu_per_output_token",
            "gamma_mu_per_request",
            "mu_per_unit",
            "sample_count",
            "distinct_shapes",
            "cv_mape",
            "cv_worst_error",
            "cv_error_by_feature",
            "candidates",
            "residuals",
            "source_run",
            "created_at",
            "activated_at",
            "retired_at",
        ]
        read_only_fields = fields


class CostModelSerializer(CostModelPublicSerializer):
    price_change = serializers.JSONField(
        read_only=True,
        allow_null=True,
        help_text=(
            "How the version moved prices when it was fitted, against the version then active "
            "(totals), against the review's baseline (`baseline`: the last version a planner "
            "approved or the one in force 30 days ago) and which customers it moved past the "
            "limit (`customers_over_limit`); GET …/price-change/ for the figures of now, per "
            "customer and shape."
        ),
    )

    class Meta(CostModelPublicSerializer.Meta):
        fields = [*CostModelPublicSerializer.Meta.fields, *REVIEW_FIELDS]
        read_only_fields = fields


class CostModelDecisionSerializer(StrictSerializer):
    reason = serializers.CharField(
        required=False,
        allow_blank=True,
        max_length=2000,
        help_text="Why: kept on the version and in the audit log.",
    )
    force = serializers.BooleanField(
        required=False,
        default=False,
        help_text=(
            "Activate or retire even though sold reservations would be at risk (409 "
            "capacity_at_risk otherwise); needs a reason."
        ),
    )


class ChangeRowSerializer(serializers.Serializer):
    key = serializers.CharField(help_text="The customer's slug, or the shape bucket.")
    label = serializers.CharField()
    requests = serializers.IntegerField()
    current_mu = serializers.FloatField(help_text="MU under the active version.")
    candidate_mu = serializers.FloatField(help_text="MU under this version.")
    change = serializers.FloatField(
        allow_null=True,
        help_text="candidate ÷ current − 1 (0.072 = +7.2 %); null when only this one charges.",
    )


class PriceChangeSerializer(serializers.Serializer):
    basis = serializers.ChoiceField(
        choices=["traffic", "benchmark_shapes", "default_mix"],
        help_text=(
            "What was priced: the model's requests of the last window_days days, or without "
            "any, the benchmark's shapes (each once), or failing those a typical request."
        ),
    )
    compared_with_id = serializers.IntegerField()
    compared_with_version = serializers.IntegerField()
    window_days = serializers.IntegerField()
    computed_at = serializers.DateTimeField()
    requests = serializers.IntegerField()
    events_in_window = serializers.IntegerField()
    sample_one_in = serializers.IntegerField(help_text="1: every request was priced.")
    customers = serializers.IntegerField()
    prices_usage = serializers.BooleanField(
        help_text=(
            "True on the model's reference GPU type: the MU are customers' usage charges. "
            "Else they are this GPU type's replica time, i.e. what its replicas mint."
        )
    )
    current_mu = serializers.FloatField()
    candidate_mu = serializers.FloatField()
    change = serializers.FloatField(allow_null=True)
    largest_customer_change = serializers.FloatField(allow_null=True)
    description = serializers.CharField()
    total = ChangeRowSerializer()
    by_customer = ChangeRowSerializer(many=True)
    by_shape = ChangeRowSerializer(many=True)


class CostModelViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Fitted cost-model versions. Everyone signed in reads them (prices are public to
    customers); planners activate and retire."""

    serializer_class = CostModelSerializer
    permission_classes = [CostModelPermission]
    queryset = cost_models.cost_models()
    filterset_fields = {
        "served_model__name": ["exact"],
        "gpu_type__name": ["exact"],
        "status": ["exact"],
        "gpus_per_replica": ["exact"],
    }
    ordering_fields = ["created_at", "version", "cv_mape"]

    def get_serializer_class(self):
        if not getattr(self, "swagger_fake_view", False) and self.request.method in SAFE_METHODS:
            principal = principal_of(self.request)
            if not (principal.is_planner or principal.is_service):
                return CostModelPublicSerializer
        return CostModelSerializer

    def _decision(self, request) -> str:
        return self._body(request).get("reason", "")

    def _body(self, request) -> dict:
        body = CostModelDecisionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return dict(body.validated_data)

    @extend_schema(request=CostModelDecisionSerializer, responses=CostModelSerializer)
    @action(detail=True, methods=["post"])
    def activate(self, request, pk=None):
        """Put the version in force (retiring the active one); the caller is recorded as its
        approver, with the reason given."""
        body = self._body(request)
        cost_model = repricing.cost_model_activate(
            cost_model=self.get_object(),
            reason=body.get("reason", ""),
            force=body.get("force", False),
        )
        return Response(CostModelSerializer(cost_model).data)

    @extend_schema(request=CostModelDecisionSerializer, responses=CostModelSerializer)
    @action(detail=True, methods=["post"])
    def reject(self, request, pk=None):
        """Turn a candidate down after review (409 for any other status)."""
        cost_model = repricing.cost_model_reject(
            cost_model=self.get_object(), reason=self._decision(request)
        )
        return Response(CostModelSerializer(cost_model).data)

    @extend_schema(request=CostModelDecisionSerializer, responses=CostModelSerializer)
    @action(detail=True, methods=["post"])
    def retire(self, request, pk=None):
        body = self._body(request)
        cost_model = repricing.cost_model_retire(
            cost_model=self.get_object(),
            force=body.get("force", False),
            reason=body.get("reason", ""),
        )
        return Response(CostModelSerializer(cost_model).data)

    @extend_schema(responses=PriceChangeSerializer)
    @action(
        detail=True,
        methods=["get"],
        url_path="price-change",
        permission_classes=[PriceChangePermission],
    )
    def price_change(self, request, pk=None):
        """What activating this version would do to prices now: the last 7 days of the
        model's requests priced under the active version and under this one, in total, per
        customer and per shape bucket. 409 when it is the active version or none is active."""
        cost_model = self.get_object()
        change = repricing.cost_model_price_change(cost_model=cost_model)
        if change is None:
            raise ConflictError(
                f"Version {cost_model.version} has nothing to be compared with: "
                + (
                    "it is the active version."
                    if cost_model.status == CostModel.Status.ACTIVE
                    else "no version of its model, GPU type and size is active."
                ),
                field="status",
                code="nothing_to_compare",
            )
        return Response(PriceChangeSerializer(change.as_dict()).data)


class ShapeSerializer(StrictSerializer):
    """A request shape. Its tokens must fit the model's context (checked with the model)."""

    input_tokens = serializers.IntegerField(
        min_value=0, max_value=MAX_TOKENS, help_text="All prompt tokens."
    )
    cached_input_tokens = serializers.IntegerField(
        min_value=0,
        max_value=MAX_TOKENS,
        default=0,
        help_text="Of input_tokens, how many hit the prefix cache.",
    )
    output_tokens = serializers.IntegerField(min_value=0, max_value=MAX_TOKENS)
    images = serializers.IntegerField(min_value=0, max_value=MAX_TOKENS, default=0)

    def validate(self, attrs):
        if attrs["cached_input_tokens"] > attrs["input_tokens"]:
            raise serializers.ValidationError(
                {"cached_input_tokens": ["must not exceed input_tokens."]}
            )
        return attrs


class EstimateRequestSerializer(StrictSerializer):
    model = serializers.SlugRelatedField(slug_field="name", queryset=ServedModel.objects.all())
    gpu_type = serializers.SlugRelatedField(
        slug_field="name",
        queryset=GpuType.objects.all(),
        required=False,
        help_text="Default: the model's reference GPU type, whose MU is the model's currency.",
    )
    shapes = ShapeSerializer(many=True, allow_empty=False, max_length=10_000)

    def validate(self, attrs):
        context = attrs["model"].context_length_tokens
        problems = [
            context_problems(context, shape["input_tokens"], shape["output_tokens"])
            for shape in attrs["shapes"]
        ]
        if any(problems):
            raise serializers.ValidationError({"shapes": problems})
        return attrs


class PricedShapeSerializer(ShapeSerializer):
    replica_seconds = serializers.FloatField()
    mu = serializers.FloatField()
    requests_per_s = serializers.FloatField(allow_null=True)


class EstimateResponseSerializer(serializers.Serializer):
    model = serializers.CharField()
    gpu_type = serializers.CharField()
    cost_model_id = serializers.IntegerField()
    cost_model_version = serializers.IntegerField()
    cost_model_status = serializers.CharField()
    replica_mu_per_minute = serializers.FloatField()
    shapes = PricedShapeSerializer(many=True)
    total_mu = serializers.FloatField()


class CostEstimateView(APIView):
    """MU and replica-seconds per request shape, from the active cost model (or the newest
    candidate while none is active). A read, posted for the size of its body: needs `read`."""

    permission_classes = [ReadScope]

    @extend_schema(request=EstimateRequestSerializer, responses=EstimateResponseSerializer)
    def post(self, request):
        serializer = EstimateRequestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        served_model = serializer.validated_data["model"]
        cost_model = cost_models.pricing_cost_model(
            served_model=served_model, gpu_type=serializer.validated_data.get("gpu_type")
        )
        shapes = serializer.validated_data["shapes"]
        priced = price_shapes(cost_model, shapes)
        body = {
            "model": served_model.name,
            "gpu_type": cost_model.gpu_type.name,
            "cost_model_id": cost_model.pk,
            "cost_model_version": cost_model.version,
            "cost_model_status": cost_model.status,
            "replica_mu_per_minute": cost_model.replica_mu_per_minute,
            "shapes": priced,
            "total_mu": sum(row["mu"] for row in priced),
        }
        return Response(body)
