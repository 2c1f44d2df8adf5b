"""Pricing request shapes with a stored cost model: replica-seconds, MU and requests/s.

The currency lives in one place, `capacity.pricing.features`, which is pure numpy and shared
by the fit and by pricing so that the two can never disagree.
"""

from collections.abc import Iterable, Mapping

import numpy as np

from capacity.models import CostModel
from capacity.pricing.features import (
    FEATURES,
    FloatArray,
    Shape,
    batch_replica_seconds,
    feature_columns,
    mu_of,
    predict_replica_seconds,
    uncached_input_tokens,
)


def shape_from(row: Mapping) -> Shape:
    """API shapes count all prompt tokens in input_tokens; the fit's feature is the uncached
    part."""
    return Shape.from_api(
        input_tokens=int(row["input_tokens"]),
        cached_input_tokens=int(row.get("cached_input_tokens", 0) or 0),
        output_tokens=int(row["output_tokens"]),
        images=int(row.get("images", 0) or 0),
    )


def shape_mu(cost_model: CostModel, row: Mapping) -> float:
    """The MU of one request shape (a row of input/output/cached tokens) under this version."""
    replica_seconds = predict_replica_seconds(cost_model.weights_replica_seconds, shape_from(row))
    return mu_of(replica_seconds, cost_model.replica_mu_per_minute)


def price_shapes(cost_model: CostModel, rows: Iterable[Mapping]) -> list[dict]:
    """Each shape of `rows` with its replica-seconds and MU under this version (the cost estimate
    API)."""
    priced = []
    for row in rows:
        replica_seconds = predict_replica_seconds(
            cost_model.weights_replica_seconds, shape_from(row)
        )
        priced.append(
            {
                "input_tokens": int(row["input_tokens"]),
                "cached_input_tokens": int(row.get("cached_input_tokens", 0) or 0),
                "output_tokens": int(row["output_tokens"]),
                "images": int(row.get("images", 0) or 0),
                "replica_seconds": replica_seconds,
                "mu": mu_of(replica_seconds, cost_model.replica_mu_per_minute),
                "requests_per_s": 1.0 / replica_seconds if replica_seconds > 0 else None,
            }
        )
    return priced


def mu_per_request(
    cost_model: CostModel,
    *,
    input_tokens: np.ndarray,
    cached_input_tokens: np.ndarray,
    output_tokens: np.ndarray,
    images: np.ndarray,
    prompts: np.ndarray | None = None,
    sequences: np.ndarray | None = None,
) -> FloatArray:
    """MU of each request under `cost_model`, from arrays of the API's counts (input_tokens
    includes the cached ones): usage ingestion prices a batch this way, and a price review
    prices a week of requests under two versions. `prompts` and `sequences` (each request's
    engine requests and sequences, None: one each) price a request of several prompts or of
    `n` sequences as the engine runs it (features.batch_replica_seconds)."""
    input_tokens = np.asarray(input_tokens, dtype=float)
    cached_input_tokens = np.asarray(cached_input_tokens, dtype=float)
    weights = np.array([cost_model.weights_replica_seconds.get(name, 0.0) for name in FEATURES])

    def seconds_of(uncached, cached, output, image_count):
        matrix = feature_columns(
            input_tokens=uncached,
            cached_input_tokens=cached,
            output_tokens=output,
            images=image_count,
            features=FEATURES,
        )
        return matrix @ weights

    uncached = uncached_input_tokens(input_tokens, cached_input_tokens)
    output = np.asarray(output_tokens, dtype=float)
    image_counts = np.asarray(images, dtype=float)
    if prompts is None and sequences is None:
        seconds = seconds_of(uncached, cached_input_tokens, output, image_counts)
    else:
        ones = np.ones(len(input_tokens))
        seconds = batch_replica_seconds(
            seconds_of,
            prompts=ones if prompts is None else np.maximum(np.asarray(prompts, float), 1.0),
            sequences=ones if sequences is None else np.maximum(np.asarray(sequences, float), 1.0),
            input_tokens=uncached,
            cached_input_tokens=cached_input_tokens,
            output_tokens=output,
            images=image_counts,
        )
    mu: FloatArray = mu_of(seconds, cost_model.replica_mu_per_minute)
    return mu
