"""One engine instance: requests in, a step at a time, token and text deltas out.

``EngineCore`` is single-threaded and synchronous: ``step()`` schedules, runs the model once,
samples, and updates every request. Front ends (the offline ``LLM``, the HTTP server, a Ray
actor) drive it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from boundless.config import ConfigError, EngineConfig
from boundless.engine.attention_time import AttentionTimeRecorder
from boundless.engine.bad_words import bad_words_token_ids
from boundless.engine.builder import DeviceMemory, EngineLayout, ModelIdentity, build_model_executor, size_engine
from boundless.engine.detokenizer import IncrementalDetokenizer, add_runs, add_tokens, flush
from boundless.engine.errors import CONTEXT_LENGTH_EXCEEDED, ContextOverflow, InvalidRequestError
from boundless.engine.executor import Executor, ModelExecutor, PendingStep, StepResult
from boundless.engine.handoff import HandoffPlan, IntakeAnswer, IntakePlan, PrefixPush
from boundless.engine.lending_stats import LendingStats
from boundless.engine.logprobs import PromptLogprobs, PromptScores, logprobs_limit
from boundless.engine.multi_step import window_shapes
from boundless.engine.prefill_batching import step_quota
from boundless.engine.rank_process import RankEndpoint
from boundless.engine.request import Request, RequestStatus
from boundless.engine.sampler import SampledToken
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import Scheduler, SchedulerOutput
from boundless.engine.speculative import draft_proposer
from boundless.engine.structured_output import Grammars, StructuredOutput, check_structured_output
from boundless.engine.tensor_parallel import TensorParallelRanks
from boundless.kv.disk_moves import DiskIOStats
from boundless.kv.event_publisher import ZmqEventPublisher, open_publisher
from boundless.kv.events import KVEventLog, LoraTag
from boundless.kv.layer_gate import LayerLost
from boundless.kv.manager import KVCacheManager
from boundless.kv.remote_io import DEFAULT_TIMEOUT_S, RemoteIO
from boundless.kv.remote_moves import RemoteIOStats
from boundless.kv.throttled_store import ReadLink
from boundless.kv.transfer import DISK, PEER
from boundless.model.loader import LoadedModel
from boundless.model.lora import LoRAError, LoRARequest
from boundless.model.tokenizer import Tokenizer
from boundless.programs.eviction import PolicyRanking
from boundless.programs.policy import SchedulingPolicy
from boundless.programs.ref import ProgramRef
from boundless.programs.registry import make_policy
from boundless.transport.base import KVTransport
from boundless.transport.endpoints import instance_address

log = logging.getLogger(__name__)

# Attention-time prefill batching: steps between refits of the step-time model (a fit is a small least-squares
# problem over at most the recorder's 512 samples; refitting every step would cost more than it follows).
REFIT_EVERY_STEPS = 32
# How long an engine holds the blocks it read ahead for a call that has not come (``EngineCore.prefetch``): the
# dispatcher drops a prefetch whose call is aborted or placed elsewhere, so this only bounds a hold whose dispatcher
# is gone. Calls wait at the dispatcher for room elsewhere, for as long as the calls ahead of them run: well above
# a run of agent turns, and the holds are bounded in size by the dispatcher meanwhile.
PREFETCH_HOLD_S = 120.0
# The stop reason of a request failed because a stream its step was reading failed (a DE-read push whose decode
# engine went away mid-push): nothing of it reached the client, so a PD dispatcher places the call again.
KV_STREAM_LOST = "kv stream lost"
# The stop reason of a request longer than its pool that the gManager failed: the live instances could not hold it
# for the grant timeout (cluster/lending_grants.py). The server answers it with a 503, not an engine error.
GRANT_REFUSED = (
    "the request needs more KV memory than the live instances can lend it (an instance was lost and has not come "
    "back); retry later, or with a shorter prompt or max_tokens"
)


@dataclass
class RequestDelta:
    """What one step produced for one request: the new tokens and text, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[SampledToken]
    finished: bool
    finish_reason: str | None = None  # stop, length, abort, or handoff (prefilled here, decoding elsewhere)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # Predicted Outputs (``SamplingParams.prediction``): the prediction's drafts kept and rejected so far.
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    # Engine-clock timestamps, for latency metrics (set on every delta).
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    service_s: float = 0.0  # model time the request has spent in the executor
    instance: str = "0"  # which engine instance produced it
    # With its first token, a request that asked for them (``SamplingParams.prompt_logprobs``): each prompt token's
    # logprob given the tokens before it (None for the first), vLLM's ``prompt_logprobs``.
    prompt_logprobs: PromptLogprobs | None = None
    # An embedding request's (``SamplingParams.embed``): its prompt's embedding, with its one delta.
    embedding: list[float] | None = None


@dataclass(frozen=True)
class Resume:
    """Where a request left off on an instance that failed."""

    output_token_ids: tuple[int, ...]
    text_chars_sent: int


@dataclass
class EngineCounters:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    generation_tokens: int = 0
    computed_tokens: int = 0  # tokens run through the model (prefill, recompute and decode)
    drafts: int = 0  # speculative decoding: chunks with drafts
    draft_tokens: int = 0  # tokens proposed and verified
    accepted_tokens: int = 0  # of which the model's samples matched
    accepted_by_position: list[int] = field(default_factory=list)  # drafts kept, by their place in the chunk
    busy_seconds: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)


@dataclass
class TierStats:
    """One KV tier (device, host, disk) of one instance: its hits and traffic so far, and its blocks in use."""

    hit_tokens: int = 0  # prompt tokens whose KV a first admission found in this tier
    bytes_read: int = 0  # copied out of it
    bytes_written: int = 0  # copied into it
    evictions: int = 0  # named blocks it gave up (moved down a tier where one had room)
    checksum_failures: int = 0  # blocks that failed their check when read back: recomputed, never served
    load_timeouts: int = 0  # loads a waiting request gave up on after --kv-load-timeout-s (then recomputed)
    recomputed_blocks: dict[str, int] = field(default_factory=dict)  # disk: stored blocks computed, by why
    reloaded_blocks: int = 0  # disk: stored blocks read a second time (they left memory before their turn)
    blocks_used: int = 0  # memory tiers: blocks held by requests or by moves in flight
    blocks_total: int = 0


