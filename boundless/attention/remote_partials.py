"""Attention partials over KV blocks lent by another instance, and the messages that carry them.

A creditor holds some of a debtor's request's KV blocks (Infinite-LLM's KV lending). Those blocks hold only
positions earlier than any token the debtor still computes (a move never takes the block being written), so
every query token the debtor sends attends to *all* of their tokens: no causal mask. A layer with a sliding window
is the one place positions count: a segment carries its first query's position counted from its first lent key, and
a row sees the lent keys within the window of its position (``attention/backend.py``'s rule).
The keys in the blocks were stored already rotated (RoPE at their own positions) and the debtor rotates its
queries at theirs before sending, so a score is the same dot product wherever it is computed.

:func:`lent_partial` computes the partial (``m``, ``e``, ``o``; ``attention/partials.py``) of query rows over
such blocks with the paged-attention code: on the CPU in fp32 the native kernel, each query row a sequence of
one token whose context is the lent blocks; elsewhere the PyTorch matmul path.

The wire format (any :class:`~boundless.transport.base.KVTransport`; one request per debtor, creditor and
layer, covering every request of the step whose blocks that creditor holds):

- request, debtor → creditor, on :data:`REQUEST_TAG`, two messages in order:
  1. a header, int64 ``[9]``: version, sequence number, layer, query rows ``T``, heads ``H``, head dim ``D``,
     segments ``S``, bytes of move ids ``B``, the layer's sliding window (0: none);
  2. the body: rows per segment int64 ``[S]``, bytes of each segment's move ids int64 ``[S]``, each segment's first
     query position from its first lent key int64 ``[S]``, the move ids (utf-8, a segment's joined by ``,``) uint8
     ``[B]``, and the query rows fp32 ``[T, H, D]``.
- reply, creditor → debtor, on :func:`reply_tag` of the sequence number: a status int64 ``[2]`` (0 or an
  error code, the sequence number), then ``m`` and ``e`` fp32 ``[T, H, 1]`` and ``o`` fp32 ``[T, H, D]``.
  A failed request (a move id the creditor does not hold) still replies with tensors of the full size, so the
  debtor's posted receive always completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from boundless.attention import cpu_attention
from boundless.attention.backend import window_start
from boundless.attention.partials import AttentionPartial, scores_partial
from boundless.kv.cache_dtype import FP8_DTYPES, from_cache, index_select, is_fp8

VERSION = 2
# Tags of DistAttention traffic: far above the handoff tags the dispatcher hands out (1, 3, 5, ...).
REQUEST_TAG = 0xF000_0000
_REPLY_BASE = 0xF100_0000
_REPLY_SPAN = 1 << 24
HEADER_LEN = 9
# Up to this many query rows (a step's decodes) the native kernel computes a creditor's partial, each row a
# one-token sequence reading every lent block; more rows (a prefill chunk's) go through matmuls, which read each
# block once for all rows: at 256 rows over 80 blocks, 15 ms against 26 ms a layer on one thread of this CPU.
NATIVE_MAX_ROWS = 8

STATUS_OK = 0
STATUS_UNKNOWN_MOVE = 1  # a move id the creditor holds no blocks for
STATUS_FAILED = 2  # the creditor failed computing


def reply_tag(seq: int) -> int:
    """A fresh tag per request, so that a reply that never comes cannot shift the later ones."""
    return _REPLY_BASE + seq % _REPLY_SPAN


@dataclass(frozen=True)
class LentBlocks:
    """The creditor's pool blocks that hold one move's blocks of a debtor's request (all full)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class QuerySegment:
    """Query rows of one request for one creditor, and the moves whose blocks they attend to there.
    ``first_position``: the position of the first row's token counted from the first key of those blocks (its
    rows' tokens follow each other); only a sliding window reads it."""

    num_rows: int
    move_ids: tuple[str, ...]
    first_position: int = 0

    def sees_any(self, num_keys: int, window: int | None) -> bool:
        """Whether a row of the segment sees one of the ``num_keys`` lent keys under ``window`` (its first row sees
        the most: the rows after it lie later)."""
        return window_start(self.first_position, window) < num_keys


