"""Suites with feature shapes (a shared prefix, images): created and changed through the API,
checked, and measured into samples that carry cached tokens and images."""

import io

import pytest
from django.core.management import call_command

from benchmarking import services
from benchmarking.models import BenchmarkRun, BenchmarkSample, BenchmarkSuite
from benchmarking.runner import PointResult, ShapeResult
from capacity.pricing.features import predict_replica_seconds
from dataplane.emulator.background import BackgroundEmulator
from dataplane.emulator.config import parse_config
from tests.benchmarking.test_fitting_features import CACHED, PLAIN, WEIGHTS, WITH_IMAGES

# The benchmark path of `make run`'s demo: on SQLite too.
pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

SUITE = {
    "name": "features",
    "grid": [[128, 16], [512, 16]],
    "slo_ttft_p95_ms": 5000,
    "slo_tpot_p95_ms": 500,
    "duration_per_point_seconds": 0.4,
    "concurrency_start": 4,
    "max_concurrency": 4,
}
FEATURE_SHAPES = [
    {"input_len": 512, "output_len": 16, "cache_hit_share": 0.75},
    {"input_len": 64, "output_len": 16, "images": 2},
]


def test_a_planner_creates_a_suite_with_feature_shapes_and_reads_them_back(planner_client):
    response = planner_client.post(
        "/api/v1/benchmark-suites/", SUITE | {"feature_shapes": FEATURE_SHAPES}, format="json"
    )
    assert response.status_code == 201, response.json()
    assert response.json()["feature_shapes"] == [
        {"input_len": 512, "output_len": 16, "cache_hit_share": 0.75, "images": 0},
        {"input_len": 64, "output_len": 16, "cache_hit_share": 0.0, "images": 2},
    ]
    assert BenchmarkSuite.objects.get(name="features").feature_shapes[1]["images"] == 2


