"""The emulator's prefix cache and image inputs, against vLLM's behaviour: block-granular hits,
the prefix-cache counters, usage's cached tokens, image placeholders and their cost."""

import base64
from dataclasses import replace

import pytest

from dataplane.emulator.cli import apply_arguments
from dataplane.emulator.config import ConfigError, parse_config, with_overrides
from dataplane.emulator.prefix_cache import ImageSpan, PrefixCache, block_hashes
from simulation.engine.profile import ground_truth_replica_seconds, ground_truth_weights

from .support import config, metric, model, scrape, stream

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n not really an image").decode()


def image_part(data: str = PNG) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def cached_model(**overrides) -> dict:
    return model(enable_prefix_caching=True, **overrides)


def complete(http, emulator, prompt: list[int], **body) -> dict:
    response = http.post(
        f"{emulator.url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True} | body,
    )
    assert response.status_code == 200, response.text
    return response.json()


# --- the cache itself ----------------------------------------------------------------------------


def test_a_prompt_hits_the_full_blocks_it_shares_with_an_earlier_one():
    cache = PrefixCache(block_tokens=16, capacity_blocks=100)
    first = list(range(100, 150))  # 50 tokens: three full blocks
    cache.insert(block_hashes(first, 16))
    second = first[:40] + [7] * 30  # shares 40 tokens: two full blocks
    assert cache.hit_tokens(block_hashes(second, 16), len(second)) == 32
    # The same prompt again: whole blocks within its first 49 tokens (the last is always
    # computed), so three.
    assert cache.hit_tokens(block_hashes(first, 16), len(first)) == 48
    # A prompt of exactly two blocks, seen before, hits one: its last token must be computed.
    two_blocks = first[:32]
    assert cache.hit_tokens(block_hashes(two_blocks, 16), 32) == 16


def test_a_different_first_block_shares_nothing_after_it():
    cache = PrefixCache(block_tokens=16, capacity_blocks=100)
    cache.insert(block_hashes(list(range(64)), 16))
    other = [999] + list(range(1, 64))
    assert cache.hit_tokens(block_hashes(other, 16), 64) == 0


def test_the_least_recently_used_blocks_are_evicted_first():
    cache = PrefixCache(block_tokens=4, capacity_blocks=3)
    a, b = block_hashes([1] * 8 + [0], 4), block_hashes([2] * 8 + [0], 4)
    cache.insert(a)
    cache.insert(b)  # four blocks for three places: a's first block goes
    assert len(cache) == 3
    assert cache.hit_tokens(a, 9) == 0
    assert cache.hit_tokens(b, 9) == 8


def test_images_with_the_same_placeholders_but_other_content_share_no_block():
    ids = [5] * 20 + [9] * 20
    one = block_hashes(ids, 16, [ImageSpan(20, 20, b"one")])
    other = block_hashes(ids, 16, [ImageSpan(20, 20, b"two")])
    assert one[0] == other[0]  # the first block ends before the image
    assert one[1] != other[1]


# --- over HTTP -----------------------------------------------------------------------------------


def test_the_prefix_cache_counters_and_usage_details_report_hits_in_tokens(start_emulator, http):
    emulator = start_emulator(
        with_overrides(config(cached_model()), enable_prompt_tokens_details=True)
    )
    shared = list(range(100, 140))
    first = complete(http, emulator, shared + [1, 2, 3])
    second = complete(http, emulator, shared + [4, 5, 6])

    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens"] == 43
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    samples = scrape(http, emulator.url)
    assert metric(samples, "vllm:prefix_cache_queries_total", model_name="tiny") == 86
    assert metric(samples, "vllm:prefix_cache_hits_total", model_name="tiny") == 32
    # The prompt counter counts whole prompts, cache hits included, as vLLM's does.
    assert metric(samples, "vllm:prompt_tokens_total", model_name="tiny") == 86


