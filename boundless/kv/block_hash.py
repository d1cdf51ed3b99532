"""Names of full KV blocks: a chained content hash.

A full block is named by hash(parent block's name, the block's token ids, the model fingerprint).
The chain makes a name identify the whole prefix up to and including the block, so the same
name finds the same KV whether it sits in device memory, host memory, the store or on another
instance. Partial (not yet full) blocks have no name and are never shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], fingerprint: str) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"\x00" * 16)
    h.update(fingerprint.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, fingerprint: str
) -> list[BlockHash]:
    """Append to ``hashes`` the names of every full block of ``token_ids`` not yet named.

    ``hashes`` already names the first ``len(hashes)`` blocks; the call is incremental so that a
    decoding request pays for each block once.
    """
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for b in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[b * block_size : (b + 1) * block_size], fingerprint)
        hashes.append(parent)
    return hashes
