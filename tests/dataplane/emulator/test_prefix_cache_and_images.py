"""vLLM's automatic prefix cache and image inputs, as the emulator serves them."""

import time
from dataclasses import replace

from .support import config, metric, model, scrape

PROMPT = list(range(1000, 1100))  # 100 tokens: six full blocks of 16, and 4 more
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def complete(http, url, prompt, **extra):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True} | extra
    response = http.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_a_repeated_prefix_is_reported_cached_in_usage_and_in_the_prefix_cache_counters(
    start_emulator, http
):
    emulator = start_emulator(replace(config(model()), enable_prompt_tokens_details=True))

    first = complete(http, emulator.url, PROMPT)
    # The same 96-token prefix (six blocks), then a different tail.
    second = complete(http, emulator.url, PROMPT[:96] + [7, 8, 9])

    assert first == {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102}
    assert second["prompt_tokens"] == 99
    assert second["prompt_tokens_details"] == {"cached_tokens": 96}
    samples = scrape(http, emulator.url)
    assert metric(samples, "vllm:prefix_cache_queries_total", model_name="tiny") == 199
    assert metric(samples, "vllm:prefix_cache_hits_total", model_name="tiny") == 96


def test_without_prompt_tokens_details_usage_says_nothing_of_the_cache_as_vllm(
    start_emulator, http
):
    emulator = start_emulator(config(model()))
    complete(http, emulator.url, PROMPT)

    usage = complete(http, emulator.url, PROMPT)

    assert "prompt_tokens_details" not in usage
    # The last prompt token is always computed (its logits give the first output token), so
    # a whole repeated prompt hits all its full blocks but the one holding that token.
    samples = scrape(http, emulator.url)
    assert metric(samples, "vllm:prefix_cache_hits_total", model_name="tiny") == 96


def test_cached_prompt_tokens_cost_the_cheaper_prefill(start_emulator, http):
    # 0.5 ms a token uncached, nothing cached: a 2,000-token prompt's prefill is a second.
    emulator = start_emulator(
        config(model(prefill_seconds_per_token=5e-4, prefill_seconds_per_cached_token=0.0))
    )
    prompt = list(range(2000))

    started = time.perf_counter()
    complete(http, emulator.url, prompt)
    cold_seconds = time.perf_counter() - started
    started = time.perf_counter()
    complete(http, emulator.url, prompt)
    warm_seconds = time.perf_counter() - started

    assert cold_seconds > 1.0
    assert warm_seconds < 0.3  # 16 tokens computed: 8 ms of prefill


def test_an_image_raises_prompt_tokens_by_the_configured_image_tokens(start_emulator, http):
    emulator = start_emulator(config(model(image_tokens_per_image=40)))
    text = {"type": "text", "text": "describe these two pictures"}

    def chat(content):
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
        response = http.post(f"{emulator.url}/v1/chat/completions", json=body | {"max_tokens": 2})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert chat([text]) == 4
    assert chat([text, IMAGE]) == 4 + 40
    assert chat([IMAGE, text, IMAGE]) == 4 + 2 * 40


def test_an_image_part_without_a_url_gets_a_400_naming_the_message(start_emulator, http):
    emulator = start_emulator(config(model()))
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
    }

    response = http.post(f"{emulator.url}/v1/chat/completions", json=body)

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].content"
