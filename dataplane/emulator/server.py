"""The aiohttp application: vLLM's OpenAI-compatible endpoints, a scale endpoint, and the
fault-injection endpoint (`/emulator/faults`, apart from the OpenAI paths)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from .config import MAX_REPLICAS, PRIORITY, EmulatorConfig
from .engine import Listener, Sequence
from .faults import CRASH, FaultError, exit_process, parse_fault
from .fleet import Fleet, ModelFleet, ModelStatus
from .metrics import EmulatorCollector, build_registry, render
from .protocol import (
    CHAT,
    Choice,
    GenerationRequest,
    RequestError,
    StreamFormatter,
    completion_response,
    error_body,
    parse_chat_request,
    parse_completion_request,
    prepare_prompts,
)

EMULATOR_VERSION = "0.1.0"
MAX_BODY_BYTES = 32 * 1024 * 1024

# The webhook actuator's signing scheme (capacity/actuation/webhook.py); this package imports
# nothing from the control plane, so it is restated here.
WEBHOOK_SECRET_ENV = "EMULATOR_WEBHOOK_SECRET"
WEBHOOK_SIGNATURE_HEADER = "X-Signature-256"
WEBHOOK_TIMESTAMP_HEADER = "X-Timestamp"
WEBHOOK_ID_HEADER = "X-Webhook-Id"
WEBHOOK_MAX_SKEW_SECONDS = 300

FLEET_KEY = web.AppKey("fleet", Fleet)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
PROMPT_TOKENS_DETAILS_KEY = web.AppKey("prompt_tokens_details", bool)
WEBHOOK_SECRET_KEY = web.AppKey("webhook_secret", str)
# Webhook ids accepted → the unix time after which their timestamp fails the skew check anyway.
WEBHOOK_SEEN_IDS_KEY = web.AppKey("webhook_seen_ids", dict)
# An immediate crash waits this long, so the command itself is answered first.
CRASH_GRACE_SECONDS = 0.05


def create_app(
    config: EmulatorConfig,
    *,
    webhook_secret: str | None = None,
    crash: Callable[[], None] = exit_process,
) -> web.Application:
    """`webhook_secret` (default: $EMULATOR_WEBHOOK_SECRET) signs `/admin/webhook/scale`;
    `crash` is what an injected crash does (default: exit the process with status 1)."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
    fleet = Fleet(config, crash=crash)
    app[FLEET_KEY] = fleet
    app[PROMPT_TOKENS_DETAILS_KEY] = config.enable_prompt_tokens_details
    if webhook_secret is None:
        webhook_secret = os.environ.get(WEBHOOK_SECRET_ENV, "")
    app[WEBHOOK_SECRET_KEY] = webhook_secret
    app[WEBHOOK_SEEN_IDS_KEY] = {}
    app[REGISTRY_KEY] = build_registry(
        EmulatorCollector(
            models=lambda: [f.metrics for f in fleet.models.values()],
            gauges=lambda: [f.gauges() for f in fleet.models.values()],
            fault_mode=lambda: fleet.faults.mode,
        )
    )
    app.on_startup.append(_start_fleet)
    app.on_cleanup.append(_stop_fleet)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/replicas", list_replicas)
    app.router.add_post("/admin/replicas", scale_replicas)
    app.router.add_post("/admin/webhook/scale", webhook_scale)
    app.router.add_get("/emulator/faults", get_faults)
    app.router.add_post("/emulator/faults", set_faults)
    return app


async def _start_fleet(app: web.Application) -> None:
    app[FLEET_KEY].start()


async def _stop_fleet(app: web.Application) -> None:
    await app[FLEET_KEY].stop()


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response(error_body(exc.reason, status=exc.status), status=exc.status)


async def _json_body(request: web.Request) -> object:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"The request body is not valid JSON: {exc}.") from exc


def _model_fleet(request: web.Request, model_name: str) -> ModelFleet:
    model_fleet = request.app[FLEET_KEY].get(model_name)
    if model_fleet is None:
        raise RequestError(f"The model `{model_name}` does not exist.", status=404, param="model")
    return model_fleet


