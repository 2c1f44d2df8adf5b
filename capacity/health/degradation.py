"""Degradation policies: when a model's healthy capacity stays short, degrade; when it
returns, recover — never on one sample, and without flapping in between.

Healthy share = healthy replicas ÷ (healthy + unhealthy) over the model's deployments, from
the probes (capacity.health.probes). Levels, applied in order, each after another full
`window_seconds` below `degrade_below`:

    1  refuse best-effort traffic (requests beyond a reservation), tier by tier: the
       first tier in shed order (accounts.Tier.shed_order) at once, the next after each
       further window, until every tier's best-effort is refused
    2  cap max_tokens at `max_tokens_cap`               (only if a cap is set)
    3  refused requests are answered with `fallback_model` (only if one is set)

So with tiers free, standard, premium and enterprise, level 2 comes four windows after
level 1. Without any tier, level 1 refuses all best-effort at once.

All levels are lifted together once the share has stayed at or above `recover_at` for
`hysteresis_seconds`. Between the two thresholds nothing changes, and a break in a window
starts it again. Every change is a DegradationChange row with its reason.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from accounts.models import Customer, Tier
from capacity.hooks import gateway_state_changed
from capacity.models import (
    DegradationChange,
    DegradationPolicy,
    DegradationState,
    Replica,
)
from capacity.telemetry import metrics

REFUSE_BEST_EFFORT = "refuse_best_effort"
CAP_MAX_TOKENS = "cap_max_tokens"
FALLBACK = "fallback_model"
ACTION_WORDS = {
    REFUSE_BEST_EFFORT: "best-effort traffic is refused",
    CAP_MAX_TOKENS: "max_tokens is capped",
    FALLBACK: "refused requests are sent to the fallback model",
}
CACHE_SECONDS = 2.0


def actions_of(policy: DegradationPolicy) -> list[str]:
    """The policy's levels, in the order they apply."""
    actions = [REFUSE_BEST_EFFORT]
    if policy.max_tokens_cap:
        actions.append(CAP_MAX_TOKENS)
    if policy.fallback_model_id:
        actions.append(FALLBACK)
    return actions


def healthy_shares() -> dict[int, float]:
    """Per served model with probed replicas: the healthy share of them."""
    rows = (
        Replica.objects.filter(state__in=[Replica.State.HEALTHY, Replica.State.UNHEALTHY])
        .values("deployment__served_model_id")
        .annotate(
            healthy=Count("id", filter=Q(state=Replica.State.HEALTHY)),
            total=Count("id"),
        )
    )
    return {
        row["deployment__served_model_id"]: row["healthy"] / row["total"]
        for row in rows
        if row["total"]
    }


def _change(state, policy, to_level: int, share: float, reason: str, now: datetime):
    change = DegradationChange.objects.create(
        served_model_id=state.served_model_id,
        at=now,
        from_level=state.level,
        to_level=to_level,
        healthy_share=share,
        reason=reason,
    )
    metrics.DEGRADATION_LEVEL_CHANGES.labels("up" if to_level > state.level else "down").inc()
    state.level = to_level
    state.changed_at = now
    return change


def tiers_in_shed_order() -> list[str]:
    """Tier names in the order level 1 sheds them (their `shed_order`)."""
    return list(Tier.objects.order_by("shed_order").values_list("name", flat=True))


def shed_count(state: DegradationState, tiers: Sequence[str]) -> int:
    """How many tiers, in shed order, have their best-effort refused in this state."""
    if state.level == 0:
        return 0
    if state.level > 1:
        return len(tiers)
    return min(len(tiers), max(1, state.tiers_shed))


