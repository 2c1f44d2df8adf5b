from datetime import timedelta

from django.utils import timezone
from rest_framework import serializers

from accounts import scopes as S
from accounts.models import ApiKey, Customer, Tier
from accounts.services import MAX_SHED_ORDER, MAX_TIER_WEIGHT
from core.api.serializers import (
    StrictModelSerializer,
    StrictSerializer,
    no_control_characters,
)


class CustomerSerializer(StrictModelSerializer):
    class Meta:
        model = Customer
        fields = ["id", "name", "slug", "tier", "may_report_own_usage", "created_at"]
        read_only_fields = ["id", "created_at"]

    def validate_name(self, value: str) -> str:
        return no_control_characters(value)


class ApiKeySerializer(serializers.ModelSerializer):
    customer = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)
    is_active = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "customer",
            "service_name",
            "scopes",
            "created_at",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "is_active",
        ]
        read_only_fields = fields

    def get_is_active(self, api_key: ApiKey) -> bool:
        now = timezone.now()
        return api_key.revoked_at is None and (
            api_key.expires_at is None or api_key.expires_at > now
        )


class ApiKeyCreateSerializer(StrictSerializer):
    name = serializers.CharField(max_length=200, validators=[no_control_characters])
    customer = serializers.SlugRelatedField(
        slug_field="slug",
        queryset=Customer.objects.all(),
        required=False,
        allow_null=True,
        # Another tenant's slug and an unknown one get this same answer (400): which customers
        # exist is not for a caller who cannot see them (the view narrows the queryset).
        error_messages={"does_not_exist": "No customer '{value}' that you may see."},
    )

    def __init__(self, *args, customers=None, **kwargs):
        super().__init__(*args, **kwargs)
        if customers is not None:
            self.fields["customer"].queryset = customers

    service_name = serializers.SlugField(max_length=100, required=False, allow_blank=True)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=S.ALL_SCOPES), required=False, allow_empty=False
    )
    expires_in_days = serializers.IntegerField(
        required=False, allow_null=True, min_value=1, max_value=3650
    )

    def validate(self, attrs):
        if bool(attrs.get("customer")) == bool(attrs.get("service_name")):
            raise serializers.ValidationError(
                {"customer": ["Give exactly one of customer (a slug) or service_name."]}
            )
        return attrs

    def expires_at(self):
        days = self.validated_data.get("expires_in_days")
        return timezone.now() + timedelta(days=days) if days else None


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(help_text="The key, shown this once: `prefix.secret`.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]
        read_only_fields = fields


class MeMembershipSerializer(serializers.Serializer):
    customer = serializers.CharField()
    role = serializers.CharField()


class MeSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=["user", "api_key"])
    username = serializers.CharField(allow_null=True)
    is_planner = serializers.BooleanField()
    is_service = serializers.BooleanField()
    service_name = serializers.CharField(allow_blank=True)
    api_key_prefix = serializers.CharField(allow_null=True)
    scopes = serializers.ListField(child=serializers.CharField())
    customers = MeMembershipSerializer(many=True)


_WEIGHT_HELP = (
    "The tier's share of the even part of best-effort slack, relative to the other tiers' "
    "(capacity.allocation.policy); reaches the next allocation tick."
)
_SHED_HELP = (
    "Its place in the order degradation sheds best-effort traffic: level 1 refuses the lowest "
    "first, then the next each window. One tier per place."
)


class TierSerializer(StrictModelSerializer):
    name = serializers.SlugField(
        max_length=20, help_text="What customers refer to the tier by: fixed once created."
    )
    label = serializers.CharField(
        max_length=100, required=False, allow_blank=True, default="",
        validators=[no_control_characters],
    )  # fmt: skip
    weight = serializers.FloatField(
        min_value=0.0, max_value=MAX_TIER_WEIGHT, required=False, default=1.0,
        help_text=_WEIGHT_HELP,
    )  # fmt: skip
    shed_order = serializers.IntegerField(
        min_value=1, max_value=MAX_SHED_ORDER, help_text=_SHED_HELP
    )

    class Meta:
        model = Tier
        fields = ["name", "label", "weight", "shed_order"]
        # A name or shed order taken is the service's 409, not a validation 400.
        validators: list = []


class TierChangeSerializer(StrictSerializer):
    unknown_field_message = (
        "cannot be changed: a tier's name is fixed (customers refer to it); create another."
    )

    label = serializers.CharField(
        max_length=100, required=False, allow_blank=True, validators=[no_control_characters]
    )
    weight = serializers.FloatField(
        min_value=0.0, max_value=MAX_TIER_WEIGHT, required=False, help_text=_WEIGHT_HELP
    )
    shed_order = serializers.IntegerField(
        min_value=1, max_value=MAX_SHED_ORDER, required=False, help_text=_SHED_HELP
    )
