"""Write the audit log: who changed what, before → after, and when (docs/design.md#audit).

Services call `audit_record(...)` inside their transaction. The actor is a plain string so that
entries outlive the users and keys they name: "user:<name>", "key:<prefix> (<owner>)" or
"system:<what>". A service takes it as an `actor` argument; when none is given,
`current_actor()` names whoever the current HTTP request authenticated as (set by
`AuditActorMiddleware` and the API-key authentication), or the job running (`acting_as`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models

from core.models import AuditEntry

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
    return current_actor() if principal is None and user is None else "system:unknown"


_request: ContextVar[Any] = ContextVar("audit_request", default=None)
_system: ContextVar[str] = ContextVar("audit_system_actor", default="system:unknown")


class AuditActorMiddleware:
    """Remembers the request being served, so services can name its caller."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        token = _request.set(request)
        try:
            return self.get_response(request)
        finally:
            _request.reset(token)


def note_api_key(request, api_key) -> None:
    """Called by the API-key authentication: the request is that key's (DRF authenticates
    inside the view, after every middleware ran)."""
    django_request = getattr(request, "_request", request)
    django_request.audit_api_key = api_key


@contextmanager
def acting_as(actor: str) -> Iterator[None]:
    """Name the actor of writes made outside a request: a Celery task, a command."""
    token = _system.set(actor)
    try:
        yield
    finally:
        _system.reset(token)


def in_request() -> bool:
    """Whether an HTTP request is being served, so the caller is known without an `actor`."""
    return _request.get() is not None


def current_actor() -> str:
    """Who the write being made is by: the current request's key or user ("anonymous" when
    it authenticated neither), else the job named by `acting_as` ("system:unknown" if none)."""
    request = _request.get()
    if request is not None:
        api_key = getattr(request, "audit_api_key", None)
        if api_key is not None:
            return actor_of(api_key=api_key)
        user = getattr(request, "user", None)
        if user is not None and getattr(user, "is_authenticated", False):
            return actor_of(user=user)
        return "anonymous"
    return _system.get()


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
    actor: str | None = None,
    action: str,
    obj: models.Model | None = None,
    object_type: str = "",
    object_id: str | int = "",
    object_repr: str = "",
    before: dict | None = None,
    after: dict | None = None,
    reason: str = "",
) -> AuditEntry:
    """Record one write: who (`actor`, else `current_actor()`), what (`action` on `obj`, or
    on the object named by type, id and label when it is gone), and the object before and
    after. Call it inside the write's transaction, so the entry and the change commit or roll
    back together."""
    if obj is not None:
        object_type = object_type or obj._meta.label_lower
        object_id = object_id or obj.pk
        object_repr = object_repr or str(obj)
    actor = actor or current_actor()
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


def audit_change(
    *,
    action: str,
    obj: models.Model,
    before: dict,
    after: dict,
    actor: str | None = None,
    reason: str = "",
) -> AuditEntry | None:
    """Record an update as the fields that changed (before → after); nothing when none did."""
    changed = sorted(key for key in set(before) | set(after) if before.get(key) != after.get(key))
    if not changed:
        return None
    return audit_record(
        actor=actor,
        action=action,
        obj=obj,
        before={key: before.get(key) for key in changed},
        after={key: after.get(key) for key in changed},
        reason=reason,
    )


def all_fields(obj: models.Model) -> list[str]:
    """The names of a model's concrete fields: what a create or delete entry keeps. Fields the
    database stamps on every save (`auto_now`) are left out: they change on every update and
    say nothing the entry's own time does not."""
    return [
        field.name for field in obj._meta.concrete_fields if not getattr(field, "auto_now", False)
    ]


class ReadOnlyAdminMixin:
    """An admin page that only shows: rows written by services (histories, logs, records),
    never added, edited or deleted by hand."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class AuditedAdminMixin:
    """For ModelAdmins: changes made in the admin are written to the audit log too, with the
    staff user as the actor (the admin saves models itself, not through the services)."""

    def audit_state(self, obj) -> dict[str, Any]:
        """What an entry keeps of `obj`: its fields; an admin that writes more beside the row
        (`saved`) adds it here."""
        return snapshot(obj, all_fields(obj))

    def saved(self, request, obj, form, change) -> None:
        """After the row is saved, before the entry reads it back: an admin writes here what
        it saves beside the row, in the same transaction."""

    def save_model(self, request, obj, form, change):
        model = type(obj)
        before = None
        if change and obj.pk is not None:
            stored = model._default_manager.filter(pk=obj.pk).first()
            before = self.audit_state(stored) if stored is not None else None
        super().save_model(request, obj, form, change)  # type: ignore[misc]
        self.saved(request, obj, form, change)
        name = f"{obj._meta.model_name}.{'update' if change else 'create'}"
        actor = actor_of(user=request.user)
        after = self.audit_state(obj)
        if before is None:
            audit_record(actor=actor, action=name, obj=obj, after=after)
        else:
            audit_change(actor=actor, action=name, obj=obj, before=before, after=after)

    def delete_model(self, request, obj):
        before = self.audit_state(obj)
        pk, label, label_lower = obj.pk, str(obj), obj._meta.label_lower
        super().delete_model(request, obj)  # type: ignore[misc]
        audit_record(
            actor=actor_of(user=request.user),
            action=f"{obj._meta.model_name}.delete",
            object_type=label_lower,
            object_id=pk,
            object_repr=label,
            before=before,
        )

    def delete_queryset(self, request, queryset):
        """One entry per row: the admin's bulk delete would otherwise write none."""
        for obj in queryset:
            self.delete_model(request, obj)


# --- Reading the log -------------------------------------------------------------------------


def entries_about(*objects_or_pairs, limit: int | None = None):
    """Entries about any of the given objects (model instances, or (object_type, ids) pairs
    for many rows of one type), newest first."""
    condition = models.Q(pk__in=[])
    for item in objects_or_pairs:
        if isinstance(item, models.Model):
            condition |= models.Q(object_type=item._meta.label_lower, object_id=str(item.pk))
        else:
            object_type, ids = item
            ids = [str(pk) for pk in ids]
            if ids:
                condition |= models.Q(object_type=object_type, object_id__in=ids)
    entries = AuditEntry.objects.filter(condition).order_by("-at", "-id")
    return entries[:limit] if limit else entries
