"""One engine instance in its own process: the body of a Ray actor.

The actor runs an :class:`~boundless.engine.async_engine.EngineLoop` and keeps its deltas in an
outbox that the router drains with long polls. Calls return plain values (errors as tuples), so
nothing depends on how Ray wraps exceptions.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from boundless.cluster.dispatcher import AddResult
from boundless.cluster.lending_cluster import LendingOrder
from boundless.cluster.lending_instance import InstanceLending, LendingSetup
from boundless.cluster.lending_plan import served_request_pools
from boundless.cluster.links import InstanceLinks, LinkStats, instance_links
from boundless.cluster.pd_dispatcher import PrepareResult
from boundless.cluster.pd_scheduler import Role
from boundless.cluster.placement import Heartbeat as LendingHeartbeat
from boundless.cluster.rmanager import SendBlocks, TryMove
from boundless.config import ClusterConfig, EngineConfig
from boundless.engine.async_engine import EngineDeadError, EngineLoop, QueueFullError, engine_stopped
from boundless.engine.attention_time import AttentionSample
from boundless.engine.core import EngineCore, EngineStats, RequestDelta, Resume
from boundless.engine.errors import InvalidRequestError
from boundless.engine.handoff import HandoffPlan, IntakePlan
from boundless.engine.hung_executor import HangTrap, HungExecutor
from boundless.engine.rank_process import RankEndpoint
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import SchedulerOutput
from boundless.engine.split_lending import lending_address
from boundless.engine.step_watch import StepReport
from boundless.engine.tensor_parallel import load_with_ranks
from boundless.model.loader import LoadedModel
from boundless.model.pooling import EmbeddingPooling
from boundless.programs.ref import ProgramRef
from boundless.transport.endpoints import EndpointSpec, open_endpoint

# Test hook: with this variable set in an instance's environment, ``add`` raises for a request whose
# seed equals its value, as a request that trips a bug in the engine would.
FAIL_ADD_SEED_ENV = "BOUNDLESS_TEST_FAIL_ADD_SEED"
# Test hook: the instance whose id this variable names hangs for ever in its first step that decodes a request
# already 3 tokens in, as an engine whose forward pass never returns (a hung kernel): the step watchdog's test.
HANG_STEP_ENV = "BOUNDLESS_TEST_HANG_STEP_INSTANCE"

log = logging.getLogger(__name__)


def log_as_instance(instance_id: str) -> None:
    """An actor's own process: its ``boundless`` log lines as a single engine's server writes them (time, level,
    logger, INFO and up), naming the instance that wrote them. Ray forwards them to the server's output under the
    actor's pid alone, which an operator could not tell apart (a restart changes it; the server logs no pid); before,
    they had no handler at all and came through Python's last resort: the message only, warnings and up."""
    handler = logging.StreamHandler()  # stderr, which Ray forwards to the server (log_to_driver)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s instance {instance_id} %(name)s: %(message)s"))
    logger = logging.getLogger("boundless")
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


@dataclass(frozen=True)
class InstanceInfo:
    instance_id: str
    pid: int
    node: str
    max_model_len: int
    device: str
    role: str = ""  # prefill or decode, in a disaggregated cluster
    kv_address: str = ""  # its KV transport's address, in a disaggregated cluster
    block_size: int = 16
    kv_bytes_per_block: int = 0
    fingerprint: str = ""
    kv_blocks: int = 0  # its device KV pool
    host_blocks: int = 0  # its host KV memory (what the dispatcher's reads ahead for waiting calls may use a share of)
    lending: bool = False  # it lends and borrows KV; ``kv_address`` is its rManager's id
    kv_dtype: str = ""  # the type its KV cache holds (--kv-cache-dtype), as torch names it: float8_e4m3fn, float32, ...
    pooling: EmbeddingPooling = field(default_factory=EmbeddingPooling)  # how its model's embeddings are made


def _decodes_three_in(sched: SchedulerOutput) -> bool:
    """The ``HANG_STEP_ENV`` hook's step: the first that decodes a request already 3 tokens in."""
    return any(c.num_output_tokens >= 3 and len(c.token_ids) == 1 for c in sched.chunks)


@dataclass(frozen=True)
class RoleSetup:
    """An engine's part in a prefill/decode cluster: its role, and the transport endpoint it opens (``rank`` of
    ``world_size`` endpoints, meeting in ``directory``), its links and timeouts from ``cluster``."""

    role: Role
    cluster: ClusterConfig
    directory: str
    rank: int
    world_size: int


@dataclass
class Heartbeat:
    """What an instance says of itself: its engine's stats, its emulated links' (storage, network), with KV lending
    its rManager's report and step times for the gManager, and the step its engine is running (None when idle or
    between steps), for the front end's watchdog (``cluster/stuck_step.py``)."""

    stats: EngineStats
    links: list[LinkStats] = field(default_factory=list)
    lending: LendingHeartbeat | None = None
    step: StepReport | None = None


