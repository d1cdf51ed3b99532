"""``boundless simulate``: policies side by side on a workload, in virtual time.

The engine flags (model, KV cache, scheduler) and their defaults are ``boundless bench programs``'s:
the simulated engine is sized from them exactly as the real one is.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from tqdm import tqdm

from boundless.bench.report import output_path, plot_sweep, print_table, write_json
from boundless.bench.serve import percentile
from boundless.bench.workloads import WORKLOADS, ProgramSpec, WorkloadShape, agent_sessions, make_programs
from boundless.cluster.pd_dispatcher import PDDispatcher
from boundless.config import (
    CacheConfig,
    ClusterConfig,
    EngineConfig,
    ModelConfig,
    add_flags,
    comma_numbers,
    engine_config_from_flags,
)
from boundless.sim.cost import CostModel
from boundless.sim.engine import SimulatedModel
from boundless.sim.failures import InstanceFailure, check_failures, parse_failures
from boundless.sim.longctx import add_longctx_arguments, run_longctx
from boundless.sim.parallel import DEFAULT_SYNC_INTERVAL_S, WindowedSimulator
from boundless.sim.profiles import HardwareProfile, profile_from_flag, profile_names
from boundless.sim.progress import VirtualTimeBar
from boundless.sim.simulator import DEFAULT_INSTANCE_STARTUP_S, SimResult, Simulator


@dataclass(frozen=True)
class RowJob:
    """One row of a sweep: a rate, a cluster and a policy. Rows share nothing: each is a run of its own."""

    rate: float
    cluster: ClusterConfig
    policy: str


@dataclass(frozen=True)
class RowRun:
    """A row's figures (a function of the flags alone) and what its run took."""

    row: dict
    wall_s: float
    cpu_s: float
    steps_alone: int  # steps fast-forwarded
    steps_scheduled: int  # fewer than the steps with multi-step windows
    worker_cpu_s: list[float] = dataclasses.field(default_factory=list)  # each worker process's (in cpu_s too)


@dataclass(frozen=True)
class RowContext:
    """What every row of a sweep shares, made once from the flags (the model's metadata takes ~0.4 s to read)."""

    base: EngineConfig
    model: SimulatedModel
    profile: HardwareProfile | None
    cost: CostModel | None
    failures: list[InstanceFailure]


def row_jobs(args: argparse.Namespace, clusters: list[ClusterConfig]) -> list[RowJob]:
    policies = [p.strip() for p in args.policies.split(",")]
    if not all(policies):
        raise SystemExit(f"--policies: {args.policies!r} names an empty policy (comma-separated, e.g. fcfs,plas)")
    rates = comma_numbers("--rates", args.rates, float)  # programs a second (0: all arrive at once)
    return [RowJob(rate, c, policy) for rate in rates for c in clusters for policy in policies]


def check_workload_flags(args: argparse.Namespace) -> None:
    """The workload's flags: counts and sizes positive, waits not negative (each ran a meaningless sweep, or failed
    with a traceback)."""
    positive = {"--num-programs": args.num_programs, "--scale": args.scale, "--call-scale": args.call_scale}
    positive |= {"--max-calls": args.max_calls, "--max-len": args.max_len}
    for flag, value in positive.items():
        if not (value > 0 and math.isfinite(value)):  # (inf overflowed or divided by zero later: a traceback)
            raise SystemExit(f"{flag}: must be positive and finite, not {value}")
    not_negative = {"--tool-wait": args.tool_wait, "--instances-per-node": args.instances_per_node}
    not_negative |= {"--step-base-s": args.step_base_s, "--step-per-token-s": args.step_per_token_s}
    not_negative |= {"--step-per-seq-s": args.step_per_seq_s}
    for flag, value in not_negative.items():
        if not (value >= 0 and math.isfinite(value)):
            raise SystemExit(f"{flag}: must not be negative or infinite, not {value}")


