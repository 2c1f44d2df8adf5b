from rest_framework import serializers

from benchmarking.models import BenchmarkRun, BenchmarkSample, BenchmarkSuite
from capacity.models import Deployment, GpuType, ServedModel
from core.api.serializers import FreeTextField, StrictModelSerializer, StrictSerializer

# A latency SLO of an hour is already no SLO.
MAX_SLO_MS = 3_600_000
# PositiveIntegerField's upper bound on PostgreSQL.
MAX_INT = 2_147_483_647


class BenchmarkSuiteSerializer(StrictModelSerializer):
    description = FreeTextField()
    # Checked shape by shape by benchmarking.services.validate_grid, which names the entry.
    grid = serializers.ListField(
        child=serializers.JSONField(),
        min_length=1,
        max_length=400,
        help_text=(
            "Request shapes: [input_len, output_len], or {input_len, output_len, prefix_share "
            "(0 to <1: the share of the prompt every request of the shape shares), images "
            "(per request)}."
        ),
    )

    class Meta:
        model = BenchmarkSuite
        fields = [
            "id",
            "name",
            "description",
            "grid",
            "slo_ttft_p95_ms",
            "slo_tpot_p95_ms",
            "duration_per_point_seconds",
            "concurrency_start",
            "max_concurrency",
            "min_throughput_growth",
            "max_error_rate",
            "request_timeout_seconds",
            "created_at",
        ]
        read_only_fields = ["id", "created_at"]
        validators = []
        extra_kwargs = {
            "concurrency_start": {"min_value": 1, "max_value": 4096},
            "max_concurrency": {"min_value": 1, "max_value": 4096},
            "min_throughput_growth": {"min_value": 0.0, "max_value": 1.0},
            "max_error_rate": {"min_value": 0.0, "max_value": 1.0},
            "request_timeout_seconds": {"min_value": 0.1, "max_value": 3600},
            "duration_per_point_seconds": {"min_value": 0.1, "max_value": 3600},
            "slo_ttft_p95_ms": {"min_value": 0.001, "max_value": MAX_SLO_MS},
            "slo_tpot_p95_ms": {"min_value": 0.001, "max_value": MAX_SLO_MS},
        }


class BenchmarkRunSerializer(serializers.ModelSerializer):
    suite = serializers.SlugRelatedField(slug_field="name", read_only=True)
    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True)
    served_model = serializers.SlugRelatedField(slug_field="name", read_only=True)
    gpu_type = serializers.SlugRelatedField(slug_field="name", read_only=True)
    progress_fraction = serializers.FloatField(read_only=True)

    class Meta:
        model = BenchmarkRun
        fields = [
            "id",
            "suite",
            "deployment",
            "served_model",
            "gpu_type",
            "gpus_per_replica",
            "replicas",
            "endpoint_url",
            "engine_model_id",
            "source",
            "source_detail",
            "status",
            "progress_done",
            "progress_total",
            "progress_fraction",
            "progress_message",
            "attempts",
            "error",
            "fit_error",
            "log",
            "created_at",
            "started_at",
            "heartbeat_at",
            "finished_at",
        ]
        read_only_fields = fields


class BenchmarkRunCreateSerializer(StrictSerializer):
    suite = serializers.SlugRelatedField(slug_field="name", queryset=BenchmarkSuite.objects.all())
    deployment = serializers.SlugRelatedField(
        slug_field="name", queryset=Deployment.objects.all(), required=False
    )
    endpoint_url = serializers.URLField(required=False, allow_blank=True, max_length=500)
    served_model = serializers.SlugRelatedField(
        slug_field="name", queryset=ServedModel.objects.all(), required=False
    )
    gpu_type = serializers.SlugRelatedField(
        slug_field="name", queryset=GpuType.objects.all(), required=False
    )
    gpus_per_replica = serializers.IntegerField(min_value=1, max_value=MAX_INT, required=False)
    replicas = serializers.IntegerField(min_value=1, max_value=1000, default=1)


class BenchmarkSampleSerializer(serializers.ModelSerializer):
    class Meta:
        model = BenchmarkSample
        fields = [
            "id",
            "input_len",
            "output_len",
            "cached_input_len",
            "images",
            "concurrency",
            "requests_per_s",
            "input_tokens_per_s",
            "output_tokens_per_s",
            "ttft_p50_ms",
            "ttft_p95_ms",
            "tpot_p50_ms",
            "tpot_p95_ms",
            "e2e_p95_ms",
            "request_count",
            "error_count",
            "slo_met",
            "sustainable",
        ]
        read_only_fields = fields
