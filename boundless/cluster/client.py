"""The Ray transport around the cluster's dispatcher.

``ClusterClient`` offers the HTTP server the same interface as an in-process engine. It starts
(or joins) Ray, creates one :class:`~boundless.cluster.instance.EngineInstance` actor per
instance (with ``--prefill-instances``/``--decode-instances``, prefill and decode engines with a KV
transport between them, behind a :class:`~boundless.cluster.pd_dispatcher.PDDispatcher`), and
carries out the decisions of a :class:`~boundless.cluster.dispatcher.Dispatcher`,
which routes calls, keeps the process table (so program priorities are global) and decides
failover. What is left here is the transport: the actors, a poller thread per instance that
drains its deltas, a heartbeat thread that collects load and KV usage, the streams to the HTTP
handlers, and telling Ray's errors apart: an instance whose ``add`` raised fails that call and
keeps serving; one that died, does not answer in ``heartbeat_timeout_s`` or whose engine has been inside one
step for ``step_timeout_s`` (a forward pass that never returns: ``cluster/stuck_step.py``) is lost, and its
calls are resent elsewhere with the tokens already produced. A lost instance's actor is killed, and a fresh one
started in its place when the dispatcher's restart is due (``cluster/restarts.py``); it takes calls from its first
heartbeat. Each poller drains one actor: an earlier actor of a restarted instance cannot make it lost again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from boundless.api.metrics import link_metrics
from boundless.cluster.dispatcher import AbortOn, AddResult, Dispatcher, Fail, MarkDead, Send
from boundless.cluster.gmanager import GManager
from boundless.cluster.instance import EngineInstance, Heartbeat, InstanceInfo, RoleSetup
from boundless.cluster.lending_cluster import ClusterLending, PeerBack, PeerLost
from boundless.cluster.lending_instance import LendingSetup
from boundless.cluster.links import LinkStats
from boundless.cluster.pd_dispatcher import (
    Continue,
    DropPrefetch,
    PDDecision,
    PDDispatcher,
    PDInstance,
    Prefetch,
    Prepare,
    PrepareResult,
    placement_counts,
)
from boundless.cluster.pd_scheduler import PDSchedulerConfig, read_queue_tokens
from boundless.cluster.restarts import Restart, RestartPolicy
from boundless.cluster.routing import Router
from boundless.cluster.stuck_step import stuck_step
from boundless.config import ClusterConfig, ConfigError, EngineConfig
from boundless.engine.async_engine import EngineDeadError, QueueFullError, RequestStream, StreamRegistry
from boundless.engine.core import EngineStats, RequestDelta
from boundless.engine.errors import NO_ROOM_AFTER_FAILOVER, InvalidRequestError
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.step_watch import StepReport
from boundless.kv.transfer import DISK
from boundless.model.loader import resolve_model_path
from boundless.model.pooling import EmbeddingPooling
from boundless.model.tokenizer import load_tokenizer
from boundless.programs.process_table import ProcessTable
from boundless.programs.ref import ProgramRef
from boundless.transport.meeting_dir import MeetingDirectory, make_meeting_directory

log = logging.getLogger(__name__)

# How long a restarted actor may take to start (Ray placing it, its model loading) before the restart counts as failed.
STARTUP_TIMEOUT_S = 600.0


class InstanceCallError(RuntimeError):
    """An instance raised while taking a call: the call fails alone, and the instance keeps serving."""


@dataclass
class Instance:
    """An instance's actor and what it last said about itself."""

    actor: object
    info: InstanceInfo | None = None
    stats: EngineStats | None = None
    links: list[LinkStats] = field(default_factory=list)


