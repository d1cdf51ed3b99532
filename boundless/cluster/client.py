"""The Ray transport around the cluster's dispatcher.

``ClusterClient`` offers the HTTP server the same interface as an in-process engine. It starts
(or joins) Ray, creates one :class:`~boundless.cluster.instance.EngineInstance` actor per
instance, and carries out the decisions of a :class:`~boundless.cluster.dispatcher.Dispatcher`,
which routes calls, keeps the process table (so program priorities are global) and decides
failover. What is left here is the transport: the actors, a poller thread per instance that
drains its deltas, a heartbeat thread that collects load and KV usage, the streams to the HTTP
handlers, and telling Ray's errors apart: an instance whose ``add`` raised fails that call and
keeps serving; one that died or does not answer in ``heartbeat_timeout_s`` is lost, and its calls
are resent elsewhere with the tokens already produced.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from boundless.cluster.dispatcher import AbortOn, AddResult, Decision, Dispatcher, Fail, MarkDead, Send
from boundless.cluster.instance import EngineInstance, InstanceInfo
from boundless.cluster.routing import Router
from boundless.config import ClusterConfig, EngineConfig
from boundless.engine.async_engine import EngineDeadError, QueueFullError, RequestStream, StreamRegistry
from boundless.engine.core import EngineStats, RequestDelta
from boundless.engine.errors import InvalidRequestError
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import resolve_model_path
from boundless.model.tokenizer import load_tokenizer
from boundless.programs.process_table import ProcessTable
from boundless.programs.ref import ProgramRef

log = logging.getLogger(__name__)


class InstanceCallError(RuntimeError):
    """An instance raised while taking a call: the call fails alone, and the instance keeps serving."""


@dataclass
class Instance:
    """An instance's actor and what it last said about itself."""

    actor: object
    info: InstanceInfo | None = None
    stats: EngineStats | None = None