@dataclass
class EngineStats:
    """A snapshot of one instance for metrics, load balancing and heartbeats."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (admitted prompts)
    prefix_cache_hits: int  # of which were found cached
    prompt_tokens: int
    generation_tokens: int
    computed_tokens: int
    num_preemptions: int
    num_kept: int  # left out of a step, KV kept
    num_swapped_out: int  # KV moved to host memory
    num_recomputed: int  # KV dropped, to be recomputed
    busy_seconds: float
    steps: int
    kv_tiers: dict[str, TierStats] = field(default_factory=dict)  # by tier id, those this instance has
    disk_io: DiskIOStats | None = None  # the disk store's loads and writes (with --kv-disk-path)
    remote_io: RemoteIOStats | None = None  # block streams to and from other instances (with a transport)
    lending: LendingStats | None = None  # KV lending and DistAttention (with a lending agent)
    window_blocks_released: int = 0  # blocks given back past every layer's sliding window
    spec_drafts: int = 0  # speculative decoding: chunks with drafts (accepted / drafts: the mean run kept)
    spec_draft_tokens: int = 0  # tokens proposed and verified
    spec_accepted_tokens: int = 0  # of which the model's samples matched (kept as output)
    spec_accepted_by_position: list[int] = field(default_factory=list)  # the j-th draft of a step kept, by j
    # LoRA adapters (--enable-lora): the running and waiting requests of each loaded adapter, by name.
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)
    # Autellix's process table: the programs it holds (each until idle past --program-ttl-s; an anonymous call is a
    # program of its own), and the programs with a call running or waiting here now.
    programs_tracked: int = 0
    programs_with_calls: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_total)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class EngineCore:
    """Scheduler, KV cache manager, executor and detokenizers of one instance.

    Built by :meth:`from_model` for the real network; the simulator builds it with the same
    sizing and a cost-model executor.
    """

    def __init__(
        self,
        config: EngineConfig,
        layout: EngineLayout,
        identity: ModelIdentity,
        tokenizer: Tokenizer,
        executor: Executor,
        clock: Callable[[], float] = time.monotonic,
        policy: SchedulingPolicy | None = None,
        grammars: Grammars | None = None,
        kv_events: ZmqEventPublisher | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.identity = identity
        self.tokenizer = tokenizer
        self.executor = executor
        self.clock = clock
        self.max_model_len = layout.max_model_len
        self.eos_token_ids = identity.eos_token_ids
        self.policy = policy or make_policy(config.scheduler)
        ranking = PolicyRanking.of_policy(self.policy, clock) if config.cache.kv_eviction == "program" else None
        self.kv = KVCacheManager(
            layout.num_blocks,
            layout.block_size,
            config.cache.enable_prefix_caching,
            identity.fingerprint,
            num_host_blocks=layout.num_host_blocks,
            disk=layout.disk_bytes > 0,
            write_policy=config.cache.kv_write_policy,
            host_caching=config.cache.host_caches,
            ranking=ranking,
            load_timeout_s=config.cache.kv_load_timeout_s,
        )
        # A model whose every layer slides gives back the blocks that have left the window (when the pool runs short).
        self.kv.window = layout.window
        # Under DE-read the decode engine's push comes counted first and the request runs as its layers land (set
        # alike on every engine of a cluster: both ends of a push must agree on its messages).
        self.kv.layerwise_receive = config.cache.layerwise_load == "on"
        # KV cache events (--kv-events-config): the pools log the names they give and drop; each step's go to the
        # publisher after the step (_publish_kv_events). Without a publisher no log is attached and nothing is made.
        self.kv_events = kv_events
        if kv_events is not None:
            self.kv.enable_events(KVEventLog())
        self.scheduler = Scheduler(
            self.kv,
            self.policy,
            clock,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_num_seqs=config.scheduler.max_num_seqs,
            num_scheduler_steps=config.scheduler.num_scheduler_steps,
            proposer=draft_proposer(config.scheduler.speculative),
            max_loras=config.model.max_loras if config.model.enable_lora else None,
        )
        # Loaded LoRA adapters by name: the fingerprint that names the KV their requests compute, and the adapter as
        # the KV events name it (its id and name).
        self.loras: dict[str, str] = {}
        self._lora_tags: dict[str, LoraTag] = {}
        # The executor's sampler's grammars (one compilation a spec for both): a structured request waits in its queue
        # while its grammar compiles in the background (``Scheduler.compiling``), as vLLM's requests do.
        self.grammars = grammars
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.counters = EngineCounters()
        # Every step's shapes and seconds: what the step-time models (the KV-lending planner's, the prefill
        # batcher's) are fitted from.
        self.step_times = AttentionTimeRecorder()
        self._prefill_batching = config.scheduler.prefill_batching
        self._disk_io = DiskIOStats()  # the executor's disk I/O, as last reported
        self._remote_io: RemoteIOStats | None = None  # its block streams, as last reported (once connected)
        self.handoff_timeout_s = DEFAULT_TIMEOUT_S
        self.lending_stats: Callable[[], LendingStats] | None = None  # set by a lending agent (engine/lending.py)
        # Requests prepared for a handoff, by the time past which one still waiting for its first token is dropped
        # (its prefill engine or the dispatcher is gone): nothing may hold blocks for good.
        self._awaiting: dict[str, float] = {}
        # Calls read ahead for (``prefetch``), by the time past which a call that has not come is dropped.
        self._prefetches: dict[str, float] = {}
        # Asynchronous scheduling: the window decided and queued while the last one ran, read at the next step.
        self._ahead: tuple[SchedulerOutput, PendingStep] | None = None
        # Final deltas of requests failed between steps (a grammar whose compilation failed), for the loop to send.
        self._rejected: list[RequestDelta] = []

    @classmethod
    def from_model(
        cls,
        loaded: LoadedModel,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        policy: SchedulingPolicy | None = None,
        read_link: ReadLink | None = None,
        pools: float = 1,
        events_rank: int = 0,
        ranks: TensorParallelRanks | None = None,
        release_windows: bool = True,
    ) -> EngineCore:
        """An instance that runs ``loaded`` on its device (its store reads waiting for ``read_link``, an
        emulated storage link, when given); a request may hold ``pools`` pools' worth of KV (``size_engine``). With
        --kv-events-config its KV events go out as data-parallel rank ``events_rank`` (on its endpoint's port plus
        that). ``ranks``: a split model's other ranks, launched while ``loaded`` loaded
        (:func:`~boundless.engine.tensor_parallel.load_with_ranks`). ``release_windows``: see ``size_engine``."""
        try:
            memory = DeviceMemory.of(loaded.device)
            layout = size_engine(config, loaded.arch, loaded.dtype, pools, memory, release_windows)
        except BaseException:
            if ranks is not None:
                ranks.close()
            raise
        grammars = Grammars(loaded.tokenizer, loaded.arch.vocab_size)
        executor = build_model_executor(loaded, config, layout, read_link=read_link, grammars=grammars, ranks=ranks)
        events = None
        try:
            events = open_publisher(config.cache.kv_events, layout.block_size, events_rank)
            identity = ModelIdentity.of(loaded, layout)
            core = cls(config, layout, identity, loaded.tokenizer, executor, clock, policy, grammars, events)
            for i, module in enumerate(config.model.loras, start=1):
                try:
                    core.add_lora(LoRARequest(module.name, i, module.path))
                except LoRAError as e:  # at start-up: the flag's fault, said as such
                    raise ConfigError(f"--lora-modules: {e}") from None
        except BaseException:
            if events is not None:  # (its thread and bound sockets would outlive the engine never made)
                events.close()
            executor.close()  # (and a split model's ranks, which would outlive it too)
            raise
        return core

    # -- LoRA adapters -----------------------------------------------------------------------

    def add_lora(self, lora: LoRARequest) -> None:
        """Load a LoRA adapter (``model/lora.py``); requests name it by ``SamplingParams.lora_name``. A name already
        loaded is refused (``LoRAError``; vLLM's rule), whatever the path: unload it first to replace it."""
        if not self.config.model.enable_lora:
            raise LoRAError("LoRA adapters need --enable-lora (LLM(..., enable_lora=True))")
        if lora.lora_name in self.loras:
            raise LoRAError(f"the LoRA adapter {lora.lora_name!r} has already been loaded")
        digest = self.executor.add_lora(lora, self.config.model.max_lora_rank)
        namespace = hashlib.sha256(f"{self.identity.fingerprint}:lora:{digest}".encode()).hexdigest()
        self.loras[lora.lora_name] = namespace[:16]
        self._lora_tags[lora.lora_name] = LoraTag(lora.lora_int_id, lora.lora_name)

    def remove_lora(self, name: str) -> bool:
        """Unload an adapter; False if none has that name. Refused (``LoRAError``) while unfinished requests run with
        it."""
        if name not in self.loras:
            return False
        users = sum(1 for r in self.scheduler.requests.values() if r.sampling_params.lora_name == name)
        if users:
            raise LoRAError(f"LoRA adapter {name!r} is in use by {users} unfinished requests")
        self.executor.remove_lora(name)
        del self.loras[name]
        self._lora_tags.pop(name, None)
        return True

    def connect(
        self,
        transport: KVTransport,
        throttle: Callable[[int], object] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        layerwise: bool = True,
        ranks_endpoint: RankEndpoint | None = None,
    ) -> str:
        """Let this instance move KV to and from its peers over ``transport`` (prefill/decode disaggregation):
        ``throttle(nbytes)`` waits for the emulated network link, ``timeout_s`` bounds every stream, and a
        handoff streams layer by layer during the forward pass (``layerwise``) or after it. A model split over ranks
        moves each rank's share on an endpoint of the rank's own, opened as ``ranks_endpoint`` says. Returns the
        address peers reach this instance at (``transport/endpoints.py``: its ranks' endpoints')."""
        if not isinstance(self.executor, ModelExecutor):
            raise TypeError("only the model executor moves KV between instances")
        # Prompts' blocks go whole between the engines (from block 0): none goes back past a sliding window here
        # (an instance of a role is sized without it: ``size_engine(release_windows=False)``).
        self.kv.window = None
        addresses = [transport.address]
        ranks = self.ranks
        if ranks is not None:
            if ranks_endpoint is None:
                raise ValueError("a model split over ranks moves KV from every rank: say how they open their endpoints")
            addresses += ranks.connect(ranks_endpoint)
        # (A split model's rank 0 keeps its gates until every rank's share of their receive is reported, as the other
        # ranks do: ``kv/split_streams.py``.)
        self.executor.connect(
            lambda tiers: RemoteIO(
                tiers, transport, throttle, timeout_s, layerwise=layerwise, retire_on_report=ranks is None
            )
        )
        self._remote_io = RemoteIOStats()
        self.handoff_timeout_s = timeout_s
        return instance_address(addresses)

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        program: ProgramRef | None = None,
        resume: Resume | None = None,
        handoff: HandoffPlan | None = None,
    ) -> Request:
        """Queue a request. ``resume`` continues one that another instance had started (failover):
        its tokens so far count as output, and only text the client has not seen is sent. ``handoff``
        makes this instance its prefill engine: it ends with its first token, its KV sent to the decode
        engine (``engine/handoff.py``)."""
        request = self._new_request(request_id, prompt_token_ids, params, arrival_time, program, resume)
        request.handoff = handoff
        self._claim_prefetch(request_id, params)
        if handoff is not None and handoff.recv_blocks > 0:  # DE-read: the decode engine pushes what this one lacks
            prompt = request.prompt_token_ids
            if handoff.recv_from > 0:
                # This engine said it holds the blocks before the push: hold them until the request's admission
                # (as a load's prefix is held: bounded, and let go should the engine need the room). Any that left
                # memory are read from the store (counted now, so no probe) or computed.
                caching = self.kv.pool.enable_caching
                held = self.kv.hold_while_receiving(request_id, prompt, handoff.recv_from) if caching else 0
                if held < handoff.recv_from:
                    self._count_stored_prefix(request_id, prompt[: handoff.recv_from * self.kv.block_size + 1])
            self.kv.expect_blocks(
                request_id,
                prompt,
                handoff.recv_from,
                handoff.recv_blocks,
                handoff.peer,
                handoff.recv_tag,
                count_first=self.kv.layerwise_receive,  # the push is used as it lands (its count comes first)
            )
            if self.kv.has_disk:  # the DE saw the push's blocks in the shared store: should some not come, load them
                end = handoff.recv_from + handoff.recv_blocks
                keys = self.kv.block_hashes(request_id, prompt[: end * self.kv.block_size])
                self.kv.note_on_disk(keys[handoff.recv_from : end])
        elif not request.computes_whole_prompt:  # (one that scores or pools its whole prompt reads nothing)
            # This engine reads what the store holds itself: PE-read, colocated, or resumed here.
            self._count_stored_prefix(request_id, request.all_token_ids)
        spec = params.structured
        if spec is not None and self.grammars is not None and not self.grammars.prepare(spec):
            self.scheduler.compiling.add(request_id)
        self.scheduler.add(request)
        return request

    def _count_stored_prefix(self, request_id: str, token_ids: list[int]) -> None:
        """A request this engine prefills from the store (PE-read, colocated): count the blocks the store holds after
        those in memory now (a stat each, as the decode engine does under DE-read), so that the request loads them
        rather than computing them. Without it, the blocks after a prefix in memory are probed in the loader's
        queue, behind every load queued on the slow link, and the request (not waiting for such a probe: it expects
        new input there) computes them meanwhile; an agent's context after the shared prefix is mostly blocks
        another engine (the decode engine) or an earlier process wrote, or this engine evicted and forgot, which
        it does not know to be stored."""
        if not (self.kv.has_disk and self.kv.pool.enable_caching):
            return
        num_full = (len(token_ids) - 1) // self.kv.block_size  # the last token is always computed
        have = len(self.kv.memory_prefix(request_id, token_ids, num_full))
        self.kv.note_memory_prefix(request_id, have)  # should it leave memory before the request's turn: counted
        if have < num_full:
            keys = self.kv.block_hashes(request_id, token_ids[: num_full * self.kv.block_size])[have:]
            self.kv.note_on_disk(keys[: self.executor.count_stored(keys)])

    def prefetch(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """Read ahead the stored KV of a call that will come here under ``request_id`` (the dispatcher's prefetch,
        ``cluster/pd_dispatcher.py``): the blocks the store holds after those in memory now (a ``stat`` each, here)
        load into host memory in the background, after the waiting requests' own loads, and are held for the call
        until its admission. Dropped by :meth:`drop_prefetch`, or after ``PREFETCH_HOLD_S`` without the call: the
        blocks then stay as ordinary cache. Returns the blocks it will read."""
        if request_id in self.scheduler.requests:
            return 0
        blocks = self.kv.prefetch(request_id, prompt_token_ids, self.executor.count_stored)
        if blocks:
            self._prefetches[request_id] = self.clock() + PREFETCH_HOLD_S
        return blocks

    def drop_prefetch(self, request_id: str) -> None:
        """The call read ahead for will not come here: its blocks are let go (they stay cached)."""
        if self._prefetches.pop(request_id, None) is not None:
            self.kv.drop_prefetch(request_id)

    def _claim_prefetch(self, request_id: str, params: SamplingParams) -> None:
        if self._prefetches.pop(request_id, None) is not None:
            if self.kv_namespace(params) is None:
                self.kv.claim_prefetch(request_id)
            else:
                # Read ahead under the model's names (the prefetch knows no parameters), but the request names its KV
                # under its adapter's or cache salt's: none of it is the request's, and the names the read kept for the
                # request id would name its blocks as the model's. Let go, as cache.
                self.kv.drop_prefetch(request_id)

    def kv_namespace(self, params: SamplingParams) -> str | None:
        """The fingerprint that names the KV a request with ``params`` computes, when it is not the model's: its LoRA
        adapter's, salted with its ``cache_salt``. None: the model's. (An adapter not loaded here: its name, which
        names no block.)"""
        if params.lora_name is None and params.cache_salt is None:
            return None
        base = self.identity.fingerprint
        if params.lora_name is not None:
            base = self.loras.get(params.lora_name, f"unloaded:{params.lora_name}")
        if params.cache_salt is None:
            return base
        return hashlib.sha256(f"{base}:salt:{params.cache_salt}".encode()).hexdigest()[:16]

    def memory_prefix_blocks(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> int:
        """How many leading full blocks of a prompt this engine holds in memory (device or host), a lookup that takes
        nothing: a DE-read call's decode engine pushes only the blocks after them (``engine/handoff.py``). With
        ``params``, the blocks a request with them may use (its LoRA adapter's, its cache salt's)."""
        fingerprint = self.kv_namespace(params) if params is not None else None
        if not self.kv.pool.enable_caching:
            return 0
        num_full = len(prompt_token_ids) // self.kv.block_size
        return len(self.kv.memory_prefix(None, prompt_token_ids, num_full, fingerprint=fingerprint))

    def prepare_intake(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        plan: IntakePlan,
        arrival_time: float | None = None,
        program: ProgramRef | None = None,
    ) -> IntakeAnswer:
        """Make this instance the decode engine of a request a prefill engine will hand over
        (``engine/handoff.py``): the request waits for its first token (:meth:`continue_request`); the prompt's
        blocks in memory are held for it; under DE-read (``plan.push_tag``) the blocks the store holds after
        them are counted (a probe), loaded, and pushed with them to the prefill engine; host blocks are reserved
        for the rest, which the prefill engine sends. Returns from which block it should send."""
        request = self._new_request(request_id, prompt_token_ids, params, arrival_time, program, None)
        request.awaiting_resume = True
        request.prompt_logprobs = None  # its prefill engine scores the prompt (its first delta carries them)
        self._claim_prefetch(request_id, params)
        # Its first token comes after the PE's queue, prefill and stream, each stream bounded by the timeout.
        self._awaiting[request_id] = self.clock() + 2 * self.handoff_timeout_s
        prompt = request.prompt_token_ids
        num_full = len(prompt) // self.kv.block_size
        have = self.kv.hold_prefix(request_id, prompt, num_full) if self.kv.pool.enable_caching else 0
        push = push_from = 0
        first = have
        if plan.push_tag is not None:
            # Push only what the PE lacks: the blocks from its memory's prefix (it holds those) to the end of what
            # either engine's memory or the store has. The DE loads the stored ones it lacks itself.
            push_from = min(plan.pe_holds, num_full)
            end = have
            if self.kv.has_disk and have < num_full:
                keys = self.kv.block_hashes(request_id, prompt[: num_full * self.kv.block_size])[have:]
                stored = self.executor.count_stored(keys)
                self.kv.note_on_disk(keys[:stored])  # its loads need no probe (should the PE's stream fail)
                end += stored
                if push_from > have and end > push_from:
                    # Its own prefix stops short of the PE's: the PE sends this engine the blocks between (with the
                    # rest, at the handoff), and this engine loads only the push's, apart from its prefix.
                    self.kv.load_for_push(request_id, push_from, end)
            end = max(end, push_from)
            if end > push_from:
                push = end - push_from
                request.push = PrefixPush(plan.peer, plan.push_tag, push, first=push_from)
            first = have if push_from > have else end
        if num_full > first and self.kv.host_room(num_full - first):
            self.kv.expect_blocks(request_id, prompt, first, num_full - first, plan.peer, plan.recv_tag)
        else:
            first = num_full  # nothing to receive, or no room for it: the PE sends nothing, this engine computes
        self.scheduler.add(request)
        return IntakeAnswer(send_from_block=first, push_blocks=push, push_from=push_from)

    def continue_request(self, request_id: str, resume: Resume) -> bool:
        """Give a decode engine's request the tokens its prefill engine produced (and the text the client
        has); it runs from the next step. False if the request is not here, or not waiting for them."""
        request = self.scheduler.requests.get(request_id)
        if request is None or not request.awaiting_resume:
            return False
        detok = self._detokenizers[request_id]
        for token in resume.output_token_ids:
            request.append_output(token)
            detok.add(token)
        detok.skip_emitted(resume.text_chars_sent)
        request.awaiting_resume = False
        self._awaiting.pop(request_id, None)
        return True

    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None,
        program: ProgramRef | None,
        resume: Resume | None,
    ) -> Request:
        """A validated request with its detokenizer, not yet queued."""
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if params.embed and not self.identity.pooling.served:
            raise InvalidRequestError(self.identity.pooling.refusal(), "input")
        if not (params.embed or self.identity.generates):
            serves = (
                "is a classifier: it serves /classify, /score and /rerank (LLM.classify, LLM.score)"
                if self.identity.pooling.classifies
                else "is an embedding model (its checkpoint has no LM head): it serves /v1/embeddings (LLM.embed)"
            )
            raise InvalidRequestError(f"{self.identity.name} {serves}, not text", "model")
        vocab = self.identity.vocab_size
        if max(prompt_token_ids) >= vocab or not _non_negative(prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        # The sampler indexes the logits with stop ids (min_tokens) and biased ids; one outside would fail the whole
        # step.
        bad_stop = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad_stop is not None:
            raise InvalidRequestError(f"stop_token_ids: token id {bad_stop} is not in [0, {vocab})", "stop_token_ids")
        bad_bias = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise InvalidRequestError(f"logit_bias: token id {bad_bias} is not in [0, {vocab})", "logit_bias")
        # Only tokens the tokenizer knows may be allowed (vLLM's rule, and the server's): a model's vocabulary padded
        # past its tokenizer's (Qwen's, for one) has rows no text maps to.
        known = min(vocab, self.tokenizer.vocab_size)
        bad_allowed = next((t for t in params.allowed_token_ids or () if t >= known), None)
        if bad_allowed is not None:
            raise InvalidRequestError(
                f"allowed_token_ids: token id {bad_allowed} is not in the tokenizer's vocabulary, [0, {known})",
                "allowed_token_ids",
            )
        if params.bad_words:  # (tokenized here, where every path of a request arrives: offline, served, an instance)
            sequences = bad_words_token_ids(params.bad_words, lambda text: self.tokenizer.encode(text, False))
            # (The words give way to their sequences: a request moved to another instance arrives with these alone.)
            params = dataclasses.replace(params, bad_words=(), bad_words_token_ids=sequences)
        bad_word = next((t for word in params.bad_words_token_ids for t in word if t >= vocab), None)
        if bad_word is not None:
            raise InvalidRequestError(f"bad_words: token id {bad_word} is not in [0, {vocab})", "bad_words")
        # A prediction's tokens are drafts the model reads, as a prompt's.
        bad_predicted = next((t for t in params.prediction if t >= vocab), None)
        if bad_predicted is not None:
            raise InvalidRequestError(f"prediction: token id {bad_predicted} is not in [0, {vocab})", "prediction")
        budget = params.thinking_budget
        if budget is not None and not all(0 <= t < vocab for t in (*budget.start, *budget.end)):
            raise InvalidRequestError(f"thinking budget: tag ids must be in [0, {vocab})", "thinking_token_budget")
        if params.structured is not None:
            check_structured_output(params.structured, vocab)
            # A grammar this engine failed to compile already (it passed the check): refused before anything is set up.
            error = self.grammars.error(params.structured) if self.grammars is not None else None
            if error is not None:
                raise InvalidRequestError(error, params.structured.param)
        most = logprobs_limit(self.config.model.max_logprobs, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > most:
                raise InvalidRequestError(
                    f"{name}: {asked} alternatives asked for, more than the {most} this engine gives (--max-logprobs)",
                    name,
                )
        if params.lora_name is not None and params.lora_name not in self.loras:
            raise InvalidRequestError(f"LoRA adapter {params.lora_name!r} is not loaded", "model", "model_not_found")
        namespace = self.kv_namespace(params)
        # (One token asked for may follow a prompt that fills the context: see require_context_room.)
        require_context_room(len(prompt_token_ids), params.max_tokens, self.max_model_len, params.max_tokens == 1)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            program=program,
            output_token_ids=list(resume.output_token_ids) if resume else [],
            # A resumed request's first delta went out on the instance it started on, prompt logprobs and all.
            prompt_logprobs=[None] if params.prompt_logprobs is not None and resume is None else None,
            pools_every_token=params.embed and self.identity.pooling.kind == "mean",
        )
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params, self.eos_token_ids)
        if resume is not None:
            for token in resume.output_token_ids:
                detok.add(token)
            detok.skip_emitted(resume.text_chars_sent)
        self._detokenizers[request_id] = detok
        if namespace is not None:
            lora = self._lora_tags.get(params.lora_name) if params.lora_name is not None else None
            self.kv.set_namespace(request_id, namespace, lora)
        if program is not None:
            self.policy.merge_remote_service(program)
        self.counters.prompt_tokens += len(prompt_token_ids)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; False if it was not running."""
        request = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        self._detokenizers.pop(request_id, None)
        self._awaiting.pop(request_id, None)
        if request is not None:
            self._count_finish(request)
        return request is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """Requests to serve, blocks the last step computed still to hand to the disk store's writer, or streams
        to other instances still to report (their blocks are held till then)."""
        return (
            self.has_unfinished()
            or self.kv.has_writes_to_hand_over()
            or self.kv.num_remote_in_flight > 0
            or bool(self._prefetches)  # reads ahead to start, land, or expire
        )

    def release_memory(self) -> None:
        """After :meth:`close`, for good: give back the KV memory for a fresh engine in this process (a restart in
        place); its stats stay readable."""
        release = getattr(self.executor, "release_memory", None)  # (the simulator's executor holds none)
        if release is not None:
            release()

    def close(self, lost: bool = False) -> None:
        """Hand the last computed blocks to the store's writer, and wait (bounded) until what it was handed is
        written: a server stopped after a workload finds all of it in the store when it starts again. ``lost``: the
        engine lost a part (a split model's rank): nothing more runs on it, and its KV is not to be trusted."""
        try:
            if not self.has_unfinished() and not lost:
                self.kv.write_back_all()  # (write-back: the blocks in memory go now, or a restart finds none of them)
                if self.kv.has_writes_to_hand_over():
                    self.step()
        except Exception:
            log.exception("the step that hands the last blocks to the disk store failed; they are not written")
        finally:  # (the executor goes all the same: its ranks, threads and store)
            self.executor.close()
        if self.grammars is not None:
            self.grammars.close()
        if self.kv_events is not None:
            self._publish_kv_events()
            self.kv_events.close()

    # -- the loop --------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one iteration; returns the requests that produced tokens (or finished). With asynchronous scheduling
        the window after this one is decided and queued on the device before this one's tokens are read back; the
        next call reads it."""
        launched: PendingStep | None = None
        if self._ahead is not None:
            (sched, launched), self._ahead = self._ahead, None
        else:
            sched = self.schedule()
            if sched.is_empty:
                if self.scheduler.compiling and self.grammars is not None:  # nothing to run until a grammar is: wait
                    self.grammars.wait(self._compiling_specs(), timeout_s=1.0)
                return self.take_rejected()
        ahead = None
        try:
            if launched is None:
                launched = self.launch(sched)
            ahead = self.schedule_ahead(sched, launched)
            if ahead is not None:
                self._ahead = (ahead, self.launch(ahead, launched))
                self.decode_pending(ahead)
            result = launched.wait()
        except BaseException:
            # The caller fails the requests. The blocks the steps were to write (a window ahead's demotions among them:
            # their copies land only when it is read back) lose their names, and a window queued behind is dropped.
            for failed in (sched, ahead) if ahead is not None else (sched,):
                self.scheduler.step_failed(failed)
            self._ahead = None
            raise
        return self.take_rejected() + self.finish_step(sched, result)

    def schedule(self) -> SchedulerOutput:
        """Decide the next step (bookkeeping only; cheap)."""
        if self.scheduler.compiling:
            self._admit_compiled()
        self._drop_expired()
        return self.scheduler.schedule()

    def _drop_expired(self) -> None:
        """Drop prepared requests whose first token never came, and prefetches past their deadline."""
        if self._awaiting:
            self._drop_stale_intakes()
        if self._prefetches:
            now = self.clock()
            for request_id in [rid for rid, deadline in self._prefetches.items() if deadline < now]:
                self.drop_prefetch(request_id)

    def _compiling_specs(self) -> list[StructuredOutput]:
        requests = self.scheduler.requests
        return [s for rid in self.scheduler.compiling if (s := requests[rid].sampling_params.structured) is not None]

    def _admit_compiled(self) -> None:
        """Let the requests whose grammars are compiled be admitted (a request that leaves leaves the set). One whose
        compilation failed is failed alone, its final delta kept for :meth:`take_rejected`: in a step, the sampler
        would have raised for it and failed the step's every request."""
        assert self.grammars is not None
        requests, grammars = self.scheduler.requests, self.grammars
        ready = [rid for rid in self.scheduler.compiling if grammars.ready(requests[rid].sampling_params.structured)]
        self.scheduler.compiling.difference_update(ready)
        for rid in ready:
            spec = requests[rid].sampling_params.structured
            error = grammars.error(spec) if spec is not None else None
            if error is not None and self.abort(rid):
                self._rejected.append(
                    RequestDelta(rid, [], "", [], finished=True, finish_reason="error", stop_reason=error)
                )

    def take_rejected(self) -> list[RequestDelta]:
        """The final deltas of requests failed between steps since the last call (a grammar that did not compile)."""
        out, self._rejected = self._rejected, []
        return out

    def _drop_stale_intakes(self) -> None:
        """Drop prepared requests whose first token never came (their blocks are freed)."""
        now = self.clock()
        for request_id in [rid for rid, deadline in self._awaiting.items() if deadline < now]:
            self.abort(request_id)

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Run a scheduled step on the executor; returns its sampled tokens, seconds and finished disk I/O.

        Touches only the executor, so a front end may run it without holding the lock that guards
        request bookkeeping (requests aborted meanwhile are skipped by :meth:`finish_step`).
        """
        return self.executor.execute(sched)

    def launch(self, sched: SchedulerOutput, follows: PendingStep | None = None) -> PendingStep:
        """Start a scheduled step (``ModelExecutor.launch``): a window on CUDA graphs is queued on the device, any
        other step runs to its end; ``PendingStep.wait`` gives its result. Touches only the executor, as
        :meth:`execute` does. ``follows``: the window still running that a window decided ahead follows."""
        launch = getattr(self.executor, "launch", None) if self.config.scheduler.async_scheduling else None
        if launch is None:  # a plain step (nothing to overlap, or an executor that runs each step to its end)
            assert follows is None
            return PendingStep(self.executor, sched, 0.0, result=self.execute(sched))
        return launch(sched, follows)

    def schedule_ahead(self, sched: SchedulerOutput, launched: PendingStep) -> SchedulerOutput | None:
        """Asynchronous scheduling (``--async-scheduling``): the step after ``sched``, decided while ``sched`` runs
        on the device (``Scheduler.schedule_ahead``: the next window, or the ordinary decision over the requests as
        ``sched`` leaves them); launch it with ``follows=launched`` before waiting for ``launched``. None when it is
        off, ``sched`` did not run on the device, or the next step needs the ordinary decision after ``sched``."""
        if not self.config.scheduler.async_scheduling or launched.window is None:
            return None
        self._drop_expired()  # (steps may be decided ahead for as long as requests keep coming)
        return self.scheduler.schedule_ahead(sched)

    def decode_pending(self, queued: SchedulerOutput) -> None:
        """The text so far of the requests that take theirs at the end (``RequestOutputKind.FINAL_ONLY``: their tokens
        wait in ``pending``), decoded while the device runs the steps queued ahead, when ``queued`` is a multi-step
        window (the host waits for the device then; a single step's host work is the pace). The same text as one
        decode at the end (``detokenizer.add_runs``), whose decode, on the host's path after the last kernel, is then of
        the last window's tokens alone."""
        if queued.window > 1:
            waiting = [d for d in self._detokenizers.values() if d.pending]
            if waiting:
                flush(waiting)

    def finish_step(self, sched: SchedulerOutput, result: StepResult) -> list[RequestDelta]:
        """Apply a step's results: finished disk reads and writes, progress, tokens, detokenizing, stops."""
        sampled, elapsed = result.sampled, result.elapsed_s
        self.scheduler.apply_tier_report(result.tier_report)
        self.scheduler.apply_remote_report(result.remote_report)
        if result.tier_report.io is not None:
            self._disk_io = result.tier_report.io
        if result.remote_report.stats is not None:
            self._remote_io = result.remote_report.stats
        c = self.counters
        accepted = None
        predicted: dict[str, tuple[int, int]] = {}
        scheduler = self.scheduler
        # Speculative decoding (and Predicted Outputs): a request's kept drafts are its later tokens.
        if scheduler.proposer is not None or scheduler.predictions.active:
            drafted = [ch for ch in sched.chunks if ch.draft_token_ids]
            accepted = {ch.request_id: sum(ch.request_id in p for p in result.later) for ch in drafted}
            # A prediction's drafts, and how many the verification kept (counted below, as its output keeps them);
            # not the prompt lookup's drafts of a request whose prediction had none (no prediction tokens).
            predicted = {
                ch.request_id: (len(ch.draft_token_ids), accepted[ch.request_id])
                for ch in drafted
                if ch.request_id in sched.predicted
            }
            c.drafts += len(drafted)
            c.draft_tokens += sum(len(ch.draft_token_ids) for ch in drafted)
            c.accepted_tokens += sum(accepted.values())
            by_position = c.accepted_by_position
            for kept in accepted.values():
                by_position.extend([0] * (kept - len(by_position)))  # (nothing when it is long enough)
                for j in range(kept):
                    by_position[j] += 1
        self.scheduler.advance(sched, elapsed, accepted)
        steps_before = c.steps
        c.steps += sched.window
        c.computed_tokens += sched.num_tokens if sched.window == 1 else sum(ch.num_steps for ch in sched.chunks)
        c.busy_seconds += elapsed
        now = self.clock()
        arrivals, departures = sched.arrivals, sched.departures
        if sched.chunks:  # each pass of a window is a step of its own shape to the step-time models, ended in turn
            passes = window_shapes(sched)  # (made when a sample is read)
            seconds = result.pass_seconds if sched.window > 1 else (elapsed,)  # (kept by the recorder as they are)
            # Tokens attended on other instances (lent blocks): the step's time holds the round trips' waits.
            remote = sum(r.num_tokens for c in sched.chunks for r in c.remote) if self.lending_stats is not None else 0
            self.step_times.record_window(passes, seconds, now, arrivals, departures, len(passes), remote)
        if self._prefill_batching == "attention" and c.steps // REFIT_EVERY_STEPS > steps_before // REFIT_EVERY_STEPS:
            self._refit_prefill_time()
        self._apply_prompt_scores(result.prompt_scores)
        applied: list[tuple[Request, IncrementalDetokenizer, list[SampledToken]]] = []
        decided_for = sched.requests
        for request_id, token in sampled.items():
            request = self.scheduler.requests.get(request_id)
            if request is None or (decided_for is not None and decided_for.get(request_id) is not request):
                continue  # it left while the step ran (and its id may be a new request's)
            tokens = [token]
            if result.later:  # a multi-step window: its later passes' tokens, in order
                tokens += [t for p in result.later if (t := p.get(request_id)) is not None]
            applied.append((request, self._detokenizers[request_id], tokens))
        outputs = []
        results = _apply_tokens(applied)
        # Requests that end now and take their text at the end: decoded together, once.
        ending = [
            d for (_, d, _), (_, status) in zip(applied, results, strict=True) if d.pending and status is not None
        ]
        if ending:
            flush(ending)
        for (request, detok, tokens), (kept, status) in zip(applied, results, strict=True):
            request_id, token = request.request_id, tokens[0]
            if not request.sampling_params.embed:  # (an embedding request's one token is not an answer)
                c.generation_tokens += kept
            if request.first_token_time is None:
                request.first_token_time = now
            if len(tokens) > 1:
                # The window's KV: the blocks its passes filled get their names (as the next steps' allocations would
                # have named them), before a finished request's blocks are freed.
                self.kv.name_full_blocks(request_id, request.all_token_ids, request.num_tokens - 1)
            if request_id in predicted:
                # The kept drafts the output holds: those after a stop (a stop token or string among them) are not in
                # it, and count as rejected (OpenAI's: prediction tokens that did not appear in the completion).
                num_drafts, num_kept = predicted[request_id]
                in_output = min(num_kept, kept)
                request.num_accepted_prediction_tokens += in_output
                request.num_rejected_prediction_tokens += num_drafts - in_output
            if status is None and request.handoff is not None:
                status = RequestStatus.FINISHED_HANDED_OFF  # its first token; it decodes on its decode engine
            if status is not None:
                self.scheduler.finish(request_id, status)
                self._detokenizers.pop(request_id, None)
                self._count_finish(request)
            outputs.append(
                RequestDelta(
                    request_id=request_id,
                    new_token_ids=[t.token_id for t in tokens[:kept]] if kept > 1 else [token.token_id],
                    # A handed-off request goes on elsewhere: text that may start a stop string stays held back.
                    new_text=detok.take_delta(finished=status not in (None, RequestStatus.FINISHED_HANDED_OFF)),
                    new_logprobs=tokens[:kept] if request.sampling_params.logprobs is not None else [],
                    finished=status is not None,
                    finish_reason=status.value if status is not None else None,
                    stop_reason=request.stop_reason if status is not None else None,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    num_output_tokens=request.num_output_tokens,
                    num_accepted_prediction_tokens=request.num_accepted_prediction_tokens,
                    num_rejected_prediction_tokens=request.num_rejected_prediction_tokens,
                    arrival_time=request.arrival_time,
                    first_token_time=request.first_token_time,
                    finish_time=request.finish_time,
                    service_s=request.service_s,
                    prompt_logprobs=self._take_prompt_logprobs(request),
                    embedding=result.embeddings.get(request_id),
                )
            )
        if self.kv_events is not None:
            self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        """Hand the KV events since the last batch to the publisher, as one batch (a step's), if there are any."""
        assert self.kv_events is not None and self.kv.events is not None
        if self.kv.events.events:
            self.kv_events.publish(self.kv.events.take())

    def _apply_prompt_scores(self, scores: dict[str, PromptScores]) -> None:
        """Append the prompt tokens a step scored to their requests' prompt logprobs (those aborted meanwhile, or
        whose id a new request took, are skipped: the scores must follow the request's own)."""
        for request_id, scored in scores.items():
            request = self.scheduler.requests.get(request_id)
            so_far = request.prompt_logprobs if request is not None else None
            if so_far is not None and len(so_far) == scored.first:
                so_far.extend(scored.tokens)

    @staticmethod
    def _take_prompt_logprobs(request: Request) -> PromptLogprobs | None:
        """The request's prompt logprobs for the delta of its first token (the request keeps none after: its recompute
        after a preemption may then take cached blocks, and scores nothing again)."""
        scored, request.prompt_logprobs = request.prompt_logprobs, None
        return scored

    def fail_step(self, sched: SchedulerOutput, error: BaseException) -> list[RequestDelta]:
        """A step that raised: the requests it leaves without their KV (its chunks, and requests its transfers were
        moving: swapped out to blocks the failed copy never filled, say) are aborted, and their final deltas say
        why: ``KV_STREAM_LOST`` when a stream the step's forward pass was reading failed (a dispatcher places
        such a call again), else ``engine step failed``."""
        reason = KV_STREAM_LOST if isinstance(error, LayerLost) else "engine step failed"
        deltas = []
        for request_id in self.scheduler.step_failed(sched):
            if self.abort(request_id):
                deltas.append(
                    RequestDelta(request_id, [], "", [], finished=True, finish_reason="error", stop_reason=reason)
                )
        if self.kv_events is not None:
            self._publish_kv_events()
        return deltas

    def _refit_prefill_time(self) -> None:
        """Attention-time prefill batching: refit the step-time model on the latest steps; the scheduler bounds
        each step's prefills by its prediction, under the predicted time of a full step of fresh tokens."""
        model = self.step_times.fit()
        if model is None:
            return
        quota = step_quota(model, self.scheduler.max_num_batched_tokens)
        # A fit that puts a full step of fresh tokens at no time is degenerate (steps timed on a loaded machine): under
        # a zero quota every prefill over cached context would go a block a step. The last fit stays (or the budget).
        if quota > 0:
            self.scheduler.prefill_time = (model.predict, quota)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        c = self.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=pool.num_used,
            kv_blocks_total=pool.num_blocks,
            prefix_cache_queries=c.prompt_tokens,
            prefix_cache_hits=self.scheduler.stats.num_prompt_tokens_cached,
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            computed_tokens=c.computed_tokens,
            num_preemptions=self.scheduler.stats.num_preemptions,
            num_kept=self.scheduler.stats.num_kept,
            num_swapped_out=self.scheduler.stats.num_swapped_out,
            num_recomputed=self.scheduler.stats.num_recomputed,
            window_blocks_released=self.scheduler.stats.num_window_blocks_released,
            busy_seconds=c.busy_seconds,
            steps=c.steps,
            kv_tiers=self._tier_stats(),
            disk_io=self._disk_io if self.kv.has_disk else None,
            remote_io=self._remote_io,
            lending=self.lending_stats() if self.lending_stats is not None else None,
            spec_drafts=c.drafts,
            spec_draft_tokens=c.draft_tokens,
            spec_accepted_tokens=c.accepted_tokens,
            spec_accepted_by_position=list(c.accepted_by_position),
            lora_running=self._lora_counts(self.scheduler.running),
            lora_waiting=self._lora_counts(self.scheduler.waiting),
            programs_tracked=len(self.policy.table),
            programs_with_calls=len(
                {r.program.program_id for r in (*self.scheduler.running, *self.scheduler.waiting) if r.program}
            ),
        )

    def _lora_counts(self, requests: list[Request]) -> dict[str, int]:
        counts = dict.fromkeys(self.loras, 0)
        for r in requests:
            name = r.sampling_params.lora_name
            if name is not None:
                counts[name] = counts.get(name, 0) + 1
        return counts

    @property
    def ranks(self) -> TensorParallelRanks | None:
        """A split model's other ranks; None on one device, or with no model (a simulated engine)."""
        return self.executor.runner.ranks if isinstance(self.executor, ModelExecutor) else None

    @property
    def block_bytes(self) -> int:
        """A block's bytes on every rank of a split model (each moves its share: the instance moved them all), as its
        streams' totals count them (``kv/split_streams.py``); one device's, its own. (A simulated split engine's layout
        holds whole blocks.)"""
        return self.layout.bytes_per_block * (self.ranks.size if self.ranks is not None else 1)

    def _tier_stats(self) -> dict[str, TierStats]:
        per_block = self.block_bytes
        hits = self.scheduler.stats.cached_tokens_by_tier
        tiers = {}
        for tier, counters in self.kv.counters.items():
            pool = self.kv.pools.get(tier)
            if pool is None and not (tier == DISK and self.kv.has_disk) and not (tier == PEER and self._remote_io):
                continue
            evictions, checksum_failures = counters.evictions, 0
            if tier == DISK:  # the store evicts its own files and checks what it reads
                evictions = int(getattr(self._disk_io.store, "evictions", 0) or 0)
                checksum_failures = int(getattr(self._disk_io.store, "checksum_failures", 0) or 0)
            tiers[tier] = TierStats(
                hit_tokens=hits.get(tier, 0),
                bytes_read=counters.blocks_read * per_block,
                bytes_written=counters.blocks_written * per_block,
                evictions=evictions,
                checksum_failures=checksum_failures,
                load_timeouts=counters.load_timeouts,
                recomputed_blocks=dict(counters.recomputed_blocks),
                reloaded_blocks=counters.reloaded_blocks,
                blocks_used=pool.num_used if pool is not None else 0,
                blocks_total=pool.num_blocks if pool is not None else 0,
            )
        return tiers

    def _count_finish(self, request: Request) -> None:
        key = request.status.value
        self.counters.finished[key] = self.counters.finished.get(key, 0) + 1

    @torch.inference_mode()
    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
        if self.kv_events is not None:
            self._publish_kv_events()


def require_context_room(prompt_len: int, max_tokens: int | None, max_model_len: int, prompt_only: bool) -> None:
    """Raise :class:`InvalidRequestError` unless the context holds the prompt and the tokens asked for (``max_tokens``;
    None: one at least), naming ``prompt`` when the prompt alone is too long or no limit was given, else
    ``max_tokens``, with OpenAI's code ``context_length_exceeded`` (what agents read to compact their history).
    ``prompt_only``: the one token sampled at the prompt's end is all the request asks for; it is never
    read, so a prompt that fills the context leaves it room (the engine takes such a request, as vLLM's does, and it
    ends there, ``length``; the completions API's prompt alone, ``echo`` with ``max_tokens`` 0, is one)."""
    wanted = 0 if prompt_only else (max_tokens or 1)
    if prompt_len + wanted > max_model_len:
        asked = f" and {wanted} more were requested" if wanted else ""
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len} tokens{asked}",
            "prompt" if prompt_len > max_model_len or not max_tokens else "max_tokens",
            CONTEXT_LENGTH_EXCEEDED,
            ContextOverflow(prompt_len, max_tokens, max_model_len),
        )