class DispatcherFrontEnd:
    """The HTTP server's engine interface (``submit``, ``abort``) over a cluster dispatcher, and the loop that
    carries out the dispatcher's decisions. Subclasses own the instances and say how each decision reaches
    one (``_add``, ``_prepare``, ``_continue``, ``_mark_dead``, ``_abort_on``, ``_peer_lost``, ``_restart``): Ray
    actors in :class:`ClusterClient`, direct calls in ``cluster/local_pd.py``. They set ``config``, ``dispatcher``,
    ``streams`` and ``lock`` (held around the dispatcher and the calls its decisions make)."""

    config: ClusterConfig
    dispatcher: Dispatcher
    streams: StreamRegistry
    lock: threading.RLock
    # No one queue limits a request's samples: the dispatcher spreads them over the instances (each with its own).
    max_waiting: int | None = None
    # How the model's embeddings are made (``/v1/embeddings``); None: not served (prefill and decode engines).
    pooling: EmbeddingPooling | None = None

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        program: ProgramRef | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestStream:
        def start() -> None:
            with self.lock:
                failure = self._carry_out(
                    self.dispatcher.submit(request_id, prompt_token_ids, params, program), caller=request_id
                )
            if failure is not None:
                raise failure_error(failure)

        return self.streams.open_and_start(request_id, self.abort, start, loop)

    def abort(self, request_id: str) -> None:
        self.streams.close(request_id)
        with self.lock:
            self._carry_out(self.dispatcher.abort(request_id))

    def end_requests(self) -> None:
        """End every call in flight with an error and refuse new ones: the server is shutting down."""
        for request_id in self.streams.end_all():
            self.abort(request_id)

    def _carry_out(self, decisions: Iterable[PDDecision], caller: str | None = None) -> Fail | None:
        """Carry out ``decisions`` and those that follow from their outcomes. Holds ``self.lock``.

        Returns the failure of ``caller``'s call, for its submitter to raise; the failure of any
        other call (one failing over) ends its stream with an error."""
        queue: deque[PDDecision] = deque(decisions)
        failure = None
        while queue:
            decision = queue.popleft()
            if isinstance(decision, Send):
                queue.extend(self.dispatcher.add_done(decision, self._add(decision)))
            elif isinstance(decision, Prepare):
                assert isinstance(self.dispatcher, PDDispatcher)
                queue.extend(self.dispatcher.prepare_done(decision, self._prepare_decode(decision)))
            elif isinstance(decision, Continue):
                assert isinstance(self.dispatcher, PDDispatcher)
                queue.extend(self.dispatcher.continue_done(decision, self._continue(decision)))
            elif isinstance(decision, Fail):
                if decision.request_id == caller:
                    failure = decision
                    continue
                self.streams.deliver(failure_delta(decision))
            elif isinstance(decision, MarkDead):
                self._mark_dead(decision)
            elif isinstance(decision, AbortOn):
                self._abort_on(decision)
            elif isinstance(decision, PeerLost):
                self._peer_lost(decision)
            elif isinstance(decision, PeerBack):
                self._peer_back(decision)
            elif isinstance(decision, Prefetch):
                self._prefetch(decision)
            elif isinstance(decision, DropPrefetch):
                self._drop_prefetch(decision)
            elif isinstance(decision, Restart):
                log.warning("restarting instance %s (restart %d)", decision.instance_id, decision.attempt)
                self._restart(decision)
        return failure

    def _receive(self, iid: str, delta: RequestDelta) -> RequestDelta | None:
        """A delta from instance ``iid``: what the dispatcher shows of it goes to the call's stream, and what follows
        from it is carried out, shown or not (a prefill that failed with its DE-read push shows nothing, and places
        the call again: a Prepare dropped here would leave the call waiting for ever). Returns what was shown."""
        with self.lock:
            shown, decisions = self.dispatcher.receive(iid, delta)
            if shown is not None:
                self.streams.deliver(shown)
            self._carry_out(decisions)
        return shown

    def _lose(self, iid: str, reason: str) -> None:
        """The instance is lost (dead, silent or stuck): the dispatcher's decisions for it are carried out."""
        with self.lock:
            self._carry_out(self.dispatcher.instance_lost(iid, reason))

    def _start_due_restarts(self) -> None:
        """Start the lost instances whose restart is due (the heartbeat loop asks every round)."""
        with self.lock:
            self._carry_out(self.dispatcher.restarts_due())

    def _rejoin(self, iid: str, kv_address: str | None = None) -> None:
        """A restarted instance answered its first heartbeat: it takes calls again (its KV transport at
        ``kv_address``: the lending peers and the prefill and decode engines reach it there)."""
        with self.lock:
            log.warning("instance %s is back (restarted); it takes calls again", iid)
            self._carry_out(self.dispatcher.instance_ready(iid, kv_address))

    def _restart_failed(self, iid: str, reason: str) -> None:
        """A restart did not come up: counted, and tried again later as the policy allows."""
        log.error("restart of instance %s failed: %s", iid, reason)
        self._lose(iid, f"restart failed: {reason}")

    def _watch_step(self, iid: str, step: StepReport | None) -> bool:
        """The watchdog over a heartbeat's step in flight: an instance stuck in one step past ``--step-timeout-s``
        is lost, as a dead one (``cluster/stuck_step.py``). True if it was."""
        reason = stuck_step(step, self.config.step_timeout_s)
        if reason is None:
            return False
        self._lose(iid, reason)
        return True

    def _prepare_decode(self, prepare: Prepare) -> PrepareResult:
        """Carry out a Prepare: under DE-read the prefill engine is asked first how much of the prompt it holds, so
        that the decode engine loads and pushes only the rest (``IntakePlan.pe_holds``)."""
        if prepare.plan.push_tag is not None and prepare.prefill_engine:
            holds = self._pe_holds(prepare.prefill_engine, prepare.prompt, prepare.params)
            prepare = dataclasses.replace(prepare, plan=dataclasses.replace(prepare.plan, pe_holds=holds))
        answer = self._prepare(prepare)
        if isinstance(answer, AddResult):
            return PrepareResult(answer.status, message=answer.message, refusal=answer.refusal)
        return answer

    def _add(self, send: Send) -> AddResult:
        raise NotImplementedError

    def _prepare(self, prepare: Prepare) -> PrepareResult | AddResult:
        raise NotImplementedError

    def _pe_holds(self, instance_id: str, prompt: list[int], params: SamplingParams) -> int:
        raise NotImplementedError

    def _continue(self, cont: Continue) -> AddResult:
        raise NotImplementedError

    def _mark_dead(self, mark: MarkDead) -> None:
        raise NotImplementedError

    def _restart(self, restart: Restart) -> None:
        """Start a fresh instance in place of a lost one, without waiting for it (the lock is held): once it answers
        a heartbeat, ``_rejoin``; if it does not come up, ``_restart_failed``."""
        raise NotImplementedError

    def _abort_on(self, abort: AbortOn) -> None:
        raise NotImplementedError

    def _peer_lost(self, lost: PeerLost) -> None:
        raise NotImplementedError

    def _peer_back(self, back: PeerBack) -> None:
        raise NotImplementedError

    def _prefetch(self, prefetch: Prefetch) -> None:
        raise NotImplementedError

    def _drop_prefetch(self, drop: DropPrefetch) -> None:
        raise NotImplementedError


