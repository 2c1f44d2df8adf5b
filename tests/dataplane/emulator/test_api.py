"""The emulator speaks vLLM's OpenAI-compatible API over real HTTP."""

import httpx

from .support import config, metric, model, scrape, stream, wait_for_samples


def test_a_streamed_token_id_prompt_with_ignore_eos_gets_exactly_max_tokens_and_usage(
    start_emulator, http
):
    emulator = start_emulator(config(model()))
    result = stream(
        http,
        f"{emulator.url}/v1/completions",
        {
            "model": "tiny",
            "prompt": list(range(1, 11)),
            "max_tokens": 7,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )

    assert result.status == 200
    assert result.done
    tokens = result.token_events
    assert len(tokens) == 7
    assert all(e["object"] == "text_completion" and e["model"] == "tiny" for e in tokens)
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * 6 + ["length"]
    assert all(e["usage"] is None for e in tokens)
    usage_chunk = result.events[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}


def test_a_stream_without_include_usage_has_no_usage_chunk(start_emulator, http):
    emulator = start_emulator(config(model()))
    result = stream(
        http,
        f"{emulator.url}/v1/completions",
        {"model": "tiny", "prompt": "a b c", "max_tokens": 3, "ignore_eos": True},
    )

    assert len(result.events) == 3
    assert all("usage" not in e for e in result.events)
    assert result.done


def test_a_non_streamed_completion_returns_text_ids_and_usage(start_emulator, http):
    emulator = start_emulator(config(model()))
    response = http.post(
        f"{emulator.url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": "the quick brown fox",
            "max_tokens": 12,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )

    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 12
    # One word per generated token, so re-tokenizing the text gives the same count.
    assert len(choice["text"].split()) == 12
    assert len(choice["prompt_token_ids"]) == 4
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}


def test_min_tokens_holds_back_the_end_of_sequence(start_emulator, http):
    # mean_output_tokens 1: without min_tokens every request would stop after one token.
    emulator = start_emulator(config(model(mean_output_tokens=1)))
    body = http.post(
        f"{emulator.url}/v1/completions",
        json={"model": "tiny", "prompt": [5, 6], "max_tokens": 10, "min_tokens": 5},
    ).json()

    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "stop"


def test_a_list_of_prompts_gets_one_choice_each(start_emulator, http):
    emulator = start_emulator(config(model()))
    body = http.post(
        f"{emulator.url}/v1/completions",
        json={"model": "tiny", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "ignore_eos": True},
    ).json()

    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}


def test_chat_completions_stream_a_role_then_content_and_count_message_tokens(start_emulator, http):
    emulator = start_emulator(config(model()))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "say three words"}]},
    ]
    unary = http.post(
        f"{emulator.url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 3, "ignore_eos": True},
    ).json()
    streamed = stream(
        http,
        f"{emulator.url}/v1/chat/completions",
        {
            "model": "tiny",
            "messages": messages,
            "max_tokens": 3,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )

    assert unary["object"] == "chat.completion"
    assert unary["choices"][0]["message"]["role"] == "assistant"
    assert len(unary["choices"][0]["message"]["content"].split()) == 3
    assert unary["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    events = streamed.events
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["finish_reason"] for e in events[1:4]] == [None, None, "length"]
    assert events[-1]["usage"]["completion_tokens"] == 3
    assert streamed.done


def test_a_chat_without_max_tokens_may_use_the_rest_of_the_context(start_emulator, http):
    emulator = start_emulator(config(model(context_length=512, kv_cache_tokens=512)))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}

    replies = [http.post(f"{emulator.url}/v1/chat/completions", json=body).json() for _ in range(3)]

    for reply in replies:
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert 1 <= reply["usage"]["completion_tokens"] < 511


def test_models_health_and_version_answer(start_emulator, http):
    emulator = start_emulator(config(model("a"), model("b", context_length=4096)))

    models = http.get(f"{emulator.url}/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [
        ("a", "model", 2048),
        ("b", "model", 4096),
    ]
    assert http.get(f"{emulator.url}/health").status_code == 200
    assert "version" in http.get(f"{emulator.url}/version").json()


