"""``boundless bench programs``: agent programs against the server, one scheduling policy after another.

Every policy serves the same programs (same seed, same arrivals, same lengths) on a fresh engine
in this process, behind a real HTTP server driven by the async ``openai`` client. Each call is a
completion whose prompt is its thread's conversation so far (token ids, so prefixes match exactly)
and whose output length is fixed by the workload (``ignore_eos``), so policies differ only in
when they serve what. Reported per policy and rate: average, p95 and p99 program latency, program
latency per output token (Autellix's metric), makespan and program throughput.

``--kv-configs`` runs each policy under several KV setups too (:data:`KV_CONFIGS`): the device alone, host
memory below it, and host memory and a disk store, each evicting by LRU or by program. Each run gets a fresh,
empty disk store. The prefix-cache hit rate is then also reported per tier (the share of prompt tokens whose KV
came from the device, host memory or disk).

A failed call returns at once, so a program with failed calls finishes early: a policy that makes
calls fail would look faster. Failed calls are therefore counted, shown in the table, and any of
them marks the whole run's figures invalid (printed, and ``valid: false`` in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import dataclasses
import gc
import itertools
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from boundless.bench.report import output_path, plot_sweep, print_table, write_json
from boundless.bench.serve import percentile
from boundless.bench.workloads import (
    WORKLOADS,
    CallSpec,
    ProgramSpec,
    PromptTokens,
    WorkloadShape,
    call_prompt,
    make_programs,
)
from boundless.config import (
    KV_EVICTIONS,
    ROUTINGS,
    ClusterConfig,
    ConfigError,
    EngineConfig,
    add_flags,
    comma_numbers,
    engine_config_from_flags,
    from_flags,
    non_negative_float,
    positive_float,
    positive_int,
)
from boundless.engine.attention_time import AttentionSample
from boundless.engine.core import EngineStats
from boundless.kv.transfer import DEVICE, DISK, HOST

if TYPE_CHECKING:
    from boundless.api.server import EngineClient
    from boundless.model.loader import LoadedModel

# KV setups for --kv-configs: which tiers sit below the device. "device": host memory only swaps preempted
# requests (--swap-space-gb, as before host memory was a tier); "host": host memory keeps evicted blocks too
# (--kv-host-gb); "tiers": and a disk store below it (a fresh directory per run). Each with -lru or -program.
KV_TIERS = ("device", "host", "tiers")
KV_CONFIGS = tuple(f"{t}-{e}" for t in KV_TIERS for e in KV_EVICTIONS)
TIER_IDS = (DEVICE, HOST, DISK)
# Per-tier counters each row keeps (``{tier}_{field}``): where hits came from, and whether evicted blocks went down
# a tier (a tier's bytes written) and came back (its bytes read).
TIER_TRAFFIC = ("hit_tokens", "bytes_read", "bytes_written", "evictions", "load_timeouts")


def kv_config(base: EngineConfig, name: str, disk_path: str | None) -> EngineConfig:
    """``base`` with the KV setup ``name`` (one of :data:`KV_CONFIGS`); host memory is ``base``'s (1 GiB by
    default), and ``disk_path`` the disk store's directory for "tiers"."""
    tiers, _, eviction = name.partition("-")
    if name not in KV_CONFIGS:
        raise ConfigError(f"--kv-configs: unknown KV setup {name!r}; one of {', '.join(KV_CONFIGS)}")
    cache, host_gb = base.cache, base.cache.host_gb
    if tiers == "device":
        cache = dataclasses.replace(cache, kv_host_gb=None, swap_space_gb=host_gb, kv_disk_path=None)
    else:
        cache = dataclasses.replace(
            cache, kv_host_gb=host_gb, swap_space_gb=None, kv_disk_path=disk_path if tiers == "tiers" else None
        )
    return dataclasses.replace(base, cache=dataclasses.replace(cache, kv_eviction=eviction))


@contextlib.contextmanager
def fresh_store_dir(parent: str | None) -> Iterator[str]:
    """An empty directory for one run's disk store (under ``parent`` if given), removed afterwards: no run may
    find blocks an earlier one wrote."""
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kv-store-", dir=parent) as path:
        yield path