def run_row(args: argparse.Namespace, context: RowContext, job: RowJob, progress: bool) -> RowRun:
    """Simulate one row of the sweep the flags ask for."""
    cluster = job.cluster
    # With several cluster sizes the load grows with the cluster: --num-programs per prefill engine.
    count = args.num_programs * (cluster.roles[0] if args.roles else 1)
    programs = workload_programs(args.workload, count, job.rate, args.bench_seed, workload_shape(args))
    base = context.base
    config = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, policy=job.policy))
    sim: Simulator
    if windowed(args):  # the engines in windows of virtual time, in --workers processes (sim/parallel.py)
        sim = WindowedSimulator(
            config,
            context.model,
            context.cost,
            instances=cluster.instances,
            cluster=cluster,
            profile=context.profile,
            fast_forward=args.fast_forward,
            sync_interval_s=sync_interval_s(args),
            workers=args.workers,
            pipeline=args.pipeline,
        )
    else:
        sim = Simulator(
            config,
            context.model,
            context.cost,
            instances=cluster.instances,
            cluster=cluster,
            profile=context.profile,
            instances_per_node=args.instances_per_node,
            fast_forward=args.fast_forward,
            failures=context.failures,
            instance_startup_s=args.instance_startup_s,
        )
    label = f"{job.policy}{'/' + cluster.kv_path if cluster.disaggregated else ''} @ {job.rate}/s"
    bar = VirtualTimeBar(programs[-1].arrival_s if programs else 0.0, label, progress)
    start, cpu_start = time.perf_counter(), time.process_time()
    results = sim.run(programs, bar)
    wall_s, main_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    workers_cpu_s = sim.helper_cpu_s()
    bar.close()
    row = result_row(sim, results, job.rate, job.policy, cluster)
    return RowRun(row, wall_s, main_cpu_s + sum(workers_cpu_s), sim.num_steps_alone, sim.num_scheduled, workers_cpu_s)


def run_rows(args: argparse.Namespace, context: RowContext, jobs: list[RowJob]) -> tuple[list[RowRun], float]:
    """Every row, in order, and the sweep's wall seconds: one after another, or with ``--jobs N`` in N processes
    (the rows are the same: each is a function of the flags)."""
    workers = min(args.jobs, len(jobs))
    if workers <= 1:
        runs = [run_row(args, context, job, args.progress) for job in jobs]
        return runs, sum(r.wall_s for r in runs)
    start = time.perf_counter()
    flags = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})  # (the command's function)
    # Forked: the workers start without importing anything again; a row's bar would interleave, so one bar of rows.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = [pool.submit(run_row, flags, context, job, False) for job in jobs]
        done = tqdm(total=len(jobs), desc=f"rows ({workers} processes)", unit="row", disable=not args.progress)
        for _ in as_completed(futures):
            done.update()
        done.close()
        runs = [f.result() for f in futures]
    return runs, time.perf_counter() - start


def windowed(args: argparse.Namespace) -> bool:
    """Whether the run is windowed (``sim/parallel.py``): ``--sync-interval-s``, or ``--workers`` above 1."""
    return args.sync_interval_s is not None or args.workers > 1


def sync_interval_s(args: argparse.Namespace) -> float:
    return DEFAULT_SYNC_INTERVAL_S if args.sync_interval_s is None else args.sync_interval_s


def check_windowed_flags(
    args: argparse.Namespace, clusters: list[ClusterConfig], profile: HardwareProfile | None
) -> None:
    """A windowed run is a plain cluster's: refuse (one line) what it does not simulate."""
    if args.workers < 1:
        raise SystemExit(f"--workers: at least 1 process, not {args.workers}")
    if not windowed(args):
        return
    interval = sync_interval_s(args)
    if not (math.isfinite(interval) and interval > 0):
        raise SystemExit(f"--sync-interval-s: a positive number of virtual seconds, not {interval}")
    refused = {
        "--roles/--prefill-instances/--decode-instances": any(c.disaggregated for c in clusters),
        "--kv-lending on": any(c.kv_lending == "on" for c in clusters),
        "--fail": bool(args.fail),
        "--instances-per-node": args.instances_per_node > 0,
        "--workload longctx": args.workload == "longctx",
        "--jobs": args.jobs > 1,
        "a contended profile": bool(profile and getattr(profile.step, "contended", False)),
    }
    for flag, given in refused.items():
        if given:
            raise SystemExit(
                f"--sync-interval-s/--workers: a windowed run simulates plain instances that share nothing, not {flag}"
            )
    if args.workers > clusters[0].instances:
        raise SystemExit(f"--workers: at most one per instance ({clusters[0].instances}), not {args.workers}")


