"""The runner's feature shapes: prefix-shared prompts and images sent as vLLM takes them, and
the cache hits read back from usage or from the engine's prefix-cache counters."""

import asyncio
import struct
import zlib

import pytest

from benchmarking import runner
from controlplane import outbound
from dataplane.emulator.background import BackgroundEmulator
from dataplane.emulator.config import parse_config, with_overrides

# Measures real throughput and latency: runs alone, not beside another test worker.
pytestmark = pytest.mark.serial

LOOPBACK = outbound.HostPolicy.parse("BENCHMARK_ALLOWED_HOSTS", outbound.DEFAULT_ALLOWED_HOSTS)

MODEL = {
    "name": "tiny",
    "max_num_seqs": 8,
    "kv_cache_tokens": 100_000,
    "context_length": 4096,
    "prefill_seconds_per_token": 1e-5,
    "decode_step_base_seconds": 2e-3,
    "decode_seconds_per_sequence": 0.0,
    "decode_seconds_per_context_token": 0.0,
    "enable_prefix_caching": True,
    "image_placeholder_tokens": 50,
    "prefill_seconds_per_image": 1e-3,
}


def spec(*feature_shapes: runner.ShapeSpec) -> runner.SuiteSpec:
    return runner.SuiteSpec(
        grid=(),
        slo_ttft_p95_ms=10_000,
        slo_tpot_p95_ms=1_000,
        duration_per_point_seconds=0.5,
        concurrency_start=4,
        max_concurrency=4,
        request_timeout_seconds=10,
        feature_shapes=feature_shapes,
    )


def run(emulator, *shapes: runner.ShapeSpec) -> list[runner.ShapeResult]:
    return asyncio.run(
        runner.run_grid(
            host_policy=LOOPBACK, base_url=emulator.url, model="tiny", spec=spec(*shapes)
        )
    )


def per_request(point: runner.PointResult) -> tuple[float, float]:
    """(prompt tokens, cached tokens) of the point's mean request."""
    return (
        point.input_tokens_per_s / point.requests_per_s,
        point.cached_input_tokens_per_s / point.requests_per_s,
    )


@pytest.fixture
def emulator():
    with BackgroundEmulator(parse_config({"seed": 1, "models": [MODEL]})) as running:
        yield running


@pytest.fixture
def emulator_with_details():
    config = with_overrides(
        parse_config({"seed": 1, "models": [MODEL]}), enable_prompt_tokens_details=True
    )
    with BackgroundEmulator(config) as running:
        yield running


def test_requests_of_a_cache_shape_share_exactly_their_prefix():
    endpoint = runner.Endpoint("http://127.0.0.1:9", "m", client=object())
    shape = runner.ShapeSpec(100, 8, cache_hit_share=0.4)
    (_, one), (_, two) = endpoint._body(shape), endpoint._body(shape)
    assert one["prompt"][:40] == two["prompt"][:40]
    assert one["prompt"][40] != two["prompt"][40]
    other_shape = endpoint._body(runner.ShapeSpec(200, 8, cache_hit_share=0.4))[1]
    assert other_shape["prompt"][:16] != one["prompt"][:16]
    # A grid shape's prompts share not even their first block.
    plain = [endpoint._body(runner.ShapeSpec(32, 8))[1]["prompt"] for _ in range(2)]
    assert plain[0][:16] != plain[1][:16]


def test_salted_prompts_do_not_repeat_after_thirty_thousand_requests():
    assert runner.prompt_token_ids(16, 5) != runner.prompt_token_ids(16, 30_005)


