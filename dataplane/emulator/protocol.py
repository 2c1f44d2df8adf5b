"""The OpenAI-compatible wire format, as vLLM speaks it: request parsing and response bodies.

Parsing is strict about the fields the emulator acts on (a wrong type is a 400 naming the
field) and ignores sampling fields it does not model (`top_p`, `top_k`, ...), as vLLM
accepts them. `temperature` 0 means greedy decoding: deterministic output for the prompt.
Streamed chunks are assembled from pre-escaped string pieces rather than
`json.dumps` per token: at thousands of streams that serialisation would dominate the CPU.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, TypedDict, TypeGuard

from .config import ModelConfig
from .tokens import text_to_token_ids, token_text

COMPLETION = "completion"
CHAT = "chat"

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    503: "ServiceUnavailableError",
}

# vLLM's default `max_tokens` for /v1/completions; chat defaults to the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# vLLM samples greedily below this temperature (`_SAMPLING_EPS` in sampling_params.py).
GREEDY_TEMPERATURE = 1e-5


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(TypedDict):
    error: ErrorDetail


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class _UsageCounts(TypedDict):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int


class Usage(_UsageCounts, total=False):
    prompt_tokens_details: PromptTokensDetails


class RequestError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> ErrorBody:
        return error_body(self.message, status=self.status, param=self.param)


def error_body(message: str, *, status: int, param: str | None = None) -> ErrorBody:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


@dataclass(frozen=True)
class ImageInput:
    """One `image_url` content part. The emulator never decodes it: its URL (a data: URL
    carries the image itself) names it, as vLLM's multimodal hash names an image's bytes."""

    url: str


@dataclass(frozen=True)
class ChatPrompt:
    """A chat prompt with images: text and images in the order of the messages' parts."""

    parts: tuple[str | ImageInput, ...]


Prompt = str | tuple[int, ...] | ChatPrompt


