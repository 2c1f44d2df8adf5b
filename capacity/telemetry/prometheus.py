"""Deployment load read from Prometheus: vLLM's counters and gauges (docs/design.md#used).

Per deployment, over a rate window (default 60 s):

- requests/s, prompt tokens/s and generation tokens/s: `sum(rate(...))` of
  `vllm:request_success_total`, `vllm:prompt_tokens_total` and `vllm:generation_tokens_total`;
- MU/min: those rates priced with the model's pricing cost model (below);
- concurrency: `vllm:num_requests_running` + `vllm:num_requests_waiting`, summed over replicas;
- KV-cache usage: the mean of `vllm:kv_cache_usage_perc` over replicas (0–1; vLLM before the
  v1 rename exposes `vllm:gpu_cache_usage_perc`, read as a fallback).

A deployment's series are picked by its `prometheus_selector` (PromQL label matchers, e.g.
`job="vllm", namespace="prod"`), by default `model_name="<engine model id>"`, the label vLLM
puts on every series. Selectors are parsed here, not pasted into queries unchecked, so that a
selector cannot close the braces and append PromQL of its own.

**Unknown is never zero.** When Prometheus is not configured, cannot be reached, times out,
refuses the query, or has no series for the selector, the load is `known=False` with the reason
and `mu_per_minute` is None: an allocator that read 0 would scale a busy deployment to zero. A
deployment whose series exist but carry no traffic is known, with 0 MU/min.

**MU/min through the cost model.** MU is the model's currency (docs/design.md#the-currency),
so requests are priced with the model's pricing cost model on its reference GPU type,
whatever GPU serves them.
Prometheus gives rates, not individual requests, so the window's traffic is priced as
`requests/s` requests of the window's mean shape (mean prompt tokens = prompt tokens/s ÷
requests/s, mean output tokens likewise):

    MU/min = requests/s × 60 × t(mean shape) × R / 60

That is exact for the per-token and per-request terms of the cost model, which are linear, and
an approximation for the input×output and output² terms, which are not: a mix of short and long
requests costs more than as many requests of its mean shape (by Σ w·Var / 1000 per request).
Prompt tokens the engines' prefix caches served (`vllm:prefix_cache_hits_total`, in tokens) are
priced as cached input tokens and the rest of the prompt tokens as uncached (the conversion is
capacity.pricing's: `MeanShape.of_totals`); an engine that exposes no prefix-cache counter
(prefix caching off, or not vLLM) has its prompt tokens priced as uncached. Tokens
processed in a window in which no request finished (requests longer than the window) are priced
by their per-token weights alone, a lower bound, rather than reported as no load.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import requests
from django.conf import settings
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.exceptions import ReadTimeoutError
from urllib3.util.retry import Retry

from capacity.models import CostModel, Deployment
from capacity.pricing.cost_models import pricing_cost_model
from capacity.pricing.exchange import MeanShape
from core.errors import DomainError

logger = logging.getLogger(__name__)


REQUEST_SUCCESS_METRIC = "vllm:request_success_total"
PROMPT_TOKENS_METRIC = "vllm:prompt_tokens_total"
GENERATION_TOKENS_METRIC = "vllm:generation_tokens_total"
RUNNING_METRIC = "vllm:num_requests_running"
WAITING_METRIC = "vllm:num_requests_waiting"
KV_CACHE_USAGE_METRIC = "vllm:kv_cache_usage_perc"
# vLLM v1's counter of prompt tokens served from the prefix cache (vllm/v1/metrics/loggers.py).
PREFIX_CACHE_HITS_METRIC = "vllm:prefix_cache_hits_total"
# The name before vLLM's v1 rename; some deployed engines still expose only this one.
LEGACY_KV_CACHE_USAGE_METRIC = "vllm:gpu_cache_usage_perc"

QUANTITIES = (
    "requests_per_s",
    "prompt_tokens_per_s",
    "generation_tokens_per_s",
    "running",
    "waiting",
    "kv_cache_usage",
    "prefix_cache_hits_per_s",
)
_METRIC_OF: dict[str, str] = {
    "requests_per_s": REQUEST_SUCCESS_METRIC,
    "prompt_tokens_per_s": PROMPT_TOKENS_METRIC,
    "generation_tokens_per_s": GENERATION_TOKENS_METRIC,
    "running": RUNNING_METRIC,
    "waiting": WAITING_METRIC,
    "kv_cache_usage": KV_CACHE_USAGE_METRIC,
    "prefix_cache_hits_per_s": PREFIX_CACHE_HITS_METRIC,
}
# KV-cache usage is informational (allocation runs on MU/min and concurrency), and engines
# other than vLLM may not expose it, nor prefix-cache hits (without prefix caching): without
# them the load is still known.
_OPTIONAL = ("kv_cache_usage", "prefix_cache_hits_per_s")
_REQUIRED = tuple(quantity for quantity in QUANTITIES if quantity not in _OPTIONAL)

# The label the fleet query puts on each deployment's result, to tell them apart.
_DEPLOYMENT_LABEL = "mucp_deployment_id"

# HTTP statuses with which Prometheus refuses one query (bad PromQL, e.g. an invalid regex in
# one selector): the fleet read then queries deployment by deployment, so that one bad
# selector does not blind the allocator to the whole fleet.
_QUERY_REFUSED_STATUSES = {400, 422}


class InvalidSelectorError(DomainError):
    """A deployment's prometheus_selector is not a list of PromQL label matchers."""

    def __init__(self, message: str) -> None:
        super().__init__(
            message, field="prometheus_selector", code="invalid_prometheus_selector", status=400
        )