class ClusterClient:
    """N engine instances as Ray actors behind one dispatcher."""

    def __init__(self, engine: EngineConfig, cluster: ClusterConfig, max_waiting: int = 1024) -> None:
        import ray

        self.engine_config = engine
        self.config = cluster
        if not ray.is_initialized():
            ray.init(address=cluster.ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        gpu = engine.model.device.startswith("cuda")
        threads = None if gpu else max(1, _local_cpus() // cluster.instances)
        actor_cls = ray.remote(EngineInstance).options(
            num_cpus=0 if not gpu else 1, num_gpus=1 if gpu else 0, max_concurrency=16, max_restarts=0
        )
        self.instances: dict[str, Instance] = {
            str(i): Instance(actor_cls.remote(str(i), engine, max_waiting, threads)) for i in range(cluster.instances)
        }
        for inst in self.instances.values():
            inst.info = ray.get(inst.actor.info.remote())
        self.tokenizer = load_tokenizer(resolve_model_path(engine.model.model))
        self.max_model_len = min(i.info.max_model_len for i in self.instances.values() if i.info)
        self.dispatcher = Dispatcher(
            self.instances,
            Router(cluster.routing, cluster.locality_threshold, cluster.locality_max_imbalance),
            ProcessTable(ttl_s=engine.scheduler.program_ttl_s, critical_path=engine.scheduler.policy == "atlas"),
            time.monotonic,
        )
        self.streams = StreamRegistry()
        self.lock = threading.RLock()  # around the dispatcher, and the adds its decisions send
        self._listeners: list[Callable[[RequestDelta], None]] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll, args=(iid,), name=f"boundless-poll-{iid}", daemon=True)
            for iid in self.instances
        ]
        self._threads.append(threading.Thread(target=self._heartbeats, name="boundless-heartbeat", daemon=True))
        for t in self._threads:
            t.start()

    # -- the EngineClient interface ------------------------------------------------------------

    def is_alive(self) -> bool:
        return self.dispatcher.is_alive()

    def add_finished_listener(self, fn: Callable[[RequestDelta], None]) -> None:
        self._listeners.append(fn)

    def stats(self) -> dict[str, EngineStats]:
        views = self.dispatcher.views
        return {iid: i.stats for iid, i in self.instances.items() if i.stats is not None and views[iid].alive}

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, program: ProgramRef | None = None
    ) -> RequestStream:
        def start() -> None:
            with self.lock:
                failure = self._carry_out(
                    self.dispatcher.submit(request_id, prompt_token_ids, params, program), caller=request_id
                )
            if failure is not None:
                raise _error(failure)

        return self.streams.open_and_start(request_id, self.abort, start)

    def abort(self, request_id: str) -> None:
        self.streams.close(request_id)
        with self.lock:
            self._carry_out(self.dispatcher.abort(request_id))

    def cluster_info(self) -> list[dict]:
        out = []
        for iid, inst in self.instances.items():
            s = inst.stats
            view = self.dispatcher.views[iid]
            out.append(
                {
                    "id": iid,
                    "pid": inst.info.pid if inst.info else None,
                    "node": inst.info.node if inst.info else None,
                    "state": "alive" if view.alive else "dead",
                    "running": s.num_running if s else 0,
                    "waiting": s.num_waiting if s else 0,
                    "inflight": view.inflight,
                    "kv_usage": s.kv_usage if s else 0.0,
                    "prefix_cache_hit_rate": s.prefix_cache_hit_rate if s else 0.0,
                }
            )
        return out

    def shutdown(self) -> None:
        import ray

        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for iid, inst in self.instances.items():
            if self.dispatcher.views[iid].alive:
                with contextlib.suppress(Exception):  # already gone
                    ray.get(inst.actor.shutdown.remote(), timeout=10)
            ray.kill(inst.actor)

    # -- carrying out the dispatcher's decisions ----------------------------------------------------

    def _carry_out(self, decisions: Iterable[Decision], caller: str | None = None) -> Fail | None:
        """Carry out ``decisions`` and those that follow from their outcomes. Holds ``self.lock``.

        Returns the failure of ``caller``'s call, for its submitter to raise; the failure of any
        other call (one failing over) ends its stream with an error."""
        import ray

        queue = deque(decisions)
        failure = None
        while queue:
            decision = queue.popleft()
            if isinstance(decision, Send):
                queue.extend(self.dispatcher.add_done(decision, self._add(decision)))
            elif isinstance(decision, Fail):
                if decision.request_id == caller:
                    failure = decision
                    continue
                self.streams.deliver(_error_delta(decision))
            elif isinstance(decision, MarkDead):
                log.error("instance %s is dead (%s); failing over its calls", decision.instance_id, decision.reason)
                with contextlib.suppress(Exception):  # a hung instance must not come back with stale work
                    ray.kill(self.instances[decision.instance_id].actor)
            elif isinstance(decision, AbortOn):
                self.instances[decision.instance_id].actor.abort.remote(decision.request_id)
        return failure

    def _add(self, send: Send) -> AddResult:
        """The instance's answer to ``send``, with Ray's errors told apart."""
        import ray

        actor = self.instances[send.instance_id].actor
        try:
            return ray.get(
                actor.add.remote(send.request_id, send.prompt, send.params, send.program, send.resume),
                timeout=self.config.heartbeat_timeout_s,
            )
        except Exception as e:
            if _instance_unreachable(e):
                return AddResult("unreachable", type(e).__name__)
            cause = getattr(e, "cause", None) or e  # a RayTaskError carries what add raised on the instance
            message = f"instance {send.instance_id} failed to take the request: {type(cause).__name__}: {cause}"
            log.error("request %s: %s", send.request_id, message)
            return AddResult("failed", message)

    def _lose(self, iid: str, reason: str) -> None:
        with self.lock:
            self._carry_out(self.dispatcher.instance_lost(iid, reason))

    # -- background threads -------------------------------------------------------------------

    def _poll(self, iid: str) -> None:
        import ray

        actor = self.instances[iid].actor
        while not self._stop.is_set() and self.dispatcher.views[iid].alive:
            try:
                deltas = ray.get(actor.drain.remote(0.1), timeout=self.config.heartbeat_timeout_s)
            except Exception as e:
                if not self._stop.is_set():
                    self._lose(iid, f"drain failed: {type(e).__name__}")
                return
            for delta in deltas:
                self._on_delta(iid, delta)

    def _on_delta(self, iid: str, delta: RequestDelta) -> None:
        with self.lock:
            if not self.dispatcher.on_delta(iid, delta):
                return  # aborted, or a stale delta from before a failover
        self.streams.deliver(delta)
        if delta.finished:
            for fn in self._listeners:
                fn(delta)

    def _heartbeats(self) -> None:
        import ray

        while not self._stop.wait(self.config.heartbeat_interval_s):
            for iid, inst in self.instances.items():
                if not self.dispatcher.views[iid].alive:
                    continue
                try:
                    inst.stats = ray.get(inst.actor.heartbeat.remote(), timeout=self.config.heartbeat_timeout_s)
                except Exception as e:
                    self._lose(iid, f"heartbeat failed: {type(e).__name__}")
            with self.lock:
                self.dispatcher.expire()


def _error(failure: Fail) -> Exception:
    """The exception a submitter raises for its call's failure (the HTTP layer maps each to a status)."""
    if failure.reason == "invalid":
        return InvalidRequestError(failure.message, failure.param)
    if failure.reason == "busy":
        return QueueFullError()
    if failure.reason == "unavailable":
        return EngineDeadError(failure.message)
    return InstanceCallError(failure.message)


def _error_delta(failure: Fail) -> RequestDelta:
    """The last delta of a call that failed after it started (while failing over)."""
    return RequestDelta(
        failure.request_id, [], "", [], finished=True, finish_reason="error", stop_reason=failure.message
    )


def _instance_unreachable(e: Exception) -> bool:
    """Whether Ray's error says the instance died or hung, rather than that the call raised there."""
    from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

    return not isinstance(e, RayTaskError) and isinstance(e, (RayActorError, GetTimeoutError, ObjectLostError))


def _local_cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))
