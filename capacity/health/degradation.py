"""Degradation policies: when a model's healthy capacity stays short, degrade; when it
returns, recover — never on one sample, and without flapping in between.

Healthy share = healthy replicas ÷ (healthy + unhealthy) over the model's deployments, from
the probes (capacity.health.probes). Levels, applied in order, each after another full
`window_seconds` below `degrade_below`:

    1  refuse best-effort traffic (the lower tier: requests beyond a reservation)
    2  cap max_tokens at `max_tokens_cap`               (only if a cap is set)
    3  refused requests are answered with `fallback_model` (only if one is set)

All levels are lifted together once the share has stayed at or above `recover_at` for
`hysteresis_seconds`. Between the two thresholds nothing changes, and a break in a window
starts it again. Every change is a DegradationChange row with its reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from capacity.models import (
    DegradationChange,
    DegradationPolicy,
    DegradationState,
    Replica,
)
from capacity.publication import publish_after_commit
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


def step(
    state: DegradationState, policy: DegradationPolicy | None, share: float | None, now: datetime
) -> DegradationChange | None:
    """Advance one model's state with a new sample of its healthy share (saves the state)."""
    change = None
    state.evaluated_at = now
    if share is not None:
        state.healthy_share = share
    if policy is None or not policy.enabled:
        if state.level:
            change = _change(state, policy, 0, share or 0.0, "the degradation policy is off", now)
        state.below_since = state.above_since = None
        state.save()
        return change
    actions = actions_of(policy)
    if state.level > len(actions):
        # The policy lost a level (its cap or fallback was removed): drop what no longer exists.
        change = _change(
            state,
            policy,
            len(actions),
            share if share is not None else 1.0,
            f"the policy now has {len(actions)} level(s)",
            now,
        )
    # No probed replica at all (scaled to zero, or not probed yet): nothing is known to be
    # broken, so it counts as recovered; a degradation is lifted after the hysteresis.
    share = 1.0 if share is None else share
    window = timedelta(seconds=policy.window_seconds)
    if share < policy.degrade_below:
        state.above_since = None
        if state.below_since is None:
            state.below_since = now
        elif now - state.below_since >= window and state.level < len(actions):
            action = actions[state.level]
            change = change or _change(
                state,
                policy,
                state.level + 1,
                share,
                f"healthy capacity {share:.0%} has been below {policy.degrade_below:.0%} for "
                f"{(now - state.below_since).total_seconds():.0f} s: {ACTION_WORDS[action]}",
                now,
            )
            state.below_since = now  # the next level needs another full window
    elif share >= policy.recover_at:
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
            state.above_since = None
    else:
        # Between the thresholds: hold the level, and restart both windows.
        state.below_since = state.above_since = None
    state.save()
    return change


@transaction.atomic
def evaluate_all(*, now: datetime | None = None, shares: dict[int, float] | None = None) -> int:
    """One sample for every model with a policy or a state; returns how many levels changed."""
    now = now or timezone.now()
    shares = healthy_shares() if shares is None else shares
    policies = {p.served_model_id: p for p in DegradationPolicy.objects.all()}
    states = {s.served_model_id: s for s in DegradationState.objects.select_for_update().all()}
    changed = 0
    for model_id in set(policies) | set(states):
        state = states.get(model_id) or DegradationState(served_model_id=model_id)
        if step(state, policies.get(model_id), shares.get(model_id), now):
            changed += 1
    if changed:
        publish_after_commit("degradation level changed")
    return changed


# --- What admission reads ------------------------------------------------------------------


@dataclass(frozen=True)
class Degradation:
    level: int = 0
    refuse_best_effort: bool = False
    max_tokens_cap: int | None = None
    fallback_model: str | None = None


NORMAL = Degradation()
_cache: dict[int, tuple[Degradation, float]] = {}


def current(model_id: int) -> Degradation:
    """The model's degradation as admission applies it, read at most every CACHE_SECONDS."""
    cached = _cache.get(model_id)
    if cached is not None and time.monotonic() - cached[1] < CACHE_SECONDS:
        return cached[0]
    state = DegradationState.objects.filter(served_model_id=model_id).only("level").first()
    degradation = NORMAL
    if state is not None and state.level:
        policy = (
            DegradationPolicy.objects.filter(served_model_id=model_id)
            .select_related("fallback_model")
            .first()
        )
        if policy is not None and policy.enabled:
            applied = actions_of(policy)[: state.level]
            degradation = Degradation(
                level=state.level,
                refuse_best_effort=REFUSE_BEST_EFFORT in applied,
                max_tokens_cap=policy.max_tokens_cap if CAP_MAX_TOKENS in applied else None,
                fallback_model=policy.fallback_model.name
                if FALLBACK in applied and policy.fallback_model
                else None,
            )
    _cache[model_id] = (degradation, time.monotonic())
    return degradation


def forget() -> None:
    _cache.clear()