def step(
    state: DegradationState,
    policy: DegradationPolicy | None,
    share: float | None,
    now: datetime,
    tiers: Sequence[str] = (),
) -> DegradationChange | None:
    """Advance one model's state with a new sample of its healthy share (saves the state).

    `tiers`: the tier names in shed order; level 1 sheds them one window at a time."""
    state.evaluated_at = now
    if share is not None:
        state.healthy_share = share
    if policy is None or not policy.enabled:
        change = _policy_off(state, policy, share, now)
    else:
        actions = actions_of(policy)
        change = _levels_removed(state, policy, actions, share, now, tiers)
        # No probed replica at all (scaled to zero, or not probed yet): nothing is known to be
        # broken, so it counts as recovered; a degradation is lifted after the hysteresis.
        share = 1.0 if share is None else share
        if share < policy.degrade_below:
            change = _below(state, policy, actions, share, now, tiers, change)
        elif share >= policy.recover_at:
            change = _recovered(state, policy, share, now, change)
        else:
            # Between the thresholds: hold the level, and restart both windows.
            state.below_since = state.above_since = None
    state.save()
    return change


def _policy_off(
    state: DegradationState, policy: DegradationPolicy | None, share: float | None, now: datetime
) -> DegradationChange | None:
    """No policy, or one turned off: whatever the level, back to none."""
    change = None
    if state.level:
        change = _change(state, policy, 0, share or 0.0, "the degradation policy is off", now)
    state.tiers_shed = 0
    state.below_since = state.above_since = None
    return change


def _levels_removed(
    state: DegradationState,
    policy: DegradationPolicy,
    actions: Sequence[str],
    share: float | None,
    now: datetime,
    tiers: Sequence[str],
) -> DegradationChange | None:
    """The policy lost a level (its cap or fallback was removed): drop what no longer exists."""
    if state.level <= len(actions):
        return None
    change = _change(
        state,
        policy,
        len(actions),
        share if share is not None else 1.0,
        f"the policy now has {len(actions)} level(s)",
        now,
    )
    state.tiers_shed = len(tiers)  # it was past level 1: every tier stays shed
    return change


def _below(
    state: DegradationState,
    policy: DegradationPolicy,
    actions: Sequence[str],
    share: float,
    now: datetime,
    tiers: Sequence[str],
    change: DegradationChange | None,
) -> DegradationChange | None:
    """Healthy capacity under `degrade_below`: after a whole window, one step deeper (at level 1
    one more tier shed per window, before level 2 begins), and the window starts again."""
    state.above_since = None
    if state.below_since is None:
        state.below_since = now
        return change
    if change is not None or now - state.below_since < timedelta(seconds=policy.window_seconds):
        return change
    below = (
        f"healthy capacity {share:.0%} has been below {policy.degrade_below:.0%} for "
        f"{(now - state.below_since).total_seconds():.0f} s"
    )
    shed = shed_count(state, tiers)
    if state.level == 1 and shed < len(tiers):
        state.tiers_shed = shed + 1
        change = _change(
            state,
            policy,
            1,
            share,
            f"{below}: best-effort traffic of tier {tiers[shed]} is refused too",
            now,
        )
        state.below_since = now
    elif state.level < len(actions):
        words = ACTION_WORDS[actions[state.level]]
        if state.level == 0:
            state.tiers_shed = 1
            if tiers:
                words = f"best-effort traffic of tier {tiers[0]} is refused"
        change = _change(state, policy, state.level + 1, share, f"{below}: {words}", now)
        state.below_since = now  # the next level needs another full window
    return change


def _recovered(
    state: DegradationState,
    policy: DegradationPolicy,
    share: float,
    now: datetime,
    change: DegradationChange | None,
) -> DegradationChange | None:
    """Healthy capacity at or above `recover_at`: every degradation lifted after the
    hysteresis."""
    state.below_since = None
    if state.level == 0:
        state.above_since = None
    elif state.above_since is None:
        state.above_since = now
    elif now - state.above_since >= timedelta(seconds=policy.hysteresis_seconds):
        change = change or _change(
            state,
            policy,
            0,
            share,
            f"healthy capacity {share:.0%} has been at or above {policy.recover_at:.0%} for "
            f"{(now - state.above_since).total_seconds():.0f} s: every degradation lifted",
            now,
        )
        state.tiers_shed = 0
        state.above_since = None
    return change


