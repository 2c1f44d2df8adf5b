"""Work counted as the engine will do it (issue 34, findings 3 and 13): a completion's list of
prompts runs as that many engine requests and `n` samples each prompt that many times, so the
gateway admits and estimates all of it, says so in the usage event (`prompts`, `sequences`), and
refuses what vLLM's V1 engine refuses (`best_of`) before any work; a request the engine refuses
itself is recorded as its refusal (`engine_status`), which bills nothing."""

from __future__ import annotations

import httpx
import pytest

from capacity.admission.redis_layout import parse_record
from capacity.pricing.features import mu_of, replica_seconds_of_batch

from . import contract as C
from .conftest import bearer, usage_events, wait_for


@pytest.fixture
def served(world, start_emulator, start_gateway):
    url, _ = start_emulator()
    world.publication.models["tiny"] = C.model(7, [C.replica(url)])
    world.publish()
    return world, start_gateway(GATEWAY_MAX_N="4")


def test_a_list_of_prompts_sampled_n_times_is_admitted_and_reported_as_all_of_its_work(
    served, http: httpx.Client, usage_server
):
    world, gateway = served
    prompts = ["a b c d " * 50, "e f g h " * 50, "i j k l " * 50]  # 400 bytes: 100 tokens each
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 8, "ignore_eos": True}
    answer = http.post(gateway.url + "/v1/completions", json=body, headers=bearer(world.acme))
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 6
    usage = answer.json()["usage"]
    assert usage["completion_tokens"] == 6 * 8  # every sequence's output

    (event,) = wait_for(lambda: usage_events(usage_server))
    assert (event["prompts"], event["sequences"]) == (3, 6)
    assert (event["input_tokens"], event["output_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    # Admission charged the whole of it: three prompts' input and six sequences' max_tokens
    # (before, one prompt's worth of max_tokens).
    record = parse_record(world.rds.get(f"adm:req:7:1:{event['event_id']}"))
    expected = mu_of(
        replica_seconds_of_batch(
            C.WEIGHTS, prompts=3, sequences=6, input_tokens=300, output_tokens=6 * 8
        ),
        100.0,
    )
    assert record.estimated_mu == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"best_of": 2}, "best_of"), ({"n": 5}, "n"), ({"n": 0}, "n"), ({"prompt": []}, "prompt")],
)
def test_what_the_engine_would_refuse_or_a_request_too_large_is_a_400_before_any_work(
    served, http: httpx.Client, usage_server, extra, param
):
    world, gateway = served
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **extra}
    answer = http.post(gateway.url + "/v1/completions", json=body, headers=bearer(world.acme))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert not usage_events(usage_server)  # refused before admission: no request ran


def test_a_request_the_engine_refuses_before_any_work_is_recorded_as_that(
    served, http: httpx.Client, usage_server
):
    world, gateway = served
    # Over the tiny model's 2,048-token context: the engine answers 400, as vLLM does.
    body = {"model": "tiny", "prompt": "w " * 3000, "max_tokens": 4}
    answer = http.post(gateway.url + "/v1/completions", json=body, headers=bearer(world.acme))
    assert answer.status_code == 400, answer.text
    (event,) = wait_for(lambda: usage_events(usage_server))
    assert (event["outcome"], event["engine_status"], event["output_tokens"]) == ("error", 400, 0)
