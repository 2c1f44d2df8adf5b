"""A replica's step-time model (its "profile"): what one engine replica of a model is, and how
long its steps take.

`ModelConfig` describes one served model and the ground truth its replicas follow;
`step_seconds` times one engine step, `ground_truth_replica_seconds` is the same cost summed
over one request's steps at a steady batch size, which is what a fitted cost model
(docs/design.md#the-currency) should recover. The fleet simulator and the what-if use it, and
the engine emulator (`dataplane.emulator`) steps its engines with it, so both follow the same
ground truth. Pure functions and a strict loader, no I/O and no Django.

The loader refuses unknown fields and wrong types with an error that names the field
(`models[1].max_num_seqs: ...`), because a typo in a ground-truth constant would otherwise
silently produce a benchmark of a different machine.

A profile from a fitted cost model (`profile_from_cost_model`), for a what-if of a real fleet:
the cost model (capacity.pricing.features) predicts the replica-seconds a request costs on a
saturated replica, t = Σ w_f·x_f, and one replica-second is R / 60 MU, so a replica busy for a
minute serves R = 100 MU/min on the model's reference GPU. The ground truth a simulated replica
follows costs, at a steady batch of n sequences (`ground_truth_replica_seconds`),

    prefill·input + output·(base/n + per_sequence) + per_context_token·(input·output + output²/2)

so the weights map onto it term by term, at the batch the replica reaches when saturated,
n = min(max_num_seqs, kv_cache_tokens ÷ the mix's mean input + output), since the engine
reserves each sequence's prompt and output in its KV cache when it admits it:

- prefill_seconds_per_token = w_input_tokens, plus w_request ÷ the mix's mean input: the
  ground truth has no per-request term, so the overhead is spread over the prompt tokens,
  exact for the mix's mean request (and over the output tokens when there is no input);
- base/n + per_sequence = w_output_tokens, split as in the emulator's defaults (7 ms of base
  shared by 256 sequences beside 60 µs per sequence: 31 % base), so that latency (TPOT) at a
  small batch is base + per_sequence and at the saturated batch n·w_output_tokens + the context;
- per_context_token: w_input_x_output_per_1000 and w_output_sq_per_1000 are per thousand of
  input·output and output², which the ground truth weighs 1 : ½; with other weights (a fit
  selects features) it is their cost for the mix's mean input·output and output².

The simulator's traces carry no cached tokens or images, so those weights are not used. With
the weights the simulated replica's saturated cost of the mix's mean request is the cost
model's own, so it serves R MU/min of the mix priced by that cost model (on another GPU type,
the deployment's own cost model gives the replica and the reference one prices the requests:
R · t_ref / t_own, the exchange rate of capacity.pricing.exchange).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeGuard

# Defaults describe an 8B dense model on one H100 (bf16): weights read once per decode step
# (~7 ms), a small per-sequence cost, and ~128 KiB of KV cache read per context token.
DEFAULT_MAX_NUM_SEQS = 256
# vLLM's per-step token budget for prompts (`--max-num-batched-tokens`; 8192 is vLLM V1's
# default for its OpenAI server on large GPUs): a burst of prompts is prefilled a budget at a
# time, first come first served, rather than all in one step.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_KV_CACHE_TOKENS = 200_000
DEFAULT_CONTEXT_LENGTH = 8192
DEFAULT_PREFILL_SECONDS_PER_TOKEN = 1.0e-4
DEFAULT_DECODE_STEP_BASE_SECONDS = 7.0e-3
DEFAULT_DECODE_SECONDS_PER_SEQUENCE = 6.0e-5
DEFAULT_DECODE_SECONDS_PER_CONTEXT_TOKEN = 5.0e-8
DEFAULT_MEAN_OUTPUT_TOKENS = 200
DEFAULT_VOCAB_SIZE = 128_256
DEFAULT_PENDING_TIMEOUT_SECONDS = 60.0
# vLLM's automatic prefix caching (on by default in its V1 engine): prompts are hashed in
# blocks of `block_size` tokens (vLLM's default 16), and a block computed once is reused by
# every later prompt that starts with the same blocks, until it is evicted (LRU).
DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFIX_CACHE_BLOCKS = DEFAULT_KV_CACHE_TOKENS // DEFAULT_BLOCK_SIZE
# A cached prompt token is not computed again, but the prefill's attention still reads its
# KV: a tenth of an uncached token's cost.
DEFAULT_PREFILL_SECONDS_PER_CACHED_TOKEN = 1.0e-5
# A vision encoder turns each image into a fixed number of placeholder tokens (LLaVA-1.5:
# 24×24 patches of a 336 px image = 576), prefilled like text and counted in prompt_tokens,
# after the encoder's own pass over the image.
DEFAULT_IMAGE_TOKENS_PER_IMAGE = 576
DEFAULT_VISION_ENCODER_SECONDS_PER_IMAGE = 5.0e-3
MAX_REPLICAS = 1024
# vLLM's `--scheduling-policy`: fcfs (its default) or priority.
FCFS = "fcfs"
PRIORITY = "priority"
SCHEDULING_POLICIES = (FCFS, PRIORITY)


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


@dataclass(frozen=True)
class ModelConfig:
    """One served model and the ground truth its replicas follow.

    A decode step of a replica takes
        prefill_seconds_per_token × (prompt tokens prefilled in the step)
        + decode_step_base_seconds
        + decode_seconds_per_sequence × (running sequences)
        + decode_seconds_per_context_token × (context tokens of the running sequences)
    and every running sequence emits one token at its end. Prompt tokens served from the
    prefix cache cost `prefill_seconds_per_cached_token` instead of the full prefill, and every
    image whose tokens are not all cached costs `vision_encoder_seconds_per_image` on top of
    its `image_tokens_per_image` placeholder tokens.
    """

    name: str
    replicas: int = 1
    cold_start_seconds: float = 0.0
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    context_length: int = DEFAULT_CONTEXT_LENGTH
    prefill_seconds_per_token: float = DEFAULT_PREFILL_SECONDS_PER_TOKEN
    decode_step_base_seconds: float = DEFAULT_DECODE_STEP_BASE_SECONDS
    decode_seconds_per_sequence: float = DEFAULT_DECODE_SECONDS_PER_SEQUENCE
    decode_seconds_per_context_token: float = DEFAULT_DECODE_SECONDS_PER_CONTEXT_TOKEN
    mean_output_tokens: int = DEFAULT_MEAN_OUTPUT_TOKENS
    vocab_size: int = DEFAULT_VOCAB_SIZE
    # How long a request may wait for a ready replica (model scaled to zero or still cold
    # starting) before it is answered 503.
    pending_timeout_seconds: float = DEFAULT_PENDING_TIMEOUT_SECONDS
    # vLLM's `--scheduling-policy`: `fcfs` admits in arrival order and ignores `priority`;
    # `priority` admits lowest `priority` first, then arrival order.
    scheduling_policy: str = FCFS
    # With the priority policy, also preempt running sequences of a worse priority when
    # the best waiting one does not fit (vLLM V0's priority preemption; V1 does not).
    priority_preemption: bool = False
    # vLLM's `--enable-prefix-caching` (its V1 default) and `--block-size`; the cache keeps at
    # most `prefix_cache_blocks` blocks, least recently used evicted first.
    enable_prefix_caching: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_cache_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS
    prefill_seconds_per_cached_token: float = DEFAULT_PREFILL_SECONDS_PER_CACHED_TOKEN
    image_tokens_per_image: int = DEFAULT_IMAGE_TOKENS_PER_IMAGE
    vision_encoder_seconds_per_image: float = DEFAULT_VISION_ENCODER_SECONDS_PER_IMAGE


@dataclass(frozen=True)
class ProfileConfig:
    """The seed and the models of a config in the emulator's format (its `faults`, if any, are
    the emulator's own: `dataplane.emulator.config.parse_config` reads them)."""

    seed: int = 0
    models: tuple[ModelConfig, ...] = field(default_factory=tuple)

    def model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


