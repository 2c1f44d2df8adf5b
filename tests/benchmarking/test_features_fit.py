"""Every feature measured: a suite with prefix-shared prompts and images, run by the real runner
against a real emulator process whose ground truth prices cached tokens and images, and the
fit that gives them their weights."""

import pytest

from benchmarking import services
from benchmarking.models import BenchmarkRun
from capacity.models import CostModel
from tests.support.factories import GpuTypeFactory, ServedModelFactory
from tests.support.processes import emulator_process

# Measures real throughput: runs alone, not beside another test worker.
pytestmark = pytest.mark.serial

# Prefill dominates and decode is cheap, so cached tokens and images carry much of each
# request's cost; a 4 ms decode step keeps the streams few enough for this machine.
VISION = {
    "name": "vision",
    "max_num_seqs": 64,
    "prefill_seconds_per_token": 2.0e-5,
    "prefill_seconds_per_cached_token": 8.0e-6,
    "image_tokens_per_image": 64,
    "vision_encoder_seconds_per_image": 4.0e-3,
    "decode_step_base_seconds": 4.0e-3,
    "decode_seconds_per_sequence": 0.0,
    "decode_seconds_per_context_token": 0.0,
}
GRID = [
    [256, 16],
    [1024, 8],
    [2048, 16],
    [512, 32],
    {"input_len": 2048, "output_len": 8, "prefix_share": 0.75},
    {"input_len": 1024, "output_len": 16, "prefix_share": 0.5},
    {"input_len": 2048, "output_len": 32, "prefix_share": 0.5},
    {"input_len": 256, "output_len": 8, "images": 2},
    # Up to 8 images a request: the image points are short, so a per-request delay of the
    # client (one CI run beside the parallel pass fitted a 2.1 ms intercept where the truth
    # has none) is shared by several images rather than charged to one or two.
    {"input_len": 512, "output_len": 16, "images": 4},
    {"input_len": 128, "output_len": 32, "images": 8},
]
SUITE = {
    "slo_ttft_p95_ms": 10_000,
    "slo_tpot_p95_ms": 1_000,
    # 2.5 s a point: at 1.5 s the cached-token weight (a difference of two shapes' costs) came
    # out 11.5 % off the truth in one clean run of three (throughput noise, not a bias).
    "duration_per_point_seconds": 2.5,
    # One point per shape: the same batch of 8 everywhere, so the truth is one set of weights.
    "concurrency_start": 8,
    "max_concurrency": 8,
    "request_timeout_seconds": 30,
}


@pytest.mark.slow(seconds=40)
@pytest.mark.django_db
def test_a_run_with_shared_prefixes_and_images_fits_their_weights(tmp_path, settings):
    # What is judged here is the fit of every feature; whether the client measured itself is
    # test_client_overhead.py's (beside the niced pass, a few ms of loop lag on this run's
    # short TTFTs once passed the 10 % limit and no cost model was fitted).
    settings.BENCHMARK_MAX_CLIENT_OVERHEAD_PERCENT = float("inf")
    gpu_type = GpuTypeFactory(name="EMU-VISION")
    model = ServedModelFactory(name="vision", engine_model_id="vision", reference_gpu_type=gpu_type)
    suite = services.suite_create(name="every-feature", grid=GRID, **SUITE)
    with emulator_process({"seed": 5, "models": [VISION]}, tmp_path) as url:
        run = services.run_queue(
            suite=suite, endpoint_url=url, served_model=model, gpu_type=gpu_type
        )
        services.run_execute(run_id=run.pk)

    run.refresh_from_db()
    assert run.status == BenchmarkRun.Status.SUCCEEDED, run.error + run.log
    samples = {
        (s.input_len, s.output_len, s.images): s for s in run.samples.filter(sustainable=True)
    }
    assert len(samples) == len(GRID)
    # The hit share read back from the engine's counters: the shared part of the prompt (the
    # first request of a point misses it, hence a tolerance of a few percent).
    assert samples[(2048, 8, 0)].cached_input_len == pytest.approx(1536, rel=0.03)
    assert samples[(1024, 16, 0)].cached_input_len == pytest.approx(512, rel=0.03)
    assert samples[(2048, 16, 0)].cached_input_len == 0  # salted: nothing shared
    # Images counted as the engine counts them: 64 tokens each, beside the text.
    assert samples[(256 + 2 * 64, 8, 2)].cached_input_len == 0
    assert (128 + 8 * 64, 32, 8) in samples

    assert not run.fit_error, run.fit_error
    cost_model = CostModel.objects.get(source_link__run=run)
    weights = cost_model.weights_replica_seconds
    print("fitted weights:", weights, "per feature:", cost_model.cv_error_by_feature)
    assert {"cached_input_tokens", "images"} <= set(cost_model.features)
    # The truth: the profile's own per-cached-token and per-image costs
    # (simulation.engine.profile.ground_truth_replica_seconds).
    # The cached-token weight is the smallest and the least determined (three shapes carry
    # it, as a difference from their uncached cost): 1-3 % off the truth on a quiet machine,
    # but 11.5 % and 16 % in two clean `make test` runs of five, with the parallel pass taking
    # CPU from the emulator. A fit that drops or misprices the feature is still far outside.
    assert weights["cached_input_tokens"] == pytest.approx(
        VISION["prefill_seconds_per_cached_token"], rel=0.20
    )
    assert weights["images"] == pytest.approx(VISION["vision_encoder_seconds_per_image"], rel=0.10)
    assert weights["input_tokens"] == pytest.approx(VISION["prefill_seconds_per_token"], rel=0.10)
    # The held-out error is reported for the samples carrying each feature.
    report = cost_model.cv_error_by_feature
    assert report["cached_input_tokens"]["samples"] == 3
    assert report["images"]["samples"] == 3
    assert report["cached_input_tokens"]["cv_mape"] < 0.10
    assert report["images"]["cv_mape"] < 0.10
