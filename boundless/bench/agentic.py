"""``boundless bench agentic``: agent sessions with long shared contexts and short appends over the persistent KV
store, with the KV read on the prefill engine only (``basic``), on either engine (``dualpath``) or costing no
storage bandwidth (``oracle``), and on one colocated engine; DualPath's evaluation (arXiv 2602.21548, section 5)
on one machine.

Setups, each with a fresh, empty store (``--kv-disk-path`` semantics, written through):

- ``basic``, ``dualpath``, ``oracle``: ``--prefill-instances P`` prefill and ``--decode-instances D`` decode engines
  (default P = D = 1) in this process
  (``cluster/local_pd.py``: the engines of the Ray cluster without the actors) over the shared-memory KV
  transport, behind the PD dispatcher and its scheduler, ``--kv-path`` set to the mode. Every engine is a node
  of its own with an emulated storage link at ``--storage-gbps`` and a network link at ``--net-gbps``
  (``cluster/links.py``): under ``basic`` every stored block crosses the PE's storage link, under ``dualpath``
  the scheduler sends each turn's read through whichever node's link would finish it first, and under
  ``oracle`` no engine has a storage link (the reads still happen, for the right outputs, but wait for nothing).
- ``colocated``: one engine that prefills and decodes, reading through one storage link at ``--storage-gbps``.

Each engine keeps ``--memory-sessions`` sessions' worth of KV in device memory and as much in host memory, far
fewer than the sessions in flight: as in the paper, agent contexts outgrow memory and nearly every turn's
context comes back from storage.

Offline, every session starts at once and the JCT of the batch is the figure (throughput = turns / JCT);
online, sessions arrive by a Poisson process at ``--rate`` and wait their tool time between turns (TTFT, TPOT,
SLO attainment). ``--sweep-gbps`` reruns the offline batch under ``basic`` and ``dualpath`` at each storage
bandwidth (``oracle`` does not depend on it and runs once), showing where storage stops being the bottleneck.
Greedy outputs must be identical in every run; the bench checks and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import dataclasses
import gc
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boundless.bench.agent_replay import SLO, Engine, TurnResult, outputs_of, replay, summarize
from boundless.bench.pd_trace import PDTracer, cluster_sampler
from boundless.bench.pd_trace import summary as trace_summary
from boundless.bench.report import output_path, print_table, write_json
from boundless.bench.workloads import (
    ProgramSpec,
    PromptTokens,
    WorkloadShape,
    agent_sessions,
    make_programs,
    with_arrivals,
)
from boundless.cluster.links import Link, LinkStats, ThrottledLink, gbps_to_bytes_per_s
from boundless.config import (
    ClusterConfig,
    EngineConfig,
    comma_numbers,
    engine_config_from_flags,
    non_negative_float,
    positive_float,
    positive_int,
    refuse_engine_flags,
)
from boundless.engine.builder import size_engine
from boundless.kv.transfer import DISK
from boundless.model.loader import LoadedModel

PD_MODES = ("basic", "dualpath", "oracle")
MODES = (*PD_MODES, "colocated")
LOAD_TIMEOUT_S = 60.0
DEFAULT_TRACE_FOLDER = "/work/shared/traces/lmcache_agent_trace/miniswe"


@dataclass(frozen=True)
class Setup:
    """What every run of one bench shares: the model, the engines' config (its store directory set per run),
    the emulated network link and the sessions' prompt tokens."""

    loaded: LoadedModel
    engine: EngineConfig
    net_gbps: float | None
    tokens: PromptTokens
    slo: SLO
    warm_store: str | None = None  # a store holding every session's first context, copied for each run
    prefill_instances: int = 1  # PD modes: prefill engines (P)
    decode_instances: int = 1  # PD modes: decode engines (D)


