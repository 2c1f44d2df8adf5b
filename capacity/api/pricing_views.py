from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.permissions import ReadScope, scoped_permission
from capacity.metering.events import MAX_TOKENS, context_problems
from capacity.models import CostModel, GpuType, ServedModel
from capacity.pricing import cost_models
from capacity.pricing.estimates import price_shapes
from controlplane.api.serializers import StrictSerializer

CostModelPermission = scoped_permission(
    "CostModelPermission", message="Only planners activate or retire cost models.", write_scope=None
)


class CostModelSerializer(serializers.ModelSerializer):
    served_model = serializers.SlugRelatedField(slug_field="name", read_only=True)
    gpu_type = serializers.SlugRelatedField(slug_field="name", read_only=True)

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
            "candidates",
            "residuals",
            "source_run",
            "created_at",
            "activated_at",
            "retired_at",
        ]
        read_only_fields = fields


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

    @extend_schema(request=None, responses=CostModelSerializer)
    @action(detail=True, methods=["post"])
    def activate(self, request, pk=None):
        cost_model = cost_models.cost_model_activate(cost_model=self.get_object())
        return Response(CostModelSerializer(cost_model).data)

    @extend_schema(request=None, responses=CostModelSerializer)
    @action(detail=True, methods=["post"])
    def retire(self, request, pk=None):
        cost_model = cost_models.cost_model_retire(cost_model=self.get_object())
        return Response(CostModelSerializer(cost_model).data)


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
