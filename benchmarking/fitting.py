"""Fitting a request cost model to benchmark throughputs (docs/design.md#the-currency, #benchmarks).

A cost model predicts the replica time a request consumes on a saturated replica,

    t(req) = Σ_f w_f · x_f(req)        (replica-seconds, every w_f ≥ 0)

and a benchmark measures, per request shape, the sustainable requests/s of one replica, so the
target of the fit is t = 1 / requests_per_s. Everything here is pure: plain sequences in, frozen
dataclasses out, no Django, so the benchmark services, the simulator and the tests share it.

Why relative error: request costs span four orders of magnitude (128/128 against 20000/2000), and
an absolute least-squares fit would spend all its freedom on the most expensive shapes while
mispricing cheap ones by tens of percent. Scaling each row by 1/t turns the problem into
min Σ (x_i·w / t_i − 1)², i.e. least squares on relative errors.

Why cross-validated feature selection: with ten-odd shapes a fit with more features always looks
better in-sample; only the error on shapes the fit has not seen says whether the io / o² terms
describe the engine or merely the noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from capacity.pricing.features import (
    FEATURES,
    PLAIN_FEATURES,
    FitError,
    Shape,
    canonical_features,
    feature_matrix,
)

MIN_DISTINCT_SHAPES = 6

# Feature-set selection rule: a larger candidate replaces a smaller one only when it cuts the
# cross-validated MAPE by at least 0.5 percentage point AND by at least 10 % of the smaller set's
# MAPE. Below that, the difference is within what re-running the same benchmark moves, and the
# extra weights would price noise. Both thresholds are on CV MAPE expressed as a fraction.
MIN_MAPE_IMPROVEMENT_ABSOLUTE = 0.005
MIN_MAPE_IMPROVEMENT_RELATIVE = 0.10


@dataclass(frozen=True)
class Residual:
    shape: Shape
    measured_replica_seconds: float
    predicted_replica_seconds: float
    relative_error: float  # signed: (predicted − measured) / measured


@dataclass(frozen=True)
class CandidateScore:
    features: tuple[str, ...]
    cv_mape: float  # mean |pred − meas| / meas over held-out samples, as a fraction
    cv_worst_error: float  # max |pred − meas| / meas over held-out samples, as a fraction


@dataclass(frozen=True)
class FitResult:
    features: tuple[str, ...]  # the selected feature set, in FEATURES order
    weights_replica_seconds: dict[str, float]  # every name in FEATURES; 0.0 when unused
    cv_mape: float
    cv_worst_error: float
    sample_count: int
    distinct_shapes: int
    residuals: tuple[Residual, ...]  # in-sample, of the final fit on all data, one per sample
    candidates: tuple[CandidateScore, ...]  # every feature set tried, with its CV score
    # The chosen set's held-out error over the samples that carry each feature
    # (cached_input_tokens: samples with prefix-cache hits; images: samples with images), so
    # a good overall MAPE cannot hide a feature that is priced badly:
    # {feature: {"cv_mape", "cv_worst_error", "samples"}}; only features some sample has.
    cv_error_by_feature: dict[str, dict[str, float | int]] = field(default_factory=dict)


# --- validation ---------------------------------------------------------------------------------


def _validated_targets(shapes: Sequence[Shape], requests_per_s: Sequence[float]) -> np.ndarray:
    """Checks the benchmark table and returns the target t = 1/throughput, in replica-seconds."""
    if len(shapes) != len(requests_per_s):
        raise FitError(
            f"got {len(shapes)} shapes but {len(requests_per_s)} throughputs;"
            " every shape needs exactly one measured requests_per_s"
        )
    throughputs: list[float] = []
    for row, (shape, raw) in enumerate(zip(shapes, requests_per_s, strict=True)):
        try:
            value = float(raw)
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise FitError(
                f"row {row} (shape {shape.describe()}): requests_per_s is {raw!r};"
                " a throughput must be a positive finite number"
            )
        throughputs.append(value)

    input_output_pairs = {(s.total_input_tokens, s.output_tokens) for s in shapes}
    if len(input_output_pairs) < MIN_DISTINCT_SHAPES:
        raise FitError(
            f"need at least {MIN_DISTINCT_SHAPES} distinct (input, output) shapes,"
            f" got {len(input_output_pairs)}"
        )
    input_lengths = {pair[0] for pair in input_output_pairs}
    output_lengths = {pair[1] for pair in input_output_pairs}
    # With one axis constant, per-token and per-request costs are confounded (and so are io and
    # the other length's term): the fit would return arbitrary weights, so refuse instead.
    if len(input_lengths) == 1:
        raise FitError(
            "the grid must vary both input and output length; input length is"
            f" {input_lengths.pop()} tokens in every shape"
        )
    if len(output_lengths) == 1:
        raise FitError(
            "the grid must vary both input and output length; output length is"
            f" {output_lengths.pop()} tokens in every shape"
        )
    return 1.0 / np.array(throughputs)


def _shape_groups(shapes: Sequence[Shape]) -> np.ndarray:
    """Group id per sample: equal shapes share an id (ids in order of first appearance)."""
    ids: dict[Shape, int] = {}
    return np.array([ids.setdefault(shape, len(ids)) for shape in shapes], dtype=int)


# --- fitting ------------------------------------------------------------------------------------


def _fit_weights(x: np.ndarray, replica_seconds: np.ndarray) -> np.ndarray:
    """Non-negative weights minimising Σ (x_i·w / t_i − 1)²."""
    scaled = x / replica_seconds[:, None]
    # Columns differ by up to ~10⁴ in magnitude (request = 1, io/1000 up to 4·10⁴); NNLS converges
    # far more reliably on unit-norm columns. A positive rescaling keeps w ≥ 0 equivalent.
    column_norms = np.linalg.norm(scaled, axis=0)
    column_norms[column_norms == 0] = 1.0
    # Imported here: scikit-learn costs every process that loads the URL conf ~0.4 s at start
    # (gunicorn and Celery workers, management commands), and only fits need it.
    from sklearn.linear_model import LinearRegression

    model = LinearRegression(positive=True, fit_intercept=False)
    model.fit(scaled / column_norms, np.ones(len(replica_seconds)))
    return np.maximum(model.coef_ / column_norms, 0.0)


def _held_out_relative_errors(
    x: np.ndarray,
    replica_seconds: np.ndarray,
    splits: Sequence[tuple[np.ndarray, np.ndarray]],
) -> np.ndarray:
    """Signed relative error of every sample, predicted by a fit that did not see its shape."""
    errors = np.full(len(replica_seconds), np.nan)
    for train, test in splits:
        weights = _fit_weights(x[train], replica_seconds[train])
        predicted = x[test] @ weights
        errors[test] = (predicted - replica_seconds[test]) / replica_seconds[test]
    return errors


def _group_splits(
    groups: np.ndarray, n_splits: int, seed: int | None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """K folds over distinct shapes, so repeated samples of one shape are never split."""
    group_ids = np.unique(groups)
    if n_splits >= len(group_ids):
        folds = [(np.delete(group_ids, i), group_ids[i : i + 1]) for i in range(len(group_ids))]
    else:
        # Imported here, as LinearRegression is in _fit_weights: scikit-learn's import time.
        from sklearn.model_selection import KFold

        kfold = KFold(n_splits=n_splits, shuffle=True, random_state=seed)
        folds = [(group_ids[a], group_ids[b]) for a, b in kfold.split(group_ids)]
    return [
        (np.flatnonzero(np.isin(groups, train)), np.flatnonzero(np.isin(groups, test)))
        for train, test in folds
    ]


def _default_candidate_sets(shapes: Sequence[Shape]) -> list[tuple[str, ...]]:
    base = [
        PLAIN_FEATURES,
        (*PLAIN_FEATURES, "input_x_output_per_1000"),
        (*PLAIN_FEATURES, "output_sq_per_1000"),
        (*PLAIN_FEATURES, "input_x_output_per_1000", "output_sq_per_1000"),
    ]
    # A feature that never varies is either always 0 (no signal) or collinear with `request`.
    extra = tuple(
        name
        for name in ("cached_input_tokens", "images")
        if len({getattr(shape, name) for shape in shapes}) > 1
    )
    return base + ([(*features, *extra) for features in base] if extra else [])


def _meaningfully_better(larger_mape: float, smaller_mape: float) -> bool:
    improvement = smaller_mape - larger_mape
    return (
        improvement >= MIN_MAPE_IMPROVEMENT_ABSOLUTE
        and improvement >= MIN_MAPE_IMPROVEMENT_RELATIVE * smaller_mape
    )


def _select(candidates: Sequence[CandidateScore]) -> CandidateScore:
    """The smallest feature set no other candidate beats meaningfully.

    Ties in size go to the lower CV MAPE, then to the earlier candidate. Checking against the
    best candidate suffices: whatever beats a set meaningfully, the best beats it too.
    """
    best = min(candidates, key=lambda c: c.cv_mape)
    acceptable = [
        (len(c.features), c.cv_mape, index, c)
        for index, c in enumerate(candidates)
        if not _meaningfully_better(best.cv_mape, c.cv_mape)
    ]
    return min(acceptable, key=lambda item: item[:3])[3]


def fit_cost_model(
    shapes: Sequence[Shape],
    requests_per_s: Sequence[float],
    *,
    folds: int = 5,
    seed: int = 0,
    candidate_sets: Sequence[Sequence[str]] | None = None,
) -> FitResult:
    """Fits non-negative weights, choosing the feature set by grouped k-fold cross-validation.

    `shapes[i]` was measured at `requests_per_s[i]` per replica; a shape may repeat (several runs).
    Folds never split one shape's samples; there are min(folds, distinct shapes) of them, shuffled
    with `seed`. Raises FitError when the data cannot support a fit.
    """
    replica_seconds = _validated_targets(shapes, requests_per_s)
    if folds < 2:
        raise FitError(f"cross-validation needs at least 2 folds, got {folds}")
    if candidate_sets is None:
        raw_sets: Sequence[Sequence[str]] = _default_candidate_sets(shapes)
    else:
        raw_sets = candidate_sets
    feature_sets = list(dict.fromkeys(canonical_features(s) for s in raw_sets))
    if not feature_sets:
        raise FitError("no candidate feature sets to try")

    groups = _shape_groups(shapes)
    distinct_shapes = int(groups.max()) + 1
    splits = _group_splits(groups, min(folds, distinct_shapes), seed)
    full_x = feature_matrix(shapes, FEATURES)

    candidates = []
    held_out: dict[tuple[str, ...], np.ndarray] = {}
    for features in feature_sets:
        x = full_x[:, [FEATURES.index(name) for name in features]]
        errors = np.abs(_held_out_relative_errors(x, replica_seconds, splits))
        held_out[features] = errors
        candidates.append(CandidateScore(features, float(errors.mean()), float(errors.max())))
    chosen = _select(candidates)

    columns = [FEATURES.index(name) for name in chosen.features]
    fitted = _fit_weights(full_x[:, columns], replica_seconds)
    weights = dict.fromkeys(FEATURES, 0.0)
    weights.update({name: float(w) for name, w in zip(chosen.features, fitted, strict=True)})

    predicted = full_x[:, columns] @ fitted
    residuals = tuple(
        Residual(
            shape=shape,
            measured_replica_seconds=float(measured),
            predicted_replica_seconds=float(pred),
            relative_error=float((pred - measured) / measured),
        )
        for shape, measured, pred in zip(shapes, replica_seconds, predicted, strict=True)
    )
    return FitResult(
        features=chosen.features,
        weights_replica_seconds=weights,
        cv_mape=chosen.cv_mape,
        cv_worst_error=chosen.cv_worst_error,
        sample_count=len(shapes),
        distinct_shapes=distinct_shapes,
        residuals=residuals,
        candidates=tuple(candidates),
        cv_error_by_feature=error_by_feature(shapes, held_out[chosen.features]),
    )


# The features whose held-out error is reported apart: the ones a sample has or has not.
REPORTED_FEATURES = ("cached_input_tokens", "images")


def error_by_feature(
    shapes: Sequence[Shape], held_out_errors: np.ndarray
) -> dict[str, dict[str, float | int]]:
    """Held-out |relative error| over the samples with each reported feature."""
    report: dict[str, dict[str, float | int]] = {}
    for name in REPORTED_FEATURES:
        mask = np.array([getattr(shape, name) > 0 for shape in shapes], dtype=bool)
        if mask.any():
            errors = held_out_errors[mask]
            report[name] = {
                "cv_mape": float(errors.mean()),
                "cv_worst_error": float(errors.max()),
                "samples": int(mask.sum()),
            }
    return report


def held_out_errors(
    shapes: Sequence[Shape], requests_per_s: Sequence[float], features: Sequence[str]
) -> tuple[float, float]:
    """Leave-one-shape-out (MAPE, worst |relative error|) of a fit with exactly `features`.

    Each distinct shape in turn is priced by a fit on all the others; this is the figure to quote
    when comparing feature sets on a published table.
    """
    replica_seconds = _validated_targets(shapes, requests_per_s)
    groups = _shape_groups(shapes)
    splits = _group_splits(groups, int(groups.max()) + 1, seed=None)
    names = canonical_features(features)
    errors = np.abs(
        _held_out_relative_errors(feature_matrix(shapes, names), replica_seconds, splits)
    )
    return float(errors.mean()), float(errors.max())