# -- generation -----------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion_request(await _json_body(request)))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat_request(await _json_body(request)))


async def _generate(request: web.Request, gen: GenerationRequest) -> web.StreamResponse:
    model_fleet = _model_fleet(request, gen.model)
    if gen.priority != 0 and model_fleet.model.scheduling_policy != PRIORITY:
        # vLLM's engine raises ValueError with this text (InputProcessor / AsyncLLM), which its
        # OpenAI server answers as a 400 BadRequestError without a param.
        raise RequestError(
            f"Got priority {gen.priority} but Priority scheduling is not enabled.", status=400
        )
    prepared = prepare_prompts(gen, model_fleet.model)
    details = request.app[PROMPT_TOKENS_DETAILS_KEY]
    listener = Listener(streaming=gen.stream)
    request_id = ("chatcmpl-" if gen.kind == CHAT else "cmpl-") + uuid.uuid4().hex
    # `n` sequences per prompt, in choice order (vLLM's parallel sampling).
    seqs = [
        model_fleet.new_sequence(
            request_id=request_id,
            prompt_token_ids=ids,
            max_tokens=prepared.max_tokens,
            min_tokens=gen.min_tokens,
            ignore_eos=gen.ignore_eos,
            priority=gen.priority,
            request_seed=None if gen.seed is None else gen.seed + sample,
            prompt_index=i,
            listener=listener,
            greedy=gen.greedy,
            image_ends=prepared.image_ends[i],
        )
        for i, ids in enumerate(prepared.token_ids)
        for sample in range(gen.n)
    ]
    for seq in seqs:
        model_fleet.submit(seq)
    try:
        if gen.stream:
            return await _stream(request, gen, request_id, seqs, listener, details)
        return await _unary(gen, request_id, seqs, listener, details)
    finally:
        # The client went away (or the handler failed): free the batch slot and KV budget.
        for seq in seqs:
            if not seq.done:
                model_fleet.abort(seq)


def _unavailable(message: str) -> web.Response:
    return web.json_response(error_body(message, status=503), status=503)


async def _unary(
    gen: GenerationRequest,
    request_id: str,
    seqs: list[Sequence],
    listener: Listener,
    prompt_tokens_details: bool,
) -> web.Response:
    while not all(seq.done for seq in seqs):
        await listener.wait()
    error = next((seq.error for seq in seqs if seq.error), None)
    if error is not None:
        return _unavailable(error)
    choices = [
        Choice(i, seq.output_token_ids, seq.finish_reason, seq.prompt_token_ids, seq.cached_tokens)
        for i, seq in enumerate(seqs)
    ]
    return web.json_response(
        completion_response(
            gen,
            request_id=request_id,
            created=int(time.time()),
            choices=choices,
            prompt_tokens_details=prompt_tokens_details,
        )
    )