class EngineInstance:
    """An engine, its loop thread and an outbox of deltas; with ``role``, a prefill or decode engine with a KV
    transport to its peers and emulated storage and network links."""

    def __init__(
        self,
        instance_id: str,
        config: EngineConfig,
        max_waiting: int,
        threads: int | None = None,
        role: RoleSetup | None = None,
        loaded: LoadedModel | None = None,
        lending: LendingSetup | None = None,
        events_rank: int = 0,
    ) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.instance_id = instance_id
        self.role = role
        fail_seed = os.environ.get(FAIL_ADD_SEED_ENV)
        self._fail_add_seed = int(fail_seed) if fail_seed else None
        ranks = None
        if loaded is None:  # an actor loads its own; instances in one process may share one
            log_as_instance(instance_id)  # (its process is its own, the logging set-up too)
            loaded, ranks = load_with_ranks(config)  # (a split model's other ranks are processes of the actor's)
        self.links = InstanceLinks(None, None)
        if role is not None:
            self.links = instance_links(role.cluster, time.monotonic, time.sleep)
        storage = self.links.storage
        # With KV lending a request may hold what the other instances lend beside this pool (--lending-request-pools).
        pools = 1.0 if lending is None else served_request_pools(lending.cluster)
        # (A prefill engine's prompts go whole to its decode engine, and lending moves blocks by index: no block goes
        # back past a sliding window there, and a context stays within what the pools hold.)
        self.core = EngineCore.from_model(
            loaded, config, read_link=storage, pools=pools, events_rank=events_rank, ranks=ranks,
            release_windows=role is None and lending is None,
        )  # fmt: skip
        self.transport = None
        self.kv_address = ""  # where its peers reach it: its endpoint's address, or its ranks' (a split model)
        if role is not None:
            timeout_s = role.cluster.kv_handoff_timeout_s
            spec = EndpointSpec(role.cluster.kv_transport, role.directory, role.rank, role.world_size, timeout_s)
            try:
                self.transport = open_endpoint(spec)
                net = self.links.net
                self.kv_address = self.core.connect(
                    self.transport, throttle=net.transfer if net else None, timeout_s=timeout_s,
                    ranks_endpoint=RankEndpoint(spec, role.cluster, timeout_s, layerwise=True),
                )  # fmt: skip
            except BaseException:  # (in one process with others, a split model's ranks would outlive it)
                self.core.close()
                if self.transport is not None:
                    self.transport.close()
                raise
        if os.environ.get(HANG_STEP_ENV) == instance_id:
            log.error("test hook %s: this instance's first step decoding a request 3 tokens in hangs", HANG_STEP_ENV)
            trap = HangTrap(_decodes_three_in)  # never released: the step hangs for ever
            self.core.executor = HungExecutor(self.core.executor, trap)  # type: ignore[assignment]
        self._outbox: list[RequestDelta] = []
        self._ready = threading.Condition()
        self.loop = EngineLoop(self.core, self._sink, max_waiting)
        self.lending: InstanceLending | None = None
        if lending is not None:
            # Its transport endpoint carries the moved blocks and the DistAttention partials.
            spec = EndpointSpec(
                lending.cluster.kv_transport,
                lending.directory,
                lending.rank,
                lending.world_size,
                lending.cluster.kv_handoff_timeout_s,
            )
            self.transport = open_endpoint(spec)
            try:  # (a split model's ranks open endpoints of their own: each lends and borrows its share)
                how = RankEndpoint(spec, lending.cluster, spec.timeout_s, layerwise=False)
                self.kv_address = lending_address(self.core, self.transport, how)
            except BaseException:
                self.core.close()
                self.transport.close()
                raise
            with self.loop.lock:
                self.lending = InstanceLending(self.core, self.transport, self.kv_address, lending, self.loop.lock)
                self.loop.hooks = self.lending

    def _sink(self, delta: RequestDelta) -> None:
        delta.instance = self.instance_id
        with self._ready:
            self._outbox.append(delta)
            self._ready.notify_all()

    def info(self) -> InstanceInfo:
        core = self.core
        return InstanceInfo(
            self.instance_id,
            os.getpid(),
            os.uname().nodename,
            core.max_model_len,
            core.identity.device,
            role=self.role.role if self.role else "",
            kv_address=self.kv_address or (self.transport.address if self.transport else ""),
            lending=self.lending is not None,
            block_size=core.layout.block_size,
            kv_bytes_per_block=core.layout.bytes_per_block,
            fingerprint=core.identity.fingerprint,
            kv_blocks=core.layout.num_blocks,
            host_blocks=core.layout.num_host_blocks,
            kv_dtype=str(core.layout.kv_dtype).removeprefix("torch."),
            pooling=core.identity.pooling,
        )

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        program: ProgramRef | None = None,
        resume: Resume | None = None,
        handoff: HandoffPlan | None = None,
    ) -> AddResult:
        if self._fail_add_seed is not None and params.seed == self._fail_add_seed:
            raise RuntimeError(f"test hook {FAIL_ADD_SEED_ENV}: add fails for seed {params.seed}")
        try:
            self.loop.add(request_id, prompt_token_ids, params, program, resume, handoff)
        except InvalidRequestError as e:
            return AddResult("invalid", str(e), e)
        except QueueFullError as e:
            return AddResult("busy", str(e))
        except EngineDeadError as e:  # (stopped since its last heartbeat: the call goes elsewhere, as for a dead actor)
            return AddResult("unreachable", str(e))
        return AddResult("ok")

    def prepare(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        program: ProgramRef | None,
        plan: IntakePlan,
    ) -> PrepareResult:
        """Become the decode engine of a call (``cluster/pd_dispatcher.py``)."""
        try:
            answer = self.loop.prepare(request_id, prompt_token_ids, params, plan, program)
        except InvalidRequestError as e:
            return PrepareResult("invalid", message=str(e), refusal=e)
        except QueueFullError as e:
            return PrepareResult("busy", message=str(e))
        except EngineDeadError as e:
            return PrepareResult("unreachable", message=str(e))
        return PrepareResult("ok", answer)

    def memory_prefix_blocks(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> int:
        """How many leading full blocks of a prompt this engine holds in memory: asked of a DE-read call's prefill
        engine before its decode engine is prepared, so that the decode engine pushes only the rest."""
        return self.loop.memory_prefix_blocks(prompt_token_ids, params)

    def prefetch(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """Read a call's stored KV into host memory before the call comes here (``EngineCore.prefetch``); returns the
        blocks it will read. Never raises: a prefetch only saves a read later."""
        try:
            return self.loop.prefetch(request_id, prompt_token_ids)
        except Exception:
            log.exception("prefetch of %s failed", request_id)
            return 0

    def drop_prefetch(self, request_id: str) -> None:
        """The call prefetched here will not come: its blocks are let go (they stay as cache)."""
        self.loop.drop_prefetch(request_id)

    def continue_request(self, request_id: str, resume: Resume) -> AddResult:
        """Give a prepared call its first token; ``failed`` if this engine no longer holds it."""
        try:
            continued = self.loop.continue_request(request_id, resume)
        except EngineDeadError as e:
            return AddResult("unreachable", str(e))
        if continued:
            return AddResult("ok")
        return AddResult("failed", f"instance {self.instance_id} holds no prepared call {request_id!r}")

    def drain(self, timeout_s: float = 0.1) -> list[RequestDelta]:
        """Deltas since the last drain; waits up to ``timeout_s`` for the first one."""
        with self._ready:
            if not self._outbox:
                self._ready.wait(timeout_s)
            out, self._outbox = self._outbox, []
        return out

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def take_step_times(self) -> list[AttentionSample]:
        """The steps the engine recorded (shapes, seconds) since the last take: ``simulate calibrate --served``
        fits a cluster's step model from them. (KV lending's heartbeats read the same records as a reader of their
        own: each gets every step.)"""
        with self.loop.lock:
            return self.core.step_times.drain()

    def heartbeat(self) -> Heartbeat:
        # A loop stopped by an error outside a step answers no more calls: the front end loses the instance at this
        # failed heartbeat and fails its calls over (they waited for ever on an actor that answered with old stats).
        if self.loop.error is not None:
            raise EngineDeadError(f"instance {self.instance_id}: {engine_stopped(self.loop.error)}")
        lending = self.lending.heartbeat() if self.lending is not None else None
        return Heartbeat(self.loop.stats()["0"], self.links.stats(), lending, self.loop.step_in_flight())

    # -- KV lending (``cluster/lending_instance.py``) -----------------------------------------------------------

    def _lending(self) -> InstanceLending:
        if self.lending is None:
            raise RuntimeError(f"instance {self.instance_id} does not lend KV")
        return self.lending

    def lend_connect(self, peers: dict[str, object]) -> None:
        """The other instances' actors, by transport address."""
        self._lending().connect(peers)

    def lend_order(self, order: LendingOrder) -> None:
        """The gManager's order to this instance (a move of its blocks, a hold or a release); carried out between
        steps."""
        self._lending().order(order)
        self.loop.wake()

    def lend_peer_lost(self, address: str) -> None:
        self._lending().peer_lost(address)

    def lend_peer_back(self, address: str, actor: object) -> None:
        """The instance at ``address``, lost before, was started again as ``actor``."""
        self._lending().peer_back(address, actor)

    def lend_try_move(self, action: TryMove) -> bool:
        return self._lending().try_move(action)

    def lend_take_blocks(self, action: SendBlocks, debtor: str) -> bool:
        return self._lending().take_blocks(action, debtor)

    def lend_confirm_blocks(self, move_id: str) -> bool:
        return self._lending().confirm_blocks(move_id)

    def lend_release(self, move_id: str) -> None:
        self._lending().release(move_id)

    def stop(self) -> None:
        """Stop the engine loop at its next step's end, without waiting for it: the instance was declared lost, and
        a stuck step may never end. (An actor is killed instead; this is for instances in one process.)"""
        self.loop.stop()

    def shutdown(self) -> None:
        self.loop.shutdown()
        if self.lending is not None:
            self.lending.close()
        if self.transport is not None:
            self.transport.close()
