"""Prefill and decode engines in this process, behind the cluster's PD dispatcher: the Ray cluster's
transport (``cluster/client.py``) with direct calls in place of actors.

Each engine is an :class:`~boundless.cluster.instance.EngineInstance`, the very body of a Ray actor: its own
engine loop thread, its endpoint of the KV transport (shared memory by default) and its emulated storage and
network links. The dispatcher's decisions (prepare the DE, send the call to the PE, continue on the DE) are
carried out by the loop ``ClusterClient`` uses (``DispatcherFrontEnd``), calling the instances instead of
their actors; a poller thread per instance hands its deltas to the dispatcher, and a heartbeat thread reports
each node's storage read queue and watches each engine's step in flight: an engine stuck in one step past
``--step-timeout-s`` is lost (``cluster/stuck_step.py``), its loop told to stop, and its calls fail over as in the
Ray cluster. When the dispatcher's restart is due (``cluster/restarts.py``) the heartbeat thread closes the lost
engine's transport endpoint (its peers see it gone) and makes a fresh engine of the same id and role over the same
weights, with an empty KV cache; it takes calls from its first heartbeat. What is left out is what only processes
need: other deaths (nothing here dies alone) and Ray's error kinds. The benchmark (``bench/agentic.py``) and tests
use it where a Ray actor per engine would be too heavy; it offers the HTTP server's engine interface (``submit``
returning a stream), as the Ray cluster does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from boundless.cluster.client import (
    DispatcherFrontEnd,
    kv_bytes_per_token,
    make_pd_dispatcher,
    role_setups,
    storage_queue_bytes,
)
from boundless.cluster.dispatcher import AbortOn, AddResult, MarkDead, Send
from boundless.cluster.instance import EngineInstance
from boundless.cluster.links import LinkStats
from boundless.cluster.pd_dispatcher import Continue, DropPrefetch, Prefetch, Prepare, PrepareResult
from boundless.cluster.pd_scheduler import read_queue_tokens
from boundless.cluster.restarts import Restart
from boundless.config import ClusterConfig, EngineConfig
from boundless.engine.async_engine import EngineDeadError, StreamRegistry
from boundless.engine.core import EngineStats
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import LoadedModel, load_configured_model
from boundless.programs.process_table import ProcessTable
from boundless.transport.meeting_dir import make_meeting_directory

log = logging.getLogger(__name__)


class LocalPDCluster(DispatcherFrontEnd):
    """``--prefill-instances P --decode-instances D`` engines in this process behind a PD dispatcher."""

    def __init__(
        self, engine: EngineConfig, cluster: ClusterConfig, loaded: LoadedModel | None = None, max_waiting: int = 1024
    ) -> None:
        if not cluster.disaggregated:
            raise ValueError("a local PD cluster needs --prefill-instances and --decode-instances")
        self.config = cluster
        self._meeting = make_meeting_directory()
        setups = role_setups(cluster, self._meeting.path)
        # Each engine of a split model loads its own share (its network joins its ranks' sum; the builder launches
        # them), here rather than as an actor loads its own (which takes over the process's logging for its instance).
        split = engine.model.tensor_parallel_size > 1
        self._new_engine: Callable[[str], EngineInstance] = lambda iid: EngineInstance(
            iid, engine, max_waiting, role=setups[iid],
            loaded=load_configured_model(engine.model) if split else loaded,
        )  # fmt: skip
        self.instances = {iid: self._new_engine(iid) for iid in setups}
        self._due: list[str] = []  # instances whose restart the heartbeat thread carries out next
        self._replaced: list[EngineInstance] = []  # lost engines a restart replaced (shut down with the rest)
        infos = {iid: inst.info() for iid, inst in self.instances.items()}
        self.tokenizer = next(iter(self.instances.values())).core.tokenizer
        self.max_model_len = min(i.max_model_len for i in infos.values())
        self.max_logprobs = engine.model.max_logprobs
        self._kv_bytes_per_token = kv_bytes_per_token(infos)
        table = ProcessTable(ttl_s=engine.scheduler.program_ttl_s, critical_path=engine.scheduler.policy == "atlas")
        self.max_waiting = max_waiting * len(self.instances)  # (as ClusterClient's)
        self.dispatcher = make_pd_dispatcher(infos, engine, cluster, table, self.max_waiting)
        self.streams = StreamRegistry()
        self.lock = threading.RLock()  # around the dispatcher and the calls its decisions make
        self._stop = threading.Event()
        self._threads = [self._poller(iid, inst) for iid, inst in self.instances.items()]
        self._threads.append(threading.Thread(target=self._heartbeats, name="boundless-heartbeat", daemon=True))
        for t in self._threads:
            t.start()

    # -- the engine interface ---------------------------------------------------------------------

    def is_alive(self) -> bool:
        return self.dispatcher.is_alive()

    def stats(self) -> dict[str, EngineStats]:
        return {iid: inst.loop.stats()["0"] for iid, inst in self.instances.items()}  # (a heartbeat's, if dead too)

    def link_stats(self) -> dict[str, list[LinkStats]]:
        """Each instance's emulated links (storage, network), as its heartbeat reports them."""
        return {iid: inst.links.stats() for iid, inst in self.instances.items()}

    def shutdown(self) -> None:
        self._stop.set()
        for t in list(self._threads):
            t.join(timeout=5)
        for inst in [*self.instances.values(), *self._replaced]:
            inst.shutdown()
        self._meeting.remove()

    # -- carrying out the dispatcher's decisions ----------------------------------------------------

    def _add(self, send: Send) -> AddResult:
        inst = self.instances[send.instance_id]
        return _call(
            lambda: inst.add(send.request_id, send.prompt, send.params, send.program, send.resume, send.handoff)
        )

    def _prepare(self, prepare: Prepare) -> PrepareResult | AddResult:
        inst = self.instances[prepare.instance_id]
        return _call(
            lambda: inst.prepare(prepare.request_id, prepare.prompt, prepare.params, prepare.program, prepare.plan)
        )

    def _pe_holds(self, instance_id: str, prompt: list[int], params: SamplingParams) -> int:
        """The leading blocks of ``prompt`` a prefill engine holds in memory for a call with ``params`` (its adapter,
        its cache salt); 0 when it cannot say (its Send will fail, and the call fail over, as for any lost PE)."""
        try:
            return self.instances[instance_id].memory_prefix_blocks(prompt, params)
        except Exception:
            return 0

    def _continue(self, cont: Continue) -> AddResult:
        inst = self.instances[cont.instance_id]
        return _call(lambda: inst.continue_request(cont.request_id, cont.resume))

    def _mark_dead(self, mark: MarkDead) -> None:
        log.error("instance %s is dead (%s); failing over its calls", mark.instance_id, mark.reason)
        self.instances[mark.instance_id].stop()  # a stuck step is not waited for: it may never end

    def _restart(self, restart: Restart) -> None:
        self._due.append(restart.instance_id)  # started by the heartbeat thread, out of the lock

    def _start_again(self, iid: str) -> None:
        """A fresh engine for lost instance ``iid``; it takes calls once it answers a heartbeat."""
        old = self.instances[iid]
        try:
            if old.transport is not None:  # its peers see it gone, and connect to the new one at its address
                old.transport.close()
            inst = self._new_engine(iid)
            inst.heartbeat()
        except Exception as e:
            self._restart_failed(iid, f"{type(e).__name__}: {e}")
            return
        with self.lock:
            self._replaced.append(old)
            self.instances[iid] = inst
            poller = self._poller(iid, inst)
            self._threads.append(poller)
            self._rejoin(iid)
            poller.start()

    def _abort_on(self, abort: AbortOn) -> None:
        self.instances[abort.instance_id].abort(abort.request_id)

    def _prefetch(self, prefetch: Prefetch) -> None:
        self.instances[prefetch.instance_id].prefetch(prefetch.request_id, prefetch.prompt)

    def _drop_prefetch(self, drop: DropPrefetch) -> None:
        self.instances[drop.instance_id].drop_prefetch(drop.request_id)

    # -- background threads -------------------------------------------------------------------

    def _poller(self, iid: str, inst: EngineInstance) -> threading.Thread:
        return threading.Thread(target=self._poll, args=(iid, inst), name=f"boundless-poll-{iid}", daemon=True)

    def _poll(self, iid: str, inst: EngineInstance) -> None:
        """Hand ``inst``'s deltas to the dispatcher while it is the instance's current engine and alive."""
        while not self._stop.is_set() and self.dispatcher.views[iid].alive and self.instances[iid] is inst:
            for delta in inst.drain(0.1):
                self._receive(iid, delta)

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            for iid, inst in list(self.instances.items()):
                if not self.dispatcher.views[iid].alive:
                    continue
                try:
                    beat = inst.heartbeat()
                except EngineDeadError as e:  # its loop stopped by an error outside a step: lost, as a Ray actor's
                    self._lose(iid, f"heartbeat failed: {e}")
                    continue
                if self._watch_step(iid, beat.step):
                    continue
                queued = read_queue_tokens(storage_queue_bytes(beat.links), self._kv_bytes_per_token)
                with self.lock:
                    self.dispatcher.report(iid, queued)
            self._start_due_restarts()
            with self.lock:
                due, self._due = self._due, []
            for iid in due:
                self._start_again(iid)
            with self.lock:
                self.dispatcher.expire()


def _call(fn: Callable[[], AddResult | PrepareResult]) -> AddResult | PrepareResult:
    """An instance's answer; one that raised fails its call alone (the instance lives on)."""
    try:
        return fn()
    except Exception as e:
        return AddResult("failed", f"{type(e).__name__}: {e}")