@dataclass(frozen=True)
class CallResult:
    """One call's outcome: the tokens it generated, or the error it failed with."""

    output_tokens: int
    error: str | None = None


@dataclass
class ProgramResult:
    program_id: str
    arrival_s: float
    finish_s: float
    output_tokens: int
    calls: int
    failed_calls: int = 0
    first_error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


class ProgramRunner:
    """Runs program specs against one server through the async ``openai`` client."""

    def __init__(self, base_url: str, model: str, max_model_len: int, vocab: int, seed: int = 0) -> None:
        import openai

        self.client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        self.model = model
        self.max_model_len = max_model_len
        self.tokens = PromptTokens(vocab, seed)

    async def _call(
        self, spec: ProgramSpec, call: CallSpec, contexts: dict, outputs: dict, rng: random.Random, system: list[int]
    ) -> CallResult:
        if call.tool_wait_s > 0:
            await asyncio.sleep(call.tool_wait_s)
        new_input = self.tokens.draw(rng, call.new_input)
        prompt = call_prompt(call, system, contexts, outputs, new_input, self.max_model_len)
        try:
            resp = await self.client.completions.create(
                model=self.model,
                prompt=prompt,
                max_tokens=call.output,
                temperature=0.0,
                extra_body={
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "program_id": spec.program_id,
                    "thread_id": call.thread_id,
                    "parent_thread_ids": list(call.parents),
                },
            )
        except Exception as e:  # counted (it makes the run's figures invalid); the program goes on with what it has
            contexts[call.thread_id] = prompt
            outputs[call.thread_id] = []
            return CallResult(0, f"{type(e).__name__}: {e}"[:300])
        out = list((resp.choices[0].model_extra or {}).get("token_ids") or [])  # (model_extra: never None here)
        contexts[call.thread_id] = prompt + out
        outputs[call.thread_id] = out
        return CallResult(len(out))

    async def run_program(self, spec: ProgramSpec, t0: float) -> ProgramResult:
        delay = t0 + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        arrival = time.perf_counter() - t0
        rng, system = self.tokens.start(spec)
        contexts: dict[str, list[int]] = {}
        outputs: dict[str, list[int]] = {}
        calls: list[CallResult] = []
        for stage in spec.stages:
            calls += await asyncio.gather(*(self._call(spec, c, contexts, outputs, rng, system) for c in stage))
        errors = [c.error for c in calls if c.error is not None]
        return ProgramResult(
            spec.program_id,
            arrival,
            time.perf_counter() - t0,
            sum(c.output_tokens for c in calls),
            spec.num_calls,
            len(errors),
            errors[0] if errors else None,
        )

    async def run(self, programs: list[ProgramSpec], desc: str, sequential: bool = False) -> list[ProgramResult]:
        """Every program at its arrival time, or with ``sequential`` each alone after the previous (unloaded)."""
        bar = tqdm(total=len(programs), desc=desc, unit="prog", leave=False)
        t0 = time.perf_counter()

        async def one(p: ProgramSpec) -> ProgramResult:
            r = await self.run_program(p, t0)
            bar.update(1)
            return r

        if sequential:
            results = []
            start = t0
            for p in programs:
                t0 = time.perf_counter() - p.arrival_s  # it arrives now
                r = await one(p)
                # Back on the run's clock, so that the makespan is the whole run's.
                shift = t0 - start
                results.append(dataclasses.replace(r, arrival_s=r.arrival_s + shift, finish_s=r.finish_s + shift))
        else:
            results = await asyncio.gather(*(one(p) for p in programs))
        bar.close()
        await self.client.close()
        return list(results)


def summarize(results: list[ProgramResult]) -> dict[str, float | int | str | None]:
    lat = [r.latency_s for r in results]
    per_token = [r.latency_s / max(1, r.output_tokens) for r in results]
    makespan = max(r.finish_s for r in results) - min(r.arrival_s for r in results)
    return {
        "programs": len(results),
        "calls": sum(r.calls for r in results),
        "failed_calls": sum(r.failed_calls for r in results),
        "first_error": next((r.first_error for r in results if r.first_error), None),
        "avg_latency_s": statistics.fmean(lat),
        "p95_latency_s": percentile(lat, 0.95),
        "p99_latency_s": percentile(lat, 0.99),
        "avg_latency_per_token_s": statistics.fmean(per_token),
        "makespan_s": makespan,
        "throughput_programs_per_s": len(results) / makespan,
        "output_tokens": sum(r.output_tokens for r in results),
    }


