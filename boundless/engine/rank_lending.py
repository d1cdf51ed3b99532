"""A rank past the first of a split model in KV lending: its DistAttention, its partial server, and its shares of the
moves rank 0 makes (``engine/split_lending.py`` says how a split model lends, and rank 0's side).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from boundless.attention.dist_attention import DistributedAttention
from boundless.attention.partial_service import PartialClient, PartialServer
from boundless.attention.remote_partials import LentBlocks
from boundless.transport.base import KVTransport
from boundless.transport.blocks import BlocksReceive, send_blocks
from boundless.transport.endpoints import rank_address

if TYPE_CHECKING:
    from boundless.kv.tensors import PagedKVCache

log = logging.getLogger(__name__)

# The ranks' words on a move's share: sent (the debtor's), landed (the creditor's).
SENT = "sent"
LANDED = "landed"


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
        self.server = PartialServer(
            transport, kv_cache.layer, self._lookup, attention.scale, timeout_s, softcap=attention.softcap
        )
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
