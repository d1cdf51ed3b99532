"""A plain cluster simulated in windows of virtual time, its engines in several processes (``--sync-interval-s``,
``--workers``).

The serial :class:`~boundless.sim.simulator.Simulator` runs every engine and the dispatcher on one event heap. Here
the run is cut into windows ``[T, T + D)`` of virtual time, and each window is run in three phases:

1. The main process (:class:`WindowedSimulator`: the programs, the real ``Dispatcher`` with its router and process
   table, the heartbeats' ``expire``) routes every call that arrives in the window, at its arrival time, through the
   real ``Dispatcher.submit`` and ``add_done``, and ships each to the shard that owns its instance (:class:`CallAdd`,
   the program's global service as the ``Send`` carries it).
2. Each shard (:class:`EngineShard`: some instances' engines, run by the serial simulator's own event loop with a
   horizon) adds the calls at their arrival times and runs its engines' steps up to ``T + D``, and returns the calls
   that finished in the window (:class:`CallEnd`) with when.
3. Main applies them in the order (time, instance, order within the instance) to the dispatcher (``receive``) and the
   programs, at their finish times; a call that a finish at ``t`` makes after a tool wait ``w`` arrives at
   ``max(t + w, T + D)``.

So the router hears of a finish only at the end of its window, up to ``D`` late: its staleness, as a real router hears
deltas over the network. Instances share nothing in a plain cluster (no roles, KV lending, failures, shared storage
links or contended step model, which the command line refuses), so a shard's engines run exactly as they would beside
the others, and the results are a function of the flags, the seed and ``D`` alone: the same for any number of workers
(``tests/sim/test_parallel_sim.py``). Windows in which nothing is due are skipped (the grid of ``k * D`` stays).

``--workers W`` is W processes, one a core: the first shard runs in the main process, between its routing (with fewer
instances: :func:`shard_owners`; its windows in turn when main would otherwise wait for the workers' answers, and
always after the workers have their next window: :meth:`ShardPool.collect`), the others each in a forked process
(``multiprocessing``'s fork context, as ``--jobs``), over a pipe: a window's calls out, its finished calls back, token
ids as packed 32-bit ints. A worker's exception ends the run with one error in main (``SimulationWorkerError``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import multiprocessing
import struct
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

from mypy_extensions import mypyc_attr

from boundless.bench.workloads import ProgramSpec
from boundless.cluster.dispatcher import AddResult, Send
from boundless.config import ClusterConfig, EngineConfig
from boundless.engine.core import RequestDelta, require_context_room
from boundless.engine.errors import InvalidRequestError
from boundless.engine.sampling_params import SamplingParams
from boundless.gc_quiet import quiet_collector
from boundless.programs.ref import ProgramRef
from boundless.sim.cost import StepCost
from boundless.sim.engine import SimulatedModel
from boundless.sim.profiles import HardwareProfile
from boundless.sim.simulator import _CALL, Placement, Progress, SimResult, Simulator, _Call

# The sync interval a run with --workers > 1 takes when none is given: 20 ms of virtual time, a few decode passes.
DEFAULT_SYNC_INTERVAL_S = 0.02
# Main's own work (the programs, the dispatcher, the messages) for a second of its cluster's engines' work, as measured
# on the light hour (1,152 instances, two processes): main keeps fewer instances than a worker, so that it and each
# worker have about as much to do (shard_owners). The hour (docs/simulation.md, Speed): at 0.25 main ran 724 CPU s
# against the worker's 818, at 0.19 677 against 655, at 0.21 685 against 719.
MAIN_WORK_RATIO = 0.20


def shard_owners(instances: int, workers: int, main_ratio: float = MAIN_WORK_RATIO) -> list[list[int]]:
    """The instances (by index) of each of ``workers`` shards, the first main's: main keeps a share
    ``(1 - main_ratio * (workers - 1)) / workers`` of them (none where that is not positive), the other shards the rest
    equally, interleaved (each instance to the shard furthest behind its share; ties to the lower). Where the instances
    go never changes a run's rows, only how the work is shared."""
    main = max(0.0, (1 - main_ratio * (workers - 1)) / workers)
    shares = [main] + [(1 - main) / (workers - 1)] * (workers - 1) if workers > 1 else [1.0]
    owners: list[list[int]] = [[] for _ in range(workers)]
    for i in range(instances):
        behind = [share * (i + 1) - len(owned) for share, owned in zip(shares, owners, strict=True)]
        owners[behind.index(max(behind))].append(i)
    return owners


