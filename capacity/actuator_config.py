"""What each actuator kind needs in `Deployment.actuator_config`, checked before it is stored.

Secrets never go in the config: a webhook's signing secret or a Kubernetes token is named by
the environment variable that holds it (`secret_env`, `token_env`).
"""

import re

from rest_framework import serializers

from capacity.models import ActuatorKind
from controlplane.errors import DomainError

_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _env_name(value: str) -> str:
    if not _ENV_NAME.match(value):
        raise serializers.ValidationError(
            "must name an environment variable (upper case letters, digits, underscores)."
        )
    return value


class _StrictSerializer(serializers.Serializer):
    """Refuses keys it does not know, so a typo does not silently fall back to a default."""

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["must be a JSON object."]})
        unknown = sorted(set(data) - set(self.fields))
        value = super().to_internal_value(data)
        if unknown:
            raise serializers.ValidationError(
                {key: ["is not a setting of this actuator kind."] for key in unknown}
            )
        return value


class DryRunConfig(_StrictSerializer):
    pass


class KubernetesConfig(_StrictSerializer):
    namespace = serializers.RegexField(
        _DNS_LABEL, max_length=63, error_messages={"invalid": "must be a DNS label."}
    )
    name = serializers.RegexField(
        _DNS_SUBDOMAIN, max_length=253, error_messages={"invalid": "must be a DNS subdomain name."}
    )
    kind = serializers.ChoiceField(choices=["Deployment", "StatefulSet"], default="Deployment")
    api_server = serializers.URLField(
        required=False, help_text="Empty: the in-cluster API server from the service account."
    )
    token_env = serializers.CharField(required=False, validators=[_env_name])
    verify_tls = serializers.BooleanField(default=True)


class WebhookConfig(_StrictSerializer):
    url = serializers.URLField()
    secret_env = serializers.CharField(
        required=False,
        validators=[_env_name],
        help_text="Environment variable holding the HMAC signing secret.",
    )
    timeout_seconds = serializers.FloatField(default=5.0, min_value=0.1, max_value=60.0)


class ProcessConfig(_StrictSerializer):
    command = serializers.ListField(
        child=serializers.CharField(), allow_empty=False, help_text="argv of one engine process."
    )
    host = serializers.CharField(default="127.0.0.1")
    base_port = serializers.IntegerField(min_value=1024, max_value=65535)


SCHEMAS: dict[str, type[_StrictSerializer]] = {
    ActuatorKind.DRY_RUN: DryRunConfig,
    ActuatorKind.KUBERNETES: KubernetesConfig,
    ActuatorKind.WEBHOOK: WebhookConfig,
    ActuatorKind.PROCESS: ProcessConfig,
}


def _flatten(prefix: str, detail) -> dict[str, list[str]]:
    if isinstance(detail, dict):
        out: dict[str, list[str]] = {}
        for key, value in detail.items():
            path = prefix if key == "non_field_errors" else f"{prefix}.{key}"
            for sub, reasons in _flatten(path, value).items():
                out.setdefault(sub, []).extend(reasons)
        return out
    if isinstance(detail, list) and all(not isinstance(item, dict | list) for item in detail):
        return {prefix: [str(item) for item in detail]}
    if isinstance(detail, list):
        out = {}
        for index, item in enumerate(detail):
            for sub, reasons in _flatten(f"{prefix}.{index}", item).items():
                out.setdefault(sub, []).extend(reasons)
        return out
    return {prefix: [str(detail)]}


def validate_actuator_config(kind: str, config) -> dict:
    """The config with defaults filled in, or a DomainError naming `actuator_config.<field>`."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise DomainError(
            f"Unknown actuator kind '{kind}'. Known: {', '.join(SCHEMAS)}.", field="actuator_kind"
        )
    serializer = schema(data=config if config is not None else {})
    if not serializer.is_valid():
        fields = _flatten("actuator_config", serializer.errors)
        first_field, reasons = next(iter(fields.items()))
        raise DomainError(
            f"{first_field}: {reasons[0]} (actuator kind '{kind}')",
            field=first_field,
            fields=fields,
        )
    return dict(serializer.validated_data)