def _non_negative(token_ids: Sequence[int]) -> bool:
    """``min(token_ids) >= 0``, in half its time on a prompt of ints: an unsigned array takes them in C and refuses a
    negative one (or one past 2**32, or another type: then min() answers)."""
    try:
        array("I", token_ids)
    except (OverflowError, TypeError, ValueError):  # (ValueError: bytes of a length array cannot split)
        return min(token_ids) >= 0
    return True


def _apply_tokens(
    applied: Sequence[tuple[Request, IncrementalDetokenizer, Sequence[SampledToken]]],
) -> list[tuple[int, RequestStatus | None]]:
    """Append each request's sampled tokens in order up to its first stop (a window's tokens past it are discarded):
    how many each kept, and its finished status (None: it goes on). The requests' ``j``-th tokens are applied
    together, their text decoded in one call (``add_tokens``). A window's tokens without stop strings take their stop
    and length rules in one pass, and the kept ones' text comes from one decode of each window (``add_runs``): only
    a stop string needs each token's text before the next token is taken. So do the tokens of a request without
    text, or of one that takes its text at the end (their kept tokens wait in its ``pending``)."""
    results: list[tuple[int, RequestStatus | None]] = [(0, None)] * len(applied)
    active = []
    runs: list[tuple[IncrementalDetokenizer, list[int]]] = []  # windows' kept tokens whose text comes in one decode
    for i, (request, detok, tokens) in enumerate(applied):
        pending = detok.pending
        if pending is None and detok.enabled and (len(tokens) == 1 or detok.stop):
            active.append(i)
        else:  # no stop strings: the stop and length rules of all its tokens in one pass
            token_ids = [t.token_id for t in tokens]
            results[i] = request.append_outputs(token_ids)
            if pending is not None:  # its text comes at the end, decoded once
                pending += token_ids[: results[i][0]]
            elif detok.enabled:
                runs.append((detok, token_ids[: results[i][0]]))
    if runs:
        add_runs([d for d, _ in runs], [r for _, r in runs])
    j = 0
    while active:
        token_ids = [applied[i][2][j].token_id for i in active]
        for i, token_id in zip(active, token_ids, strict=True):
            applied[i][0].append_output(token_id)
        stops = add_tokens([applied[i][1] for i in active], token_ids)
        going = []
        for i, stop_string in zip(active, stops, strict=True):
            request, detok, tokens = applied[i]
            status = RequestStatus.FINISHED_STOPPED if stop_string else request.check_stop()
            if stop_string:
                request.stop_reason = detok.stopped_by
            results[i] = (j + 1, status)
            if status is None and j + 1 < len(tokens):
                going.append(i)
        active = going
        j += 1
    return results
