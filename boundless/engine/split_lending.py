"""KV lending for a model split over tensor-parallel ranks: each rank lends, borrows and attends with its own share.

A split instance holds each block's key/value heads spread over its ranks, and a peer split the same way holds the
same heads on its rank of the same number. So, as the prefill/decode streams do (``kv/split_streams.py``), lending
goes rank to rank, and nothing crosses the ranks' pipes but block ids and words:

- **A move.** The debtor's ranks each send their share of the move's blocks to the creditor's rank of their number,
  on their own endpoints (``RankEndpoint``), into the pool blocks rank 0 chose (every rank's pools have the same
  block ids). A share moves when rank 0 says (``TensorParallelRanks.lend``); each rank says when its share is sent, or
  has landed (``lend_done``). The debtor counts the move sent once every rank's share is; the creditor confirms it
  once every rank's share has landed, so a debtor never attends to a move some rank of the creditor lacks.
- **DistAttention.** Every rank wraps its attention in a ``DistributedAttention`` whose client asks the creditor's
  rank of its number for its heads' partials, and serves its share of the blocks it holds for others with a
  ``PartialServer`` of its own. A round trip failing on one rank is agreed over the ranks after the last layer
  (``attention/dist_attention.py``): every rank fails the step together, and rank 0 drops it and takes the creditor
  for lost, as one device does.

The ledger, the protocol and its decisions stay rank 0's (``engine/lending.py``, ``cluster/rmanager.py``): a rank
knows a move's blocks only to receive them and to answer partials over them. Its lookup of a move's blocks is kept
from the receive until its blocks go to another move's receive, so a rank may answer a partial of a move rank 0 no
longer holds; rank 0's own answer is then a failure, which the agreement makes every rank's.
"""

from __future__ import annotations

import contextlib
import logging
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
    the moves rank 0 makes. ``say(op, tag, error)`` tells rank 0 a share's end (``error`` empty when it went well)."""

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
        self._receives: dict[int, BlocksReceive] = {}  # by tag, until landed or cancelled
        self._failed: dict[int, str] = {}  # receives that could not be posted, by tag: why

    def _lookup(self, move_id: str) -> LentBlocks | None:
        blocks = self.lent.get(move_id)  # (a dict read on the server's thread: atomic under the interpreter lock)
        return None if blocks is None else LentBlocks(blocks)

    def apply(self, op: str, payload: Any) -> None:
        """One of rank 0's lending messages (``SplitLendingData``)."""
        # (Outside the rank's inference mode: the tensors posted here, a receive's staging and the partial server's
        # headers, are written by the transport's thread.)
        with torch.inference_mode(False):
            self._apply(op, payload)

    def _apply(self, op: str, payload: Any) -> None:
        if op == "recv":
            debtor, tag, move_id, block_ids = payload
            try:
                self._receive(debtor, tag, move_id, block_ids)
            except TransportError as e:  # (said when rank 0 asks for it to land)
                self._failed[tag] = f"{type(e).__name__}: {e}"
        elif op == "land":
            self._land(payload)
        elif op == "cancel":
            self._failed.pop(payload, None)
            receive = self._receives.pop(payload, None)
            if receive is not None:
                with contextlib.suppress(TransportError):
                    receive.wait(0)
        elif op == "send":
            creditor, tag, block_ids = payload
            self._send(creditor, tag, block_ids)
        elif op == "serve":
            try:
                self.server.add_peer(rank_address(payload, self.rank))
            except TransportError as e:  # (its round trips then fail, and the step with them, on every rank)
                log.warning("rank %d: cannot serve partials to %s: %s", self.rank, payload, e)
        else:
            raise ValueError(f"rank {self.rank}: no lending message {op!r}")

    def _receive(self, debtor: str, tag: int, move_id: str, block_ids: Sequence[int]) -> None:
        taken = set(block_ids)  # (blocks of an older loan, now freed and given to this one: that loan is over)
        for old in [m for m, ids in self.lent.items() if taken.intersection(ids)]:
            del self.lent[old]
        self._receives[tag] = BlocksReceive(self.transport, rank_address(debtor, self.rank), tag, self.cache, block_ids)
        self.lent[move_id] = list(block_ids)

    def _land(self, tag: int) -> None:
        receive = self._receives.pop(tag, None)
        if receive is None:
            self.say(LANDED, tag, self._failed.pop(tag, "no such receive"))
            return
        try:
            receive.wait(self.timeout_s)
        except TransportError as e:
            self.say(LANDED, tag, f"{type(e).__name__}: {e}")
            return
        self.say(LANDED, tag, "")

    def _send(self, creditor: str, tag: int, block_ids: Sequence[int]) -> None:
        try:
            peer = rank_address(creditor, self.rank)
            send_blocks(self.transport, peer, tag, self.cache, block_ids).wait(self.timeout_s)
        except TransportError as e:
            self.say(SENT, tag, f"{type(e).__name__}: {e}")
            return
        self.say(SENT, tag, "")

    def close(self) -> None:
        self.server.close()


class _SplitSend:
    """A move's send from every rank: rank 0's, then the other ranks' words."""

    def __init__(self, ranks: TensorParallelRanks, tag: int, own: Any) -> None:
        self.ranks, self.tag, self.own = ranks, tag, own

    def wait(self, timeout_s: float | None = None) -> None:
        timeout = 30.0 if timeout_s is None else timeout_s
        try:
            self.own.wait(timeout_s)
        finally:  # (the ranks' words are taken either way: none is left for a later move on the same tag)
            errors = self.ranks.lend_done(SENT, self.tag, timeout)
        if errors:
            raise TransportError(f"a move's blocks were not sent from every rank: {'; '.join(errors)}")


class _SplitReceive:
    """A move's receive on every rank: rank 0's own, then, once it has landed, the other ranks' shares (they land
    when told, on their loops). A wait that fails or times out cancels every rank's, as ``BlocksReceive`` does its
    own."""

    def __init__(self, ranks: TensorParallelRanks, tag: int, own: BlocksReceive) -> None:
        self.ranks, self.tag, self.own = ranks, tag, own
        self.block_ids = own.block_ids

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            self.own.wait(timeout_s)
        except TransportError:
            self.ranks.lend("cancel", self.tag)
            raise
        self.ranks.lend("land", self.tag)
        errors = self.ranks.lend_done(LANDED, self.tag, 30.0 if timeout_s is None else timeout_s)
        if errors:
            raise TransportError(f"a move's blocks did not land on every rank: {'; '.join(errors)}")


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
        self.server = PartialServer(
            transport, self.cache.layer, lent_blocks, self.attention.local.scale, timeout_s,
            on_peer_lost=lambda peer: on_peer_lost(self._debtors.get(peer, peer)),
        )  # fmt: skip
        ranks.lend("on", timeout_s)

    def send_blocks(self, creditor: str, tag: int, block_ids: Sequence[int]) -> _SplitSend:
        ids = list(block_ids)
        self.ranks.lend("send", (creditor, tag, ids))
        return _SplitSend(self.ranks, tag, send_blocks(self.transport, rank_address(creditor, 0), tag, self.cache, ids))

    def receive_blocks(self, debtor: str, tag: int, block_ids: Sequence[int], move_id: str) -> _SplitReceive:
        ids = list(block_ids)
        self.ranks.lend("recv", (debtor, tag, move_id, ids))
        own = BlocksReceive(self.transport, rank_address(debtor, 0), tag, self.cache, ids)
        return _SplitReceive(self.ranks, tag, own)

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
