"""The calibrated cost model: how long prefill, decode steps, transfers and load-backs take.

One place for every timing formula, shared by the simulator, the emulator and the unloaded reference
that session slowdown divides by.
"""

from __future__ import annotations

import numpy as np

from basin.sim.deployments import GpuCalibration
from basin.workload.model import Session


def prefill_seconds(gpu: GpuCalibration, new_tokens: int, start_position: int) -> float:
    """Compute for `new_tokens` prompt tokens placed after `start_position` cached tokens.

    Per-token cost grows linearly with position (attention layers), so the total is the per-token cost
    at the midpoint of the new span. Chunk overheads are charged by the caller, per forward pass.
    """
    midpoint = start_position + new_tokens / 2
    return new_tokens * (gpu.prefill_s_per_token + gpu.prefill_s_per_token_position * midpoint)


def decode_step_seconds(gpu: GpuCalibration, batch: int, context_tokens: float) -> float:
    """One decode step for `batch` running requests holding `context_tokens` of KV in total."""
    return (
        gpu.decode_step_base_s
        + gpu.decode_step_per_request_s * batch
        + gpu.decode_step_per_context_token_s * context_tokens
    )


def transfer_seconds(gpu: GpuCalibration, tokens: int) -> float:
    """A KV copy of `tokens` between instances (a lent unit's fetch, a borrowed prefix)."""
    return gpu.transfer_overhead_s + gpu.transfer_s_per_token * tokens


def pd_transfer_seconds(gpu: GpuCalibration, tokens: int) -> float:
    """A request's KV transfer from prefill to decode: fixed (the paper's charge) or proportional."""
    fixed = gpu.pd_transfer_fixed_s
    return transfer_seconds(gpu, tokens) if fixed is None else fixed


def load_back_seconds(gpu: GpuCalibration, tokens: int) -> float:
    """Copy a host-tier prefix back into GPU memory."""
    return gpu.load_back_s_per_token * tokens


def unloaded_call_seconds(gpu: GpuCalibration, uncached: int, prompt: int, output: int) -> float:
    """A call on an idle engine: one prefill pass over the uncached suffix, the transfer, and
    batch-one decode of the output."""
    chunks = max(1, -(-uncached // gpu.prefill_chunk_tokens))
    prefill = prefill_seconds(gpu, uncached, prompt - uncached) + chunks * gpu.prefill_chunk_overhead_s
    decode = output * decode_step_seconds(gpu, 1, prompt + output / 2)
    return prefill + pd_transfer_seconds(gpu, prompt) + decode


def unloaded_call_times(gpu: GpuCalibration, session: Session) -> np.ndarray:
    """Seconds each call of `session` takes on an idle engine, plus the tool gap that follows it.

    A call's uncached work is its new suffix plus the previous output: the prefill cache holds the
    previous prompt, but decode produced the output.
    """
    times = np.empty(len(session.calls))
    previous = None
    for index, call in enumerate(session.calls):
        if previous is None:
            uncached = call.prompt_tokens
        else:
            uncached = call.prompt_tokens - min(call.carried_tokens, previous.prompt_tokens)
        times[index] = unloaded_call_seconds(gpu, uncached, call.prompt_tokens, call.output_tokens)
        times[index] += call.tool_gap_s  # 0 after the last call
        previous = call
    return times


def unloaded_session_seconds(gpu: GpuCalibration, session: Session) -> float:
    """The slowdown reference (§7.1): tool gaps, call overheads, new-suffix prefill, batch-one decode."""
    return float(unloaded_call_times(gpu, session).sum())
