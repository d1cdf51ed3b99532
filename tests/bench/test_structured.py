"""``boundless bench structured`` end to end on a tiny random model: the served pause and both modes' figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundless.cli import main

pytest.importorskip("xgrammar")


def test_bench_structured_reports_the_pause_and_both_modes(
    model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "structured.json"
    assert main(
        [
            "bench", "structured", "--model", str(model_dirs["tiny-llama"]), "--num-conversations", "3",
            "--max-tokens", "12", "--rounds", "2", "--stream-tokens", "40", "--kv-cache-gb", "0.05",
            "--json", str(out),
        ]
    ) == 0  # fmt: skip
    result = json.loads(out.read_text())
    pause = result["pause"]
    assert pause["free_chunks"] > 11 and pause["median_gap_s"] > 0 and pause["structured_s"] > 0
    figures = {f["mode"]: f for f in result["figures"]}
    assert set(figures) == {"free", "json_schema"}
    assert figures["free"]["output_tokens"] == 3 * 12  # greedy, free: each conversation to its limit
    for fig in figures.values():
        assert fig["output_tokens_per_s"] == fig["output_tokens"] / fig["seconds"]
    ratio = figures["json_schema"]["output_tokens_per_s"] / figures["free"]["output_tokens_per_s"]
    assert result["throughput_ratio"] == ratio
    assert "json_schema / free throughput" in capsys.readouterr().out