# Inclusive minimum of every numeric field.
_INT_BOUNDS: dict[str, int] = {
    "replicas": 0,
    "max_num_seqs": 1,
    "max_num_batched_tokens": 1,
    "kv_cache_tokens": 1,
    "context_length": 1,
    "mean_output_tokens": 1,
    "vocab_size": 2,
    "block_size": 1,
    "prefix_cache_blocks": 0,
    "image_tokens_per_image": 1,
}
_FLOAT_MINIMUMS: dict[str, float] = {
    "cold_start_seconds": 0.0,
    "prefill_seconds_per_token": 0.0,
    "decode_step_base_seconds": 0.0,
    "decode_seconds_per_sequence": 0.0,
    "decode_seconds_per_context_token": 0.0,
    "pending_timeout_seconds": 0.0,
    "prefill_seconds_per_cached_token": 0.0,
    "vision_encoder_seconds_per_image": 0.0,
}


def _is_int(value: Any) -> TypeGuard[int]:
    # bool is an int subclass; `"replicas": true` is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(path: str, value: Any, minimum: int) -> int:
    if not _is_int(value):
        raise ConfigError(f"{path}: must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{path}: must be >= {minimum}, got {value}")
    return value


def _float_field(path: str, value: Any, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{path}: must be a number, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{path}: must be a finite number >= {minimum}, got {value!r}")
    return float(value)


def parse_model(index: int, raw: Any) -> ModelConfig:
    """`models[index]` of a config as a ModelConfig; a ConfigError names the field at fault."""
    path = f"models[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be an object, got {type(raw).__name__}")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{path}.name: must be a non-empty string, got {name!r}")
    values: dict[str, Any] = {"name": name}
    for key, value in raw.items():
        if key in _INT_BOUNDS:
            values[key] = _int_field(f"{path}.{key}", value, _INT_BOUNDS[key])
        elif key in _FLOAT_MINIMUMS:
            values[key] = _float_field(f"{path}.{key}", value, _FLOAT_MINIMUMS[key])
        elif key == "scheduling_policy":
            if value not in SCHEDULING_POLICIES:
                raise ConfigError(
                    f"{path}.scheduling_policy: must be one of {', '.join(SCHEDULING_POLICIES)}"
                    f", got {value!r}"
                )
            values[key] = value
        elif key in ("priority_preemption", "enable_prefix_caching"):
            if not isinstance(value, bool):
                raise ConfigError(f"{path}.{key}: must be a boolean, got {value!r}")
            values[key] = value
    model = ModelConfig(**values)
    _check_policy(path, model)
    if model.replicas > MAX_REPLICAS:
        raise ConfigError(f"{path}.replicas: must be <= {MAX_REPLICAS}, got {model.replicas}")
    # vLLM refuses to start when one max-length sequence cannot fit in the KV cache; without
    # this a request could wait forever for a budget that never frees up.
    if model.kv_cache_tokens < model.context_length:
        raise ConfigError(
            f"{path}.kv_cache_tokens: must be >= context_length ({model.context_length}), "
            f"got {model.kv_cache_tokens}"
        )
    return model


