"""The engine loop in a background thread, and its asyncio front.

``EngineCore`` is synchronous. ``EngineLoop`` runs it in a thread that steps while there is work
and sleeps otherwise, handing every delta to a sink. Bookkeeping (adding, aborting, scheduling,
applying results) happens under one lock; the model runs outside it, so new requests join the
running batch at the next step and a caller never waits for a forward pass to add or abort.

``AsyncEngine`` routes each request's deltas to an asyncio queue, for the HTTP server in the
same process; a cluster instance (a Ray actor) gives the loop a sink of its own.

A loop given a way to ``rebuild`` its engine and a restart policy starts a fresh engine in place of one that lost a
part (:class:`~boundless.engine.errors.EngineLost`: a rank of a model split over devices), as the cluster restarts a
lost instance (``cluster/restarts.py``): the requests in flight end with an error, the server answers unavailable
meanwhile, and the fresh engine (an empty KV cache) takes requests again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

from boundless.engine.core import EngineCore, EngineStats, RequestDelta, Resume
from boundless.engine.errors import EngineLost
from boundless.engine.executor import PendingStep
from boundless.engine.handoff import HandoffPlan, IntakeAnswer, IntakePlan
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import SchedulerOutput
from boundless.engine.step_watch import StepReport, StepWatch
from boundless.engine.structured_output import check_structured_output
from boundless.model.lora import LoRARequest
from boundless.model.pooling import EmbeddingPooling
from boundless.programs.ref import ProgramRef

if TYPE_CHECKING:
    from boundless.cluster.restarts import Restarts

log = logging.getLogger(__name__)

# The id of the one engine of a loop, in its restart policy's records.
ENGINE_ID = "0"


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the caller should retry later."""

    def __init__(self, retry_after_s: float = 1.0) -> None:
        super().__init__("the server is busy: too many requests are waiting")
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine loop has stopped."""


# The stop reason of a request the server ended because it is shutting down (SIGINT, SIGTERM): the HTTP layer answers
# it with a 503 (server_shutting_down), not an engine error.
SHUTTING_DOWN = "the server is shutting down; retry the request on another server or once this one is back"


def engine_stopped(error: BaseException) -> str:
    """The stop reason of the requests in flight when the engine loop stopped by ``error`` (outside a step: a step's
    own failure fails its requests and the loop goes on); the HTTP layer answers them as an engine error."""
    return f"the engine stopped after an error ({type(error).__name__}: {error}); retry on another server or instance"


class ShuttingDownError(EngineDeadError):
    """A request submitted after the server began to shut down."""

    def __init__(self) -> None:
        super().__init__(SHUTTING_DOWN)


class StepHooks(Protocol):
    """What runs in the loop besides the engine's steps (KV lending: ``cluster/lending_instance.py``)."""

    def between_steps(self) -> list[RequestDelta]:
        """Called under the loop's lock before each schedule; the deltas it returns (requests it ended) are sent."""

    def step_failed(self, error: Exception, sched: SchedulerOutput) -> bool:
        """Called under the loop's lock when a step raised; True if handled (the loop then fails nothing)."""
        ...


