"""Per-request block tables on top of the tiers' block pools, with prefix-cache lookups across tiers.

The scheduler talks to this class only; it never touches blocks, just learns whether slots could be
allocated, how many prompt tokens a prefix-cache hit saves, and which moves between tiers a decision takes.

Tiers below the device are caches of named blocks. A full block evicted from the device (an allocation
reuses a free cached block) goes down to host memory instead of vanishing: a device-to-host transfer,
which the executor runs before anything of the step overwrites the device block. A block evicted from
host memory goes to the disk store under write-back. A prefix lookup finds the longest prefix across the
tiers: each leading block on the device, else in host memory; a request whose blocks follow on disk has
them loaded into host memory first, in the background, while it waits (:meth:`plan_disk_read`). Every
move is decided here, in order, as plain data (``kv/transfer.py``, ``kv/disk_moves.py``); the executor
does the copies and the I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from boundless.attention.backend import RemoteKV, window_start
from boundless.kv.block_hash import BlockHash, extend_block_hashes
from boundless.kv.block_pool import BlockPool, KVBlock, find_held, find_run
from boundless.kv.disk_moves import DiskAge, DiskRead, DiskReadDone, DiskWrite, DiskWriteDone
from boundless.kv.events import MEDIUM_HOST, KVEventLog, LoraTag
from boundless.kv.eviction import FINISHED, ProgramKeys, ProgramRanking, order_factory
from boundless.kv.remote_moves import RemoteRecv, RemoteRecvCount, RemoteRecvDone, RemoteSendDone
from boundless.kv.transfer import DEVICE, DISK, HOST, PEER, BlockRef, BlockTransfer, TierId

WRITE_POLICIES = ("through", "back", "off")
# Names the manager remembers the store to hold (what it wrote or found); beyond this, the oldest are forgotten
# and found again by a probe.
MAX_KNOWN_ON_DISK = 1 << 20
# The share of host memory that blocks loaded ahead for waiting requests may hold.
PREFETCH_SHARE = 0.5
# Times a waiting request reads its prefix again after part of it left memory before its turn (then computes).
MAX_RELOADS = 2
# The share of device memory that the prefixes of requests waiting for loads may hold (see plan_disk_read).
LOAD_HOLD_SHARE = 0.5
# Program-aware eviction on disk: how far back the store's LRU stamp of a block is set once every program that
# used it has finished. A day puts it behind every block touched within the last day, by any process sharing
# the store, and keeps the LRU order among aged blocks.
DISK_AGE_S = 24 * 3600.0
# Reads ahead for calls not here yet (plan_prefetch_reads) go to the store in chunks of at most this many blocks, at
# most this many at a time: the store's loader reads in order, so a read a request placed here needs now (an agent's
# next turn: a few blocks) waits behind at most that much read-ahead, not behind every call's context queued ahead
# (at 0.2 Gbit/s, 8 blocks of SmolLM2-135M are 0.23 s; a first context, ~31 blocks, 0.9 s). Two keep the link busy
# between the engine's steps, which start the next chunk.
PREFETCH_READ_BLOCKS = 8
PREFETCH_READS_IN_FLIGHT = 2
# The owner of a read whose call was dropped while it was in flight: no request has this id, so its blocks land as
# cache for nobody.
_NOBODY = "\0nobody"


@dataclass
class CachedPrefix:
    """Blocks found for a request's leading tokens: ``blocks[i]`` sits in tier ``tiers[i]`` (device or host
    memory); ``origins[i]`` is where its KV was found (``disk`` for a host block loaded ahead of the request,
    ``peer`` for one another instance sent). ``skipped``: leading blocks an admission does not take, the window of
    the request's next token past them (``KVCacheManager.window_prefix``)."""

    blocks: list[KVBlock] = field(default_factory=list)
    tiers: list[TierId] = field(default_factory=list)
    origins: list[TierId] = field(default_factory=list)
    block_size: int = 0
    skipped: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    def taken(self) -> tuple[list[KVBlock], list[TierId]]:
        """The blocks an admission takes (past ``skipped``) and their tiers: the lists themselves when none is
        skipped."""
        if not self.skipped:
            return self.blocks, self.tiers
        return self.blocks[self.skipped :], self.tiers[self.skipped :]

    def tokens_by_origin(self, limit: int | None = None) -> dict[TierId, int]:
        """The prefix's tokens by the tier each block came from; of its first ``limit`` tokens only, if given."""
        bs, origins = self.block_size, self.origins
        # The blocks wholly within the limit.
        whole = len(origins) if limit is None else max(0, min(len(origins), limit // bs))
        counted = origins[:whole]
        # (Counted a tier at a time, in the order the tiers first come: most prefixes come from one tier.)
        out = {origin: counted.count(origin) * bs for origin in dict.fromkeys(counted)}
        if limit is not None and whole < len(origins) and limit > whole * bs:  # a block the limit cuts
            out[origins[whole]] = out.get(origins[whole], 0) + limit - whole * bs
        return out


@dataclass
class TierCounters:
    """One tier's traffic, in blocks (cumulative)."""

    blocks_read: int = 0  # copied out of the tier
    blocks_written: int = 0  # copied into the tier
    evictions: int = 0  # named blocks whose name an allocation dropped (after moving them down, when it could)
    load_timeouts: int = 0  # reads from the tier that a request stopped waiting for (stuck storage)
    # Stored blocks computed instead of read, by why (disk tier only): ``no_host_room`` (known stored, no host
    # room to load them when the request was admitted), ``unwaited_probe`` (found by a probe the request did not
    # wait for), ``load_timeout`` (loaded too late), ``evicted_before_admission`` (loaded, or in memory when the
    # request arrived, then evicted before its turn), ``load_came_back_short`` (known stored, but missing or
    # unreadable when loaded).
    recomputed_blocks: dict[str, int] = field(default_factory=dict)
    # Stored blocks read a second time (disk tier only): a waiting request's prefix left memory before its turn
    # and was read again (not recomputed, so not in ``recomputed_blocks``).
    reloaded_blocks: int = 0


@dataclass
class _ReadJob:
    request_id: str
    start: int  # index of the first block read
    read: DiskRead
    tokens: tuple[tuple[int, ...], ...]  # each block's token ids, to name a loaded block
    started_at: float = 0.0  # on the scheduler's clock
    timed_out: bool = False  # in flight past the load timeout: nobody waits for it any more


@dataclass
class _DiskLookup:
    """A waiting request's progress through the disk store."""

    in_flight: int | None = None  # its read in flight
    waits: bool = False  # whether it waits for that read (a probe behind a prefix in memory does not)
    disk_end: int | None = None  # first block index the store is known to lack (for this request's blocks)
    probed_at: int | None = None
    loaded_upto: int = 0  # end of the blocks its last load brought into host memory
    settled: bool = False  # nothing more to read for it
    limit: int | None = None  # reads stop before this block (blocks from there on come from a peer)
    room_short: int = 0  # stored blocks its last plan could not load for want of host room (0: none)
    room_short_from: int = 0  # the first of them
    arrival_prefix: int = 0  # leading blocks memory held when it arrived (stored too, unless writes are off)
    counted_from: int | None = None  # the lowest block counted in recomputed_blocks for it (counts run upwards)
    arrival_lost: tuple[int, int] = (0, 0)  # blocks [first, end) of its arrival prefix counted at its admission
    reloads: int = 0  # times its loaded prefix was read again after leaving memory before its turn
    keep: int = 0  # free host blocks of its own prefix that plan had to keep (a load may not evict them)
    admitted: bool = False  # admitted: blocks a read finds from now on were computed instead
    push_span: tuple[int, int] | None = None  # blocks [first, end) to load for a DE-read push, not yet started
    prefetch_span: tuple[int, int] | None = None  # blocks [first, end) to read ahead for a call not here yet


@dataclass
class _Intake:
    """Host blocks reserved for a stream of blocks from a peer (``kv/remote_moves.py``): blocks ``first`` on of
    ``request_id``'s tokens. The stream owns them until it is reported; they are named when they land."""

    request_id: str | None  # None once the request is gone: what lands is still named, as cache
    first: int
    blocks: list[KVBlock]
    keys: tuple[BlockHash, ...]
    tokens: tuple[tuple[int, ...], ...]
    # A counted-first stream (a DE-read push under --layerwise-load on) whose count came whole: the blocks named then,
    # each held for the request too; its request runs while the layers land (copied as the forward pass reaches
    # each). The stream still owns every block until it is reported; a failed one takes these names back.
    named_early: list[KVBlock] | None = None


@dataclass(frozen=True)
class LentSpan:
    """Blocks of a request moved to another instance (KV lending): ``num_blocks`` of them, held by ``creditor``
    under ``move_id``."""

    creditor: str
    move_id: str
    num_blocks: int


class KVCacheManager:
    """Owns every tier's block pool and every request's block table.

    A request's KV sits in one tier: on the device while it can run, in host memory while it is swapped
    out. Named blocks also stay below the device as a cache: evicted from the device to host memory, from
    host memory to the disk store (``write_policy`` back), or written to the store as soon as computed
    (``through``). With ``disk`` the store is a tier (only read with ``off``). Without ``host_caching``, host
    memory holds swapped-out requests only (the device-only baseline).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        fingerprint: str,
        num_host_blocks: int = 0,
        disk: bool = False,
        write_policy: str = "through",
        host_caching: bool = True,
        ranking: ProgramRanking | None = None,
        load_timeout_s: float = math.inf,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}")
        self.block_size = block_size
        self.fingerprint = fingerprint
        # With a ranking, every tier evicts by program (kv/eviction.py); else by recency alone.
        self.ranking = ranking
        order = order_factory(ranking)
        self.pool = BlockPool(
            num_blocks, enable_caching=enable_prefix_caching, on_evict=self._demote_from_device, order=order
        )
        # Every memory tier's pool: the device first, then the tiers a swap-out tries in turn.
        self.pools: dict[TierId, BlockPool] = {DEVICE: self.pool}
        if num_host_blocks > 0:
            self.pools[HOST] = BlockPool(
                num_host_blocks,
                enable_caching=enable_prefix_caching and host_caching,
                on_evict=self._demote_from_host,
                order=order,
                medium=MEDIUM_HOST,
            )
        # Where a prefix is looked for: each block on the device, else in host memory.
        self._memory_tiers = [t for t in (DEVICE, HOST) if t in self.pools]
        self._memory_pools = [self.pools[t] for t in self._memory_tiers]
        self.has_disk = disk and HOST in self.pools and self.pools[HOST].enable_caching
        self.write_policy = write_policy if self.has_disk else "off"
        self.load_timeout_s = load_timeout_s
        self.counters: dict[TierId, TierCounters] = {t: TierCounters() for t in (*self.pools, DISK, PEER)}
        # Looked up once for demotions (one per named block a device allocation reuses): host memory if it keeps
        # evicted blocks, the device's counters, and who owns a device block.
        self._host_cache = self.pools[HOST] if HOST in self.pools and self.pools[HOST].enable_caching else None
        self._device_counters = self.counters[DEVICE]
        self._device_owners = self.pool.order.owners
        self._swapped: dict[str, tuple[TierId, list[KVBlock]]] = {}
        # Blocks below the device that this step's transfers read or write: held until the step's copies are
        # done (freed by begin_step), so that no other move of the same step takes one and overwrites it.
        self._held: list[tuple[TierId, list[KVBlock]]] = []
        # The host copies the latest demotions made, while they are the last blocks held: the next one joins them
        # (freed in the same order, in one call).
        self._demoted: list[KVBlock] = []
        self._transfers: list[BlockTransfer] = []  # this step's, in the order decided
        self._tables: dict[str, list[KVBlock]] = {}
        # Each table's block ids, kept as the table grows (tables only grow, or are replaced whole): a decode step
        # asks for them every step, and rebuilding them was O(context) per request per step.
        self._table_ids: dict[str, tuple[list[KVBlock], list[int]]] = {}
        # KV lending: a request's leading blocks that live on other instances, in order. Its table then holds its
        # blocks from the first local one on (block index ``sum of num_blocks``).
        self._lent: dict[str, list[LentSpan]] = {}
        self._dropped_lent: list[tuple[str, list[LentSpan]]] = []
        # Sliding windows (``release_outside_window``): the window of every layer, when all of them slide, and each
        # request's leading blocks given back because they have left it (they come before its first local one).
        self.window: int | None = None
        self._released: dict[str, int] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        # Each request's full blocks' tokens, a tuple a block, made once (_block_tokens): lookups compare them with
        # cached blocks' (a waiting request's store plan looks its prefix up every step), named blocks keep them.
        self._tokens: dict[str, list[tuple[int, ...]]] = {}
        # A program's latest request's names and blocks' tokens, as it freed them: (fingerprint, names, tokens) by
        # program, a pool's worth of blocks at most in all (the oldest programs' go first). Its next call (a chat
        # sends its conversation again) takes the names of the leading blocks it shares with them, unhashed.
        self._program_names: dict[str, tuple[str, list[BlockHash], list[tuple[int, ...]]]] = {}
        self._program_names_blocks = 0
        self._num_named: dict[str, int] = {}
        # The disk store.
        self._known_on_disk: OrderedDict[BlockHash, None] = OrderedDict()
        self._writes_pending: set[BlockHash] = set()
        self._writes: list[tuple[TierId, int, BlockHash]] = []  # this step's, in the order decided
        # Device blocks named while a step is decided: its forward pass (or copies) fills them; written through
        # to the store when the next step begins.
        self._filled_by_step: list[tuple[KVBlock, BlockHash]] = []
        # Write-back at a stop: the next step queues every named block in memory for the store (write_back_all).
        self._write_back_all = False
        self._reads: dict[int, _ReadJob] = {}
        self._lookups: dict[str, _DiskLookup] = {}
        # Host blocks whose KV came from below or beside (disk, peer) and were not used yet: a hit on one counts
        # for that origin.
        self._origins: dict[int, TierId] = {}
        # Host blocks loaded for a request that still waits, by block id: held for it until its admission (so that
        # evictions down from the device do not undo the load before its turn), and at most half of host memory,
        # so that the queue's prefetches leave room for swap and for the cache.
        self._prefetched: dict[int, str] = {}
        self._next_read_id = 0
        # Streams between instances. Incoming: host blocks reserved per receive; outgoing: blocks held (a reference
        # each, in their tier) per send, until the executor reports the stream. Device blocks a request that has
        # not arrived yet will hit (a decode engine keeps them for a handoff) are held for it until its admission.
        self._intakes: dict[int, _Intake] = {}
        self._recvs: list[RemoteRecv] = []  # to post at the next step
        self._sends: dict[int, list[tuple[TierId, KVBlock]]] = {}
        self._held_for: dict[str, list[tuple[TierId, KVBlock]]] = {}
        # The memory prefix (device and host blocks before the first one loaded) of a request whose load from the
        # store is under way, held for it until its admission: were it evicted meanwhile (other requests' prefills,
        # with host memory full of loads), the request would read it again (plan_disk_read).
        self._held_while_loading: dict[str, list[tuple[TierId, KVBlock]]] = {}
        self._next_remote_id = 0
        # DE-read pushes go counted first and are used as they land (``--layerwise-load on``; both sides alike).
        self.layerwise_receive = False
        # Reads ahead for calls that have not arrived (a dispatcher's prefetch), in the order asked: each one's tokens
        # (as far as the store holds them). Its lookup is the call's own (same request id), so what it loaded is held
        # for the call like its own loads (``_prefetched``) until its admission, and a read still in flight when it
        # arrives is one it waits for.
        self._prefetch_tokens: dict[str, tuple[int, ...]] = {}
        # Which program each request belongs to: the owner of the blocks it takes (program-aware eviction).
        self._programs: dict[str, str] = {}
        self._namespaces: dict[str, str] = {}  # request id -> the fingerprint naming its blocks (``set_namespace``)
        self._loras: dict[str, LoraTag] = {}  # request id -> the adapter computing its KV (for the events)
        self.events: KVEventLog | None = None  # where the pools tell the names they give and drop (enable_events)
        # Program-aware eviction on disk: the names each followed program's requests used, and how many followed
        # programs used each name; a name no program still alive uses is aged in the store (it goes first).
        self._disk_keys = ProgramKeys(ranking) if ranking is not None and self.has_disk else None
        self._names_of: dict[str, set[BlockHash]] = {}
        self._name_users: dict[BlockHash, int] = {}
        self._ages: list[BlockHash] = []

    def set_program(self, request_id: str, program_id: str) -> None:
        """The request belongs to this program (until :meth:`end_request`): its blocks are the program's. The
        blocks of a request of no program belong to nobody: under program-aware eviction they rank with those of
        finished programs (no later call can be known to need them), LRU among them."""
        self._programs[request_id] = program_id

    def set_namespace(self, request_id: str, fingerprint: str, lora: LoraTag | None = None) -> None:
        """Name the request's blocks with ``fingerprint`` instead of the model's (until :meth:`end_request`): KV
        computed with other weights (a LoRA adapter's, ``lora``) is shared only among requests with the same."""
        self._namespaces[request_id] = fingerprint
        if lora is not None:
            self._loras[request_id] = lora

    def enable_events(self, log: KVEventLog) -> None:
        """Tell ``log`` every name the memory tiers give and drop from now on, and each reset (``kv/events.py``)."""
        self.events = log
        for pool in self.pools.values():
            pool.events = log

    def end_request(self, request_id: str) -> None:
        """The request is done (finished or aborted): free its blocks and forget its program."""
        self.free(request_id)
        self._programs.pop(request_id, None)
        self._namespaces.pop(request_id, None)
        self._loras.pop(request_id, None)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's local blocks: from block :meth:`first_local_block` on (a new list, the caller's)."""
        table = self._tables.get(request_id)
        if table is None:
            return []
        kept = self._table_ids.get(request_id)
        if kept is None or kept[0] is not table or len(kept[1]) > len(table):
            kept = self._table_ids[request_id] = (table, [])
        ids = kept[1]
        if len(ids) < len(table):
            ids.extend(b.block_id for b in table[len(ids) :])
        return list(ids)

    # -- KV lending: leading blocks on other instances ---------------------------------------------------------

    def num_lent_blocks(self, request_id: str) -> int:
        """How many of the request's leading blocks live on other instances."""
        spans = self._lent.get(request_id)
        return sum(span.num_blocks for span in spans) if spans else 0

    def first_local_block(self, request_id: str) -> int:
        """The index of the request's first local block: past its blocks released outside the window
        (:meth:`release_outside_window`) and those on other instances (:meth:`num_lent_blocks`)."""
        released = self._released.get(request_id, 0) if self._released else 0
        return released + self.num_lent_blocks(request_id) if self._lent else released

    def release_outside_window(self, request_id: str, num_computed: int) -> int:
        """Give back the request's leading blocks that have left the sliding window of every layer (``window``): a
        query at ``num_computed`` or later sees no key before ``num_computed - window + 1``, so no later step reads
        them. They keep their names, as cache, like any freed block; the request's table then starts past them (as it
        does past lent blocks). Not a request with blocks on other instances, and never its last local block.
        Returns how many blocks went."""
        if self.window is None or request_id in self._lent:
            return 0
        table = self._tables.get(request_id)
        if not table:
            return 0
        released = self._released.get(request_id, 0)
        count = min(self._blocks_before_window(num_computed) - released, len(table) - 1)
        if count > 0 and self._transfers:
            # Not a block this step's copies still write (a prefix hit from host memory, a swap-in): freed now, another
            # allocation of the step could take it, and two copies would write it.
            incoming = {t.dst.block_id for t in self._transfers if t.dst.tier == DEVICE}
            count = next((i for i in range(count) if table[i].block_id in incoming), count)
        if count <= 0:
            return 0
        gone, self._tables[request_id] = table[:count], table[count:]
        self.pool.free(reversed(gone))
        self._released[request_id] = released + count
        return count

    def window_prefix(self, prefix: CachedPrefix) -> CachedPrefix:
        """``prefix`` with its leading blocks that the window of the request's next token has left skipped (a model
        whose every layer slides, ``window``): its admission takes the rest, and its table starts past them, as if
        given back (:meth:`release_outside_window`). The last block is always taken."""
        if self.window is None or not prefix.blocks:
            return prefix
        skip = min(self._blocks_before_window(prefix.num_tokens), len(prefix.blocks) - 1)
        return dataclasses.replace(prefix, skipped=skip) if skip > prefix.skipped else prefix

    def _blocks_before_window(self, position: int) -> int:
        """The blocks wholly before the window of a query at ``position`` (and of every later one)."""
        return window_start(position, self.window) // self.block_size

    def remote_prefix(self, request_id: str) -> tuple[int, tuple[RemoteKV, ...]]:
        """The request's first local block index (:meth:`first_local_block`), and its remote blocks grouped by
        creditor (for attention), with where each move's keys lie among the remote ones (a sliding window reads it)."""
        spans = self._lent.get(request_id)
        if not spans:
            return self.first_local_block(request_id), ()
        by_creditor: dict[str, list[tuple[LentSpan, int]]] = {}
        at = 0
        for span in spans:
            by_creditor.setdefault(span.creditor, []).append((span, at))
            at += span.num_blocks * self.block_size
        bs = self.block_size
        remote = tuple(
            RemoteKV(
                c, tuple(s.move_id for s, _ in group), sum(s.num_blocks for s, _ in group) * bs,
                tuple((first, s.num_blocks * bs) for s, first in group),
            )
            for c, group in by_creditor.items()
        )  # fmt: skip
        return self.first_local_block(request_id), remote

    def lend_leading_blocks(self, request_id: str, span: LentSpan) -> None:
        """The request's next ``span.num_blocks`` blocks (its first local ones, all full and computed) now live on
        ``span.creditor``: free the local copies (full blocks keep their names here, as cache)."""
        table = self._tables[request_id]
        if span.num_blocks >= len(table):
            raise ValueError("a move may not take a request's last local block (new KV is written there)")
        moved, self._tables[request_id] = table[: span.num_blocks], table[span.num_blocks :]
        self.pool.free(reversed(moved))
        self._lent.setdefault(request_id, []).append(span)

    def take_dropped_lent(self, request_id: str | None = None) -> list[tuple[str, list[LentSpan]]]:
        """Remote blocks of requests freed since the last call (finished, aborted, preempted to recompute), of
        every request or of ``request_id``: their creditors may free them."""
        out = [d for d in self._dropped_lent if request_id is None or d[0] == request_id]
        self._dropped_lent = [d for d in self._dropped_lent if request_id is not None and d[0] != request_id]
        return out

    def allocate_unowned(self, count: int) -> list[int] | None:
        """``count`` device blocks outside any request (a creditor's blocks lent to a debtor), or None.

        A named block taken is dropped, not demoted to host memory: a demotion is a copy the executor makes at the
        next step's start, but a debtor's blocks are written into these at once, between steps (the copy would keep
        the debtor's KV under the evicted block's name, and a later prefix hit would read it)."""
        if self.pool.num_free < count:
            return None
        evictions = self.pool.stats.evictions
        ids = [b.block_id for b in self.pool.allocate(count, keep_evicted=False)]
        self._device_counters.evictions += self.pool.stats.evictions - evictions
        return ids

    def free_unowned(self, block_ids: Sequence[int]) -> None:
        self.pool.free([self.pool.blocks[i] for i in reversed(block_ids)])

    def name_unowned(self, request_id: str, block_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        """Name unowned device blocks, received from another instance, as the request's leading full blocks
        of ``token_ids`` in the prefix cache, as if computed here: its admission finds them as a prefix hit."""
        bs = self.block_size
        hashes = self.block_hashes(request_id, token_ids[: len(block_ids) * bs])
        for i, block_id in enumerate(block_ids):
            parent = hashes[i - 1] if i > 0 else None
            self.pool.cache(self.pool.blocks[block_id], hashes[i], token_ids[i * bs : (i + 1) * bs], parent)

    def num_allocated_blocks(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def block_hashes(self, request_id: str, token_ids: Sequence[int], num_tokens: int | None = None) -> list[BlockHash]:
        """The names of the request's full blocks of ``token_ids`` (its first ``num_tokens``), kept for the request:
        each block is hashed once. The list may name more blocks than asked for (named by an earlier call)."""
        hashes = self._hashes.setdefault(request_id, [])
        return extend_block_hashes(hashes, token_ids, self.block_size, self._fingerprint(request_id), num_tokens)

    def _fingerprint(self, request_id: str) -> str:
        """What the request's blocks' names are made with: its namespace's, else the model's."""
        return self._namespaces.get(request_id, self.fingerprint) if self._namespaces else self.fingerprint

    def _keep_program_names(self, request_id: str, hashes: list[BlockHash], tokens: list[tuple[int, ...]]) -> None:
        """Keep a freed request's names and blocks' tokens for its program's next request (:meth:`_program_names`)."""
        program = self._programs.get(request_id)
        if program is None:
            return
        kept = self._program_names
        old = kept.pop(program, None)
        if old is not None:
            self._program_names_blocks -= len(old[1])
        num = min(len(hashes), len(tokens))
        kept[program] = (self._fingerprint(request_id), hashes[:num], tokens[:num])
        self._program_names_blocks += num
        while self._program_names_blocks > self.pool.num_blocks:
            self._program_names_blocks -= len(kept.pop(next(iter(kept)))[1])

    def _taken_program_names(self, request_id: str, tokens: list[tuple[int, ...]]) -> list[BlockHash]:
        """The names of the request's leading blocks (``tokens``, its blocks' tokens) that its program's latest
        request had, with the same tokens and fingerprint (a name is its whole prefix's tokens' and the fingerprint's:
        the same blocks, the same names). Its tokens take the kept tuples (equal), so that a block the latest request
        named is known by identity in a lookup."""
        kept = self._program_names.get(self._programs.get(request_id, ""))
        if kept is None or kept[0] != self._fingerprint(request_id):
            return []
        _, names, kept_tokens = kept
        num = min(len(names), len(tokens))
        if tokens[:num] != kept_tokens[:num]:  # (a compacted conversation)
            num = next(i for i in range(num) if tokens[i] != kept_tokens[i])
        tokens[:num] = kept_tokens[:num]
        return names[:num]

    def find_cached_prefix(self, request_id: str, token_ids: Sequence[int]) -> CachedPrefix:
        """The longest run of leading full blocks in memory: each on the device, else in host memory.

        At least one token is always left to compute, so the step that admits the request
        produces its next-token logits.
        """
        prefix = CachedPrefix(block_size=self.block_size)
        if not self.pool.enable_caching:
            return prefix
        max_blocks = (len(token_ids) - 1) // self.block_size
        tokens = self._block_tokens(request_id, token_ids, max_blocks)
        if request_id not in self._hashes and self._program_names:  # (its first lookup)
            self._hashes[request_id] = self._taken_program_names(request_id, tokens)
        hashes = self.block_hashes(request_id, token_ids)
        prefix.blocks, prefix.tiers = self._memory_run(hashes, tokens, 0, max_blocks, count=True)
        if HOST in prefix.tiers:
            prefix.origins = [
                self._origins.get(block.block_id, HOST) if tier == HOST else tier
                for block, tier in zip(prefix.blocks, prefix.tiers, strict=True)
            ]
        else:  # (all on the device, where a block's origin is its tier)
            prefix.origins = list(prefix.tiers)
        return prefix

    def _block_tokens(self, request_id: str | None, token_ids: Sequence[int], num_blocks: int) -> list[tuple[int, ...]]:
        """The tokens of each of the first ``num_blocks`` full blocks of ``token_ids``, kept for the request (made once
        a block) unless ``request_id`` is None. The list may hold more blocks than asked for."""
        kept = [] if request_id is None else self._tokens.setdefault(request_id, [])
        if len(kept) < num_blocks:
            bs = self.block_size
            kept += [tuple(token_ids[i * bs : (i + 1) * bs]) for i in range(len(kept), num_blocks)]
        return kept

    def _memory_run(
        self,
        hashes: Sequence[BlockHash],
        block_tokens: Sequence[tuple[int, ...]],
        first: int,
        end: int,
        count: bool = False,
    ) -> tuple[list[KVBlock], list[TierId]]:
        """The leading run of full blocks ``first`` to ``end`` (block ``i`` named ``hashes[i]``, holding
        ``block_tokens[i]``) that memory holds, each on the device, else in host memory: the blocks and their tiers.
        ``count``: looked up as a prefix lookup is (the pools count the queries and hits), else peeked at."""
        blocks, where = find_run(self._memory_pools, hashes, block_tokens, first, end, count=count)
        tiers = self._memory_tiers
        return blocks, [tiers[k] for k in where]

    def blocks_short(self, request_id: str, num_tokens_after: int, prefix: CachedPrefix | None = None) -> int:
        """How many more free blocks an allocation up to ``num_tokens_after`` tokens would need (<= 0: none)."""
        return self._blocks_short(request_id, num_tokens_after, prefix)

    def num_swapped_blocks(self, request_id: str) -> int:
        swapped = self._swapped.get(request_id)
        return len(swapped[1]) if swapped is not None else 0

    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_tokens_after: int,
        prefix: CachedPrefix | None = None,
        num_known: int | None = None,
    ) -> bool:
        """Make room for the request's KV up to ``num_tokens_after`` tokens.

        ``prefix`` (first allocation only) takes references on device hits instead of new blocks; its host
        hits get new device blocks and host-to-device transfers. Returns False, changing nothing, when the
        device pool lacks free blocks. Full blocks are named by their tokens, of ``token_ids``' first ``num_known``
        only if given (the rest are placeholders: a step decided ahead); a block left unnamed is named at a later
        allocation.
        """
        if prefix is None and self._within_blocks(request_id, num_tokens_after):
            return True
        if self._blocks_short(request_id, num_tokens_after, prefix) > 0:
            return False
        owner = self._programs.get(request_id)
        table = self._tables.setdefault(request_id, [])
        if prefix is not None and prefix.blocks:
            assert not table, "a cached prefix is only taken on the first allocation"
            on_device = self._on_device(prefix)
            blocks, tiers = prefix.taken()
            if prefix.skipped:  # (the window's: the request's table starts past them)
                self._released[request_id] = prefix.skipped
                for b, t in zip(prefix.blocks[: prefix.skipped], prefix.tiers, strict=False):
                    if t == HOST:  # (found, not read: a later hit on one counts for its tier, not its origin)
                        self._origins.pop(b.block_id, None)
            in_host: list[KVBlock] = []
            if HOST in tiers:
                in_host = [b for b, t in zip(blocks, tiers, strict=True) if t == HOST]
            # Both kinds of hit are held before any new block is taken, so that no eviction this allocation
            # causes (and no demotion that follows from it) reuses a block of the prefix.
            self.pool.touch(on_device, owner)
            if not in_host:
                table += blocks
            else:
                self.pools[HOST].touch(in_host, owner)
                self._held.append((HOST, in_host))
                for b in in_host:
                    self._origins.pop(b.block_id, None)
                fresh = iter(self.pool.allocate(len(in_host), owner))
                for block, tier in zip(blocks, tiers, strict=True):
                    if tier == DEVICE:
                        table.append(block)
                    else:
                        dst = next(fresh)
                        self._move(BlockRef(HOST, block.block_id), BlockRef(DEVICE, dst.block_id))
                        table.append(dst)
        num_new = self.blocks_for_tokens(num_tokens_after) - len(table) - self.first_local_block(request_id)
        if num_new > 0:
            table.extend(self.pool.allocate(num_new, owner))
        self._name_full_blocks(request_id, token_ids, num_tokens_after if num_known is None else num_known)
        if self._prefetched:
            self._drop_prefetched(request_id)  # admitted: its hits hold their own references now
        self._release_held_for(request_id)
        self._release_held_while_loading(request_id)
        return True

    def _within_blocks(self, request_id: str, num_tokens_after: int) -> bool:
        """Whether an allocation up to ``num_tokens_after`` tokens has nothing to do: the request's blocks hold them,
        no block becomes full (to be named), and nothing is lent, held or prefetched anywhere. Most decode steps of a
        running request: checked first, since the engine asks it of every request every step."""
        table = self._tables.get(request_id)
        return (
            table is not None
            and num_tokens_after <= (len(table) + self.first_local_block(request_id)) * self.block_size
            and (
                not self.pool.enable_caching
                or num_tokens_after // self.block_size <= self._num_named.get(request_id, 0)
            )
            and not (self._lent or self._held_for or self._held_while_loading or self._prefetched)
        )

    def free(self, request_id: str) -> None:
        """Release a request's blocks (tail first, so its tail is evicted first) and forget it."""
        if self._disk_keys is not None:
            self._note_names(request_id)
        table = self._tables.pop(request_id, [])
        self._table_ids.pop(request_id, None)
        self.pool.free(reversed(table))
        lent = self._lent.pop(request_id, None)
        if lent:
            self._dropped_lent.append((request_id, lent))
        self._released.pop(request_id, None)
        swapped = self._swapped.pop(request_id, None)
        if swapped is not None:
            tier, blocks = swapped
            self.pools[tier].free(reversed(blocks))
        hashes = self._hashes.pop(request_id, None)
        tokens = self._tokens.pop(request_id, None)
        if hashes and tokens:
            self._keep_program_names(request_id, hashes, tokens)
        self._num_named.pop(request_id, None)
        self._lookups.pop(request_id, None)
        self._drop_prefetched(request_id)
        self._release_held_for(request_id)
        self._release_held_while_loading(request_id)
        for intake in self._intakes.values():
            if intake.request_id == request_id:
                intake.request_id = None  # the stream still owns its blocks until it is reported

    def reset_prefix_cache(self) -> None:
        """Drop every name in memory (device and host); the disk store keeps its blocks."""
        for pool in self.pools.values():
            pool.reset_prefix_cache()
        self._origins.clear()
        if self.events is not None:
            self.events.cleared()

    # -- moves between tiers ------------------------------------------------------------------

    def begin_step(self) -> None:
        """Start deciding a step: the last step's copies have run, so the blocks below the device they read or
        wrote are released, and the device blocks it computed are queued for the store (write-through)."""
        for tier, blocks in self._held:
            self.pools[tier].free(blocks)
        self._held = []
        self._transfers = []
        self._writes = []
        if self._disk_keys is not None:
            self._age_finished_programs()
        if self.write_policy == "through":
            for block, name in self._filled_by_step:
                if block.block_hash == name:  # still its KV (a failed step's blocks were forgotten)
                    self._queue_write(DEVICE, block.block_id, name)
        self._filled_by_step = []
        if self._write_back_all:
            self._write_back_all = False
            # Not the host blocks whose KV is still arriving: a peer's stream named early (its count came first), or
            # a disk read's. Written whole-looking, a restart would serve them.
            arriving = {b.block_id for intake in self._intakes.values() for b in intake.blocks}
            arriving.update(i for job in self._reads.values() for i in job.read.dst_ids)
            for tier in (HOST, DEVICE):  # (a block in both is written once, from host memory)
                pool = self.pools.get(tier)
                for name, block in pool.named_blocks() if pool is not None else ():
                    if not (tier == HOST and block.block_id in arriving):
                        self._queue_write(tier, block.block_id, name)

    def take_transfers(self) -> list[BlockTransfer]:
        """This step's transfers between memory tiers, in the order decided."""
        out, self._transfers = self._transfers, []
        return out

    def swap_out(self, request_id: str) -> list[BlockTransfer] | None:
        """Move a request's KV to the first tier below the device with room; returns the transfers to
        copy, or None (changing nothing) when no tier has room. The device blocks are released, keeping their
        names (still a cache); the copies below take the names too, where that tier has none for them."""
        table = self._tables.get(request_id)
        if not table:
            return None
        tier = next((t for t in list(self.pools)[1:] if self.pools[t].num_free >= len(table)), None)
        if tier is None:
            return None
        lower_pool = self.pools[tier]
        lower = lower_pool.allocate(len(table), self._programs.get(request_id))
        transfers = []
        for d, b in zip(table, lower, strict=True):
            transfers.append(self._move(BlockRef(DEVICE, d.block_id), BlockRef(tier, b.block_id)))
            if d.block_hash is not None and d.token_ids is not None:
                lower_pool.cache(b, d.block_hash, d.token_ids)
        self._swapped[request_id] = (tier, lower)
        del self._tables[request_id]
        self._table_ids.pop(request_id, None)
        self.pool.free(reversed(table))
        self._num_named.pop(request_id, None)
        return transfers

    def swap_in(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> list[BlockTransfer] | None:
        """Bring a swapped request back to the device; returns the transfers to copy, or None when device
        memory lacks room."""
        tier, lower = self._swapped[request_id]
        if self.pool.num_free < len(lower):
            return None
        device = self.pool.allocate(len(lower), self._programs.get(request_id))
        transfers = [
            self._move(BlockRef(tier, b.block_id), BlockRef(DEVICE, d.block_id))
            for b, d in zip(lower, device, strict=True)
        ]
        self._tables[request_id] = device
        del self._swapped[request_id]
        self._held.append((tier, lower))
        self._name_full_blocks(request_id, token_ids, num_computed)
        return transfers

    def holders(self, refs: Iterable[BlockRef]) -> list[str]:
        """The requests whose KV (on the device or swapped out) is in any of these blocks."""
        wanted = set(refs)
        tables = [(rid, DEVICE, t) for rid, t in self._tables.items()]
        tables += [(rid, tier, t) for rid, (tier, t) in self._swapped.items()]
        return [rid for rid, tier, table in tables if any(BlockRef(tier, b.block_id) in wanted for b in table)]

    def forget(self, refs: Iterable[BlockRef]) -> None:
        """Drop the prefix-cache names of these blocks (in any memory tier): their KV was never written."""
        for ref in refs:
            pool = self.pools.get(ref.tier)
            if pool is not None:
                pool.uncache([pool.blocks[ref.block_id]])

    def _move(self, src: BlockRef, dst: BlockRef) -> BlockTransfer:
        transfer = BlockTransfer(src, dst)
        self._transfers.append(transfer)
        self.counters[src.tier].blocks_read += 1
        self.counters[dst.tier].blocks_written += 1
        return transfer

    def _demote_from_device(self, block: KVBlock, name: BlockHash, tokens: tuple[int, ...]) -> None:
        """A device allocation reuses a named block: keep its KV in host memory, unless host memory already
        has it (then it only counts as used) or has no room (then it goes to the store under write-back).
        The copy is decided before any move that writes the block, so the executor copies it first."""
        self._device_counters.evictions += 1
        host = self._host_cache
        if host is None:
            return
        owners = self._device_owners(block.block_id)
        existing = host.peek(name, tokens)
        if existing is not None:
            host.refresh(existing)
            for owner in owners:
                host.order.own(existing.block_id, owner)
            return
        if host.num_free == 0:
            if self.write_policy == "back":
                self._queue_write(DEVICE, block.block_id, name)
            return
        (copy,) = host.allocate(1)
        for owner in owners:  # the copy belongs to the programs the device block did
            host.order.own(copy.block_id, owner)
        host.cache(copy, name, tokens)
        if self._held and self._held[-1][1] is self._demoted:
            self._demoted.append(copy)
        else:
            self._demoted = [copy]
            self._held.append((HOST, self._demoted))
        self._move(BlockRef(DEVICE, block.block_id), BlockRef(HOST, copy.block_id))

    def _demote_from_host(self, block: KVBlock, name: BlockHash, tokens: tuple[int, ...]) -> None:
        """A host allocation reuses a named block: under write-back it goes to the store first."""
        self.counters[HOST].evictions += 1
        self._origins.pop(block.block_id, None)
        if self.write_policy == "back":
            self._queue_write(HOST, block.block_id, name)

    @staticmethod
    def _on_device(prefix: CachedPrefix) -> list[KVBlock]:
        """The prefix's blocks on the device, but those skipped: all of them (the list itself) when none is in host
        memory."""
        blocks, tiers = prefix.taken()
        if HOST not in tiers:
            return blocks
        return [b for b, t in zip(blocks, tiers, strict=True) if t == DEVICE]

    def _blocks_short(self, request_id: str, num_tokens_after: int, prefix: CachedPrefix | None) -> int:
        have = len(self._tables.get(request_id, ())) + self.first_local_block(request_id)
        if prefix is None:  # a running request growing: the common case, every step
            return max(self.blocks_for_tokens(num_tokens_after) - have, 0) - self.pool.num_free
        on_device = self._on_device(prefix)
        # Hits on free cached blocks leave the free queue, so they cost free capacity too.
        revived = [b.ref_count for b in on_device].count(0)
        need = self.blocks_for_tokens(num_tokens_after) - have - prefix.skipped - len(on_device)
        return max(need, 0) + revived - self.pool.num_free

    def name_full_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Name the request's full blocks among its first ``num_tokens`` tokens (those with KV) in the prefix cache:
        after a multi-step window, whose passes filled blocks with tokens unknown when they were allocated."""
        self._name_full_blocks(request_id, token_ids, num_tokens)

    def _name_full_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        table = self._tables[request_id]
        first = self.first_local_block(request_id)  # table[0] is the request's block `first`
        start = max(self._num_named.get(request_id, 0), first)
        num_full = min(num_tokens, len(token_ids)) // self.block_size
        if num_full <= start:
            return
        hashes = self.block_hashes(request_id, token_ids, num_full * self.block_size)
        blocks = table[start - first : num_full - first]
        lora = self._loras.get(request_id) if self._loras else None
        self.pool.cache_run(blocks, hashes, self._block_tokens(request_id, token_ids, num_full), start, lora)
        if self.write_policy == "through":
            for i, block in enumerate(blocks, start):
                if block.block_hash == hashes[i]:
                    self._filled_by_step.append((block, hashes[i]))
        self._num_named[request_id] = num_full

    # -- the disk store ---------------------------------------------------------------------------

    @property
    def num_reads_in_flight(self) -> int:
        return len(self._reads)

    def is_loading(self, request_id: str) -> bool:
        """Whether the request waits for a read from the store (it is not admitted meanwhile)."""
        lookup = self._lookups.get(request_id)
        return lookup is not None and lookup.in_flight is not None and lookup.waits

    def holds_back(self, request_id: str, wait_for_host_room: bool) -> bool:
        """Whether the request's KV keeps it from running yet: it waits for a read from the store
        (:meth:`is_loading`), for blocks from a peer (:meth:`is_receiving`) or, with ``wait_for_host_room``, for host
        room (:meth:`waits_for_host_room`). Asked of every request every step: a request with no store lookup and no
        stream in flight is answered with two lookups."""
        if request_id in self._lookups and (
            self.is_loading(request_id) or (wait_for_host_room and self.waits_for_host_room(request_id))
        ):
            return True
        return bool(self._intakes) and self.is_receiving(request_id)

    def has_read_in_flight(self, request_id: str) -> bool:
        """Whether a read from the store for the request (a probe or a load) is in flight, or a push's load is due."""
        lookup = self._lookups.get(request_id)
        return lookup is not None and (lookup.in_flight is not None or lookup.push_span is not None)

    def load_for_push(self, request_id: str, first: int, end: int) -> None:
        """Load the request's blocks ``[first, end)`` (known stored) for a DE-read push, apart from its own prefix:
        the blocks before ``first`` that this engine lacks come from the prefill engine, which holds them. Started
        by the next :meth:`plan_disk_read`; until then the request counts as reading (its push waits)."""
        self._lookup_of(request_id).push_span = (first, end)

    @property
    def disk_stalled(self) -> bool:
        """Whether a read is still in flight past the load timeout: the store is stuck, so no new read starts
        (it would queue behind the stuck one) and waiting requests are admitted without their blocks on disk."""
        return any(job.timed_out for job in self._reads.values())

    def expire_disk_reads(self, now: float) -> int:
        """Stop waiting for reads in flight for ``load_timeout_s`` or more (stuck storage): their requests are
        admitted and compute those blocks instead, and read nothing more from the store. The reads' host blocks
        stay reserved until the reads end (the loader may still fill them). Returns how many timed out now."""
        expired = 0
        for job in self._reads.values():
            if job.timed_out or now - job.started_at < self.load_timeout_s:
                continue
            job.timed_out = True
            lookup = self._lookups.get(job.request_id)
            if lookup is not None and lookup.in_flight == job.read.read_id:
                expired += lookup.waits
                lookup.waits = False
                lookup.settled = True
        self.counters[DISK].load_timeouts += expired
        return expired

    def _lookup_of(self, request_id: str) -> _DiskLookup:
        """The request's progress through the store, begun now if not yet (made only then: this runs every step for
        every waiting request)."""
        lookup = self._lookups.get(request_id)
        if lookup is None:
            lookup = self._lookups[request_id] = _DiskLookup()
        return lookup

    def plan_disk_read(self, request_id: str, token_ids: Sequence[int], now: float = 0.0) -> DiskRead | None:
        """The read from the store to start for a waiting request, if any: its blocks that follow those in
        memory are probed for (when the store's holdings are unknown) or loaded into host blocks reserved
        for them (when known), ahead of its admission. Called each step for waiting requests, at ``now`` on the
        scheduler's clock; None when it waits for a read already, or the store has nothing more for it, or host
        memory has no room, or the store is stuck (:attr:`disk_stalled`)."""
        if not self.has_disk:
            return None
        lookup = self._lookup_of(request_id)
        lookup.room_short = 0
        if self.disk_stalled:
            lookup.push_span = None  # the push goes without them: the prefill engine reads or computes them
            return None
        if lookup.in_flight is not None:
            return None
        if lookup.push_span is not None:
            return self._start_push_load(request_id, token_ids, lookup, now)
        if lookup.settled:
            return None
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        hashes = self.block_hashes(request_id, token_ids)
        block_tokens = self._block_tokens(request_id, token_ids, max_blocks)
        host = self.pools[HOST]
        in_memory, tiers = self._memory_run(hashes, block_tokens, 0, max_blocks)
        start = len(in_memory)
        own_free_in_host: list[KVBlock] = []
        owner = self._programs.get(request_id)
        for block, tier in zip(in_memory, tiers, strict=True):
            if tier == HOST:  # used by the request: the last of its equals to go
                host.refresh(block, owner)
                if block.ref_count == 0:
                    own_free_in_host.append(block)
        end = max_blocks if lookup.disk_end is None else min(max_blocks, lookup.disk_end)
        if lookup.limit is not None and start >= min(end, lookup.limit):
            return None  # what is left comes from a peer (or, should that fail, may be read later)
        if lookup.limit is not None:
            end = min(end, lookup.limit)
        reloading = False
        if start < lookup.loaded_upto and lookup.reloads < MAX_RELOADS and not self._came_back_short(lookup):
            # Part of its prefix left memory before its turn (blocks it found cached that its load did not hold:
            # see _hold_while_loading): the store has them still, so read them again rather than compute them.
            # Bounded, so that a request whose blocks keep leaving cannot wait forever.
            lookup.reloads += 1
            reloading = True
            lookup.loaded_upto = start
            lookup.probed_at = None
        if start >= end or start < lookup.loaded_upto:
            # All in memory, the store has no more, or what the last load brought was evicted before its turn.
            if start < lookup.loaded_upto:
                reason = "load_came_back_short" if self._came_back_short(lookup) else "evicted_before_admission"
                self._count_recomputed(reason, lookup.loaded_upto - start)
                lookup.counted_from = min(start, lookup.counted_from if lookup.counted_from is not None else start)
            lookup.settled = True
            return None
        # Read only the run of blocks memory lacks: blocks after it still in memory (loaded before, held for the
        # request) are not read again; the next plan goes on after them.
        gap_end = find_held(self._memory_pools, hashes, block_tokens, start + 1, end)
        keys = hashes[start:gap_end]
        known = 0
        while known < len(keys) and keys[known] in self._known_on_disk:
            known += 1
        if known == 0:
            if lookup.probed_at == start:
                lookup.settled = True
                return None
            lookup.probed_at = start
            # Behind a prefix in memory, unknown blocks are almost always new input (an agent's next call: what
            # was evicted of its context is known, since this process wrote it), so the request does not wait
            # for the probe; with nothing in memory (a cold call, or the first after a restart) it does.
            return self._start_read(request_id, start, tuple(keys), (), (), waits=start == 0, now=now)
        lookup.keep = len(own_free_in_host)
        room = min(known, self._prefetch_room(lookup.keep))
        lookup.room_short = known - max(room, 0)
        lookup.room_short_from = start + max(room, 0)
        if room <= 0:
            return None  # host memory has no room for it now: try again at a later step
        # Loading must not evict the blocks of this very prefix, whatever the eviction order: they are held while
        # the load takes its blocks.
        host.touch(own_free_in_host)
        dst = host.allocate(room, self._programs.get(request_id))  # held by the read until it is done
        host.free(reversed(own_free_in_host))
        self._hold_while_loading(request_id, token_ids, start)
        if reloading:
            self.counters[DISK].reloaded_blocks += room
        tokens = tuple(block_tokens[start : start + room])
        lookup.loaded_upto = start + room
        return self._start_read(
            request_id, start, tuple(keys[:room]), tuple(b.block_id for b in dst), tokens, waits=True, now=now
        )

    def _start_push_load(
        self, request_id: str, token_ids: Sequence[int], lookup: _DiskLookup, now: float
    ) -> DiskRead | None:
        """The load of a DE-read push's blocks (:meth:`load_for_push`), as much as host memory has room for now; the
        rest loads after it (the push waits for all of them, as it waits for the request's own loads)."""
        assert lookup.push_span is not None
        first, end = lookup.push_span
        room = min(end - first, self._prefetch_room(0))
        if room <= 0:
            if not self._reads:
                # No read in flight will give room back (loaded blocks wait for their requests, whose pushes may
                # wait on this one): push what is loaded; the prefill engine reads or computes the rest.
                lookup.push_span = None
            return None  # else try again when a read is done
        lookup.push_span = (first + room, end) if first + room < end else None
        bs = self.block_size
        keys = tuple(self.block_hashes(request_id, token_ids[: end * bs])[first : first + room])
        dst = self.pools[HOST].allocate(room, self._programs.get(request_id))  # held by the read until it is done
        tokens = tuple(tuple(token_ids[i * bs : (i + 1) * bs]) for i in range(first, first + room))
        return self._start_read(request_id, first, keys, tuple(b.block_id for b in dst), tokens, waits=True, now=now)

    def _hold_while_loading(self, request_id: str, token_ids: Sequence[int], num_blocks: int) -> None:
        """Hold the request's first ``num_blocks`` blocks (all in memory: the load starts after them) until its
        admission, so that its load is not undone by their eviction before its turn. Its device blocks are held
        only while the prefixes so held stay within ``LOAD_HOLD_SHARE`` of the device, leaving room for what runs
        (and the scheduler lets them go when the request it serves next finds no room: release_held_while_loading)."""
        refs = [
            (r.tier, self.pools[r.tier].blocks[r.block_id])
            for r in self.memory_prefix(request_id, token_ids, num_blocks)
        ]
        others = sum(
            1 for rid, held in self._held_while_loading.items() if rid != request_id for t, _ in held if t == DEVICE
        )
        if others + sum(1 for t, _ in refs if t == DEVICE) > int(self.pool.num_blocks * LOAD_HOLD_SHARE):
            refs = [(t, b) for t, b in refs if t == HOST]
        for tier, block in refs:
            self.pools[tier].touch([block])
        self._release_held_while_loading(request_id)
        self._held_while_loading[request_id] = refs

    def hold_while_receiving(self, request_id: str, token_ids: Sequence[int], num_blocks: int) -> int:
        """Hold the request's first ``num_blocks`` blocks in memory while a peer's stream of the blocks after them is
        on its way (a DE-read push), as a load's prefix is held: bounded on the device, and let go when the request
        served before it needs the room. Returns how many of them memory holds (the rest left already)."""
        if HOST not in self.pools:
            return self.hold_prefix(request_id, token_ids, num_blocks)
        self._hold_while_loading(request_id, token_ids, num_blocks)
        return len(self.memory_prefix(request_id, token_ids, num_blocks))

    def _release_held_while_loading(self, request_id: str) -> None:
        for tier, block in reversed(self._held_while_loading.pop(request_id, [])):
            self.pools[tier].free([block])

    def release_held_while_loading(self, request_ids: Sequence[str]) -> bool:
        """Let the prefixes held for these waiting requests' loads go (they stay cached, and may be read again if
        evicted before the requests' turns): the request served before them needs the room. Returns whether any
        were held."""
        released = False
        for request_id in request_ids:
            released |= bool(self._held_while_loading.get(request_id))
            self._release_held_while_loading(request_id)
        return released

    def _start_read(
        self,
        request_id: str,
        start: int,
        keys: tuple[BlockHash, ...],
        dst_ids: tuple[int, ...],
        tokens: tuple[tuple[int, ...], ...],
        waits: bool,
        now: float,
        ahead: bool = False,
    ) -> DiskRead:
        read = DiskRead(self._next_read_id, keys, dst_ids, ahead=ahead)
        self._next_read_id += 1
        self._reads[read.read_id] = _ReadJob(request_id, start, read, tokens, started_at=now)
        lookup = self._lookups[request_id]
        lookup.in_flight, lookup.waits = read.read_id, waits
        return read

    def finish_disk_reads(self, done: Sequence[DiskReadDone]) -> None:
        """Record finished reads: a probe's findings; a load's blocks named in host memory (a cache entry
        like any other, whether or not their request is still here) and its unused blocks released."""
        host = self.pools.get(HOST)
        for result in done:
            job = self._reads.pop(result.read_id, None)
            if job is None:
                continue
            read, found = job.read, result.num_found
            lookup = self._lookups.get(job.request_id)
            if lookup is not None and lookup.admitted and read.is_probe and found:
                self._count_recomputed("unwaited_probe", _outside(lookup.arrival_lost, job.start, found))
            elif job.timed_out and found:
                counted = _outside(lookup.arrival_lost, job.start, found) if lookup is not None else found
                self._count_recomputed("load_timeout", counted)
            for key in read.keys[:found]:
                self._remember_on_disk(key)
            # A read stops at the first block it lacks (missing, or failing its check). Those after it are not known
            # to be there either: forgotten, they are written again once computed (kept, a bad one after the first
            # was never written again, and every later start missed from there).
            for key in read.keys[found:]:
                self._known_on_disk.pop(key, None)
            if not read.is_probe and host is not None:
                blocks = [host.blocks[i] for i in read.dst_ids]
                waiting = job.request_id in self._lookups and not job.timed_out
                kept: set[int] = set()  # block ids (a read's blocks are distinct)
                for block, key, tokens in zip(blocks[:found], read.keys, job.tokens, strict=False):
                    host.cache(block, key, tokens)
                    if block.block_hash == key:
                        self._origins[block.block_id] = DISK
                        if waiting:  # the read's reference becomes the waiting request's
                            self._prefetched[block.block_id] = job.request_id
                            kept.add(block.block_id)
                host.free(reversed([b for b in blocks if b.block_id not in kept]))
                self.counters[DISK].blocks_read += found
                self.counters[HOST].blocks_written += found
            lookup = self._lookups.get(job.request_id)
            if lookup is not None:
                lookup.in_flight = None
                if found < len(read.keys):
                    lookup.disk_end = job.start + found

    def note_memory_prefix(self, request_id: str, num_blocks: int) -> None:
        """The request arrived with its first ``num_blocks`` blocks in memory (device or host): should some of them be
        evicted before its admission and computed then, they are counted (:meth:`note_admitted`)."""
        if self.has_disk:
            self._lookup_of(request_id).arrival_prefix = num_blocks

    def note_admitted(self, request_id: str, cached_blocks: int = 0) -> None:
        """The request was admitted with its first ``cached_blocks`` blocks in memory: count the stored blocks it
        computes for want of host room, and those of its prefix in memory at its arrival that were evicted since and
        not read again (``evicted_before_admission``: stored, as every block memory holds is unless writes are off,
        and computed now; blocks a count before already covers are not counted twice). What a probe in flight finds
        for it is counted when the probe ends."""
        lookup = self._lookups.get(request_id)
        if lookup is None or lookup.admitted:
            return
        lookup.admitted = True
        if lookup.room_short:
            self._count_recomputed("no_host_room", lookup.room_short)
            before = lookup.counted_from
            lookup.counted_from = lookup.room_short_from if before is None else min(before, lookup.room_short_from)
        end = lookup.arrival_prefix if lookup.counted_from is None else min(lookup.arrival_prefix, lookup.counted_from)
        if self.write_policy != "off" and cached_blocks < end:
            self._count_recomputed("evicted_before_admission", end - cached_blocks)
            lookup.arrival_lost = (cached_blocks, end)

    def waits_for_host_room(self, request_id: str) -> bool:
        """Whether a waiting request whose stored blocks found no host room should wait for room rather than
        compute them: while other requests' reads are in flight or their loaded blocks wait for their admission
        (and they wait for no room themselves), the room they hold comes back when they are admitted.
        Reading a block costs far less than its prefill whenever the store keeps up at all; a stuck store is the
        load timeout's business."""
        lookup = self._lookups.get(request_id)
        if lookup is None or lookup.admitted or lookup.room_short <= 0 or self.disk_stalled:
            return False  # an admitted request (swapped out since) is planned no more: nothing to wait for
        return (
            self._prefetch_room(lookup.keep) > 0  # room came back this step (admissions): its load starts next step
            or any(job.request_id != request_id for job in self._reads.values())
            or any(self._will_be_admitted(owner) for owner in set(self._prefetched.values()) - {request_id})
        )

    def _will_be_admitted(self, request_id: str) -> bool:
        """Whether a request holding loaded blocks waits for nothing more from the store (a request that itself
        waits for room would otherwise wait on this one in turn: neither would ever be admitted)."""
        lookup = self._lookups.get(request_id)
        return lookup is None or lookup.room_short <= 0

    def _prefetch_room(self, keep: int) -> int:
        """Host blocks a new load may take now: free ones (less ``keep`` of them the load must not evict), within
        the prefetch share less what loads in flight and loaded blocks waiting for admission already hold."""
        host = self.pools[HOST]
        reserved = sum(len(job.read.dst_ids) for job in self._reads.values())
        budget = int(host.num_blocks * PREFETCH_SHARE) - len(self._prefetched) - reserved
        return min(host.num_free - keep, budget)

    @staticmethod
    def _came_back_short(lookup: _DiskLookup) -> bool:
        return lookup.disk_end is not None and lookup.disk_end < lookup.loaded_upto

    def _count_recomputed(self, reason: str, blocks: int) -> None:
        if blocks <= 0:
            return
        counts = self.counters[DISK].recomputed_blocks
        counts[reason] = counts.get(reason, 0) + blocks

    def release_prefetched(self, request_ids: Sequence[str]) -> bool:
        """Release the blocks loaded ahead for these waiting requests (the first listed first; before them, those read
        ahead for calls not here yet) until the tier below the device has room for a swap-out of any request the
        device holds; each request released may load its blocks again later. Returns whether anything was
        released."""
        if not self._prefetched:
            return False
        host = self.pools[HOST]
        need = max((len(t) for t in self._tables.values()), default=0)
        released = False
        # Reads ahead for calls not here yet go first, the latest asked first (their calls come last, if at all).
        for request_id in [*reversed(self._prefetch_tokens), *request_ids]:
            if host.num_free >= need:
                break
            if request_id in self._prefetched.values():
                self._drop_prefetched(request_id)
                self._release_held_while_loading(request_id)
                if request_id not in self._prefetch_tokens:
                    self._lookups.pop(request_id, None)  # planned afresh: its blocks are on disk still
                released = True
        return released

    def _drop_prefetched(self, request_id: str) -> None:
        """The request no longer waits (admitted, which took its own references, or gone): the blocks loaded
        for it are released, to stay in host memory as cache."""
        host = self.pools.get(HOST)
        mine = [b for b, rid in self._prefetched.items() if rid == request_id]
        for block_id in mine:
            del self._prefetched[block_id]
        if host is not None and mine:
            host.free(reversed([host.blocks[b] for b in mine]))

    def take_disk_ages(self) -> list[DiskAge]:
        """This step's hints to the store: names no program still alive uses, to be evicted first."""
        if not self._ages:
            return []
        out, self._ages = [DiskAge(tuple(self._ages), DISK_AGE_S)], []
        return out

    def _note_names(self, request_id: str) -> None:
        """Remember the names of the request's full blocks as its program's (for aging them on disk)."""
        program = self._programs.get(request_id)
        hashes = self._hashes.get(request_id)
        if program is None or not hashes:
            return
        assert self._disk_keys is not None
        self._disk_keys.get(program)  # followed from now on
        names = self._names_of.setdefault(program, set())
        for name in hashes:
            if name not in names:
                names.add(name)
                self._name_users[name] = self._name_users.get(name, 0) + 1

    def _age_finished_programs(self) -> None:
        """Programs that finished (or idled past their TTL) since the last step: the names only they used are
        aged in the store."""
        assert self._disk_keys is not None
        for program in self._disk_keys.catch_up():
            if self._disk_keys.get(program) != FINISHED:
                continue
            self._disk_keys.forget(program)
            for name in self._names_of.pop(program, ()):
                users = self._name_users[name] - 1
                if users:
                    self._name_users[name] = users
                    continue
                del self._name_users[name]
                if name in self._known_on_disk or name in self._writes_pending:
                    self._ages.append(name)

    def has_writes_to_hand_over(self) -> bool:
        """Whether blocks wait for the next step to be handed to the store's writer: those the last step computed
        (write-through), or every named block in memory at a stop (write-back, :meth:`write_back_all`). An idle
        engine runs one more step for them, and so does one that shuts down."""
        return (self.write_policy == "through" and bool(self._filled_by_step)) or self._write_back_all

    def write_back_all(self) -> None:
        """Under write-back, an engine that stops hands the store every named block it holds in memory (the next
        step queues them): a block is written when it leaves host memory, which a stopping engine's blocks never
        do, so a restart found none of them."""
        if self.write_policy == "back" and self.has_disk:
            self._write_back_all = True

    def take_disk_writes(self) -> list[DiskWrite]:
        """This step's writes to the store, one per source tier, in the order decided."""
        if not self._writes:
            return []  # (every step without a store)
        by_tier: dict[TierId, tuple[list[int], list[BlockHash]]] = {}
        for tier, block_id, key in self._writes:
            ids, keys = by_tier.setdefault(tier, ([], []))
            ids.append(block_id)
            keys.append(key)
        self._writes = []
        return [DiskWrite(tier, tuple(ids), tuple(keys)) for tier, (ids, keys) in by_tier.items()]

    def finish_disk_writes(self, done: Sequence[DiskWriteDone]) -> None:
        for result in done:
            for key in result.written:
                self._writes_pending.discard(key)
                self._remember_on_disk(key)
            for key in (*result.dropped, *result.failed):
                self._writes_pending.discard(key)
            self.counters[DISK].blocks_written += len(result.written)

    def writes_lost(self, writes: Sequence[DiskWrite]) -> None:
        """A failed step's writes may never reach the writer: they are no longer pending."""
        for write in writes:
            self._writes_pending.difference_update(write.keys)

    def _queue_write(self, tier: TierId, block_id: int, key: BlockHash) -> None:
        if key in self._known_on_disk or key in self._writes_pending:
            return
        self._writes_pending.add(key)
        self._writes.append((tier, block_id, key))

    def learn_disk_holdings(self, keys: Sequence[BlockHash]) -> None:
        """What the store held when it opened (least recently used first): blocks earlier processes wrote are
        loaded without a probe first, even behind a prefix in memory (after a restart, that a block is unknown
        no longer suggests it is new input). A name another process has evicted since just loads as a miss."""
        if self.has_disk:
            for key in keys[-MAX_KNOWN_ON_DISK:]:
                self._remember_on_disk(key)

    def note_on_disk(self, keys: Iterable[BlockHash]) -> None:
        """The store was seen to hold these blocks (a probe made elsewhere): loads of them need no probe."""
        for key in keys:
            self._remember_on_disk(key)

    def _remember_on_disk(self, key: BlockHash) -> None:
        self._known_on_disk[key] = None
        self._known_on_disk.move_to_end(key)
        if len(self._known_on_disk) > MAX_KNOWN_ON_DISK:
            self._known_on_disk.popitem(last=False)

    # -- reads ahead for calls not here yet (the dispatcher's prefetch) --------------------------------------

    def prefetch(
        self, request_id: str, token_ids: Sequence[int], count_stored: Callable[[Sequence[BlockHash]], int]
    ) -> int:
        """Read ahead the stored blocks of a call that has not arrived (``request_id`` is the call's): those after its
        prefix in memory now, as far as the store holds them (``count_stored``: a ``stat`` a block, stopping at the
        first missing). Loaded by :meth:`plan_prefetch_reads` into host memory's prefetch share, a chunk at a time,
        after the waiting requests' own loads; held for the call until its admission (:meth:`claim_prefetch`), or
        released by :meth:`drop_prefetch`. Returns the blocks to read (0: nothing)."""
        if not (self.has_disk and self.pool.enable_caching) or request_id in self._prefetch_tokens:
            return 0
        bs = self.block_size
        num_full = (len(token_ids) - 1) // bs  # the last token is always computed
        have = len(self.memory_prefix(None, token_ids, num_full))
        if have >= num_full:
            return 0
        keys = extend_block_hashes([], token_ids[: num_full * bs], bs, self.fingerprint)[have:]
        stored = count_stored(keys)
        self.note_on_disk(keys[:stored])
        if stored == 0:
            return 0
        self._lookup_of(request_id).prefetch_span = (have, have + stored)
        self._prefetch_tokens[request_id] = tuple(token_ids[: (have + stored) * bs])
        return stored

    @property
    def num_prefetches(self) -> int:
        """Calls read ahead for that have not arrived (their reads pending, in flight, or done and held)."""
        return len(self._prefetch_tokens)

    def plan_prefetch_reads(self, now: float = 0.0) -> list[DiskRead]:
        """The reads ahead to start this step (after the waiting requests' own, which come first): for each prefetch in
        the order asked, its next chunk (at most ``PREFETCH_READ_BLOCKS``, as host room allows), while fewer than
        ``PREFETCH_READS_IN_FLIGHT`` reads ahead are in flight. While a waiting request lacks host room for its loads,
        none starts, and one prefetch's blocks (the latest asked) are let go each step, to stay as cache: a call
        placed here goes before calls that may be placed later."""
        if not self._prefetch_tokens or self.disk_stalled:
            return []
        if any(lk.room_short > 0 for rid, lk in self._lookups.items() if rid not in self._prefetch_tokens):
            for rid in reversed(self._prefetch_tokens):
                if rid in self._prefetched.values():
                    self._drop_prefetched(rid)
                    break
            return []
        out = []
        slots = PREFETCH_READS_IN_FLIGHT - sum(
            1 for job in self._reads.values() if job.request_id in self._prefetch_tokens
        )
        for rid, tokens in self._prefetch_tokens.items():
            if slots <= 0:
                break
            lookup = self._lookups[rid]
            if lookup.prefetch_span is None or lookup.in_flight is not None:
                continue
            first, end = lookup.prefetch_span
            room = min(end - first, self._prefetch_room(0), PREFETCH_READ_BLOCKS)
            if room <= 0:
                break  # no room: the reads in flight and the admissions give it back
            lookup.prefetch_span = (first + room, end) if first + room < end else None
            bs = self.block_size
            keys = tuple(self.block_hashes(rid, tokens)[first : first + room])
            dst = self.pools[HOST].allocate(room)  # held by the read until it is done
            chunk = tuple(tuple(tokens[i * bs : (i + 1) * bs]) for i in range(first, first + room))
            lookup.loaded_upto = first + room
            dst_ids = tuple(b.block_id for b in dst)
            out.append(self._start_read(rid, first, keys, dst_ids, chunk, waits=True, now=now, ahead=True))
            slots -= 1
        return out

    def claim_prefetch(self, request_id: str) -> None:
        """The call read ahead for has arrived as a request: what was loaded stays held for it until its admission (as
        its own loads are), a read in flight is one it waits for, and what was not started it plans itself."""
        if self._prefetch_tokens.pop(request_id, None) is not None:
            self._lookups[request_id].prefetch_span = None

    def drop_prefetch(self, request_id: str) -> None:
        """The call read ahead for will not come (or its hold expired): its loaded blocks are let go, to stay as
        cache, and a read still in flight lands as cache for nobody."""
        if self._prefetch_tokens.pop(request_id, None) is None:
            return
        self._drop_prefetched(request_id)
        for job in self._reads.values():
            if job.request_id == request_id:
                job.request_id = _NOBODY
        self._lookups.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._tokens.pop(request_id, None)

    # -- streams between instances (kv/remote_moves.py) ----------------------------------------------------

    def memory_prefix(
        self,
        request_id: str | None,
        token_ids: Sequence[int],
        num_blocks: int,
        first: int = 0,
        fingerprint: str | None = None,
    ) -> list[BlockRef]:
        """The leading run of full blocks ``first`` to ``num_blocks`` of ``token_ids`` that memory holds (each on the
        device, else in host memory), without counting a lookup. ``request_id`` None: for no request here (its
        block names are not kept), named with ``fingerprint`` (default: the model's; ``set_namespace``)."""
        head = num_blocks * self.block_size
        if request_id is None:
            hashes = extend_block_hashes([], token_ids, self.block_size, fingerprint or self.fingerprint, head)
        else:
            hashes = self.block_hashes(request_id, token_ids, head)
        end = min(num_blocks, len(hashes))
        blocks, tiers = self._memory_run(hashes, self._block_tokens(request_id, token_ids, end), first, end)
        return [BlockRef(tier, block.block_id) for block, tier in zip(blocks, tiers, strict=True)]

    def hold_prefix(self, request_id: str, token_ids: Sequence[int], num_blocks: int) -> int:
        """Hold the leading run of the first ``num_blocks`` blocks in memory for a request that has not arrived
        (it will find them at its admission); returns how many. Released at its admission or when it is freed."""
        refs = self.memory_prefix(request_id, token_ids, num_blocks)
        held = self._held_for.setdefault(request_id, [])
        for ref in refs:
            block = self.pools[ref.tier].blocks[ref.block_id]
            self.pools[ref.tier].touch([block])
            held.append((ref.tier, block))
        return len(refs)

    def _release_held_for(self, request_id: str) -> None:
        for tier, block in reversed(self._held_for.pop(request_id, [])):
            self.pools[tier].free([block])

    def expect_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        first: int,
        count: int,
        peer: str,
        tag: int,
        count_first: bool = False,
    ) -> RemoteRecv | None:
        """Reserve host blocks for ``count`` blocks of the request (from block ``first`` on) that ``peer`` will send
        on ``tag``; the receive is posted at the next step. Disk reads for the request stop before ``first`` while
        the stream is in flight. When host memory has no room, the stream is still received (so the peer's
        messages are taken) and dropped, and the blocks are recomputed."""
        host = self.pools.get(HOST)
        blocks = host.allocate(count) if host is not None and self.host_room(count) else []
        bs = self.block_size
        keys = tuple(self.block_hashes(request_id, token_ids[: (first + count) * bs])[first : first + count])
        tokens = tuple(tuple(token_ids[i * bs : (i + 1) * bs]) for i in range(first, first + count))
        recv = RemoteRecv(self._next_remote_id, peer, tag, tuple(b.block_id for b in blocks), count, count_first)
        self._next_remote_id += 1
        self._intakes[recv.recv_id] = _Intake(request_id, first, blocks, keys, tokens)
        self._recvs.append(recv)
        self._lookup_of(request_id).limit = first
        return recv

    def host_room(self, count: int) -> bool:
        """Whether host memory could take ``count`` named blocks now (a stream from a peer lands there)."""
        host = self.pools.get(HOST)
        return host is not None and host.enable_caching and host.num_free >= count

    def is_receiving(self, request_id: str) -> bool:
        """Whether blocks of the request are on their way from a peer (it is not admitted meanwhile; a stream whose
        blocks were named at its count lets it run, its layers copied as they land)."""
        return bool(self._intakes) and any(
            i.request_id == request_id and i.named_early is None for i in self._intakes.values()
        )

    def landing(self, refs: Iterable[BlockRef]) -> list[BlockRef]:
        """Those of these host blocks that a stream named at its count is still landing in."""
        ids = {b.block_id for i in self._intakes.values() if i.named_early for b in i.named_early}
        return [r for r in refs if r.tier == HOST and r.block_id in ids] if ids else []

    def _name_at_count(self, count: RemoteRecvCount) -> None:
        """A counted-first stream's count came: when every block it promised is coming, name them now (held for the
        request too), so that the request runs while their layers land. Otherwise they are named when it ends."""
        intake = self._intakes.get(count.recv_id)
        host = self.pools.get(HOST)
        if intake is None or host is None or intake.request_id is None:
            return
        if count.num_valid != len(intake.keys) or len(intake.blocks) != len(intake.keys):
            return  # a gap (a block the peer could not get): the request waits for the stream, then reads or computes
        named = []
        for block, key, tokens in zip(intake.blocks, intake.keys, intake.tokens, strict=True):
            host.cache(block, key, tokens)
            if block.block_hash == key:  # else another block holds that name: the request finds that one
                named.append(block)
        host.touch(named, self._programs.get(intake.request_id))
        held = self._held_for.setdefault(intake.request_id, [])
        for block in named:
            self._origins[block.block_id] = PEER
            held.append((HOST, block))
        intake.named_early = named

    def take_remote_recvs(self) -> list[RemoteRecv]:
        out, self._recvs = self._recvs, []
        return out

    def hold_for_send(self, refs: Sequence[BlockRef]) -> int:
        """Take a reference on each block a send reads, until the send is reported; returns the send's id."""
        held = []
        for ref in refs:
            pool = self.pools[ref.tier]
            block = pool.blocks[ref.block_id]
            pool.touch([block])
            held.append((ref.tier, block))
        send_id = self._next_remote_id
        self._next_remote_id += 1
        self._sends[send_id] = held
        self.counters[PEER].blocks_written += len(refs)
        for tier, _ in held:
            self.counters[tier].blocks_read += 1
        return send_id

    @property
    def num_remote_in_flight(self) -> int:
        return len(self._intakes) + len(self._sends)

    def finish_remote(
        self,
        recvs: Sequence[RemoteRecvDone],
        sends: Sequence[RemoteSendDone],
        counts: Sequence[RemoteRecvCount] = (),
    ) -> None:
        """Record finished streams: a send's blocks are released; a receive's valid blocks are named in host
        memory (held for their request while it waits, else left as cache) and the rest freed. Disk reads of
        the request may go on past the stream's blocks again (a failed stream is made up from the store). A
        counted-first receive whose count came is named then (``counts``, before the receives that ended); when it
        ends its own references go, and if it failed, the names it gave."""
        for count in counts:
            self._name_at_count(count)
        for sent in sends:
            for tier, block in reversed(self._sends.pop(sent.send_id, [])):
                self.pools[tier].free([block])
        host = self.pools.get(HOST)
        for done in recvs:
            intake = self._intakes.pop(done.recv_id, None)
            if intake is None:
                continue
            if intake.named_early is not None:
                assert host is not None
                if done.error is not None:  # its layers never all came: no one may find these blocks again
                    host.uncache(intake.named_early)
                    for block in intake.named_early:
                        self._origins.pop(block.block_id, None)
                else:
                    self.counters[PEER].blocks_read += len(intake.named_early)
                    self.counters[HOST].blocks_written += len(intake.named_early)
                host.free(reversed(intake.blocks))
                self._reopen_lookup(intake)
                continue
            kept: set[int] = set()  # block ids (a stream's blocks are distinct)
            valid = min(done.num_valid, len(intake.blocks))
            for block, key, tokens in zip(intake.blocks[:valid], intake.keys, intake.tokens, strict=False):
                assert host is not None
                host.cache(block, key, tokens)
                if block.block_hash == key:
                    self._origins[block.block_id] = PEER
                    if intake.request_id is not None:  # the stream's reference becomes the waiting request's
                        self._held_for.setdefault(intake.request_id, []).append((HOST, block))
                        kept.add(block.block_id)
            if host is not None:
                host.free(reversed([b for b in intake.blocks if b.block_id not in kept]))
            self.counters[PEER].blocks_read += valid
            self.counters[HOST].blocks_written += valid
            self._reopen_lookup(intake)

    def _reopen_lookup(self, intake: _Intake) -> None:
        lookup = self._lookups.get(intake.request_id) if intake.request_id is not None else None
        if lookup is not None:
            lookup.limit = None
            lookup.settled = False


def _outside(span: tuple[int, int], first: int, count: int) -> int:
    """How many of the blocks ``first`` to ``first + count`` lie outside ``span`` ([first, end)): a read's finding
    counted as recomputed once only, where the request's admission counted part of it already."""
    overlap = max(0, min(first + count, span[1]) - max(first, span[0]))
    return count - overlap