def pack_tokens(tokens: list[int]) -> bytes:
    """Token ids as 32-bit ints for the pipe (vocabularies are far below 2**31): ``struct`` packs a list twice as fast
    as ``array`` takes it."""
    return struct.pack(f"{len(tokens)}i", *tokens)


def unpack_tokens(data: bytes) -> list[int]:
    return memoryview(data).cast("i").tolist()


@dataclass(frozen=True)
class CallAdd:
    """A call main routed to an instance: add it there at ``at_s``, with the program as the dispatcher's ``Send``
    carries it (its global service: PLAS and ATLAS read it)."""

    at_s: float
    instance_id: str
    request_id: str
    prompt: bytes  # pack_tokens of the prompt's token ids
    max_tokens: int | None
    program_id: str
    thread_id: str | None
    parents: tuple[str, ...]
    service_s: float | None
    total_service_s: float | None
    waiting_s: float | None


@dataclass(frozen=True)
class Window:
    """Main to a shard: run to ``end_s``, adding these calls on the way."""

    end_s: float
    adds: list[CallAdd]


@dataclass(frozen=True)
class CallEnd:
    """A shard to main: a call finished at ``at_s`` on ``instance``, with all of its output (its deltas in one: main's
    dispatcher and programs use only their tokens until the last, which carries the rest)."""

    at_s: float
    instance: int
    order: int  # the instance's deltas' order, for ties
    request_id: str
    tokens: bytes  # pack_tokens of the call's output token ids
    finish_reason: str | None
    arrival_s: float
    finish_s: float | None
    service_s: float


@dataclass(frozen=True)
class WindowDone:
    """A shard's window: the calls that finished in it, and when its next event is (``math.inf``: idle)."""

    ends: list[CallEnd]
    next_event_s: float


@dataclass(frozen=True)
class ShardTotals:
    """A shard's counters at the end of a run, and the CPU seconds its process spent running windows."""

    num_steps: int
    num_scheduled: int
    num_steps_alone: int
    num_preemptions: int
    last_event_s: float
    cpu_s: float


@dataclass(frozen=True)
class WorkerFailed:
    """A worker's exception, as text (sent in place of its answer)."""

    traceback: str


@mypyc_attr(native_class=False)  # (compiled, a class that derives from RuntimeError must stay a Python class)
class SimulationWorkerError(RuntimeError):
    """A worker process failed (its traceback in the message), or went away without a word."""


class EngineShard(Simulator):
    """Some instances' engines, run a window at a time by the serial simulator's event loop: main's calls are added at
    their arrival times, and the calls that finish are kept for main, in place of a dispatcher and programs."""

    def __init__(
        self,
        config: EngineConfig,
        model: SimulatedModel,
        cost: StepCost | None,
        seed: int,
        instances: int,
        cluster: ClusterConfig | None,
        profile: HardwareProfile | None,
        *,
        fast_forward: bool,
        owned: Sequence[int],
    ) -> None:
        super().__init__(config, model, cost, seed, instances, cluster, profile, fast_forward=fast_forward, owned=owned)
        self.dispatcher = None  # main routes; a shard's loop has no heartbeat to run
        self._outputs: dict[str, list[int]] = {}  # request -> its output so far (sent when it finishes)
        self._ends: list[CallEnd] = []
        self._order = itertools.count()

    def run_window(self, window: Window) -> WindowDone:
        for add in window.adds:
            self._at(add.at_s, _CALL, (add,))
        self._advance(window.end_s)
        ends, self._ends = self._ends, []
        return WindowDone(ends, self._events[0][0] if self._events else math.inf)

    def totals(self, cpu_s: float) -> ShardTotals:
        return ShardTotals(
            self.num_steps, self.num_scheduled, self.num_steps_alone, self.num_preemptions(), self.clock.now, cpu_s
        )

    def _submit(self, add: CallAdd) -> None:  # type: ignore[override]  # (the loop's _CALL events: main's calls)
        params = self._params.get(add.max_tokens)
        if params is None:  # as the serial simulator makes them (one per output length)
            params = self._params[add.max_tokens] = SamplingParams(
                max_tokens=add.max_tokens, ignore_eos=True, detokenize=False
            )
        program = ProgramRef(
            add.program_id, add.thread_id, add.parents, add.service_s, add.total_service_s, add.waiting_s
        )
        try:
            self.instances[add.instance_id].core.add_request(
                add.request_id, unpack_tokens(add.prompt), params, program=program
            )
        except InvalidRequestError as e:  # main checks what the engine checks: this is a bug, not a refused call
            raise RuntimeError(
                f"instance {add.instance_id} refused call {add.request_id} that main admitted: {e}"
            ) from e
        self._ready.add(add.instance_id)

    def _on_delta(self, instance_id: str, delta: RequestDelta) -> None:
        rid = delta.request_id
        output = self._outputs.get(rid)
        if output is None:
            output = self._outputs[rid] = []
        output += delta.new_token_ids
        if delta.finished:
            del self._outputs[rid]
            self._ends.append(
                CallEnd(
                    self.clock.now,
                    int(instance_id),
                    next(self._order),
                    rid,
                    pack_tokens(output),
                    delta.finish_reason,
                    delta.arrival_time,
                    delta.finish_time,
                    delta.service_s,
                )
            )


