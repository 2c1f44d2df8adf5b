"""The MU currency's rules, in one place (docs/design.md#the-currency): a request's features,
its replica-seconds under a cost model, and its model units.

A cost model predicts the replica time a request consumes on a saturated replica,

    t(req) = Σ_f w_f · x_f(req)        (replica-seconds, every w_f ≥ 0)

and a replica of the model's reference GPU type mints R = REPLICA_MU_PER_MINUTE MU per minute by
definition, so one replica-second is R / 60 MU: `mu_of`. Everything that prices a request (the
fit, usage metering, admission, sellable capacity, the allocation tick, the simulator) goes
through here, so they can never disagree.

Pure: plain numbers and numpy in, plain numbers out; no Django (an import-linter contract).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np

# R, the unit's definition (its one home is capacity.currency), re-exported: the rules below
# default to it.
from capacity.currency import REPLICA_MU_PER_MINUTE as REPLICA_MU_PER_MINUTE

SECONDS_PER_MINUTE = 60.0

# A number, or an array of them (batches are priced as arrays).
Number = TypeVar("Number", float, "np.ndarray[Any, np.dtype[np.float64]]")
Count = TypeVar("Count", int, float, "np.ndarray[Any, np.dtype[np.float64]]")
FloatArray = np.ndarray[Any, np.dtype[np.float64]]

FEATURES: tuple[str, ...] = (
    "input_tokens",  # uncached input (prefill) tokens
    "cached_input_tokens",  # input tokens served from the prefix cache
    "output_tokens",  # decoded tokens
    "input_x_output_per_1000",  # every decode step reads the whole prompt's KV cache
    "output_sq_per_1000",  # ... and the part of the context decoded so far
    "images",
    "request",  # constant 1: per-request overhead (scheduling, sampling setup, detokenising)
)

# The seeds' α/β/γ model: cost = α·input + β·output + γ.
PLAIN_FEATURES: tuple[str, ...] = ("input_tokens", "output_tokens", "request")

# Which feature's MU coefficient is which of the seeds' α, β, γ (see mu_coefficients).
ALPHA_BETA_GAMMA_FEATURES: Mapping[str, str] = {
    "alpha": "input_tokens",
    "beta": "output_tokens",
    "gamma": "request",
}


class FitError(ValueError):
    """The benchmark data cannot support a cost model; the message says why, for a planner."""


def uncached_input_tokens(input_tokens: Count, cached_input_tokens: Count) -> Count:
    """The API counts cached tokens in `input_tokens` (as OpenAI's `usage.prompt_tokens` does);
    the features count the uncached part. The one place that converts (numbers or arrays)."""
    uncached: Count = input_tokens - cached_input_tokens
    return uncached


@dataclass(frozen=True)
class Shape:
    """One request shape: token counts and image count of a benchmarked (or metered) request."""

    input_tokens: int  # uncached input tokens
    output_tokens: int
    cached_input_tokens: int = 0
    images: int = 0

    def __post_init__(self) -> None:
        for field in fields(self):
            raw = getattr(self, field.name)
            try:
                count = operator.index(raw)
            except TypeError:
                raise ValueError(f"Shape.{field.name} must be an integer, got {raw!r}") from None
            if count < 0:
                raise ValueError(f"Shape.{field.name} must not be negative, got {count}")
            # Normalise numpy integers to int so equal shapes hash equal and print plainly.
            object.__setattr__(self, field.name, int(count))

    @property
    def total_input_tokens(self) -> int:
        return self.input_tokens + self.cached_input_tokens

    @classmethod
    def from_api(
        cls, *, input_tokens: int, cached_input_tokens: int = 0, output_tokens: int, images: int = 0
    ) -> Shape:
        """The API's counts (usage events, estimates, admission) include cached tokens in
        `input_tokens`; the features count the uncached part. The one place that converts."""
        return cls(
            input_tokens=uncached_input_tokens(input_tokens, cached_input_tokens),
            output_tokens=output_tokens,
            cached_input_tokens=cached_input_tokens,
            images=images,
        )

    def describe(self) -> str:
        text = f"input {self.input_tokens}, output {self.output_tokens}"
        if self.cached_input_tokens:
            text += f", cached {self.cached_input_tokens}"
        if self.images:
            text += f", images {self.images}"
        return f"({text})"


# --- features -----------------------------------------------------------------------------------


def canonical_features(features: Sequence[str]) -> tuple[str, ...]:
    if isinstance(features, str):
        # A bare string is a sequence of characters; catching it here beats "unknown feature 'i'".
        raise FitError(f"features must be a sequence of feature names, got the string {features!r}")
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        raise FitError(f"unknown feature(s) {unknown}; known features are {list(FEATURES)}")
    if not features:
        raise FitError("a feature set must name at least one feature")
    chosen = set(features)
    return tuple(name for name in FEATURES if name in chosen)


def _feature_values(
    input_tokens: Any, cached_tokens: Any, output_tokens: Any, images: Any, one: Any
) -> dict[str, Any]:
    """Every feature from uncached input, cached input, output and images — numpy arrays or
    plain numbers alike. The one definition of every feature."""
    # Cached tokens still sit in the KV cache that every decode step reads, hence the total.
    total_input_tokens = input_tokens + cached_tokens
    return {
        "input_tokens": input_tokens,
        "cached_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
        "input_x_output_per_1000": total_input_tokens * output_tokens / 1000.0,
        "output_sq_per_1000": output_tokens * output_tokens / 1000.0,
        "images": images,
        "request": one,
    }


def feature_columns(
    *,
    input_tokens: np.ndarray,
    cached_input_tokens: np.ndarray,
    output_tokens: np.ndarray,
    images: np.ndarray,
    features: Sequence[str],
) -> FloatArray:
    """The feature matrix from token-count arrays (uncached input, cached input, output,
    images), without building a Shape per request: usage ingestion prices thousands of
    events per batch this way."""
    names = tuple(features)
    canonical_features(names)  # validates the names
    input_tokens = np.asarray(input_tokens, dtype=float)
    values = _feature_values(
        input_tokens,
        np.asarray(cached_input_tokens, dtype=float),
        np.asarray(output_tokens, dtype=float),
        np.asarray(images, dtype=float),
        np.ones(len(input_tokens)),
    )
    return np.column_stack([values[name] for name in names])


def replica_seconds_of(
    weights: Mapping[str, float],
    *,
    input_tokens: float,
    cached_input_tokens: float = 0.0,
    output_tokens: float,
    images: float = 0.0,
) -> float:
    """`predict_replica_seconds` for one request in plain Python: admission prices one request
    per decision, where building numpy arrays would cost more than the arithmetic."""
    values = _feature_values(
        float(input_tokens), float(cached_input_tokens), float(output_tokens), float(images), 1.0
    )
    return float(sum(float(weight) * values[name] for name, weight in weights.items()))


def batch_replica_seconds(
    seconds_of: Callable[[Any, Any, Any, Any], Any],
    *,
    prompts: Any,
    sequences: Any,
    input_tokens: Any,
    cached_input_tokens: Any,
    output_tokens: Any,
    images: Any,
) -> Any:
    """The replica-seconds of a request the engine runs as `prompts` engine requests (a list of
    prompts) of `sequences` sequences in all (`n` per prompt: parallel sampling), from its
    totals as the engine reports them (vLLM counts each prompt's tokens once, every
    sequence's output): each prompt is prefilled once and pays the per-request overhead, each
    sequence decodes its share of the output. For one prompt and one sequence it is the
    request's own replica-seconds. `seconds_of(uncached input, cached input, output, images)`
    prices one request (plain numbers or numpy arrays alike)."""
    per_input = input_tokens / prompts
    per_cached = cached_input_tokens / prompts
    per_images = images / prompts
    prefill = seconds_of(per_input, per_cached, 0.0 * per_input, per_images)
    whole = seconds_of(per_input, per_cached, output_tokens / sequences, per_images)
    return prompts * prefill + sequences * (whole - prefill)


def replica_seconds_of_batch(
    weights: Mapping[str, float],
    *,
    prompts: int,
    sequences: int,
    input_tokens: float,
    cached_input_tokens: float = 0.0,
    output_tokens: float,
    images: float = 0.0,
) -> float:
    """`replica_seconds_of` for a request of several prompts or sequences
    (`batch_replica_seconds`); `input_tokens` is the uncached input of all its prompts."""

    def seconds_of(uncached: Any, cached: Any, output: Any, image_count: Any) -> float:
        return replica_seconds_of(
            weights,
            input_tokens=uncached,
            cached_input_tokens=cached,
            output_tokens=output,
            images=image_count,
        )

    return float(
        batch_replica_seconds(
            seconds_of,
            prompts=max(1, prompts),
            sequences=max(1, sequences),
            input_tokens=float(input_tokens),
            cached_input_tokens=float(cached_input_tokens),
            output_tokens=float(output_tokens),
            images=float(images),
        )
    )


def feature_matrix(shapes: Sequence[Shape], features: Sequence[str]) -> FloatArray:
    """One row per shape, one column per feature (in the order given)."""
    return feature_columns(
        input_tokens=np.array([s.input_tokens for s in shapes], dtype=float),
        cached_input_tokens=np.array([s.cached_input_tokens for s in shapes], dtype=float),
        output_tokens=np.array([s.output_tokens for s in shapes], dtype=float),
        images=np.array([s.images for s in shapes], dtype=float),
        features=features,
    )


def feature_vector(shape: Shape, features: Sequence[str]) -> FloatArray:
    row: FloatArray = feature_matrix([shape], features)[0]
    return row


# --- prediction and model units -----------------------------------------------------------------


def predict_replica_seconds(weights: Mapping[str, float], shape: Shape) -> float:
    """Replica-seconds the shape costs; features missing from `weights` weigh 0."""
    names = tuple(weights)
    if not names:
        return 0.0
    w = np.array([float(weights[name]) for name in names])
    return float(feature_vector(shape, names) @ w)


def predict_requests_per_s(weights: Mapping[str, float], shape: Shape) -> float:
    """Sustainable requests/s of one replica serving only this shape."""
    replica_seconds = predict_replica_seconds(weights, shape)
    if not replica_seconds > 0:
        raise ValueError(
            f"the cost model prices shape {shape.describe()} at {replica_seconds} replica-seconds;"
            " a throughput needs a positive cost"
        )
    return 1.0 / replica_seconds


def _check_replica_mu_per_minute(replica_mu_per_minute: float) -> None:
    if not (math.isfinite(replica_mu_per_minute) and replica_mu_per_minute > 0):
        raise ValueError(
            f"replica_mu_per_minute must be a positive finite number, got {replica_mu_per_minute}"
        )


def mu_of(replica_seconds: Number, replica_mu_per_minute: float = REPLICA_MU_PER_MINUTE) -> Number:
    """Model units of `replica_seconds` of a replica minting `replica_mu_per_minute`: t · R / 60.
    A number or a numpy array (usage ingestion prices a batch at once)."""
    return replica_seconds * (replica_mu_per_minute / SECONDS_PER_MINUTE)


def mu_coefficients(
    weights: Mapping[str, float], replica_mu_per_minute: float = REPLICA_MU_PER_MINUTE
) -> dict[str, float]:
    """MU per unit of each feature, keyed by feature name: w_f · R / 60.

    On the reference GPU a replica mints R MU per minute, so one replica-second is R/60 MU. The
    seeds' α, β, γ are the entries for input_tokens, output_tokens and request
    (ALPHA_BETA_GAMMA_FEATURES).
    """
    _check_replica_mu_per_minute(replica_mu_per_minute)
    if weights:
        canonical_features(tuple(weights))  # rejects misspelt feature names
    return {name: mu_of(float(weights.get(name, 0.0)), replica_mu_per_minute) for name in FEATURES}


def mu_for(
    weights: Mapping[str, float], shape: Shape, replica_mu_per_minute: float = REPLICA_MU_PER_MINUTE
) -> float:
    """Model units one request of this shape costs."""
    _check_replica_mu_per_minute(replica_mu_per_minute)
    return mu_of(predict_replica_seconds(weights, shape), replica_mu_per_minute)