@dataclass(frozen=True)
class DeploymentLoad:
    """What one deployment was doing over the last `window_seconds`, per Prometheus.

    `known` is True when Prometheus answered with the deployment's series and the cost model
    priced them; otherwise `reason` says why, `mu_per_minute` is None, and whatever was read
    is still filled in (e.g. the rates when only the cost model is missing).
    """

    deployment_id: int
    known: bool
    reason: str  # why the load is unknown; "" when known
    requests_per_s: float | None
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    # Of the prompt tokens, those the prefix caches served; None when not exposed.
    prefix_cache_hits_per_s: float | None
    mu_per_minute: float | None  # model units per minute, in the model's MU (reference GPU)
    concurrency: float | None  # running + waiting requests, all replicas
    running: float | None
    waiting: float | None
    kv_cache_usage: float | None  # fraction 0..1, mean over replicas; None when not exposed
    window_seconds: int

    @classmethod
    def unknown(
        cls, deployment_id: int, reason: str, window_seconds: int, **read: float | None
    ) -> DeploymentLoad:
        """An unknown load: never a number of MU; `read` holds whatever was read anyway."""
        values = dict.fromkeys((*QUANTITIES, "concurrency"), None) | read
        return cls(
            deployment_id=deployment_id,
            known=False,
            reason=reason,
            mu_per_minute=None,
            window_seconds=window_seconds,
            **values,
        )


# --- selectors ----------------------------------------------------------------------------------

# A PromQL string literal: double- or single-quoted with Go's escapes, or a raw `backtick` string.
_ESCAPE = r"""\\(?:[abfnrtv\\'"]|x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|[0-7]{3})"""
_STRING = rf""""(?:[^"\\\n]|{_ESCAPE})*"|'(?:[^'\\\n]|{_ESCAPE})*'|`[^`]*`"""
_MATCHER = re.compile(
    rf"\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op>=~|!~|!=|=)\s*(?P<value>{_STRING})\s*"
)
_SELECTOR_EXAMPLE = '\'job="vllm", namespace="prod"\''


def validate_selector(text: str) -> str:
    """The selector's label matchers, normalised (`a="x", b=~"y"`); raises InvalidSelectorError.

    Only `label op "string"` matchers separated by commas pass, so braces, operators or a
    second selector can appear only inside quoted values, where PromQL reads them as text.
    """
    matchers: list[str] = []
    position = 0
    while True:
        match = _MATCHER.match(text, position)
        if match is None:
            rest = text[position:].strip()
            if not rest and matchers:  # a trailing comma, as PromQL allows
                break
            problem = "it is empty" if not text.strip() else f"cannot read {rest[:40]!r}"
            raise InvalidSelectorError(
                f"prometheus_selector {text!r} is not a list of PromQL label matchers such as "
                f"{_SELECTOR_EXAMPLE}: {problem} (character {position + 1})."
            )
        if match["label"] == "__name__":
            raise InvalidSelectorError(
                f"prometheus_selector {text!r} matches __name__; the reader chooses the vLLM "
                "metrics itself, so the selector may only match other labels."
            )
        matchers.append(f"{match['label']}{match['op']}{match['value']}")
        position = match.end()
        if position == len(text):
            break
        if text[position] != ",":
            raise InvalidSelectorError(
                f"prometheus_selector {text!r} is not a list of PromQL label matchers such as "
                f"{_SELECTOR_EXAMPLE}: expected ',' after {match.group(0).strip()!r} "
                f"(character {position + 1})."
            )
        position += 1
    return ", ".join(matchers)


