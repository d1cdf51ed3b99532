"""``boundless bench transport`` end to end on small messages (shared memory, with a real second process;
the other transports run the same code), and the choice of the default from the figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundless.bench.transport import choose_default, parse_size
from boundless.cli import main


def test_bench_transport_measures_each_transport_against_a_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "transport.json"
    args = ["bench", "transport", "--kinds", "shm,nosuch", "--sizes", "3K,1M", "--mb-per-size", "4",
            "--latency-iters", "5", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    figures = json.loads(out.read_text())
    assert figures["sizes"] == [3 << 10, 1 << 20]
    assert set(figures["transports"]) == {"shm"}
    assert "nosuch" in figures["skipped"]
    for by_size in figures["transports"].values():
        for f in by_size.values():
            assert f["latency_us"] > 0 and f["gbps"] > 0 and f["gbps_ratio"] > 0 and f["latency_ratio"] > 0
    assert figures["default"]["one_node"] == "shm"
    assert figures["default"]["across_nodes"] is None  # shared memory does not leave the node
    assert "default on one node" in capsys.readouterr().out


def test_the_default_is_the_best_bandwidth_on_large_messages() -> None:
    results = {
        "shm": {4096: {"gbps": 0.01}, 1 << 20: {"gbps": 1.5}, 16 << 20: {"gbps": 3.0}},
        "gloo": {4096: {"gbps": 0.5}, 1 << 20: {"gbps": 1.0}, 16 << 20: {"gbps": 1.5}},
    }
    assert choose_default(results, ("shm", "gloo")) == "shm"  # small messages do not count
    assert choose_default(results, ("gloo", "nixl")) == "gloo"
    assert choose_default(results, ("nixl",)) is None


def test_sizes_take_suffixes() -> None:
    assert [parse_size(s) for s in ("4K", "1M", "1.5M", "100")] == [4096, 1 << 20, 3 << 19, 100]


def test_repeated_runs_report_each_figures_median() -> None:
    from boundless.bench.transport import _medians

    runs = [{4096: {"gbps": g, "latency_us": lat}} for g, lat in [(1.0, 9.0), (3.0, 5.0), (2.0, 100.0)]]
    assert _medians(runs, [4096]) == {4096: {"gbps": 2.0, "latency_us": 9.0}}
