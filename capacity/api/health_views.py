"""Runtime health over the API: replicas, incidents with their timed steps, degradation per
model, a model's degradation policy, and resetting a deployment's probe fingerprint.

Fleet-wide data, not a customer's: planners and service keys with `read` see it; changes
need a planner or a service key with `catalog:write`.
"""

from django.db.models import Prefetch
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
    inline_serializer,
)
from rest_framework import generics, serializers, status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts import scopes as S
from accounts.permissions import OPERATORS, scoped_permission
from capacity.api.allocation_views import FleetReader
from capacity.health.services import (
    MAX_SECONDS,
    POLICY_FIELDS,
    degradation_policy_save,
    fingerprint_reset,
    level_in_words,
    seconds_to_ready,
    seconds_to_restart_requested,
    step_timings,
)
from capacity.models import (
    DegradationChange,
    DegradationPolicy,
    Deployment,
    Incident,
    Replica,
    ServedModel,
)
from core.api.serializers import StrictModelSerializer

RECENT_CHANGES = 10


# Changing health settings is a catalog change; reading them is the operator's business.
HealthWriter = scoped_permission(
    "HealthWriter",
    message="Only planners or a service key with the catalog:write scope may change this.",
    write_scope=S.CATALOG_WRITE,
    readers=OPERATORS,
)

# --- Replicas -------------------------------------------------------------------------------


class ReplicaSerializer(serializers.ModelSerializer):
    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True)
    model = serializers.CharField(source="deployment.served_model.name", read_only=True)

    class Meta:
        model = Replica
        fields = [
            "id",
            "deployment",
            "model",
            "key",
            "url",
            "state",
            "consecutive_failures",
            "last_probe_at",
            "last_ok_at",
            "last_latency_ms",
            "last_error",
            "failing_since",
            "unhealthy_since",
            "first_seen_at",
        ]
        read_only_fields = fields


@extend_schema(responses=ReplicaSerializer(many=True))
class ReplicaListView(generics.ListAPIView):
    """Every replica the probes know, with its last probe."""

    serializer_class = ReplicaSerializer
    permission_classes = [FleetReader]
    queryset = Replica.objects.select_related("deployment__served_model").order_by(
        "deployment__name", "key"
    )
    filterset_fields = {"deployment__name": ["exact"], "state": ["exact"]}
    ordering_fields = ["last_probe_at", "consecutive_failures"]


# --- Incidents ------------------------------------------------------------------------------


class IncidentStepSerializer(serializers.Serializer):
    step = serializers.CharField()
    label = serializers.CharField()
    at = serializers.DateTimeField()
    detail = serializers.CharField()
    seconds_since_detection = serializers.FloatField()


class IncidentSerializer(serializers.ModelSerializer):
    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True)
    replica = serializers.CharField(source="replica.key", read_only=True)
    open = serializers.SerializerMethodField()
    seconds_to_restart_requested = serializers.SerializerMethodField()
    seconds_to_ready = serializers.SerializerMethodField()
    steps = serializers.SerializerMethodField()

    class Meta:
        model = Incident
        fields = [
            "id",
            "deployment",
            "replica",
            "cause",
            "detail",
            "open",
            "detected_at",
            "restart_requested_at",
            "restart_error",
            "ready_at",
            "seconds_to_restart_requested",
            "seconds_to_ready",
            "steps",
        ]
        read_only_fields = fields

    def get_open(self, incident) -> bool:
        return incident.ended_at is None

    def get_seconds_to_restart_requested(self, incident) -> float | None:
        return seconds_to_restart_requested(incident)

    def get_seconds_to_ready(self, incident) -> float | None:
        return seconds_to_ready(incident)

    @extend_schema_field(IncidentStepSerializer(many=True))
    def get_steps(self, incident) -> list[dict]:
        return IncidentStepSerializer(step_timings(incident), many=True).data


TRUE_WORDS = {"true", "1", "yes"}
FALSE_WORDS = {"false", "0", "no"}


@extend_schema(
    parameters=[
        OpenApiParameter(
            "open", OpenApiTypes.BOOL, description="true: open incidents only; false: closed."
        )
    ],
    responses=IncidentSerializer(many=True),
)
class IncidentListView(generics.ListAPIView):
    """Incidents, newest first, each with its steps and timings."""

    serializer_class = IncidentSerializer
    permission_classes = [FleetReader]
    filterset_fields = {"deployment__name": ["exact"], "cause": ["exact"]}
    ordering_fields = ["detected_at"]

    def get_queryset(self):
        queryset = Incident.objects.select_related("deployment", "replica").prefetch_related(
            "steps"
        )
        wanted = self.request.query_params.get("open")
        if wanted is not None:
            if wanted.lower() in TRUE_WORDS:
                queryset = queryset.filter(ended_at__isnull=True)
            elif wanted.lower() in FALSE_WORDS:
                queryset = queryset.filter(ended_at__isnull=False)
            else:
                raise ValidationError({"open": ["must be true or false."]})
        return queryset.order_by("-detected_at", "-id")


# --- Degradation ----------------------------------------------------------------------------


