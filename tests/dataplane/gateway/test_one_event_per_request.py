"""Exactly one usage event per request, whatever stage it ends in (issue 33, item 4): a table
of every stage a request goes through × every way it can end there, each row driven through
the real gateway against real engines (the emulator) and a recording control plane, and
checked for one event, with the right outcome and tokens.

A request whose gateway worker dies holding its event is the control plane's to close (the
reaper: tests/capacity/metering/test_reaper.py, and the chaos test); one whose client leaves
while Redis decides is tests/dataplane/gateway/test_requests.py's (it pauses a Redis of its
own).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

from tests.support.recording_server import RecordingServer

from . import contract as C
from .conftest import bearer, set_limits, tiny_model, usage_events, wait_for

# 20 ms a decode step: 1,000 tokens take 20 s, so a stream is mid-way for as long as a row needs.
SLOW = {"seed": 0, "models": [tiny_model(decode_step_base_seconds=0.02)]}
LONG = {"model": "tiny", "prompt": "a b c d", "max_tokens": 1000, "ignore_eos": True}
SHORT = {"model": "tiny", "prompt": "a b c d", "max_tokens": 4, "ignore_eos": True}
ERROR_BODY = b'{"error": {"message": "engine failure", "type": "server_error", "code": 500}}'


@dataclass
class Row:
    stage: str
    end: str
    drive: Callable[[Bench], None]
    outcome: str
    admission_class: str | None
    check: Callable[[dict], bool] = lambda event: True


@dataclass
class Bench:
    world: object
    gateway_url: str
    engine_url: str
    broken_url: str
    http: httpx.Client

    def post(self, body: dict, *, model: str = "tiny", timeout: float = 30) -> httpx.Response:
        return self.http.post(
            self.gateway_url + "/v1/completions",
            json={**body, "model": model},
            headers=bearer(self.world.acme),
            timeout=timeout,
        )

    def leave_mid_stream(self, after_chunks: int, *, model: str = "tiny") -> None:
        with self.http.stream(
            "POST",
            self.gateway_url + "/v1/completions",
            json={**LONG, "stream": True, "model": model},
            headers=bearer(self.world.acme),
        ) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen >= after_chunks:
                    return

    def fault(self, mode: str, **extra) -> None:
        self.http.post(self.engine_url + "/emulator/faults", json={"mode": mode, **extra})

    def set_models(self, **models: dict) -> None:
        self.world.publication.models = models
        version = self.world.publish()
        wait_for(lambda: self.http.get(self.gateway_url + "/healthz").json()["contract_version"]
                 == version)  # fmt: skip


def _refused_over_the_allowance(bench: Bench) -> None:
    set_limits(bench.world.rds, {(1, 7): (0.0, 0.0)})
    try:
        assert bench.post(SHORT).status_code == 429
    finally:
        set_limits(bench.world.rds, {(1, 7): (1000.0, 1000.0)})


def _shed(bench: Bench) -> None:
    set_limits(bench.world.rds, {(1, 7): (0.0, 1000.0)})  # best-effort only
    bench.set_models(tiny=C.model(7, [C.replica(bench.engine_url)], refuse_best_effort=True))
    try:
        answer = bench.post(SHORT)
        assert answer.status_code == 429 and answer.json()["error"]["limit"] == "degradation"
    finally:
        set_limits(bench.world.rds, {(1, 7): (1000.0, 1000.0)})
        bench.set_models(tiny=C.model(7, [C.replica(bench.engine_url)]))


def _held_then_gone(bench: Bench) -> None:
    bench.set_models(tiny=C.model(7, []))
    try:
        with pytest.raises(httpx.ReadTimeout):
            bench.post(SHORT, timeout=1.0)  # held at zero; the client gives up
        # The gateway saw it leave: it holds nothing for the model any more.
        wait_for(lambda: not bench.world.rds.hexists(C.WAITING, "tiny"))
    finally:
        bench.set_models(tiny=C.model(7, [C.replica(bench.engine_url)]))


def _held_then_timed_out(bench: Bench) -> None:
    bench.set_models(tiny=C.model(7, []))
    try:
        answer = bench.post(SHORT)  # the gateway's cold-start wait (3 s) passes
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_not_ready"
    finally:
        bench.set_models(tiny=C.model(7, [C.replica(bench.engine_url)]))


def _held_then_served(bench: Bench) -> None:
    bench.set_models(tiny=C.model(7, []))
    wakes = threading.Timer(
        1.0, lambda: bench.set_models(tiny=C.model(7, [C.replica(bench.engine_url)]))
    )
    wakes.start()
    try:
        answer = bench.http.post(
            bench.gateway_url + "/v1/completions",
            json={**SHORT, "stream": True},
            headers=bearer(bench.world.acme),
        )
        assert answer.status_code == 200
    finally:
        wakes.join()


def _engine_error_before_the_first_byte(bench: Bench) -> None:
    bench.set_models(tiny=C.model(7, [C.replica(bench.broken_url)]))
    try:
        assert bench.post(SHORT).status_code == 500
    finally:
        bench.set_models(tiny=C.model(7, [C.replica(bench.engine_url)]))


def _gone_before_the_first_byte(bench: Bench) -> None:
    bench.fault("hang")  # the engine accepts, and never steps
    try:
        with pytest.raises(httpx.ReadTimeout):
            bench.post(LONG, timeout=0.5)
    finally:
        bench.fault("none")


def _gone_mid_stream(bench: Bench) -> None:
    bench.leave_mid_stream(after_chunks=5)


def _stalled_mid_stream(bench: Bench) -> None:
    with bench.http.stream(
        "POST",
        bench.gateway_url + "/v1/completions",
        json={**LONG, "stream": True},
        headers=bearer(bench.world.acme),
    ) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                bench.fault("hang")  # no further token: the token timeout (1 s) ends it
                break
        for _ in lines:
            pass
    bench.fault("none")


def _streamed(bench: Bench) -> None:
    answer = bench.http.post(
        bench.gateway_url + "/v1/completions",
        json={**SHORT, "stream": True},
        headers=bearer(bench.world.acme),
    )
    assert answer.status_code == 200 and "[DONE]" in answer.text


def _whole(bench: Bench) -> None:
    assert bench.post(SHORT).status_code == 200


def _gone_waiting_for_a_whole_answer(bench: Bench) -> None:
    with pytest.raises(httpx.ReadTimeout):
        bench.post(LONG, timeout=0.5)


ROWS = [
    Row("admission", "refused (MU)", _refused_over_the_allowance, "refused", None,
        lambda e: e["estimated_mu"] > 0 and e["output_tokens"] == 0),
    Row("admission", "shed (degradation)", _shed, "refused", None,
        lambda e: e["estimated_mu"] > 0),
    Row("held at zero", "client gone", _held_then_gone, "cancelled", None,
        lambda e: e["output_tokens"] == 0 and e["held_ms"] >= 500),
    Row("held at zero", "timed out", _held_then_timed_out, "refused", None,
        lambda e: e["estimated_mu"] > 0 and e["held_ms"] >= 2500),
    Row("held at zero", "completed", _held_then_served, "completed", "guaranteed",
        lambda e: e["output_tokens"] == 4 and e["held_ms"] >= 500
        and e["ttft_ms"] < e["held_ms"]),
    Row("before the first byte", "engine error", _engine_error_before_the_first_byte, "error",
        "guaranteed", lambda e: e["output_tokens"] == 0),
    Row("before the first byte", "client gone", _gone_before_the_first_byte, "cancelled",
        "guaranteed", lambda e: e["output_tokens"] == 0),
    Row("streaming", "client gone", _gone_mid_stream, "cancelled", "guaranteed",
        lambda e: e["output_tokens"] >= 5),
    Row("streaming", "token timeout", _stalled_mid_stream, "error", "guaranteed",
        lambda e: e["output_tokens"] >= 1),
    Row("streaming", "completed", _streamed, "completed", "guaranteed",
        lambda e: e["output_tokens"] == 4 and e["streamed"] is True and e["ttft_ms"] >= 0),
    Row("whole answer", "completed", _whole, "completed", "guaranteed",
        lambda e: e["output_tokens"] == 4 and e["streamed"] is False and "ttft_ms" not in e),
    Row("whole answer", "client gone", _gone_waiting_for_a_whole_answer, "cancelled",
        "guaranteed", lambda e: e["streamed"] is False),
]  # fmt: skip


def test_every_request_leaves_exactly_one_event_whatever_stage_it_ends_in_and_however(
    world, start_emulator, start_gateway, http, usage_server
):
    engine_url, _ = start_emulator(SLOW)
    world.publication.models["tiny"] = C.model(7, [C.replica(engine_url)])
    world.publish()
    gateway = start_gateway(
        GATEWAY_TOKEN_TIMEOUT_SECONDS="1",
        GATEWAY_COLD_START_WAIT_SECONDS="3",
        GATEWAY_RETRIES="0",
    )
    with RecordingServer(status=500, body=ERROR_BODY) as broken:
        bench = Bench(world, gateway.url, engine_url, broken.url, http)
        failures = []
        for row in ROWS:
            before = len(usage_events(usage_server))
            row.drive(bench)
            try:
                events = wait_for(
                    lambda before=before: (
                        len(found := usage_events(usage_server)) > before and found
                    )
                )
                time.sleep(0.5)  # a second event, were one left, would come within the flush
                new = usage_events(usage_server)[before:]
            except AssertionError:
                failures.append(f"{row.stage} / {row.end}: no event")
                continue
            del events
            if len(new) != 1:
                failures.append(f"{row.stage} / {row.end}: {len(new)} events {new}")
                continue
            event = new[0]
            got = (event["outcome"], event.get("admission_class"))
            if got != (row.outcome, row.admission_class) or not row.check(event):
                failures.append(f"{row.stage} / {row.end}: {event}")
    assert not failures, "\n".join(failures)
