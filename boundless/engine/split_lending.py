"""KV lending for a model split over tensor-parallel ranks: each rank lends, borrows and attends with its own share.

A split instance holds each block's key/value heads spread over its ranks, and a peer split the same way holds the
same heads on its rank of the same number. So, as the prefill/decode streams do (``kv/split_streams.py``), lending
goes rank to rank, and nothing crosses the ranks' pipes but block ids and words:

- **A move.** The debtor's ranks each send their share of the move's blocks to the creditor's rank of their number,
  on their own endpoints (``RankEndpoint``), into the pool blocks rank 0 chose (every rank's pools have the same
  block ids). A share moves when rank 0 says (``TensorParallelRanks.lend``); each rank says when its share is sent, or
  has landed (``lend_done``), naming the ticket rank 0 gave that share, so a word that comes late is never taken
  for another move's. The debtor counts the move sent once every rank's share is; the creditor confirms it once
  every rank's share has landed (each rank lands its own as it comes, beside its passes), so a debtor never attends
  to a move some rank of the creditor lacks. A move given up is cancelled on every rank.
- **DistAttention.** Every rank wraps its attention in a ``DistributedAttention`` whose client asks the creditor's
  rank of its number for its heads' partials, and serves its share of the blocks it holds for others with a
  ``PartialServer`` of its own. A round trip failing on one rank is agreed over the ranks after the last layer
  (``attention/dist_attention.py``): every rank fails the step together, and rank 0 drops it and takes the creditor
  for lost, as one device does.

The ledger, the protocol and its decisions stay rank 0's (``engine/lending.py``, ``cluster/rmanager.py``): a rank
knows a move's blocks only to receive them and to answer partials over them. Its lookup of a move's blocks is kept
from their landing until its blocks land for another move, so a rank may answer a partial of a move rank 0 no
longer holds; rank 0's own answer is then a failure, which the agreement makes every rank's.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from boundless.attention.dist_attention import DistributedAttention
from boundless.attention.partial_service import PartialClient, PartialServer
from boundless.attention.remote_partials import LentBlocks
from boundless.transport.base import KVTransport, TransportError
from boundless.transport.blocks import BlocksReceive, send_blocks
from boundless.transport.endpoints import instance_address, rank_address

if TYPE_CHECKING:
    from boundless.engine.core import EngineCore
    from boundless.engine.lending import PartialCounters
    from boundless.engine.rank_process import RankEndpoint
    from boundless.engine.tensor_parallel import TensorParallelRanks
    from boundless.kv.tensors import PagedKVCache

log = logging.getLogger(__name__)

# The ranks' words on a move's share: sent (the debtor's), landed (the creditor's).
SENT = "sent"
LANDED = "landed"


def lending_address(core: EngineCore, transport: KVTransport, how: RankEndpoint) -> str:
    """The address peers lend to and borrow from this instance at: its ``transport``'s; a split model's ranks' too,
    each rank's endpoint opened first as ``how`` says (``TensorParallelRanks.connect``)."""
    from boundless.engine.executor import ModelExecutor  # (the executor's modules import this one's)

    ranks = core.executor.runner.ranks if isinstance(core.executor, ModelExecutor) else None
    if ranks is None:
        return transport.address
    return instance_address([transport.address, *ranks.connect(how)])


