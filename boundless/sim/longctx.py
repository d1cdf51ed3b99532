"""``boundless simulate --workload longctx``: Infinite-LLM's experiment, separate instances against KV lending.

The trace is ``bench longctx``'s (``bench/longctx_trace.py``: many short requests and a few whose prompts are
multiples of one instance's KV pool, Poisson arrivals), each request a one-call program. Each ``--kv-modes``
entry serves the very same trace on ``--instances`` simulated engines behind the real dispatcher and router:

- ``separate``: independent instances; a request whose context exceeds one instance's pool (its
  ``max_model_len``) is refused at admission, as ``boundless serve`` refuses it;
- ``lending``: the real agents, rManagers and gManager in virtual time (``sim/lending.py``), and a request may
  hold the cluster's memory.

Prompts go as they are (no compaction). A row: requests served, refused and left unserved (the run ended
with them stalled), the longest context served, tokens per second (prompt and output of the served requests over
the span from the first arrival to the last finish), the served requests' latency, the same for the short
requests alone (their span ends with the last short one), each long request's latency, and what lending moved;
with ``--fail``, when each instance was lost and restarted.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence

from boundless.bench.longctx_trace import TraceRequest, TraceShape, make_trace
from boundless.bench.report import plot_sweep, print_table, write_json
from boundless.bench.serve import percentile
from boundless.bench.workloads import SHARED_SYSTEM_PROMPT, CallSpec, ProgramSpec
from boundless.config import ClusterConfig, EngineConfig, comma_numbers, positive_int
from boundless.engine.builder import size_engine
from boundless.sim.cost import StepCost
from boundless.sim.engine import SimulatedModel
from boundless.sim.failures import InstanceFailure
from boundless.sim.profiles import HardwareProfile
from boundless.sim.progress import VirtualTimeBar
from boundless.sim.simulator import SimResult, Simulator

KV_MODES = ("separate", "lending")


def trace_programs(trace: list[TraceRequest]) -> list[ProgramSpec]:
    """Each request a program of one call with the request's prompt length (the shared system prompt every
    simulated program starts with counts in it) and output."""
    return [
        ProgramSpec(
            r.request_id,
            r.arrival_s,
            0,
            [[CallSpec("main", (), max(1, len(r.prompt) - SHARED_SYSTEM_PROMPT), r.max_tokens)]],
        )
        for r in trace
    ]


def pool_tokens(config: EngineConfig, model: SimulatedModel) -> int:
    """One instance's KV pool, in tokens, as the engine sizes it."""
    layout = size_engine(config, model.arch, model.dtype)
    return layout.num_blocks * layout.block_size


def trace_shape_from_flags(args: argparse.Namespace) -> TraceShape:
    """The trace's lengths from the flags (SystemExit naming the flag: a bad one was a traceback, or a run of
    meaningless requests, such as long ones of a negative factor cut to one token)."""
    return TraceShape(
        num_short=args.num_programs,
        short_prompt=_length_range("--short-prompt", args.short_prompt),
        short_output=_length_range("--short-output", args.short_output),
        long_factors=tuple(comma_numbers("--long-factors", args.long_factors, float, positive=True)),
        long_output=args.long_output,
    )


def _length_range(flag: str, text: str) -> tuple[int, int]:
    """``min,max`` token lengths, each at least 1, the first not above the second."""
    lengths = comma_numbers(flag, text, int, positive=True)
    if len(lengths) != 2 or lengths[0] > lengths[1]:
        raise SystemExit(f"{flag}: min,max (two lengths, the first not above the second), not {text!r}")
    return lengths[0], lengths[1]


def kv_modes_from_flags(args: argparse.Namespace) -> list[str]:
    """``--kv-modes``: one or more of separate, lending."""
    modes = [m.strip() for m in args.kv_modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in KV_MODES]:
        raise SystemExit(f"--kv-modes: unknown {', '.join(unknown)} (separate, lending)")
    if not modes:  # (no row would run: an empty table)
        raise SystemExit(f"--kv-modes: no mode in {args.kv_modes!r} (separate, lending)")
    return modes


def mode_cluster(cluster: ClusterConfig, mode: str) -> ClusterConfig:
    return dataclasses.replace(cluster, kv_lending="on" if mode == "lending" else "off")