def test_a_streamed_usage_chunk_carries_the_cached_tokens(start_emulator, http):
    emulator = start_emulator(
        with_overrides(config(cached_model()), enable_prompt_tokens_details=True)
    )
    prompt = list(range(200, 240))
    complete(http, emulator, prompt + [1])
    result = stream(
        http,
        f"{emulator.url}/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt + [2],
            "max_tokens": 3,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert result.events[-1]["usage"] == {
        "prompt_tokens": 41,
        "total_tokens": 44,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 32},
    }


def test_without_the_details_flag_usage_has_no_prompt_tokens_details(start_emulator, http):
    emulator = start_emulator(config(cached_model()))
    complete(http, emulator, list(range(100, 140)))
    second = complete(http, emulator, list(range(100, 140)))
    assert "prompt_tokens_details" not in second["usage"]
    samples = scrape(http, emulator.url)
    assert metric(samples, "vllm:prefix_cache_hits_total", model_name="tiny") == 32


def test_without_prefix_caching_nothing_hits_and_the_counters_stay_at_zero(start_emulator, http):
    emulator = start_emulator(with_overrides(config(model()), enable_prompt_tokens_details=True))
    complete(http, emulator, list(range(100, 140)))
    second = complete(http, emulator, list(range(100, 140)))
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    samples = scrape(http, emulator.url)
    assert metric(samples, "vllm:prefix_cache_queries_total", model_name="tiny") == 0
    assert metric(samples, "vllm:prefix_cache_hits_total", model_name="tiny") == 0


# It times the engine's prefill: another worker's load would be timed too.
@pytest.mark.serial
def test_a_cache_hit_costs_the_configured_share_of_its_prefill(start_emulator, http):
    # 1,000 prompt tokens at 0.2 ms: a 200 ms prefill; its 992 cached tokens at a quarter of
    # that cost 49.6 ms, the 8 others 1.6 ms, beside a 2 ms decode step.
    spec = cached_model(prefill_seconds_per_token=2e-4, cached_prefill_fraction=0.25)
    emulator = start_emulator(config(spec))
    url = f"{emulator.url}/v1/completions"
    body = {"model": "tiny", "max_tokens": 2, "ignore_eos": True}
    shared = list(range(1000, 1996))
    cold = stream(http, url, body | {"prompt": shared + [1, 2, 3, 4]})
    warm = stream(http, url, body | {"prompt": shared + [5, 6, 7, 8]})

    assert 0.200 <= cold.ttft_seconds < 0.200 + 0.03
    assert 0.0532 <= warm.ttft_seconds < 0.0532 + 0.03


def test_an_image_is_placeholder_tokens_in_the_prompt_and_costs_its_encoder_time(
    start_emulator, http
):
    spec = model(
        image_placeholder_tokens=64, prefill_seconds_per_image=0.05, prefill_seconds_per_token=1e-4
    )
    emulator = start_emulator(config(spec))
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this"}, image_part()]}
        ],
    }
    result = stream(http, f"{emulator.url}/v1/chat/completions", body)

    assert result.status == 200, result.events
    assert result.events[-1]["usage"]["prompt_tokens"] == 3 + 64
    # 67 tokens at 0.1 ms + one image at 50 ms + a 2 ms decode step.
    assert 0.0587 <= result.ttft_seconds < 0.0587 + 0.03