def test_a_suite_without_feature_shapes_is_as_before(planner_client):
    response = planner_client.post("/api/v1/benchmark-suites/", SUITE, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["feature_shapes"] == []
    spec = services.suite_spec(BenchmarkSuite.objects.get(name="features"))
    assert spec.feature_shapes == ()
    assert [(s.input_len, s.output_len, s.has_features) for s in spec.shapes()] == [
        (128, 16, False),
        (512, 16, False),
    ]


@pytest.mark.parametrize(
    ("shape", "field"),
    [
        ({"input_len": 512, "output_len": 16, "cache_hit_share": 1.0}, "cache_hit_share"),
        ({"input_len": 512, "output_len": 16, "cache_hit_share": -0.1}, "cache_hit_share"),
        ({"input_len": 512, "output_len": 16, "images": 65}, "images"),
        ({"input_len": 0, "output_len": 16}, "input_len"),
        ({"input_len": 512, "output_len": 16, "image": 1}, "image"),
    ],
)
def test_a_bad_feature_shape_is_a_400_naming_its_field(planner_client, shape, field):
    response = planner_client.post(
        "/api/v1/benchmark-suites/", SUITE | {"feature_shapes": [shape]}, format="json"
    )
    assert response.status_code == 400
    assert f"feature_shapes.0.{field}" in response.json()["error"]["fields"], response.json()
    assert not BenchmarkSuite.objects.exists()


def test_a_feature_shape_may_not_repeat_a_shape_of_the_suite(planner_client):
    repeat = {"input_len": 128, "output_len": 16}  # no share, no images: the grid's shape
    response = planner_client.post(
        "/api/v1/benchmark-suites/", SUITE | {"feature_shapes": [repeat]}, format="json"
    )
    assert response.status_code == 400
    assert "repeats a shape" in response.json()["error"]["message"]


def test_a_planner_changes_a_suites_feature_shapes(planner_client):
    services.suite_create(**SUITE)
    response = planner_client.patch(
        "/api/v1/benchmark-suites/features/", {"feature_shapes": FEATURE_SHAPES}, format="json"
    )
    assert response.status_code == 200, response.json()
    assert BenchmarkSuite.objects.get().feature_shapes[0]["cache_hit_share"] == 0.75
    clash = planner_client.patch(
        "/api/v1/benchmark-suites/features/",
        {"feature_shapes": [{"input_len": 512, "output_len": 16}]},
        format="json",
    )
    assert clash.status_code == 400
    assert BenchmarkSuite.objects.get().feature_shapes[0]["cache_hit_share"] == 0.75


def test_a_run_counts_the_feature_shapes_in_its_progress(deployment, monkeypatch):
    monkeypatch.setattr(services, "_queue_task", lambda run_id: None)
    deployment.endpoint_url = "http://127.0.0.1:9/"
    deployment.save()
    suite = services.suite_create(**SUITE, feature_shapes=FEATURE_SHAPES)
    run = services.run_queue(suite=suite, deployment=deployment)
    assert run.progress_total == 4


def _point(**values) -> PointResult:
    defaults = {
        "input_len": 64,
        "output_len": 16,
        "concurrency": 4,
        "requests_per_s": 10.0,
        "input_tokens_per_s": 10.0 * 164.4,
        "output_tokens_per_s": 160.0,
        "ttft_p50_ms": 5.0,
        "ttft_p95_ms": 6.0,
        "tpot_p50_ms": 2.0,
        "tpot_p95_ms": 3.0,
        "e2e_p95_ms": 40.0,
        "request_count": 20,
        "error_count": 0,
        "slo_met": True,
    }
    return PointResult(**(defaults | values))


def test_a_feature_point_is_stored_as_the_shape_the_engine_counted(deployment, monkeypatch):
    monkeypatch.setattr(services, "_queue_task", lambda run_id: None)
    deployment.endpoint_url = "http://127.0.0.1:9/"
    deployment.save()
    suite = services.suite_create(**SUITE, feature_shapes=FEATURE_SHAPES)
    run = services.run_queue(suite=suite, deployment=deployment)
    BenchmarkRun.objects.filter(pk=run.pk).update(status=BenchmarkRun.Status.RUNNING)
    point = _point(images=2, cached_input_tokens_per_s=10.0 * 31.6, cache_hits_from="usage")

    services._record_point(run.pk, 1, point)
    services._record_shape(
        run.pk,
        ShapeResult(input_len=64, output_len=16, images=2, points=[point], sustainable=point),
    )

    sample = BenchmarkSample.objects.get()
    # 64 text tokens and two images of 50 placeholder tokens: 164 (mean 164.4) prompt tokens.
    assert (sample.input_len, sample.cached_input_len, sample.images) == (164, 32, 2)
    assert sample.sustainable
    assert "measured 164 prompt tokens, 32 cached (cache hits from usage)" in (
        BenchmarkRun.objects.get().log
    )


def test_a_run_of_feature_shapes_stores_cached_tokens_and_images_on_its_samples(deployment):
    model = {
        "name": deployment.served_model.engine_model_id,
        "max_num_seqs": 8,
        "prefill_seconds_per_token": 1e-5,
        "decode_step_base_seconds": 2e-3,
        "decode_seconds_per_sequence": 0.0,
        "decode_seconds_per_context_token": 0.0,
        "enable_prefix_caching": True,
        "image_placeholder_tokens": 50,
        "prefill_seconds_per_image": 1e-3,
    }
    with BackgroundEmulator(parse_config({"models": [model]})) as emulator:
        deployment.endpoint_url = emulator.url
        deployment.save()
        suite = services.suite_create(**SUITE, feature_shapes=FEATURE_SHAPES)
        run = services.run_queue(suite=suite, deployment=deployment)
        services.run_execute(run_id=run.pk)

    run.refresh_from_db()
    assert run.status == BenchmarkRun.Status.SUCCEEDED, run.error
    assert run.progress_done == 4
    shapes = sorted(
        (s.input_len, s.cached_input_len, s.images) for s in run.samples.filter(sustainable=True)
    )
    # 64 text tokens + 2 × 50 placeholders; 75 % of 512 shared: 384 tokens, 24 full blocks,
    # hit by every request but the shape's first, which the warm-up holds (unless a loaded
    # machine admits it late).
    assert [shape for shape in shapes if shape[1] == 0] == [(128, 0, 0), (164, 0, 2), (512, 0, 0)]
    (cached_shape,) = [shape for shape in shapes if shape[1] > 0]
    assert cached_shape[0] == 512 and cached_shape[1] == pytest.approx(384, rel=0.03)


def test_a_fit_of_feature_samples_records_and_reports_their_held_out_error(deployment):

    run = BenchmarkRun.objects.create(
        served_model=deployment.served_model,
        gpu_type=deployment.gpu_pool.gpu_type,
        status=BenchmarkRun.Status.SUCCEEDED,
        source=BenchmarkRun.Source.IMPORT,
    )
    for shape in PLAIN + CACHED + WITH_IMAGES:
        BenchmarkSample.objects.create(
            run=run,
            input_len=shape.total_input_tokens,
            cached_input_len=shape.cached_input_tokens,
            output_len=shape.output_tokens,
            images=shape.images,
            requests_per_s=1 / predict_replica_seconds(WEIGHTS, shape),
            sustainable=True,
        )

    cost_model = services.cost_model_fit(run=run)

    chosen = next(c for c in cost_model.candidates if c["features"] == cost_model.features)
    held_out = chosen["held_out_by_feature"]
    assert held_out["cached_input_tokens"]["samples"] == len(CACHED)
    assert held_out["images"]["samples"] == len(WITH_IMAGES)
    assert cost_model.weights_replica_seconds["images"] == pytest.approx(WEIGHTS["images"], 0.01)
    assert {r["images"] for r in cost_model.residuals} == {0, 1, 2}
    summary = services.fit_feature_summary(cost_model)
    assert summary.startswith("cached-token samples held out ")
    assert "image samples held out" in summary

    out = io.StringIO()
    call_command(
        "fit_cost_model",
        "--model",
        deployment.served_model.name,
        "--gpu",
        deployment.gpu_pool.gpu_type.name,
        "--run",
        str(run.pk),
        stdout=out,
    )
    assert "image samples held out" in out.getvalue()
    assert "(+2 images)" in out.getvalue()
