"""What planners read and change about runtime health, shared by the planner pages and the
API: incident timings, degradation levels in words, the policy rules, fingerprint resets.

The probes (capacity.health.probes) and the degradation loop (capacity.health.degradation) write
the rows;
this module only reads them, except for two planner actions: saving a DegradationPolicy and
resetting a deployment's probe fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction

from capacity.health import degradation
from capacity.hooks import gateway_state_changed
from capacity.models import (
    DegradationPolicy,
    DegradationState,
    Deployment,
    DeploymentFingerprint,
    Incident,
    ServedModel,
)
from core.audit import all_fields, audit_change, audit_record, snapshot
from core.errors import DomainError

# PositiveIntegerField's upper bound on PostgreSQL.
MAX_SECONDS = 2_147_483_647
POLICY_FIELDS = (
    "enabled",
    "degrade_below",
    "recover_at",
    "window_seconds",
    "hysteresis_seconds",
    "max_tokens_cap",
    "fallback_model",
)


def _seconds(start, end) -> float | None:
    if start is None or end is None:
        return None
    return (end - start).total_seconds()


def seconds_to_restart_requested(incident: Incident) -> float | None:
    """Seconds from the incident's detection to the restart asked for (None before)."""
    return _seconds(incident.detected_at, incident.restart_requested_at)


def seconds_to_ready(incident: Incident) -> float | None:
    """Seconds from the incident's detection to the replica ready again (None before)."""
    return _seconds(incident.detected_at, incident.ready_at)


def step_timings(incident: Incident) -> list[dict]:
    """The incident's steps in order, each with the seconds since detection (negative for the
    first failed probe, which comes before the replica is marked unhealthy)."""
    return [
        {
            "step": step.step,
            "label": step.get_step_display(),
            "at": step.at,
            "detail": step.detail,
            "seconds_since_detection": _seconds(incident.detected_at, step.at),
        }
        for step in incident.steps.all()
    ]


@dataclass(frozen=True)
class LevelWords:
    level: int
    actions: list[str]  # capacity.health.degradation action names applied at this level
    words: list[str]  # the same in words
    summary: str


def level_in_words(level: int, policy: DegradationPolicy | None) -> LevelWords:
    """What a level means for a policy, as admission applies it
    (capacity.health.degradation.current)."""
    if not level:
        return LevelWords(0, [], [], "normal: nothing is degraded")
    if policy is None or not policy.enabled:
        return LevelWords(
            level, [], [], f"level {level}, but no policy applies: lifted at the next evaluation"
        )
    applied = degradation.actions_of(policy)[:level]
    words = [degradation.ACTION_WORDS[action] for action in applied]
    summary = f"level {level}: " + "; ".join(words)
    if level > len(applied):
        summary += f" (the policy now has {len(applied)} level(s))"
    return LevelWords(level, applied, words, summary)


def policy_problems(served_model: ServedModel, values: dict) -> dict[str, list[str]]:
    """Per field, what is wrong with a policy's values (empty if nothing): the rules of the
    database's `degradation_thresholds_ordered` check, said before it refuses them."""
    problems: dict[str, list[str]] = {}
    below = values.get("degrade_below")
    recover = values.get("recover_at")
    if below is None or not 0 < below <= 1:
        problems["degrade_below"] = ["must be above 0 and at most 1 (a share of capacity)."]
    if recover is None or not 0 < recover <= 1:
        problems["recover_at"] = ["must be above 0 and at most 1 (a share of capacity)."]
    if not problems and recover < below:
        problems["recover_at"] = [
            f"must be at least degrade_below ({below:g}): a model recovers at or above the "
            "share under which it degrades."
        ]
    for name in ("window_seconds", "hysteresis_seconds"):
        value = values.get(name)
        if value is None or not 0 <= value <= MAX_SECONDS:
            problems[name] = [f"must be a number of seconds from 0 to {MAX_SECONDS}."]
    cap = values.get("max_tokens_cap")
    if cap is not None and not 1 <= cap <= MAX_SECONDS:
        problems["max_tokens_cap"] = ["must be at least 1 token (or empty: no cap)."]
    fallback = values.get("fallback_model")
    if fallback is not None and fallback.pk == served_model.pk:
        problems["fallback_model"] = ["must be another model: a model cannot stand in for itself."]
    return problems


@transaction.atomic
def degradation_policy_save(
    *, served_model: ServedModel, **values
) -> tuple[DegradationPolicy, bool]:
    """Create or change the model's policy; values not given keep the current ones (or the
    defaults for a new policy). Returns (policy, created)."""
    unknown = set(values) - set(POLICY_FIELDS)
    if unknown:
        raise DomainError(f"unknown policy fields: {', '.join(sorted(unknown))}")
    policy = DegradationPolicy.objects.select_for_update().filter(served_model=served_model).first()
    created = policy is None
    if created:
        policy = DegradationPolicy(served_model=served_model)
    before = None if created else snapshot(policy, POLICY_FIELDS)
    merged = {name: getattr(policy, name) for name in POLICY_FIELDS} | values
    problems = policy_problems(served_model, merged)
    if problems:
        first = next(iter(problems))
        raise DomainError(
            f"{first}: {problems[first][0]}",
            field=first,
            fields=problems,
        )
    for name, value in merged.items():
        setattr(policy, name, value)
    policy.save()
    if before is None:
        audit_record(
            action="degradation_policy.create", obj=policy, after=snapshot(policy, POLICY_FIELDS)
        )
    else:
        audit_change(
            action="degradation_policy.update",
            obj=policy,
            before=before,
            after=snapshot(policy, POLICY_FIELDS),
        )
    degradation.forget()  # this process's admission cache; others expire in seconds
    gateway_state_changed("degradation policy saved")  # the level's actions may have changed
    return policy, created


def fingerprint_reset(deployment: Deployment) -> DeploymentFingerprint | None:
    """Forget the deployment's known-good probe answer: the next good answer is recorded as
    the new one (after a model or engine change). Returns the forgotten fingerprint."""
    fingerprint = DeploymentFingerprint.objects.filter(deployment=deployment).first()
    if fingerprint is not None:
        before = snapshot(fingerprint, all_fields(fingerprint))
        fingerprint.delete()
        audit_record(
            action="fingerprint.reset",
            obj=deployment,
            before={"fingerprint": before},
            after={"fingerprint": None},
        )
    return fingerprint


def degradation_rows(served_models) -> list[dict]:
    """Per model (select_related degradation_state and degradation_policy): its level in words,
    healthy share, since when, and its policy."""
    rows = []
    for served_model in served_models:
        state = _related(served_model, "degradation_state")
        policy = _related(served_model, "degradation_policy")
        level = state.level if state else 0
        rows.append(
            {
                "model": served_model,
                "state": state,
                "policy": policy,
                "level": level,
                "words": level_in_words(level, policy),
                "healthy_share": state.healthy_share if state else None,
                "since": state.changed_at if state else None,
            }
        )
    return rows


def _related(instance, name):
    try:
        return getattr(instance, name)
    except (DegradationState.DoesNotExist, DegradationPolicy.DoesNotExist):
        return None
