"""The official `openai` client, unchanged, pointed at the gateway with a customer key."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from . import contract as C
from .conftest import usage_events, wait_for


@pytest.fixture
def base_url(world, start_emulator, start_gateway):
    url, _ = start_emulator()
    world.publication.models["tiny"] = C.model(7, [C.replica(url)])
    world.publish()
    return start_gateway().url + "/v1"


def client(world, base_url):
    return openai.OpenAI(
        base_url=base_url, api_key=world.acme.plaintext, http_client=httpx.Client(trust_env=False)
    )


def test_the_sync_client_chats_streamed_and_not(world, base_url, usage_server):
    api = client(world, base_url)
    messages = [{"role": "user", "content": "say something"}]

    answer = api.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
    chunks = list(
        api.chat.completions.create(model="tiny", messages=messages, max_tokens=5, stream=True)
    )
    completion = api.completions.create(model="tiny", prompt="a b", max_tokens=3)
    models = api.models.list()

    assert answer.usage.completion_tokens == len(answer.choices[0].message.content.split())
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    assert completion.usage.prompt_tokens == 2
    assert [m.id for m in models] == ["tiny"]
    events = wait_for(lambda: len(usage_events(usage_server)) == 3 and usage_events(usage_server))
    assert [e["outcome"] for e in events] == ["completed"] * 3


def test_the_async_client_streams_with_usage(world, base_url, usage_server):
    async def run():
        api = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=world.acme.plaintext,
            http_client=httpx.AsyncClient(trust_env=False),
        )
        stream = await api.completions.create(
            model="tiny",
            prompt="x y z",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        plain = await api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        await api.close()
        return chunks, plain

    chunks, plain = asyncio.run(run())

    assert chunks[-1].usage.prompt_tokens == 3
    assert plain.choices[0].message.content
    assert (
        len(wait_for(lambda: len(usage_events(usage_server)) == 2 and usage_events(usage_server)))
        == 2
    )


def test_the_client_sees_a_rate_limit_error_and_a_bad_key_as_its_own_exceptions(world, base_url):
    from .conftest import set_limits

    set_limits(world.rds, {(1, 7): (0.0, 0.0)})
    api = client(world, base_url)
    with pytest.raises(openai.RateLimitError):
        api.with_options(max_retries=0).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}]
        )
    bad = openai.OpenAI(
        base_url=base_url, api_key="mu1.nope", http_client=httpx.Client(trust_env=False)
    )
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
