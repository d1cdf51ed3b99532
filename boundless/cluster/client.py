"""The front of a cluster of engine instances on Ray: routing, heartbeats, failover.

``ClusterClient`` offers the HTTP server the same interface as an in-process engine. It starts
(or joins) Ray, creates one :class:`~boundless.cluster.instance.EngineInstance` actor per
instance, and keeps the process table, so program priorities are global: every call carries its
program's service and waiting time as the router knows them. A poller thread per instance drains
its deltas; a heartbeat thread collects load and KV usage. An instance that dies or stops
answering is marked dead and gets no new calls; its in-flight calls are resent to a live instance
with the tokens already produced, so a streaming client sees no token repeated or lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from boundless.cluster.instance import EngineInstance, InstanceInfo
from boundless.cluster.routing import InstanceView, NoLiveInstanceError, Router
from boundless.config import ClusterConfig, EngineConfig
from boundless.engine.async_engine import EngineDeadError, QueueFullError, RequestStream, StreamRegistry
from boundless.engine.core import EngineStats, RequestDelta, Resume
from boundless.engine.errors import InvalidRequestError
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import resolve_model_path
from boundless.model.tokenizer import load_tokenizer
from boundless.programs.process_table import ProcessTable
from boundless.programs.ref import ProgramRef

log = logging.getLogger(__name__)


@dataclass
class Instance:
    view: InstanceView
    actor: object
    info: InstanceInfo | None = None
    stats: EngineStats | None = None
    last_heartbeat: float = field(default_factory=time.monotonic)


@dataclass
class InflightCall:
    """A call as the router tracks it, enough to resend it elsewhere."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    program: ProgramRef | None
    instance: str
    arrival: float
    output_token_ids: list[int] = field(default_factory=list)
    text_chars_sent: int = 0
    failovers: int = 0


