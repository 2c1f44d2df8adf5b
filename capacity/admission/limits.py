"""Request limits beyond MU (issue 22): requests per minute, tokens per minute and requests in
flight, per customer and per key, set by planners (the API, the admin, the planner's customer
page) and enforced in admission's one Redis round trip (capacity.admission.redis_buckets).

- Per minute means any sliding 60 s window: a limit of 60 admits at most 60 requests in any
  60 s, not 60 per clock minute (which would let 120 through across a minute's boundary).
- Tokens per minute count each admitted request's `input_tokens + max_tokens` (max_tokens
  after a degradation cap) at admission, as OpenAI's rate limits count max_tokens: the most it
  may use, known before it runs. They are not reconciled with what it used.
- A request holds a slot in flight from admission until the gateway's end of the request
  (`release`) or its usage event (ingestion, `reconcile_usage`) frees it; a slot never freed
  lapses after ADMISSION_CONCURRENCY_TTL_SECONDS. A request admitted without a request id can
  only lapse.
- A customer-wide row limits all the customer's requests, a key's row the requests sent with
  that key; a request sent with a key is under both. Only admitted requests count.
- A refusal says which limit bit (`limit`: "rpm", "tpm" or "concurrency", `limit_scope`:
  "customer" or "api_key") with its Retry-After. It takes nothing from the MU buckets, is
  recorded as `refused_limit` and earns no SLA credit, and it is not demand for capacity.

Every change is audited (before → after) and published to Redis after commit with the gateway
documents (capacity.publication): the whole set, so a removed limit is gone from Redis too.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from accounts.models import ApiKey, Customer
from capacity.admission.redis_layout import api_key_scope, customer_scope
from capacity.hooks import gateway_state_changed
from capacity.models import BudgetCap, RequestLimit
from core.audit import audit_change, audit_record, current_actor
from core.errors import ConflictError, DomainError

LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests")
# A bound no real fleet reaches, so that a typo is a 400 and not a limit of nothing.
MAX_LIMIT = 10**12


def _state(limit: RequestLimit) -> dict:
    return {
        "api_key": limit.api_key.prefix if limit.api_key_id else None,
        **{name: getattr(limit, name) for name in LIMIT_FIELDS},
    }


def check_request_limit(customer: Customer, api_key: ApiKey | None, values: dict) -> None:
    """DomainError naming the field at fault; the admin's form checks with it too."""
    if api_key is not None and api_key.customer_id != customer.pk:
        raise DomainError(
            f"The key {api_key.prefix} is not one of {customer.slug}'s keys.", field="api_key"
        )
    for name, value in values.items():
        if value is not None and not 1 <= value <= MAX_LIMIT:
            raise DomainError(
                f"{name} must be from 1 to {MAX_LIMIT}, or empty for no limit.", field=name
            )
    if all(value is None for value in values.values()):
        raise DomainError(
            "Set at least one of requests_per_minute, tokens_per_minute and "
            "concurrent_requests (a limit with none limits nothing: delete it instead).",
            field="requests_per_minute",
        )


@transaction.atomic
def request_limit_set(
    *,
    customer: Customer,
    api_key: ApiKey | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    concurrent_requests: int | None = None,
    replace: bool = True,
    actor: str | None = None,
) -> RequestLimit:
    """Set the customer's limits (or its key's, with `api_key`), all three at once: an empty one
    is no limit. With `replace=False` an existing row is a conflict (the API's create)."""
    values = {
        "requests_per_minute": requests_per_minute,
        "tokens_per_minute": tokens_per_minute,
        "concurrent_requests": concurrent_requests,
    }
    check_request_limit(customer, api_key, values)
    # One writer of a customer's limits at a time, so "before" in the audit entry is true.
    Customer.objects.select_for_update().filter(pk=customer.pk).first()
    limit = RequestLimit.objects.filter(customer=customer, api_key=api_key).first()
    actor = actor or current_actor()
    if limit is not None and not replace:
        whose = f"the key {api_key.prefix}" if api_key is not None else customer.slug
        raise ConflictError(
            f"{whose} has request limits already (#{limit.pk}): change them with PATCH.",
            field="api_key" if api_key is not None else "customer",
            code="exists",
        )
    if limit is None:
        limit = RequestLimit(customer=customer, api_key=api_key)
        before = None
    else:
        before = _state(limit)
    for name, value in values.items():
        setattr(limit, name, value)
    limit.updated_by = actor[:200]
    limit.save()
    if before is None:
        audit_record(actor=actor, action="request_limit.create", obj=limit, after=_state(limit))
        gateway_state_changed("request limits changed")
    elif audit_change(
        actor=actor, action="request_limit.update", obj=limit, before=before, after=_state(limit)
    ):
        gateway_state_changed("request limits changed")
    return limit