def _config_error(error: Exception) -> ConfigError | None:
    """The configuration error an actor's start-up raised (a KV pool too small for ``--max-model-len``, say), as the
    one line a single engine's server gives, where Ray's error held it at the end of the actor's traceback; None for
    any other failure. Ray keeps only the text of an actor's start-up error."""
    found = re.findall(r"^boundless\.[\w.]+\.(?:ConfigError|ModelNotFoundError): (.+)$", str(error), re.MULTILINE)
    return ConfigError(found[-1]) if found else None


class ClusterClient(DispatcherFrontEnd):
    """N engine instances as Ray actors behind one dispatcher; or P prefill and D decode engines."""

    def __init__(self, engine: EngineConfig, cluster: ClusterConfig, max_waiting: int = 1024) -> None:
        import ray

        # Here, before Ray starts: a model that is not there is one line (ModelNotFoundError, a ConfigError), where
        # each actor's load failed with a RayActorError's traceback.
        model_path = resolve_model_path(engine.model.model)
        self.engine_config = engine
        self.config = cluster
        if not ray.is_initialized():
            check_ray_address(cluster.ray_address)
            # log_to_driver: the engines' warnings and errors (a store file failing its checks, writes off on a full
            # disk, a failed step) show in the server's output, each line under its actor's pid, as a single engine's
            # server prints them; without it they stayed in Ray's session files, unseen.
            ray.init(address=cluster.ray_address, include_dashboard=False, log_to_driver=True, configure_logging=False)
        gpu = engine.model.device.startswith("cuda")
        roles = _roles(cluster)
        ranks_each = engine.model.tensor_parallel_size  # (a split model's instance holds a GPU for each of its ranks)
        if gpu:
            _require_gpus(len(roles), ranks_each, joined=bool(cluster.ray_address or os.environ.get("RAY_ADDRESS")))
        threads = None if gpu else max(1, _local_cpus() // len(roles))
        # No task events: Ray's GCS keeps each call's (about 4 KB, up to 100,000 calls), and the pollers' drains and the
        # heartbeats alone, tens a second while idle, grew an idle 2-instance server's GCS by 80 KB a second.
        actor_cls = ray.remote(EngineInstance).options(
            num_cpus=0 if not gpu else 1,
            num_gpus=ranks_each if gpu else 0,
            max_concurrency=16,
            max_restarts=0,
            enable_task_events=False,
        )
        # Endpoints of the KV transport meet in a directory (shared memory's sockets and slots live there).
        self._meeting: MeetingDirectory | None = None
        setups: dict[str, RoleSetup | None] = dict.fromkeys(roles)
        lending_setups: dict[str, LendingSetup | None] = dict.fromkeys(roles)
        if cluster.disaggregated or cluster.kv_lending == "on":
            self._meeting = meeting = make_meeting_directory()
            if cluster.kv_lending == "on":
                lending_setups = {
                    iid: LendingSetup(cluster, meeting.path, rank, len(roles)) for rank, iid in enumerate(roles)
                }
            if cluster.disaggregated:
                setups = role_setups(cluster, meeting.path)
        # Each instance's KV events go out as its own data-parallel rank, on the endpoint's port plus that (vLLM's).
        ranks = {iid: rank for rank, iid in enumerate(roles)}
        # What a restart starts again: an actor of the same class, config and role (``_restart``).
        self._start_actor: Callable[[str], object] = lambda iid: actor_cls.remote(
            iid, engine, max_waiting, threads, setups[iid], lending=lending_setups[iid], events_rank=ranks[iid]
        )
        self.instances: dict[str, Instance] = {iid: Instance(self._start_actor(iid)) for iid in roles}
        self._starting: dict[str, object] = {}  # instance id -> the actor of its restart, until it is ready
        try:
            for inst in self.instances.values():
                inst.info = ray.get(inst.actor.info.remote())
        except ray.exceptions.RayActorError as e:
            for inst in self.instances.values():
                ray.kill(inst.actor)
            config_error = _config_error(e)
            if config_error is None:
                raise
            raise config_error from None
        self.lending = self._connect_lending(cluster) if cluster.kv_lending == "on" else None
        self.tokenizer = load_tokenizer(model_path)
        self.max_model_len = min(i.info.max_model_len for i in self.instances.values() if i.info)
        self.max_logprobs = engine.model.max_logprobs
        # Prefill and decode engines serve no embeddings (an embedding request's one step would be the prefill
        # engine's, its end a hand-off).
        infos = [i.info for i in self.instances.values() if i.info]
        self.pooling = None if cluster.disaggregated else infos[0].pooling
        # The dispatcher spreads a request's samples over the instances' queues (prefill and decode engines': over its
        # own, as long as theirs): more than all of them hold can never wait (a 400, where each try got a 429 for good).
        self.max_waiting = max_waiting * len(self.instances)
        table = ProcessTable(ttl_s=engine.scheduler.program_ttl_s, critical_path=engine.scheduler.policy == "atlas")
        self.dispatcher: Dispatcher
        if cluster.disaggregated:
            self.dispatcher = self._pd_dispatcher(engine, cluster, table, self.max_waiting)
        else:
            self.dispatcher = Dispatcher(
                self.instances,
                Router(cluster.routing, cluster.locality_threshold, cluster.locality_max_imbalance),
                table,
                time.monotonic,
                self.lending,
                RestartPolicy.from_config(cluster),
            )
        self.streams = StreamRegistry()
        self.lock = threading.RLock()  # around the dispatcher, and the adds its decisions send
        self._listeners: list[Callable[[RequestDelta], None]] = []
        self._stop = threading.Event()
        self._threads = [self._poller(iid, inst) for iid, inst in self.instances.items()]
        self._threads.append(threading.Thread(target=self._heartbeats, name="boundless-heartbeat", daemon=True))
        for t in self._threads:
            t.start()

    def _poller(self, iid: str, inst: Instance) -> threading.Thread:
        return threading.Thread(target=self._poll, args=(iid, inst), name=f"boundless-poll-{iid}", daemon=True)

    def _connect_lending(self, cluster: ClusterConfig) -> ClusterLending:
        """Introduce the instances' lending agents to each other, and start the gManager."""
        import ray

        require_one_kv_type(
            {iid: inst.info for iid, inst in self.instances.items() if inst.info}, "instances lending KV"
        )
        addresses = {iid: inst.info.kv_address for iid, inst in self.instances.items() if inst.info is not None}
        actors = {addresses[iid]: inst.actor for iid, inst in self.instances.items()}
        ray.get([inst.actor.lend_connect.remote(actors) for inst in self.instances.values()])
        return ClusterLending(GManager.from_config(cluster, time.monotonic), addresses)

    def _pd_dispatcher(
        self, engine: EngineConfig, cluster: ClusterConfig, table: ProcessTable, max_queued: int
    ) -> PDDispatcher:
        infos = {iid: inst.info for iid, inst in self.instances.items() if inst.info is not None}
        self._kv_bytes_per_token = kv_bytes_per_token(infos)
        return make_pd_dispatcher(infos, engine, cluster, table, max_queued)

    # -- the EngineClient interface ------------------------------------------------------------

    def is_alive(self) -> bool:
        return self.dispatcher.is_alive()

    def add_finished_listener(self, fn: Callable[[RequestDelta], None]) -> None:
        self._listeners.append(fn)

    def stats(self) -> dict[str, EngineStats]:
        views = self.dispatcher.views
        # (A copy of the instances first: the stats log reads them from a thread of its own.)
        return {iid: i.stats for iid, i in list(self.instances.items()) if i.stats is not None and views[iid].alive}

    def cluster_info(self) -> list[dict]:
        out = []
        held = self.lending.held() if self.lending is not None else {}
        waiting_for_room = self.lending.waiting_for_room() if self.lending is not None else {}
        awaiting_grant = self.lending.awaiting_grant() if self.lending is not None else {}
        for iid, inst in self.instances.items():
            view = self.dispatcher.views[iid]
            # A lost instance holds no call (they failed over) and no KV: its last heartbeat's counts are history, as
            # /metrics, which leaves it out, has it.
            s = inst.stats if view.alive else None
            losses, restarts, failed = self.dispatcher.restarts.counts(iid)
            entry = {
                "id": iid,
                "pid": inst.info.pid if inst.info else None,
                "node": inst.info.node if inst.info else None,
                "state": instance_state(self.dispatcher, iid),
                "lost": losses,
                "restarts": restarts,
                "failed_restarts": failed,
                "running": s.num_running if s else 0,
                "waiting": s.num_waiting if s else 0,
                "inflight": view.inflight,
                "kv_usage": s.kv_usage if s else 0.0,
                "prefix_cache_hit_rate": s.prefix_cache_hit_rate if s else 0.0,
            }
            if self.lending is not None:
                lending = self.lending.lending().get(iid)
                entry |= {
                    "kv_blocks_lent": lending.lent if lending else 0,
                    "kv_blocks_reserved": lending.reserved if lending else 0,
                    "kv_blocks_borrowed": lending.borrowed if lending else 0,
                    "requests_held": held.get(iid, []),
                    "requests_waiting_for_room": waiting_for_room.get(iid, 0),
                    "requests_awaiting_grant": awaiting_grant.get(iid, []),
                }
            if isinstance(self.dispatcher, PDDispatcher):
                load = next((ld for ld in self.dispatcher.loads() if ld.engine_id == iid), None)
                entry |= {
                    "role": self.dispatcher.role(iid),
                    "calls": load.seq if load else 0,
                    "tokens": load.tok if load else 0,
                    "read_queue_bytes": storage_queue_bytes(inst.links),
                }
            out.append(entry)
        return out

    def cluster_metrics(self) -> Iterator[Metric]:
        """Series beyond the engines' own: the emulated links, the instances' restarts, with KV lending the requests
        waiting for room, and with roles the bytes per KV path and the calls placed per read path."""
        views = self.dispatcher.views
        live = {iid: inst for iid, inst in self.instances.items() if views[iid].alive}
        yield from link_metrics({iid: inst.links for iid, inst in live.items()})
        yield from restart_metrics(self.dispatcher)
        if self.lending is not None:
            waiting = GaugeMetricFamily(
                "boundless_kv_lending_requests_waiting_for_room",
                "running requests whose local KV fills the instance's pool, waiting for a move to grow (KV lending)",
                labels=["instance"],
            )
            for iid, n in self.lending.waiting_for_room().items():
                waiting.add_metric([iid], float(n))
            yield waiting
        if not isinstance(self.dispatcher, PDDispatcher):
            return
        paths = CounterMetricFamily(
            "boundless_pd_path_bytes",
            "KV bytes by path: pe_read and de_read (storage to a prefill or decode engine), de_push (decode to "
            "prefill engine, the DE-read path's second hop) and handoff (prefill to decode engine)",
            labels=["instance", "role", "path"],
        )
        for iid, inst in live.items():
            s, role = inst.stats, self.dispatcher.role(iid)
            if s is None:
                continue
            disk = s.kv_tiers.get(DISK)
            read_path, send_path = ("pe_read", "handoff") if role == "prefill" else ("de_read", "de_push")
            paths.add_metric([iid, role, read_path], float(disk.bytes_read if disk else 0))
            paths.add_metric([iid, role, send_path], float(s.remote_io.bytes_sent if s.remote_io else 0))
        yield paths
        queues = GaugeMetricFamily(
            "boundless_pd_read_queue_bytes",
            "bytes waiting on the instance's (node's) storage link: the read queue the scheduler balances",
            labels=["instance", "role"],
        )
        for iid, inst in live.items():
            queues.add_metric([iid, self.dispatcher.role(iid)], float(storage_queue_bytes(inst.links)))
        yield queues
        placed = CounterMetricFamily(
            "boundless_pd_calls", "calls placed, by read path (pe, de, none)", labels=["read_path"]
        )
        stored = CounterMetricFamily(
            "boundless_pd_stored_tokens",
            "estimated stored prompt tokens of calls placed, by read path",
            labels=["read_path"],
        )
        for path, n, tokens in placement_counts(self.dispatcher):
            placed.add_metric([path], float(n))
            stored.add_metric([path], float(tokens))
        ahead = CounterMetricFamily(
            "boundless_pd_prefetches",
            "stored contexts read ahead for calls waiting for a placement, by the read path they serve (pe, de)",
            labels=["read_path"],
        )
        for path, n in sorted(self.dispatcher.prefetches.items()):
            ahead.add_metric([path], float(n))
        lost = CounterMetricFamily(
            "boundless_pd_stream_losses",
            "prefills failed because the DE-read push they were reading failed (its DE gone, a timeout); each call "
            "placed again",
        )
        lost.add_metric([], float(self.dispatcher.num_stream_losses))
        yield from (placed, stored, ahead, lost)

    def shutdown(self) -> None:
        import ray

        self._stop.set()
        for t in list(self._threads):
            t.join(timeout=5)
        for iid, inst in self.instances.items():
            if self.dispatcher.views[iid].alive:
                with contextlib.suppress(Exception):  # already gone
                    ray.get(inst.actor.shutdown.remote(), timeout=10)
            ray.kill(inst.actor)
        with self.lock:
            starting, self._starting = list(self._starting.values()), {}
        for actor in starting:  # restarts under way
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if self._meeting is not None:
            self._meeting.remove()

    # -- carrying out the dispatcher's decisions ----------------------------------------------------

    def _mark_dead(self, mark: MarkDead) -> None:
        log.error("instance %s is dead (%s); failing over its calls", mark.instance_id, mark.reason)
        _kill(self.instances[mark.instance_id].actor)  # (a hung instance must not come back with stale work)

    def _restart(self, restart: Restart) -> None:
        name = f"boundless-restart-{restart.instance_id}"
        threading.Thread(target=self._start_again, args=(restart.instance_id,), name=name, daemon=True).start()

    def _start_again(self, iid: str) -> None:
        """A fresh actor for lost instance ``iid``: it takes calls from its first heartbeat (its model loaded)."""
        import ray

        actor = None
        try:
            with self.lock:
                # Not after shutdown: an actor started then would start Ray again in this process (Ray starts itself
                # for a call), a session the caller's ray.shutdown() never ends. Checked, and the actor registered,
                # under the lock that shutdown takes to kill the restarts under way.
                if self._stop.is_set():
                    return
                actor = self._starting[iid] = self._start_actor(iid)
            info = ray.get(actor.info.remote(), timeout=STARTUP_TIMEOUT_S)
            if self.lending is not None:  # its agent meets the live instances' before it takes a call
                ray.get(actor.lend_connect.remote(self._lending_peers(iid, info, actor)), timeout=STARTUP_TIMEOUT_S)
            beat = ray.get(actor.heartbeat.remote(), timeout=self.config.heartbeat_timeout_s)
        except Exception as e:
            _kill(actor)
            with self.lock:
                self._starting.pop(iid, None)
            if not self._stop.is_set():
                self._restart_failed(iid, f"{type(e).__name__}: {e}")
            return
        with self.lock:
            if self._starting.pop(iid, None) is not actor or self._stop.is_set():
                _kill(actor)  # shut down meanwhile
                return
            inst = self.instances[iid] = Instance(actor, info, beat.stats, beat.links)
            poller = self._poller(iid, inst)
            # The lost actor's poller has ended (or ends at its next drain): the threads kept are those that run, so
            # that each restart does not keep one more finished thread for good.
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(poller)
            self._rejoin(iid, info.kv_address or None)
            poller.start()

    def _lose_current(self, iid: str, inst: Instance, reason: str) -> None:
        """``inst`` failed: the instance is lost, unless ``inst`` is an earlier actor of a restarted instance."""
        with self.lock:
            if self.instances[iid] is inst:
                self._lose(iid, reason)

    def _abort_on(self, abort: AbortOn) -> None:
        self.instances[abort.instance_id].actor.abort.remote(abort.request_id)

    def _peer_lost(self, lost: PeerLost) -> None:
        self.instances[lost.instance_id].actor.lend_peer_lost.remote(lost.lost)

    def _lending_peers(self, iid: str, info: InstanceInfo, actor: object) -> dict[str, object]:
        """What a restarted instance's lending agent is introduced to: the live instances' actors, and its own, by
        transport address."""
        assert self.lending is not None
        with self.lock:
            peers = {a: self.instances[i].actor for i, a in self.lending.live_addresses().items() if i != iid}
        return {**peers, info.kv_address: actor}

    def _peer_back(self, back: PeerBack) -> None:
        # Not waited for, as PeerLost: the instance told calls the new actor from its next move or plan.
        self.instances[back.instance_id].actor.lend_peer_back.remote(back.address, self.instances[back.back].actor)

    def _prefetch(self, prefetch: Prefetch) -> None:
        # Not waited for: a prefetch only saves a later read, and an instance that dies is found by its heartbeat.
        self.instances[prefetch.instance_id].actor.prefetch.remote(prefetch.request_id, prefetch.prompt)

    def _drop_prefetch(self, drop: DropPrefetch) -> None:
        self.instances[drop.instance_id].actor.drop_prefetch.remote(drop.request_id)

    def _add(self, send: Send) -> AddResult:
        """The instance's answer to ``send``, with Ray's errors told apart."""
        actor = self.instances[send.instance_id].actor
        call = actor.add.remote(send.request_id, send.prompt, send.params, send.program, send.resume, send.handoff)
        return self._answer(call, send.instance_id, send.request_id)

    def _prepare(self, prepare: Prepare) -> PrepareResult | AddResult:
        actor = self.instances[prepare.instance_id].actor
        call = actor.prepare.remote(prepare.request_id, prepare.prompt, prepare.params, prepare.program, prepare.plan)
        return self._answer(call, prepare.instance_id, prepare.request_id)

    def _pe_holds(self, instance_id: str, prompt: list[int], params: SamplingParams) -> int:
        """The leading blocks of ``prompt`` a prefill engine holds in memory for a call with ``params`` (its adapter,
        its cache salt); 0 when it does not answer (its Send will fail, and the call fail over, as for any lost PE)."""
        import ray

        try:
            call = self.instances[instance_id].actor.memory_prefix_blocks.remote(prompt, params)
            return int(ray.get(call, timeout=self.config.heartbeat_timeout_s))
        except Exception as e:
            log.warning("prefill engine %s did not say what it holds: %s", instance_id, type(e).__name__)
            return 0

    def _continue(self, cont: Continue) -> AddResult:
        actor = self.instances[cont.instance_id].actor
        return self._answer(
            actor.continue_request.remote(cont.request_id, cont.resume), cont.instance_id, cont.request_id
        )

    def _answer(self, call: object, instance_id: str, request_id: str) -> Any:
        """What a remote call answered, with Ray's errors told apart: ``unreachable`` (the instance died or hung)
        or ``failed`` (the call raised there; the instance lives)."""
        import ray

        try:
            return ray.get(call, timeout=self.config.heartbeat_timeout_s)
        except Exception as e:
            if _instance_unreachable(e):
                return AddResult("unreachable", type(e).__name__)
            cause = getattr(e, "cause", None) or e  # a RayTaskError carries what add raised on the instance
            message = f"instance {instance_id} failed to take the request: {type(cause).__name__}: {cause}"
            log.error("request %s: %s", request_id, message)
            return AddResult("failed", message)

    # -- background threads -------------------------------------------------------------------

    def _poll(self, iid: str, inst: Instance) -> None:
        """Drain ``inst``'s deltas while it is the instance's current actor and alive."""
        import ray

        while not self._stop.is_set() and self.dispatcher.views[iid].alive and self.instances[iid] is inst:
            try:
                deltas = ray.get(inst.actor.drain.remote(0.1), timeout=self.config.heartbeat_timeout_s)
            except Exception as e:
                if not self._stop.is_set():
                    self._lose_current(iid, inst, f"drain failed: {type(e).__name__}")
                return
            for delta in deltas:
                self._on_delta(iid, delta)

    def _on_delta(self, iid: str, delta: RequestDelta) -> None:
        shown = self._receive(iid, delta)
        if shown is not None and shown.finished:
            for fn in self._listeners:
                fn(shown)

    def _heartbeats(self) -> None:
        import ray

        while not self._stop.wait(self.config.heartbeat_interval_s):
            for iid, inst in list(self.instances.items()):
                if not self.dispatcher.views[iid].alive:
                    continue
                try:
                    beat: Heartbeat = ray.get(inst.actor.heartbeat.remote(), timeout=self.config.heartbeat_timeout_s)
                except Exception as e:
                    if self._stop.is_set():  # (shut down meanwhile: Ray may be gone, and nothing is lost)
                        return
                    self._lose_current(iid, inst, f"heartbeat failed: {type(e).__name__}")
                    continue
                if self._watch_step(iid, beat.step):
                    continue
                inst.stats, inst.links = beat.stats, beat.links
                if self.lending is not None and beat.lending is not None:
                    with self.lock:
                        self.lending.on_heartbeat(beat.lending)
                if isinstance(self.dispatcher, PDDispatcher):
                    queued = read_queue_tokens(storage_queue_bytes(beat.links), self._kv_bytes_per_token)
                    with self.lock:
                        self.dispatcher.report(iid, queued)
            if self._stop.is_set():
                return
            self._start_due_restarts()
            with self.lock:
                self.dispatcher.expire()
                orders = self.lending.orders() if self.lending is not None else []
            for order in orders:  # the instance carries it out between its steps
                self.instances[order.instance_id].actor.lend_order.remote(order)


def _kill(actor: object | None) -> None:
    """Kill an actor, quietly (it may be gone), unless Ray is down: a Ray call where Ray is not running starts it (a
    thread of a client shut down would start a session in the caller's process that nothing ends)."""
    import ray

    if actor is not None and ray.is_initialized():
        with contextlib.suppress(Exception):
            ray.kill(actor)


def instance_state(dispatcher: Dispatcher, iid: str) -> str:
    """An instance's state as ``/cluster`` shows it: alive, restarting (lost; its restart is due or under way, and
    it takes no call until it is ready) or dead (lost, and no restart coming)."""
    if dispatcher.views[iid].alive:
        return "alive"
    return "restarting" if dispatcher.restarts.state(iid) in ("down", "starting") else "dead"


def restart_metrics(dispatcher: Dispatcher) -> Iterator[Metric]:
    """Each instance's losses and restarts, for ``/metrics``."""
    lost = CounterMetricFamily("boundless_instance_lost", "times the instance was lost", labels=["instance"])
    restarts = CounterMetricFamily(
        "boundless_instance_restarts", "restarts of the instance that came up and took calls again", labels=["instance"]
    )
    failed = CounterMetricFamily(
        "boundless_instance_restart_failures", "restarts of the instance that did not come up", labels=["instance"]
    )
    up = GaugeMetricFamily("boundless_instance_up", "1 while the instance takes calls, else 0", labels=["instance"])
    for iid, view in dispatcher.views.items():
        counts = dispatcher.restarts.counts(iid)
        for family, value in zip((lost, restarts, failed), counts, strict=True):
            family.add_metric([iid], float(value))
        up.add_metric([iid], float(view.alive))
    yield from (lost, restarts, failed, up)


def failure_error(failure: Fail) -> Exception:
    """The exception a submitter raises for its call's failure (the HTTP layer maps each to a status)."""
    if failure.reason == "invalid":
        return failure.refusal or InvalidRequestError(failure.message)
    if failure.reason == "busy":
        return QueueFullError()
    if failure.reason == "unavailable":
        return EngineDeadError(failure.message)
    return InstanceCallError(failure.message)


def failure_delta(failure: Fail) -> RequestDelta:
    """The last delta of a call that failed after it started (while failing over): one that found no room (every
    queue full, or no instance left) ends as the server's state, which the API answers with a 503 to retry."""
    no_room = failure.reason in ("busy", "unavailable")
    reason = NO_ROOM_AFTER_FAILOVER if no_room else failure.message
    return RequestDelta(failure.request_id, [], "", [], finished=True, finish_reason="error", stop_reason=reason)


def _instance_unreachable(e: Exception) -> bool:
    """Whether Ray's error says the instance died or hung, rather than that the call raised there."""
    from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

    return not isinstance(e, RayTaskError) and isinstance(e, (RayActorError, GetTimeoutError, ObjectLostError))


def role_setups(cluster: ClusterConfig, directory: str) -> dict[str, RoleSetup | None]:
    """Each instance's part in a prefill/decode cluster, its endpoint meeting the others' in ``directory``."""
    roles = _roles(cluster)
    # Under oracle no read costs storage bandwidth: the instances get no storage link.
    links = dataclasses.replace(cluster, storage_gbps=None) if cluster.kv_path == "oracle" else cluster
    return {
        iid: RoleSetup(role, links, directory, rank, len(roles))  # type: ignore[arg-type]
        for rank, (iid, role) in enumerate(roles.items())
    }


def check_ray_address(address: str | None) -> None:
    """That something answers at ``--ray-address`` (``host:port`` or ``ray://host:port``; ``auto`` and none are Ray's
    to find): Ray retried a cluster that is not there for ever, deaf to SIGTERM."""
    if not address or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address: {address!r} is no host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5.0).close()
    except OSError as e:
        raise ConfigError(f"--ray-address: nothing answers at {address} ({e.strerror or e})") from None