@dataclass
class Serving:
    """A running setup: the engine to send turns to, and how to read its links and paths afterwards."""

    engine: Engine
    max_model_len: int
    links: dict[str, list[LinkStats]]  # filled at the end: per instance (p0, d0, or colocated)
    read_paths: dict[str, int]  # calls placed per read path (PD only)
    prefetches: dict[str, int] = dataclasses.field(default_factory=dict)  # reads ahead for waiting calls, per path
    computed: dict[str, int] = dataclasses.field(default_factory=dict)  # tokens each instance ran through the model
    load_timeouts: int = 0  # store loads given up on (then recomputed)
    recomputed_blocks: dict[str, int] = dataclasses.field(default_factory=dict)  # stored blocks computed, by why
    reloaded_blocks: dict[str, int] = dataclasses.field(default_factory=dict)  # stored blocks read twice, per instance
    # Requests that lost their device KV to make room (swapped out, or dropped to compute again), per instance.
    preemptions: dict[str, int] = dataclasses.field(default_factory=dict)
    # DE-read pushes the PEs prefilled from as they landed (--layerwise-load on), and the layers their forward passes
    # reached before the push had brought them.
    landing_pushes: int = 0
    landing_waits: int = 0
    trace: dict[str, Any] | None = None  # PD runs with a tracer: the storage links' idle split (bench/pd_trace.py)