def _check_policy(path: str, model: ModelConfig) -> None:
    if model.priority_preemption and model.scheduling_policy != PRIORITY:
        raise ConfigError(
            f"{path}.priority_preemption: needs scheduling_policy 'priority', "
            f"got {model.scheduling_policy!r}"
        )


def parse_config(raw: Any) -> ProfileConfig:
    """The seed and models of a config in the emulator's format (`{"seed", "models",
    "faults"}`), raising `ConfigError` naming the field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"seed", "models", "faults"})
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level field (known: faults, models, seed)")
    seed = raw.get("seed", 0)
    if not _is_int(seed):
        raise ConfigError(f"seed: must be an integer, got {seed!r}")
    raw_models = raw.get("models")
    if not isinstance(raw_models, list) or not raw_models:
        raise ConfigError("models: must be a non-empty list of model objects")
    models = tuple(parse_model(i, m) for i, m in enumerate(raw_models))
    seen: set[str] = set()
    for i, model in enumerate(models):
        if model.name in seen:
            raise ConfigError(f"models[{i}].name: duplicate model name {model.name!r}")
        seen.add(model.name)
    if not isinstance(raw.get("faults", []), list):
        raise ConfigError(
            f"faults: must be a list of fault objects, got {type(raw['faults']).__name__}"
        )
    return ProfileConfig(seed=seed, models=models)


def step_seconds(
    model: ModelConfig,
    *,
    prefill_tokens: int,
    running_sequences: int,
    context_tokens: int,
    cached_tokens: int = 0,
    encoded_images: int = 0,
) -> float:
    """Duration of one engine step.

    `prefill_tokens`: prompt tokens of the sequences admitted in this step that are computed
    (not served from the prefix cache); `cached_tokens`: their prompt tokens that are;
    `encoded_images`: their images the vision encoder runs on;
    `running_sequences`: sequences in the batch, newly admitted ones included;
    `context_tokens`: prompt + tokens generated so far, summed over those sequences.
    """
    return (
        model.prefill_seconds_per_token * prefill_tokens
        + model.prefill_seconds_per_cached_token * cached_tokens
        + model.vision_encoder_seconds_per_image * encoded_images
        + model.decode_step_base_seconds
        + model.decode_seconds_per_sequence * running_sequences
        + model.decode_seconds_per_context_token * context_tokens
    )


def ground_truth_replica_seconds(
    model: ModelConfig,
    input_tokens: int,
    output_tokens: int,
    batch_size: float,
    *,
    cached_input_tokens: int = 0,
    images: int = 0,
) -> float:
    """Replica-seconds one request consumes when the replica steadily runs `batch_size` sequences.

        prefill × input
        + output × (base / B + per_sequence)
        + per_context_token × (input × output + output² / 2)

    Each of a request's `output` steps costs the batch `base`, shared by B sequences, plus its
    own per-sequence cost and the read of its context, which grows from `input` to
    `input + output - 1`. The engine's exact context sum is input×output + output(output-1)/2;
    the formula uses output²/2 to match the cost model's features, a difference of
    per_context_token × output / 2, well under 1 % for realistic constants.

    In cost-model weights (docs/design.md#the-currency, features per token and per thousand tokens):
    w_input = prefill, w_output = base/B + per_sequence,
    w_input×output/1000 = 1000 × per_context_token, w_output²/1000 = 500 × per_context_token,
    w_request = 0.

    `input_tokens` are the uncached prompt tokens (image placeholder tokens included, as
    vLLM counts them in prompt_tokens), `cached_input_tokens` those served from the prefix
    cache, as in capacity.pricing.features.Shape: w_cached_input_tokens =
    prefill_seconds_per_cached_token, w_images = vision_encoder_seconds_per_image (images
    whose tokens are uncached), and cached tokens are context like any other.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if input_tokens < 0 or output_tokens < 0 or cached_input_tokens < 0 or images < 0:
        raise ValueError("token and image counts must be >= 0")
    context_input_tokens = input_tokens + cached_input_tokens
    return (
        model.prefill_seconds_per_token * input_tokens
        + model.prefill_seconds_per_cached_token * cached_input_tokens
        + model.vision_encoder_seconds_per_image * images
        + output_tokens * (model.decode_step_base_seconds / batch_size)
        + output_tokens * model.decode_seconds_per_sequence
        + model.decode_seconds_per_context_token
        * (context_input_tokens * output_tokens + output_tokens * output_tokens / 2)
    )


# The emulator's split of a decoded token's cost at a full batch: the step's base (the weights,
# read once per step) shared by the batch, beside the sequence's own cost.
DEFAULT_BASE_SHARE = (DEFAULT_DECODE_STEP_BASE_SECONDS / DEFAULT_MAX_NUM_SEQS) / (
    DEFAULT_DECODE_STEP_BASE_SECONDS / DEFAULT_MAX_NUM_SEQS + DEFAULT_DECODE_SECONDS_PER_SEQUENCE
)


@dataclass(frozen=True)
class WorkloadMix:
    """Means over a workload's requests: tokens, and the products the context terms weigh."""

    input_tokens: float
    output_tokens: float
    input_x_output: float
    output_sq: float

    @classmethod
    def of(cls, sizes: Sequence[tuple[int, int]]) -> WorkloadMix:
        """From (input tokens, output tokens) pairs; an engine emits at least one token."""
        if not sizes:
            raise ValueError("a workload mix needs at least one request")
        count = len(sizes)
        inputs = [float(i) for i, _ in sizes]
        outputs = [float(max(1, o)) for _, o in sizes]
        return cls(
            input_tokens=sum(inputs) / count,
            output_tokens=sum(outputs) / count,
            input_x_output=sum(i * o for i, o in zip(inputs, outputs, strict=True)) / count,
            output_sq=sum(o * o for o in outputs) / count,
        )


def saturated_batch(mix: WorkloadMix, *, max_num_seqs: int, kv_cache_tokens: int) -> int:
    """Sequences a saturated replica runs for this mix: its batch limit, or what its KV cache
    holds of the mix's mean sequence (prompt + output, reserved on admission)."""
    per_sequence = mix.input_tokens + mix.output_tokens
    fits = int(kv_cache_tokens // per_sequence) if per_sequence > 0 else max_num_seqs
    return max(1, min(max_num_seqs, fits))


def profile_from_cost_model(
    *,
    name: str,
    weights_replica_seconds: Mapping[str, float],
    mix: WorkloadMix,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    cold_start_seconds: float = 0.0,
) -> ModelConfig:
    """The replica a fitted cost model describes, for a workload mix (module docstring)."""
    w = {key: float(value) for key, value in weights_replica_seconds.items()}
    for key, value in w.items():
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(
                f"weights_replica_seconds.{key}: must be finite and >= 0, got {value}"
            )
    per_request = w.get("request", 0.0)
    prefill = w.get("input_tokens", 0.0)
    decode = w.get("output_tokens", 0.0)
    # The per-request overhead, spread over the mean request's tokens.
    if mix.input_tokens > 0:
        prefill += per_request / mix.input_tokens
    elif mix.output_tokens > 0:
        decode += per_request / mix.output_tokens
    context_weight = (
        w.get("input_x_output_per_1000", 0.0) * mix.input_x_output
        + w.get("output_sq_per_1000", 0.0) * mix.output_sq
    )
    context_terms = mix.input_x_output + mix.output_sq / 2
    per_context_token = context_weight / 1000.0 / context_terms if context_terms > 0 else 0.0
    batch = saturated_batch(mix, max_num_seqs=max_num_seqs, kv_cache_tokens=kv_cache_tokens)
    base = DEFAULT_BASE_SHARE * decode * batch
    per_sequence = (1 - DEFAULT_BASE_SHARE) * decode
    if base + per_sequence <= 0:
        raise ConfigError(
            "weights_replica_seconds.output_tokens: a decoded token must cost time (> 0)"
        )
    raw = {
        "name": name,
        "cold_start_seconds": float(cold_start_seconds),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "kv_cache_tokens": max(kv_cache_tokens, context_length),
        "context_length": context_length,
        "prefill_seconds_per_token": prefill,
        "decode_step_base_seconds": base,
        "decode_seconds_per_sequence": per_sequence,
        "decode_seconds_per_context_token": per_context_token,
    }
    return parse_model(0, raw)