def linear_cost(args: argparse.Namespace, profile: HardwareProfile | None) -> CostModel | None:
    """The ``--step-*`` linear model, which prices steps when no ``--profile`` does."""
    return None if profile else CostModel(args.step_base_s, args.step_per_token_s, args.step_per_seq_s)


def workload_shape(args: argparse.Namespace) -> WorkloadShape:
    return WorkloadShape(
        scale=args.scale,
        call_scale=args.call_scale,
        tool_wait_s=args.tool_wait,
        max_calls=args.max_calls,
        max_len=args.max_len,
    )


def run(args: argparse.Namespace) -> dict:
    if args.jobs < 1:
        raise SystemExit(f"--jobs: at least 1 process, not {args.jobs}")
    if args.workload == "longctx" and args.jobs > 1:
        raise SystemExit("--jobs: the longctx workload runs its rows in one process")
    check_workload_flags(args)
    base = engine_config_from_flags(args)
    profile = profile_from_flag("--profile", args.profile) if args.profile else None
    clusters = cluster_configs_from_flags(args)
    failures = failures_from_flags(args, clusters)
    check_windowed_flags(args, clusters, profile)
    context = RowContext(base, SimulatedModel.read(base.model), profile, linear_cost(args, profile), failures)
    if args.workload == "longctx":  # Infinite-LLM's experiment: its own rows (sim/longctx.py)
        return run_longctx(args, base, context.model, profile, context.cost, clusters[0], failures)
    runs, wall = run_rows(args, context, row_jobs(args, clusters))
    rows = [r.row for r in runs]
    walls = [r.wall_s for r in runs]  # apart from the rows, which are a function of the flags alone
    cpus = [r.cpu_s for r in runs]  # the same runs' CPU seconds (steadier than wall time on a shared machine)
    alone = sum(r.steps_alone for r in runs)
    scheduled = sum(r.steps_scheduled for r in runs)
    print_rows(rows)
    simulated, steps = sum(r["simulated_s"] for r in rows), sum(r["steps"] for r in rows)
    instances = ", ".join(dict.fromkeys(str(r["instances"]) for r in rows))
    gpus = (
        f" ({', '.join(dict.fromkeys(str(r['gpus']) for r in rows))} GPUs)"
        if base.model.tensor_parallel_size > 1
        else ""
    )
    cpu = sum(cpus)
    processes = f" ({args.workers} processes: main and {args.workers - 1} forked)" if args.workers > 1 else ""
    print(
        f"simulated {simulated:.0f} s of {instances} instance(s){gpus} in {wall:.1f} s wall, {cpu:.1f} s CPU"
        f"{processes}:"
        f" {simulated / max(wall, 1e-9):.1f} simulated s per wall s,"
        f" {steps / max(wall, 1e-9):.0f} engine steps per wall s"
        + (f" ({scheduled} of {steps} steps scheduled)" if scheduled < steps else "")
    )
    failed = sum(row["failed_calls"] for row in rows)
    if failures:
        for row in rows:
            lost = ", ".join(f"{iid} at {t:g} s" for iid, t in row["instances_lost"].items())
            back = ", ".join(
                f"{iid} at {t:g} s ({row['calls_after_restart'][iid]} calls placed on it since)"
                for iid, t in row["instances_restarted"].items()
            )
            print(
                f"{row['policy']} @ {row['rate']}/s{' ' + row['roles'] if row['roles'] else ''}: lost {lost or 'none'};"
                f" {row['failovers']} calls failed over, {row['failed_calls']} failed;"
                f" {row['programs_finished']} of {row['programs']} programs finished"
                + (f"; restarted {back}" if back else "")
            )
    elif failed:  # a refused call takes no time: the latencies above would flatter the run
        print(f"{failed} calls were refused by the engine (too long for --max-model-len): these figures are invalid")
    if not failures:
        for line in unfinished_lines(rows):
            print(line)
    result = {
        "workload": args.workload,
        "num_programs": args.num_programs,
        "instances": clusters[0].instances,
        "profile": profile.name if profile else None,
        "rows": rows,
        "virtual_time": True,
        "speed": {
            "wall_s": wall,
            "simulated_s": simulated,
            "steps": steps,
            "steps_fast_forwarded": alone,
            "steps_scheduled": scheduled,
            "simulated_s_per_wall_s": simulated / max(wall, 1e-9),
            "row_wall_s": walls,
            "cpu_s": cpu,  # every process's (main's and the workers')
            "row_cpu_s": cpus,
            "row_worker_cpu_s": [r.worker_cpu_s for r in runs],  # each worker process's CPU seconds, by row
        },
        "workers": args.workers,
        "sync_interval_s": sync_interval_s(args) if windowed(args) else None,  # None: the serial simulator
        "pipeline": windowed(args) and args.pipeline,
    }
    if args.json:
        write_json(args.json, result)
    if args.plot:
        write_plot(args.plot, rows, args, profile.name if profile else "linear model")
    return result


