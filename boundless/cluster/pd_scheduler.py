"""Which prefill engine (PE) and decode engine (DE) serve a request, and over which path its KV is read
from storage: DualPath's inter-engine scheduler (arXiv 2602.21548, section 4.3.1).

Engines report an :class:`EngineLoad`: their unfinished requests (``seq``), those requests' tokens
(``tok``, the proxy the paper uses for GPU, storage and network load alike) and the storage read
queue of their node. From those reports and a FIFO of requests, :func:`schedule` places requests in
order, one round at a time:

1. **PE.** Engines are *overloaded* (``tok > beta``), *ideal* (``read_queue <= alpha`` and
   ``tok <= beta``) or *storage-pressed* (``read_queue > alpha`` and ``tok <= beta``). A request never
   goes to an overloaded PE; ideal PEs come first (their storage NIC is about to idle, and only new
   requests keep it busy), then storage-pressed ones; within the class, the fewest tokens wins. A PE must have
   the KV room for the prompts of the requests placed on it (:func:`fits`), as a DE must for its requests.
2. **DE.** The request goes to the DE group with the fewest tokens, then, within it, to the DE with
   the fewest requests among those that stay at or under the high-token threshold ``Z`` after taking
   it; only when every DE would pass ``Z`` does the one with the fewest tokens take it (a DE far
   above the others risks running out of KV memory and preempting). A DE must have the KV room.
3. **Read path.** ``dualpath`` reads the request's stored KV on whichever node's storage link would
   finish it first: the PE's (storage -> PE) or the DE's (storage -> DE -> PE over the compute network),
   each node's queue plus the tokens that path would read for this request (:func:`read_tokens`: the
   stored tokens less what the reading engines likely hold in memory already; every node's link has one
   rate, so tokens compare as times). A tie reads on the DE (the PE's node also computes the prefill);
   a request the PE holds whole, or a PE and DE on one node, reads on the PE (nothing to balance).
   ``basic`` always reads on the PE (the single-path baseline); ``oracle`` reads nothing (no storage
   I/O: an upper bound for benchmarks).

Every placement is accounted before the next request is placed: the PE's and DE's ``seq`` and
``tok`` grow, the DE's free KV shrinks, and the read (the tokens its path reads) lands in its node's
queue. The request at the head of the queue that finds no PE or no DE stops the round (strict FIFO,
as the paper's PE scheduling); the rest wait for the next reports.

Where this differs from the paper: the paper's engine groups *pull* work (a group's leader asks,
the scheduler answers), and DE requests pass through a global pool and per-group private queues.
Here one round sees every engine's latest report at once, so a request's PE, DE and read path are
chosen together, and the pool is drained request by request to the group with the fewest tokens
*at that moment* (with one request in the pool this is the paper's rule; with many, it keeps a
burst from landing on one group). The paper gives ``Z`` as a formula of the group's state (not in
our summary); by default we take it as the tokens per DE if the group took every request of the
round that fits its free KV, evenly spread (``--pd-z`` fixes it instead).

Units: every quantity is in tokens. A read queue of ``b`` bytes is ``b // kv_bytes_per_token``
tokens (:func:`read_queue_tokens`); one model means one ratio for every engine, so comparing
tokens compares bytes, and the thresholds scale with the engine's step budget, not with the model.

Pure: a decision is a function of (loads, queue, config); nothing here does I/O or reads time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from boundless.config import KV_PATHS, ClusterConfig, SchedulerConfig

Role = Literal["prefill", "decode"]
KVPath = Literal["basic", "dualpath", "oracle"]
ReadPath = Literal["pe", "de", "none"]
PrefillClass = Literal["overloaded", "ideal", "storage_pressed"]

# Defaults as multiples of the engine's step budget (--max-num-batched-tokens), justified on the fields.
ALPHA_STEPS = 1
BETA_STEPS = 8


@dataclass(frozen=True)
class PDSchedulerConfig:
    """The thresholds of the inter-engine scheduler, in tokens.

    ``alpha``: a node whose storage read queue holds at most this many tokens of KV is *ideal* for
    new prefill work. Default: one step's token budget (``max_num_batched_tokens``, 2048). Reads
    are issued a request at a time ahead of its compute, so a queue shorter than one step's worth
    drains before the engine's next step and its NIC then idles; a longer queue keeps the NIC busy
    for at least a step without help, so new work there only lengthens the wait. Below a block
    (``block_size`` tokens) the threshold means nothing, as reads come in whole blocks.

    ``beta``: a PE with more than this many unfinished tokens is *overloaded* and takes nothing.
    Default: eight step budgets (16,384). An agentic request's tokens are mostly cached context
    (the paper's traces: ~95%), so the count of all its tokens runs far ahead of the new tokens a
    step computes; eight budgets leave a PE a few steps of queued work (enough for the attention-time
    batcher to pack) without hoarding requests another PE could start at once. A PE under ``beta``
    always takes one more request, however long, so a request longer than ``beta`` is still served.

    ``z``: the high-token threshold of a DE; None derives it per round from the group's state
    (the paper's rule, see the module docstring); a number fixes it.

    ``kv_path``: ``basic`` (PE reads only), ``dualpath`` (the link that finishes the read first) or ``oracle``
    (no reads).
    """

    alpha: int = ALPHA_STEPS * 2048
    beta: int = BETA_STEPS * 2048
    z: int | None = None
    kv_path: KVPath = "dualpath"

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0 or (self.z is not None and self.z < 0):
            raise ValueError("alpha, beta and z must not be negative")
        if self.kv_path not in KV_PATHS:
            raise ValueError(f"unknown kv path {self.kv_path!r}; one of {', '.join(KV_PATHS)}")

    @classmethod
    def from_configs(cls, cluster: ClusterConfig, scheduler: SchedulerConfig) -> PDSchedulerConfig:
        """The flags, with unset thresholds scaled to the engines' step budget."""
        budget = scheduler.max_num_batched_tokens
        return cls(
            alpha=cluster.pd_alpha if cluster.pd_alpha is not None else ALPHA_STEPS * budget,
            beta=cluster.pd_beta if cluster.pd_beta is not None else BETA_STEPS * budget,
            z=cluster.pd_z,
            kv_path=cluster.kv_path,  # type: ignore[arg-type]  # validated by ClusterConfig
        )


@dataclass(frozen=True)
class EngineLoad:
    """An engine's report: its role, where it sits, and its load.

    ``node`` is the machine whose storage NIC the engine shares (every engine of a node reports the
    same ``read_queue``); ``group`` is the set of engines scheduled together (all PEs or all DEs,
    never spanning nodes). ``kv_free_tokens`` is its free KV memory in tokens (None: not limited): a DE's for the
    requests it decodes, a PE's for the prompts of the requests placed on it (until their handoffs)."""

    engine_id: str
    role: Role
    node: str
    group: str
    seq: int = 0
    tok: int = 0
    read_queue: int = 0
    kv_free_tokens: int | None = None


@dataclass(frozen=True)
class PendingRequest:
    """A request waiting for its engines: its prompt tokens, how many of them have KV in storage, and how many
    leading ones of those each engine likely holds in memory (``in_memory``: the engines that served its program's
    last call; a read there skips them, so the bytes a path carries are not the stored tokens alone)."""

    request_id: str
    num_tokens: int
    stored_tokens: int = 0
    prefetched_on: str | None = None  # the engine its stored KV was read into ahead of its placement (see below)
    in_memory: Mapping[str, int] = field(default_factory=dict, hash=False)  # engine id -> leading stored tokens held

    def __post_init__(self) -> None:
        if not 0 <= self.stored_tokens <= self.num_tokens:
            raise ValueError(f"{self.request_id}: stored tokens must be within 0..num_tokens")


@dataclass(frozen=True)
class Placement:
    """Where a request runs, and where its stored KV is read (``read_tokens`` on ``read_node``)."""

    request_id: str
    prefill_engine: str
    decode_engine: str
    read_path: ReadPath
    read_node: str | None
    read_tokens: int


@dataclass(frozen=True)
class ScheduleResult:
    """A round's placements in FIFO order, the requests left waiting (in order), and the loads and
    node read queues with the placements accounted (valid until the engines' next reports)."""

    placements: tuple[Placement, ...]
    queue: Sequence[PendingRequest]  # the round's queue, its first ``len(placements)`` placed
    placed: Mapping[str, EngineLoad]  # every engine's load with the placements, by id in the loads' order
    read_queues: Mapping[str, int]

    @property
    def waiting(self) -> tuple[PendingRequest, ...]:
        """The requests left waiting, in order."""
        return tuple(self.queue[len(self.placements) :])

    @property
    def loads(self) -> tuple[EngineLoad, ...]:
        """Every engine's load with the placements and its node's read queue accounted, made when read (the
        dispatcher reads only the queues, and it schedules on every call's arrival and end)."""
        return tuple(dataclasses.replace(e, read_queue=self.read_queues[e.node]) for e in self.placed.values())


def read_queue_tokens(queued_bytes: int, kv_bytes_per_token: int) -> int:
    """A read queue in tokens of KV, rounded up (a partial token still has to be read)."""
    return -(-queued_bytes // kv_bytes_per_token)


# -- the rules, one function each ---------------------------------------------------------------


def classify_prefill(load: EngineLoad, read_queue: int, config: PDSchedulerConfig) -> PrefillClass:
    """The paper's three classes of PE, by its tokens and its node's read queue."""
    if load.tok > config.beta:
        return "overloaded"
    return "ideal" if read_queue <= config.alpha else "storage_pressed"


def pick_prefill_engine(
    pes: Sequence[EngineLoad], read_queues: Mapping[str, int], config: PDSchedulerConfig, num_tokens: int = 0
) -> EngineLoad | None:
    """Never an overloaded PE, nor one without the KV room for the request's ``num_tokens`` (:func:`fits`; 0: room
    not asked); ideal before storage-pressed; then the fewest tokens (first listed on a tie)."""
    for wanted in ("ideal", "storage_pressed"):
        candidates = [
            e for e in pes if classify_prefill(e, read_queues[e.node], config) == wanted and fits(e, num_tokens)
        ]
        if candidates:
            return min(candidates, key=lambda e: e.tok)
    return None


def fits(engine: EngineLoad, num_tokens: int) -> bool:
    """Whether the engine has the KV room for a request (ignoring fragmentation, as the paper does). A DE holds the
    request's KV while it decodes; a PE holds the prompts of every request placed on it until each one's handoff:
    the prefix a waiting request counts on (in memory when it arrived) stays there only while the requests placed
    on the PE fit its memory together, and one evicted before its admission is computed again (the PE-side room
    rule)."""
    return engine.kv_free_tokens is None or engine.kv_free_tokens >= num_tokens


def pick_decode_group(des: Sequence[EngineLoad], num_tokens: int) -> str | None:
    """The group with the fewest tokens among those with a DE that has room for the request."""
    totals: dict[str, int] = {}
    for de in des:
        totals[de.group] = totals.get(de.group, 0) + de.tok
    open_groups = [g for g in totals if any(fits(de, num_tokens) for de in des if de.group == g)]
    return min(open_groups, key=lambda g: totals[g], default=None)


def high_token_threshold(group: Sequence[EngineLoad], request_tokens: Iterable[int]) -> float:
    """Z for a DE group: its tokens per DE if it took, evenly spread, every request (in FIFO order)
    that fits its free KV. Below Z a DE is no fuller than its share; above it, it is the one the
    group's memory runs out on first."""
    room = sum(de.kv_free_tokens for de in group if de.kv_free_tokens is not None)
    limited = any(de.kv_free_tokens is not None for de in group)
    total = sum(de.tok for de in group)
    for n in request_tokens:
        if limited and n > room:
            break
        total += n
        room -= n
    return total / len(group)


def pick_decode_engine(group: Sequence[EngineLoad], num_tokens: int, z: float) -> EngineLoad | None:
    """Among DEs with room: the fewest requests among those staying at or under Z after the request;
    if every one would pass Z, the fewest tokens. First listed on a tie."""
    room = [de for de in group if fits(de, num_tokens)]
    under = [de for de in room if de.tok + num_tokens <= z]
    if under:
        return min(under, key=lambda e: e.seq)
    return min(room, key=lambda e: e.tok, default=None)


def read_tokens(request: PendingRequest, path: ReadPath, pe_id: str, de_id: str) -> int:
    """The stored tokens a path reads from storage for the request on engines ``pe_id`` and ``de_id``: PE-read,
    what the PE does not hold; DE-read, what neither holds (the DE reads only what the PE lacks, and serves from its
    own memory what it holds: ``EngineCore.prepare_intake``). An estimate: memory may have let blocks go since."""
    held_pe = request.in_memory.get(pe_id, 0)
    if path == "pe":
        return max(0, request.stored_tokens - held_pe)
    if path == "de":
        return max(0, request.stored_tokens - max(held_pe, request.in_memory.get(de_id, 0)))
    return 0


def choose_read_path(
    mode: KVPath,
    request: PendingRequest,
    pe_queue: int,
    de_queue: int,
    same_node: bool,
    pe_id: str = "",
    de_id: str = "",
) -> ReadPath:
    """PE-read or DE-read for the request's stored KV (``none`` when there is nothing to read, or under oracle).

    ``dualpath`` takes the path whose node would finish the read first: its queue plus what that path reads for
    this request (:func:`read_tokens` on engines ``pe_id`` and ``de_id``), so the bytes each link carries balance,
    not only the queues' lengths (a request whose context the DE holds adds nothing to the DE's link, and a whole
    context read adds all of it). A tie goes to the DE: the PE's node also computes every prefill. A request the
    PE holds whole reads nothing either way: PE-read, without a push."""
    if mode == "oracle" or request.stored_tokens == 0:
        return "none"
    if mode == "basic" or same_node:
        return "pe"
    pe_read = read_tokens(request, "pe", pe_id, de_id)
    if pe_read == 0:
        return "pe"
    return "de" if de_queue + read_tokens(request, "de", pe_id, de_id) <= pe_queue + pe_read else "pe"


def honor_prefetch(
    request: PendingRequest,
    pe: EngineLoad,
    de: EngineLoad,
    pes: Sequence[EngineLoad],
    des: Sequence[EngineLoad],
    queues: Mapping[str, int],
    config: PDSchedulerConfig,
) -> tuple[EngineLoad, EngineLoad, ReadPath | None]:
    """The PE and DE the rules above chose, unless the request's stored KV was prefetched into one engine's memory
    (:func:`plan_prefetches`): then that engine takes its side wherever the rules allow it (a PE not overloaded; a DE
    with the KV room), and the path is the one that reads there (a PE's memory: PE-read; a DE's: DE-read, which
    pushes it to the PE), so the bytes are not read a second time. Where the rules exclude the prefetched engine,
    their choice stands and the prefetched blocks stay there as ordinary cache. Returns the PE, the DE, and the
    path when the prefetch decided it (None: the rules decide)."""
    where = request.prefetched_on
    if where is None or config.kv_path == "oracle" or request.stored_tokens == 0:
        return pe, de, None
    for candidate in pes:
        if (
            candidate.engine_id == where
            and classify_prefill(candidate, queues[candidate.node], config) != "overloaded"
            and fits(candidate, request.num_tokens)
        ):
            return candidate, de, "pe"
    for candidate in des:
        if candidate.engine_id == where and fits(candidate, request.num_tokens) and pe.node != candidate.node:
            return pe, candidate, "de"
    return pe, de, None


def prefetch_target(
    request: PendingRequest,
    pes: Sequence[EngineLoad],
    des: Sequence[EngineLoad],
    queues: Mapping[str, int],
    room: Mapping[str, int],
    config: PDSchedulerConfig,
) -> tuple[EngineLoad, ReadPath, int] | None:
    """Where a waiting request's stored KV is read ahead of its placement, and how many tokens that reads, by the
    placement's own rules as far as they do not depend on room it lacks now: the PE it would get (the scheduler's PE
    rule), the DE whose node's read queue is the shortest (the fewest tokens on a tie; a DE's KV room is what the
    request waits for, and its placement then goes to that DE when it has room), and the read path by
    :func:`choose_read_path`; should that engine's prefetch room (``room``, tokens) not hold what it would read, the
    other path's engine under ``dualpath``. The tokens are 0 when the engines likely hold the request's context
    already (nothing to read ahead). None: no engine has the room (or nothing is stored)."""
    if config.kv_path == "oracle" or request.stored_tokens == 0 or not pes or not des:
        return None
    pe = pick_prefill_engine(pes, queues, config) or min(pes, key=lambda e: e.tok)
    de = min(des, key=lambda e: (queues[e.node], e.tok))
    ids = (pe.engine_id, de.engine_id)
    path = choose_read_path(config.kv_path, request, queues[pe.node], queues[de.node], pe.node == de.node, *ids)
    options: list[tuple[EngineLoad, ReadPath]] = [(pe, "pe"), (de, "de")] if path == "pe" else [(de, "de"), (pe, "pe")]
    if config.kv_path == "basic" or pe.node == de.node:
        options = [(pe, "pe")]
    for engine, p in options:
        tokens = read_tokens(request, p, *ids)
        if room.get(engine.engine_id, 0) >= tokens:
            return engine, p, tokens
    return None


@dataclass(frozen=True)
class ReadAhead:
    """A waiting request's stored KV (``read_tokens``) to be read into ``engine_id``'s host memory now, for the
    ``read_path`` it will then be placed on."""

    request_id: str
    engine_id: str
    read_path: ReadPath
    read_tokens: int


def plan_prefetches(
    queue: Sequence[PendingRequest],
    loads: Sequence[EngineLoad],
    room: Mapping[str, int],
    config: PDSchedulerConfig,
) -> tuple[tuple[ReadAhead, ...], dict[str, int]]:
    """Reads ahead for requests still waiting for a placement, in FIFO order (those placed next first), each on
    :func:`prefetch_target`'s engine, while engines have prefetch room (``room``: tokens of host memory each may
    hold for requests not placed yet); requests already prefetched, or whose context the engines likely hold
    already, are skipped, and the first that fits nowhere ends the round (its room goes to it as soon as there is
    some). Each read joins its node's queue before the next is decided, as a placement's does. Returns the
    prefetches and the node read queues with them."""
    queues: dict[str, int] = {}
    for e in loads:
        queues[e.node] = max(queues.get(e.node, 0), e.read_queue)
    left = dict(room)
    pes = [e for e in loads if e.role == "prefill"]
    des = [e for e in loads if e.role == "decode"]
    out: list[ReadAhead] = []
    for request in queue:
        if request.prefetched_on is not None or request.stored_tokens == 0:
            continue
        target = prefetch_target(request, pes, des, queues, left, config)
        if target is None:
            break
        engine, path, tokens = target
        if tokens == 0:
            continue  # in memory where it would be read: nothing to read ahead, and no room to hold
        left[engine.engine_id] -= tokens
        queues[engine.node] += tokens
        out.append(ReadAhead(request.request_id, engine.engine_id, path, tokens))
    return tuple(out), queues


# -- a round --------------------------------------------------------------------------------------


def _placed_on(engine: EngineLoad, num_tokens: int) -> EngineLoad:
    """The engine's load with a request of ``num_tokens`` placed on it: one more request, its tokens, and their KV
    taken from its free room (a PE holds the prompt until the handoff, a DE the request while it decodes)."""
    free = engine.kv_free_tokens - num_tokens if engine.kv_free_tokens is not None else None
    return dataclasses.replace(engine, seq=engine.seq + 1, tok=engine.tok + num_tokens, kv_free_tokens=free)


def schedule(queue: Sequence[PendingRequest], loads: Sequence[EngineLoad], config: PDSchedulerConfig) -> ScheduleResult:
    """Place the queue's requests in FIFO order on a PE and a DE each, with their read paths, until one
    finds no PE or no DE. ``loads`` holds the latest report of every live engine. The queue is read in order, as
    far as the round goes (and whole for a DE group's Z): a dispatcher may make its requests as they are read."""
    state = {e.engine_id: e for e in loads}
    order = [e.engine_id for e in loads]
    queues: dict[str, int] = {}
    for e in loads:  # engines of a node report one queue; reports a moment apart may differ: keep the longest
        queues[e.node] = max(queues.get(e.node, 0), e.read_queue)
    # Each DE group's Z, from the loads before any placement: made for a group when a request first goes there (a
    # pass over the queue per group; most calls place one request, or none).
    z_by_group: dict[str, float] = {}
    placements: list[Placement] = []
    for request in queue:
        pes = [state[i] for i in order if state[i].role == "prefill"]
        des = [state[i] for i in order if state[i].role == "decode"]
        pe = pick_prefill_engine(pes, queues, config, request.num_tokens)
        group = pick_decode_group(des, request.num_tokens)
        if pe is None or group is None:
            break
        members = [de for de in des if de.group == group]
        if config.z is not None:
            z = float(config.z)
        else:
            if group not in z_by_group:
                before = [e for e in loads if e.role == "decode" and e.group == group]
                z_by_group[group] = high_token_threshold(before, (r.num_tokens for r in queue))
            z = z_by_group[group]
        de = pick_decode_engine(members, request.num_tokens, z)
        assert de is not None  # the group was chosen for having a DE with room
        pe, de, prefetched = honor_prefetch(request, pe, de, pes, des, queues, config)
        if prefetched is not None:  # its read is under way (or done) there: no second read, no new queueing
            path, read_node, tokens = prefetched, (pe if prefetched == "pe" else de).node, 0
        else:
            ids = (pe.engine_id, de.engine_id)
            path = choose_read_path(config.kv_path, request, queues[pe.node], queues[de.node], pe.node == de.node, *ids)
            read_node = {"pe": pe.node, "de": de.node, "none": None}[path]
            tokens = read_tokens(request, path, *ids)
        if read_node is not None:
            queues[read_node] += tokens
        state[pe.engine_id] = _placed_on(pe, request.num_tokens)
        state[de.engine_id] = _placed_on(de, request.num_tokens)
        placements.append(Placement(request.request_id, pe.engine_id, de.engine_id, path, read_node, tokens))
    return ScheduleResult(tuple(placements), queue, state, queues)
