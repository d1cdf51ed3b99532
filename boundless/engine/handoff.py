"""A request split between a prefill engine (PE) and a decode engine (DE): what each side is told to do.

The cluster's dispatcher places a request on a PE and a DE (``cluster/pd_scheduler.py``) and tells each its
part; the KV moves between them as block streams (``kv/remote_moves.py``), named by content, so a handoff
is "these full blocks of the request's tokens go into the peer's host memory as cached blocks":

1. The DE is told first (:class:`IntakePlan`): it creates the request, held back until its first token
   comes; holds the blocks of the prompt it already has in memory; reserves host blocks for the rest, which
   the PE will send; and answers (:class:`IntakeAnswer`) from which block the PE should send. Under the
   DE-read path it also counts the blocks the shared store holds after its memory's, loads them itself, and
   pushes all those leading blocks to the PE.
2. The PE is told second (:class:`HandoffPlan`): it receives the DE's push (DE-read), prefills the rest,
   samples the first token and, while its forward pass runs, sends the DE the blocks from ``send_from_block``
   on, layer by layer. The request ends there, with the first token (finish reason ``handoff``).
3. The DE is given the first token (``EngineCore.continue_request``) and runs the request as a resumed one:
   its prompt is a prefix-cache hit (device, host or received blocks), at most the last partial block and
   the first token are computed, and decoding goes on. Greedy outputs are those of one engine.

A stream that fails or times out frees its blocks on both sides, and the blocks it should have brought are
recomputed (or read from the store): a handoff only saves work, so correctness never depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HandoffPlan:
    """A PE's part: receive the DE's push of the request's first ``recv_blocks`` blocks on ``recv_tag`` (the
    DE-read path; 0 otherwise), then send the DE (``peer``) the prompt's full blocks from ``send_from_block``
    on, on ``send_tag``, layer by layer during the step that samples the first token."""

    peer: str
    send_tag: int
    send_from_block: int
    recv_tag: int = 0
    recv_blocks: int = 0


@dataclass(frozen=True)
class IntakePlan:
    """A DE's part: the request's KV comes from the PE at ``peer`` on ``recv_tag``. With ``push_tag`` (the
    DE-read path), the DE loads the prompt's stored blocks after those in its memory and pushes all those
    leading blocks to the PE on ``push_tag`` first."""

    peer: str
    recv_tag: int
    push_tag: int | None = None


@dataclass(frozen=True)
class IntakeAnswer:
    """The DE's answer: the PE sends blocks ``send_from_block`` on; the DE pushes the first ``push_blocks``."""

    send_from_block: int
    push_blocks: int = 0


@dataclass(frozen=True)
class PrefixPush:
    """A DE's push under DE-read: the request's first ``num_blocks`` blocks (those in its memory, then those it
    loads from the store) go to the PE at ``peer`` on ``tag`` once its loads are done."""

    peer: str
    tag: int
    num_blocks: int