def failures_from_flags(args: argparse.Namespace, clusters: list[ClusterConfig]) -> list[InstanceFailure]:
    """``--fail``'s instance failures, checked against every cluster of the run, and ``--instance-startup-s``
    (SystemExit with what is wrong)."""
    if not (math.isfinite(args.instance_startup_s) and args.instance_startup_s >= 0):
        raise SystemExit(f"--instance-startup-s: a number of seconds, not negative (got {args.instance_startup_s})")
    if not args.fail:
        return []
    try:
        failures = parse_failures(args.fail)
        for cluster in clusters:
            check_failures(failures, cluster)
    except ValueError as e:
        raise SystemExit(f"--fail: {e}") from None
    return failures


def workload_programs(workload: str, count: int, rate: float, seed: int, shape: WorkloadShape) -> list[ProgramSpec]:
    """The programs of a run: the benchmark's workloads, or DualPath's agent sessions (``agent``)."""
    if workload == "agent":
        return agent_sessions(count, rate, seed, shape)
    return make_programs(workload, count, rate, seed, shape)


def result_row(sim: Simulator, results: list[SimResult], rate: float, policy: str, cluster: ClusterConfig) -> dict:
    """One run's figures: program latencies, the job's completion time (first arrival to last finish) and the
    engines' counters; with roles, the calls placed per read path."""
    lat = [r.latency_s for r in results]
    jct = max(r.finish_s for r in results) - min(r.arrival_s for r in results)
    tokens = sum(r.output_tokens for r in results)
    row = {
        "rate": rate,
        "policy": policy,
        "roles": f"{cluster.roles[0]}P{cluster.roles[1]}D" if cluster.disaggregated else "",
        "kv_path": cluster.kv_path if cluster.disaggregated else "",
        "gpus": len(sim.instance_ids) * sim.gpus_per_instance,
        "instances": len(sim.instance_ids),
        "avg_latency_s": statistics.fmean(lat),
        "p95_latency_s": percentile(lat, 0.95),
        "p99_latency_s": percentile(lat, 0.99),
        "avg_latency_per_token_s": statistics.fmean(r.latency_s / max(1, r.output_tokens) for r in results),
        "jct_s": jct,
        "output_tokens_per_s": tokens / max(jct, 1e-9),
        "preemptions": sim.num_preemptions(),
        "calls_per_instance": calls_per_instance(sim),
        "simulated_s": sim.clock.now,
        "steps": sim.num_steps,
        "failed_calls": sum(r.failed_calls for r in results),
        "failovers": sim.dispatcher.num_failovers if sim.dispatcher is not None else 0,
        "instances_lost": dict(sim.lost),  # instance -> when the dispatcher was told
        "instances_restarted": dict(sim.restarted),  # instance -> when its restart took calls again
        "calls_after_restart": {
            iid: sum(1 for p in sim.placements if p.instance_id == iid and p.at_s >= t)
            for iid, t in sim.restarted.items()
        },
        "programs": len(results),
        "programs_finished": sum(r.finished for r in results),
        "lending_stalled_at_s": sim.lending_stalled_at,  # None: lending never stalled with work left
        "avg_call_latency_s": {kind: statistics.fmean(v) for kind, v in sorted(sim.call_latencies.items())},
    }
    if sim.lending is not None:
        row["lending"] = sim.lending.totals()
    if isinstance(sim.dispatcher, PDDispatcher):
        row["read_paths"] = dict(sorted(sim.dispatcher.placements.items()))
        row["storage_bytes_read"] = {link.name: link.stats().bytes_carried["kv"] for link in sim.storage_links}
    return row