def invalid_reason(rows: list[dict]) -> str | None:
    """Why a run's figures cannot be compared, or None when every call succeeded.

    A failed call takes no serving time, so latencies that include failed calls favour whatever
    made them fail; no figure of such a run is trustworthy, including those of the other rows.
    """
    failing = [r for r in rows if r["failed_calls"]]
    if not failing:
        return None
    counts = ", ".join(f"{_label(r)} at {r['rate']}/s: {r['failed_calls']} of {r['calls']}" for r in failing)
    return f"calls failed ({counts}); first error: {failing[0]['first_error']}"


@dataclass
class ServedEngine:
    """A running server (``url``), how to take the steps its engines recorded since the last take, and their
    stats (by instance)."""

    url: str
    max_model_len: int
    take_steps: Callable[[], list[AttentionSample]]
    stats: Callable[[], dict[str, EngineStats]]


@contextlib.contextmanager
def served_engine(
    loaded: LoadedModel, config: EngineConfig, cluster: ClusterConfig | None = None, model_name: str = "bench"
) -> Iterator[ServedEngine]:
    """A fresh engine in this process (or, with ``cluster``, a fresh Ray cluster behind the dispatcher) behind the
    HTTP server in a thread: ``bench programs``' serving, and ``simulate validate``'s and ``calibrate --served``'s."""
    from boundless.api.launch import start_in_thread
    from boundless.engine.async_engine import AsyncEngine
    from boundless.engine.core import EngineCore

    if cluster is not None and (cluster.instances > 1 or cluster.disaggregated):
        from boundless.cluster.client import ClusterClient

        engine: EngineClient = ClusterClient(config, cluster)
    else:
        engine = AsyncEngine(EngineCore.from_model(loaded, config))
    server = start_in_thread(engine, model_name)
    served = ServedEngine(server.url, engine.max_model_len, _step_taker(engine), engine.stats)
    try:
        yield served
    finally:
        server.stop()
        engine.shutdown()
        del engine
        gc.collect()


def _step_taker(engine: EngineClient) -> Callable[[], list[AttentionSample]]:
    """How to take the steps recorded since the last take: from the engine's loop, or from every actor."""
    from boundless.engine.async_engine import EngineLoop

    if isinstance(engine, EngineLoop):

        def take_local() -> list[AttentionSample]:
            with engine.lock:
                return engine.core.step_times.drain()

        return take_local
    import ray

    actors = [inst.actor for inst in engine.instances.values()]  # type: ignore[attr-defined]

    def take_actors() -> list[AttentionSample]:
        return [s for steps in ray.get([a.take_step_times.remote() for a in actors]) for s in steps]

    return take_actors


def _serve_and_run(
    config: EngineConfig,
    loaded,
    programs: list[ProgramSpec],
    desc: str,
    cluster: ClusterConfig | None,
    sequential: bool = False,
) -> tuple[dict, dict]:
    """A fresh engine (or cluster) and HTTP server; the programs; the engines' summed counters."""
    with served_engine(loaded, config, cluster) as served:
        runner = ProgramRunner(served.url, "bench", served.max_model_len, loaded.arch.vocab_size)
        results = asyncio.run(runner.run(programs, desc, sequential=sequential))
        if cluster is not None:
            time.sleep(2 * cluster.heartbeat_interval_s)  # let the last heartbeats in
        snapshots = [dataclasses.asdict(s) for s in served.stats().values()]
    stats = {k: sum(s[k] for s in snapshots) for k, v in snapshots[0].items() if isinstance(v, int | float)}
    for tier in TIER_IDS:
        for field in TIER_TRAFFIC:
            stats[f"{tier}_{field}"] = sum(s["kv_tiers"].get(tier, {}).get(field, 0) for s in snapshots)
    return summarize(results), stats