def _serve(conn: Connection, make_shard: Callable[[Sequence[int]], EngineShard], owned: Sequence[int]) -> None:
    """A worker process: build the shard, then answer windows until main sends None (then the shard's totals)."""
    try:
        shard = make_shard(owned)
        conn.send(None)  # ready
        with quiet_collector():  # as the serial run (gc_quiet.py)
            cpu_start = time.process_time()
            while (window := conn.recv()) is not None:
                conn.send(shard.run_window(window))
            conn.send(shard.totals(time.process_time() - cpu_start))
    except BaseException:  # every failure becomes one error in main
        with contextlib.suppress(OSError):  # (unless main went away)
            conn.send(WorkerFailed(traceback.format_exc()))
    finally:
        conn.close()


class ShardPool:
    """The shards: the first in this process (its engines run between main's routing), each other in a forked worker
    process. The same calls either way, so the split never changes a run."""

    def __init__(self, make_shard: Callable[[Sequence[int]], EngineShard], owners: Sequence[Sequence[int]]) -> None:
        self._local: EngineShard | None = None
        self._queued: deque[Window] = deque()  # the local shard's windows, until run
        self._done: deque[WindowDone] = deque()  # the local shard's answers, until collected
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        # Forked (as --jobs) before this process builds its own engines (the workers would copy them): they start with
        # the modules (torch too) imported, and build their engines at once.
        context = multiprocessing.get_context("fork")
        try:
            for k, owned in enumerate(owners[1:], start=1):
                parent, child = context.Pipe()
                proc = context.Process(
                    target=_serve, args=(child, make_shard, owned), name=f"sim-worker-{k}", daemon=True
                )
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            if owners[0]:
                self._local = make_shard(owners[0])
            for k in range(len(self._conns)):
                self._recv(k)  # ready
        except BaseException:
            self.kill()
            raise

    def dispatch(self, windows: Sequence[Window]) -> None:
        """Start a window on every shard, one ``Window`` a shard: the workers run it meanwhile (after any window they
        run now); the shard in this process runs it in :meth:`collect`."""
        for conn, window in zip(self._conns, windows[1:], strict=True):
            conn.send(window)
        if self._local is not None:
            self._queued.append(windows[0])

    def collect(self) -> list[WindowDone]:
        """The shards' answers to the oldest window dispatched and not collected. The shard in this process runs its
        windows here, in turn: the oldest one if it has not yet, then the next ones while a worker's answer is not
        in. So this process goes back to routing (and the workers get their next window) as soon as the workers have
        answered, and runs its own engines while it would otherwise wait; a shard's windows and answers are the same
        whenever it runs them."""
        if self._local is not None:
            if not self._done:
                self._run_local()
            while self._queued and not all(conn.poll() for conn in self._conns):
                self._run_local()
        done = [self._done.popleft()] if self._local is not None else []
        return done + [self._recv(k) for k in range(len(self._conns))]

    def _run_local(self) -> None:
        assert self._local is not None
        self._done.append(self._local.run_window(self._queued.popleft()))

    def finish(self) -> list[ShardTotals]:
        """The shards' totals (the local shard's CPU is this process's, counted as 0); the workers exit."""
        for conn in self._conns:
            conn.send(None)
        assert not self._queued, "a window of this process's shard was dispatched and never collected"
        totals = [self._local.totals(0.0)] if self._local is not None else []
        totals += [self._recv(k) for k in range(len(self._conns))]
        for proc in self._procs:
            proc.join()
        return totals

    def kill(self) -> None:
        """Stop the workers (after an error): none is left behind."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()

    def _recv(self, k: int):  # type: ignore[no-untyped-def]
        try:
            answer = self._conns[k].recv()
        except EOFError:
            raise SimulationWorkerError(
                f"simulation worker {k + 1} exited without an answer (exit code {self._procs[k].exitcode})"
            ) from None
        if isinstance(answer, WorkerFailed):
            raise SimulationWorkerError(f"simulation worker {k + 1} failed:\n{answer.traceback}")
        return answer


@dataclass(frozen=True)
class _Flight:
    """A window the shards run while main routes the next (pipelined): its end, and whether it added calls."""

    end: float
    adds: bool


class WindowedSimulator(Simulator):
    """A plain cluster run in windows of ``sync_interval_s`` of virtual time, its instances in ``workers`` shards
    (:func:`shard_owners`; the first in this process): the programs, the dispatcher and the results here, the engines
    in the shards (module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        model: SimulatedModel,
        cost: StepCost | None = None,
        seed: int = 0,
        instances: int = 1,
        cluster: ClusterConfig | None = None,
        profile: HardwareProfile | None = None,
        fast_forward: bool = True,
        sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
        workers: int = 1,
        pipeline: bool = False,
    ) -> None:
        cluster = cluster or ClusterConfig(instances=instances)
        if cluster.disaggregated or cluster.kv_lending == "on":
            raise ValueError("a windowed run simulates plain instances: no prefill/decode roles, no KV lending")
        if getattr(cost or (profile.step if profile else None), "contended", False):
            raise ValueError("a windowed run needs instances that share nothing: not a contended step model")
        if not (math.isfinite(sync_interval_s) and sync_interval_s > 0):
            raise ValueError(f"sync_interval_s must be a positive number of seconds (got {sync_interval_s})")
        if not 1 <= workers <= instances:
            raise ValueError(f"workers must be between 1 and the instances ({instances}), not {workers}")
        super().__init__(config, model, cost, seed, instances, cluster, profile, fast_forward=fast_forward, owned=())
        self.sync_interval_s = sync_interval_s
        self.workers = workers
        self.pipeline = pipeline
        owners = shard_owners(instances, workers)
        self._shard_of = {str(i): k for k, owned in enumerate(owners) for i in owned}
        self._outbox: list[list[CallAdd]] = [[] for _ in range(workers)]
        self._not_before = -math.inf  # calls made from now on arrive no earlier (the window being applied has run)
        self._totals: list[ShardTotals] = []
        make = functools.partial(
            EngineShard, config, model, cost, seed, instances, cluster, profile, fast_forward=fast_forward
        )
        self._pool = ShardPool(lambda owned: make(owned=owned), owners)

    def _run(self, programs: list[ProgramSpec], progress: Progress | None) -> list[SimResult]:
        sims = self._arrivals(programs)
        try:
            self._windows(progress)
            self._totals = self._pool.finish()
        except BaseException:
            self._pool.kill()
            raise
        self.num_steps = sum(t.num_steps for t in self._totals)
        self.num_scheduled = sum(t.num_scheduled for t in self._totals)
        self.num_steps_alone = sum(t.num_steps_alone for t in self._totals)
        self.clock.now = max([self.clock.now, *(t.last_event_s for t in self._totals)])
        return self._results(sims)

    def _windows(self, progress: Progress | None) -> None:
        """Window after window until nothing is left to do: main's events (arrivals, calls) routed, the shards run,
        their finished calls applied. A window is ``[k * D, (k + 1) * D)``; those in which nothing can happen are
        skipped. Pipelined, main routes window k while the shards run window k - 1, and applies that window's finished
        calls once window k is under way: the calls they make arrive from window k + 1 on."""
        d, pool = self.sync_interval_s, self._pool
        k, flight, shards_next = -1, None, math.inf
        while True:
            after = self._next_window(k, flight, shards_next)
            if after is None:
                if flight is not None:
                    pool.collect()  # (a window that ran nothing)
                return
            k = after
            end = (k + 1) * d
            self._advance(end)  # route the window's calls (and run the heartbeats due)
            outbox, self._outbox = self._outbox, [[] for _ in range(self.workers)]
            # Pipelined, the window goes out before the window before's answers come back: each worker finds it
            # queued when it ends that one (no wait for main, nor for the slower worker), and main applies those
            # answers while the workers run it.
            pool.dispatch([Window(end, adds) for adds in outbox])
            done = [] if self.pipeline and flight is None else pool.collect()
            shards_next = min((w.next_event_s for w in done), default=math.inf)
            self._apply(done, end)
            flight = _Flight(end, any(outbox)) if self.pipeline else None
            if progress is not None:
                progress(self.clock.now)

    def _next_window(self, k: int, flight: _Flight | None, shards_next: float) -> int | None:
        """The window after ``k`` to run: the next one, or, where nothing is due before it, the one something is due
        in (None: nothing is left). ``shards_next``: the shards' earliest event, as of their last answers; a window
        in flight (pipelined) that may have run something makes that unknown, and the next window is run."""
        if flight is not None and (flight.adds or shards_next < flight.end):
            return k + 1
        due = min(self._events[0][0] if self._events else math.inf, shards_next)
        if due == math.inf:
            return None
        return max(k + 1, self._window_of(due))

    def _apply(self, done: list[WindowDone], not_before: float) -> None:
        """The shards' finished calls, in the order (time, instance, order), to the dispatcher and the programs at
        their finish times; the calls they make arrive at ``not_before`` at the earliest."""
        self._not_before = not_before
        clock = self.clock
        for e in sorted((e for w in done for e in w.ends), key=lambda e: (e.at_s, e.instance, e.order)):
            clock.now = e.at_s
            self._on_delta(str(e.instance), _delta(e))

    def _dispatcher_now(self) -> float:
        """The router hears of a finish at the end of its window: its process table records it then, and its clock
        never goes back (the table's expiry scans in the order of activity, which a clock going back spoils)."""
        return max(self.clock.now, self._not_before)

    def _window_of(self, t: float) -> int:
        """The window ``k`` with ``k * D <= t < (k + 1) * D`` (on the grid, whatever the float division rounds to)."""
        d = self.sync_interval_s
        k = int(t // d)
        while (k + 1) * d <= t:
            k += 1
        while k > 0 and k * d > t:
            k -= 1
        return k

    def _at(self, t: float, kind: int, payload: object) -> None:
        super()._at(max(t, self._not_before), kind, payload)

    def _add(self, call: _Call, send: Send) -> AddResult:
        """Main's side of an add: refused here as the engine would refuse it (its context), else placed now and sent to
        its shard with the window's other calls."""
        try:
            require_context_room(len(send.prompt), send.params.max_tokens, self.max_model_len, prompt_only=False)
        except InvalidRequestError as e:
            if self.dispatcher is None:
                self._refused(call)
            return AddResult("invalid", str(e), e)
        program = send.program
        assert program is not None and send.resume is None and send.handoff is None
        self._calls[send.request_id] = call
        now = self.clock.now
        self.placements.append(
            Placement(send.request_id, call.program.spec.program_id, send.instance_id, len(send.prompt), now)
        )
        self._outbox[self._shard_of[send.instance_id]].append(
            CallAdd(
                now,
                send.instance_id,
                send.request_id,
                pack_tokens(send.prompt),
                send.params.max_tokens,
                program.program_id,
                program.thread_id,
                program.parent_thread_ids,
                program.service_s,
                program.total_service_s,
                program.waiting_s,
            )
        )
        return AddResult("ok")

    def num_preemptions(self) -> int:
        return sum(t.num_preemptions for t in self._totals)

    def helper_cpu_s(self) -> list[float]:
        return [t.cpu_s for t in self._totals[1:]]  # (the first shard runs in this process)


def _delta(end: CallEnd) -> RequestDelta:
    """A finished call as the one delta main's dispatcher and programs are told."""
    return RequestDelta(
        end.request_id,
        unpack_tokens(end.tokens),
        "",
        [],
        True,
        end.finish_reason,
        arrival_time=end.arrival_s,
        finish_time=end.finish_s,
        service_s=end.service_s,
        instance=str(end.instance),
    )