def unfinished_lines(rows: list[dict]) -> list[str]:
    """A line for each run that left programs unfinished (its figures cover the finished ones), with why when KV
    lending stalled."""
    lines = []
    for row in rows:
        if row["programs_finished"] == row["programs"]:
            continue
        stalled = row["lending_stalled_at_s"]
        why = (
            f": KV lending stalled at {stalled:.0f} s (requests over one instance's pool waiting for room no instance"
            " could lend; docs/lending.md)"
            if stalled is not None
            else ""
        )
        lines.append(
            f"{row['policy']} @ {row['rate']}/s: {row['programs'] - row['programs_finished']} of {row['programs']}"
            f" programs did not finish{why}; these figures are invalid"
        )
    return lines


def print_rows(rows: list[dict]) -> None:
    pd = any(r["roles"] for r in rows)
    table = []
    for row in rows:
        ref = next(
            (
                r
                for r in rows
                if r["rate"] == row["rate"]
                and r["roles"] == row["roles"]
                and (r["kv_path"] == "basic" if pd else r["policy"] == "fcfs")
                and (r["policy"] == row["policy"] if pd else r["kv_path"] == row["kv_path"])
            ),
            None,
        )
        key = "jct_s" if pd else "avg_latency_s"
        table.append(
            [
                row["rate"],
                *([row["roles"], row["kv_path"]] if pd else []),
                row["policy"],
                f"{row['avg_latency_s']:.1f}",
                f"{row['p95_latency_s']:.1f}",
                f"{row['jct_s']:.1f}",
                f"{row['output_tokens_per_s']:.0f}",
                f"{row['avg_latency_per_token_s'] * 1000:.0f}",
                row["preemptions"],
                f"{ref[key] / row[key]:.2f}x" if ref else "-",
            ]
        )
    header = ["rate/s", *(["roles", "kv path"] if pd else []), "policy", "avg s", "p95 s", "JCT s", "tokens/s"]
    header += ["ms/token", "preemptions", "JCT vs basic" if pd else "avg vs fcfs"]
    print_table(header, table)


def write_plot(path: str, rows: list[dict], args: argparse.Namespace, hardware: str) -> None:
    """Latency against arrival rate, a line per policy (and read path); with several cluster sizes, the job's
    completion time and throughput against the number of GPUs, a line per read path."""

    def label(row: dict) -> str:
        return row["policy"] + (f"/{row['kv_path']}" if row["kv_path"] else "")

    sizes = len({r["roles"] for r in rows})
    if sizes > 1:
        title = f"{args.workload}: {args.num_programs} programs per prefill engine on {hardware}"
        metrics = (("jct_s", "job completion time (s)"), ("output_tokens_per_s", "output tokens per second"))
        done = plot_sweep(path, rows, title, metrics, x=("gpus", "GPUs (prefill + decode)"), series=label)
    else:
        title = f"{args.workload}: {rows[0]['roles'] or rows[0]['gpus']} x {hardware}, {args.num_programs} programs"
        metrics = (("avg_latency_s", "average program latency (s)"), ("p95_latency_s", "p95 program latency (s)"))
        done = plot_sweep(path, rows, title, metrics, series=label)
    print(f"wrote {path}" if done else "matplotlib is not installed; no plot")