def test_an_image_whose_placeholders_are_cached_is_not_encoded_again(start_emulator, http):
    spec = cached_model(image_placeholder_tokens=64, prefill_seconds_per_image=0.1)
    emulator = start_emulator(config(spec))
    url = f"{emulator.url}/v1/chat/completions"

    def ask(question: str, image: dict):
        content = [image, {"type": "text", "text": question}]
        body = {"model": "tiny", "max_tokens": 2, "ignore_eos": True}
        return stream(http, url, body | {"messages": [{"role": "user", "content": content}]})

    first = ask("one two", image_part())
    same_image = ask("three four", image_part())
    other_image = ask("five six", image_part(base64.b64encode(b"another image").decode()))
    assert first.ttft_seconds >= 0.1
    assert same_image.ttft_seconds < 0.05
    assert other_image.ttft_seconds >= 0.1


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", "does not fetch remote media"),
        ("file:///etc/passwd", "Cannot load local files without `--allowed-local-media-path`."),
        ("data:image/png,not-base64", "Only base64 data URLs are supported for now."),
        ("data:image/png;base64,%%%", "is not valid base64"),
        ("data:text/plain;base64,aGk=", "must be an image/* data URL"),
        ("ftp://example.com/cat.png", "The URL must be either a HTTP, data or file URL."),
    ],
)
def test_an_image_url_the_emulator_cannot_read_is_a_400_naming_why(
    start_emulator, http, url, message
):
    emulator = start_emulator(config(model(image_placeholder_tokens=16)))
    part = {"type": "image_url", "image_url": {"url": url}}
    response = http.post(
        f"{emulator.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": [part]}]},
    )
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_a_text_only_model_refuses_images(start_emulator, http):
    emulator = start_emulator(config(model()))
    response = http.post(
        f"{emulator.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": [image_part()]}]},
    )
    assert response.status_code == 400
    assert "takes no image inputs" in response.json()["error"]["message"]


def test_a_chat_of_text_parts_is_tokenized_as_before(start_emulator, http):
    emulator = start_emulator(config(model()))
    content = [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]
    response = http.post(
        f"{emulator.url}/v1/chat/completions",
        json={
            "model": "tiny",
            "max_tokens": 1,
            "messages": [
                {"role": "system", "content": "d e"},
                {"role": "user", "content": content},
            ],
        },
    )
    assert response.json()["usage"]["prompt_tokens"] == 5


# --- configuration and ground truth --------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("cached_prefill_fraction", 1.5, "must be <= 1.0"),
        ("cached_prefill_fraction", -0.1, "must be a finite number >= 0.0"),
        ("enable_prefix_caching", 1, "must be a boolean"),
        ("prefix_cache_block_tokens", 0, "must be >= 1"),
        ("image_placeholder_tokens", -1, "must be >= 0"),
    ],
)
def test_a_bad_cache_or_image_setting_is_refused_naming_the_field(field, value, problem):
    with pytest.raises(ConfigError, match=rf"models\[0\]\.{field}: {problem}"):
        parse_config({"models": [{"name": "m", field: value}]})


def test_the_flags_turn_on_caching_for_every_model_and_the_usage_details():
    base = parse_config({"models": [{"name": "a"}, {"name": "b"}]})
    flagged = apply_arguments(
        base,
        scheduling_policy=None,
        priority_preemption=False,
        fault=[],
        enable_prefix_caching=True,
        enable_prompt_tokens_details=True,
    )
    assert all(m.enable_prefix_caching for m in flagged.models)
    assert flagged.enable_prompt_tokens_details
    assert not any(m.enable_prefix_caching for m in base.models)


def test_the_ground_truth_prices_cached_tokens_and_images_by_their_weights():
    spec = replace(
        parse_config({"models": [model()]}).models[0],
        prefill_seconds_per_token=2e-5,
        cached_prefill_fraction=0.3,
        prefill_seconds_per_image=0.004,
        decode_seconds_per_context_token=1e-7,
    )
    weights = ground_truth_weights(spec, batch_size=8)
    assert weights["cached_input_tokens"] == pytest.approx(6e-6)
    assert weights["images"] == pytest.approx(0.004)
    uncached, cached, output, images = 300, 2000, 40, 2
    features = {
        "input_tokens": uncached,
        "cached_input_tokens": cached,
        "output_tokens": output,
        "input_x_output_per_1000": (uncached + cached) * output / 1000,
        "output_sq_per_1000": output * output / 1000,
        "images": images,
        "request": 1,
    }
    assert sum(weights[f] * x for f, x in features.items()) == pytest.approx(
        ground_truth_replica_seconds(
            spec, uncached, output, 8, cached_input_tokens=cached, images=images
        )
    )