class ClusterClient:
    """N engine instances as Ray actors behind one router."""

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
        self.instances: dict[str, Instance] = {}
        for i in range(cluster.instances):
            iid = str(i)
            actor = actor_cls.remote(iid, engine, max_waiting, threads)
            self.instances[iid] = Instance(InstanceView(iid), actor)
        for inst in self.instances.values():
            inst.info = ray.get(inst.actor.info.remote())
        self.tokenizer = load_tokenizer(resolve_model_path(engine.model.model))
        self.max_model_len = min(i.info.max_model_len for i in self.instances.values() if i.info)
        self.router = Router(cluster.routing, cluster.locality_threshold, cluster.locality_max_imbalance)
        self.table = ProcessTable(
            ttl_s=engine.scheduler.program_ttl_s, critical_path=engine.scheduler.policy == "atlas"
        )
        self.streams = StreamRegistry()
        self.inflight: dict[str, InflightCall] = {}
        self.lock = threading.RLock()
        self._listeners: list[Callable[[RequestDelta], None]] = []
        self.num_failovers = 0  # calls resent after their instance died
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
        return any(i.view.alive for i in self.instances.values())

    def add_finished_listener(self, fn: Callable[[RequestDelta], None]) -> None:
        self._listeners.append(fn)

    def stats(self) -> dict[str, EngineStats]:
        return {iid: i.stats for iid, i in self.instances.items() if i.stats is not None and i.view.alive}

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, program: ProgramRef | None = None
    ) -> RequestStream:
        call = InflightCall(request_id, list(prompt_token_ids), params, program, "", time.monotonic())

        def start() -> None:
            with self.lock:
                if program is not None:
                    self.table.call_arrived(program, time.monotonic())
                try:
                    self._dispatch(call)
                except BaseException:
                    self._abandon(program)
                    raise

        return self.streams.open_and_start(request_id, self.abort, start)

    def abort(self, request_id: str) -> None:
        self.streams.close(request_id)
        with self.lock:
            call = self.inflight.pop(request_id, None)
            if call is None:
                return
            inst = self.instances[call.instance]
            inst.view.inflight -= 1
            self._abandon(call.program)
        if inst.view.alive:
            inst.actor.abort.remote(request_id)

    def cluster_info(self) -> list[dict]:
        out = []
        for iid, inst in self.instances.items():
            s = inst.stats
            out.append(
                {
                    "id": iid,
                    "pid": inst.info.pid if inst.info else None,
                    "node": inst.info.node if inst.info else None,
                    "state": "alive" if inst.view.alive else "dead",
                    "running": s.num_running if s else 0,
                    "waiting": s.num_waiting if s else 0,
                    "inflight": inst.view.inflight,
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
        for inst in self.instances.values():
            if inst.view.alive:
                with contextlib.suppress(Exception):  # already gone
                    ray.get(inst.actor.shutdown.remote(), timeout=10)
            ray.kill(inst.actor)

    # -- routing and failover ----------------------------------------------------------------------

    def _dispatch(self, call: InflightCall) -> None:
        """Send a call (new or resent) to the instance the router picks. Holds ``self.lock``."""
        import ray

        pid = call.program.program_id if call.program else None
        views = [i.view for i in self.instances.values()]
        program = call.program
        if program is not None:
            rec = self.table.get(program.program_id)
            if rec is not None:
                program = dataclasses.replace(
                    program, service_s=rec.service_s, total_service_s=rec.total_service_s, waiting_s=rec.waiting_s
                )
        resume = Resume(tuple(call.output_token_ids), call.text_chars_sent) if call.output_token_ids else None
        while True:
            try:
                iid = self.router.choose(views, pid, len(call.prompt) + len(call.output_token_ids))
            except NoLiveInstanceError as e:
                raise EngineDeadError(str(e)) from e
            inst = self.instances[iid]
            try:
                result = ray.get(
                    inst.actor.add.remote(call.request_id, call.prompt, call.params, program, resume),
                    timeout=self.config.heartbeat_timeout_s,
                )
            except Exception as e:  # the instance is gone: mark it and try another
                self._mark_dead(iid, f"add failed: {type(e).__name__}")
                continue
            break
        if result.status == "invalid":
            raise InvalidRequestError(result.message, result.param)
        if result.status == "busy":
            raise QueueFullError()
        call.instance = iid
        inst.view.inflight += 1
        self.inflight[call.request_id] = call

    def _abandon(self, program: ProgramRef | None) -> None:
        """A call of ``program`` will not complete: it stops keeping the program active. Holds ``self.lock``."""
        if program is not None:
            self.table.call_abandoned(program.program_id)

    def _mark_dead(self, iid: str, reason: str) -> None:
        """Stop routing to an instance and resend its in-flight calls elsewhere."""
        with self.lock:
            inst = self.instances[iid]
            if not inst.view.alive:
                return
            inst.view.alive = False
            log.error("instance %s is dead (%s); failing over its calls", iid, reason)
            self.router.drop_instance(iid)
            orphans = [c for c in self.inflight.values() if c.instance == iid]
            for call in orphans:
                del self.inflight[call.request_id]
                call.failovers += 1
                self.num_failovers += 1
                try:
                    self._dispatch(call)
                except Exception as e:  # nowhere to go: the client gets an error, not silence
                    self._abandon(call.program)
                    self.streams.deliver(
                        RequestDelta(
                            call.request_id, [], "", [], finished=True, finish_reason="error", stop_reason=str(e)
                        )
                    )
        try:
            import ray

            ray.kill(inst.actor)  # a hung instance must not come back with stale work
        except Exception:
            pass

    # -- background threads -------------------------------------------------------------------

    def _poll(self, iid: str) -> None:
        import ray

        inst = self.instances[iid]
        while not self._stop.is_set() and inst.view.alive:
            try:
                deltas = ray.get(inst.actor.drain.remote(0.1), timeout=self.config.heartbeat_timeout_s)
            except Exception as e:
                if not self._stop.is_set():
                    self._mark_dead(iid, f"drain failed: {type(e).__name__}")
                return
            for delta in deltas:
                self._on_delta(iid, delta)

    def _on_delta(self, iid: str, delta: RequestDelta) -> None:
        with self.lock:
            call = self.inflight.get(delta.request_id)
            if call is None or call.instance != iid:
                return  # aborted, or a stale delta from before a failover
            call.output_token_ids.extend(delta.new_token_ids)
            call.text_chars_sent += len(delta.new_text)
            if delta.finished:
                del self.inflight[delta.request_id]
                self.instances[iid].view.inflight -= 1
                if call.program is not None and delta.finish_time is not None:
                    wait = max(0.0, (delta.finish_time - delta.arrival_time) - delta.service_s)
                    self.table.call_finished(call.program, delta.service_s, wait, time.monotonic(), iid)
                else:
                    self._abandon(call.program)
        self.streams.deliver(delta)
        if delta.finished:
            for fn in self._listeners:
                fn(delta)

    def _heartbeats(self) -> None:
        import ray

        while not self._stop.wait(self.config.heartbeat_interval_s):
            for iid, inst in list(self.instances.items()):
                if not inst.view.alive:
                    continue
                try:
                    stats = ray.get(inst.actor.heartbeat.remote(), timeout=self.config.heartbeat_timeout_s)
                except Exception as e:
                    self._mark_dead(iid, f"heartbeat failed: {type(e).__name__}")
                    continue
                inst.stats = stats
                inst.last_heartbeat = time.monotonic()
            with self.lock:
                self.table.expire(time.monotonic())
                self.router.retain(self.table)


def _local_cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))
