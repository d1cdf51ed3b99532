"""``boundless bench longctx``: contexts larger than one instance, three ways, on the same trace.

A trace of many short requests and a few whose contexts exceed one instance's KV pool (``bench/longctx_trace.py``)
is served by ``--instances`` engines in this process, each with a small pool (``--num-kv-blocks``), behind one
least-loaded router, three times:

- ``separate``: independent instances. A request whose context exceeds one pool (``max_model_len``) is
  rejected at admission; one that fits waits for memory (or preempts later ones) where it was routed.
- ``move``: the same, and a running request that cannot grow where it runs (its next chunk does not fit) moves
  with its whole KV to the instance with the most room, if one can hold it, and continues there
  (``cluster/kv_migration.py``). Still one pool at most per request.
- ``lending``: each engine has a :class:`~boundless.engine.lending.LendingAgent` (rManager, DistAttention,
  partial server) over shared memory; a gManager takes their heartbeats (with the engines' own step times, to fit
  its performance model) before every step and plans with Algorithm 1; debtors move leading blocks to creditors
  (try, send, confirm) and attend to them through partials. ``max_model_len`` is the cluster's memory.

**Time.** The instances step in one thread, but each has its own clock, advanced by the wall time of its own
steps (and the moves it makes): the instances are emulated as running in parallel, as they would on machines of
their own. Arrivals are routed when the earliest clock reaches them; an instance that cannot progress waits
(its clock jumps) until something changes elsewhere. Throughput is over the span from the first arrival to the
last instance's last step. The creditor's work for a debtor's partials runs on its server thread inside the
debtor's step, so it is charged to the debtor's clock (on separate machines it would overlap).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from boundless.bench.longctx_trace import TraceRequest, TraceShape, make_trace
from boundless.bench.report import output_path, print_table, write_json
from boundless.cluster.gmanager import GManager
from boundless.cluster.kv_migration import Endpoint, migrate_request
from boundless.cluster.lending_plan import LendingThresholds
from boundless.cluster.rmanager import RManager
from boundless.config import (
    ConfigError,
    EngineConfig,
    comma_numbers,
    engine_config_from_flags,
    non_negative_float,
    positive_int,
    refuse_engine_flags,
)
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore, RequestDelta
from boundless.engine.errors import InvalidRequestError
from boundless.engine.lending import LendingAgent, LocalControlPlane, next_chunk_needs, stalled_growth
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import LoadedModel
from boundless.transport.shm import ShmTransport

SETUPS = ("separate", "move", "lending")
SERVED = ("stop", "length")
# A long request may need most of the cluster's memory: creditors lend down to 5% free, and up to 90% used.
BENCH_THRESHOLDS = LendingThresholds(creditor_max_usage=0.9, creditor_headroom=0.05)


@dataclass(frozen=True)
class LongCtxConfig:
    """The cluster each setup runs: instances, each one's pool and step budget, and the lending planner's knobs."""

    instances: int = 3
    num_kv_blocks: int = 64
    block_size: int = 16
    chunk_tokens: int = 256
    max_num_seqs: int = 16
    thresholds: LendingThresholds = BENCH_THRESHOLDS
    plan_interval_s: float = 0.0  # virtual seconds between the gManager's plans (0: before every step)
    max_steps: int = 50_000  # all instances together: a run that has not finished by then gives up

    @property
    def pool_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@dataclass
class Instance:
    """One engine of the emulated cluster, with its own clock (seconds of its own work since the start)."""

    name: str
    core: EngineCore
    transport: ShmTransport
    agent: LendingAgent | None = None
    clock: float = 0.0
    waiting_for_change: bool = False  # its last step did nothing: it waits for something elsewhere

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.core, self.transport)

    def load(self) -> int:
        """What the router balances: blocks in use here (its own and lent) and blocks its queue waits for."""
        kv = self.core.kv
        return kv.pool.num_used + sum(kv.blocks_for_tokens(r.num_tokens) for r in self.core.scheduler.waiting)


@dataclass
class SetupResult:
    """What one setup did with the trace."""

    setup: str
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)  # request id -> finish reason
    finish_s: dict[str, float] = field(default_factory=dict)  # request id -> its instance's clock when it ended
    rejected: dict[str, str] = field(default_factory=dict)  # request id -> why
    span_s: float = 0.0
    wall_s: float = 0.0
    steps: int = 0
    gave_up: bool = False
    moves: int = 0
    bytes_moved: int = 0
    round_trips: int = 0
    partial_bytes: int = 0  # queries out and partials back, DistAttention's round trips
    recomputed: int = 0
    plans: int = 0

    def served(self) -> list[str]:
        return [rid for rid, reason in self.finish.items() if reason in SERVED]


def route(instances: list[Instance]) -> Instance:
    """The least-loaded instance (the first of equals)."""
    return min(instances, key=lambda i: i.load())


class LongCtxCluster:
    """The instances of one setup and what runs between their steps (see the module)."""

    def __init__(self, setup: str, loaded: LoadedModel, base: EngineConfig, config: LongCtxConfig, directory: Path):
        self.setup = setup
        self.config = config
        self.now = 0.0
        engine = dataclasses.replace(
            base,
            cache=dataclasses.replace(
                base.cache,
                num_kv_blocks=config.num_kv_blocks,
                block_size=config.block_size,
                enable_prefix_caching=True,
                kv_host_gb=0.0,  # no host tier: a request that loses its blocks is recomputed, in every setup
            ),
            scheduler=dataclasses.replace(
                base.scheduler,
                policy="fcfs",
                max_num_batched_tokens=config.chunk_tokens,
                max_num_seqs=config.max_num_seqs,
            ),
        )
        layout = size_engine(
            dataclasses.replace(engine, model=dataclasses.replace(engine.model, max_model_len=None)),
            loaded.arch,
            loaded.dtype,
            pools=config.instances if setup == "lending" else 1,  # a request may hold the cluster's memory
            release_windows=False,  # (lending and moves take blocks by index: none goes back past a window)
        )
        self.control = LocalControlPlane()
        self.instances: list[Instance] = []
        for i in range(config.instances):
            core = EngineCore(
                engine,
                layout,
                ModelIdentity.of(loaded, layout),
                loaded.tokenizer,
                build_model_executor(loaded, engine, layout),
            )
            net = ShmTransport(directory / setup, f"i{i}", timeout_s=30)
            inst = Instance(f"i{i}", core, net)
            if setup == "lending":
                rm = RManager(
                    net.address,
                    layout.num_blocks,
                    layout.block_size,
                    core.clock,
                    reservation_timeout_s=30,
                    headroom_blocks=int(config.thresholds.creditor_headroom * layout.num_blocks),
                )
                inst.agent = self.control.add(LendingAgent(core, rm, net, self.control, timeout_s=30))
            self.instances.append(inst)
        self.gm = GManager(config.thresholds, config.plan_interval_s, math.inf, lambda: self.now)
        self._last_plan = -math.inf
        self.migrations = 0
        self.migrated_bytes = 0
        self._attempts: dict[str, int] = {}

    def close(self) -> None:
        for inst in self.instances:
            if inst.agent is not None:
                inst.agent.close()
        for inst in self.instances:
            inst.transport.close()

    # -- between steps -----------------------------------------------------------------------------------------

    def before_step(self, inst: Instance) -> None:
        """The setup's work before ``inst`` steps: the lending plan and its moves, or migrations off ``inst``."""
        if self.setup == "lending":
            self._plan()
        elif self.setup == "move":
            self._migrate_from(inst)

    def _plan(self) -> None:
        if self.now - self._last_plan < self.config.plan_interval_s:
            return
        self._last_plan = self.now
        by_address = {inst.transport.address: inst for inst in self.instances}
        for inst in self.instances:
            agent = inst.agent
            assert agent is not None
            agent.observe()
            agent.apply(agent.rm.expire())
            self.gm.on_heartbeat(agent.heartbeat())
        plan = self.gm.plan()
        for order in plan.moves:
            debtor = by_address[order.debtor]
            assert debtor.agent is not None
            start = time.perf_counter()
            debtor.agent.move_kvcache(order.request_id, order.num_blocks, order.creditor)
            debtor.clock += time.perf_counter() - start  # the debtor sends; its steps wait meanwhile
            self._wake(debtor.clock)
        # The deadlock breaker's holds and releases (cluster/lending_deadlock.py), as a served cluster's instances
        # carry them out; without them the gManager would count as held what nobody holds.
        for hold in plan.holds:
            agent = by_address[hold.instance].agent
            assert agent is not None
            if agent.hold(hold.request_id):
                self._wake(by_address[hold.instance].clock)
        for release in plan.releases:
            agent = by_address[release.instance].agent
            assert agent is not None
            if agent.release(release.request_id):
                self._wake(by_address[release.instance].clock)
        # Its grants to requests longer than one pool (cluster/lending_grants.py): they start only on one.
        for grant in self.gm.grant():
            agent = by_address[grant.instance].agent
            assert agent is not None
            if agent.grant(grant.request_id):
                self._wake(by_address[grant.instance].clock)

    def _migrate_from(self, src: Instance) -> None:
        for rid, _ in stalled_growth(next_chunk_needs(src.core), src.core.kv.pool.num_free):
            request = src.core.scheduler.requests[rid]
            end = min(request.num_tokens, request.num_computed_tokens + self.config.chunk_tokens)
            room = src.core.kv.blocks_for_tokens(end)  # all its blocks, after its next chunk
            others = [i for i in self.instances if i is not src]
            dst = max(others, key=lambda i: i.core.kv.pool.num_free)
            if dst.core.kv.pool.num_free < room:
                continue  # nowhere holds it: it waits (or is preempted) where it is
            attempt = self._attempts.get(rid, 0)
            self._attempts[rid] = attempt + 1
            start = time.perf_counter()
            moved = migrate_request(src.endpoint, dst.endpoint, rid, attempt)
            src.clock += time.perf_counter() - start
            if moved is not None:
                self.migrations += 1
                self.migrated_bytes += moved.num_bytes
                dst.clock = max(dst.clock, src.clock)  # it continues there once it has arrived
                self._wake(src.clock)

    def _unstick(self) -> bool:
        """With every instance that has work waiting for a change, the setup's work once more on the state their
        last steps left (a plan runs before a step, so the step that stalled was never planned for): whether it
        woke anyone."""
        stuck = [i for i in self.instances if i.core.has_unfinished()]
        if not stuck or self.setup == "separate":
            return False
        self.now = max(self.now, *(i.clock for i in stuck))
        if self.setup == "lending":
            self._last_plan = -math.inf
            self._plan()
        else:
            for inst in stuck:
                self._migrate_from(inst)
        return any(not i.waiting_for_change for i in stuck)

    def _wake(self, at: float) -> None:
        for inst in self.instances:
            if inst.waiting_for_change:
                inst.waiting_for_change = False
                inst.clock = max(inst.clock, at)

    # -- the run -----------------------------------------------------------------------------------------------

    def _mark(self) -> tuple[tuple[int, int, int], ...]:
        """What a step may change that another step depends on: each instance's computed tokens, preemptions and free
        blocks. A step that computes nothing may still evict its request (it cannot grow, and the rest of its pool holds
        blocks lent to others), which frees its blocks here and, through its release, on its creditors; taken for no
        change, it left the instances waiting for that room waiting for good, and a run could end with them."""
        return tuple(
            (i.core.counters.computed_tokens, i.core.scheduler.stats.num_preemptions, i.core.kv.pool.num_free)
            for i in self.instances
        )

    def step(self, inst: Instance) -> list[RequestDelta]:
        before = self._mark()
        start = time.perf_counter()
        deltas = inst.agent.step() if inst.agent is not None else inst.core.step()
        inst.clock += time.perf_counter() - start
        if self._mark() == before and not deltas:
            inst.waiting_for_change = True
        else:
            self._wake(inst.clock)
        return deltas

    def run(self, trace: list[TraceRequest]) -> SetupResult:
        result = SetupResult(self.setup)
        pending = deque(sorted(trace, key=lambda r: r.arrival_s))
        start_wall = time.perf_counter()
        first = pending[0].arrival_s if pending else 0.0
        for inst in self.instances:
            inst.clock = first
        while True:
            active = [i for i in self.instances if i.core.has_unfinished() and not i.waiting_for_change]
            next_arrival = pending[0].arrival_s if pending else math.inf
            if not active and not pending:
                if self._unstick():
                    continue
                break  # done, or every instance left waits for a change that will not come
            if pending and (not active or next_arrival <= min(i.clock for i in active)):
                self.now = max(self.now, next_arrival)
                self._arrive(pending.popleft(), result)
                self._wake(self.now)
                continue
            inst = min(active, key=lambda i: i.clock)
            self.now = max(self.now, inst.clock)
            self.before_step(inst)
            for delta in self.step(inst):
                result.tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
                if delta.finished:
                    result.finish[delta.request_id] = delta.finish_reason or ""
                    result.finish_s[delta.request_id] = inst.clock
            result.steps += 1
            if result.steps >= self.config.max_steps:
                result.gave_up = True
                break
        result.span_s = max(i.clock for i in self.instances) - first
        result.wall_s = time.perf_counter() - start_wall
        result.moves, result.bytes_moved = self.migrations, self.migrated_bytes
        for inst in self.instances:
            result.recomputed += inst.core.scheduler.stats.num_recomputed
            if inst.agent is not None:
                result.moves += inst.agent.stats.moves_out
                result.bytes_moved += inst.agent.stats.bytes_out
                partials = inst.agent.data.counters()
                result.round_trips += partials.round_trips
                result.partial_bytes += partials.round_trip_bytes
        result.plans = self.gm.counters.plans
        return result

    def _arrive(self, request: TraceRequest, result: SetupResult) -> None:
        inst = route(self.instances)
        inst.clock = max(inst.clock, request.arrival_s)
        params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
        try:
            inst.core.add_request(request.request_id, list(request.prompt), params, arrival_time=request.arrival_s)
        except InvalidRequestError as e:
            result.rejected[request.request_id] = str(e)


