"""``boundless bench frontend`` at tiny scale: the engine loop alone, the async engine and a real server process on
every route and mode, on a tiny random model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from boundless.bench.frontend import async_engine_run, completion_tokens, engine_loop_run, summarize
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.model.loader import LoadedModel


def test_the_engine_rows_count_every_token_and_compare_with_the_engine_loop(tiny_llama: LoadedModel) -> None:
    config = EngineConfig(
        model=ModelConfig(max_model_len=64), cache=CacheConfig(num_kv_blocks=32), scheduler=SchedulerConfig()
    )
    engine = AsyncEngine(EngineCore.from_model(tiny_llama, config))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    try:
        rows = [
            engine_loop_run(engine, prompts, 6, True, "a"),
            engine_loop_run(engine, prompts, 6, False, "b"),
            async_engine_run(engine, prompts, 6, "c"),
        ]
    finally:
        engine.shutdown()
    assert [(r.system, r.stream, r.output_tokens) for r in rows] == [
        ("engine loop", True, 18),
        ("engine loop", False, 18),
        ("async engine", True, 18),
    ]
    summary = {(s["system"], s["stream"]): s for s in summarize(rows)}
    assert summary[("engine loop", True)]["vs_engine_loop"] == 1.0
    ratio = rows[2].tokens_per_s / rows[0].tokens_per_s
    assert summary[("async engine", True)]["vs_engine_loop"] == pytest.approx(ratio)


@pytest.mark.slow  # (a model loaded in two processes, one a server: 30 s here)
def test_bench_frontend_reports_each_route_and_mode_against_the_engine_loop(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "frontend.json"
    cmd = [sys.executable, "-m", "boundless.cli", "bench", "frontend", "--model", str(model_dirs["tiny-llama"])]
    cmd += ["--num-requests", "3", "--input-len", "4", "--output-len", "5", "--rounds", "1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {(s["system"], s["route"], s["stream"]) for s in result["summary"]} == {
        ("engine loop", "-", True),
        ("engine loop", "-", False),
        ("async engine", "-", True),
        *{("server", route, stream) for route in ("completions", "chat/completions") for stream in (True, False)},
    }
    for s in result["summary"]:
        assert s["output_tokens_per_s"] > 0 and s["vs_engine_loop"] > 0 and s["rounds"] == 1
        # The server's event loop is its main thread, timed from /proc on Linux.
        assert (s["event_loop_us_per_token"] is not None) == (s["system"] == "server" and sys.platform == "linux")
    assert all(row["output_tokens"] == 3 * 5 for row in result["rows"])  # every request ran to its max_tokens
    assert "vs engine loop" in done.stdout


def test_a_streams_tokens_are_read_from_its_last_usage() -> None:
    events = [
        b'data: {"choices": [{"text": "a"}], "usage": null}',
        b'data: {"choices": [], "usage": {"completion_tokens": 7}}',
        b"data: [DONE]",
    ]
    assert completion_tokens(b"\n\n".join(events) + b"\n\n", stream=True) == 7
    assert completion_tokens(b'{"usage": {"completion_tokens": 3}}', stream=False) == 3
