"""The fast path of a usage batch (msgspec) reads what pydantic reads, or leaves the batch to
pydantic: never a different value, never an event pydantic would refuse."""

import json
from datetime import UTC, datetime, timedelta

import pytest

from capacity.metering.events import UsageEventIn, decode_batch

FINISHED = datetime(2026, 12, 3, 10, 0, 5, 123456, tzinfo=UTC)


def event(**overrides) -> dict:
    body = {
        "event_id": "req-1",
        "customer": "acme",
        "model": "llama-8b",
        "deployment": "llama-prod",
        "replica": "http://10.0.0.1:8000",
        "started_at": (FINISHED - timedelta(seconds=3)).isoformat(),
        "finished_at": FINISHED.isoformat(),
        "input_tokens": 1000,
        "cached_input_tokens": 10,
        "output_tokens": 100,
        "images": 1,
        "outcome": "completed",
        "admission_class": "guaranteed",
        "api_key": "mu_abcdef",
        "ttft_ms": 120,
        "estimated_mu": 3,
        "prompt_bytes": 4000,
    }
    return body | overrides


def body(*events, bare=False) -> bytes:
    return json.dumps(list(events) if bare else {"events": list(events)}).encode()


@pytest.mark.parametrize("bare", [False, True])
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"started_at": "2026-12-03T11:00:02+01:00", "finished_at": "2026-12-03T10:00:05Z"},
        {"customer": None, "deployment": None, "ttft_ms": None, "estimated_mu": 0.5},
    ],
)
def test_the_fast_path_reads_every_field_as_pydantic_does(overrides, bare):
    raw = event(**overrides)
    decoded = decode_batch(body(raw, raw | {"event_id": "req-2"}, bare=bare))
    assert decoded is not None and len(decoded) == 2
    expected = UsageEventIn.model_validate(raw)
    for name in UsageEventIn.model_fields:
        assert getattr(decoded[0], name) == getattr(expected, name), name
        assert type(getattr(decoded[0], name)) is type(getattr(expected, name)), name
    assert decoded[0].finished_at.tzinfo is UTC


@pytest.mark.parametrize(
    "overrides",
    [
        {"input_tokens": "12"},
        {"input_tokens": True},
        {"output_tokens": 1.5},
        {"ttft_ms": "12"},  # pydantic's lax float reads it: its path decides
        {"event_id": " padded "},  # pydantic strips it: its path decides
        {"event_id": "line\n"},
        {"model": ""},
        {"surprise": 1},
        {"outcome": "maybe"},
        {"finished_at": "2026-11-01T00:00:00"},
        {"started_at": "0001-01-01T00:00:00+01:00"},
        {"started_at": FINISHED.isoformat(), "finished_at": (FINISHED - timedelta(1)).isoformat()},
        {"cached_input_tokens": 5000},
        {"ttft_ms": 10_000},
        {"started_at": "2026-12-03T10:00:02.1234567Z"},  # msgspec would round, pydantic cuts
    ],
)
def test_whatever_the_fast_path_is_unsure_of_goes_to_pydantic(overrides):
    assert decode_batch(body(event(), event(**overrides))) is None


@pytest.mark.parametrize(
    "raw", [b"", b"not json", b'{"events": [], "more": 1}', b'{"events": null}', b"[[[[1]]]]"]
)
def test_bodies_that_are_no_batch_go_to_the_json_parser(raw):
    assert decode_batch(raw) is None


def test_an_empty_batch_is_an_empty_list():
    assert decode_batch(b'{"events": []}') == []
