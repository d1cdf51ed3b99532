"""Fast-forward: an instance's steps run back to back while nothing else is due give the same results as every
step through the event heap."""

from __future__ import annotations

import json
from pathlib import Path

from boundless.cli import main


def _both_ways(tmp_path: Path, *args: str) -> tuple[dict, dict]:
    """``boundless simulate`` with fast-forward and without it: each run's figures."""
    runs = []
    for name, flag in (("on", "--fast-forward"), ("off", "--no-fast-forward")):
        out = tmp_path / f"{name}.json"
        assert main(["simulate", *args, flag, "--no-progress", "--json", str(out)]) == 0
        runs.append(json.loads(out.read_text()))
    return runs[0], runs[1]


def test_one_instance_gives_the_same_rows_either_way(tmp_path: Path) -> None:
    on, off = _both_ways(
        tmp_path, "--policies", "fcfs,plas", "--rates", "0.5", "--num-programs", "12", "--num-kv-blocks", "300"
    )
    assert on["rows"] == off["rows"]
    assert on["speed"]["steps_fast_forwarded"] > on["speed"]["steps"] / 4  # it did skip the heap
    assert off["speed"]["steps_fast_forwarded"] == 0


def test_a_cluster_on_a_gpu_profile_gives_the_same_rows_either_way(tmp_path: Path) -> None:
    on, off = _both_ways(
        tmp_path,
        *("--instances", "3", "--profile", "h100", "--policies", "plas", "--rates", "3", "--num-programs", "18"),
        *("--num-kv-blocks", "300"),
    )
    assert on["rows"] == off["rows"]
    assert on["speed"]["steps_fast_forwarded"] > 0


def test_prefill_and_decode_roles_with_a_disk_store_give_the_same_rows_either_way(tmp_path: Path) -> None:
    on, off = _both_ways(
        tmp_path,
        *("--workload", "agent", "--policies", "fcfs", "--rates", "0", "--num-programs", "6", "--scale", "0.05"),
        *("--call-scale", "0.25", "--roles", "1:2", "--kv-paths", "basic,dualpath", "--profile", "h100"),
        *("--num-kv-blocks", "400", "--kv-host-gb", "0.5", "--kv-disk-path", "unused", "--kv-disk-gb", "1"),
    )
    assert on["rows"] == off["rows"]
    assert on["speed"]["steps_fast_forwarded"] > 0
