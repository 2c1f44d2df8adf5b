"""The emulator's ground-truth cost: one function for a step, one for a request.

The engine times every step with `step_seconds`; `ground_truth_replica_seconds` is the same
cost summed over one request's steps at a steady batch size, which is what a fitted cost
model (DESIGN.md §1) should recover. Pure functions, no I/O, so tests and benchmarks can
compare fits against them directly.
"""

from __future__ import annotations

from .config import ModelConfig


def step_seconds(
    model: ModelConfig, *, prefill_tokens: int, running_sequences: int, context_tokens: int
) -> float:
    """Duration of one engine step.

    `prefill_tokens`: prompt tokens of the sequences admitted in this step;
    `running_sequences`: sequences in the batch, newly admitted ones included;
    `context_tokens`: prompt + tokens generated so far, summed over those sequences.
    """
    return (
        model.prefill_seconds_per_token * prefill_tokens
        + model.decode_step_base_seconds
        + model.decode_seconds_per_sequence * running_sequences
        + model.decode_seconds_per_context_token * context_tokens
    )


def ground_truth_replica_seconds(
    model: ModelConfig, input_tokens: int, output_tokens: int, batch_size: float
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

    In cost-model weights (DESIGN.md §1, features per token and per thousand tokens):
    w_input = prefill, w_output = base/B + per_sequence,
    w_input×output/1000 = 1000 × per_context_token, w_output²/1000 = 500 × per_context_token,
    w_request = 0.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if input_tokens < 0 or output_tokens < 0:
        raise ValueError("input_tokens and output_tokens must be >= 0")
    return (
        model.prefill_seconds_per_token * input_tokens
        + output_tokens * (model.decode_step_base_seconds / batch_size)
        + output_tokens * model.decode_seconds_per_sequence
        + model.decode_seconds_per_context_token
        * (input_tokens * output_tokens + output_tokens * output_tokens / 2)
    )