def run_setup(
    setup: str, loaded: LoadedModel, base: EngineConfig, config: LongCtxConfig, trace: list[TraceRequest]
) -> SetupResult:
    directory = Path(
        tempfile.mkdtemp(prefix="boundless-longctx-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    cluster = LongCtxCluster(setup, loaded, base, config, directory)
    try:
        return cluster.run(trace)
    finally:
        cluster.close()
        shutil.rmtree(directory, ignore_errors=True)


# -- the report -------------------------------------------------------------------------------------------------


def compare_outputs(results: list[SetupResult]) -> tuple[bool, int]:
    """Whether every request all setups served got the same greedy tokens everywhere, and how many such."""
    common = set.intersection(*(set(r.served()) for r in results)) if results else set()
    same = all(r.tokens[rid] == results[0].tokens[rid] for r in results for rid in common)
    return same, len(common)


def row_of(result: SetupResult, trace: list[TraceRequest], config: LongCtxConfig) -> dict[str, Any]:
    by_id = {r.request_id: r for r in trace}
    served = result.served()
    out_tokens = sum(len(result.tokens[rid]) for rid in served)
    all_tokens = out_tokens + sum(len(by_id[rid].prompt) for rid in served)
    longest = max((by_id[rid].context for rid in served), default=0)
    span = max(result.span_s, 1e-9)
    unserved = [
        r.request_id for r in trace if r.request_id not in result.finish and r.request_id not in result.rejected
    ]
    return {
        "setup": result.setup,
        "requests": len(trace),
        "served": len(served),
        "rejected": len(result.rejected),
        "unserved": len(unserved),
        "long_served": sum(1 for rid in served if by_id[rid].long),
        "longest_context": longest,
        "longest_x_pool": round(longest / config.pool_tokens, 2),
        "span_s": round(result.span_s, 2),
        "output_tok_s": round(out_tokens / span, 2),
        "tok_s": round(all_tokens / span, 1),
        "req_s": round(len(served) / span, 3),
        "moves": result.moves,
        "mb_moved": round(result.bytes_moved / 1e6, 2),
        "round_trips": result.round_trips,
        "mb_partials": round(result.partial_bytes / 1e6, 2),
        "mb_between": round((result.bytes_moved + result.partial_bytes) / 1e6, 2),
        "recomputed": result.recomputed,
        "steps": result.steps,
        "gave_up": result.gave_up,
        "wall_s": round(result.wall_s, 1),
        "long_latency_s": {
            rid: round(result.finish_s[rid] - by_id[rid].arrival_s, 2) for rid in served if by_id[rid].long
        },
        "rejected_ids": sorted(result.rejected),
        "unserved_ids": unserved,
    }


TABLE = ("setup", "served", "rejected", "unserved", "long_served", "longest_x_pool", "span_s", "tok_s",
         "output_tok_s", "req_s", "moves", "mb_moved", "round_trips", "mb_partials", "recomputed")  # fmt: skip


def run_all(
    loaded: LoadedModel,
    base: EngineConfig,
    config: LongCtxConfig,
    trace: list[TraceRequest],
    setups: tuple[str, ...] = SETUPS,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every setup on the same trace; the rows, the comparison of outputs, and the goals' ratios."""
    # Untimed, so that no setup pays the first steps' one-time costs (kernels, allocator) in its figures.
    run_setup(setups[0], loaded, base, config, [r for r in trace if not r.long][: config.instances])
    results = []
    for setup in setups:
        log(f"-- {setup}")
        results.append(run_setup(setup, loaded, base, config, trace))
    rows = [row_of(r, trace, config) for r in results]
    identical, compared = compare_outputs(results)
    by = {r["setup"]: r for r in rows}
    goals: dict[str, Any] = {}
    if "lending" in by and "separate" in by:
        goals["lending_vs_separate_tok_s"] = _ratio(by["lending"]["tok_s"], by["separate"]["tok_s"])
        goals["lending_vs_separate_req_s"] = _ratio(by["lending"]["req_s"], by["separate"]["req_s"])
    if "lending" in by and "move" in by:
        goals["move_vs_lending_bytes"] = _ratio(by["move"]["mb_between"], by["lending"]["mb_between"])
    if "lending" in by:
        goals["lending_longest_x_pool"] = by["lending"]["longest_x_pool"]
    return {"rows": rows, "outputs_identical": identical, "outputs_compared": compared, "goals": goals}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


# The engine flags each instance's engine takes from this benchmark instead (LongCtxCluster): given, they would be
# ignored.
SET_BY_LONGCTX = {
    "kv_cache_gb": "use --num-kv-blocks: 64 blocks by default",
    "max_num_seqs": "use --max-seqs",
    "max_num_batched_tokens": "use --chunk-tokens",
    "policy": "fcfs on every instance",
    "enable_prefix_caching": "on in every setup",
    "kv_host_gb": "no host memory: a request that loses its blocks is recomputed",
    "swap_space_gb": "no host memory: a request that loses its blocks is recomputed",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, default=3, help="engine instances (2-4)")
    parser.add_argument("--chunk-tokens", type=positive_int, default=256, help="each instance's token budget per step")
    parser.add_argument("--max-seqs", type=int, default=16, help="each instance's most requests per step")
    parser.add_argument("--num-short", type=positive_int, default=30, help="short requests in the trace")
    parser.add_argument("--long-factors", default="0.75,1.5,2.5",
                        help="the long requests' prompts, in multiples of one instance's pool")  # fmt: skip
    parser.add_argument(
        "--rate", type=non_negative_float, default=1.0, help="Poisson arrivals per second (0: all at once)"
    )
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--creditor-max-usage", type=float, default=0.9, help="U_thres of the lending planner")
    parser.add_argument("--creditor-headroom", type=float, default=0.05, help="share of a creditor never lent")
    parser.add_argument("--debtor-max-batch", type=int, default=8, help="β_thres of the lending planner")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads while the setups run (the instances stand for machines of their own: one "
                        "thread each keeps them from contending for this machine's cores)")  # fmt: skip
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench-results", help="where the CSV and JSON go ('' for none)")
    parser.add_argument("--json", metavar="PATH", type=output_path, help="also write the figures to this file")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from boundless.model.loader import load_configured_model

    long_factors = tuple(comma_numbers("--long-factors", args.long_factors, float, positive=True))  # (before the load)
    if not args.instances >= 2:
        raise SystemExit(f"--instances: at least 2 (a context larger than one instance), not {args.instances}")
    if not 0 < args.creditor_max_usage <= 1:
        raise SystemExit(f"--creditor-max-usage: a share of the pool in (0, 1], not {args.creditor_max_usage}")
    refuse_engine_flags(args, "bench longctx", SET_BY_LONGCTX)
    base = engine_config_from_flags(args)
    loaded = load_configured_model(base.model)
    setups = tuple(s.strip() for s in args.setups.split(",") if s.strip())
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise SystemExit(f"unknown setups {unknown}; choose from {', '.join(SETUPS)}")
    config = LongCtxConfig(
        instances=args.instances,
        num_kv_blocks=base.cache.num_kv_blocks or 64,
        block_size=base.cache.block_size,
        chunk_tokens=args.chunk_tokens,
        max_num_seqs=args.max_seqs,
        thresholds=LendingThresholds(
            debtor_max_batch=args.debtor_max_batch,
            creditor_max_usage=args.creditor_max_usage,
            creditor_headroom=args.creditor_headroom,
        ),
    )
    shape = TraceShape(num_short=args.num_short, long_factors=long_factors)
    trace = make_trace(shape, config.pool_tokens, loaded.arch.vocab_size, args.rate, args.bench_seed)
    longs = [r.context for r in trace if r.long]
    print(
        f"{len(trace)} requests ({len(longs)} long: contexts {longs} tokens); {config.instances} instances of "
        f"{config.num_kv_blocks} blocks x {config.block_size} = {config.pool_tokens} tokens; rate {args.rate}/s",
        flush=True,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = run_all(loaded, base, config, trace, setups)
    except ConfigError as e:  # (the engines' step budget is this command's --chunk-tokens: named so)
        raise ConfigError(str(e).replace("--max-num-batched-tokens", "--chunk-tokens")) from None
    finally:
        torch.set_num_threads(threads)
    result["config"] = {
        "model": base.model.model,
        "instances": config.instances,
        "pool_tokens": config.pool_tokens,
        "chunk_tokens": config.chunk_tokens,
        "rate": args.rate,
        "seed": args.bench_seed,
        "long_contexts": longs,
        "num_short": shape.num_short,
        "threads": args.threads,
    }
    print_table(TABLE, [[r[k] for k in TABLE] for r in result["rows"]])
    print(
        f"outputs_identical: {result['outputs_identical']} ({result['outputs_compared']} requests served by every "
        f"setup); goals: {result['goals']}"
    )
    for r in result["rows"]:
        print(f"{r['setup']}: long requests served, seconds from arrival to end: {r['long_latency_s']}")
        if r["rejected_ids"]:
            print(f"{r['setup']}: rejected {r['rejected_ids']} (context over max_model_len)")
        if r["unserved_ids"]:
            print(f"{r['setup']}: not finished {r['unserved_ids']}")
    if args.out_dir:
        out = Path(args.out_dir)
        write_json(out / "longctx.json", result)
        _write_csv(out / "longctx.csv", result["rows"])
    if args.json:
        write_json(args.json, result)
    return result


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = [k for k in rows[0] if not isinstance(rows[0][k], (list, dict))] if rows else []
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
