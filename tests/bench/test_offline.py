"""``boundless bench offline`` end to end on a tiny random model: both systems, turns, medians."""

from __future__ import annotations

import gc
import json
import statistics
from pathlib import Path

import pytest

from boundless.bench.offline import CollectorTime
from boundless.cli import main


def test_bench_offline_reports_medians_of_alternating_runs(
    model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "offline.json"
    # In this process: the command line's parsing and dispatch are the same, without importing torch anew.
    assert main(
        [
            "bench", "offline", "--model", str(model_dirs["tiny-llama"]),
            "--num-prompts", "3", "--input-len", "9", "--output-len", "5", "--repeats", "3",
            "--kv-cache-gb", "0.05", "--json", str(out),
        ]
    ) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert result["repeats"] == 3 and len(result["runs"]) == 3
    figures = {f["system"]: f for f in result["figures"]}
    assert set(figures) == {"huggingface", "boundless"}
    for name, fig in figures.items():
        seconds = [run[name]["seconds"] for run in result["runs"]]
        assert fig["seconds"] == statistics.median(seconds) > 0
        assert fig["output_tokens"] == 3 * 5
        assert fig["output_tokens_per_s"] == fig["output_tokens"] / fig["seconds"]
    ratio = figures["boundless"]["output_tokens_per_s"] / figures["huggingface"]["output_tokens_per_s"]
    assert result["throughput_ratio"] == ratio
    assert len(result["throughput_ratio_per_run"]) == 3
    # Each Boundless run's engine steps and its slowest, where a first run's one-off cost would show.
    for run in result["runs"]:
        ours = run["boundless"]
        assert ours["steps"] >= 5 and 0 <= ours["slowest_step"] < ours["steps"]
        assert 0 < ours["slowest_step_s"] <= ours["seconds"]
        assert "steps" not in run["huggingface"]
        for figures in run.values():  # the collector's work in each system's timed run
            assert figures["gc_full_collections"] >= 0 and 0 <= figures["gc_s"] <= figures["seconds"]
    # Greedy on the same fp32 weights: the two systems agree token for token.
    assert result["identical_outputs"] == 3
    out = capsys.readouterr().out
    assert "throughput ratio per run" in out
    assert "boundless's runs: " in out and out.count("(collector ") == 6  # (each run's time, beside its collector's)


def test_the_collectors_work_in_a_run_is_counted() -> None:
    """A full collection (the oldest generation's) is counted as one, a young one only in the seconds."""
    with CollectorTime() as collector:
        gc.collect(0)
        assert collector.full_collections == 0 and collector.seconds > 0
        gc.collect()
        gc.collect()
    assert collector.full_collections == 2
    gc.collect()  # (after the block: not counted)
    assert collector.figures() == {"gc_full_collections": 2, "gc_s": collector.seconds}
