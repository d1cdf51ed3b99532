"""Agent program workloads and the program benchmark, on a tiny random model."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest

from boundless.bench.workloads import (
    MULTI_THREADED,
    WORKLOADS,
    PromptTokens,
    WorkloadShape,
    compaction,
    load_agent_sessions,
    make_programs,
)
from boundless.cli import main

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces" / "lmcache_agent_trace" / "miniswe"


@pytest.mark.parametrize("workload", [w for w in WORKLOADS if w != "trace"])
def test_workloads_are_seeded_and_shaped(workload: str) -> None:
    a = make_programs(workload, 20, rate=0.5, seed=3)
    b = make_programs(workload, 20, rate=0.5, seed=3)
    assert [(p.arrival_s, p.num_calls, p.output_tokens) for p in a] == [
        (p.arrival_s, p.num_calls, p.output_tokens) for p in b
    ]
    assert all(x.arrival_s < y.arrival_s for x, y in itertools.pairwise(a))
    assert any(p.num_calls > 3 * min(q.num_calls for q in a) for p in a)  # a long tail of program lengths
    assert all(p.multi_threaded for p in a) == (workload in MULTI_THREADED)
    for p in a:
        threads: set[str] = set()
        for stage in p.stages:
            for call in stage:  # every parent a call joins ran in an earlier stage
                assert all(parent in threads or parent == "main" for parent in call.parents)
            threads.update(c.thread_id for c in stage)


def test_chat_lengths_follow_sharegpt_scaled() -> None:
    programs = make_programs("chat", 400, rate=1.0, seed=0, shape=WorkloadShape(scale=0.1))
    calls = [c for p in programs for s in p.stages for c in s]
    mean_out = sum(c.output for c in calls) / len(calls)
    mean_calls = sum(p.num_calls for p in programs) / len(programs)
    assert 20 < mean_out < 36  # 277 x 0.1
    assert 5.0 < mean_calls < 8.0  # 6.66 calls per program


@pytest.mark.parametrize("vocab", [101, 102, 228, 356, 32000, 49152, 100 + 2**15, 128256])
def test_prompt_tokens_are_those_randrange_draws(vocab: int) -> None:
    # The draws are taken from the generator's words in batches; the tokens, and the generator after them, must be
    # what one randrange per token gives (the benchmark's and the simulator's prompts, run to run).
    tokens = PromptTokens(vocab, seed=3)
    for seed, n in itertools.product(range(12), [0, 1, 7, 64, 500]):
        ours, theirs = random.Random(f"{seed}:{n}"), random.Random(f"{seed}:{n}")
        assert tokens.draw(ours, n) == [theirs.randrange(100, vocab) for _ in range(n)]
        assert ours.random() == theirs.random()


def test_compaction_keeps_the_system_prompt_and_the_newest_half() -> None:
    assert compaction(100, 20, 100) is None  # fits
    assert compaction(101, 20, 100) == (20, 50)  # system prompt + the newest 30 tokens
    assert compaction(101, 60, 100) == (0, 50)  # a system prompt over half the room is not kept whole
    # Calls after a compaction extend its result: the next compaction is room/2 tokens away.
    _, total = compaction(500, 20, 100)
    assert compaction(total + 50, 20, 100) is None and compaction(total + 51, 20, 100) == (20, 50)
    assert compaction(101, 0, 100) == (0, 50)  # no system prompt left to keep


def test_agent_sessions_replay(tmp_path: Path) -> None:
    folder = TRACES if TRACES.exists() else tmp_path
    if not TRACES.exists():
        lines = [
            {"timestamp": 1_000_000 * i, "input": "x" * (400 * (i + 1)), "output": "y" * 80, "session_id": "s"}
            for i in range(5)
        ]
        (tmp_path / "s.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    sessions = load_agent_sessions(folder)
    assert sessions and all(len(s) >= 1 for s in sessions)
    programs = make_programs("trace", 3, rate=1.0, seed=0, trace_folder=folder)
    assert [p.num_calls for p in programs] == [min(len(sessions[i % len(sessions)]), 40) for i in range(3)]


def test_bench_programs_compares_policies(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "programs.json"
    # In this process: the command line's parsing and dispatch are the same, without importing torch anew.
    code = main(
        [
            "bench",
            "programs",
            "--model",
            str(model_dirs["tiny-llama"]),
            "--workload",
            "mapreduce",
            "--num-programs",
            "3",
            "--rate",
            "4",
            "--scale",
            "0.03",
            "--policies",
            "fcfs,atlas",
            "--max-num-seqs",
            "2",
            "--kv-cache-gb",
            "0.05",
            "--json",
            str(out),
            "--sweep",
            "--rates",
            "4",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["policy"] for r in result["rows"]] == ["fcfs", "atlas"]
    assert result["valid"] and result["invalid_reason"] is None
    for row in result["rows"]:
        assert row["programs"] == 3 and row["failed_calls"] == 0 and row["avg_latency_s"] > 0
    assert (tmp_path / "programs-mapreduce.csv").exists() and (tmp_path / "programs-mapreduce.png").exists()


def test_bench_programs_shows_failed_calls_and_marks_the_run_invalid(
    model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A 64-token context: of the three chat calls of seed 0 (36, 23 and 205 output tokens), the
    # third asks for more tokens than fit, and the server refuses it at once.
    out = tmp_path / "programs.json"
    code = main(
        [
            "bench",
            "programs",
            "--model",
            str(model_dirs["tiny-llama"]),
            "--workload",
            "chat",
            "--num-programs",
            "3",
            "--rate",
            "4",
            "--scale",
            "0.3",
            "--tool-wait",
            "0",
            "--policies",
            "fcfs",
            "--max-model-len",
            "64",
            "--kv-cache-gb",
            "0.05",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert (row["failed_calls"], row["calls"]) == (1, 3)
    assert "maximum context length" in row["first_error"]
    assert not result["valid"] and "fcfs at 4.0/s: 1 of 3" in result["invalid_reason"]
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("rate/s"))
    columns = dict(zip(re.split(r"\s{2,}", lines[at]), re.split(r"\s{2,}", lines[at + 2]), strict=True))
    assert columns["failed"] == "1/3"
    assert lines[at + 3].startswith("INVALID")


@pytest.mark.slow  # (6 s; the policies' comparison above stays in the fast suite)
def test_bench_programs_compares_kv_setups(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from boundless.bench import programs
    from boundless.cli import build_parser

    stores = tmp_path / "stores"
    args = build_parser().parse_args(
        [
            "bench", "programs", "--model", str(model_dirs["tiny-llama"]),
            "--workload", "chat", "--num-programs", "2", "--rate", "4", "--scale", "0.05", "--tool-wait", "0.02",
            "--call-scale", "0.5", "--policies", "plas", "--kv-configs", "device-lru,tiers-lru,tiers-program",
            "--num-kv-blocks", "24", "--max-model-len", "384", "--kv-host-gb", "0.01", "--kv-disk-path", str(stores),
            "--max-num-seqs", "2",
        ]
    )  # fmt: skip
    result = programs.run(args)
    rows = result["rows"]
    assert [r["kv"] for r in rows] == ["device-lru", "tiers-lru", "tiers-program"] and result["valid"]
    assert rows[0]["hit_rate_host"] == rows[0]["hit_rate_disk"] == 0.0  # the device alone keeps nothing below
    assert rows[0]["disk_bytes_written"] == 0 and rows[1]["disk_bytes_written"] > 0  # write-through to the store
    for row in rows:
        assert row["policy"] == "plas" and row["failed_calls"] == 0
        tiers = row["hit_rate_device"] + row["hit_rate_host"] + row["hit_rate_disk"]
        assert tiers == pytest.approx(row["prefix_cache_hit_rate"]) and tiers > 0
    assert rows[0]["avg_latency_vs_baseline"] == 1.0
    assert stores.is_dir() and not any(stores.iterdir())  # each run's store was fresh, and is gone


def test_routings_are_compared_with_round_robin_else_the_first_listed() -> None:
    """Each routing row's ratio is against the baseline routing of its own policy."""
    from boundless.bench.programs import _is_baseline

    rows = [{"policy": p, "routing": r, "kv": ""} for p in ("fcfs", "plas") for r in ("locality", "least-loaded")]

    def baseline_of(row: dict, routings: list[str | None]) -> dict:
        (ref,) = [r for r in rows if _is_baseline(r, row, ["fcfs", "plas"], routings, [None])]
        return ref

    assert baseline_of(rows[3], ["locality", "least-loaded"]) == rows[2]  # plas/locality
    assert baseline_of(rows[1], ["least-loaded", "locality"]) == rows[1]
    rows.append({"policy": "plas", "routing": "round-robin", "kv": ""})
    assert baseline_of(rows[2], ["locality", "least-loaded", "round-robin"]) == rows[4]