def test_an_image_shape_is_a_chat_request_with_distinct_inline_pngs():
    endpoint = runner.Endpoint("http://127.0.0.1:9", "m", client=object())
    url, body = endpoint._body(runner.ShapeSpec(10, 4, images=2))
    assert url == "http://127.0.0.1:9/v1/chat/completions"
    content = body["messages"][0]["content"]
    assert content[0]["type"] == "text" and len(content[0]["text"].split()) == 10
    urls = [part["image_url"]["url"] for part in content[1:]]
    assert len(set(urls)) == 2 and all(u.startswith("data:image/png;base64,") for u in urls)
    assert body["max_tokens"] == body["min_tokens"] == 4 and body["ignore_eos"]


def test_the_images_are_valid_pngs():
    png = runner.image_png(salt=12, index=1)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    position, chunks = 8, {}
    while position < len(png):
        (length,) = struct.unpack(">I", png[position : position + 4])
        kind = png[position + 4 : position + 8]
        data = png[position + 8 : position + 8 + length]
        (crc,) = struct.unpack(">I", png[position + 8 + length : position + 12 + length])
        assert crc == zlib.crc32(kind + data)
        chunks[kind] = data
        position += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (width, height, depth, colour) == (runner.IMAGE_SIDE_PX, runner.IMAGE_SIDE_PX, 8, 2)
    assert len(zlib.decompress(chunks[b"IDAT"])) == height * (1 + 3 * width)
    assert b"IEND" in chunks


def test_the_prefix_cache_counters_are_read_per_model_and_under_their_older_names():
    text = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="a"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="a"} 50.0
vllm:prefix_cache_queries_total{engine="0",model_name="b"} 7.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="a"} 64.0
vllm:prefix_cache_hits_total{engine="1",model_name="a"} 16.0
vllm:prefix_cache_hits_total{engine="0",model_name="b"} 1.0
"""
    assert runner.prefix_cache_counters(text, "a") == (150.0, 80.0)
    legacy = """# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="a"} 10.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{model_name="a"} 4.0
"""
    assert runner.prefix_cache_counters(legacy, "a") == (10.0, 4.0)
    assert runner.prefix_cache_counters("vllm:num_requests_running 0\n", "a") is None


def test_cache_hits_are_read_from_usage_when_the_engine_reports_them(emulator_with_details):
    (shape,) = run(emulator_with_details, runner.ShapeSpec(256, 8, cache_hit_share=0.5))
    point = shape.sustainable
    assert point.cache_hits_from == "usage"
    prompt_tokens, cached_tokens = per_request(point)
    assert prompt_tokens == pytest.approx(256)
    # 128 shared tokens: eight full blocks, hit by every request but the shape's first.
    assert cached_tokens == pytest.approx(128, rel=0.02)


def test_cache_hits_are_read_from_the_prefix_cache_counters_otherwise(emulator):
    (shape,) = run(emulator, runner.ShapeSpec(256, 8, cache_hit_share=0.5))
    point = shape.sustainable
    assert point.cache_hits_from == "metrics"
    assert per_request(point)[1] == pytest.approx(128, rel=0.02)


def test_an_image_shapes_prompt_tokens_count_the_placeholders_the_engine_added(emulator):
    (shape,) = run(emulator, runner.ShapeSpec(100, 8, images=2))
    point = shape.sustainable
    assert point.error_count == 0 and point.images == 2
    prompt_tokens, cached_tokens = per_request(point)
    assert prompt_tokens == pytest.approx(100 + 2 * 50)
    assert cached_tokens == 0  # distinct images, after the salted text: nothing to hit


def test_the_counters_of_every_held_replica_are_summed():
    config = parse_config({"seed": 1, "models": [MODEL]})
    with BackgroundEmulator(config) as first, BackgroundEmulator(config) as second:
        (shape,) = asyncio.run(
            runner.run_grid(
                host_policy=LOOPBACK,
                base_url=[first.url, second.url],
                model="tiny",
                spec=spec(runner.ShapeSpec(256, 8, cache_hit_share=0.5)),
            )
        )
    point = shape.sustainable
    assert point.cache_hits_from == "metrics" and point.engines_measured == 2
    assert per_request(point)[1] == pytest.approx(128, rel=0.02)
