"""What the server logs as it runs, in vLLM's lines: the periodic stats line (each instance's prompt and generation
throughput over the last interval, its running and waiting requests, KV cache usage and prefix cache hit rate;
``--disable-log-stats`` turns it off), from which an operator reads the load without scraping ``/metrics``; and with
``--enable-log-requests`` a line for each request taken."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from boundless.engine.core import EngineStats
from boundless.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

LOG_STATS_INTERVAL_S = 10.0  # (vLLM's VLLM_LOG_STATS_INTERVAL)


@dataclass(frozen=True)
class IntervalStats:
    """One instance's figures over one interval."""

    prompt_throughput: float  # prompt tokens of the requests taken, per second (vLLM's)
    generation_throughput: float  # tokens generated per second
    running: int
    waiting: int
    kv_usage: float  # share of the device pool's blocks in use, now
    prefix_hit_rate: float | None  # of the prompt tokens looked up this interval; None: none was

    @property
    def idle(self) -> bool:
        return not (self.prompt_throughput or self.generation_throughput or self.running or self.waiting)

    def line(self, instance: str) -> str:
        hits = "-" if self.prefix_hit_rate is None else f"{self.prefix_hit_rate:.1%}"
        return (
            f"Engine {instance}: Avg prompt throughput: {self.prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_throughput:.1f} tokens/s, Running: {self.running} reqs, "
            f"Waiting: {self.waiting} reqs, KV cache usage: {self.kv_usage:.1%}, Prefix cache hit rate: {hits}"
        )


def interval_stats(before: EngineStats | None, now: EngineStats, seconds: float) -> IntervalStats:
    """``now``'s figures against ``before``'s, ``seconds`` earlier. Counters that went down (an instance restarted,
    its counts from zero again) or an instance not seen before count from zero."""

    def grew(name: str) -> int:
        value: int = getattr(now, name)
        if before is None or value < getattr(before, name):
            return value
        return value - getattr(before, name)

    queries, hits = grew("prefix_cache_queries"), grew("prefix_cache_hits")
    per_s = 1 / seconds if seconds > 0 else 0.0
    return IntervalStats(
        prompt_throughput=grew("prompt_tokens") * per_s,
        generation_throughput=grew("generation_tokens") * per_s,
        running=now.num_running,
        waiting=now.num_waiting,
        kv_usage=now.kv_usage,
        prefix_hit_rate=min(1.0, hits / queries) if queries else None,
    )


class StatsLog:
    """Logs every instance's :class:`IntervalStats` each ``interval_s``, from a thread of its own: at INFO while it
    has work or had some in the interval before (the line that shows it fell idle), else at DEBUG (an idle server's
    log stays quiet). ``stats`` is the engine client's (instance id -> its latest stats); ``clock`` the time."""

    def __init__(
        self,
        stats: Callable[[], dict[str, EngineStats]],
        clock: Callable[[], float],
        interval_s: float = LOG_STATS_INTERVAL_S,
    ) -> None:
        self._stats = stats
        self._clock = clock
        self.interval_s = interval_s
        self._last: dict[str, EngineStats] = {}
        self._last_time = clock()
        self._was_idle: dict[str, bool] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> list[tuple[int, str]]:
        """Take the stats now; the (level, line) of each instance, logged too."""
        now_time = self._clock()
        seconds, self._last_time = now_time - self._last_time, now_time
        lines = []
        current = self._stats()
        for instance in sorted(current):
            figures = interval_stats(self._last.get(instance), current[instance], seconds)
            quiet = figures.idle and self._was_idle.get(instance, True)
            self._was_idle[instance] = figures.idle
            level = logging.DEBUG if quiet else logging.INFO
            line = figures.line(instance)
            log.log(level, "%s", line)
            lines.append((level, line))
        self._last = current
        return lines

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stats-log", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as e:  # (a failed read of the stats costs its line, not the server)
                log.warning("stats log: %s: %s", type(e).__name__, e)


def request_line(
    request_id: str,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    tokenizer: Any,
    max_len: int | None = None,
) -> str:
    """A request's line as it is taken (vLLM's ``Received request``): each prompt's text and token ids (their first
    ``max_len`` characters and ids with ``--max-log-len``), and its sampling parameters."""

    def cut(items: Sequence[Any]) -> Sequence[Any]:
        return items if max_len is None else items[:max_len]

    parts = []
    for ids in prompts:
        text = tokenizer.decode(list(cut(ids)), skip_special_tokens=False)
        parts.append(f"prompt: {cut(text)!r}, prompt_token_ids: {list(cut(ids))}")
    lora = params.lora_name
    return f"Received request {request_id}: {'; '.join(parts)}, params: {params!r}, lora_request: {lora!r}."