def calls_per_instance(sim: Simulator) -> dict[str, int]:
    counts = dict.fromkeys(sim.instance_ids, 0)
    for placement in sim.placements:
        counts[placement.instance_id] += 1
    return counts


# The cluster's flags the simulator uses: the same names and defaults as ``boundless serve``'s.
CLUSTER_FLAGS = (
    "instances",
    "routing",
    "locality_threshold",
    "locality_max_imbalance",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "step_timeout_s",
    "restart_delay_s",
    "max_restarts",
    "restart_reset_s",
    "prefill_instances",
    "decode_instances",
    "kv_path",
    "kv_handoff_timeout_s",
    "pd_alpha",
    "pd_beta",
    "pd_z",
    "storage_gbps",
    "net_gbps",
    "kv_lending",
    "lending_interval_s",
    "lending_debtor_max_batch",
    "lending_creditor_max_usage",
    "lending_creditor_headroom",
    "lending_min_gain",
    "lending_reservation_timeout_s",
    "lending_lookahead_chunks",
)


def cluster_config_from_flags(args: argparse.Namespace) -> ClusterConfig:
    config = ClusterConfig(**{name: getattr(args, name) for name in CLUSTER_FLAGS})
    if config.instances < 1:
        raise SystemExit("--instances must be at least 1")
    return config


def parse_roles(text: str | None) -> list[tuple[int, int]]:
    """``--roles``: comma-separated ``P:D`` sizes (prefill engines, decode engines), each at least 1."""
    sizes = []
    for size in (text or "").split(","):
        if not size.strip():
            continue
        try:
            prefill, decode = (int(n) for n in size.split(":"))
        except ValueError:
            raise SystemExit(f"--roles: {size.strip()!r} is not P:D (prefill and decode engines, e.g. 1:2)") from None
        if prefill < 1 or decode < 1:
            raise SystemExit(f"--roles: {size.strip()!r} needs at least one engine of each role")
        sizes.append((prefill, decode))
    return sizes