def make_pd_dispatcher(
    infos: Mapping[str, InstanceInfo],
    engine: EngineConfig,
    cluster: ClusterConfig,
    table: ProcessTable,
    max_queued: int | None = None,
) -> PDDispatcher:
    """The dispatcher over prefill and decode engines that described themselves as ``infos``, its queue holding
    ``max_queued`` calls at most."""
    if len({i.fingerprint for i in infos.values()}) != 1:
        raise RuntimeError(
            "prefill and decode engines must serve the same model, and a LongRoPE model with the same factors (their "
            "KV fingerprints differ: another model, or a --max-model-len past the original context on one side only)"
        )
    require_one_kv_type(infos, "prefill and decode engines")
    # With emulated storage links every instance reads through a link of its own: a node of its own.
    emulated = cluster.storage_gbps is not None or cluster.net_gbps is not None
    members = {
        iid: PDInstance(
            i.role,  # type: ignore[arg-type]
            iid if emulated else i.node,
            i.kv_address,
            i.kv_blocks * i.block_size if i.kv_blocks else None,
            i.host_blocks * i.block_size if i.host_blocks else None,
        )
        for iid, i in infos.items()
    }
    first = next(iter(infos.values()))
    config = PDSchedulerConfig.from_configs(cluster, engine.scheduler)
    order_by_program = engine.scheduler.queue_order == "program"
    restarts = RestartPolicy.from_config(cluster)
    return PDDispatcher(
        members, table, time.monotonic, config, first.block_size, order_by_program, restarts, max_queued
    )