def lent_partial(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: Sequence[int],
    scale: float,
    window: int | None = None,
    first_position: int = 0,
    softcap: float | None = None,
) -> AttentionPartial:
    """The partial of every row of ``q`` [T, heads, head_dim] over every token of the full blocks ``block_ids``
    of one layer's caches [kv_heads, blocks, block_size, head_dim]: m, e [T, heads, 1], o [T, heads, head_dim].
    With ``window``, row ``i`` sits at ``first_position + i`` counted from the blocks' first key and sees the keys
    within its window only (a row that sees none is an empty partial). ``softcap``: the model's cap of the scaled
    scores (Gemma 2's), or None."""
    t, h, d = q.shape
    kvh, _, bs, _ = k_cache.shape
    bias = None
    if window is not None and first_position + t - window > 0:
        # Some row's window starts past the first key (its last row's does first). Blocks before the first row's
        # window are seen by no row; the rest are masked row by row.
        skip = window_start(first_position, window) // bs
        block_ids = list(block_ids)[skip:]
        if not block_ids:  # (every row's window starts past the lent keys)
            return AttentionPartial(m=torch.zeros(t, h, 1), e=torch.zeros(t, h, 1), o=torch.zeros(t, h, d))
        first_position -= skip * bs
        rows = torch.arange(first_position, first_position + t).view(-1, 1)
        hidden = torch.arange(len(block_ids) * bs).view(1, -1) <= rows - window
        g = h // kvh  # (a kv head's query heads of every row form the query length below)
        bias = torch.zeros(t, len(block_ids) * bs).masked_fill_(hidden, float("-inf")).repeat_interleave(g, 0)
        bias = bias.unsqueeze(0).to(k_cache.device)
    num_tokens = len(block_ids) * bs
    if (
        bias is None
        and t <= NATIVE_MAX_ROWS
        and cpu_attention.supports(d, k_cache.device)
        and q.dtype == torch.float32
        and k_cache.dtype in (torch.float32, *FP8_DTYPES)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    ):
        # Each query row is a one-token sequence whose context is the lent blocks: the kernel's causal rule
        # (a row sees positions up to its own, the last) then lets every row see every lent token.
        batch = cpu_attention.make_batch([1] * t, [num_tokens] * t, [list(block_ids)] * t)
        return cpu_attention.paged_partial(q.contiguous(), k_cache, v_cache, batch, scale, softcap=softcap)
    # A request lands in host memory, in fp32; it is scored in the cache's type, or in fp32 over an 8-bit cache.
    q = q.to(device=k_cache.device, dtype=torch.float32 if is_fp8(k_cache.dtype) else k_cache.dtype)
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=k_cache.device)
    keys = from_cache(index_select(k_cache, 1, ids).reshape(kvh, num_tokens, d), q.dtype)
    values = from_cache(index_select(v_cache, 1, ids).reshape(kvh, num_tokens, d), q.dtype)
    g = h // kvh
    # kv heads form the batch; each kv head's query heads of every row form the query length.
    qg = q.view(t, kvh, g, d).permute(1, 0, 2, 3).reshape(kvh, t * g, d)
    part = scores_partial(qg, keys, values, scale, bias=None if bias is None else bias.to(q.dtype), softcap=softcap)

    def back(x: torch.Tensor) -> torch.Tensor:
        return x.view(kvh, t, g, -1).permute(1, 0, 2, 3).reshape(t, h, -1).float()

    return AttentionPartial(m=back(part.m), e=back(part.e), o=back(part.o))


# -- the messages -------------------------------------------------------------------------------------------


def request_header(
    seq: int, layer: int, num_rows: int, heads: int, head_dim: int, segments: int, id_bytes: int, window: int | None
) -> torch.Tensor:
    fields = [VERSION, seq, layer, num_rows, heads, head_dim, segments, id_bytes, window or 0]
    return torch.tensor(fields, dtype=torch.int64)


def encode_segments(
    segments: Sequence[QuerySegment],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows per segment, bytes of ids per segment, first positions per segment, and the ids' bytes."""
    encoded = [",".join(s.move_ids).encode() for s in segments]
    rows = torch.tensor([s.num_rows for s in segments], dtype=torch.int64)
    lens = torch.tensor([len(b) for b in encoded], dtype=torch.int64)
    positions = torch.tensor([s.first_position for s in segments], dtype=torch.int64)
    ids = torch.frombuffer(bytearray(b"".join(encoded)), dtype=torch.uint8)
    return rows, lens, positions, ids


def decode_segments(
    rows: torch.Tensor, lens: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor
) -> list[QuerySegment]:
    raw = bytes(ids.tolist())
    out, at = [], 0
    for n, length, first in zip(rows.tolist(), lens.tolist(), positions.tolist(), strict=True):
        out.append(QuerySegment(int(n), tuple(raw[at : at + length].decode().split(",")), int(first)))
        at += length
    return out