class PolicySerializer(StrictModelSerializer):
    """A model's degradation policy; on PUT, fields left out keep their current value (or
    the default for a new policy)."""

    model = serializers.CharField(source="served_model.name", read_only=True)
    enabled = serializers.BooleanField(required=False)
    degrade_below = serializers.FloatField(required=False)
    recover_at = serializers.FloatField(required=False)
    window_seconds = serializers.IntegerField(required=False, min_value=0, max_value=MAX_SECONDS)
    hysteresis_seconds = serializers.IntegerField(
        required=False, min_value=0, max_value=MAX_SECONDS
    )
    max_tokens_cap = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=MAX_SECONDS
    )
    fallback_model = serializers.SlugRelatedField(
        slug_field="name", queryset=ServedModel.objects.all(), required=False, allow_null=True
    )

    class Meta:
        model = DegradationPolicy
        fields = ["model", *POLICY_FIELDS, "updated_at"]
        read_only_fields = ["model", "updated_at"]


class ChangeSerializer(serializers.ModelSerializer):
    class Meta:
        model = DegradationChange
        fields = ["at", "from_level", "to_level", "healthy_share", "reason"]
        read_only_fields = fields


class ActionSerializer(serializers.Serializer):
    action = serializers.CharField()
    words = serializers.CharField()


class DegradationSerializer(serializers.Serializer):
    model = serializers.CharField()
    level = serializers.IntegerField()
    actions = ActionSerializer(many=True)
    in_words = serializers.CharField()
    healthy_share = serializers.FloatField(allow_null=True)
    changed_at = serializers.DateTimeField(allow_null=True)
    below_since = serializers.DateTimeField(allow_null=True)
    above_since = serializers.DateTimeField(allow_null=True)
    evaluated_at = serializers.DateTimeField(allow_null=True)
    policy = PolicySerializer(allow_null=True)
    recent_changes = ChangeSerializer(many=True)

    def to_representation(self, served_model):
        state = getattr(served_model, "degradation_state", None)
        policy = getattr(served_model, "degradation_policy", None)
        level = state.level if state else 0
        words = level_in_words(level, policy)
        return {
            "model": served_model.name,
            "level": level,
            "actions": [
                {"action": action, "words": word}
                for action, word in zip(words.actions, words.words, strict=True)
            ],
            "in_words": words.summary,
            "healthy_share": state.healthy_share if state else None,
            "changed_at": state.changed_at if state else None,
            "below_since": state.below_since if state else None,
            "above_since": state.above_since if state else None,
            "evaluated_at": state.evaluated_at if state else None,
            "policy": PolicySerializer(policy).data if policy else None,
            "recent_changes": ChangeSerializer(served_model.recent_changes, many=True).data,
        }


@extend_schema(responses=DegradationSerializer(many=True))
class DegradationListView(generics.ListAPIView):
    """Per served model: its degradation now, its policy, and its last level changes."""

    serializer_class = DegradationSerializer
    permission_classes = [FleetReader]
    filterset_fields = {"name": ["exact"]}
    ordering_fields = ["name"]

    def get_queryset(self):
        return (
            ServedModel.objects.select_related(
                "degradation_state", "degradation_policy__fallback_model"
            )
            .prefetch_related(
                Prefetch(
                    "degradation_changes",
                    queryset=DegradationChange.objects.order_by("-at", "-id")[:RECENT_CHANGES],
                    to_attr="recent_changes",
                )
            )
            .order_by("name")
        )


class PolicyView(APIView):
    """A model's degradation policy: read it, or create / change it (PUT)."""

    permission_classes = [HealthWriter]

    def _model(self, model_name):
        return get_object_or_404(ServedModel, name=model_name)

    @extend_schema(responses=PolicySerializer)
    def get(self, request, model_name):
        policy = get_object_or_404(
            DegradationPolicy.objects.select_related("served_model", "fallback_model"),
            served_model=self._model(model_name),
        )
        return Response(PolicySerializer(policy).data)

    @extend_schema(
        request=PolicySerializer, responses={200: PolicySerializer, 201: PolicySerializer}
    )
    def put(self, request, model_name):
        served_model = self._model(model_name)
        serializer = PolicySerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        policy, created = degradation_policy_save(
            served_model=served_model, **serializer.validated_data
        )
        return Response(
            PolicySerializer(policy).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class ResetFingerprintView(APIView):
    """Forget a deployment's known-good probe answer: the next good answer is recorded."""

    permission_classes = [HealthWriter]

    @extend_schema(
        request=None,
        responses=inline_serializer(
            "FingerprintReset",
            {
                "deployment": serializers.CharField(),
                "reset": serializers.BooleanField(),
                "forgotten_answer": serializers.CharField(allow_null=True),
                "forgotten_recorded_at": serializers.DateTimeField(allow_null=True),
            },
        ),
    )
    def post(self, request, name):
        deployment = get_object_or_404(Deployment, name=name)
        forgotten = fingerprint_reset(deployment)
        return Response(
            {
                "deployment": deployment.name,
                "reset": forgotten is not None,
                "forgotten_answer": forgotten.answer if forgotten else None,
                "forgotten_recorded_at": forgotten.recorded_at if forgotten else None,
            }
        )
