from rest_framework import serializers

from capacity.catalog.selectors import benchmark_suites
from capacity.catalog.services import DEPLOYMENT_FIELDS, SERVED_MODEL_FIELDS
from capacity.metering.events import MAX_TOKENS
from capacity.models import ActuatorKind, Deployment, GpuPool, GpuType, ServedModel
from core.api.serializers import (
    FreeTextField,
    StrictModelSerializer,
    no_control_characters,
)

# Larger than any model built (about 100 times the largest known), far below overflow.
MAX_PARAMETERS_BILLIONS = 100_000


class ForceFields(serializers.Serializer):
    """A change that would leave sold capacity unserved is refused (409, naming the
    reservations at risk) unless forced with a reason (capacity.selling.at_risk)."""

    force = serializers.BooleanField(
        write_only=True,
        required=False,
        default=False,
        help_text="Make the change even though sold reservations would be at risk.",
    )
    force_reason = FreeTextField(
        write_only=True, help_text="Why it is forced: required with force, kept in the audit log."
    )


FORCE_FIELDS = ["force", "force_reason"]


class GpuTypeSerializer(StrictModelSerializer):
    hourly_cost_usd = serializers.DecimalField(max_digits=10, decimal_places=4, min_value=0)

    class Meta:
        model = GpuType
        fields = ["id", "name", "memory_gb", "hourly_cost_usd"]
        read_only_fields = ["id"]
        extra_kwargs = {"memory_gb": {"min_value": 1}}

    def validate_name(self, value: str) -> str:
        return no_control_characters(value)


class GpuTypePublicSerializer(serializers.ModelSerializer):
    """What customers see of a GPU type: not its cost."""

    class Meta:
        model = GpuType
        fields = ["id", "name", "memory_gb"]
        read_only_fields = fields


class GpuPoolSerializer(ForceFields, StrictModelSerializer):
    gpu_type = serializers.SlugRelatedField(slug_field="name", queryset=GpuType.objects.all())

    class Meta:
        model = GpuPool
        fields = ["id", "name", "gpu_type", "gpu_count", *FORCE_FIELDS]
        read_only_fields = ["id"]

    def validate_name(self, value: str) -> str:
        return no_control_characters(value)


class ServedModelSerializer(ForceFields, StrictModelSerializer):
    reference_gpu_type = serializers.SlugRelatedField(
        slug_field="name", queryset=GpuType.objects.all()
    )

    class Meta:
        model = ServedModel
        fields = ["id", *SERVED_MODEL_FIELDS, *FORCE_FIELDS]
        read_only_fields = ["id"]
        extra_kwargs = {
            # Bounds of best-effort growth (capacity.allocation.policy); null: unbounded.
            "best_effort_ceiling_mu_per_minute": {"min_value": 0.0, "max_value": 1e9},
            "best_effort_ceiling_replicas": {"min_value": 0, "max_value": 100_000},
            "parameters_billions": {"min_value": 0, "max_value": MAX_PARAMETERS_BILLIONS},
            # Selling: sellable = deployable × (1 − headroom) × overcommit (set by catalog
            # writers; the database's constraints hold the same bounds).
            "headroom": {"min_value": 0.0, "max_value": 0.99},
            "overcommit": {"min_value": 0.01, "max_value": 100.0},
            # Usage events are bounded by it, and their token counts by MAX_TOKENS.
            "context_length_tokens": {"min_value": 1, "max_value": MAX_TOKENS},
        }

    def validate_engine_model_id(self, value: str) -> str:
        return no_control_characters(value)


class DeploymentSerializer(ForceFields, StrictModelSerializer):
    served_model = serializers.SlugRelatedField(
        slug_field="name", queryset=ServedModel.objects.all()
    )
    gpu_pool = serializers.SlugRelatedField(slug_field="name", queryset=GpuPool.objects.all())
    actuator_kind = serializers.ChoiceField(choices=ActuatorKind.choices, required=False)
    actuator_config = serializers.JSONField(required=False)
    engine_profile = serializers.JSONField(
        required=False,
        help_text=(
            "The engine's parameters the what-if simulates a replica with: max_num_seqs, "
            "max_num_batched_tokens, kv_cache_tokens, context_length (whole numbers; a missing "
            "one takes vLLM's default)."
        ),
    )
    target_utilisation = serializers.FloatField(required=False, min_value=0.01, max_value=1.0)
    benchmark_suite = serializers.SlugRelatedField(
        slug_field="name",
        # benchmarking's reference to the deployment, read back as Deployment.benchmark_suite.
        queryset=benchmark_suites(),
        required=False,
        allow_null=True,
        help_text="The suite the nightly benchmark runs (see benchmark_nightly).",
    )

    class Meta:
        model = Deployment
        fields = [
            "id",
            *DEPLOYMENT_FIELDS,
            "actuator_config_problem",
            "created_at",
            "updated_at",
            *FORCE_FIELDS,
        ]
        read_only_fields = ["id", "actuator_config_problem", "created_at", "updated_at"]
        extra_kwargs = {"gpus_per_replica": {"min_value": 1}}
        # The database's min ≤ max constraint is checked by the service with a clearer message.
        validators = []


# What customers see of a deployment, by allowlist: never where it runs or how it is driven
# (endpoint_url, actuator_config, prometheus_selector) nor its benchmarks; a field added to the
# full serializer stays hidden from customers until it is added here.
DEPLOYMENT_PUBLIC_FIELDS = [
    "id",
    "name",
    "served_model",
    "gpu_pool",
    "gpus_per_replica",
    "min_replicas",
    "max_replicas",
    "current_replicas",
    "cold_start_seconds",
    "scale_to_zero_after_seconds",
    "target_utilisation",
    "actuator_kind",  # filterable anyway (?actuator_kind=)
    "created_at",
    "updated_at",
]


class DeploymentPublicSerializer(serializers.ModelSerializer):
    served_model = serializers.SlugRelatedField(slug_field="name", read_only=True)
    gpu_pool = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Deployment
        fields = DEPLOYMENT_PUBLIC_FIELDS
        read_only_fields = fields
