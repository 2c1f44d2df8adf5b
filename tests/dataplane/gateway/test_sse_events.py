"""The SSE pass-through without parsing every chunk (`pass_events`): it passes on, drops and
counts exactly what parsing every event did (the reference below, the gateway's code before),
on the chunks vLLM, the emulator and OpenAI-style engines send."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from dataplane.gateway.relay import pass_events
from dataplane.gateway.usage import Usage


def reference(data: bytes, include_usage: bool, usage: Usage) -> tuple[bytes, bool]:
    """Every data event parsed (the gateway's code until the byte scan replaced it)."""
    parts: list[bytes] = []
    done = False
    for event in data.split(b"\n\n"):
        if not event.strip():
            continue
        payload = event.strip()
        if payload.startswith(b"data:"):
            text = payload[5:].strip()
            if text == b"[DONE]":
                done = True
            else:
                try:
                    doc = json.loads(text)
                except ValueError:
                    doc = None
                if isinstance(doc, dict):
                    choices = doc.get("choices")
                    if doc.get("usage"):
                        usage.take_engine_usage(doc["usage"])
                        if not choices and not include_usage:
                            continue
                    if choices and not usage.engine_usage:
                        usage.output_tokens += sum(
                            1
                            for c in choices
                            if isinstance(c, dict)
                            and (c.get("text") or (c.get("delta") or {}).get("content"))
                        )
        parts.append(event + b"\n\n")
    return b"".join(parts), done


def fresh() -> Usage:
    return Usage(
        request_id="r", customer="c", model="m", started_at=0.0, input_tokens=3, estimated_mu=1.0
    )


def chat(content, *, spaced=False, usage_null=False, finish=None, role=False) -> dict:
    delta = {"role": "assistant", "content": content} if role else {"content": content}
    doc = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage_null:
        doc["usage"] = None
    return doc


def completion(text, **_options) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
    }


USAGE_CHUNK = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "m",
    "choices": [],
    "usage": {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 2},
    },
}


def event(doc, *, spaced=False) -> bytes:
    separators = (", ", ": ") if spaced else (",", ":")
    return b"data: " + json.dumps(doc, separators=separators).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"

# What engines send: vLLM/the emulator (compact), OpenAI-style (spaced), and the odd ones.
CORPUS = [
    event(chat("", role=True)),
    event(chat("Hello")),
    event(chat(' wor"ld', spaced=True), spaced=True),
    event(chat('say "content":"x" and \\"text\\"')),
    event(chat("caf\u00e9 \u2603")),
    event(chat(None, finish="stop")),
    event(chat("", finish="length")),
    event(chat("x", usage_null=True)),
    event(chat("x", usage_null=True), spaced=True),
    event(completion("abc")),
    event(completion(""), spaced=True),
    event(completion("content")),
    event(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "function": {"arguments": '{"text": "hi", "content": 1}'}}
                        ]
                    },
                }
            ]
        }
    ),
    event(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "a"},
                    "logprobs": {"content": [{"token": "a", "logprob": -0.1, "bytes": [97]}]},
                }
            ]
        }
    ),
    event(
        {
            "choices": [
                {
                    "index": 0,
                    "text": "a",
                    "logprobs": {"tokens": ["a"], "top_logprobs": [{"content": -0.2, "text": -1}]},
                }
            ]
        }
    ),
    event({"choices": [{"index": 0, "delta": {"content": "a"}}, {"index": 1, "text": "b"}]}),
    event({"choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]}),
    event({"error": {"message": "boom", "type": "api_error", "param": None, "code": 503}}),
    event(USAGE_CHUNK),
    event(USAGE_CHUNK, spaced=True),
    event({**chat("tok"), "usage": USAGE_CHUNK["usage"]}),  # continuous usage stats
    event({"choices": [], "usage": {}}),
    b": keep-alive comment\n\n",
    b"event: ping\ndata: {}\n\n",
    b"data: not json\n\n",
    b"\n\n",
    b"  \n\n",
    DONE,
]


def _same(chunks: list[bytes], include_usage: bool) -> None:
    ours, theirs = fresh(), fresh()
    for chunk in chunks:
        assert pass_events(chunk, include_usage, ours) == reference(chunk, include_usage, theirs)
        assert (ours.output_tokens, ours.engine_usage) == (
            theirs.output_tokens,
            theirs.engine_usage,
        )
    assert ours.event(1.0) == theirs.event(1.0)


def test_every_kind_of_chunk_alone_and_all_in_one_read():
    for include_usage in (True, False):
        for chunk in CORPUS:
            _same([chunk], include_usage)
        _same(CORPUS, include_usage)
        _same([b"".join(CORPUS)], include_usage)
        # The stream's unterminated end.
        _same([b"".join(CORPUS) + b'data: {"choices":[{"text":"z"}]}'], include_usage)


def test_a_usage_only_chunk_is_hidden_unless_asked_and_gives_the_counts():
    usage = fresh()
    stream = event(chat("a")) + event(chat("b")) + event(USAGE_CHUNK) + DONE
    out, done = pass_events(stream, False, usage)
    assert done
    assert out == event(chat("a")) + event(chat("b")) + DONE
    assert (usage.input_tokens, usage.cached_input_tokens, usage.output_tokens) == (5, 2, 7)
    out, _ = pass_events(stream, True, fresh())
    assert out == stream  # the very bytes


texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["chat", "completion", "usage", "done", "blank"]),
            texts,
            st.booleans(),
        ),
        max_size=12,
    ),
    st.booleans(),
    st.integers(min_value=1, max_value=4),
)
def test_any_stream_cut_anywhere_at_event_ends(items, include_usage, group):
    chunks = []
    for kind, text, spaced in items:
        if kind == "chat":
            chunks.append(event(chat(text), spaced=spaced))
        elif kind == "completion":
            chunks.append(event(completion(text), spaced=spaced))
        elif kind == "usage":
            chunks.append(event(USAGE_CHUNK, spaced=spaced))
        elif kind == "done":
            chunks.append(DONE)
        else:
            chunks.append(b"\n\n")
    reads = [b"".join(chunks[i : i + group]) for i in range(0, len(chunks), group)]
    _same(reads, include_usage)


@given(st.floats(min_value=-1e9, max_value=4e9, allow_nan=False))
def test_event_times_are_formatted_as_datetime_formats_them(moment):
    from datetime import UTC, datetime

    from dataplane.gateway.usage import _iso

    assert _iso(moment) == datetime.fromtimestamp(moment, tz=UTC).isoformat()
    assert _iso(moment + 0.5) == datetime.fromtimestamp(moment + 0.5, tz=UTC).isoformat()


def test_event_times_at_the_edges_of_a_second_and_of_a_microsecond():
    from datetime import UTC, datetime

    from dataplane.gateway.usage import _iso

    for moment in (
        0.0,
        1764620000.0,
        1764620000.9999995,
        1764620000.9999994,
        1764620000.0000005,
        1764620000.0000015,
        1764620000.0000025,
        1764620000.5,
        1764620001.000001,
        -0.0000005,
        -1.5,
        1e-7,
    ):
        assert _iso(moment) == datetime.fromtimestamp(moment, tz=UTC).isoformat(), moment
