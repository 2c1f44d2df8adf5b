"""Write the audit log: who changed what, before → after, and when (DESIGN §6).

Services call `audit_record(...)` inside their transaction. The actor is a plain string so that
entries outlive the users and keys they name: `actor_of(principal)` gives "user:<name>" or
"key:<prefix> (<owner>)"; jobs and migrations pass "system:<what>".
"""

from __future__ import annotations

import json
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models

from controlplane.models import AuditEntry

_MAX_REPR_CHARS = 200


def actor_of(principal=None, *, user=None, api_key=None) -> str:
    """The actor string of a request's principal (accounts.principals.Principal), a user or
    a key."""
    if principal is not None:
        api_key = api_key or getattr(principal, "api_key", None)
        user = user or getattr(principal, "user", None)
    if api_key is not None:
        return f"key:{api_key.prefix} ({api_key.owner_label})"
    if user is not None and getattr(user, "pk", None):
        return f"user:{user.get_username()}"
    return "system:unknown"


def snapshot(obj: models.Model, fields: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The named fields of `obj` as JSON-ready values (foreign keys by id)."""
    values = {}
    for name in fields:
        field = obj._meta.get_field(name)
        value = getattr(obj, field.attname)
        values[name] = value
    # Round-trip through Django's encoder: datetimes, decimals and UUIDs become strings.
    return _jsonable(values)


def _jsonable(value):
    return json.loads(json.dumps(value, cls=DjangoJSONEncoder))


def audit_record(
    *,
    actor: str,
    action: str,
    obj: models.Model | None = None,
    object_type: str = "",
    object_id: str | int = "",
    object_repr: str = "",
    before: dict | None = None,
    after: dict | None = None,
    reason: str = "",
) -> AuditEntry:
    if obj is not None:
        object_type = object_type or obj._meta.label_lower
        object_id = object_id or obj.pk
        object_repr = object_repr or str(obj)
    return AuditEntry.objects.create(
        actor=actor[:200],
        action=action,
        object_type=object_type,
        object_id=str(object_id),
        object_repr=object_repr[:_MAX_REPR_CHARS],
        before=_jsonable(before) if before is not None else None,
        after=_jsonable(after) if after is not None else None,
        reason=reason,
    )
