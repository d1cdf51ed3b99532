"""The server's log lines (``api/server_log.py``): the periodic stats line and a request's line."""

from __future__ import annotations

import logging
import time

import pytest

from boundless.api.server_log import StatsLog, interval_stats, request_line
from boundless.engine.core import EngineStats
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import LoadedModel


def _stats(prompt: int = 0, generated: int = 0, running: int = 0, waiting: int = 0, queries: int = 0, hits: int = 0):
    return EngineStats(
        num_running=running, num_waiting=waiting, kv_blocks_used=25, kv_blocks_total=100,
        prefix_cache_queries=queries, prefix_cache_hits=hits, prompt_tokens=prompt, generation_tokens=generated,
        computed_tokens=0, num_preemptions=0, num_kept=0, num_swapped_out=0, num_recomputed=0, busy_seconds=0.0,
        steps=0,
    )  # fmt: skip


def test_an_interval_counts_what_grew_in_it() -> None:
    figures = interval_stats(_stats(100, 50, queries=100, hits=20), _stats(300, 250, 2, 1, 300, 170), 10.0)
    assert figures.prompt_throughput == 20.0
    assert figures.generation_throughput == 20.0
    assert (figures.running, figures.waiting, figures.kv_usage) == (2, 1, 0.25)
    assert figures.prefix_hit_rate == 0.75  # (150 of the 200 tokens looked up in the interval)
    assert figures.line("0") == (
        "Engine 0: Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 75.0%"
    )


def test_counters_that_went_down_count_from_zero() -> None:
    """An instance restarted in place counts from zero again: its counts are this interval's, not negative rates."""
    figures = interval_stats(_stats(1000, 1000, queries=1000), _stats(40, 30, queries=40, hits=10), 10.0)
    assert (figures.prompt_throughput, figures.generation_throughput, figures.prefix_hit_rate) == (4.0, 3.0, 0.25)
    assert interval_stats(None, _stats(40), 10.0).prompt_throughput == 4.0  # (an instance not seen before)
    assert interval_stats(_stats(), _stats(), 10.0).prefix_hit_rate is None


def test_the_stats_line_is_info_while_there_is_work_and_once_it_has_ended(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's rule: an idle server's log stays quiet (DEBUG), but the line after the last work is INFO, so the log
    shows the load fall to nothing."""
    now = [0.0]
    snapshots = iter(
        [
            {"0": _stats()},  # idle from the start
            {"0": _stats(100, 10, running=1), "1": _stats()},  # work on 0; 1 appears, idle
            {"0": _stats(100, 40, running=1), "1": _stats()},
            {"0": _stats(100, 40), "1": _stats()},  # 0 falls idle: one more INFO line
            {"0": _stats(100, 40), "1": _stats()},
        ]
    )
    log = StatsLog(lambda: next(snapshots), lambda: now[0], interval_s=10.0)
    levels = []
    with caplog.at_level(logging.DEBUG, logger="boundless.api.server_log"):
        for _ in range(5):
            now[0] += 10.0
            levels.append([level for level, _ in log.tick()])
    assert levels == [
        [logging.DEBUG],
        [logging.INFO, logging.DEBUG],
        [logging.INFO, logging.DEBUG],
        [logging.INFO, logging.DEBUG],
        [logging.DEBUG, logging.DEBUG],
    ]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines[0].startswith("Engine 0: Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 1.0 ")
    assert "Avg generation throughput: 3.0 tokens/s, Running: 1 reqs" in lines[1]
    assert "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs" in lines[2]


def test_a_stats_log_thread_logs_until_stopped() -> None:
    ticks = []

    def stats() -> dict[str, EngineStats]:
        ticks.append(1)
        return {"0": _stats()}

    log = StatsLog(stats, lambda: 0.0, interval_s=0.01)
    log.start()
    while len(ticks) < 3:
        time.sleep(0.005)
    log.stop()
    seen = len(ticks)
    assert log._thread is not None and not log._thread.is_alive()
    assert len(ticks) == seen


def test_a_request_line_shows_the_prompt_and_params_cut_to_max_log_len(tiny_llama: LoadedModel) -> None:
    tokenizer = tiny_llama.tokenizer
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    params = SamplingParams(max_tokens=7, temperature=0.5)
    line = request_line("cmpl-1", [ids], params, tokenizer, max_len=3)
    assert line.startswith(f"Received request cmpl-1: prompt: {tokenizer.decode(ids[:3])[:3]!r}, ")
    assert f"prompt_token_ids: {ids[:3]}, " in line
    assert "max_tokens=7" in line and "temperature=0.5" in line and line.endswith("lora_request: None.")
    whole = request_line("cmpl-2", [ids, ids[:2]], params, tokenizer)
    assert f"prompt_token_ids: {ids}; prompt: " in whole and f"prompt_token_ids: {ids[:2]}, params: " in whole