class RankLending:
    """A rank past the first in KV lending (see the module): its DistAttention, its partial server, and its shares of
    the moves rank 0 makes. ``say(op, ticket, error)`` tells rank 0 a share's end (``error`` empty when it went well),
    by the ticket rank 0 gave the share.

    A share sent goes on the rank's loop (the debtor moves between its steps: its ranks are idle). A share received
    lands on a thread of its own as soon as it has come (its blocks written into the pool then, beside the rank's
    forward pass, as rank 0's own landing is beside its loop's), so a creditor confirms a move without waiting for its
    ranks' passes in flight; only then may its partial server answer for the move."""

    def __init__(
        self,
        rank: int,
        transport: KVTransport,
        kv_cache: PagedKVCache,
        attention: Any,
        agree: Callable[[torch.Tensor], None],
        say: Callable[[str, int, str], None],
        timeout_s: float,
    ) -> None:
        self.rank = rank
        self.transport = transport
        self.cache = kv_cache
        self.say = say
        self.timeout_s = timeout_s
        caches = [kv_cache.layer(i) for i in range(kv_cache.num_layers)]
        self.client = PartialClient(transport, timeout_s, rank=rank)
        self.attention = DistributedAttention(attention, self.client, caches, agree=agree)
        self.lent: dict[str, list[int]] = {}  # move id -> this rank's pool blocks holding its share of the move
        self.server = PartialServer(transport, kv_cache.layer, self._lookup, attention.scale, timeout_s)
        # Receives posted and not yet landed, by ticket: the move's id, the receive, its deadline.
        self._landing: dict[int, tuple[str, BlocksReceive, float]] = {}
        self._lock = threading.Lock()  # (the landing thread's and the loop's: a cancelled receive writes nothing)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._land_loop, name="tp-lend-landing", daemon=True)
        self._thread.start()

    def _lookup(self, move_id: str) -> LentBlocks | None:
        blocks = self.lent.get(move_id)  # (a dict read on the server's thread: atomic under the interpreter lock)
        return None if blocks is None else LentBlocks(tuple(blocks))

    def apply(self, op: str, payload: Any) -> None:
        """One of rank 0's lending messages (``SplitLendingData``). A failure of one (a transport's, or any other) is
        said as the share's end, or logged, never raised: on one device it fails the move alone, not the engine."""
        # (Outside the rank's inference mode: the tensors posted here, a receive's staging and the partial server's
        # headers, are written by the transport's thread.)
        with torch.inference_mode(False):
            if op == "recv":
                ticket, debtor, tag, move_id, block_ids = payload
                try:
                    self._receive(ticket, debtor, tag, move_id, block_ids)
                except Exception as e:
                    self.say(LANDED, ticket, f"{type(e).__name__}: {e}")
            elif op == "cancel":
                self._cancel(payload)
            elif op == "send":
                ticket, creditor, tag, block_ids = payload
                try:
                    peer = rank_address(creditor, self.rank)
                    send_blocks(self.transport, peer, tag, self.cache, block_ids).wait(self.timeout_s)
                except Exception as e:
                    self.say(SENT, ticket, f"{type(e).__name__}: {e}")
                else:
                    self.say(SENT, ticket, "")
            elif op == "serve":
                try:
                    self.server.add_peer(rank_address(payload, self.rank))
                except Exception as e:  # (its round trips then fail, and the step with them, on every rank)
                    log.warning("rank %d: cannot serve partials to %s: %s", self.rank, payload, e)
            else:
                log.error("rank %d: no lending message %r", self.rank, op)

    def _receive(self, ticket: int, debtor: str, tag: int, move_id: str, block_ids: Sequence[int]) -> None:
        receive = BlocksReceive(self.transport, rank_address(debtor, self.rank), tag, self.cache, block_ids)
        with self._lock:
            self._landing[ticket] = (move_id, receive, time.monotonic() + self.timeout_s)
        self._wake.set()

    def _cancel(self, ticket: int) -> None:
        with self._lock:
            landing = self._landing.pop(ticket, None)
        if landing is not None:
            landing[1].cancel()

    def _land_loop(self) -> None:
        """Land each receive once its share has come (or fail it at its deadline), and say so."""
        while not self._stop.is_set():
            with self._lock:
                for ticket, (move_id, receive, deadline) in list(self._landing.items()):
                    try:
                        if not receive.done():  # (done writes the share into the pool)
                            if time.monotonic() < deadline:
                                continue
                            receive.wait(0)
                    except Exception as e:  # (a transport's failure, or its timeout at the deadline)
                        del self._landing[ticket]
                        receive.cancel()
                        self.say(LANDED, ticket, f"{type(e).__name__}: {e}")
                        continue
                    del self._landing[ticket]
                    landed = set(receive.block_ids)  # (blocks of an older loan, freed and given to this one)
                    for old in [m for m, ids in self.lent.items() if landed.intersection(ids)]:
                        del self.lent[old]
                    self.lent[move_id] = list(receive.block_ids)
                    self.say(LANDED, ticket, "")
                waiting = bool(self._landing)
            self._wake.wait(0.001 if waiting else 0.5)
            self._wake.clear()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self.server.close()


class _SplitSend:
    """A move's send from every rank: rank 0's, then the other ranks' words."""

    def __init__(self, ranks: TensorParallelRanks, ticket: int, own: Any) -> None:
        self.ranks, self.ticket, self.own = ranks, ticket, own

    def wait(self, timeout_s: float | None = None) -> None:
        timeout = 30.0 if timeout_s is None else timeout_s
        try:
            self.own.wait(timeout_s)
        finally:  # (the ranks' words are taken either way)
            errors = self.ranks.lend_done((SENT, self.ticket), timeout)
        if errors:
            raise TransportError(f"a move's blocks were not sent from every rank: {'; '.join(errors)}")


