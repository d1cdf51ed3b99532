"""``boundless bench restart`` at tiny scale: real server processes on one store directory, stopped and started
again, on a tiny random model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from boundless.cli import build_parser
from boundless.config import engine_config_from_flags, to_flags


def test_engine_flags_round_trip_through_to_flags() -> None:
    parser = build_parser()
    argv = ["serve", "--model", "m", "--num-kv-blocks", "64", "--kv-host-gb", "0.01", "--no-enable-prefix-caching"]
    config = engine_config_from_flags(parser.parse_args(argv))
    flags = to_flags(config.model) + to_flags(config.cache) + to_flags(config.scheduler)
    assert sorted(flags) == sorted(argv[1:])  # only what differs from the defaults
    assert engine_config_from_flags(parser.parse_args(["serve", *flags])) == config


@pytest.mark.slow  # four Python processes (three servers) start one after another: 25-50 s here
@pytest.mark.parametrize("ranks", [1, 2])
def test_bench_restart_finds_the_first_servers_blocks_after_a_restart(
    ranks: int, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """On one device, and with the model split over two ranks (each rank's share of every block in its own files)."""
    out = tmp_path / "restart.json"
    cmd = [sys.executable, "-m", "boundless.cli", "bench", "restart", "--model", str(model_dirs["tiny-llama"])]
    cmd += ["--tensor-parallel-size", str(ranks)]
    cmd += ["--num-programs", "4", "--scale", "0.05", "--max-len", "64", "--num-kv-blocks", "64"]
    cmd += ["--kv-host-gb", "0.01", "--kv-disk-path", str(tmp_path / "stores"), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    phases = {p["name"]: p for p in result["phases"]}
    assert all(p["identical"] for p in phases.values())
    assert result["restart_vs_warm_hit_rate"] >= 0.9
    # The restarted server's hits came from the store; the cold one's only from its own memory.
    assert phases["restart"]["disk_hit_tokens"] > 0 and phases["cold"]["disk_hit_tokens"] == 0
    assert phases["restart"]["hit_rate"] > phases["cold"]["hit_rate"]
    assert "TTFT cold / after the restart" in done.stdout
    assert list((tmp_path / "stores").iterdir()) == []  # its directories removed (no --keep)