def longctx_row(sim: Simulator, results: list[SimResult], programs: list[ProgramSpec], rate: float, mode: str) -> dict:
    """One mode's figures on the trace (see the module)."""
    context = {p.program_id: 0 for p in programs}
    for placement in sim.placements:
        context[placement.program_id] = placement.num_prompt_tokens
    wanted = {p.program_id: p.output_tokens for p in programs}
    served = [r for r in results if r.finished and r.failed_calls == 0]
    refused = [r for r in results if r.failed_calls]
    first = min(r.arrival_s for r in results)
    span = max((r.finish_s for r in served), default=first) - first
    tokens = sum(context[r.program_id] + r.output_tokens for r in served)
    lat = [r.latency_s for r in served] or [0.0]
    shorts = [r for r in served if not r.program_id.startswith("long")]
    short_lat = [r.latency_s for r in shorts] or [0.0]
    short_span = max((r.finish_s for r in shorts), default=first) - first
    longest = max((context[r.program_id] + wanted[r.program_id] for r in served), default=0)
    row = {
        "rate": rate,
        "mode": mode,
        "gpus": len(sim.instances),
        "requests": len(results),
        "served": len(served),
        "refused": len(refused),
        "unserved": len(results) - len(served) - len(refused),
        "longest_served": longest,
        "span_s": span,
        "tokens_per_s": tokens / max(span, 1e-9),
        "output_tokens_per_s": sum(r.output_tokens for r in served) / max(span, 1e-9),
        "requests_per_s": len(served) / max(span, 1e-9),
        "avg_latency_s": statistics.fmean(lat),
        "p95_latency_s": percentile(lat, 0.95),
        "short_tokens_per_s": sum(context[r.program_id] + r.output_tokens for r in shorts) / max(short_span, 1e-9),
        "short_avg_latency_s": statistics.fmean(short_lat),
        "short_p95_latency_s": percentile(short_lat, 0.95),
        "short_max_latency_s": max(short_lat),
        "long_latency_s": {r.program_id: r.latency_s for r in served if r.program_id.startswith("long")},
        "preemptions": sum(i.core.stats().num_preemptions for i in sim.instances.values()),
        "simulated_s": sim.clock.now,
        "steps": sim.num_steps,
        "lending_stalled_at_s": sim.lending_stalled_at,  # None: lending never stalled with requests unserved
    }
    if sim.failures:
        row["instances_lost"] = dict(sim.lost)  # instance -> when the dispatcher was told
        row["instances_restarted"] = dict(sim.restarted)
    if sim.lending is not None:
        row["lending"] = sim.lending.totals()
    return row


def print_longctx_rows(rows: list[dict], pool: int) -> None:
    table = []
    for row in rows:
        ref = next((r for r in rows if r["rate"] == row["rate"] and r["mode"] == "separate"), None)
        lending = row.get("lending", {})
        table.append(
            [
                row["rate"],
                row["mode"],
                row["served"],
                row["refused"],
                row["unserved"],
                f"{row['longest_served']:,} ({row['longest_served'] / pool:.2f}x)",
                f"{row['span_s']:.1f}",
                f"{row['tokens_per_s']:,.0f}",
                f"{row['requests_per_s']:.2f}",
                f"{row['avg_latency_s']:.2f}",
                f"{row['short_tokens_per_s']:,.0f}",
                f"{row['short_avg_latency_s']:.2f}",
                f"{row['short_p95_latency_s']:.2f}",
                f"{row['short_max_latency_s']:.1f}",
                " ".join(f"{v:.0f}" for v in row["long_latency_s"].values()) or "-",
                lending.get("moves", 0),
                f"{lending.get('bytes_moved', 0) / 1e9:.1f}",
                f"{row['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref and ref["tokens_per_s"] else "-",
            ]
        )
    header = ["rate/s", "mode", "served", "refused", "unserved", "longest served (x pool)", "span s", "tok/s"]
    header += [
        "req/s",
        "avg s",
        "short tok/s",
        "short avg s",
        "short p95 s",
        "short max s",
        "long requests' s",
        "moves",
        "GB moved",
    ]
    header += ["tok/s vs separate"]
    print_table(header, table)


def write_longctx_plot(path: str, rows: list[dict], title: str) -> None:
    metrics = (
        ("short_tokens_per_s", "short requests: tokens per second"),
        ("short_p95_latency_s", "short requests: p95 latency (s)"),
        ("longest_served", "longest context served (tokens)"),
    )
    done = plot_sweep(path, rows, title, metrics, x=("rate", "request arrival rate (requests/s)"), series="mode")
    print(f"wrote {path}" if done else "matplotlib is not installed; no plot")


