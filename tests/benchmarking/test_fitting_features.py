"""The fit's held-out error on the samples with cached tokens and with images, beside its
weights for them (benchmarking.fitting): pure, no database."""

import itertools

import numpy as np
import pytest

from benchmarking.fitting import FeatureError, fit_cost_model, held_out_feature_errors
from capacity.pricing.features import (
    PLAIN_FEATURES,
    Shape,
    canonical_features,
    predict_replica_seconds,
)

IO = "input_x_output_per_1000"
OSQ = "output_sq_per_1000"

WEIGHTS = {
    "input_tokens": 1.5e-5,
    "cached_input_tokens": 4e-6,
    "output_tokens": 1.2e-5,
    "input_x_output_per_1000": 2.5e-5,
    "output_sq_per_1000": 1.3e-5,
    "images": 6e-3,
    "request": 7e-4,
}
PLAIN = [
    Shape(input_tokens=i, output_tokens=o)
    for i, o in itertools.product([128, 512, 2048, 5000], [128, 500, 2048])
]
CACHED = [
    Shape(input_tokens=i - c, cached_input_tokens=c, output_tokens=o)
    for i, c, o in [(2048, 1536, 128), (5000, 4096, 500), (4096, 2048, 64)]
]
WITH_IMAGES = [
    Shape(input_tokens=i, output_tokens=o, images=m)
    for i, o, m in [(700, 128, 1), (1300, 64, 2), (700, 500, 2)]
]


def throughputs(shapes, weights=WEIGHTS, noise=0.0, seed=3):
    rng = np.random.default_rng(seed)
    seconds = np.array([predict_replica_seconds(weights, shape) for shape in shapes])
    return list(np.exp(rng.normal(0.0, noise, len(shapes))) / seconds)


def test_a_fit_of_feature_shapes_reports_its_held_out_error_on_each_feature():
    shapes = PLAIN + CACHED + WITH_IMAGES
    result = fit_cost_model(shapes, throughputs(shapes, noise=0.01))

    assert result.weights_replica_seconds["cached_input_tokens"] == pytest.approx(4e-6, rel=0.1)
    assert result.weights_replica_seconds["images"] == pytest.approx(6e-3, rel=0.1)
    errors = {error.feature: error for error in result.feature_errors}
    assert set(errors) == {"cached_input_tokens", "images"}
    assert errors["cached_input_tokens"].sample_count == len(CACHED)
    assert errors["images"].sample_count == len(WITH_IMAGES)
    assert errors["cached_input_tokens"].cv_mape < 0.05
    assert errors["images"].cv_worst_error < 0.10


def test_a_fit_without_the_feature_misprices_exactly_its_shapes():
    # Priced as if cached tokens were free, the cached shapes are the ones that suffer.
    shapes = PLAIN + CACHED
    scores = {
        candidate.features: candidate
        for candidate in fit_cost_model(shapes, throughputs(shapes)).candidates
    }
    without = scores[canonical_features((*PLAIN_FEATURES, IO, OSQ))]
    (cached_error,) = without.feature_errors
    assert cached_error.feature == "cached_input_tokens"
    assert cached_error.cv_mape > 3 * without.cv_mape / 2


def test_plain_shapes_report_no_feature_errors():
    result = fit_cost_model(PLAIN, throughputs(PLAIN))
    assert result.feature_errors == ()
    assert all(candidate.feature_errors == () for candidate in result.candidates)


def test_leave_one_shape_out_errors_of_a_given_feature_set_per_feature():
    shapes = PLAIN + CACHED + WITH_IMAGES
    features = [name for name in WEIGHTS if name != "request"] + ["request"]
    errors = held_out_feature_errors(shapes, throughputs(shapes), features)
    assert [error.feature for error in errors] == ["cached_input_tokens", "images"]
    assert all(isinstance(error, FeatureError) and error.cv_mape < 0.01 for error in errors)