def cluster_configs_from_flags(args: argparse.Namespace) -> list[ClusterConfig]:
    """The clusters to run: the flags' one, or one per ``--roles`` size (``P:D``) and per ``--kv-paths`` path."""
    config = cluster_config_from_flags(args)
    sizes: list[tuple[int, int] | None] = [*parse_roles(args.roles)] or [None]
    configs = []
    for size in sizes:
        sized = (
            config
            if size is None  # (the engines of a P:D size are its own: --instances counts plain ones)
            else dataclasses.replace(config, instances=1, prefill_instances=size[0], decode_instances=size[1])
        )
        paths = args.kv_paths.split(",") if args.kv_paths and sized.disaggregated else [sized.kv_path]
        configs += [dataclasses.replace(sized, kv_path=path.strip()) for path in paths]
    return configs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=[w for w in WORKLOADS if w != "trace"] + ["agent", "longctx"],
        default="chat",
        help="a benchmark workload, or agent: DualPath-like agent sessions (long contexts, short appends), or "
        "longctx: bench longctx's trace of short requests and ones longer than an instance's KV pool, "
        "separate instances against KV lending (--kv-modes)",
    )
    parser.add_argument("--policies", default="fcfs,mlfq,plas,atlas")
    parser.add_argument("--rates", default="0.1,0.2,0.3,0.4")
    parser.add_argument("--num-programs", type=int, default=150)
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--tool-wait", type=float, default=0.2, help="mean seconds of tool/user time between calls")
    parser.add_argument("--call-scale", type=float, default=1.0, help="multiply the calls per program")
    parser.add_argument("--max-calls", type=int, default=WorkloadShape().max_calls, help="cap on a program's calls")
    parser.add_argument(
        "--max-len", type=int, default=WorkloadShape().max_len, help="cap on one call's new input and output tokens"
    )
    parser.add_argument(
        "--profile",
        help=f"hardware profile: {', '.join(profile_names())} or a profile file (boundless simulate calibrate writes "
        "one); without it, the --step-* linear model",
    )
    parser.add_argument(
        "--instances-per-node",
        type=int,
        default=0,
        help="instances of a node read the disk store over one shared storage link, their per-instance bandwidths "
        "summed (0: each its own)",
    )
    parser.add_argument("--step-base-s", type=float, default=CostModel.base_s)
    parser.add_argument("--step-per-token-s", type=float, default=CostModel.per_token_s)
    parser.add_argument("--step-per-seq-s", type=float, default=CostModel.per_seq_s)
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument(
        "--json", metavar="PATH", type=output_path, help="write the rows (with the run's speed) to this file"
    )
    parser.add_argument(
        "--roles",
        help="prefill/decode cluster sizes to run, P:D comma-separated (e.g. 1:1,2:4,48:96); --num-programs is then "
        "per prefill engine",
    )
    parser.add_argument("--kv-paths", help="with prefill/decode roles: read paths to compare (basic,dualpath,oracle)")
    parser.add_argument(
        "--plot", metavar="PATH", type=output_path, help="write a PNG of latency against rate, a line per policy"
    )
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="a progress bar on stderr"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="run the sweep's rows (rates x clusters x policies) in this many processes at once; the rows are the "
        "same, the speed's wall_s is then the sweep's (not with --workload longctx)",
    )
    parser.add_argument(
        "--fast-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run an instance's steps back to back while nothing else is due before the next one ends (the same "
        "results; --no-fast-forward: every step through the event heap)",
    )
    parser.add_argument(
        "--fail",
        metavar="ID@SECONDS[:hang|:stuck],...",
        help="instances that fail during each run (ids 0..N-1, or p0.., d0.. with roles): a crash (the default) is "
        "seen at once, as Ray fails the calls to a dead actor; a hang when the heartbeat times out "
        "(--heartbeat-timeout-s later); stuck (an engine whose step in flight, or next, never ends) when that "
        "step has run --step-timeout-s; the dispatcher fails their calls over to the live instances, and "
        "restarts each lost one --restart-delay-s later (up to --max-restarts), back --instance-startup-s after that",
    )
    parser.add_argument(
        "--instance-startup-s",
        type=float,
        default=DEFAULT_INSTANCE_STARTUP_S,
        help="seconds from an instance's restart to its first heartbeat (its model's load), with --fail",
    )
    parser.add_argument(
        "--sync-interval-s",
        type=float,
        metavar="D",
        help="run the cluster in windows of D virtual seconds (sim/parallel.py): main routes each window's calls, the "
        "engines run the window, and the router hears of the calls that finished at the window's end (up to D "
        "late); plain instances only (no roles, KV lending, --fail, --instances-per-node); without it (and with "
        "--workers 1) the serial simulator runs",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="with --sync-interval-s: run the instances' engines in this many processes, main one of them (it keeps "
        "fewer instances, beside its routing: sim/parallel.py's shard_owners); one a core; the rows are the same for "
        f"any N; above 1 without --sync-interval-s, D is {DEFAULT_SYNC_INTERVAL_S}",
    )
    parser.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --sync-interval-s: main routes a window's calls while the engines run the window before, so the "
        "router hears of a finish up to 2 D late and the calls it makes arrive a window later (other rows; the same "
        "for any --workers)",
    )
    add_flags(parser, ClusterConfig, only=CLUSTER_FLAGS)
    # The engine's own flags (the scheduler's are added with them by the command line).
    add_longctx_arguments(parser)
    add_flags(parser, ModelConfig)
    add_flags(parser, CacheConfig)