class EngineLoop:
    """Steps an :class:`EngineCore` in a background thread; every delta goes to ``sink``. ``hooks`` (set before
    the first request, or at construction) run between steps and see failed steps first. ``step_watch`` times the
    step in flight on ``clock`` (:meth:`step_in_flight`), for a watchdog: the step runs outside ``lock``.
    ``rebuild`` and ``restarts`` (whose one record is :data:`ENGINE_ID`): a fresh engine in place of one that lost a
    part, when the policy allows it (see the module docstring)."""

    def __init__(
        self,
        core: EngineCore,
        sink: Callable[[RequestDelta], None],
        max_waiting: int = 1024,
        hooks: StepHooks | None = None,
        clock: Callable[[], float] = time.monotonic,
        rebuild: Callable[[], EngineCore] | None = None,
        restarts: Restarts | None = None,
    ) -> None:
        self.core = core
        self.clock = clock
        self.rebuild = rebuild
        self.restarts = restarts
        self._loras: dict[str, LoRARequest] = {}  # adapters loaded at run time (:meth:`add_lora`), for a restart
        self.sink = sink
        self.max_waiting = max_waiting
        self.hooks = hooks
        self.step_watch = StepWatch(clock)
        self.lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._listeners: list[Callable[[RequestDelta], None]] = []
        if core.grammars is not None:  # a request waiting for its grammar runs as soon as it is compiled
            core.grammars.notify = self.wake
        self.error: BaseException | None = None  # what stopped the loop, if anything did (``_run``)
        self._thread = threading.Thread(target=self._run, name="boundless-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def max_logprobs(self) -> int:
        return self.core.config.model.max_logprobs

    @property
    def pooling(self) -> EmbeddingPooling:
        """How the model's embeddings are made (``/v1/embeddings``)."""
        return self.core.identity.pooling

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(engine_stopped(self.error))
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop has stopped")

    def wake(self) -> None:
        """Step now if idle (something for the hooks came in)."""
        self._wake.set()

    def step_in_flight(self) -> StepReport | None:
        """The step running now (how long it has run, its size), or None between steps; never waits for the lock."""
        return self.step_watch.report()

    def add_finished_listener(self, fn: Callable[[RequestDelta], None]) -> None:
        """``fn(delta)`` is called (in the engine thread) with every request's final delta."""
        self._listeners.append(fn)

    def remove_finished_listener(self, fn: Callable[[RequestDelta], None]) -> None:
        self._listeners.remove(fn)

    def stats(self) -> dict[str, EngineStats]:
        with self.lock:
            return {"0": self.core.stats()}

    def add_lora(self, lora: LoRARequest) -> None:
        """Load a LoRA adapter between steps (``EngineCore.add_lora``); a restarted engine loads it again."""
        self._check_alive()
        with self.lock:
            self.core.add_lora(lora)
            self._loras[lora.lora_name] = lora

    def remove_lora(self, name: str) -> bool:
        """Unload an adapter between steps; False if none has that name (``EngineCore.remove_lora``)."""
        self._check_alive()
        with self.lock:
            removed = self.core.remove_lora(name)  # (refused while in use: then it stays one to load again on restart)
            self._loras.pop(name, None)
            return removed

    def cluster_info(self) -> list[dict]:
        """The one instance, as ``GET /cluster`` lists instances."""
        s = self.stats()["0"]
        return [
            {
                "id": "0",
                "pid": os.getpid(),
                "node": os.uname().nodename,
                "state": "alive" if self.is_alive() else "dead",
                "running": s.num_running,
                "waiting": s.num_waiting,
                "kv_usage": s.kv_usage,
                "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            }
        ]

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        program: ProgramRef | None = None,
        resume: Resume | None = None,
        handoff: HandoffPlan | None = None,
    ) -> None:
        """Add a request; raises at once for an invalid request or a full waiting queue. ``handoff`` makes this
        engine the request's prefill engine (``engine/handoff.py``)."""
        self._check_alive()
        if params.structured is not None:  # (outside the lock: the first imports xgrammar, 1.5 s the loop would wait)
            check_structured_output(params.structured, self.core.identity.vocab_size)
        with self.lock:
            if len(self.core.scheduler.waiting) >= self.max_waiting:
                raise QueueFullError(retry_after_s=1.0)
            self.core.add_request(request_id, prompt_token_ids, params, program=program, resume=resume, handoff=handoff)
        self._wake.set()

    def prepare(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        plan: IntakePlan,
        program: ProgramRef | None = None,
    ) -> IntakeAnswer:
        """Make this engine a request's decode engine (``EngineCore.prepare_intake``). A half of the same call from
        an earlier placement (its abort may still be on its way) is dropped first."""
        self._check_alive()
        with self.lock:
            if len(self.core.scheduler.waiting) >= self.max_waiting:
                raise QueueFullError(retry_after_s=1.0)
            if request_id in self.core.scheduler.requests:
                self.core.abort(request_id)
            answer = self.core.prepare_intake(request_id, prompt_token_ids, params, plan, program=program)
        self._wake.set()
        return answer

    def prefetch(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """Read ahead the stored KV of a call that will come here (``EngineCore.prefetch``); returns the blocks."""
        with self.lock:
            blocks = self.core.prefetch(request_id, prompt_token_ids)
        self._wake.set()
        return blocks

    def drop_prefetch(self, request_id: str) -> None:
        with self.lock:
            self.core.drop_prefetch(request_id)

    def memory_prefix_blocks(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> int:
        """How many leading full blocks of a prompt this engine holds in memory
        (``EngineCore.memory_prefix_blocks``)."""
        with self.lock:
            return self.core.memory_prefix_blocks(prompt_token_ids, params)

    def continue_request(self, request_id: str, resume: Resume) -> bool:
        """Give a prepared request its first token (``EngineCore.continue_request``); raises if the loop has stopped (it
        would wait there for ever)."""
        self._check_alive()
        with self.lock:
            ok = self.core.continue_request(request_id, resume)
        self._wake.set()
        return ok

    def abort(self, request_id: str) -> None:
        with self.lock:
            aborted = self.core.abort(request_id)
        if aborted:  # (its listeners learn of it as of any end: /metrics counts requests their clients gave up on)
            ended = RequestDelta(request_id, [], "", [], finished=True, finish_reason="abort")
            for fn in self._listeners:
                fn(ended)

    def stop(self) -> None:
        """Tell the loop to stop after the step in flight; returns at once (:meth:`shutdown` waits)."""
        self._stop.set()
        self._wake.set()

    def shutdown(self) -> None:
        """Stop the loop, then let the engine finish its writes to the disk store (bounded)."""
        self.stop()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            return  # a step is stuck: closing the engine would race it
        try:
            with self.lock:
                self.core.close()
        except Exception:
            log.exception("closing the engine failed")

    def _run(self) -> None:
        while True:
            try:
                self._steps()
                return
            except BaseException as e:  # outside a step (deciding one, taking its result): the loop cannot go on
                self.error = e  # (first: no request is taken from here on)
                log.critical("the engine loop stopped: %s\n%s", engine_stopped(e), traceback.format_exc())
                self._stopped(e)
                if not self._restarted(e):
                    return

    def _restarted(self, error: BaseException) -> bool:
        """After ``error`` stopped the loop: whether a fresh engine now runs in place of the old (which is closed), as
        the restart policy allows for an engine that lost a part, after its delay; a rebuild that fails counts as a
        restart and is tried again under the same limit. False: the loop stays stopped, with its error."""
        restarts = self.restarts
        if self.rebuild is None or restarts is None or not isinstance(error, EngineLost):
            return False
        restarts.lost(ENGINE_ID, self.clock())
        try:
            self.core.close(lost=True)  # (a split model's ranks stopped, its writes to the disk store drained)
        except Exception:
            log.exception("closing the lost engine failed")
        self.core.release_memory()  # (its KV memory, which the fresh engine's would not fit beside on a GPU)
        while restarts.state(ENGINE_ID) != "retired":
            due_at = restarts.next_due()
            if due_at is not None and self._stop.wait(max(0.0, due_at - self.clock())):
                return False  # (the server is shutting down)
            due = restarts.due(self.clock())
            if not due:
                continue
            restart = due[0]
            log.warning("restarting the engine (restart %d)", restart.attempt)
            try:
                core = self.rebuild()
            except Exception:
                log.exception("the engine's restart %d failed", restart.attempt)
                restarts.lost(ENGINE_ID, self.clock())
                continue
            if self._stop.is_set():  # (the server shut down while it was built: nobody would close it)
                core.close()
                return False
            for lora in list(self._loras.values()):
                try:
                    core.add_lora(lora)
                except Exception:
                    log.exception("LoRA adapter %r did not load into the restarted engine", lora.lora_name)
                    del self._loras[lora.lora_name]
            with self.lock:
                self.core = core
                if core.grammars is not None:
                    core.grammars.notify = self.wake
                restarts.ready(ENGINE_ID, self.clock())
                self.error = None  # (last: requests are taken from here on)
            log.warning("the engine is back after restart %d; it takes requests again", restart.attempt)
            return True
        log.critical("the engine was lost and is not restarted again (--max-restarts): it stays stopped")
        return False

    # Whether the requests of a step that lost the engine end with the step's error (the server's engine: its clients
    # and /metrics see them fail), or are left to the loop's owner (a cluster instance: its calls fail over).
    fails_lost_steps = False

    def _stopped(self, error: BaseException) -> None:
        """The loop stopped by ``error`` with requests in flight. Here nothing more: the cluster's instance says so at
        its next heartbeat, and its calls fail over with their tokens. The server's engine ends them (below)."""

    def _steps(self) -> None:
        core = self.core
        # Asynchronous scheduling: the window decided and queued while the last one ran, and what it follows.
        ahead: tuple[SchedulerOutput, PendingStep] | None = None
        while not self._stop.is_set() or ahead is not None:  # (a window in flight is read before the loop stops)
            if ahead is None:
                with self.lock:
                    if self.hooks is not None:
                        for delta in self.hooks.between_steps():
                            self._emit(delta)
                    sched = core.schedule() if core.has_work() else None
                    self._emit_all(core.take_rejected())  # (requests failed as the step was decided)
                if sched is None or sched.is_empty:
                    self._wake.wait(timeout=0.05 if sched is not None else 1.0)
                    self._wake.clear()
                    continue
                launched = None
            else:
                (sched, launched), ahead = ahead, None
            self.step_watch.begin(sched)
            failed = [sched]
            try:
                if launched is None:
                    launched = core.launch(sched)
                # (KV lending's hooks act between steps.)
                if core.config.scheduler.async_scheduling and self.hooks is None and not self._stop.is_set():
                    with self.lock:
                        nxt = core.schedule_ahead(sched, launched)
                    if nxt is not None:
                        failed.append(nxt)
                        ahead = (nxt, core.launch(nxt, launched))
                        with self.lock:
                            core.decode_pending(nxt)
                result = launched.wait()
            except Exception as e:  # a failed step must not take the server down: fail its requests, go on
                self.step_watch.end()
                ahead = None  # (a window queued behind a failed one fails with it)
                with self.lock:
                    if self.hooks is not None and self.hooks.step_failed(e, sched):
                        continue
                log.error("engine step failed:\n%s", traceback.format_exc())
                if isinstance(e, EngineLost) and not self.fails_lost_steps:
                    # A cluster instance's: its calls fail over, the step's among them (an error of theirs would have
                    # reached the client).
                    raise
                with self.lock:
                    for failed_sched in failed:
                        self._emit_all(core.fail_step(failed_sched, e))
                if isinstance(e, EngineLost):
                    raise  # no later step could run: the loop stops (_run)
                continue
            self.step_watch.end()
            with self.lock:
                self._emit_all(core.finish_step(sched, result))

    def _emit(self, delta: RequestDelta) -> None:
        self.sink(delta)
        if delta.finished:
            for fn in self._listeners:
                fn(delta)

    def _emit_all(self, deltas: list[RequestDelta]) -> None:
        """A step's deltas, in order (the server's engine hands them to its event loop together)."""
        for delta in deltas:
            self._emit(delta)


class DeltaQueue:
    """A request's deltas waiting for its one reader, put by its event loop's thread (``call_soon_threadsafe``).

    Lighter than ``asyncio.Queue`` (no size bound, no putters, one getter), and read a batch at a time: a reader
    that fell behind the engine takes every delta waiting in one wake-up."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[RequestDelta] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, delta: RequestDelta) -> None:
        self._items.append(delta)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _ready(self) -> None:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def get(self) -> RequestDelta:
        await self._ready()
        return self._items.popleft()

    async def get_all(self) -> list[RequestDelta]:
        """Every delta waiting (at least one: waits for it), oldest first."""
        await self._ready()
        items = list(self._items)
        self._items.clear()
        return items


class RequestStream:
    """The deltas of one request, as an async iterator (or in batches: :meth:`batches`); ``abort()`` stops it (used
    on disconnect)."""

    def __init__(self, abort: Callable[[str], None], request_id: str, queue: DeltaQueue) -> None:
        self._abort = abort
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        delta: RequestDelta = await self._queue.get()
        self.finished = delta.finished
        return delta

    async def batches(self) -> AsyncIterator[list[RequestDelta]]:
        """The deltas as they come, those waiting together: a reader behind the engine (several steps' deltas
        queued) takes them in one wake-up, and the server writes their chunks in one send. Nothing is read after
        the final delta (a finished stream's registry entry is gone, so none follows it)."""
        while not self.finished:
            batch = await self._queue.get_all()
            self.finished = batch[-1].finished
            yield batch

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


def _put_all(items: list[tuple[DeltaQueue, RequestDelta]]) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)


class StreamRegistry:
    """Per-request asyncio queues fed from another thread."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, DeltaQueue]] = {}
        self._lock = threading.Lock()
        self._ended = False  # (end_all: no stream opens again)
        self._failures = 0  # fail_all's so far: a request started after one failed its stream is aborted

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._streams

    def open(
        self, request_id: str, abort: Callable[[str], None], loop: asyncio.AbstractEventLoop | None = None
    ) -> RequestStream:
        """The request's stream, read on ``loop`` (by default the running one: a caller off the loop names it)."""
        return self._open(request_id, abort, loop)[0]

    def _open(
        self, request_id: str, abort: Callable[[str], None], loop: asyncio.AbstractEventLoop | None
    ) -> tuple[RequestStream, int]:
        """:meth:`open`, and the count of failures of every stream when it opened."""
        loop = loop or asyncio.get_running_loop()
        queue = DeltaQueue()
        with self._lock:
            if self._ended:
                raise ShuttingDownError()
            self._streams[request_id] = (loop, queue)
            return RequestStream(abort, request_id, queue), self._failures

    def open_and_start(
        self,
        request_id: str,
        abort: Callable[[str], None],
        start: Callable[[], None],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestStream:
        """Open the request's stream (read on ``loop``), then ``start`` the request; if that raises, the stream is
        closed again (so no delta is kept for a request that never ran) and the error propagates.
        The stream opens first, so not even the first delta can arrive before it."""
        stream, failures = self._open(request_id, abort, loop)
        try:
            start()
        except BaseException:
            self.close(request_id)
            raise
        with self._lock:
            failed_meanwhile = self._failures != failures
        if failed_meanwhile:
            # Every stream was failed (the server shutting down, the engine stopped) between this one's opening and
            # its request's start, off the event loop: the abort that went with it found no request yet, and the
            # request ran on, for nobody. (An abort of one that ended is nothing.)
            abort(request_id)
        return stream

    def close(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def end_all(self) -> list[str]:
        """End every open stream with an error (stop reason :data:`SHUTTING_DOWN`) and open no more: the server is
        shutting down. Returns the ended requests' ids, for the caller to abort them."""
        with self._lock:
            self._ended = True
        return self.fail_all(SHUTTING_DOWN)

    def fail_all(self, stop_reason: str) -> list[str]:
        """End every open stream with an error, ``stop_reason`` saying why; their ids."""
        with self._lock:
            streams, self._streams = self._streams, {}
            self._failures += 1
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DeltaQueue, RequestDelta]]] = {}
        for request_id, (loop, queue) in streams.items():
            delta = RequestDelta(request_id, [], "", [], True, finish_reason="error", stop_reason=stop_reason)
            by_loop.setdefault(loop, []).append((queue, delta))
        self._hand_over(by_loop)
        return list(streams)

    def deliver(self, delta: RequestDelta) -> None:
        self.deliver_all([delta])

    def deliver_all(self, deltas: list[RequestDelta]) -> None:
        """Deliver a step's deltas with one call into each event loop (one in a server), not one per delta: a call
        from another thread wakes the loop and makes a handle, for each of a 256-request batch's deltas every step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DeltaQueue, RequestDelta]]] = {}
        with self._lock:
            streams = self._streams
            for delta in deltas:
                stream = streams.pop(delta.request_id, None) if delta.finished else streams.get(delta.request_id)
                if stream is not None:
                    by_loop.setdefault(stream[0], []).append((stream[1], delta))
        self._hand_over(by_loop)

    def _hand_over(self, by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DeltaQueue, RequestDelta]]]) -> None:
        """Each event loop's deltas in one call into it, from the caller's thread (the engine loop's, a poller's)."""
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its loop has closed (its streams' readers are gone): not the caller's end
                self._drop_streams_of(loop)

    def _drop_streams_of(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._streams = {rid: stream for rid, stream in self._streams.items() if stream[0] is not loop}


class AsyncEngine(EngineLoop):
    """An engine loop whose requests stream to coroutines (the server's in-process engine)."""

    def __init__(
        self,
        core: EngineCore,
        max_waiting: int = 1024,
        rebuild: Callable[[], EngineCore] | None = None,
        restarts: Restarts | None = None,
    ) -> None:
        self.streams = StreamRegistry()
        super().__init__(core, self.streams.deliver, max_waiting, rebuild=rebuild, restarts=restarts)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        program: ProgramRef | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestStream:
        """Add a request and return the stream of its deltas (read on ``loop``: by default the running one).

        Raises at once for an invalid request or a full waiting queue, so an HTTP handler can answer
        with an error status before it starts a response.
        """
        return self.streams.open_and_start(
            request_id, self.abort, lambda: self.add(request_id, prompt_token_ids, params, program), loop
        )

    def abort(self, request_id: str) -> None:
        self.streams.close(request_id)
        super().abort(request_id)

    def _emit_all(self, deltas: list[RequestDelta]) -> None:
        self.streams.deliver_all(deltas)
        if self._listeners:
            for delta in deltas:
                if delta.finished:
                    for fn in self._listeners:
                        fn(delta)

    fails_lost_steps = True

    def _stopped(self, error: BaseException) -> None:
        """Its requests in flight end with an error saying so (they waited for ever: nothing would end their
        streams); new ones are refused (``add``), and ``/health`` answers unavailable."""
        self.streams.fail_all(engine_stopped(error))

    def end_requests(self) -> None:
        """End every request in flight with an error and refuse new ones (:meth:`StreamRegistry.end_all`): the server
        is shutting down."""
        for request_id in self.streams.end_all():
            self.abort(request_id)