async def _stream(
    request: web.Request,
    gen: GenerationRequest,
    request_id: str,
    seqs: list[Sequence],
    listener: Listener,
    prompt_tokens_details: bool,
) -> web.StreamResponse:
    fmt = StreamFormatter(gen, request_id=request_id, created=int(time.time()))
    sent = [0] * len(seqs)
    errored = [False] * len(seqs)
    response: web.StreamResponse | None = None
    try:
        while True:
            parts: list[str] = []
            all_done = True
            for i, seq in enumerate(seqs):
                if seq.error is not None:
                    if response is None:
                        # Nothing sent yet, so the status line can still say what happened.
                        return _unavailable(seq.error)
                    if not errored[i]:
                        parts.append(fmt.error_chunk(seq.error, 503))
                        errored[i] = True
                    continue
                out = seq.output_token_ids
                n_out = len(out)
                if sent[i] < n_out and sent[i] == 0 and gen.kind == CHAT:
                    parts.append(fmt.role_chunk(i))
                while sent[i] < n_out:
                    last = sent[i] == n_out - 1 and seq.done
                    finish_reason = seq.finish_reason if last else None
                    parts.append(fmt.token_chunk(i, out[sent[i]], finish_reason))
                    sent[i] += 1
                if not seq.done:
                    all_done = False
            if parts:
                if response is None:
                    # Headers wait for the first token, so an error before it is a real status.
                    response = web.StreamResponse(
                        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                    )
                    await response.prepare(request)
                # One write per wake-up: a handler that fell behind sends its tokens together.
                await response.write("".join(parts).encode())
            if all_done:
                break
            await listener.wait()
        if response is None:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
        tail = []
        if gen.include_usage:
            tail.append(
                fmt.usage_chunk(
                    sum(seq.prompt_tokens for seq in seqs[:: gen.n]),
                    sum(len(seq.output_token_ids) for seq in seqs),
                    sum(seq.cached_tokens for seq in seqs[:: gen.n])
                    if prompt_tokens_details
                    else None,
                )
            )
        tail.append(fmt.DONE)
        await response.write("".join(tail).encode())
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client closed the stream; _generate aborts what is left
    return response if response is not None else web.Response(status=499)