def _promql_string(value: str) -> str:
    """A double-quoted PromQL string literal of `value` (Go escapes)."""
    escaped = []
    for char in value:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\x{ord(char):02x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def selector_for(deployment: Deployment) -> str:
    """The label matchers (without braces) that pick the deployment's vLLM series."""
    if deployment.prometheus_selector.strip():
        return validate_selector(deployment.prometheus_selector)
    return f"model_name={_promql_string(deployment.served_model.engine_model_id)}"


# --- pricing ------------------------------------------------------------------------------------

# The features that are a rate of tokens by themselves (the others are per request).
_PER_TOKEN_FEATURES = ("input_tokens", "cached_input_tokens", "output_tokens")


def mu_per_minute_of(
    cost_model: CostModel,
    *,
    requests_per_s: float,
    prompt_tokens_per_s: float,
    generation_tokens_per_s: float,
    prefix_cache_hits_per_s: float = 0.0,
) -> float:
    """MU per minute of traffic given by its rates, priced as requests of the mean shape; the
    prompt tokens the prefix caches served at the cached weight."""
    weights = cost_model.weights_replica_seconds
    # Hits are a part of the prompt tokens; counters scraped at slightly different moments
    # must not make the uncached part negative.
    cached_per_s = min(max(prefix_cache_hits_per_s, 0.0), prompt_tokens_per_s)
    if requests_per_s > 0:
        # The window's mean request, at its fractional token counts (capacity.pricing.exchange),
        # from the API's counts: prompt tokens include the cached ones.
        mean = MeanShape.of_totals(
            requests=requests_per_s,
            input_tokens=prompt_tokens_per_s,
            cached_input_tokens=cached_per_s,
            output_tokens=generation_tokens_per_s,
        )
        assert mean is not None  # requests_per_s > 0
        replica_seconds_per_s = requests_per_s * mean.replica_seconds(weights)
    else:
        # No request finished in the window, yet tokens may have been processed (requests
        # longer than the window): their per-token cost is a lower bound on the load.
        per_token = MeanShape.of_totals(
            requests=1.0,
            input_tokens=prompt_tokens_per_s,
            cached_input_tokens=cached_per_s,
            output_tokens=generation_tokens_per_s,
        )
        assert per_token is not None
        replica_seconds_per_s = per_token.replica_seconds(
            {name: w for name, w in weights.items() if name in _PER_TOKEN_FEATURES}
        )
    # R MU per replica-minute: one replica-second per second is R MU per minute.
    return replica_seconds_per_s * cost_model.replica_mu_per_minute


# --- reading ------------------------------------------------------------------------------------


def _promql(quantity: str, selector: str, window_seconds: int) -> str:
    """The query of one quantity for one deployment, aggregated to a single value.

    Replicas add up, and so do the finished_reason series of the request counter: aborted
    requests used the engine too, and their tokens are in the token counters.
    """
    matchers = "{" + selector + "}"
    window = f"[{window_seconds}s]"
    return {
        "requests_per_s": f"sum(rate({REQUEST_SUCCESS_METRIC}{matchers}{window}))",
        "prompt_tokens_per_s": f"sum(rate({PROMPT_TOKENS_METRIC}{matchers}{window}))",
        "generation_tokens_per_s": f"sum(rate({GENERATION_TOKENS_METRIC}{matchers}{window}))",
        "running": f"sum({RUNNING_METRIC}{matchers})",
        "waiting": f"sum({WAITING_METRIC}{matchers})",
        "kv_cache_usage": (
            f"avg({KV_CACHE_USAGE_METRIC}{matchers} or {LEGACY_KV_CACHE_USAGE_METRIC}{matchers})"
        ),
        "prefix_cache_hits_per_s": f"sum(rate({PREFIX_CACHE_HITS_METRIC}{matchers}{window}))",
    }[quantity]


class _PrometheusFailure(Exception):
    """Prometheus gave no usable answer; the message is the DeploymentLoad's reason."""

    def __init__(self, reason: str, *, query_refused: bool = False) -> None:
        super().__init__(reason)
        self.query_refused = query_refused


class _Reader:
    """Instant queries against one Prometheus, all evaluated at the same moment."""

    def __init__(self, client: PrometheusConnect, url: str, timeout_seconds: float) -> None:
        self.client = client
        self.url = url
        self.timeout_seconds = timeout_seconds
        self.params = {
            # One evaluation instant for every query, so that the ratios of rates (the mean
            # shape) are of one window; Prometheus gives up on its side when the client does.
            "time": f"{time.time():.3f}",
            "timeout": f"{timeout_seconds}s",
        }

    def query(self, promql: str) -> list[dict]:
        try:
            return self.client.custom_query(promql, params=self.params)
        except requests.RequestException as error:
            # Without retries, requests reports a read timeout as a ConnectionError wrapping
            # urllib3's MaxRetryError(reason=ReadTimeoutError).
            cause = getattr(error.args[0], "reason", None) if error.args else None
            if isinstance(error, requests.Timeout) or isinstance(cause, ReadTimeoutError):
                raise _PrometheusFailure(
                    f"Prometheus at {self.url} did not answer within {self.timeout_seconds} s"
                ) from None
            # requests buries the cause ("[Errno 111] Connection refused") in a long repr.
            errno = re.search(r"\[Errno -?\d+\][^'\")]*", str(error))
            detail = errno.group(0) if errno else type(error).__name__
            raise _PrometheusFailure(f"Prometheus unreachable at {self.url}: {detail}") from None
        except PrometheusApiClientException as error:
            status_code, detail = _refusal(error)
            raise _PrometheusFailure(
                f"Prometheus refused the query (HTTP {status_code}): {detail}",
                query_refused=status_code in _QUERY_REFUSED_STATUSES,
            ) from None
        except (ValueError, KeyError, TypeError) as error:
            # A 200 that is not a query result: the URL points at something else.
            raise _PrometheusFailure(
                f"{self.url} did not answer like Prometheus ({type(error).__name__}: {error})"
            ) from None

    def values(
        self, selectors: Mapping[int, str], window_seconds: int
    ) -> dict[int, dict[str, float | None]]:
        """Every quantity of every deployment, by deployment id, in one query per quantity.

        Each deployment's aggregate is tagged with its id by label_replace, and the tagged
        vectors joined with `or` (their label sets differ, so none shadows another).
        """
        values: dict[int, dict[str, float | None]] = {pk: {} for pk in selectors}
        for quantity in QUANTITIES:
            promql = " or ".join(
                f"label_replace({_promql(quantity, selector, window_seconds)}, "
                f'"{_DEPLOYMENT_LABEL}", "{pk}", "", "")'
                for pk, selector in selectors.items()
            )
            by_id = {
                sample.get("metric", {}).get(_DEPLOYMENT_LABEL): _sample_value(sample)
                for sample in self.query(promql)
            }
            for pk in selectors:
                values[pk][quantity] = by_id.get(str(pk))
        return values


def _refusal(error: PrometheusApiClientException) -> tuple[int | None, str]:
    """The HTTP status and Prometheus's own error message out of the client's exception.

    The client only keeps the text 'HTTP Status Code 400 (b\'{"status":"error", ...}\')'.
    """
    text = str(error)
    parsed = re.fullmatch(r"HTTP Status Code (\d+) \((b(?:'.*'|\".*\"))\)", text, re.DOTALL)
    if parsed is None:
        return None, text[:300]
    try:
        detail = str(json.loads(ast.literal_eval(parsed.group(2)))["error"])
    except (ValueError, SyntaxError, KeyError, TypeError):
        detail = parsed.group(2)[:300]  # not Prometheus's JSON: a proxy's error page, say
    return int(parsed.group(1)), detail


def _sample_value(sample: dict) -> float | None:
    try:
        value = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    # NaN (e.g. an average over no usable sample) is no reading, not a number to act on.
    return value if math.isfinite(value) else None


def _load_from(
    deployment_id: int,
    selector: str,
    values: Mapping[str, float | None],
    cost_model: CostModel | str,
    window_seconds: int,
) -> DeploymentLoad:
    """The load from what Prometheus returned; `cost_model` is the reason when there is none."""
    read: dict[str, float | None] = {quantity: values.get(quantity) for quantity in QUANTITIES}
    running, waiting = read["running"], read["waiting"]
    read["concurrency"] = None if running is None or waiting is None else running + waiting
    missing = [_METRIC_OF[quantity] for quantity in _REQUIRED if read[quantity] is None]
    if missing:
        reason = (
            f"no series match {{{selector}}} for {', '.join(missing)}"
            f" (rates need two samples in the last {window_seconds} s)"
        )
        return DeploymentLoad.unknown(deployment_id, reason, window_seconds, **read)
    if isinstance(cost_model, str):
        return DeploymentLoad.unknown(
            deployment_id, f"MU/min unknown: {cost_model}", window_seconds, **read
        )
    mu_per_minute = mu_per_minute_of(
        cost_model,
        requests_per_s=read["requests_per_s"],
        prompt_tokens_per_s=read["prompt_tokens_per_s"],
        generation_tokens_per_s=read["generation_tokens_per_s"],
        prefix_cache_hits_per_s=read["prefix_cache_hits_per_s"] or 0.0,
    )
    return DeploymentLoad(
        deployment_id=deployment_id,
        known=True,
        reason="",
        mu_per_minute=mu_per_minute,
        window_seconds=window_seconds,
        **read,
    )


def _check_window(window_seconds: int) -> None:
    if isinstance(window_seconds, bool) or not isinstance(window_seconds, int):
        raise ValueError(f"window_seconds must be an integer, got {window_seconds!r}")
    if window_seconds < 1:
        raise ValueError(f"window_seconds must be at least 1, got {window_seconds}")


def read_fleet_load(
    deployments: Iterable[Deployment],
    *,
    cost_models: Mapping[int, CostModel] | None = None,
    window_seconds: int = 60,
    url: str | None = None,
    timeout_seconds: float | None = None,
) -> dict[int, DeploymentLoad]:
    """The load of every deployment, by deployment id, from one query per quantity.

    `cost_models` maps served-model ids to the cost model to price with (default: each model's
    pricing cost model). A deployment with an invalid selector is reported unknown with the
    selector error while the others are read. `url` and `timeout_seconds` default to the
    PROMETHEUS_URL and PROMETHEUS_TIMEOUT_SECONDS settings.
    """
    _check_window(window_seconds)
    deployments = list(deployments)
    base_url = (settings.PROMETHEUS_URL if url is None else url).rstrip("/")
    timeout_seconds = timeout_seconds or settings.PROMETHEUS_TIMEOUT_SECONDS

    loads: dict[int, DeploymentLoad] = {}
    selectors: dict[int, str] = {}
    for deployment in deployments:
        try:
            selectors[deployment.pk] = selector_for(deployment)
        except InvalidSelectorError as error:
            loads[deployment.pk] = DeploymentLoad.unknown(
                deployment.pk, error.message, window_seconds
            )
    if not selectors:
        return loads
    if not base_url:
        reason = "Prometheus is not configured (PROMETHEUS_URL is empty)"
        return loads | {pk: DeploymentLoad.unknown(pk, reason, window_seconds) for pk in selectors}

    # No retries: the allocation tick reads again in 15 s, and an unknown load now beats one
    # that arrives after the client's default of three retries with seconds of backoff.
    with PrometheusConnect(url=base_url, retry=Retry(total=0), timeout=timeout_seconds) as client:
        reader = _Reader(client, base_url, timeout_seconds)
        try:
            values = reader.values(selectors, window_seconds)
        except _PrometheusFailure as failure:
            if not (failure.query_refused and len(selectors) > 1):
                logger.warning("Deployment load unknown: %s", failure)
                unknown = {
                    pk: DeploymentLoad.unknown(pk, str(failure), window_seconds) for pk in selectors
                }
                return loads | unknown
            # One selector Prometheus refuses (say, an invalid regex) must not blind the
            # allocator to the whole fleet: ask deployment by deployment.
            values = {}
            for pk, selector in selectors.items():
                try:
                    values |= reader.values({pk: selector}, window_seconds)
                except _PrometheusFailure as single_failure:
                    loads[pk] = DeploymentLoad.unknown(pk, str(single_failure), window_seconds)

    priced_with: dict[int, CostModel | str] = dict(cost_models or {})
    for deployment in deployments:
        if deployment.pk not in values:
            continue
        model_id = deployment.served_model_id
        if model_id not in priced_with:
            try:
                priced_with[model_id] = pricing_cost_model(served_model=deployment.served_model)
            except DomainError as error:
                priced_with[model_id] = error.message
        loads[deployment.pk] = _load_from(
            deployment.pk,
            selectors[deployment.pk],
            values[deployment.pk],
            priced_with[model_id],
            window_seconds,
        )
    return loads


def read_deployment_load(
    deployment: Deployment,
    *,
    cost_model: CostModel | None = None,
    window_seconds: int = 60,
    url: str | None = None,
    timeout_seconds: float | None = None,
) -> DeploymentLoad:
    """The deployment's load over the last `window_seconds`, unknown (never 0) when it cannot
    be read. Raises InvalidSelectorError for a malformed prometheus_selector."""
    selector_for(deployment)  # a malformed selector is an error here, not an unknown load
    cost_models = None if cost_model is None else {deployment.served_model_id: cost_model}
    return read_fleet_load(
        [deployment],
        cost_models=cost_models,
        window_seconds=window_seconds,
        url=url,
        timeout_seconds=timeout_seconds,
    )[deployment.pk]