class _SplitReceive:
    """A move's receive on every rank: rank 0's own, then the other ranks' words that their shares landed (each rank
    lands its own as it comes). A wait that fails or times out cancels every rank's, as :meth:`cancel` does."""

    def __init__(self, ranks: TensorParallelRanks, ticket: int, own: BlocksReceive) -> None:
        self.ranks, self.ticket, self.own = ranks, ticket, own
        self.block_ids = own.block_ids

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            self.own.wait(timeout_s)
        except TransportError:
            self.cancel()
            raise
        errors = self.ranks.lend_done((LANDED, self.ticket), 30.0 if timeout_s is None else timeout_s)
        if errors:
            self.cancel()
            raise TransportError(f"a move's blocks did not land on every rank: {'; '.join(errors)}")

    def cancel(self) -> None:
        """Give the receive up on every rank: nothing more is written into its blocks, and no word of it is kept."""
        self.own.cancel()
        self.ranks.lend("cancel", self.ticket)
        self.ranks.lend_forget((LANDED, self.ticket))


class SplitLendingData:
    """Rank 0's tensor side of lending for a split model (``engine/lending.py``'s ``LendingData``; see the module):
    its own share as ``TransportLendingData`` moves one device's, and the other ranks' through their pipes. The
    instance's address is its ranks' endpoints' (``transport/endpoints.py``); ``transport`` is rank 0's."""

    def __init__(
        self,
        core: EngineCore,
        transport: KVTransport,
        lent_blocks: Callable[[str], LentBlocks | None],
        on_peer_lost: Callable[[str], None],
        timeout_s: float,
    ) -> None:
        runner = core.executor.runner  # type: ignore[attr-defined]
        ranks = runner.ranks
        assert ranks is not None, "a model split over ranks"
        if not ranks.connected:
            raise ValueError("a split model lends from every rank: open the ranks' endpoints first (lending_address)")
        self.ranks: TensorParallelRanks = ranks
        self.size = ranks.size
        self.transport = transport
        self.cache = runner.kv_cache
        caches = [self.cache.layer(i) for i in range(self.cache.num_layers)]
        self.client = PartialClient(transport, timeout_s, rank=0)
        self.attention = DistributedAttention(runner.attention, self.client, caches, agree=ranks.all_reduce_)
        runner.attention = self.attention
        self._debtors: dict[str, str] = {}  # a debtor's rank 0's address -> its instance's
        # Each share of a move gets a ticket of its own, which its ranks' words name: a word that comes after its wait
        # gave up is dropped, never taken for a later move's (whose tag, of its move id, may be the same).
        self._tickets = itertools.count(1)
        self.server = PartialServer(
            transport, self.cache.layer, lent_blocks, self.attention.local.scale, timeout_s,
            on_peer_lost=lambda peer: on_peer_lost(self._debtors.get(peer, peer)),
        )  # fmt: skip
        ranks.lend("on", timeout_s)

    def send_blocks(self, creditor: str, tag: int, block_ids: Sequence[int]) -> _SplitSend:
        ids, ticket = list(block_ids), next(self._tickets)
        self.ranks.lend("send", (ticket, creditor, tag, ids), awaits=(SENT, ticket))
        own = send_blocks(self.transport, rank_address(creditor, 0), tag, self.cache, ids)
        return _SplitSend(self.ranks, ticket, own)

    def receive_blocks(self, debtor: str, tag: int, block_ids: Sequence[int], move_id: str) -> _SplitReceive:
        ids, ticket = list(block_ids), next(self._tickets)
        own = BlocksReceive(self.transport, rank_address(debtor, 0), tag, self.cache, ids)
        self.ranks.lend("recv", (ticket, debtor, tag, move_id, ids), awaits=(LANDED, ticket))
        return _SplitReceive(self.ranks, ticket, own)

    def serve(self, debtor: str) -> None:
        own = rank_address(debtor, 0)
        self._debtors[own] = debtor
        self.server.add_peer(own)
        self.ranks.lend("serve", debtor)

    def counters(self) -> PartialCounters:
        from boundless.engine.lending import PartialCounters  # (that module's agent makes this one's data)

        c, a = self.client.stats, self.attention.stats
        # (Every rank's round trips carry its heads' rows and partials alike: the bytes are rank 0's times the ranks.)
        return PartialCounters(
            c.round_trips, (c.bytes_sent + c.bytes_received) * self.size, self.server.stats.round_trips, a.layers,
            a.exposed_s,
        )  # fmt: skip

    def close(self) -> None:
        self.server.close()
