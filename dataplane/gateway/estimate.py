"""What a request is, before it runs: its body checked, its input tokens estimated without a
tokenizer (content bytes / the model's published `bytes_per_token`) and its MU priced with the
currency (capacity.pricing.features) under the model's published cost model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from capacity.pricing.features import mu_of, replica_seconds_of_batch, uncached_input_tokens

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
    # The engine runs a list of prompts as that many requests, and samples `n` sequences of
    # each (vLLM's parallel sampling): the work is counted as it will be done.
    prompts: int = 1
    n: int = 1

    @property
    def sequences(self) -> int:
        return self.prompts * self.n


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request_error")


def _utf8_bytes(text: str, param: str) -> int:
    try:
        return len(text.encode())
    except UnicodeEncodeError:  # a lone surrogate ("\ud800"): not text any engine takes
        raise _bad(
            f"'{param}' holds an invalid Unicode character (a lone surrogate).", param
        ) from None


def _is_ids(value: Any) -> bool:
    return bool(value) and all(type(v) is int for v in value)


def _prompt_text(prompt: Any, param: str) -> tuple[int, int, str, int]:
    """(bytes of text, token ids, text start, prompts) of a completion's `prompt`: a string, a
    list of token ids, or a list of either (one engine request each), as vLLM takes it."""
    if isinstance(prompt, str):
        return _utf8_bytes(prompt, param), 0, prompt[:256], 1
    if isinstance(prompt, list) and _is_ids(prompt):
        return 0, len(prompt), ",".join(str(v) for v in prompt[:64]), 1
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        size = sum(_utf8_bytes(p, f"{param}[{i}]") for i, p in enumerate(prompt))
        return size, 0, prompt[0][:256], len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        if not all(_is_ids(p) for p in prompt):
            raise _bad(f"'{param}': every prompt of token ids must be a non-empty list of them.")
        start = ",".join(str(v) for v in prompt[0][:64])
        return 0, sum(len(p) for p in prompt), start, len(prompt)
    raise _bad(
        f"'{param}' must be a string, a list of token ids, or a non-empty list of either.", param
    )


def _content_text(content: Any, param: str) -> tuple[int, str]:
    """(bytes of text, text start) of a chat message's content: a string, or a list of parts
    of which only the `text` ones are text the engine tokenises (an `image_url` is an image;
    other part types are not counted, whatever `text` they carry)."""
    if content is None:
        return 0, ""
    if isinstance(content, str):
        return _utf8_bytes(content, param), content[:256]
    if not isinstance(content, list):
        raise _bad(f"'{param}' must be a string or a list of content parts", param)
    size, start = 0, ""
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _bad(f"'{param}[{j}]' must be a content part (an object with a 'type').")
        if part.get("type", "text") != "text":
            continue
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"'{param}[{j}].text' must be a string.", f"{param}[{j}].text")
        size += _utf8_bytes(text, f"{param}[{j}].text")
        start = start or text[:256]
    return size, start


def parse_body(kind: str, doc: Any, *, max_prompts: int = 64, max_n: int = 16) -> Body:
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
    n = _count(doc, "n", most=max_n)
    if _count(doc, "best_of", most=None) != 1:
        # vLLM's V1 engine refuses it (vllm/v1/engine/processor.py): said before any work.
        raise _bad("'best_of' other than 1 is not supported (vLLM V1 refuses it).", "best_of")
    prompts = 1
    if kind == CHAT:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list.", "messages")
        size = images = 0
        prefix = ""
        ids = 0
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise _bad(f"'messages[{i}]' must be an object.", f"messages[{i}]")
            content = message.get("content")
            b, s = _content_text(content, f"messages[{i}].content")
            size, prefix = size + b, prefix or s
            images += _images_in(content)
    else:
        if "prompt" not in doc:
            raise _bad("'prompt' is required.", "prompt")
        size, ids, prefix, prompts = _prompt_text(doc.get("prompt"), "prompt")
        images = 0
        if prompts > max_prompts:
            raise _bad(
                f"'prompt' lists {prompts} prompts; at most {max_prompts} are taken in one "
                "request (GATEWAY_MAX_PROMPTS).",
                "prompt",
            )
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
        prompts=prompts,
        n=n,
    )


def _count(doc: dict[str, Any], name: str, *, most: int | None) -> int:
    """A whole number of at least 1 (absent: 1), at most `most`."""
    value = doc.get(name)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(f"'{name}' must be a whole number of at least 1.", name)
    count = int(value)
    if most is not None and count > most:
        raise _bad(f"'{name}' is {count}; at most {most} are taken in one request.", name)
    return count


def _images_in(content: Any) -> int:
    """Image parts of a message's content (OpenAI's `{"type": "image_url", ...}`): each is
    priced by the cost model's image weight; its bytes (a data: URL) are not text."""
    if not isinstance(content, list):
        return 0
    return sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image_url")


def input_tokens_of(body: Body, model: Model) -> int:
    return body.token_ids + math.ceil(body.content_bytes / max(model.bytes_per_token, 1e-6))


def max_output_tokens_of(body: Body, model: Model, input_tokens: int) -> int:
    """The most the request may generate, every sequence of every prompt: max_tokens (or the
    engine's default) each (what tokens per minute count, beside the input)."""
    return body.sequences * _per_sequence_max(body, model, input_tokens)


def _per_sequence_max(body: Body, model: Model, input_tokens: int) -> int:
    if body.max_tokens is not None:
        return body.max_tokens
    if body.kind == COMPLETION:
        return COMPLETION_DEFAULT_MAX_TOKENS
    return max(1, model.context_length_tokens - input_tokens // body.prompts)


def output_tokens_of(body: Body, model: Model, input_tokens: int) -> int:
    """What admission charges for the output, all sequences together: each one's max_tokens
    (or the engine's default) capped by the model's published output cap."""
    output = _per_sequence_max(body, model, input_tokens)
    if model.output_cap_tokens is not None:
        output = min(output, model.output_cap_tokens)
    return body.sequences * output


def estimate_mu(
    model: Model,
    *,
    input_tokens: int,
    output_tokens: int,
    images: int = 0,
    prompts: int = 1,
    sequences: int = 1,
) -> float:
    """MU of the request as the engine will run it: `prompts` engine requests of `sequences`
    sequences in all (capacity.pricing.features.replica_seconds_of_batch)."""
    if model.cost_model is None:
        raise GatewayError(
            409,
            f"The model '{model.name}' has no cost model yet, so requests cannot be priced.",
            code="not_priced",
            param="model",
        )
    seconds = replica_seconds_of_batch(
        model.cost_model.weights_replica_seconds,
        prompts=prompts,
        sequences=sequences,
        input_tokens=uncached_input_tokens(input_tokens, 0),
        cached_input_tokens=0,
        output_tokens=output_tokens,
        images=images,
    )
    return float(mu_of(seconds, model.cost_model.replica_mu_per_minute))
