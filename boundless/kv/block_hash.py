"""Names of full KV blocks: a chained content hash.

A full block is named by hash(parent block's name, the block's token ids, the model fingerprint).
The chain makes a name identify the whole prefix up to and including the block, so the same
name finds the same KV whether it sits in device memory, host memory, the store or on another
instance. Partial (not yet full) blocks have no name and are never shared.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes


_NO_PARENT = b"\x00" * 16
# A name's hash before any byte: each name copies it (cheaper than making a new one, and the same digest).
_EMPTY = hashlib.blake2b(digest_size=16)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], fingerprint: str) -> BlockHash:
    return _name(parent if parent is not None else _NO_PARENT, fingerprint.encode(), _pack(token_ids))


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as native int64 bytes, one after another (``array("q", token_ids).tobytes()``, in a third of the
    time)."""
    return struct.pack(f"{len(token_ids)}q", *token_ids)


def _name(parent: BlockHash, fingerprint: bytes, packed_tokens: bytes) -> BlockHash:
    """A block's name from its parent's, the model fingerprint and its tokens as int64 bytes (:func:`_pack`): the one
    layout every name has (names are kept in the disk store, so it must not change)."""
    h = _EMPTY.copy()
    h.update(parent + fingerprint + packed_tokens)
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, fingerprint: str, num_tokens: int | None = None
) -> list[BlockHash]:
    """Append to ``hashes`` the names of every full block of ``token_ids`` (of its first ``num_tokens``) not yet named.

    ``hashes`` already names the first ``len(hashes)`` blocks; the call is incremental so that a
    decoding request pays for each block once. The names are :func:`hash_block`'s; the new blocks' tokens are
    packed once (this runs for every prompt's blocks at admission).
    """
    limit = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    start, num_full = len(hashes), limit // block_size
    if start >= num_full:
        return hashes
    packed = _pack(token_ids[start * block_size : num_full * block_size])
    fp, width = fingerprint.encode(), block_size * 8
    parent = hashes[-1] if hashes else _NO_PARENT
    for off in range(0, len(packed), width):
        parent = _name(parent, fp, packed[off : off + width])
        hashes.append(parent)
    return hashes
