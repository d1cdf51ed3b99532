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

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from boundless.attention.remote_partials import LentBlocks
from boundless.engine.lending import BlockReceive, BlockSend, PartialCounters, TransportLendingData
from boundless.engine.rank_lending import LANDED, SENT
from boundless.transport.base import KVTransport, TransportError
from boundless.transport.endpoints import instance_address, rank_address

if TYPE_CHECKING:
    from boundless.engine.core import EngineCore
    from boundless.engine.rank_process import RankEndpoint
    from boundless.engine.tensor_parallel import TensorParallelRanks


def lending_address(core: EngineCore, transport: KVTransport, how: RankEndpoint) -> str:
    """The address peers lend to and borrow from this instance at: its ``transport``'s; a split model's ranks' too,
    each rank's endpoint opened first as ``how`` says (``TensorParallelRanks.connect``)."""
    if core.ranks is None:
        return transport.address
    return instance_address([transport.address, *core.ranks.connect(how)])


class _SplitSend:
    """A move's send from every rank: rank 0's, then the other ranks' words."""

    def __init__(self, ranks: TensorParallelRanks, ticket: int, own: BlockSend) -> None:
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

    def __init__(self, ranks: TensorParallelRanks, ticket: int, own: BlockReceive) -> None:
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


class SplitLendingData(TransportLendingData):
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
        ranks = core.ranks
        assert ranks is not None, "a model split over ranks"
        if not ranks.connected:
            raise ValueError("a split model lends from every rank: open the ranks' endpoints first (lending_address)")
        self._debtors: dict[str, str] = {}  # a debtor's rank 0's address -> its instance's
        # Rank 0's own share as one device's; its round trips' failures agreed over the ranks.
        super().__init__(
            core, transport, lent_blocks, lambda peer: on_peer_lost(self._debtors.get(peer, peer)), timeout_s,
            agree=ranks.all_reduce_,
        )  # fmt: skip
        self.ranks: TensorParallelRanks = ranks
        # Each share of a move gets a ticket of its own, which its ranks' words name: a word that comes after its wait
        # gave up is dropped, never taken for a later move's (whose tag, of its move id, may be the same).
        self._tickets = itertools.count(1)
        ranks.lend("on", timeout_s)

    def send_blocks(self, creditor: str, tag: int, block_ids: Sequence[int]) -> _SplitSend:
        ids, ticket = list(block_ids), next(self._tickets)
        self.ranks.lend("send", (ticket, creditor, tag, ids), awaits=(SENT, ticket))
        return _SplitSend(self.ranks, ticket, super().send_blocks(creditor, tag, ids))

    def receive_blocks(self, debtor: str, tag: int, block_ids: Sequence[int], move_id: str) -> _SplitReceive:
        ids, ticket = list(block_ids), next(self._tickets)
        own = super().receive_blocks(debtor, tag, ids, move_id)
        self.ranks.lend("recv", (ticket, debtor, tag, move_id, ids), awaits=(LANDED, ticket))
        return _SplitReceive(self.ranks, ticket, own)

    def serve(self, debtor: str) -> None:
        self._debtors[rank_address(debtor, 0)] = debtor
        super().serve(debtor)
        self.ranks.lend("serve", debtor)

    def counters(self) -> PartialCounters:
        # (Every rank's round trips carry its heads' rows and partials alike: the bytes are rank 0's times the ranks.)
        own = super().counters()
        return dataclasses.replace(own, round_trip_bytes=own.round_trip_bytes * self.ranks.size)