def memory_config(
    loaded: LoadedModel, base: EngineConfig, context_tokens: int, device_sessions: int, host_sessions: int
) -> EngineConfig:
    """``base`` with device memory for ``device_sessions`` contexts of ``context_tokens`` each and host memory for
    ``host_sessions`` (unless the flags set them), writing through to the store."""
    cache = base.cache
    per_session = -(-context_tokens // cache.block_size) + 1
    per_block = size_engine(base, loaded.arch, loaded.dtype).bytes_per_block
    cache = dataclasses.replace(
        cache,
        num_kv_blocks=cache.num_kv_blocks or device_sessions * per_session,
        kv_host_gb=cache.kv_host_gb
        if cache.kv_host_gb is not None
        else host_sessions * per_session * per_block / 2**30,
        kv_write_policy="through",
        # The load timeout is for stuck storage; behind a deliberately slow emulated link a queued load may wait
        # longer than the default 10 s, and the timeout would turn that wait into recomputation.
        kv_load_timeout_s=max(cache.kv_load_timeout_s, LOAD_TIMEOUT_S),
    )
    return dataclasses.replace(base, cache=cache)


def warm_store(setup: Setup, sessions: Sequence[ProgramSpec], directory: str) -> None:
    """Write every session's first context to the store in ``directory`` (one engine, no link, untimed).

    Agents resume: the paper's premise is that a turn's context is already in storage, and its PEs read almost
    all of it. Computing the first contexts once here, rather than in every timed run, keeps the runs about
    that regime (a first context is ~95% of a session's prompt tokens here, and a CPU prefills it at a few
    hundred tokens a second) and identical in what they start from."""
    from boundless.engine.core import EngineCore
    from boundless.engine.sampling_params import SamplingParams

    config = dataclasses.replace(setup.engine, cache=dataclasses.replace(setup.engine.cache, kv_disk_path=directory))
    core = EngineCore.from_model(setup.loaded, config)
    for spec in sessions:
        core.add_request(spec.program_id, setup.tokens.start(spec)[1], SamplingParams(temperature=0.0, max_tokens=1))
    while core.has_unfinished():
        core.step()
    core.close()


@contextlib.contextmanager
def serving(setup: Setup, mode: str, storage_gbps: float | None, trace: bool = False) -> Iterator[Serving]:
    """A fresh setup of ``mode`` over a fresh copy of the warm store; shut down (and its figures read) on exit.
    ``trace``: a PD setup's storage links are sampled while it serves (``bench/pd_trace.py``)."""
    from boundless.cluster.local_pd import LocalPDCluster
    from boundless.cluster.pd_dispatcher import PDDispatcher
    from boundless.engine.async_engine import AsyncEngine
    from boundless.engine.core import EngineCore

    with tempfile.TemporaryDirectory(prefix="boundless-agentic-") as parent:
        store = str(Path(parent) / "store")
        if setup.warm_store:
            shutil.copytree(setup.warm_store, store)
        config = dataclasses.replace(setup.engine, cache=dataclasses.replace(setup.engine.cache, kv_disk_path=store))
        if mode == "colocated":
            link = None
            if storage_gbps is not None:
                link = ThrottledLink(Link("storage", gbps_to_bytes_per_s(storage_gbps)), time.monotonic, time.sleep)
            engine = AsyncEngine(EngineCore.from_model(setup.loaded, config, read_link=link))
            run = Serving(engine, engine.max_model_len, {}, {})
            try:
                yield run
            finally:
                stats = engine.stats()["0"]
                run.computed = {"colocated": stats.computed_tokens}
                run.preemptions = {"colocated": stats.num_preemptions}
                run.load_timeouts = stats.kv_tiers[DISK].load_timeouts if DISK in stats.kv_tiers else 0
                run.recomputed_blocks = dict(stats.kv_tiers[DISK].recomputed_blocks) if DISK in stats.kv_tiers else {}
                run.reloaded_blocks = (
                    {"colocated": stats.kv_tiers[DISK].reloaded_blocks} if DISK in stats.kv_tiers else {}
                )
                engine.shutdown()
                run.links = {"colocated": [link.stats()] if link else []}
        else:
            cluster = ClusterConfig(
                prefill_instances=setup.prefill_instances,
                decode_instances=setup.decode_instances,
                kv_path=mode,
                storage_gbps=storage_gbps,
                net_gbps=setup.net_gbps,
            )
            pd = LocalPDCluster(config, cluster, setup.loaded)
            run = Serving(pd, pd.max_model_len, {}, {})
            tracer = PDTracer(cluster_sampler(pd)) if trace else None
            if tracer is not None:
                tracer.start()
            try:
                yield run
            finally:
                if tracer is not None:
                    run.trace = trace_summary(tracer.stop())
                run.links = pd.link_stats()
                by_instance = pd.stats()
                run.computed = {iid: s.computed_tokens for iid, s in by_instance.items()}
                run.preemptions = {iid: s.num_preemptions for iid, s in by_instance.items()}
                remote = [s.remote_io for s in by_instance.values() if s.remote_io is not None]
                run.landing_pushes = sum(r.counted_recvs for r in remote)
                run.landing_waits = sum(r.recv_layer_waits for r in remote)
                run.load_timeouts = sum(
                    s.kv_tiers[DISK].load_timeouts for s in by_instance.values() if DISK in s.kv_tiers
                )
                dispatcher = pd.dispatcher
                assert isinstance(dispatcher, PDDispatcher)  # (a PD cluster's; its front end's type names the base)
                run.read_paths = dict(dispatcher.placements)
                run.prefetches = dict(dispatcher.prefetches)
                run.recomputed_blocks = {
                    f"{iid}:{why}": n
                    for iid, s in by_instance.items()
                    if DISK in s.kv_tiers
                    for why, n in s.kv_tiers[DISK].recomputed_blocks.items()
                }
                run.reloaded_blocks = {
                    iid: s.kv_tiers[DISK].reloaded_blocks for iid, s in by_instance.items() if DISK in s.kv_tiers
                }
                pd.shutdown()
        gc.collect()


def run_once(
    setup: Setup, mode: str, storage_gbps: float | None, sessions: Sequence, offline: bool, trace: bool = False
) -> tuple[dict[str, Any], list[TurnResult]]:
    """One mode over the sessions: its summary row (with its links' figures) and its turns; with ``trace``, a PD
    run's row has its links' idle split (``trace``)."""
    with serving(setup, mode, storage_gbps, trace) as run:
        turns = asyncio.run(replay(run.engine, sessions, setup.tokens, run.max_model_len, offline))
    row: dict[str, Any] = {
        "phase": "offline" if offline else "online",
        "mode": mode,
        "storage_gbps": storage_gbps if mode != "oracle" else None,
    }
    row |= summarize(turns, setup.slo)
    row |= link_figures(run.links, row["jct_s"])
    row["read_paths"] = run.read_paths
    row["prefetches"] = run.prefetches
    row |= {f"{iid}_computed_tokens": n for iid, n in run.computed.items()}
    row["load_timeouts"] = run.load_timeouts
    row["recomputed_blocks"] = run.recomputed_blocks
    row["reloaded_blocks"] = run.reloaded_blocks
    row["preemptions"] = run.preemptions
    row["landing_pushes"] = run.landing_pushes
    row["landing_waits"] = run.landing_waits
    if run.trace is not None:
        row["trace"] = run.trace
    return row, turns


def link_figures(links: dict[str, list[LinkStats]], seconds: float) -> dict[str, Any]:
    """Per instance: MB read through its storage link and the share of the run it was busy; MB over its network
    link. Per role (``pe_``, ``de_``: instances ``p0..``, ``d0..``): the MB its instances' storage links carried
    together and their mean busy share."""
    out: dict[str, Any] = {}
    by_role: dict[str, list[tuple[float, float]]] = {}
    for iid, stats in links.items():
        for s in stats:
            carried = sum(s.bytes_carried.values()) / 1e6
            if s.name == "storage":
                busy = s.busy_s / seconds if seconds > 0 else 0.0
                out[f"{iid}_storage_mb"] = round(carried, 1)
                out[f"{iid}_storage_busy"] = round(busy, 3)
                role = {"p": "pe", "d": "de"}.get(iid[0]) if iid[1:].isdigit() else None
                if role:
                    by_role.setdefault(role, []).append((carried, busy))
            else:
                out[f"{iid}_net_mb"] = round(carried, 1)
    for role, figures in by_role.items():
        out[f"{role}_storage_mb"] = round(sum(mb for mb, _ in figures), 1)
        out[f"{role}_storage_busy"] = round(sum(b for _, b in figures) / len(figures), 3)
    return out


def sessions_for(args: argparse.Namespace) -> list[ProgramSpec]:
    """The sessions of this bench: DualPath-like agent trajectories, or the replayed mini-SWE-agent traces."""
    shape = WorkloadShape(
        scale=args.scale,
        call_scale=args.turn_scale,
        tool_wait_s=args.tool_wait,
        max_calls=args.max_turns,
        max_len=args.max_len,
    )
    if args.workload == "trace":
        return make_programs("trace", args.num_sessions, 0.0, args.bench_seed, shape, args.trace_folder)
    return agent_sessions(args.num_sessions, 0.0, args.bench_seed, shape)


def identical_outputs(runs: dict[str, list[TurnResult]]) -> tuple[bool, str]:
    """Whether every run generated the same tokens for every turn, and a line saying so (or where not)."""
    names = list(runs)
    reference = outputs_of(runs[names[0]])
    for name in names[1:]:
        other = outputs_of(runs[name])
        differing = sorted(k for k in reference if other.get(k) != reference[k])
        if differing or other.keys() != reference.keys():
            return False, f"outputs differ: {name} vs {names[0]} at {len(differing)} turns (first {differing[:3]})"
    return True, f"greedy outputs identical across {len(names)} runs ({len(reference)} turns each)"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from boundless.model.loader import load_configured_model

    refuse_engine_flags(args, "bench agentic", SET_BY_AGENTIC)
    base = engine_config_from_flags(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    sweep_gbps(args)  # (before the model loads: a bad rate failed with a traceback after every other run)
    phases_of(args)  # (and a bad --phases stopped the run only once its engines were built)
    loaded = load_configured_model(base.model)
    offline_sessions = sessions_for(args)
    online_sessions = with_arrivals(offline_sessions, args.rate, args.bench_seed)
    longest = max(
        s.system_prompt + sum(c.new_input + c.output for st in s.stages for c in st) for s in offline_sessions
    )
    longest += PromptTokens(loaded.arch.vocab_size).shared.__len__()
    setup = Setup(
        loaded,
        memory_config(loaded, base, longest, args.memory_sessions, args.host_sessions),
        args.net_gbps,
        PromptTokens(loaded.arch.vocab_size, args.bench_seed),
        SLO(args.slo_ttft, args.slo_tpot),
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
    )
    with tempfile.TemporaryDirectory(prefix="boundless-agentic-warm-") as warm:
        if args.warm_store:
            start = time.perf_counter()
            warm_store(setup, offline_sessions, warm)
            print(f"warm store: every session's first context written in {time.perf_counter() - start:.1f} s")
            setup = dataclasses.replace(setup, warm_store=warm)
        return _run_all(args, base, setup, modes, offline_sessions, online_sessions, longest)


def phases_of(args: argparse.Namespace) -> list[str]:
    """``--phases``: offline, online or both, in the order given."""
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or any(p not in ("offline", "online") for p in phases):
        raise SystemExit(f"--phases: offline, online or both, not {args.phases!r}")
    return phases


def sweep_gbps(args: argparse.Namespace) -> list[float]:
    """``--sweep-gbps``: the storage rates of the sweep, each a positive number (none by default)."""
    return comma_numbers("--sweep-gbps", args.sweep_gbps, float, positive=True) if args.sweep_gbps else []


def _run_all(
    args: argparse.Namespace,
    base: EngineConfig,
    setup: Setup,
    modes: list[str],
    offline_sessions: list[ProgramSpec],
    online_sessions: list[ProgramSpec],
    longest: int,
) -> dict[str, Any]:
    print(
        f"{len(offline_sessions)} sessions, {sum(s.num_calls for s in offline_sessions)} turns, longest context "
        f"{longest} tokens; per engine {setup.engine.cache.num_kv_blocks} device blocks and "
        f"{setup.engine.cache.kv_host_gb:.3f} GiB host; PD modes {setup.prefill_instances}P{setup.decode_instances}D; "
        f"storage {args.storage_gbps} Gbit/s, net {args.net_gbps} Gbit/s",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    runs: dict[str, list[TurnResult]] = {}
    traces: dict[str, dict[str, Any]] = {}  # --trace: per PD run, its storage links' idle split
    for phase in phases_of(args):
        sessions = offline_sessions if phase == "offline" else online_sessions
        for mode in modes:
            row, turns = run_once(
                setup, mode, args.storage_gbps, sessions, offline=phase == "offline", trace=bool(args.trace)
            )
            if "trace" in row:
                traces[f"{phase}/{mode}"] = row.pop("trace")
            rows.append(row)
            runs[f"{phase}/{mode}@{args.storage_gbps}"] = turns
            _print_progress(row)
    for gbps in sweep_gbps(args):
        for mode in [m for m in modes if m in ("basic", "dualpath")]:
            row, turns = run_once(setup, mode, gbps, offline_sessions, offline=True)
            row["phase"] = "sweep"
            rows.append(row)
            runs[f"sweep/{mode}@{gbps}"] = turns
            _print_progress(row)
    identical, line = identical_outputs(runs) if runs else (True, "no runs")
    _add_ratios(rows)
    print_table(*_table(rows))
    print(line, flush=True)
    invalid = [
        f"{r['phase']}/{r['mode']}: {r['failed_turns']} failed ({r['first_error']})" for r in rows if r["failed_turns"]
    ]
    if invalid:
        print("INVALID: " + "; ".join(invalid), flush=True)
    result = {
        "model": base.model.model,
        "workload": args.workload,
        "num_sessions": args.num_sessions,
        "scale": args.scale,
        "storage_gbps": args.storage_gbps,
        "net_gbps": args.net_gbps,
        "prefill_instances": args.prefill_instances,
        "decode_instances": args.decode_instances,
        "slo": dataclasses.asdict(setup.slo),
        "outputs_identical": identical,
        "valid": not invalid,
        "rows": rows,
    }
    if args.out_dir:
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_csv(out_dir / "agentic.csv", rows)
        _plot(out_dir / "agentic.png", rows)
        write_json(out_dir / "agentic.json", result)
    if args.json:
        write_json(args.json, result)
    if args.trace:
        write_json(args.trace, traces)
        _print_idle(traces)
    return result


def _print_idle(traces: dict[str, dict[str, Any]]) -> None:
    """Each traced run's storage links: busy and idle seconds, the idle split by cause."""
    for run, trace in traces.items():
        for iid, link in trace["links"].items():
            causes = ", ".join(f"{k} {v:.1f}" for k, v in link["idle_by_cause_s"].items() if v)
            print(f"trace {run} {iid}: busy {link['busy_s']:.1f} s, idle {link['idle_s']:.1f} s ({causes}); "
                  f"process CPU {trace['cpu_cores']:.2f} cores", flush=True)  # fmt: skip


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Throughput against ``basic`` at the same storage bandwidth and against ``oracle``, within the offline runs
    (the sweep's included) or the online ones."""

    def group(r: dict[str, Any]) -> str:
        return "online" if r["phase"] == "online" else "offline"

    for row in rows:
        same = [r for r in rows if group(r) == group(row)]
        basic = next((r for r in same if r["mode"] == "basic" and r["storage_gbps"] == row["storage_gbps"]), None)
        oracle = next((r for r in same if r["mode"] == "oracle"), None)
        row["vs_basic"] = row["turns_per_s"] / basic["turns_per_s"] if basic else None
        row["vs_oracle"] = row["turns_per_s"] / oracle["turns_per_s"] if oracle else None


def _table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    header = ["phase", "mode", "storage Gbit/s", "JCT s", "turns/s", "vs basic", "vs oracle", "TTFT s", "p90 TTFT",
              "TPOT ms", "SLO", "PEs/coloc storage MB, busy", "DEs storage MB, busy", "paths pe/de"]  # fmt: skip
    table = []
    for r in rows:
        pe = r.get("pe_storage_mb", r.get("colocated_storage_mb"))
        pe_busy = r.get("pe_storage_busy", r.get("colocated_storage_busy"))
        paths = r["read_paths"]
        table.append(
            [r["phase"], r["mode"], r["storage_gbps"] if r["storage_gbps"] is not None else "-", f"{r['jct_s']:.1f}",
             f"{r['turns_per_s']:.2f}", _ratio(r["vs_basic"]), _ratio(r["vs_oracle"]), f"{r['ttft_mean_s']:.2f}",
             f"{r['ttft_p90_s']:.2f}", f"{r['tpot_mean_s'] * 1000:.0f}", f"{r['slo_attainment']:.0%}",
             f"{pe}, {pe_busy:.0%}" if pe is not None else "-",
             f"{r['de_storage_mb']}, {r['de_storage_busy']:.0%}" if "de_storage_mb" in r else "-",
             f"{paths.get('pe', 0)}/{paths.get('de', 0)}" if paths else "-"]
        )  # fmt: skip
    return header, table


def _ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else "-"


def _print_progress(row: dict[str, Any]) -> None:
    print(
        f"{row['phase']} {row['mode']} @ {row['storage_gbps']} Gbit/s: JCT {row['jct_s']:.1f} s, "
        f"{row['turns_per_s']:.2f} turns/s, TTFT {row['ttft_mean_s']:.2f} s, TPOT {row['tpot_mean_s'] * 1000:.0f} ms, "
        f"SLO {row['slo_attainment']:.0%}, paths {row['read_paths']}, read ahead {row['prefetches']}, "
        f"failed {row['failed_turns']}, "
        f"load timeouts {row['load_timeouts']}, stored blocks recomputed {row['recomputed_blocks']}, "
        f"read twice {row['reloaded_blocks']}, preemptions {row['preemptions']}; "
        + ", ".join(f"{k} {v}" for k, v in row.items() if _is_instance_figure(k)),
        flush=True,
    )


def _is_instance_figure(key: str) -> bool:
    """Whether a row's key is an instance's or a role's figure (``p0_storage_mb``, ``de_storage_busy``, ...)."""
    owner = key.split("_", 1)[0]
    return owner in ("pe", "de", "colocated") or (owner[:1] in ("p", "d") and owner[1:].isdigit())


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    offline = [r for r in rows if r["phase"] in ("offline", "sweep")]
    for mode in ("basic", "dualpath"):
        pts = sorted({(r["storage_gbps"], r["turns_per_s"]) for r in offline if r["mode"] == mode})
        if pts:
            left.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    for mode, style in (("oracle", "--"), ("colocated", ":")):
        ref = next((r for r in offline if r["mode"] == mode), None)
        if ref:
            left.axhline(ref["turns_per_s"], linestyle=style, color="gray" if mode == "oracle" else "black", label=mode)
    left.set_xscale("log", base=2)
    left.set_xlabel("storage link per engine (Gbit/s)")
    left.set_ylabel("offline throughput (turns/s)")
    left.set_title("offline batch: throughput against storage bandwidth")
    left.legend()
    left.grid(alpha=0.3)
    online = [r for r in rows if r["phase"] == "online"]
    if online:
        names = [r["mode"] for r in online]
        xs = range(len(online))
        right.bar([x - 0.2 for x in xs], [r["ttft_mean_s"] for r in online], width=0.4, label="mean TTFT (s)")
        right.bar([x + 0.2 for x in xs], [r["slo_attainment"] for r in online], width=0.4, label="SLO attainment")
        right.set_xticks(list(xs), names)
        right.set_title("online: Poisson session arrivals")
        right.legend()
        right.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


# The engine flags each run's engines take from this benchmark instead (memory_config, the runs' stores): given, they
# would be ignored.
SET_BY_AGENTIC = {
    "kv_cache_gb": "use --memory-sessions or --num-kv-blocks",
    "swap_space_gb": "use --host-sessions or --kv-host-gb",
    "kv_write_policy": "through, on every run",
    "kv_disk_path": "a store of its own for each run",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("agent", "trace"), default="agent",
                        help="agent: DualPath-like trajectories (workloads.DUALPATH_AGENT); trace: mini-SWE-agent "
                        "sessions from --trace-folder")  # fmt: skip
    parser.add_argument("--trace-folder", default=DEFAULT_TRACE_FOLDER)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--phases", default="offline,online", help="offline (all sessions at once), online (Poisson)")
    parser.add_argument("--num-sessions", type=positive_int, default=16)
    parser.add_argument(
        "--scale", type=positive_float, default=0.03, help="multiply token lengths (context, append, output)"
    )
    parser.add_argument("--turn-scale", type=positive_float, default=0.19, help="multiply the turns per session")
    parser.add_argument("--max-turns", type=positive_int, default=64)
    parser.add_argument("--max-len", type=positive_int, default=512, help="cap on one turn's append and output tokens")
    parser.add_argument(
        "--tool-wait", type=non_negative_float, default=0.5, help="online: mean seconds of tool time before a turn"
    )
    parser.add_argument("--rate", type=non_negative_float, default=0.5, help="online: session arrivals per second")
    parser.add_argument("--storage-gbps", type=positive_float, default=0.2, help="each engine's emulated storage link")
    parser.add_argument(
        "--net-gbps", type=positive_float, default=8.0, help="each engine's emulated compute-network link"
    )
    parser.add_argument("--sweep-gbps", default="", help="offline basic and dualpath at each of these storage Gbit/s")
    parser.add_argument("--prefill-instances", type=positive_int, default=1, help="PD modes: prefill engines (P)")
    parser.add_argument("--decode-instances", type=positive_int, default=1, help="PD modes: decode engines (D)")
    parser.add_argument("--memory-sessions", type=positive_int, default=4,
                        help="device KV per engine, in sessions' longest contexts (the decode batch)")  # fmt: skip
    parser.add_argument("--host-sessions", type=positive_int, default=4,
                        help="host KV per engine, in sessions' longest contexts (loads, receives)")  # fmt: skip
    parser.add_argument(
        "--slo-ttft", type=positive_float, default=4.0, help="SLO on a turn's TTFT, seconds (the paper's 4 s)"
    )
    parser.add_argument(
        "--slo-tpot", type=positive_float, default=0.2, help="SLO on a turn's TPOT, seconds (paper: 0.05 on GPUs)"
    )
    parser.add_argument("--warm-store", action=argparse.BooleanOptionalAction, default=True,
                        help="start every run from a store holding each session's first context (computed once, "
                        "untimed)")  # fmt: skip
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench-results", help="where the CSV, PNG and JSON go ('' for none)")
    parser.add_argument("--json", metavar="PATH", type=output_path, help="also write the figures to this file")
    parser.add_argument("--trace", metavar="PATH", help="PD runs: sample the storage links and write when and why "
                        "each idled (bench/pd_trace.py) to this JSON file")  # fmt: skip