@dataclass(frozen=True)
class GenerationRequest:
    kind: str  # COMPLETION or CHAT
    model: str
    prompts: tuple[Prompt, ...]
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    priority: int
    seed: int | None
    return_token_ids: bool
    temperature: float | None = None  # None: vLLM's default, 1.0 (sampling)
    # Sequences per prompt (parallel sampling): vLLM's `n`. Choices are ordered prompt by
    # prompt, `n` each (index = prompt * n + sample), and usage counts each prompt's tokens
    # once (its `prompt_tokens`), every sequence's output.
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature is not None and self.temperature < GREEDY_TEMPERATURE


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: dict[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise RequestError(f"'{name}' must be an integer, got {value!r}.", param=name)
    if minimum is not None and value < minimum:
        raise RequestError(f"'{name}' must be at least {minimum}, got {value}.", param=name)
    return value


def _temperature(body: dict[str, Any]) -> float | None:
    value = body.get("temperature")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise RequestError(f"'temperature' must be a number, got {value!r}.", param="temperature")
    if value < 0:
        raise RequestError(f"'temperature' must be non-negative, got {value}.", param="temperature")
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean, got {value!r}.", param=name)
    return value


def _parse_common(
    body: dict[str, Any], kind: str, prompts: tuple[Prompt, ...]
) -> GenerationRequest:
    max_tokens = _optional_int(body, "max_tokens", minimum=1)
    if kind == CHAT and max_tokens is None:
        max_tokens = _optional_int(body, "max_completion_tokens", minimum=1)
    elif kind == COMPLETION and max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    min_tokens = _optional_int(body, "min_tokens", minimum=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise RequestError(
            f"'min_tokens' ({min_tokens}) must be less than or equal to "
            f"'max_tokens' ({max_tokens}).",
            param="min_tokens",
        )
    n = _optional_int(body, "n", minimum=1) or 1
    best_of = _optional_int(body, "best_of", minimum=1)
    if best_of is not None and best_of != 1:
        # vLLM's V1 engine (vllm/v1/engine/processor.py) refuses it; its server answers 400.
        raise RequestError("vLLM V1 does not yet support best_of.", param="best_of")
    stream = _bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise RequestError(
                "'stream_options' can only be set when 'stream' is true.", param="stream_options"
            )
        if not isinstance(stream_options, dict):
            raise RequestError("'stream_options' must be an object.", param="stream_options")
        value = stream_options.get("include_usage")
        if value is not None and not isinstance(value, bool):
            raise RequestError(
                "'stream_options.include_usage' must be a boolean.",
                param="stream_options.include_usage",
            )
        include_usage = bool(value)
    return GenerationRequest(
        kind=kind,
        model=body["model"],
        prompts=prompts,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=_bool(body, "ignore_eos"),
        stream=stream,
        include_usage=include_usage,
        priority=_optional_int(body, "priority") or 0,
        seed=_optional_int(body, "seed"),
        return_token_ids=_bool(body, "return_token_ids"),
        temperature=_temperature(body),
        n=n,
    )


def _check_model(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is required and must be a string.", param="model")
    return body


def _all_ints(values: list[Any]) -> bool:
    # `type() is int` rather than isinstance: excludes bool, and token-id prompts are long
    # enough for the difference in speed to show up in a profile.
    return all(type(v) is int for v in values)


def _token_id_list(value: list[Any], param: str) -> tuple[int, ...]:
    if not value or not _all_ints(value) or min(value) < 0:
        raise RequestError(f"'{param}' token ids must be non-negative integers.", param=param)
    return tuple(value)


def parse_completion_request(body: object) -> GenerationRequest:
    body = _check_model(body)
    prompt = body.get("prompt")
    prompts: tuple[str | tuple[int, ...], ...]
    if isinstance(prompt, str):
        prompts = (prompt,)
    elif isinstance(prompt, list) and prompt and _all_ints(prompt):
        prompts = (_token_id_list(prompt, "prompt"),)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tuple(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = tuple(_token_id_list(p, "prompt") for p in prompt)
    else:
        raise RequestError(
            "'prompt' is required: a string, a list of token ids, or a non-empty list of either.",
            param="prompt",
        )
    return _parse_common(body, COMPLETION, prompts)


def _message_parts(index: int, message: object) -> list[str | ImageInput]:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"'{param}' must be an object with a string 'role'.", param=param)
    content = message.get("content")
    if content is None or isinstance(content, str):
        return [content] if content else []
    if isinstance(content, list):
        parts: list[str | ImageInput] = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(
                    f"'{param}.content' parts must be objects with a 'type'.",
                    param=f"{param}.content",
                )
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise RequestError(
                        f"'{param}.content' text parts need a string 'text'.",
                        param=f"{param}.content",
                    )
                parts.append(part["text"])
            elif part["type"] == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else None
                if not isinstance(url, str) or not url:
                    raise RequestError(
                        f"'{param}.content' image_url parts need an 'image_url' object with a "
                        "non-empty string 'url'.",
                        param=f"{param}.content",
                    )
                parts.append(ImageInput(url))
        return parts
    raise RequestError(
        f"'{param}.content' must be a string, a list of parts or null.", param=f"{param}.content"
    )


def parse_chat_request(body: object) -> GenerationRequest:
    body = _check_model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' is required and must be a non-empty list.", param="messages")
    parts = [part for i, m in enumerate(messages) for part in _message_parts(i, m)]
    prompt: Prompt
    if any(isinstance(part, ImageInput) for part in parts):
        prompt = ChatPrompt(tuple(parts))
    else:
        # The stand-in chat template: message contents joined by whitespace.
        prompt = " ".join(part for part in parts if isinstance(part, str))
    return _parse_common(body, CHAT, (prompt,))


def image_token_ids(image: ImageInput, model: ModelConfig) -> list[int]:
    """The image's placeholder tokens, named by its content: equal images give equal tokens
    (so a repeated image is a prefix-cache hit, as vLLM hashes images into its block hashes),
    different ones differ."""
    digest = int.from_bytes(hashlib.sha256(image.url.encode()).digest()[:8], "big")
    return [(digest + 7919 * i) % model.vocab_size for i in range(model.image_tokens_per_image)]


@dataclass(frozen=True)
class PreparedPrompts:
    token_ids: list[list[int]]
    # Per prompt, where each image's placeholder tokens end.
    image_ends: list[tuple[int, ...]]
    max_tokens: int


def _chat_token_ids(prompt: ChatPrompt, model: ModelConfig) -> tuple[list[int], tuple[int, ...]]:
    ids: list[int] = []
    ends: list[int] = []
    for part in prompt.parts:
        if isinstance(part, ImageInput):
            ids.extend(image_token_ids(part, model))
            ends.append(len(ids))
        else:
            ids.extend(text_to_token_ids(part, model.vocab_size))
    return ids, tuple(ends)


def prepare_prompts(request: GenerationRequest, model: ModelConfig) -> PreparedPrompts:
    """Token ids of every prompt (images as their placeholder tokens) and the effective
    `max_tokens`, checked against the model."""
    prompt_param = "messages" if request.kind == CHAT else "prompt"
    prompts: list[list[int]] = []
    image_ends: list[tuple[int, ...]] = []
    for prompt in request.prompts:
        ends: tuple[int, ...] = ()
        if isinstance(prompt, ChatPrompt):
            ids, ends = _chat_token_ids(prompt, model)
        elif isinstance(prompt, str):
            ids = text_to_token_ids(prompt, model.vocab_size)
        else:
            ids = list(prompt)
            if ids and max(ids) >= model.vocab_size:
                raise RequestError(
                    f"'{prompt_param}': token id {max(ids)} is out of vocabulary "
                    f"(vocab_size {model.vocab_size}).",
                    param=prompt_param,
                )
        if not ids:
            raise RequestError(f"'{prompt_param}' cannot be empty.", param=prompt_param)
        prompts.append(ids)
        image_ends.append(ends)
    longest = max(len(ids) for ids in prompts)
    if longest >= model.context_length:
        raise RequestError(
            f"This model's maximum context length is {model.context_length} tokens. "
            f"However, your request has {longest} input tokens. Please reduce the length of "
            f"the input.",
            param=prompt_param,
        )
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = model.context_length - longest
    if longest + max_tokens > model.context_length:
        raise RequestError(
            f"This model's maximum context length is {model.context_length} tokens. "
            f"However, you requested {longest + max_tokens} tokens ({longest} in the "
            f"{prompt_param}, {max_tokens} in the completion). Please reduce the length of "
            f"the {prompt_param} or completion.",
            param="max_tokens",
        )
    if request.min_tokens > max_tokens:
        raise RequestError(
            f"'min_tokens' ({request.min_tokens}) must be less than or equal to "
            f"'max_tokens' ({max_tokens}).",
            param="min_tokens",
        )
    return PreparedPrompts(token_ids=prompts, image_ends=image_ends, max_tokens=max_tokens)


def output_text(token_ids: list[int]) -> str:
    return "".join(token_text(t) for t in token_ids)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
    """`cached_tokens`: given only by a server started with `--enable-prompt-tokens-details`;
    as vLLM's serving code (`if self.enable_prompt_tokens_details and num_cached_tokens`),
    the details appear only when some prompt tokens were cached."""
    body: Usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


@dataclass(frozen=True)
class Choice:
    index: int
    token_ids: list[int]
    finish_reason: str | None
    prompt_token_ids: list[int]
    cached_tokens: int = 0


def completion_response(
    request: GenerationRequest,
    *,
    request_id: str,
    created: int,
    choices: list[Choice],
    prompt_tokens_details: bool = False,
) -> dict[str, Any]:
    # Each prompt's tokens once, however many sequences sampled it (vLLM's usage).
    firsts = choices[:: request.n]
    prompt_tokens = sum(len(c.prompt_token_ids) for c in firsts)
    cached_tokens = sum(c.cached_tokens for c in firsts) if prompt_tokens_details else None
    completion_tokens = sum(len(c.token_ids) for c in choices)
    body_choices: list[dict[str, Any]] = []
    for c in choices:
        text = output_text(c.token_ids)
        if request.kind == CHAT:
            choice: dict[str, Any] = {
                "index": c.index,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": c.index,
                "text": text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": None,
            }
        if request.return_token_ids:
            choice["token_ids"] = c.token_ids
            if request.kind == COMPLETION:
                choice["prompt_token_ids"] = c.prompt_token_ids
        body_choices.append(choice)
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion" if request.kind == CHAT else "text_completion",
        "created": created,
        "model": request.model,
        "choices": body_choices,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }
    if request.return_token_ids and request.kind == CHAT:
        body["prompt_token_ids"] = choices[0].prompt_token_ids
    return body


class StreamFormatter:
    """Server-sent-event chunks of one streamed request, one token per chunk like vLLM."""

    DONE = "data: [DONE]\n\n"

    def __init__(self, request: GenerationRequest, *, request_id: str, created: int):
        self._request = request
        obj = "chat.completion.chunk" if request.kind == CHAT else "text_completion"
        self._head = (
            f'data: {{"id":{json.dumps(request_id)},"object":"{obj}","created":{created},'
            f'"model":{json.dumps(request.model)},"choices":['
        )
        # OpenAI: with include_usage every chunk carries "usage", null but on the last one.
        self._tail = ',"usage":null}\n\n' if request.include_usage else "}\n\n"

    def role_chunk(self, index: int) -> str:
        return (
            f'{self._head}{{"index":{index},"delta":{{"role":"assistant","content":""}},'
            f'"logprobs":null,"finish_reason":null}}]{self._tail}'
        )

    def token_chunk(self, index: int, token_id: int, finish_reason: str | None) -> str:
        # Generated text is plain ASCII letters and spaces: no JSON escaping needed.
        text = token_text(token_id)
        finish = "null" if finish_reason is None else f'"{finish_reason}"'
        ids = f',"token_ids":[{token_id}]' if self._request.return_token_ids else ""
        if self._request.kind == CHAT:
            return (
                f'{self._head}{{"index":{index},"delta":{{"content":"{text}"}},'
                f'"logprobs":null,"finish_reason":{finish}{ids}}}]{self._tail}'
            )
        return (
            f'{self._head}{{"index":{index},"text":"{text}","logprobs":null,'
            f'"finish_reason":{finish},"stop_reason":null{ids}}}]{self._tail}'
        )

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
    ) -> str:
        body = json.dumps(usage(prompt_tokens, completion_tokens, cached_tokens))
        return f'{self._head}],"usage":{body}}}\n\n'

    @staticmethod
    def error_chunk(message: str, status: int) -> str:
        return f"data: {json.dumps(error_body(message, status=status))}\n\n"
