"""A request split between a prefill engine (PE) and a decode engine (DE): what each side is told to do.

The cluster's dispatcher places a request on a PE and a DE (``cluster/pd_scheduler.py``) and tells each its
part; the KV moves between them as block streams (``kv/remote_moves.py``), named by content, so a handoff
is "these full blocks of the request's tokens go into the peer's host memory as cached blocks":

1. The DE is told first (:class:`IntakePlan`): it creates the request, held back until its first token
   comes; holds the blocks of the prompt it already has in memory; reserves host blocks for the rest, which
   the PE will send; and answers (:class:`IntakeAnswer`) from which block the PE should send. Under the
   DE-read path the dispatcher first asks the PE how many leading blocks of the prompt it holds in memory
   (``EngineCore.memory_prefix_blocks``); the DE counts the blocks the shared store holds after what either
   engine has, loads only those the PE lacks, and pushes them (from the PE's prefix on) to the PE.
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
    """A PE's part: receive the DE's push of ``recv_blocks`` blocks of the request from block ``recv_from`` on, on
    ``recv_tag`` (the DE-read path; 0 otherwise), then send the DE (``peer``) the prompt's full blocks from
    ``send_from_block`` on, on ``send_tag``, layer by layer during the step that samples the first token."""

    peer: str
    send_tag: int
    send_from_block: int
    recv_tag: int = 0
    recv_blocks: int = 0
    recv_from: int = 0  # the push's first block: the PE holds those before it (it holds them for the request)


@dataclass(frozen=True)
class IntakePlan:
    """A DE's part: the request's KV comes from the PE at ``peer`` on ``recv_tag``. With ``push_tag`` (the
    DE-read path), the DE loads the prompt's stored blocks the PE lacks (it holds the first ``pe_holds`` in
    memory) and pushes them to the PE on ``push_tag`` first."""

    peer: str
    recv_tag: int
    push_tag: int | None = None
    pe_holds: int = 0


@dataclass(frozen=True)
class IntakeAnswer:
    """The DE's answer: the PE sends blocks ``send_from_block`` on; the DE pushes ``push_blocks`` from block
    ``push_from`` on."""

    send_from_block: int
    push_blocks: int = 0
    push_from: int = 0


@dataclass(frozen=True)
class PrefixPush:
    """A DE's push under DE-read: ``num_blocks`` blocks of the request from block ``first`` on (those the PE lacks:
    from the DE's memory, then loaded from the store) go to the PE at ``peer`` on ``tag`` once its loads are done."""

    peer: str
    tag: int
    num_blocks: int
    first: int = 0