def require_one_kv_type(infos: Mapping[str, InstanceInfo], who: str) -> None:
    """Refuse engines that hold KV in different types (``--kv-cache-dtype``) or blocks of different sizes: the blocks
    they hand each other travel as their bytes, so an fp8_e4m3 block read as fp8_e5m2 (the same size) would be
    attended to as other numbers, and a block of another size is lost at every handoff."""
    layouts = {(i.kv_dtype, i.block_size) for i in infos.values()}
    if len(layouts) > 1:
        held = ", ".join(f"{iid} {i.kv_dtype} in blocks of {i.block_size}" for iid, i in infos.items())
        raise ConfigError(
            f"{who} must hold KV in one type and block size (--kv-cache-dtype, --block-size): their blocks move "
            f"between them as bytes; here {held}"
        )


def kv_bytes_per_token(infos: Mapping[str, InstanceInfo]) -> int:
    """KV bytes per token of the engines' model (one model: one ratio), to turn read queues into tokens."""
    first = next(iter(infos.values()))
    return max(1, first.kv_bytes_per_block // first.block_size)


def _roles(cluster: ClusterConfig) -> dict[str, str | None]:
    """Instance ids and their roles: ``0``..``N-1`` without roles, or ``p0``.. and ``d0``.. with them."""
    if not cluster.disaggregated:
        return {str(i): None for i in range(cluster.instances)}
    prefill, decode = cluster.roles
    return {f"p{i}": "prefill" for i in range(prefill)} | {f"d{i}": "decode" for i in range(decode)}


def storage_queue_bytes(links: list[LinkStats]) -> int:
    """Bytes queued on an instance's storage link (0 without one)."""
    return next((s.queued_bytes for s in links if s.name == "storage"), 0)


def _require_gpus(instances: int, ranks_each: int, joined: bool) -> None:
    """Refuse instances on GPUs a Ray cluster this server started lacks (one GPU each, one per rank of a split model):
    Ray would wait for them for ever, repeating that no node can fulfil the request. A joined cluster
    (``--ray-address``) may gain nodes, so there it is a warning."""
    import ray

    have = int(ray.cluster_resources().get("GPU", 0))
    needed = instances * ranks_each
    # (An instance's ranks share its actor's node: a split model needs that many GPUs on one node.)
    most_on_a_node = max((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0)
    if have >= needed and most_on_a_node >= ranks_each:
        return
    each = "one each" if ranks_each == 1 else f"{ranks_each} each (--tensor-parallel-size), on one node"
    message = f"--device cuda: {instances} engine instances need {needed} GPUs, {each}; the Ray cluster has {have}"
    if ranks_each > 1:
        message += f", at most {most_on_a_node} on a node"
    if not joined:
        raise ConfigError(f"{message} (give fewer instances, or --ray-address of a cluster with more)")
    log.warning("%s; the instances wait until nodes with GPUs join", message)


def _local_cpus() -> int:
    return len(os.sched_getaffinity(0))
