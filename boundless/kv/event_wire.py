"""vLLM's wire form of KV cache events (``vllm/distributed/kv_events.py``), so that a subscriber written for vLLM
(Dynamo's KV router, llm-d's indexer, a msgspec decoder of vLLM's structs) decodes ours unchanged.

A batch is a msgpack array ``[ts, events, data_parallel_rank]`` (msgspec's ``array_like`` ``KVEventBatch``). Each
event is a tagged msgspec struct: as a map whose ``"type"`` names it (vLLM since its PR 42892, 0.24 on, ``map``), or
as an array whose first element names it (vLLM 0.23 and before, ``array``):

- ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
  ``lora_name``
- ``BlockRemoved``: ``block_hashes``, ``medium``
- ``AllBlocksCleared``: nothing

vLLM's later optional fields (``extra_keys``, ``group_idx``, ...) are left out, as its encoder leaves out a field at
its default. A block's hash is an unsigned 64-bit integer: :func:`external_hash`.

The replay socket's answers (:func:`replay_reply`, :func:`replay_end`) are vLLM's too: since its PR 45177 (0.26 on)
each resent batch is ``[topic, seq, payload]`` after the envelope, as on the PUB socket, and the end ``[b"", -1, b""]``;
``array`` keeps 0.23's ``[seq, payload]`` and ``[-1, b""]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from boundless.kv.block_hash import BlockHash
from boundless.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# The replay's end: -1 as a signed 8-byte big-endian number.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def replay_reply(topic: bytes, seq: int, payload: bytes, event_format: str = "map") -> tuple[bytes, ...]:
    """A resent batch as the replay socket sends it after the client's envelope: with the topic, as vLLM 0.26 on
    sends it (a router reads the instance and model from the topic, ``kv@<pod>@<model>``), or without it
    (``array``: vLLM 0.23 and before)."""
    seq_bytes = seq.to_bytes(8, "big")
    return (topic, seq_bytes, payload) if event_format == "map" else (seq_bytes, payload)


def replay_end(event_format: str = "map") -> tuple[bytes, ...]:
    """The replay's last message after the envelope: an empty topic (``map``), ``-1``, an empty payload."""
    return (b"", END_OF_REPLAY, b"") if event_format == "map" else (END_OF_REPLAY, b"")


def external_hash(name: BlockHash) -> int:
    """A block's name as the events send it: its last 8 bytes as a big-endian unsigned integer, the low 64 bits of the
    name read as one number (vLLM's ``maybe_convert_block_hash`` of its own hashes). Our names are blake2b digests of
    the parent's name, the model's fingerprint and the tokens, with no per-process seed, so the same prefix of the
    same model has the same hashes on every instance and after every restart."""
    return int.from_bytes(name[-8:], "big")


def encode_batch(ts: float, events: Sequence[KVEvent], rank: int, block_size: int, event_format: str = "map") -> bytes:
    """One batch's payload: ``events`` (a step's) at wall time ``ts`` from data-parallel rank ``rank``."""
    as_map = event_format == "map"
    return msgpack.packb([ts, [_event(e, block_size, as_map) for e in events], rank], use_bin_type=True)


def _event(event: KVEvent, block_size: int, as_map: bool) -> Any:
    if isinstance(event, BlockStored):
        parent = external_hash(event.parent_block_hash) if event.parent_block_hash is not None else None
        lora_id, lora_name = (event.lora.lora_id, event.lora.lora_name) if event.lora is not None else (None, None)
        fields: dict[str, Any] = {
            "block_hashes": [external_hash(h) for h in event.block_hashes],
            "parent_block_hash": parent,
            "token_ids": [t for block in event.block_tokens for t in block],
            "block_size": block_size,
            "lora_id": lora_id,
            "medium": event.medium,
            "lora_name": lora_name,
        }
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": [external_hash(h) for h in event.block_hashes], "medium": event.medium}
    else:
        assert isinstance(event, AllBlocksCleared)
        fields = {}
    tag = type(event).__name__
    return {"type": tag, **fields} if as_map else [tag, *fields.values()]