@transaction.atomic
def evaluate_all(*, now: datetime | None = None, shares: dict[int, float] | None = None) -> int:
    """One sample for every model with a policy or a state; returns how many levels changed."""
    now = now or timezone.now()
    shares = healthy_shares() if shares is None else shares
    policies = {p.served_model_id: p for p in DegradationPolicy.objects.all()}
    states = {s.served_model_id: s for s in DegradationState.objects.select_for_update().all()}
    tiers = tiers_in_shed_order()
    changed = 0
    for model_id in set(policies) | set(states):
        state = states.get(model_id) or DegradationState(served_model_id=model_id)
        if step(state, policies.get(model_id), shares.get(model_id), now, tiers):
            changed += 1
    if changed:
        gateway_state_changed("degradation level changed")
    return changed


# --- What admission reads ------------------------------------------------------------------


@dataclass(frozen=True)
class Degradation:
    level: int = 0
    # True once every tier's best-effort is refused (or there are no tiers).
    refuse_best_effort: bool = False
    # At level 1 before that: the tiers whose best-effort is refused, in shed order.
    shed_tiers: tuple[str, ...] = ()
    max_tokens_cap: int | None = None
    fallback_model: str | None = None


NORMAL = Degradation()
_cache: dict[int, tuple[Degradation, float]] = {}
_tier_cache: dict[int, tuple[str, float]] = {}


def customer_tier(customer_id: int) -> str:
    """The customer's tier name, read at most every CACHE_SECONDS (asked only while tiers are
    being shed)."""
    cached = _tier_cache.get(customer_id)
    if cached is not None and time.monotonic() - cached[1] < CACHE_SECONDS:
        return cached[0]
    tier = Customer.objects.filter(pk=customer_id).values_list("tier_id", flat=True).first() or ""
    _tier_cache[customer_id] = (tier, time.monotonic())
    return tier


def refuses_best_effort_of(degradation: Degradation, customer_id: int) -> bool:
    """Whether this degradation refuses the customer's best-effort traffic."""
    if degradation.refuse_best_effort:
        return True
    return bool(degradation.shed_tiers) and customer_tier(customer_id) in degradation.shed_tiers


def current(model_id: int) -> Degradation:
    """The model's degradation as admission applies it, read at most every CACHE_SECONDS."""
    cached = _cache.get(model_id)
    if cached is not None and time.monotonic() - cached[1] < CACHE_SECONDS:
        return cached[0]
    state = (
        DegradationState.objects.filter(served_model_id=model_id)
        .only("level", "tiers_shed")
        .first()
    )
    degradation = NORMAL
    if state is not None and state.level:
        policy = (
            DegradationPolicy.objects.filter(served_model_id=model_id)
            .select_related("fallback_model")
            .first()
        )
        if policy is not None and policy.enabled:
            applied = actions_of(policy)[: state.level]
            tiers = tiers_in_shed_order()
            shed = shed_count(state, tiers)
            every_tier = shed >= len(tiers)
            degradation = Degradation(
                level=state.level,
                refuse_best_effort=REFUSE_BEST_EFFORT in applied and every_tier,
                shed_tiers=() if every_tier else tuple(tiers[:shed]),
                max_tokens_cap=policy.max_tokens_cap if CAP_MAX_TOKENS in applied else None,
                fallback_model=policy.fallback_model.name
                if FALLBACK in applied and policy.fallback_model
                else None,
            )
    _cache[model_id] = (degradation, time.monotonic())
    return degradation


def current_of(model_ids) -> dict[int, Degradation]:
    """`current` of many models, in one query for those at level 0 (most of them): the
    gateway documents ask for every model each tick."""
    ids = list(model_ids)
    degraded = set(
        DegradationState.objects.filter(served_model_id__in=ids, level__gt=0).values_list(
            "served_model_id", flat=True
        )
    )
    found = {}
    for model_id in ids:
        cached = _cache.get(model_id)
        if model_id in degraded or (
            cached is not None and time.monotonic() - cached[1] < CACHE_SECONDS
        ):
            found[model_id] = current(model_id)
        else:
            _cache[model_id] = (NORMAL, time.monotonic())
            found[model_id] = NORMAL
    return found


def forget() -> None:
    """Forget what this process cached of degradation states and tiers: read again next time."""
    _cache.clear()
    _tier_cache.clear()