def run(args: argparse.Namespace) -> dict:
    from boundless.model.loader import load_configured_model

    base = engine_config_from_flags(args)
    cluster_base = from_flags(ClusterConfig, args)
    if cluster_base.instances > 1:
        # Compare routings; each policy (--policies, else --policy) on every instance.
        routings = [r.strip() for r in (args.routings or "locality,round-robin,least-loaded").split(",") if r.strip()]
        if unknown := [r for r in routings if r not in ROUTINGS]:
            raise SystemExit(f"--routings: {', '.join(unknown)} is none of {', '.join(ROUTINGS)}")
        policies = [p.strip() for p in (args.policies or base.scheduler.policy).split(",") if p.strip()]
    else:
        routings = [None]
        policies = [p.strip() for p in (args.policies or f"fcfs,{base.scheduler.policy}").split(",") if p.strip()]
    kv_names: list[str | None] = [k.strip() for k in (args.kv_configs or "").split(",") if k.strip()] or [None]
    for name in kv_names:
        if name is not None:
            kv_config(base, name, None)  # a bad name fails before any run
    rates = comma_numbers("--rates", args.rates, float) if args.sweep else [args.rate]
    shape = WorkloadShape(
        scale=args.scale, call_scale=args.call_scale, tool_wait_s=args.tool_wait, max_len=args.max_len
    )
    loaded = load_configured_model(base.model)
    rows = []
    for rate in rates:
        # Rate 0 means unloaded: each program runs alone, after the previous one.
        programs = make_programs(
            args.workload, args.num_programs, rate or 1.0, args.bench_seed, shape, args.trace_folder
        )
        for policy, routing, kv_name in itertools.product(policies, routings, kv_names):
            config = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, policy=policy))
            cluster = dataclasses.replace(cluster_base, routing=routing) if routing else None
            row = {"workload": args.workload, "rate": rate, "policy": policy, "routing": routing or ""}
            row["kv"] = kv_name or ""
            name = _label(row)
            with fresh_store_dir(base.cache.kv_disk_path) if kv_name else contextlib.nullcontext() as store_dir:
                if kv_name:
                    config = kv_config(config, kv_name, store_dir)
                summary, stats = _serve_and_run(
                    config, loaded, programs, f"{name} @ {rate}/s", cluster, sequential=rate == 0
                )
            row.update(summary)
            hits, queries = stats["prefix_cache_hits"], stats["prefix_cache_queries"]
            row["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
            for tier in TIER_IDS:
                row[f"hit_rate_{tier}"] = stats[f"{tier}_hit_tokens"] / queries if queries else 0.0
            row.update({k: stats[k] for k in ("num_kept", "num_swapped_out", "num_recomputed")})
            row.update({f"{t}_{f}": stats[f"{t}_{f}"] for t in TIER_IDS for f in TIER_TRAFFIC if f != "hit_tokens"})
            rows.append(row)
            tier_rates = ", ".join(f"{t} {row[f'hit_rate_{t}']:.2f}" for t in TIER_IDS)
            print(
                f"{args.workload} rate {rate}/s {name}: avg {summary['avg_latency_s']:.1f} s, "
                f"p95 {summary['p95_latency_s']:.1f} s, makespan {summary['makespan_s']:.1f} s, "
                f"prefix-cache hit rate {row['prefix_cache_hit_rate']:.2f} "
                f"({tier_rates}), "
                f"failed calls {row['failed_calls']} of {row['calls']}",
                flush=True,
            )
    table = []
    for row in rows:
        # The baseline: the first KV setup of the same policy when comparing KV setups, else fcfs when comparing
        # policies, round-robin (else the first listed) of the same policy when comparing routings.
        ref = next(
            (r for r in rows if r["rate"] == row["rate"] and _is_baseline(r, row, policies, routings, kv_names)), None
        )
        speedup = ref["avg_latency_s"] / row["avg_latency_s"] if ref else float("nan")
        row["avg_latency_vs_baseline"] = speedup
        table.append(
            [
                row["rate"],
                _label(row),
                f"{row['avg_latency_s']:.2f}",
                f"{row['p95_latency_s']:.2f}",
                f"{row['p99_latency_s']:.2f}",
                f"{row['avg_latency_per_token_s'] * 1000:.1f}",
                f"{row['makespan_s']:.1f}",
                f"{row['throughput_programs_per_s']:.3f}",
                f"{row['prefix_cache_hit_rate']:.2f}",
                "/".join(f"{row[f'hit_rate_{t}']:.2f}" for t in TIER_IDS),
                f"{row['failed_calls']}/{row['calls']}",
                f"{speedup:.2f}x",
            ]
        )
    baseline = _baseline_routing(routings) if cluster_base.instances > 1 else "fcfs"
    if len(kv_names) > 1:
        baseline = str(kv_names[0])
    print_table(
        [
            "rate/s",
            "policy",
            "avg s",
            "p95 s",
            "p99 s",
            "ms/token",
            "makespan s",
            "prog/s",
            "hit rate",
            "dev/host/disk",
            "failed",
            f"avg vs {baseline}",
        ],
        table,
    )
    invalid = invalid_reason(rows)
    if invalid:
        print(f"INVALID: these figures cannot be compared: {invalid}", flush=True)
    result = {
        "workload": args.workload,
        "model": base.model.model,
        "num_programs": args.num_programs,
        "scale": args.scale,
        "max_num_seqs": base.scheduler.max_num_seqs,
        "valid": invalid is None,
        "invalid_reason": invalid,
        "rows": rows,
    }
    if args.sweep:
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_csv(out_dir / f"programs-{args.workload}.csv", rows)
        png = out_dir / f"programs-{args.workload}.png"
        done = plot_sweep(png, rows, f"{args.workload}: latency against load", series=_label)
        print(f"wrote {png}" if done else "matplotlib is not installed; no plot")
    if args.json:
        write_json(args.json, result)
    return result


def _label(row: dict) -> str:
    return row["policy"] + (f"/{row['routing']}" if row["routing"] else "") + (f"/{row['kv']}" if row["kv"] else "")


def _baseline_routing(routings: list[str | None]) -> str:
    """Round-robin when it is compared, else the first routing listed."""
    return "round-robin" if "round-robin" in routings else str(routings[0])


def _is_baseline(
    candidate: dict, row: dict, policies: list[str], routings: list[str | None], kv_names: list[str | None]
) -> bool:
    if len(kv_names) > 1:
        return candidate["policy"] == row["policy"] and candidate["kv"] == kv_names[0]
    if row["routing"]:
        return candidate["policy"] == row["policy"] and candidate["routing"] == _baseline_routing(routings)
    return candidate["policy"] == ("fcfs" if len(policies) > 1 else policies[0])


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ClusterConfig)
    parser.add_argument("--workload", choices=WORKLOADS, default="chat")
    parser.add_argument(
        "--policies",
        help="comma-separated policies to compare (default: fcfs and --policy; with --instances N > 1, --policy)",
    )
    parser.add_argument(
        "--kv-configs",
        help=f"comma-separated KV setups to run each policy under, the first the baseline: {', '.join(KV_CONFIGS)} "
        "(device: host memory swaps only; host: it keeps evicted blocks; tiers: and a fresh disk store, under "
        "--kv-disk-path if given; -lru or -program eviction). Default: the engine flags as given",
    )
    parser.add_argument(
        "--routings", help="with --instances N > 1: comma-separated routings to compare (default: all three)"
    )
    parser.add_argument(
        "--rate", type=non_negative_float, default=0.2, help="program arrivals per second (0: one at a time)"
    )
    parser.add_argument("--sweep", action="store_true", help="run every policy at every rate of --rates")
    parser.add_argument("--rates", default="0.05,0.1,0.2,0.4")
    parser.add_argument("--num-programs", type=positive_int, default=30)
    parser.add_argument("--scale", type=positive_float, default=0.1, help="multiply the workload's token lengths")
    parser.add_argument("--call-scale", type=positive_float, default=1.0, help="multiply the calls per program")
    parser.add_argument(
        "--tool-wait", type=non_negative_float, default=0.2, help="mean seconds of tool/user time between calls"
    )
    parser.add_argument(
        "--max-len", type=positive_int, default=512, help="cap on one call's new input and output tokens"
    )
    parser.add_argument("--trace-folder", help="mini-SWE-agent sessions for --workload trace")
    parser.add_argument("--out-dir", default="bench-results", help="where --sweep writes its CSV and PNG")
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the figures to this file")