# -- everything else ------------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    created = int(time.time())
    data = [
        {
            "id": f.model.name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": f.model.name,
            "parent": None,
            "max_model_len": f.model.context_length,
        }
        for f in request.app[FLEET_KEY].models.values()
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": EMULATOR_VERSION, "engine": "vllm-emulator"})


async def metrics(request: web.Request) -> web.Response:
    body = render(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def list_replicas(request: web.Request) -> web.Response:
    fleet = request.app[FLEET_KEY]
    return web.json_response({"models": [f.status() for f in fleet.models.values()]})


async def scale_replicas(request: web.Request) -> web.Response:
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    model_name = body.get("model")
    if not isinstance(model_name, str) or not model_name:
        raise RequestError("'model' is required and must be a string.", param="model")
    replicas = _replica_count(body, "replicas")
    model_fleet = _model_fleet(request, model_name)
    model_fleet.scale(replicas)
    return web.json_response(model_fleet.status())


def _replica_count(body: dict[str, Any], key: str) -> int:
    replicas = body.get(key)
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        raise RequestError(f"'{key}' is required and must be an integer.", param=key)
    if not 0 <= replicas <= MAX_REPLICAS:
        raise RequestError(
            f"'{key}' must be between 0 and {MAX_REPLICAS}, got {replicas}.", param=key
        )
    return replicas


class _WebhookScaleStatus(ModelStatus):
    """A model's status as the webhook actuator reads it."""

    observed_replicas: int


async def webhook_scale(request: web.Request) -> web.Response:
    """The control plane's webhook actuator: `{model, target_replicas, ...}`, signed."""
    raw = await request.read()
    secret = request.app[WEBHOOK_SECRET_KEY]
    if secret:
        # Checked on the raw bytes before parsing: re-serialised JSON would not match.
        refusal = _webhook_signature_problem(
            secret, request.headers, raw, request.app[WEBHOOK_SEEN_IDS_KEY]
        )
        if refusal:
            return web.json_response(
                {
                    "error": {
                        "message": refusal,
                        "type": "AuthenticationError",
                        "param": None,
                        "code": 401,
                    }
                },
                status=401,
            )
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"The request body is not valid JSON: {exc}.") from exc
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    model_name = body.get("model")
    if not isinstance(model_name, str) or not model_name:
        raise RequestError("'model' is required and must be a string.", param="model")
    replicas = _replica_count(body, "target_replicas")
    model_fleet = _model_fleet(request, model_name)
    model_fleet.scale(replicas)
    status = model_fleet.status()
    # What the actuator reports as observed: replicas that exist toward the target, like a
    # Deployment's status.replicas counts pods that are not ready yet.
    scaled: _WebhookScaleStatus = {
        **status,
        "observed_replicas": status["ready"] + status["starting"],
    }
    return web.json_response(scaled)


async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(request.app[FLEET_KEY].faults.status())


async def set_faults(request: web.Request) -> web.Response:
    """`{"mode", "factor", "after_seconds", "duration_seconds"}` → the fault state."""
    body = await _json_body(request)
    try:
        spec = parse_fault(body, at_key="after_seconds")
    except FaultError as exc:
        raise RequestError(str(exc), param=exc.field) from exc
    if spec.mode == CRASH and spec.at_seconds < CRASH_GRACE_SECONDS:
        spec = replace(spec, at_seconds=CRASH_GRACE_SECONDS)
    faults = request.app[FLEET_KEY].faults
    faults.submit(spec)
    return web.json_response(faults.status())


def _webhook_signature_problem(
    secret: str, headers: Mapping[str, str], raw: bytes, seen_ids: dict[str, int]
) -> str:
    """Why the request's signature is not acceptable, or "" when it is (and its id is new).

    The signed material is f"{timestamp}.{webhook_id}." + raw body; an id accepted once is
    refused for as long as its timestamp would still pass, so a captured request cannot be
    replayed within the skew window either.
    """
    timestamp = headers.get(WEBHOOK_TIMESTAMP_HEADER, "")
    webhook_id = headers.get(WEBHOOK_ID_HEADER, "")
    signature = headers.get(WEBHOOK_SIGNATURE_HEADER, "")
    if not timestamp or not webhook_id or not signature:
        return (
            f"{WEBHOOK_TIMESTAMP_HEADER}, {WEBHOOK_ID_HEADER} and {WEBHOOK_SIGNATURE_HEADER} "
            "are required."
        )
    try:
        sent_at_seconds = int(timestamp)
    except ValueError:
        return f"{WEBHOOK_TIMESTAMP_HEADER} must be unix seconds."
    now = time.time()
    if abs(now - sent_at_seconds) > WEBHOOK_MAX_SKEW_SECONDS:
        return f"{WEBHOOK_TIMESTAMP_HEADER} is more than {WEBHOOK_MAX_SKEW_SECONDS} s from now."
    message = f"{timestamp}.{webhook_id}.".encode() + raw
    digest = hmac.new(secret.encode(), message, hashlib.sha256)
    if not hmac.compare_digest(signature.encode(), f"sha256={digest.hexdigest()}".encode()):
        return f"{WEBHOOK_SIGNATURE_HEADER} does not match the body."
    for expired in [key for key, until in seen_ids.items() if until < now]:
        del seen_ids[expired]
    if webhook_id in seen_ids:
        return f"{WEBHOOK_ID_HEADER} {webhook_id} was already received: a replay."
    seen_ids[webhook_id] = sent_at_seconds + WEBHOOK_MAX_SKEW_SECONDS
    return ""


def run(
    host: str,
    port: int,
    config: EmulatorConfig,
    *,
    print_fn: Callable[..., None] | None = None,
    startup_seconds: float = 0.0,
) -> None:
    """Serve until SIGINT/SIGTERM, after `startup_seconds` of loading with the port bound but
    not listening (connections refused), as vLLM's server does while it loads a model."""
    out = print_fn or (lambda *args: print(*args, flush=True))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    if startup_seconds > 0:
        out(f"Engine emulator loading for {startup_seconds:g} s on {host}:{port}")
        time.sleep(startup_seconds)
    models = ", ".join(m.name for m in config.models)
    out(f"Engine emulator serving {models} on http://{host}:{port} (Ctrl-C to stop)")
    web.run_app(
        create_app(config),
        sock=sock,
        # An access-log line per request would cost more than emulating the request.
        access_log=None,
        # Benchmarks open hundreds of connections at once.
        backlog=4096,
        shutdown_timeout=2.0,
        print=None,
        # As vLLM's server does (`with_cancellation`): a client that leaves aborts its request,
        # non-streamed ones too (a stream notices on its next write).
        handler_cancellation=True,
    )
