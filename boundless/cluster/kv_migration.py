"""Moving a running request, with its whole KV, from one engine to another: live migration.

The baseline KV lending is measured against (``bench/longctx.py``, setup ``move``): when a request cannot grow
where it runs, all of its KV moves to an instance with room and it continues there. The blocks travel over the
KV transport as one message (``transport/blocks.py``, as the lending moves do); the destination writes them into
pool blocks, names them in its prefix cache with the request's own chained hashes (blocks are content-addressed,
so the names need not travel), and the request is queued there with its output so far (``Resume``). Its
admission then finds the moved blocks as a prefix-cache hit and computes only its last, partial block; the
source drops the request and its blocks. Greedy output is unchanged: the moved KV is the KV it computed.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from boundless.engine.core import EngineCore, Resume
from boundless.engine.request import RequestStatus
from boundless.transport.base import KVTransport, TransportError
from boundless.transport.blocks import BlocksReceive, send_blocks

_MIGRATION_TAG_BASE = 0xF300_0000
_MIGRATION_TAG_SPAN = 1 << 24


@dataclass(frozen=True)
class Endpoint:
    """An engine and its endpoint of the KV transport."""

    core: EngineCore
    transport: KVTransport


@dataclass(frozen=True)
class Migration:
    """A request moved: how many full blocks travelled, and their bytes."""

    request_id: str
    num_blocks: int
    num_bytes: int


def migration_tag(request_id: str, attempt: int) -> int:
    """A tag of its own for each migration of a request (a request may move more than once)."""
    return _MIGRATION_TAG_BASE + zlib.crc32(f"{request_id}#{attempt}".encode()) % _MIGRATION_TAG_SPAN


def migrate_request(
    src: Endpoint, dst: Endpoint, request_id: str, attempt: int = 0, timeout_s: float = 30.0
) -> Migration | None:
    """Move a running request from ``src`` to ``dst`` with its computed full blocks; None (nothing changed) when
    it is not running there (or holds no block 0 there), ``dst`` lacks room for its blocks, or the transfer fails (a
    peer gone, a timeout). Call between the engines' steps."""
    request = src.core.scheduler.requests.get(request_id)
    if request is None or request.status is not RequestStatus.RUNNING or src.core.kv.first_local_block(request_id):
        return None  # (not one whose leading blocks are elsewhere: lent, or given back past a sliding window)
    kv_src, kv_dst = src.core.kv, dst.core.kv
    bs = kv_src.block_size
    tokens = request.all_token_ids
    num_full = request.num_computed_tokens // bs
    src_ids = kv_src.block_ids(request_id)[:num_full]
    dst_ids = kv_dst.allocate_unowned(num_full)
    if dst_ids is None:
        return None
    cache_src, cache_dst = src.core.executor.runner.kv_cache, dst.core.executor.runner.kv_cache
    tag = migration_tag(request_id, attempt)
    try:
        receive = BlocksReceive(dst.transport, src.transport.address, tag, cache_dst, dst_ids)
        send_blocks(src.transport, dst.transport.address, tag, cache_src, src_ids).wait(timeout_s)
        receive.wait(timeout_s)
    except TransportError:
        kv_dst.free_unowned(dst_ids)  # nothing was named there: the request runs on where it was
        return None
    # Named as the request names its blocks there (its adapter's, its cache salt's fingerprint), set before the first
    # name: its hashes are kept from then on, and a block under the model's own names is any request's prefix.
    namespace = dst.core.kv_namespace(request.sampling_params)
    if namespace is not None:
        kv_dst.set_namespace(request_id, namespace)
    kv_dst.name_unowned(request_id, dst_ids, tokens)
    kv_dst.free_unowned(dst_ids)  # cached and free: the request's admission below takes them as its prefix
    resume = Resume(tuple(request.output_token_ids), text_chars_sent=0)
    dst.core.add_request(
        request_id, list(request.prompt_token_ids), request.sampling_params, request.arrival_time, resume=resume
    )
    src.core.abort(request_id)
    return Migration(request_id, num_full, num_full * src.core.layout.bytes_per_block)
