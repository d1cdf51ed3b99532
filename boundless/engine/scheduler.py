"""Iteration-level scheduling: which tokens of which requests to compute in the next step.

The scheduler is pure bookkeeping. It is given a clock, a KV cache manager and a policy; it never
runs the model. Each step it orders every unfinished request, running or not, by the policy's
priority (atlas by default, ``programs/``), fills a token budget from the top, and hands the runner
a plain :class:`SchedulerOutput`. Prefill chunks and decodes share one batch, because both are
"compute the next tokens not yet computed".

A running request left out of a step keeps its KV. When a request needs blocks that are not free,
the lowest-priority holders of device KV outside the step give theirs up: swapped out to host
memory while the host pool has room, else dropped, to be recomputed from prompt and output so far.
A swapped request is swapped back in once there is room for it.

With KV lending a request may be longer than the pool (its leading blocks move to other instances): its chunks
are cut to what the pool holds of its local blocks, it keeps them rather than being evicted when they fill the
pool (only a move lets it grow), and when evicted anyway it comes back with its cached prefix cut to the pool.

A waiting request whose next blocks sit in the disk store has them loaded into host memory from the
step after it arrives (ahead of its turn); while its read is in flight it is passed over and the
others run. Loaded blocks then count as computed tokens at its admission, as prefix-cache hits do.

Blocks may also come from and go to other instances (prefill/decode disaggregation, ``engine/handoff.py``):
a request whose blocks are on their way from a peer is passed over like one waiting for the disk; a
prefill engine's request sends its blocks layer by layer in the step that samples its first token; a
decode engine's request waits for that token, and under DE-read pushes its prefix to the prefill engine
once its loads are done. The streams are plain moves in the output (``kv/remote_moves.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from boundless.attention.backend import RemoteKV
from boundless.engine.attention_time import ChunkShape
from boundless.engine.prediction import PredictionProposer
from boundless.engine.prefill_batching import Predictor, PrefillCandidate, fill_prefill_batch
from boundless.engine.request import Request, RequestStatus
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.structured_output import grammar_start
from boundless.kv.disk_moves import DiskAge, DiskRead, DiskWrite, TierReport
from boundless.kv.manager import CachedPrefix, KVCacheManager
from boundless.kv.remote_moves import RemoteRecv, RemoteReport, RemoteSend
from boundless.kv.transfer import DEVICE, HOST, BlockRef, BlockTransfer, TierId
from boundless.programs.policy import SchedulingPolicy

Clock = Callable[[], float]


class DraftProposer(Protocol):
    """Speculative decoding's proposer (``engine/speculative.py``)."""

    def max_drafts(self, batch_size: int) -> int:
        """The most drafts a request may get in a step that chose ``batch_size`` requests (0: none)."""
        ...

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens likely to follow the request's ``token_ids`` (its prompt, then its output)."""
        ...

    def finish(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request left with these tokens: drop what was kept for it (a proposer that learns from outputs keeps
        its output)."""
        ...


# The input of a chunk decided ahead (Scheduler.schedule_ahead): its real token is on the device, drawn by the window
# before. Not a token id, so that a chunk that ran with it would fail loudly.
AHEAD_TOKEN = -1


@dataclass
class ScheduledChunk:
    """Tokens of one request to compute in a step. Not changed once made (not frozen only because a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``: 3.5 us a chunk against 1.3, a
    millisecond of a 256-request step's Python on a GPU)."""

    request_id: str
    token_ids: list[int]
    start_pos: int  # position of token_ids[0]; tokens before it already have KV
    block_ids: list[int]
    sample: bool  # the chunk ends at the last known token, so the step samples the next one
    sampling_params: SamplingParams
    num_output_tokens: int
    eos_token_ids: tuple[int, ...]
    # KV lending: ``block_ids`` start at the request's block ``first_block``; the blocks before it live on other
    # instances (``remote``), whose partials DistAttention merges (docs/distributed-attention.md).
    first_block: int = 0
    remote: tuple[RemoteKV, ...] = ()
    # Multi-step decoding (``engine/multi_step.py``): forward passes this one-token decode takes in the step's window,
    # its slots allocated up front (1: an ordinary chunk).
    num_steps: int = 1
    # Penalties and grammars (``SamplingParams.needs_history``): the request's tokens so far, prompt then output
    # (its own list, not a copy), and how many are the prompt's; empty otherwise.
    history: Sequence[int] = ()
    num_prompt_tokens: int = 0
    # Prompt logprobs (``SamplingParams.prompt_logprobs``): the prompt tokens this chunk's positions predict and that
    # are not scored yet, the first of them prompt token ``prompt_targets_from`` (predicted by the position before it).
    prompt_targets: Sequence[int] = ()
    prompt_targets_from: int = 0
    # Speculative decoding (``engine/speculative.py``): the proposed tokens that end ``token_ids``, after the request's
    # last known token; the step samples at each of those positions and keeps the samples that match.
    draft_token_ids: tuple[int, ...] = ()

    def next_pass(self, token_id: int, j: int) -> ScheduledChunk:
        """Pass ``j`` of a multi-step window: this chunk decoding ``token_id``, ``j`` positions on (made field by
        field, not by ``dataclasses.replace``, which reads the fields by name, for every chunk of every pass)."""
        return ScheduledChunk(
            self.request_id,
            [token_id],
            self.start_pos + j,
            self.block_ids,
            self.sample,
            self.sampling_params,
            self.num_output_tokens + j,
            self.eos_token_ids,
            self.first_block,
            self.remote,
            self.num_steps,
            self.history,
            self.num_prompt_tokens,
            self.prompt_targets,
            self.prompt_targets_from,
            self.draft_token_ids,
        )


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)  # lost their device KV this step
    finished_ids: list[str] = field(default_factory=list)  # left since the last step
    # Requests that entered since the last step, and of ``finished_ids`` those that left while others stayed (so
    # this step follows theirs at once, beside the server answering them): a served engine's server works on them
    # on the same cores as the step, which its time carries (sim/step_model.py).
    arrivals: int = 0
    departures: int = 0
    # KV moves between memory tiers (swap-outs and swap-ins, evictions down to host memory, prefix hits in
    # host memory), in the order decided; the executor applies them before the forward pass (kv/transfer.py).
    transfers: list[BlockTransfer] = field(default_factory=list)
    # Reads and writes of the disk store, run in the background (kv/disk_moves.py).
    disk_reads: list[DiskRead] = field(default_factory=list)
    disk_writes: list[DiskWrite] = field(default_factory=list)
    disk_ages: list[DiskAge] = field(default_factory=list)  # eviction hints to the store
    num_reads_in_flight: int = 0  # disk reads not yet reported done (this step's included)
    # Block streams between instances (kv/remote_moves.py): receives to post, sends to start (layerwise ones
    # during this step's forward pass), and how many are not yet reported done (this step's included).
    remote_recvs: list[RemoteRecv] = field(default_factory=list)
    remote_sends: list[RemoteSend] = field(default_factory=list)
    num_remote_in_flight: int = 0
    # Multi-step decoding: forward passes the step runs for its batch (the longest chunk's ``num_steps``).
    window: int = 1
    # Each pass's chunk shapes, made once when first asked for (multi_step.window_shapes: a WindowPasses).
    pass_shapes: Sequence[tuple[ChunkShape, ...]] | None = None
    # The requests the step was decided for, by id: its results go to these alone (a request that left while the
    # step ran, its id then taken by a new one, is not the new one; None: any request of the id).
    requests: dict[str, Request] | None = None
    decided_ahead: bool = False  # by Scheduler.schedule_ahead, while the step before it ran
    # Predicted Outputs: the requests whose drafts this step are their prediction's, counted as prediction tokens
    # kept or rejected (a request with a prediction drafts by prompt lookup where its prediction has none:
    # ``engine/prediction.py``; those drafts are no prediction tokens).
    predicted: set[str] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing for the executor to do: no chunk, no move, and no read or stream to wait for."""
        return not (
            self.chunks
            or self.transfers
            or self.disk_reads
            or self.disk_writes
            or self.disk_ages
            or self.num_reads_in_flight
            or self.remote_sends
            or self.remote_recvs
            or self.num_remote_in_flight
        )


@dataclass
class SchedulerStats:
    num_preemptions: int = 0  # requests that lost their device KV (swapped or to recompute)
    num_kept: int = 0  # running requests left out of a step that kept their KV
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_recomputed: int = 0
    num_prompt_tokens_cached: int = 0
    num_ahead: int = 0  # windows decided while the one before ran (schedule_ahead)
    num_window_blocks_released: int = 0  # blocks given back past every layer's sliding window (_release_windows)
    # Of those, by the tier their KV was found in: device, host, or disk (loaded ahead of admission).
    cached_tokens_by_tier: dict[TierId, int] = field(default_factory=dict)


class Scheduler:
    """Continuous batching under a token budget, in the policy's order; preemption swaps KV to a tier below
    the device, or drops it to be recomputed when no tier has room."""

    def __init__(
        self,
        kv: KVCacheManager,
        policy: SchedulingPolicy,
        clock: Clock,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        num_scheduler_steps: int = 1,
        proposer: DraftProposer | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.kv = kv
        self.policy = policy
        self.clock = clock
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._finished_since_step: list[str] = []
        self._arrived_since_step = 0
        self._last_chosen: set[str] = set()
        # A waiting request whose stored prefix finds no host room waits for room while reads are in flight,
        # instead of computing the prefix (False: the earlier rule, kept for comparisons and tests).
        self.wait_for_host_room = True
        # Attention-time prefill batching (engine/prefill_batching.py): a step's predictor and its quota in seconds,
        # set by the engine once it has fitted one; None: the token budget alone bounds prefills.
        self.prefill_time: tuple[Predictor, float] | None = None
        # Multi-step decoding: a step of decodes only runs up to this many forward passes (engine/multi_step.py).
        self.num_scheduler_steps = num_scheduler_steps
        # Speculative decoding: each decoding request's drafts, verified in its step (None: off).
        self.proposer = proposer
        # OpenAI's Predicted Outputs: the drafts of requests that bring a prediction, whatever ``proposer`` is.
        self.predictions = PredictionProposer()
        # LoRA: most distinct adapters in one step (vLLM's --max-loras); a request of another adapter waits its turn.
        self.max_loras = max_loras
        # Tokens of each request in the step decided and not yet recorded (``advance``): a view taken while the
        # step runs (a heartbeat: the engine loop holds its lock only between steps) sees the request as the step
        # will leave it, not with its chunk's blocks taken and its tokens not yet counted.
        self.in_flight: dict[str, int] = {}
        self._ahead_in_flight = 0  # windows decided ahead (schedule_ahead) not yet recorded
        # Asynchronous scheduling decides any step ahead, not only the next window of the requests in flight (False:
        # windows alone, the earlier rule, kept for comparisons: ``bench gpu``).
        self.decide_steps_ahead = True
        # While a step is decided ahead by the ordinary decision (``_step_ahead``): the placeholders each request in
        # flight holds at the end of its tokens for the tokens the step in flight draws (by request id); None otherwise.
        self._placeholders: dict[str, int] | None = None
        # A step decided ahead ended at a request it may not take: one short of blocks (it evicts nobody), or one whose
        # KV is in host memory (where blocks may still be landing). The next decision is the ordinary one, after the
        # step in flight, which may preempt, swap in and load; else a run of steps ahead could pass it over for good.
        self._ended_ahead = False
        # KV lending's deadlock breaker (``cluster/lending_deadlock.py``): requests dropped to recompute that may not
        # be admitted again until the gManager releases them, so that the blocks they freed go to another's growth.
        self.held: set[str] = set()
        # KV lending's grants (``cluster/lending_grants.py``): with ``grants_required`` (set by the lending agent), a
        # request whose peak needs more blocks than the pool starts only once the gManager granted it.
        self.grants_required = False
        self.granted: set[str] = set()
        # KV lending: the pool's blocks this instance holds for other instances' requests, which its own requests' KV
        # may not grow into (``_local_limit``); 0, the whole pool theirs, unless the lending agent counts them
        # (``LendingAgent(count_hosted=True)``, measured and left off: docs/lending.md, "A creditor's own requests").
        self.hosted_blocks = 0
        # Structured requests whose grammars are still compiling (``EngineCore``): not admitted until they are.
        self.compiling: set[str] = set()

    # -- queue changes ---------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self._arrived_since_step += 1
        self.policy.on_arrival(request, self.clock())
        if request.sampling_params.prediction:
            self.predictions.add(request.request_id, request.sampling_params.prediction)
        if request.program is not None:  # its blocks are its program's (a call without one: nobody's)
            self.kv.set_program(request.request_id, request.program.program_id)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request (finished or aborted) and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.finish_time = self.clock()
        self.held.discard(request_id)
        self.granted.discard(request_id)
        self.compiling.discard(request_id)
        if self.proposer is not None and not request.sampling_params.embed:  # (an embedding's token is no answer)
            self.proposer.finish(request_id, request.all_token_ids, request.num_prompt_tokens)
        if self.predictions.active:
            self.predictions.finish(request_id)
        self.kv.end_request(request_id)
        self.policy.on_finish(request, request.finish_time)
        self._finished_since_step.append(request_id)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- the decision ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Fill the step from the highest priority down while the budget, sequence slots and memory allow.

        Requests holding KV that are left out keep it (they are paused, not preempted). When memory
        is short, the lowest-priority KV holders not in the step give it up: swapped to a tier
        below the device (host memory) if one has room, else dropped to be recomputed.
        """
        now = self.clock()
        if self._placeholders is None:
            self._ended_ahead = False
        out = self._begin_output()
        self.policy.update(now)
        budget = self.max_num_batched_tokens
        order = sorted(self.running + self.waiting, key=self._ranking(now))
        if self.kv.has_disk:
            # A request waits for its blocks on disk at most the load timeout (stuck storage): then it is
            # admitted and computes them.
            self.kv.expire_disk_reads(now)
            # Every waiting request, from the step after it arrives: its blocks on disk start loading ahead of
            # its turn, highest priority first (host memory may not hold everyone's).
            for request in order:
                if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and not (
                    request.request_id in self.held  # its loads would pin the blocks it was held to free
                    or self.awaits_grant(request)  # and these those a grant lends
                    or request.computes_whole_prompt  # it computes every block (no cached prefix): nothing to load
                ):
                    read = self.kv.plan_disk_read(request.request_id, request.all_token_ids, now)
                    if read is not None:
                        out.disk_reads.append(read)
            out.disk_reads += self.kv.plan_prefetch_reads(now)  # reads ahead for calls not here yet, after theirs
        for request in order:
            if request.push is not None and not self.kv.has_read_in_flight(request.request_id):
                out.remote_sends.append(self._push(request))
        chosen: list[tuple[Request, int]] = []
        chosen_ids: set[str] = set()
        caps = self._prefill_caps(order) if self.prefill_time is not None else None
        loras: set[str] = set()
        for idx, request in enumerate(order):
            if budget <= 0 or len(chosen) >= self.max_num_seqs:
                break
            if self._held_back(request):
                continue  # its blocks are on their way (from the store or a peer), or its first token is
            lora = request.sampling_params.lora_name
            if lora is not None and self.max_loras is not None and lora not in loras and len(loras) >= self.max_loras:
                continue  # the step's adapters are taken: next step (it keeps any KV it holds)
            cap = budget
            if caps is not None and _prefilling(request):
                if request.request_id not in caps:
                    continue  # past the prefill batch's quota: next step (decodes below still run)
                cap = min(budget, caps[request.request_id])
            num_new = self._admit(request, cap, order, idx, chosen_ids, out)
            if num_new is None:
                if not chosen and not self.running:
                    # Nothing runs that will free memory: the prefixes held for loads below it let go (hold and
                    # wait would otherwise stall the engine), to be taken at the next step.
                    self.kv.release_held_while_loading([r.request_id for r in order[idx + 1 :]])
                break  # keep priority order: nothing below may take the memory this one could not get
            chosen.append((request, num_new))
            chosen_ids.add(request.request_id)
            budget -= num_new
            if lora is not None:
                loras.add(lora)
        for request in self.running:
            if request.request_id not in chosen_ids and request.request_id in self._last_chosen:
                self.stats.num_kept += 1
        self._last_chosen = chosen_ids
        out.requests = {request.request_id: request for request, _ in chosen}
        # A step with a request that brings a prediction drafts from it, in single steps (a window's passes take none).
        predicting = self.predictions.active and any(self.predictions.has(r.request_id) for r, _ in chosen)
        windows = self._plan_window(chosen) if self.num_scheduler_steps > 1 and not predicting else None
        drafts = self._plan_drafts(chosen, budget, out.predicted) if self.proposer is not None or predicting else {}
        for request, num_new in chosen:
            first_block, remote = self.kv.remote_prefix(request.request_id)
            start = request.num_computed_tokens
            end = start + num_new
            # (Checked here first: the simulator schedules many chunks a step, none of them scoring its prompt.)
            scoring = request.prompt_logprobs is not None
            targets, targets_from = request.prompt_targets(start, end) if scoring else ((), 0)
            if end == request.num_tokens and request.handoff is not None and not request.handoff_sent:
                send = self._handoff_send(request)
                if send is not None:
                    out.remote_sends.append(send)
            token_ids = request.all_token_ids[start:end]
            draft = drafts.get(request.request_id)
            if draft:
                token_ids += draft
            out.chunks.append(
                ScheduledChunk(
                    request_id=request.request_id,
                    token_ids=token_ids,
                    start_pos=start,
                    block_ids=self.kv.block_ids(request.request_id),
                    sample=end == request.num_tokens,
                    sampling_params=request.sampling_params,
                    num_output_tokens=request.num_output_tokens,
                    eos_token_ids=request.eos_token_ids,
                    first_block=first_block,
                    remote=remote,
                    num_steps=windows[request.request_id] if windows else 1,
                    history=request.all_token_ids if request.sampling_params.needs_history else (),
                    num_prompt_tokens=len(request.prompt_token_ids),
                    prompt_targets=targets,
                    prompt_targets_from=targets_from,
                    draft_token_ids=tuple(draft) if draft else (),
                )
            )
        if windows:
            out.window = max(windows.values())
        # Each chunk's tokens, until the step is recorded.
        self.in_flight = {c.request_id: _sure_tokens(c) for c in out.chunks}
        out.transfers = self.kv.take_transfers()
        out.disk_writes = self.kv.take_disk_writes()
        out.disk_ages = self.kv.take_disk_ages()
        out.num_reads_in_flight = self.kv.num_reads_in_flight
        out.remote_recvs = self.kv.take_remote_recvs()
        out.num_remote_in_flight = self.kv.num_remote_in_flight
        if out.is_empty:
            # A step with nothing to run is not launched: its departures and arrivals go to the next one that is,
            # whose executor forgets the departed requests' sampling state (grammar matchers, seeded generators).
            self._finished_since_step = out.finished_ids + self._finished_since_step
            self._arrived_since_step += out.arrivals
            out.finished_ids, out.arrivals, out.departures = [], 0, 0
        return out

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Asynchronous scheduling: the step after ``prev`` (a step run on the device: a multi-step window, a single
        step of decodes, or a step with prefill as a window of one pass), decided while ``prev`` still runs there, the
        tokens it draws unknown. A chunk that decodes a token ``prev`` draws holds :data:`AHEAD_TOKEN` in its
        ``token_ids``: its input is taken on the device from ``prev``'s tokens. A request that ``prev`` ends otherwise
        than by length (a stop token or string, an abort) may be in it too; its tokens are dropped when it is recorded
        (it was removed by then).

        The next window of ``prev``'s requests when nothing else changes (:meth:`_window_ahead`: the steady state,
        cheap), else the ordinary decision over the requests as ``prev`` leaves them (:meth:`_step_ahead`: admissions,
        the rest of a prompt, the step after a prefill). None when the next step needs the ordinary decision after
        ``prev``: blocks are on their way or lent, drafts, a handoff, a grammar compiling, or the device short of the
        blocks a step could take (nothing is preempted under a step in flight); the engine then waits for ``prev`` and
        schedules as ever."""
        if (
            self.kv.has_disk
            or self.kv.num_remote_in_flight
            or self.proposer is not None
            or self.predictions.active
            or prev.remote_sends  # (a stream prev sends ends with prev: a step launched meanwhile would cut it)
        ):
            return None
        ahead = self._window_ahead(prev)
        return ahead if ahead is not None or not self.decide_steps_ahead else self._step_ahead(prev)

    def _window_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The window after ``prev`` when ``prev``'s every chunk sampled and its requests simply go on: each chunk
        ``prev``'s request one window on (each chunk's first input is its request's last token in ``prev``), less those
        whose output ends in ``prev`` by length. None when a chunk of ``prev`` did not sample (the middle of a prompt),
        a running request is not in it, a waiting request would be admitted (:meth:`_would_admit`), or the device lacks
        the window's blocks."""
        if any(r.request_id not in self.in_flight for r in self.running):
            return None  # (a running request left out of prev: the ordinary decision orders them)
        found = self._in_flight(prev)
        if found is None:
            return None
        kv = self.kv
        plan: list[tuple[Request, int, int, int]] = []  # (request, first position, passes, outputs after prev)
        need = 0
        for request, chunk in found[0]:  # (those whose output ends in prev are left out)
            if not chunk.sample:
                return None  # (the middle of a prompt: the ordinary decision goes on with it)
            outputs = request.num_output_tokens + chunk.num_steps
            start = request.num_computed_tokens + _sure_tokens(chunk)
            steps = min(self.num_scheduler_steps, request.max_tokens - outputs)
            plan.append((request, start, steps, outputs))
            need += max(0, kv.blocks_for_tokens(start + steps) - kv.num_allocated_blocks(request.request_id))
        if not plan or need > kv.pool.num_free or (self.waiting and self._would_admit([r for r, *_ in plan])):
            return None
        out = self._begin_output()
        out.requests = {request.request_id: request for request, *_ in plan}
        for request, start, steps, outputs in plan:
            rid = request.request_id
            if not kv.allocate(rid, request.all_token_ids, start + steps):
                # (Counted free above.) The copies to host memory decided so far will not run: no name may point at
                # the blocks they were to fill.
                kv.forget(t.dst for t in kv.take_transfers())
                raise RuntimeError(f"a window ahead found fewer free blocks than counted for {rid}")
            out.chunks.append(
                ScheduledChunk(
                    request_id=rid,
                    token_ids=[AHEAD_TOKEN],
                    start_pos=start,
                    block_ids=kv.block_ids(rid),
                    sample=True,
                    sampling_params=request.sampling_params,
                    num_output_tokens=outputs,
                    eos_token_ids=request.eos_token_ids,
                    num_steps=steps,
                    num_prompt_tokens=len(request.prompt_token_ids),
                )
            )
            self.in_flight[rid] += steps
        out.window = max(steps for _, _, steps, _ in plan)
        out.decided_ahead = True
        self._ahead_in_flight += 1
        out.transfers = kv.take_transfers()  # (evictions of named blocks down to host memory, for the new blocks)
        self.stats.num_ahead += 1
        return out

    def _in_flight(self, prev: SchedulerOutput) -> tuple[list[tuple[Request, ScheduledChunk]], list[Request]] | None:
        """``prev``'s requests still here (not one that left while it ran, nor a new request of its id), each with its
        chunk, less those whose output ends in ``prev`` by length, which come second; None when the step after ``prev``
        may not be decided ahead for one of them: it has lent blocks, drafts or a handoff, or another step of it is in
        flight."""
        going: list[tuple[Request, ScheduledChunk]] = []
        ending: list[Request] = []
        decided_for = prev.requests
        for chunk in prev.chunks:
            rid = chunk.request_id
            request = self.requests.get(rid)
            if (
                request is None
                or request.status is not RequestStatus.RUNNING
                or (decided_for is not None and decided_for.get(rid) is not request)
            ):
                continue
            if (
                self.kv.first_local_block(rid)  # (lent or released blocks: the device windows' tables start at 0)
                or chunk.draft_token_ids
                or request.handoff is not None
                or _sure_tokens(chunk) != self.in_flight.get(rid)
            ):
                return None
            if chunk.sample and request.num_output_tokens + chunk.num_steps >= request.max_tokens:
                ending.append(request)
            else:
                going.append((request, chunk))
        return going, ending

    def _step_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The ordinary decision (:meth:`schedule`) for the step after ``prev``, made while ``prev`` runs, as vLLM's
        asynchronous scheduler makes it: each of ``prev``'s requests counts the tokens ``prev`` computes, and one that
        samples in ``prev`` holds a placeholder (:data:`AHEAD_TOKEN`) for each token it draws there, for the decision's
        length only. So the step may admit waiting requests, go on with the rest of a prompt, and decode the tokens
        ``prev`` draws (a chunk of the one placeholder). A request whose output ends in ``prev`` by length is left out.

        Within the decision: no request is preempted (a step in flight may be writing any request's blocks): one
        that finds too few free blocks ends the decision, in priority order, and the next decision is the ordinary
        one; it is declined unless the free blocks cover the most a step takes, so that this is rare. No block is
        named after a placeholder (the allocations name blocks of the known tokens only; the request's next
        allocation names them). Nothing is read from host memory (host blocks may still be landing from a copy queued
        behind the step in flight): a request whose KV is there (swapped out, or a prefix found there) ends the
        decision too, and the ordinary decision after swaps it in or loads it (:meth:`_end_ahead`). None when nothing
        would run."""
        kv = self.kv
        if (
            self._ended_ahead
            or self.compiling  # (admitted by the engine's ordinary decision, which looks at their compilation first)
            or self.held
            or self.grants_required
            # (A prefill engine's request sends its blocks in the step that ends its prompt: streams of one step only.)
            or any(r.handoff is not None for r in self.waiting)
            # (A chunk of n tokens takes at most n / block size + 1 new blocks.)
            or kv.pool.num_free
            < kv.blocks_for_tokens(self.max_num_batched_tokens) + min(self.max_num_seqs, len(self.requests))
        ):
            return None
        found = self._in_flight(prev)
        if found is None:
            return None
        going, ending = found
        # (request, tokens prev computes, placeholders for the tokens it draws)
        pretend = [(r, _sure_tokens(c), c.num_steps if c.sample else 0) for r, c in going]
        if not self.waiting and len(ending) == len(self.running):
            return None  # nothing goes on
        for request, computed, placeholders in pretend:
            request.num_computed_tokens += computed
            if placeholders:
                request.output_token_ids.extend([AHEAD_TOKEN] * placeholders)
                request.all_token_ids.extend([AHEAD_TOKEN] * placeholders)
        if ending:
            ended = {r.request_id for r in ending}
            self.running = [r for r in self.running if r.request_id not in ended]
        in_flight = self.in_flight
        finished, arrived = self._finished_since_step, self._arrived_since_step
        self._placeholders = {r.request_id: k for r, _, k in pretend if k}
        try:
            out = self.schedule()
        except BaseException:
            # (No step to launch: the copies to host memory decided so far will not run, so no name may point at the
            # blocks they were to fill; the departures and arrivals go to the next step.)
            kv.forget(t.dst for t in kv.take_transfers())
            self._finished_since_step = finished + self._finished_since_step
            self._arrived_since_step += arrived
            self.in_flight = in_flight  # (prev's counts alone)
            raise
        finally:
            self._placeholders = None
            for request, computed, placeholders in pretend:
                request.num_computed_tokens -= computed
                if placeholders:
                    del request.output_token_ids[-placeholders:]
                    del request.all_token_ids[-placeholders:]
            self.running += ending
        step_in_flight, self.in_flight = self.in_flight, in_flight  # (schedule() counts its own step's only)
        for rid, tokens in step_in_flight.items():
            in_flight[rid] = in_flight.get(rid, 0) + tokens
        # (Ruled out in _admit: nobody is evicted, nothing is swapped in or loaded from host memory.)
        assert not out.preempted_ids and all(t.dst.tier != DEVICE for t in out.transfers), "a step ahead moved KV in"
        if not out.chunks and not out.transfers:
            # Nothing to run (those that go on are held back): the ordinary decision after prev, which gets the
            # departures and arrivals this one took.
            self._finished_since_step = out.finished_ids + self._finished_since_step
            self._arrived_since_step += out.arrivals
            return None
        out.decided_ahead = True
        self._ahead_in_flight += 1
        self.stats.num_ahead += 1
        return out

    def _num_known(self, request: Request) -> int | None:
        """How many of the request's tokens are known while a step is decided ahead: all but the placeholders it holds
        (a block is named by its tokens when allocated: never after a placeholder); None (all) otherwise."""
        placeholders = self._placeholders.get(request.request_id, 0) if self._placeholders else 0
        return request.num_tokens - placeholders if placeholders else None

    def _begin_output(self) -> SchedulerOutput:
        """A step's decision begun: the KV manager's step opened, the step's output with the requests that finished and
        arrived since the last one (taken: the next step starts from none)."""
        self.kv.begin_step()
        # Departures count when some request here came before the last step: the engine went on at once (after the
        # last requests left it waited, and the server answered them beside no step).
        departures = len(self._finished_since_step) if len(self.requests) > self._arrived_since_step else 0
        out = SchedulerOutput(
            finished_ids=self._finished_since_step, arrivals=self._arrived_since_step, departures=departures
        )
        self._finished_since_step = []
        self._arrived_since_step = 0
        return out

    def _ranking(self, now: float) -> Callable[[Request], tuple]:
        """The sort key of the order of service: the request's ``priority`` class (vLLM's; smaller first), then the
        policy's priority within it."""
        policy_priority = self.policy.priority
        return lambda r: (r.sampling_params.priority, policy_priority(r, now))

    def _would_admit(self, continuing: list[Request]) -> bool:
        """Whether the ordinary decision after the step in flight would take a waiting request: one ranks among the
        policy's first ``max_num_seqs`` beside the requests that go on (a full batch of requests that outrank every
        waiting one keeps running ahead; a waiting request that outranks one of them, or a free slot, ends it)."""
        now = self.clock()
        self.policy.update(now)
        order = sorted(continuing + self.waiting, key=self._ranking(now))
        return any(r.status is not RequestStatus.RUNNING for r in order[: self.max_num_seqs])

    def _plan_window(self, chosen: list[tuple[Request, int]]) -> dict[str, int] | None:
        """Multi-step decoding: when every chosen request decodes one token (no prefill, no handoff, no lent blocks),
        each runs ``num_scheduler_steps`` forward passes, or fewer when its output runs out first, with the slots of
        all of them allocated now; None (an ordinary step) when the batch is not all decodes or the device lacks
        free blocks for the window (a window preempts nobody)."""
        steps = window_lengths(chosen, self.num_scheduler_steps)
        if steps is None or any(self.kv.first_local_block(r.request_id) for r, _ in chosen):
            return None
        kv = self.kv
        ends = {r.request_id: r.num_computed_tokens + steps[r.request_id] for r, _ in chosen}  # tokens with KV after
        need = sum(max(0, kv.blocks_for_tokens(end) - kv.num_allocated_blocks(rid)) for rid, end in ends.items())
        if need > kv.pool.num_free:
            return None
        for request, _ in chosen:
            allocated = kv.allocate(
                request.request_id, request.all_token_ids, ends[request.request_id], num_known=self._num_known(request)
            )
            assert allocated, "the window's blocks were counted free"
        return steps

    def _plan_drafts(self, chosen: list[tuple[Request, int]], budget: int, predicted: set[str]) -> dict[str, list[int]]:
        """Speculative decoding: the proposer's drafts for each chosen request that decodes its next token, within
        the step's remaining token budget and the request's remaining output (its last sample is a token more), with
        the slots for them allocated now. A request gets none when the device lacks free blocks for them (a draft
        preempts nobody), or when it hands off after this token, or some of its KV is lent, or its grammar waits to
        begin (a draft could carry it past its start unchecked); at most the proposer's
        ``max_drafts`` for the step's number of requests. The sampler masks a grammar's positions and counts a
        penalized request's outputs with the drafts before each. A request that brings a prediction drafts from it
        (``self.predictions``; by prompt lookup where it has none), the others from ``self.proposer`` (if any); the
        requests whose drafts are their prediction's go in ``predicted``."""
        drafts: dict[str, list[int]] = {}
        most = self.proposer.max_drafts(len(chosen)) if self.proposer is not None else 0
        for request, num_new in chosen:
            if budget <= 0:
                break
            rid = request.request_id
            proposer: DraftProposer | None = self.proposer
            limit = most
            if self.predictions.has(rid):
                proposer, limit = self.predictions, self.predictions.max_drafts(len(chosen))
            if (
                proposer is None
                or limit == 0
                or num_new != 1
                or request.num_computed_tokens + 1 != request.num_tokens
                or request.handoff is not None
                or self.kv.num_lent_blocks(rid)
                or _grammar_waits(request)
            ):
                continue
            limit = min(budget, limit, request.max_tokens - request.num_output_tokens - 1)
            draft = proposer.propose(rid, request.all_token_ids, request.num_prompt_tokens, limit)
            if draft and self.kv.allocate(rid, request.all_token_ids, request.num_tokens + len(draft)):
                drafts[rid] = draft
                budget -= len(draft)
                if proposer is self.predictions and self.predictions.from_prediction:
                    predicted.add(rid)
        return drafts

    def tokens_after_step(self, request: Request) -> int:
        """The request's computed tokens once the step decided (if any) has run."""
        return request.num_computed_tokens + self.in_flight.get(request.request_id, 0)

    def _prefill_caps(self, order: list[Request]) -> dict[str, int]:
        """Each prefilling request's most tokens this step, by attention time: the batch filled in priority order
        while its predicted time stays under the quota, the first that does not fit cut to the longest block-aligned
        chunk that does, and those behind it left out (``fill_prefill_batch``)."""
        assert self.prefill_time is not None
        predict, quota_s = self.prefill_time
        bs = self.kv.block_size
        candidates = []
        for request in order:
            if not _prefilling(request) or self._held_back(request):
                continue
            if request.status is RequestStatus.RUNNING:
                cached = request.num_computed_tokens
            elif request.computes_whole_prompt:  # it takes no cached prefix
                cached = 0
            else:  # what its admission will find in memory (not counted as a lookup)
                num_full = (request.num_tokens - 1) // bs
                cached = len(self.kv.memory_prefix(request.request_id, request.all_token_ids, num_full)) * bs
            candidates.append(PrefillCandidate(request.request_id, cached, request.num_tokens - cached))
        batch = fill_prefill_batch(
            candidates, predict, quota_s, self.max_num_batched_tokens, self.max_num_seqs, align=bs
        )
        return {chunk.request_id: chunk.num_tokens for chunk in batch.chunks}

    def _held_back(self, request: Request) -> bool:
        """Whether a request may not run yet: its blocks are on their way from the store or a peer, it waits for
        its first token (a decode engine's), it still has its prefix to push (DE-read), KV lending holds it back, or
        its grammar is compiling."""
        rid = request.request_id
        return (
            rid in self.held
            or rid in self.compiling
            or request.awaiting_resume
            or request.push is not None
            or (self.grants_required and self.awaits_grant(request))
            or self.kv.holds_back(rid, self.wait_for_host_room)
        )

    def _handoff_send(self, request: Request) -> RemoteSend | None:
        """The layerwise send of a prefill engine's request to its decode engine, in the step that samples its first
        token: the prompt's full blocks from the plan's first on (held until the send is reported)."""
        plan = request.handoff
        assert plan is not None
        request.handoff_sent = True
        num_full = request.num_prompt_tokens // self.kv.block_size
        blocks = self.kv.block_ids(request.request_id)[plan.send_from_block : num_full]
        if not blocks:
            return None
        refs = tuple(BlockRef(DEVICE, b) for b in blocks)
        send_id = self.kv.hold_for_send(refs)
        return RemoteSend(send_id, plan.peer, plan.send_tag, refs, len(refs), layerwise=True)

    def _push(self, request: Request) -> RemoteSend:
        """A decode engine's push (DE-read): the leading blocks it holds of those promised (its loads are done; a
        block it could not get goes as a gap the prefill engine reads or recomputes)."""
        push = request.push
        assert push is not None
        request.push = None
        end = push.first + push.num_blocks
        refs = tuple(self.kv.memory_prefix(request.request_id, request.all_token_ids, end, first=push.first))
        send_id = self.kv.hold_for_send(refs)
        return RemoteSend(send_id, push.peer, push.tag, refs, push.num_blocks, count_first=self.kv.layerwise_receive)

    def _admit(
        self,
        request: Request,
        budget: int,
        order: list[Request],
        idx: int,
        chosen_ids: set[str],
        out: SchedulerOutput,
    ) -> int | None:
        """Secure device KV for the request's next chunk; returns the chunk's length or None."""
        rid = request.request_id
        if request.status is RequestStatus.SWAPPED:
            if self._placeholders is not None:  # (its blocks in host memory: the ordinary decision swaps it in)
                self._end_ahead()
                return None
            # Room for its swapped blocks and the chunk's growth comes first: were it evicted again
            # after its swap-in, it would be copied out of blocks the swap-in had not yet filled.
            # Its blocks on creditors (KV lending) stay there while it is swapped out: only its local ones count.
            chunk_end = min(request.num_tokens, request.num_computed_tokens + budget, self._local_limit(rid))
            need = max(
                self.kv.num_swapped_blocks(rid), self.kv.blocks_for_tokens(chunk_end) - self.kv.first_local_block(rid)
            )
            if need > self.kv.pool.num_free:
                self._release_windows()
            if need > self.kv.pool.num_free:
                self._release_load_holds(order)
            if need > self.kv.pool.num_free + self._evictable_blocks(order, idx, chosen_ids):
                return None  # evicting everything below would not be enough: evict nothing
            while self.kv.pool.num_free < need:
                if not self._make_room(order, idx, chosen_ids, out):
                    return None
            transfers = self.kv.swap_in(rid, request.all_token_ids, request.num_computed_tokens)
            assert transfers is not None, "room was made for the swap-in"
            self.stats.num_swapped_in += 1
            self._to_running(request)
        prefix = None
        base = limit = self._local_limit(rid)
        windowed = False  # (a prefix taken from its window's blocks on, the model's every layer sliding)
        bs = self.kv.block_size
        if request.status is not RequestStatus.RUNNING:
            prefix = self._cached_prefix(request, base)
            if self._placeholders is not None and HOST in prefix.tiers:  # (loaded by the ordinary decision)
                self._end_ahead()
                return None
            computed = prefix.num_tokens
            limit = base + prefix.skipped * bs  # (the blocks it skips are not held)
        else:
            computed = request.num_computed_tokens
        if computed >= limit and self._placeholders is None and self._release_windows():
            limit = self._local_limit(rid)  # (its own blocks past the window went back)
        if computed >= limit:
            # Its local blocks fill the whole pool (a request longer than one pool, with KV lending): only a move of
            # its blocks to a creditor lets it grow. It keeps them meanwhile; evicting it would gain nothing (it
            # would come back to the same wall) and lose its KV, here and on its creditors.
            return None
        num_new = min(request.num_tokens - computed, budget, limit - computed)
        known = self._num_known(request)
        if prefix is None and self.kv.allocate(rid, request.all_token_ids, computed + num_new, num_known=known):
            return num_new  # a running request's growth, with room: the common case
        if self._placeholders is not None:
            # Decided ahead: nobody is evicted under a step in flight (its chunks may be writing any request's blocks).
            # The decision ends here, in priority order; the next one is the ordinary decision, which may preempt.
            if prefix is None or not self.kv.allocate(rid, request.all_token_ids, computed + num_new, prefix, known):
                self._end_ahead()
                return None
        else:
            short = self.kv.blocks_short(rid, computed + num_new, prefix)
            if short > 0 and self._release_windows():  # (before anyone is preempted: those blocks are read no more)
                short = self.kv.blocks_short(rid, computed + num_new, prefix)
            if short > 0 and self._release_load_holds(order):
                short = self.kv.blocks_short(rid, computed + num_new, prefix)
            narrowed = self.kv.window_prefix(prefix) if short > 0 and prefix is not None else None
            if narrowed is not None and narrowed is not prefix:
                # Nor its own prefix's blocks that its window has left: taken from the window's on.
                windowed, prefix = True, narrowed
                limit = base + narrowed.skipped * bs
                num_new = min(request.num_tokens - computed, budget, limit - computed)
                short = self.kv.blocks_short(rid, computed + num_new, prefix)
            if short > 0 and short > self._evictable_blocks(order, idx, chosen_ids):
                if request.status is RequestStatus.RUNNING:
                    self._evict(request, out, order)  # it cannot grow and nothing below it can give way
                return None
            while not self.kv.allocate(rid, request.all_token_ids, computed + num_new, prefix):
                if not self._make_room(order, idx, chosen_ids, out):
                    if request.status is RequestStatus.RUNNING:
                        self._evict(request, out, order)  # it cannot grow and nothing below it can give way
                    return None
                if prefix is not None and prefix.tiers.count(HOST):
                    # The swap-out that made room may have taken host blocks of the prefix: look again.
                    prefix = self._cached_prefix(request, base)
                    if windowed:
                        prefix = self.kv.window_prefix(prefix)
                    computed = prefix.num_tokens
                    limit = base + prefix.skipped * bs
                    num_new = min(request.num_tokens - computed, budget, limit - computed)
        if request.status is not RequestStatus.RUNNING:
            self.kv.note_admitted(rid, computed // self.kv.block_size)
            if request.num_computed_tokens == 0 and request.num_preemptions == 0:
                # Of the prompt only: a request resumed elsewhere (a failover) finds its earlier outputs cached too,
                # which are no prompt tokens of its client's (a hit rate past 1, cached tokens past the prompt's).
                cached = min(computed, request.num_prompt_tokens)
                request.num_cached_tokens = cached
                self.stats.num_prompt_tokens_cached += cached
                if prefix is not None:
                    by_tier = self.stats.cached_tokens_by_tier
                    for tier, tokens in prefix.tokens_by_origin(cached).items():
                        by_tier[tier] = by_tier.get(tier, 0) + tokens
            request.num_computed_tokens = computed
            self._to_running(request)
        return num_new

    def _cached_prefix(self, request: Request, limit: int) -> CachedPrefix:
        """The cached prefix a request being admitted starts from: none for one that computes its whole prompt (it
        scores it: every prompt position's logits are needed, as vLLM rules; or it pools every token), else the longest
        in memory, within ``limit`` tokens. One longer than that, of a model whose every layer slides, skips the blocks
        its window has left (``KVCacheManager.window_prefix``): the rest within ``limit``."""
        if request.computes_whole_prompt:
            return CachedPrefix(block_size=self.kv.block_size)
        found = self.kv.find_cached_prefix(request.request_id, request.all_token_ids)
        if found.num_tokens >= limit and self.kv.window is not None and self._placeholders is None:
            skipping = self.kv.window_prefix(found)
            return self.kv.window_prefix(_prefix_within(skipping, limit + skipping.skipped * self.kv.block_size))
        return _prefix_within(found, limit)

    def _end_ahead(self) -> None:
        """End a decision ahead at a request it may not take, and make the next decision the ordinary one, after the
        step in flight: else a run of steps ahead could pass the request over for good. Nothing below it runs in the
        step (priority order). The request is
        - short of blocks: nobody is evicted under a step in flight (its chunks may be writing any request's blocks);
          the ordinary decision may preempt;
        - or holds KV in host memory (swapped out, or a prefix found there): a step decided ahead reads nothing from
          there, where blocks may still be landing from copies queued behind the step in flight, and computing them
          again would throw away what memory holds (and give other cached-token counts than the engine without
          asynchronous scheduling); the ordinary decision swaps it in or loads its prefix."""
        self._ended_ahead = True

    def _local_limit(self, request_id: str) -> int:
        """The most tokens the request's KV may reach with its local blocks filling the whole pool (less
        ``hosted_blocks``, when the lending agent counts them): its blocks on creditors (KV lending) and the pool.
        Only a request longer than one pool reaches it (its ``max_model_len`` is the cluster's); it then computes up
        to it, and grows past it once a move has taken some of its blocks, instead of waiting for room no eviction can
        make. A request on a creditor that runs into the blocks it hosts before that is evicted like any other (swapped
        out, or dropped to recompute without host memory) and comes back once they are freed or moved."""
        own = self.kv.pool.num_blocks - self.hosted_blocks
        return (self.kv.first_local_block(request_id) + own) * self.kv.block_size

    def _release_load_holds(self, order: list[Request]) -> bool:
        """A model whose every layer slides: the memory prefixes held for waiting requests while the store loads the
        rest (``_held_while_loading``), the one being admitted's too, let go when a request finds no room: they stay
        named (cache), and a step that needs nearly the whole pool (a window's and a step's tokens: such a model's
        context is not capped by the pool) would else wait for them for ever. Other models keep them until nothing
        else runs (``schedule``), their contexts within the pool. Whether any went."""
        if self.kv.window is None:
            return False
        waiting = [r.request_id for r in order if r.status is not RequestStatus.RUNNING]
        return self.kv.release_held_while_loading(waiting)

    def _release_windows(self) -> bool:
        """A model whose every layer slides (``KVCacheManager.window``): each running request's blocks that have left
        the window of its next token go back to the pool (named, as cache). Done when the pool runs short, not every
        step: a request with no block given back keeps the device's fast paths (CUDA graphs, multi-step windows), whose
        block tables start at its first block. Not a request that hands its prompt's blocks off or pushes them (they
        are read whole). Whether any block went."""
        if self.kv.window is None:
            return False
        released = 0
        for request in self.running:
            if request.handoff is None and request.push is None and request.status is RequestStatus.RUNNING:
                released += self.kv.release_outside_window(request.request_id, request.num_computed_tokens)
        self.stats.num_window_blocks_released += released
        return released > 0

    def waits_for_room(self, request: Request) -> bool:
        """Whether a running request's local blocks fill the whole pool, once the step decided has run, and it has
        more to compute: only a move of its blocks to a creditor (KV lending) lets it grow, and it keeps its blocks
        meanwhile (``_admit``). Two such requests on two instances with nowhere to lend wait for each other for good:
        the gManager's deadlock breaker looks for them (``cluster/lending_deadlock.py``)."""
        computed = self.tokens_after_step(request)
        return computed < request.num_tokens and computed >= self._local_limit(request.request_id)

    def hold(self, request_id: str) -> bool:
        """Drop the request's KV to be recomputed and admit it no more until :meth:`release` (the gManager's deadlock
        breaker: the blocks it freed are lent to another request's growth); False when it holds no KV here."""
        if not self.preempt_to_recompute(request_id):
            return False
        self.held.add(request_id)
        self.kv.release_held_while_loading([request_id])  # no load of its prefix holds device blocks either
        return True

    def peak_blocks(self, request: Request) -> int:
        """The blocks the request's KV reaches at most: its prompt and its ``max_tokens`` (its prompt alone when the
        caller set no cap: its growth is then left to the lending plans)."""
        capped = request.sampling_params.max_tokens is not None
        return self.kv.blocks_for_tokens(request.num_prompt_tokens + (request.max_tokens if capped else 0))

    def awaits_grant(self, request: Request) -> bool:
        """Whether the request waits for the gManager's grant to start: grants are required here, it has not started
        (or was dropped to recompute before its grant), it is not granted, and its peak needs more blocks than the
        pool."""
        return (
            self.grants_required
            and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            and request.request_id not in self.granted
            and self.peak_blocks(request) > self.kv.pool.num_blocks
        )

    def awaiting_grant(self) -> list[tuple[str, int]]:
        """The waiting requests that await a grant, in arrival order, with their peak blocks (for the heartbeat)."""
        return [(r.request_id, self.peak_blocks(r)) for r in self.waiting if self.awaits_grant(r)]

    def grant(self, request_id: str) -> bool:
        """The gManager's grant: the request may start although its peak needs more than the pool; False when it
        is not here."""
        if request_id not in self.requests:
            return False
        self.granted.add(request_id)
        return True

    def release(self, request_id: str) -> bool:
        """Admit a held request again (its turn comes by the policy's priority, as any waiting request's); False
        when it was not held."""
        if request_id not in self.held:
            return False
        self.held.discard(request_id)
        return True

    def _evictable_blocks(self, order: list[Request], idx: int, chosen_ids: set[str]) -> int:
        """Device blocks held by requests below ``idx`` outside this step (shared ones may not all come free)."""
        return sum(
            self.kv.num_allocated_blocks(r.request_id)
            for r in order[idx + 1 :]
            if r.status is RequestStatus.RUNNING and r.request_id not in chosen_ids
        )

    def _make_room(self, order: list[Request], idx: int, chosen_ids: set[str], out: SchedulerOutput) -> bool:
        """Evict the lowest-priority device-KV holder below ``idx`` that is not in this step."""
        for victim in reversed(order[idx + 1 :]):
            if victim.status is RequestStatus.RUNNING and victim.request_id not in chosen_ids:
                self._evict(victim, out, order)
                return True
        return False

    def _evict(self, request: Request, out: SchedulerOutput, order: list[Request]) -> None:
        """Take a request's device KV: to a tier below if one has room, else drop it for recompute.

        Blocks loaded from the store ahead of the turn of waiting requests below it give way first: they are
        on disk still, and dropping the KV of a request served before them would cost a recompute.
        """
        transfers = self.kv.swap_out(request.request_id)
        if transfers is None:
            below = order[order.index(request) + 1 :]
            if self.kv.release_prefetched(
                [r.request_id for r in reversed(below) if r.status is not RequestStatus.RUNNING]
            ):
                transfers = self.kv.swap_out(request.request_id)
        if transfers is not None:
            request.status = RequestStatus.SWAPPED
            self.stats.num_swapped_out += 1
        else:
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self.stats.num_recomputed += 1
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.running.remove(request)
        self.waiting.append(request)
        out.preempted_ids.append(request.request_id)

    def preempt_to_recompute(self, request_id: str) -> bool:
        """Drop a request's KV (running, or swapped out), to be recomputed from its tokens (its blocks on another
        instance were lost with it); False when it holds no KV here."""
        request = self.requests.get(request_id)
        if request is None or request.status not in (RequestStatus.RUNNING, RequestStatus.SWAPPED):
            return False
        self.kv.free(request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.stats.num_recomputed += 1
        if request in self.running:
            self.running.remove(request)
            self.waiting.append(request)
        request.status = RequestStatus.PREEMPTED
        return True

    def _to_running(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
            self.running.append(request)
        request.status = RequestStatus.RUNNING

    # -- after the step ----------------------------------------------------------------------

    def step_failed(self, output: SchedulerOutput) -> list[str]:
        """The requests a step that raised leaves without their KV, to be failed: those in its chunks and
        those holding a block one of its transfers was to write. The blocks it was to write (on the device
        or below), and the host blocks it read that a stream was still landing in, lose their prefix-cache
        names, so no later request reads KV that was never written. Its
        disk reads were started whatever happened (their requests wait for them as usual)."""
        self.in_flight = {}
        self._ahead_in_flight = 0
        bs = self.kv.block_size
        written = [t.dst for t in output.transfers]
        for chunk in output.chunks:
            written += [BlockRef(DEVICE, b) for b in chunk.block_ids[chunk.start_pos // bs - chunk.first_block :]]
        # Host blocks a stream was still landing in when the step read them (a DE-read push used as it lands): the
        # step may have failed because their stream did, so no later request may find them.
        written += self.kv.landing(t.src for t in output.transfers)
        self.kv.forget(written)
        self.kv.writes_lost(output.disk_writes)
        chunk_ids = [c.request_id for c in output.chunks]
        return chunk_ids + [rid for rid in self.kv.holders(written) if rid not in chunk_ids]

    def apply_tier_report(self, report: TierReport) -> None:
        """Record the disk reads and writes the executor finished: requests whose reads are done may be
        admitted at the next step."""
        if report.held_at_open:
            self.kv.learn_disk_holdings(report.held_at_open)
        self.kv.finish_disk_reads(report.reads)
        self.kv.finish_disk_writes(report.writes)

    def apply_remote_report(self, report: RemoteReport) -> None:
        """Record the block streams the executor finished: their blocks are released or named, and requests
        whose blocks have come (or failed to) may be admitted at the next step."""
        self.kv.finish_remote(report.recvs, report.sends, report.counts)

    def advance(self, output: SchedulerOutput, service_s: float, accepted: Mapping[str, int] | None = None) -> None:
        """Record that the step ran: each scheduled request computed its chunk, of its drafts (speculative
        decoding) only the ``accepted`` ones (by request id).

        ``service_s`` is the step's model execution time; every request in the batch spent it in
        the model executor, and is charged it as attained service (Autellix's measure).
        """
        now = self.clock()
        decided_for = output.requests
        if self._ahead_in_flight:  # a window decided ahead may be in flight still: only this step's tokens leave
            in_flight = self.in_flight
            for chunk in output.chunks:
                left = in_flight.pop(chunk.request_id, 0) - _sure_tokens(chunk)
                if left > 0:
                    in_flight[chunk.request_id] = left
            self._ahead_in_flight -= output.decided_ahead
        else:  # the one step in flight
            self.in_flight = {}
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or (decided_for is not None and decided_for.get(chunk.request_id) is not request):
                continue  # it left while the step ran (and its id may be a new request's)
            computed = len(chunk.token_ids) + chunk.num_steps - 1  # a window's passes: one each
            if chunk.draft_token_ids:  # the drafts' KV counts up to the first rejected one
                computed += (accepted or {}).get(chunk.request_id, 0) - len(chunk.draft_token_ids)
            request.num_computed_tokens += computed
            request.service_s += service_s
            self.policy.on_service(request, service_s, now)


def _sure_tokens(chunk: ScheduledChunk) -> int:
    """The tokens a chunk computes for sure: its tokens, one more for each later pass of a window; drafts may be
    rejected."""
    return len(chunk.token_ids) - len(chunk.draft_token_ids) + chunk.num_steps - 1


def _grammar_waits(request: Request) -> bool:
    """Whether the request's grammar begins after tokens its output does not hold yet (StructuredOutput.after)."""
    spec = request.sampling_params.structured
    if spec is None or not spec.after:
        return False
    return grammar_start(request.output_token_ids, spec.after, spec.after_close) is None


def window_lengths(chosen: list[tuple[Request, int]], num_scheduler_steps: int) -> dict[str, int] | None:
    """Each chosen request's forward passes in a multi-step window (``num_scheduler_steps`` at most, and no more than
    the output tokens it may still produce, so no slot is allocated past its length), or None when the batch is not
    all one-token decodes that sample (a prefill chunk, a prefill engine's handoff) or no request has a second step."""
    steps = {}
    for request, num_new in chosen:
        if num_new != 1 or request.num_computed_tokens + 1 != request.num_tokens or request.handoff is not None:
            return None
        steps[request.request_id] = max(1, min(num_scheduler_steps, request.max_tokens - request.num_output_tokens))
    return steps if steps and max(steps.values()) > 1 else None


def _prefix_within(prefix: CachedPrefix, limit: int) -> CachedPrefix:
    """The cached prefix cut to leave at least one block to compute under ``limit`` tokens (a request longer than
    one pool, evicted with the pool full of its blocks, comes back with all but the last of them)."""
    if prefix.num_tokens < limit:
        return prefix
    keep = limit // prefix.block_size - 1
    return CachedPrefix(prefix.blocks[:keep], prefix.tiers[:keep], prefix.origins[:keep], prefix.block_size)


def _prefilling(request: Request) -> bool:
    """Whether the request still has prompt to compute (a waiting one always starts with its prompt)."""
    return request.status is not RequestStatus.RUNNING or request.num_computed_tokens < request.num_prompt_tokens
