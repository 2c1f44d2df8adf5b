"""What a request is, before it runs: its body checked, its input tokens estimated without a
tokenizer (content bytes / the model's published `bytes_per_token`) and its MU priced with the
currency (capacity.pricing.features) under the model's published cost model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from capacity.pricing.features import mu_of, replica_seconds_of, uncached_input_tokens

from .contract import Model
from .errors import GatewayError

CHAT = "chat"
COMPLETION = "completion"
# vLLM's default max_tokens for /v1/completions; chat defaults to the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass
class Body:
    kind: str
    doc: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool  # what the client asked for (the gateway always asks the engine)
    max_tokens: int | None
    content_bytes: int
    token_ids: int  # prompt tokens given as ids (counted exactly)
    prefix: str  # the prompt's start, for prefix affinity
    images: int = 0  # image_url content parts of a chat request


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request_error")


def _text_bytes(value: Any, param: str) -> tuple[int, int, str]:
    """(bytes of text, token ids, text start) of a prompt or a message content."""
    if value is None:
        return 0, 0, ""
    if isinstance(value, str):
        return len(value.encode()), 0, value[:256]
    if isinstance(value, list):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return 0, len(value), ",".join(str(v) for v in value[:64])
        size = ids = 0
        start = ""
        for item in value:
            if isinstance(item, dict):
                item = item.get("text")
            b, i, s = _text_bytes(item, param)
            size, ids = size + b, ids + i
            start = start or s
        return size, ids, start
    raise _bad(f"'{param}' must be a string or a list", param)


def parse_body(kind: str, doc: Any) -> Body:
    if not isinstance(doc, dict):
        raise _bad("The request body must be a JSON object.")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string.", "model")
    stream = doc.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean.", "stream")
    options = doc.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object.", "stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = doc.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(f"'{name}' must be an integer.", name)
        if value < 1:
            raise _bad(f"'{name}' must be at least 1, got {value}.", name)
        max_tokens = value if max_tokens is None else min(max_tokens, value)
    if kind == CHAT:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list.", "messages")
        size = ids = images = 0
        prefix = ""
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise _bad(f"'messages[{i}]' must be an object.", f"messages[{i}]")
            content = message.get("content")
            b, n, s = _text_bytes(content, f"messages[{i}].content")
            size, ids, prefix = size + b, ids + n, prefix or s
            images += _images_in(content)
    else:
        if "prompt" not in doc:
            raise _bad("'prompt' is required.", "prompt")
        size, ids, prefix = _text_bytes(doc.get("prompt"), "prompt")
        images = 0
    return Body(
        kind=kind,
        doc=doc,
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        content_bytes=size,
        token_ids=ids,
        prefix=prefix,
        images=images,
    )


def _images_in(content: Any) -> int:
    """Image parts of a message's content (OpenAI's `{"type": "image_url", ...}`): each is
    priced by the cost model's image weight; its bytes (a data: URL) are not text."""
    if not isinstance(content, list):
        return 0
    return sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image_url")


def input_tokens_of(body: Body, model: Model) -> int:
    return body.token_ids + math.ceil(body.content_bytes / max(model.bytes_per_token, 1e-6))


def max_output_tokens_of(body: Body, model: Model, input_tokens: int) -> int:
    """The most the request may generate: max_tokens, or the engine's default (what tokens
    per minute count, beside the input)."""
    if body.max_tokens is not None:
        return body.max_tokens
    if body.kind == COMPLETION:
        return COMPLETION_DEFAULT_MAX_TOKENS
    return max(1, model.context_length_tokens - input_tokens)


def output_tokens_of(body: Body, model: Model, input_tokens: int) -> int:
    """What admission charges for the output: max_tokens (or the engine's default) capped by
    the model's published output cap."""
    output = max_output_tokens_of(body, model, input_tokens)
    if model.output_cap_tokens is not None:
        output = min(output, model.output_cap_tokens)
    return output


def estimate_mu(model: Model, *, input_tokens: int, output_tokens: int, images: int = 0) -> float:
    if model.cost_model is None:
        raise GatewayError(
            409,
            f"The model '{model.name}' has no cost model yet, so requests cannot be priced.",
            code="not_priced",
            param="model",
        )
    seconds = replica_seconds_of(
        model.cost_model.weights_replica_seconds,
        input_tokens=uncached_input_tokens(input_tokens, 0),
        cached_input_tokens=0,
        output_tokens=output_tokens,
        images=images,
    )
    return float(mu_of(seconds, model.cost_model.replica_mu_per_minute))
