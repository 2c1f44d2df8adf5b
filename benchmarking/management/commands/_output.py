"""Shared output helpers for the benchmarking commands (`--json` for scripts)."""

import json

from capacity.models import CostModel


def cost_model_dict(cost_model: CostModel) -> dict:
    return {
        "id": cost_model.pk,
        "model": cost_model.served_model.name,
        "gpu_type": cost_model.gpu_type.name,
        "gpus_per_replica": cost_model.gpus_per_replica,
        "version": cost_model.version,
        "status": cost_model.status,
        "features": cost_model.features,
        "weights_replica_seconds": cost_model.weights_replica_seconds,
        "alpha_mu_per_input_token": cost_model.alpha_mu_per_input_token,
        "beta_mu_per_output_token": cost_model.beta_mu_per_output_token,
        "gamma_mu_per_request": cost_model.gamma_mu_per_request,
        "mu_per_unit": cost_model.mu_per_unit,
        "cv_mape": cost_model.cv_mape,
        "cv_worst_error": cost_model.cv_worst_error,
        "sample_count": cost_model.sample_count,
        "candidates": cost_model.candidates,
        "residuals": cost_model.residuals,
        "source_run": cost_model.source_run_id,
        "price_change": cost_model.price_change,
        "review_reason": cost_model.review_reason,
        "approved_by": cost_model.approved_by,
        "approval_reason": cost_model.approval_reason,
    }


def print_json(stdout, payload) -> None:
    stdout.write(json.dumps(payload, indent=2, sort_keys=False))


def print_fit_report(stdout, cost_model: CostModel) -> None:
    stdout.write(
        f"{cost_model.served_model.name} on {cost_model.gpu_type.name}×"
        f"{cost_model.gpus_per_replica}: version {cost_model.version}, {cost_model.status}"
    )
    # Why it is in force, or why it waits: the operator running the fit should not have to open
    # the planner to learn that a price change is waiting for review.
    if cost_model.review_reason:
        stdout.write(f"  {cost_model.review_reason}")
    elif cost_model.approved_by:
        stdout.write(f"  approved by {cost_model.approved_by}: {cost_model.approval_reason}")
    stdout.write(
        f"  features: {', '.join(cost_model.features)}; {cost_model.sample_count} samples; "
        f"CV MAPE {cost_model.cv_mape:.2%}, worst {cost_model.cv_worst_error:.2%}"
    )
    stdout.write(
        f"  α = {cost_model.alpha_mu_per_input_token:.6g} MU/input token, "
        f"β = {cost_model.beta_mu_per_output_token:.6g} MU/output token, "
        f"γ = {cost_model.gamma_mu_per_request:.6g} MU/request"
    )
    for name, weight in cost_model.weights_replica_seconds.items():
        if weight:
            stdout.write(f"  w[{name}] = {weight:.6g} replica-s")
    stdout.write("  candidates (CV MAPE):")
    for candidate in cost_model.candidates:
        stdout.write(f"    {candidate['cv_mape']:.2%}  {', '.join(candidate['features'])}")
    stdout.write("  residuals:")
    for residual in cost_model.residuals:
        stdout.write(
            f"    {residual['input_tokens'] + residual['cached_input_tokens']}/"
            f"{residual['output_tokens']}: measured {residual['measured_replica_seconds']:.5g} s, "
            f"predicted {residual['predicted_replica_seconds']:.5g} s "
            f"({residual['relative_error']:+.1%})"
        )
