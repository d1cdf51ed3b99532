"""Replaying agent sessions against an engine, turn by turn, and what each turn measured.

A session (a :class:`~boundless.bench.workloads.ProgramSpec` of one thread) sends its turns one after
another; each turn's prompt is the whole conversation so far plus its append (``call_prompt``), as token ids
so that prefixes match exactly, and it generates a fixed number of tokens greedily (``ignore_eos``). The
engine is anything with the HTTP server's engine interface, ``submit(request_id, prompt, params, program)``
returning a stream of deltas: one in-process engine, a Ray cluster, or a local prefill/decode cluster. Every
delta is timed on arrival, so a turn yields its time to first token (TTFT), time per output token (TPOT) and
its tokens.

Offline (``offline=True``) every session starts at once and turns follow each other without tool time: the
job completion time (JCT) of the whole batch is the figure. Online, sessions arrive at their Poisson times
and wait their tool time before each turn.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from boundless.bench.serve import percentile
from boundless.bench.workloads import ProgramSpec, PromptTokens, call_prompt
from boundless.engine.async_engine import RequestStream
from boundless.engine.sampling_params import SamplingParams
from boundless.programs.ref import ProgramRef


class Engine(Protocol):
    """The engine interface the HTTP server serves from (``AsyncEngine``, ``ClusterClient``, ``LocalPDCluster``)."""

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, program: ProgramRef | None = None
    ) -> RequestStream: ...


@dataclass(frozen=True)
class TurnResult:
    """One turn: when it was sent, got its first token and ended (seconds from the run's start), its prompt
    length and generated tokens, or the error it failed with."""

    session_id: str
    turn: int
    sent_s: float
    first_token_s: float
    finished_s: float
    prompt_tokens: int
    cached_tokens: int
    output_token_ids: tuple[int, ...]
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float:
        """Seconds per output token after the first (0 for a single token)."""
        n = len(self.output_token_ids)
        return (self.finished_s - self.first_token_s) / (n - 1) if n > 1 else 0.0


async def _turn(
    engine: Engine, request_id: str, prompt: list[int], output: int, program: ProgramRef, t0: float
) -> tuple[float, float, int, list[int], str | None]:
    """Send one turn; (first token s, finished s, cached tokens, tokens, error)."""
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    tokens: list[int] = []
    first = finished = float("nan")
    cached = 0
    try:
        stream = engine.submit(request_id, prompt, params, program)
        async for delta in stream:
            now = time.perf_counter() - t0
            if delta.new_token_ids and not tokens:
                first = now
            tokens += delta.new_token_ids
            cached = max(cached, delta.num_cached_tokens)
            if delta.finished:
                finished = now
                if delta.finish_reason not in ("length", "stop"):
                    return first, finished, cached, tokens, f"finished: {delta.finish_reason} {delta.stop_reason}"
    except Exception as e:  # counted: a failed turn makes the run's figures invalid
        return first, time.perf_counter() - t0, cached, tokens, f"{type(e).__name__}: {e}"[:300]
    return first, finished, cached, tokens, None


async def replay_session(
    engine: Engine, spec: ProgramSpec, tokens: PromptTokens, max_model_len: int, t0: float, offline: bool
) -> list[TurnResult]:
    """A session's turns in order, from its arrival (at once when ``offline``)."""
    if not offline:
        delay = t0 + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    rng, system = tokens.start(spec)
    contexts: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    results = []
    for turn, stage in enumerate(spec.stages):
        (call,) = stage  # an agent session is one thread
        if call.tool_wait_s > 0 and not offline:
            await asyncio.sleep(call.tool_wait_s)
        new_input = tokens.draw(rng, call.new_input)
        prompt = call_prompt(call, system, contexts, outputs, new_input, max_model_len)
        program = ProgramRef(spec.program_id, call.thread_id, call.parents)
        sent = time.perf_counter() - t0
        first, finished, cached, out, error = await _turn(
            engine, f"{spec.program_id}-t{turn}", prompt, call.output, program, t0
        )
        results.append(TurnResult(spec.program_id, turn, sent, first, finished, len(prompt), cached, tuple(out), error))
        contexts[call.thread_id] = prompt + out
        outputs[call.thread_id] = out
    return results


async def replay(
    engine: Engine, sessions: Sequence[ProgramSpec], tokens: PromptTokens, max_model_len: int, offline: bool
) -> list[TurnResult]:
    """Every session, concurrently; their turns in session order."""
    t0 = time.perf_counter()
    per_session = await asyncio.gather(
        *(replay_session(engine, s, tokens, max_model_len, t0, offline) for s in sessions)
    )
    return [r for rs in per_session for r in rs]


@dataclass(frozen=True)
class SLO:
    """A turn meets the SLO when its TTFT and its TPOT are both within bounds (the paper's: 4 s and 50 ms)."""

    ttft_s: float
    tpot_s: float

    def met(self, turn: TurnResult) -> bool:
        return turn.error is None and turn.ttft_s <= self.ttft_s and turn.tpot_s <= self.tpot_s


def summarize(turns: Sequence[TurnResult], slo: SLO) -> dict[str, Any]:
    """A run's figures: JCT (first send to last finish), throughput in turns and prompt tokens per second,
    TTFT and TPOT (mean, p90), SLO attainment, failed turns."""
    ok = [t for t in turns if t.error is None]
    start = min(t.sent_s for t in turns)
    jct = max(t.finished_s for t in turns) - start
    ttft = [t.ttft_s for t in ok]
    tpot = [t.tpot_s for t in ok if len(t.output_token_ids) > 1]
    prompt = sum(t.prompt_tokens for t in ok)
    return {
        "turns": len(turns),
        "failed_turns": len(turns) - len(ok),
        "first_error": next((t.error for t in turns if t.error), None),
        "jct_s": jct,
        "turns_per_s": len(ok) / jct,
        "prompt_tokens_per_s": prompt / jct,
        "output_tokens": sum(len(t.output_token_ids) for t in ok),
        "cached_share": sum(t.cached_tokens for t in ok) / max(1, prompt),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p90_s": percentile(ttft, 0.9),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else float("nan"),
        "tpot_p90_s": percentile(tpot, 0.9),
        "slo_attainment": sum(slo.met(t) for t in turns) / len(turns),
    }


def outputs_of(turns: Sequence[TurnResult]) -> dict[tuple[str, int], tuple[int, ...]]:
    """Each turn's generated tokens, by (session, turn): what must be equal across modes."""
    return {(t.session_id, t.turn): t.output_token_ids for t in turns}