@transaction.atomic
def request_limit_update(
    *, limit: RequestLimit, changes: dict, actor: str | None = None
) -> RequestLimit:
    """Change some of a row's limits (`changes`: field -> int, or None for no limit)."""
    unknown = sorted(set(changes) - set(LIMIT_FIELDS))
    if unknown:
        raise DomainError(f"{unknown[0]} cannot be changed.", field=unknown[0])
    values = {name: changes.get(name, getattr(limit, name)) for name in LIMIT_FIELDS}
    return request_limit_set(customer=limit.customer, api_key=limit.api_key, actor=actor, **values)


@transaction.atomic
def request_limit_delete(*, limit: RequestLimit, actor: str | None = None) -> None:
    """Delete a request limit row, audited; gateways stop enforcing it after the commit."""
    before = _state(limit)
    pk, label = limit.pk, str(limit)
    limit.delete()
    audit_record(
        actor=actor or current_actor(),
        action="request_limit.delete",
        object_type=RequestLimit._meta.label_lower,
        object_id=pk,
        object_repr=label,
        before=before,
    )
    gateway_state_changed("request limits changed")


def request_limits_of_customer(customer: Customer) -> list[RequestLimit]:
    """The customer's limits: customer-wide first, then its keys' by prefix."""
    return sorted(
        RequestLimit.objects.filter(customer=customer).select_related("api_key"),
        key=lambda limit: (
            limit.api_key_id is not None,
            limit.api_key.prefix if limit.api_key_id else "",
        ),
    )


def published_request_limits() -> dict[str, dict[str, int]]:
    """Every scope's limits as admission's script reads them: "c:<customer id>" or
    "k:<key prefix>" -> {"rpm" | "tpm" | "concurrency" | "budget": int} (capacity.publication).
    `budget: 1` on a customer's scope: its budget's hard cap refuses its best-effort requests;
    on a key's scope: that key's budget's hard cap refuses the best-effort requests sent with
    it (`budget_cap_set`)."""
    published: dict[str, dict[str, int]] = {}
    for limit in RequestLimit.objects.select_related("api_key").order_by("pk"):
        scope = (
            api_key_scope(limit.api_key.prefix)
            if limit.api_key_id
            else customer_scope(limit.customer_id)
        )
        published[scope] = limit.limits
    for cap in BudgetCap.objects.select_related("api_key").order_by("pk"):
        scope = (
            api_key_scope(cap.api_key.prefix) if cap.api_key_id else customer_scope(cap.customer_id)
        )
        published.setdefault(scope, {})[BUDGET_CAP_FIELD] = 1
    return published


# --- The budget cap: best-effort refused for a customer (or key) whose budget is spent -------

# The field of a customer's (or key's) published limits hash that admission's script reads
# (capacity.admission.redis_buckets).
BUDGET_CAP_FIELD = "budget"


@transaction.atomic
def budget_cap_set(
    *,
    customer: Customer,
    capped: bool,
    api_key: ApiKey | None = None,
    reason: str = "",
    actor: str | None = None,
) -> bool:
    """Cap the best-effort admission of the customer, or of the requests sent with its key
    `api_key` (`capped`), or lift the cap; True when that changed anything. Billing's hard cap
    calls it (billing.budgets): capacity owns the flag and enforces it, billing decides when.
    Audited and published to admission and gateways."""
    if capped and not reason.strip():
        raise DomainError("A cap says why it refuses best-effort requests.", field="reason")
    if api_key is not None and api_key.customer_id != customer.pk:
        raise DomainError(
            f"The key {api_key.prefix} is not one of {customer.slug}'s keys.", field="api_key"
        )
    Customer.objects.select_for_update().filter(pk=customer.pk).first()
    cap = BudgetCap.objects.filter(customer=customer, api_key=api_key).first()
    actor = actor or current_actor()
    whose = f"{customer} key {api_key.prefix}" if api_key is not None else str(customer)
    if capped and cap is None:
        cap = BudgetCap.objects.create(
            customer=customer, api_key=api_key, reason=reason[:300], since=timezone.now()
        )
        audit_record(actor=actor, action="budget_cap.set", obj=cap, after=_cap_state(cap, api_key))
    elif not capped and cap is not None:
        before = {**_cap_state(cap, api_key), "since": cap.since}
        pk = cap.pk
        cap.delete()
        audit_record(
            actor=actor,
            action="budget_cap.lift",
            object_type=BudgetCap._meta.label_lower,
            object_id=pk,
            object_repr=f"{whose} capped",
            before=before,
        )
    else:
        return False
    gateway_state_changed("budget cap changed")
    return True


def _cap_state(cap: BudgetCap, api_key: ApiKey | None) -> dict:
    return {"api_key": api_key.prefix if api_key is not None else None, "reason": cap.reason}


def budget_cap_of(customer: Customer, api_key: ApiKey | None = None) -> BudgetCap | None:
    """The cap of the customer (`api_key` None) or of its key."""
    return BudgetCap.objects.filter(customer=customer, api_key=api_key).first()


def budget_caps_of_customers(customer_ids) -> set[tuple[int, int | None]]:
    """The caps on these customers as (customer id, key id or None for the customer's own)."""
    return set(
        BudgetCap.objects.filter(customer_id__in=customer_ids).values_list(
            "customer_id", "api_key_id"
        )
    )