def add_longctx_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--workload longctx (Infinite-LLM: separate instances against KV lending)")
    group.add_argument("--kv-modes", default="separate,lending", help="comma-separated: separate, lending")
    group.add_argument("--short-prompt", default="32,192", help="short requests' prompt lengths: min,max")
    group.add_argument("--short-output", default="8,32", help="short requests' output lengths: min,max")
    group.add_argument(
        "--long-factors", default="0.75,1.5,2.5", help="long prompts as multiples of one instance's KV pool"
    )
    group.add_argument("--long-output", type=positive_int, default=16, help="tokens each long request generates")


def run_longctx(
    args: argparse.Namespace,
    base: EngineConfig,
    model: SimulatedModel,
    profile: HardwareProfile | None,
    cost: StepCost | None,
    cluster: ClusterConfig,
    failures: Sequence[InstanceFailure] = (),
) -> dict:
    """Every rate of ``--rates`` and mode of ``--kv-modes`` on the trace (see the module), with ``failures`` in each
    run (``--fail``); the JSON's data. No host
    tier, as ``bench longctx`` runs it: a request that loses its blocks is recomputed (a swapped-out request's
    swap-in counts its lent blocks as local ones, so with lending it could never come back). Separate instances
    admit one pool (``--max-model-len``, else the pool, whatever the simulated model's position limit)."""
    # The flags first: a bad one stops the command before any engine is sized.
    shape, modes = trace_shape_from_flags(args), kv_modes_from_flags(args)
    rates = comma_numbers("--rates", args.rates, float)  # requests a second (0: all arrive at once)
    base = dataclasses.replace(base, cache=dataclasses.replace(base.cache, kv_host_gb=0.0))
    pool = pool_tokens(base, model)
    if base.model.max_model_len is None:  # one pool, not the simulated model's position limit (lending ignores it)
        model_config = dataclasses.replace(base.model, max_model_len=pool, allow_long_max_model_len=True)
        base = dataclasses.replace(base, model=model_config)
    rows, walls = [], []
    for rate in rates:
        trace = make_trace(shape, pool, model.identity.vocab_size, rate, args.bench_seed)
        programs = trace_programs(trace)
        for mode in modes:
            sim = Simulator(
                base,
                model,
                cost,
                instances=cluster.instances,
                cluster=mode_cluster(cluster, mode),
                profile=profile,
                compact_prompts=False,
                failures=failures,
                instance_startup_s=args.instance_startup_s,
            )
            bar = VirtualTimeBar(programs[-1].arrival_s if programs else 0.0, f"{mode} @ {rate}/s", args.progress)
            start = time.perf_counter()
            results = sim.run(programs, bar)
            walls.append(time.perf_counter() - start)
            bar.close()
            rows.append(longctx_row(sim, results, programs, rate, mode))
    print(f"one instance's KV pool: {pool:,} tokens; {cluster.instances} instances")
    print_longctx_rows(rows, pool)
    simulated, wall, steps = sum(r["simulated_s"] for r in rows), sum(walls), sum(r["steps"] for r in rows)
    print(
        f"simulated {simulated:.0f} s in {wall:.1f} s wall: {simulated / max(wall, 1e-9):.1f} simulated s per wall s,"
        f" {steps / max(wall, 1e-9):.0f} engine steps per wall s"
    )
    for row in rows:
        if row["lending_stalled_at_s"] is not None:
            print(
                f"{row['mode']} @ {row['rate']}/s: KV lending stalled at {row['lending_stalled_at_s']:.0f} s with"
                f" {row['unserved']} requests unserved (requests over one pool waiting for each other's room;"
                " docs/lending.md)"
            )
    result = {
        "workload": "longctx",
        "instances": cluster.instances,
        "profile": profile.name if profile else None,
        "pool_tokens": pool,
        "trace": dataclasses.asdict(shape),
        "rows": rows,
        "virtual_time": True,
        "speed": {"wall_s": wall, "simulated_s": simulated, "steps": steps, "row_wall_s": walls},
    }
    if args.json:
        write_json(args.json, result)
    if args.plot:
        hardware = profile.name if profile else "linear model"
        title = f"longctx: {cluster.instances} x {hardware}, {len(programs)} requests, pool {pool:,} tokens"
        write_longctx_plot(args.plot, rows, title)
    return result