def test_an_unknown_model_is_a_404_in_openai_shape(start_emulator, http):
    emulator = start_emulator(config(model()))
    response = http.post(
        f"{emulator.url}/v1/completions", json={"model": "gpt-9", "prompt": "hi", "stream": True}
    )

    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == 404
    assert error["type"] == "NotFoundError"
    assert "gpt-9" in error["message"]


def _bad_request(http: httpx.Client, url: str, body) -> dict:
    response = http.post(url, **({"content": body} if isinstance(body, str) else {"json": body}))
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_malformed_bodies_are_400s_that_name_the_field(start_emulator, http):
    emulator = start_emulator(config(model(context_length=64, vocab_size=1000)))
    url = f"{emulator.url}/v1/completions"

    assert "JSON" in _bad_request(http, url, "{not json")["message"]
    for body, field in [
        ({"prompt": "hi"}, "model"),
        ({"model": "tiny"}, "prompt"),
        ({"model": "tiny", "prompt": []}, "prompt"),
        ({"model": "tiny", "prompt": [1, "x"]}, "prompt"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "priority": 1.5}, "priority"),
        ({"model": "tiny", "prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
        ({"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}}, "stream"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"model": "tiny", "prompt": [5000]}, "prompt"),
    ]:
        error = _bad_request(http, url, body)
        assert field in error["message"], (body, error)
        assert error["type"] == "BadRequestError"
    chat_error = _bad_request(
        http, f"{emulator.url}/v1/chat/completions", {"model": "tiny", "messages": [{"x": 1}]}
    )
    assert "messages[0]" in chat_error["message"]


def test_a_prompt_beyond_the_context_length_is_refused(start_emulator, http):
    emulator = start_emulator(config(model(context_length=64)))
    url = f"{emulator.url}/v1/completions"

    too_long = http.post(url, json={"model": "tiny", "prompt": list(range(64))})
    too_much_output = http.post(
        url, json={"model": "tiny", "prompt": list(range(60)), "max_tokens": 10}
    )

    assert too_long.status_code == 400
    assert "maximum context length is 64" in too_long.json()["error"]["message"]
    assert too_much_output.status_code == 400
    assert too_much_output.json()["error"]["param"] == "max_tokens"


def test_metrics_use_vllms_exact_names_and_counters_move(start_emulator, http):
    emulator = start_emulator(config(model()))
    before = scrape(http, emulator.url)
    stream(
        http,
        f"{emulator.url}/v1/completions",
        {"model": "tiny", "prompt": list(range(10)), "max_tokens": 7, "ignore_eos": True},
    )
    after = scrape(http, emulator.url)

    def delta(name, **labels):
        return metric(after, name, model_name="tiny", **labels) - metric(
            before, name, model_name="tiny", **labels
        )

    assert delta("vllm:prompt_tokens_total") == 10
    assert delta("vllm:generation_tokens_total") == 7
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    for histogram in [
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ]:
        assert delta(f"{histogram}_count") == 1, histogram
    assert delta("vllm:time_per_output_token_seconds_count") == 6
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    assert delta("vllm:request_generation_tokens_sum") == 7
    assert metric(after, "vllm:time_to_first_token_seconds_bucket", model_name="tiny", le="+Inf")
    assert metric(after, "vllm:num_requests_running", model_name="tiny") == 0
    assert metric(after, "vllm:num_requests_waiting", model_name="tiny") == 0
    assert metric(after, "vllm:kv_cache_usage_perc", model_name="tiny") == 0
    assert metric(after, "emulator_replicas", model_name="tiny", state="ready") == 1
    assert metric(after, "emulator_replicas", model_name="tiny", state="starting") == 0
    # prometheus_client appends _total itself; a doubled suffix would break vLLM dashboards.
    assert not any("_total_total" in key for key in after)


def test_a_client_that_hangs_up_mid_stream_frees_its_slot(start_emulator, http):
    emulator = start_emulator(config(model(decode_step_base_seconds=0.005)))
    url = f"{emulator.url}/v1/completions"
    body = {"model": "tiny", "prompt": [1], "max_tokens": 500, "ignore_eos": True, "stream": True}
    with http.stream("POST", url, json=body) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))

    samples = wait_for_samples(
        http,
        emulator.url,
        lambda s: metric(
            s, "vllm:request_success_total", model_name="tiny", finished_reason="abort"
        ),
    )
    assert metric(samples, "vllm:num_requests_running", model_name="tiny") == 0
