"""Triton kernels for paged attention on the GPU: KV store, attention with log-sum-exp, split merge.

One attention kernel serves decodes and prefill chunks alike. Its programs each take a block of
query tokens of one sequence and one kv head; the rows of the block are (token, query head of that
kv head's group) pairs, so grouped-query attention reads each K/V tile once for the whole group and
copies nothing. K/V tiles are read straight from the paged cache through the block table (a tile
spans several pages), with an online softmax. Each program returns, with the output, the
log-sum-exp of its scores: a partial in the sense of :mod:`boundless.attention.partials` (``m =
lse``, ``e = 1``). Long decodes split their context over several programs (flash-decoding), whose
partials :func:`merge_splits_kernel` merges exactly.

A sliding-window layer (``WINDOW``, :mod:`boundless.attention.backend`'s rule: a query at position ``p`` sees keys
``p - WINDOW < j <= p``) reads only the tiles from the one holding its block's first window start, and splits those
over its programs; ``WINDOW = 0`` (no window, the default) reads and masks the tiles as before.

The kernels run on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (how the tests check them
where there is no GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the host scales scores by it, so the kernel can use exp2
# Globals a kernel reads must be constexpr.
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    DIM_POW2: tl.constexpr,
    SATURATE: tl.constexpr = 0.0,  # an 8-bit cache's largest value: K/V clamped to it before the cast (0: none)
):
    """One program per token: its K and V (all kv heads) into cache slot ``slot_ptr[t]``; a slot
    of -1 (a padding row) stores nothing. Cache layout [kv_heads, blocks * block_size, head_dim]."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, HEADS_POW2)
        d = tl.arange(0, DIM_POW2)
        mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        src = h[:, None] * HEAD_DIM + d[None, :]
        dst = h[:, None].to(tl.int64) * stride_cache_head + slot * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + src, mask=mask)
        v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + src, mask=mask)
        if SATURATE > 0:
            k = tl.minimum(tl.maximum(k.to(tl.float32), -SATURATE), SATURATE)
            v = tl.minimum(tl.maximum(v.to(tl.float32), -SATURATE), SATURATE)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, tile, k_cache_ptr, v_cache_ptr, table, cache_head, stride_cache_block, kv_lo, kv_len, q_pos,
    dims, dim_ok, scale_log2,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    MASKED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One tile of keys into a block's online softmax. ``MASKED``: keys past the context, after a row's query or (with
    ``WINDOW``) before its window are left out, and keys before ``kv_lo`` (in no row's window) are not read (else the
    caller knows every row sees the whole tile: no mask, no test for rows that see nothing)."""
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = n < kv_len
        if WINDOW > 0:  # (pages no row's window reaches are not read: whatever they hold, NaNs too, stays out)
            n_ok = n_ok & (n >= kv_lo)
        block = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & dim_ok[None, :]
    else:
        block = tl.load(table + n // PAGE).to(tl.int64)
        kv_mask = dim_ok[None, :]
    offs = cache_head + block * stride_cache_block + (n % PAGE) * HEAD_DIM
    # (Read in the queries' type: a no-op for a cache in the model's, a widening for an 8-bit one.)
    k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if SOFTCAP > 0:  # Gemma 2's cap of the scaled score, in its own units (not log2's): tanh(x) = 2 sigmoid(2x) - 1
        s = (2.0 * tl.sigmoid(s * (2.0 * LN2 / SOFTCAP)) - 1.0) * (SOFTCAP / LN2)
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if WINDOW > 0:
            visible = visible & (n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def paged_attention_kernel(
    out_ptr,  # [tokens, heads, head_dim], or [splits, tokens, heads, head_dim] fp32 when SPLIT
    lse_ptr,  # [tokens, heads] fp32, or [splits, tokens, heads] when SPLIT
    q_ptr,  # [tokens, heads, head_dim] (strided rows)
    k_cache_ptr,  # [kv_heads, blocks, block_size, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [seqs, max_blocks] int32
    seq_lens_ptr,  # [seqs] int32: context length after the step (cached + new tokens)
    query_start_ptr,  # [seqs + 1] int32: first token of each sequence in q
    q_block_seq_ptr,  # [programs along axis 0] int32: the sequence of each query block
    q_block_start_ptr,  # [programs along axis 0] int32: the first token of each query block
    scale_log2,  # softmax scale * log2(e)
    num_tokens,  # rows of q (the split scratch's stride)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cache_head,
    stride_cache_block,
    GROUP: tl.constexpr,  # query heads per kv head
    NUM_HEADS: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * GROUP, rounded up to a power of two (>= 16)
    BLOCK_N: tl.constexpr,  # keys per tile (a multiple of PAGE or a divisor of it)
    PAGE: tl.constexpr,  # tokens per KV block
    HEAD_DIM: tl.constexpr,
    DIM_POW2: tl.constexpr,
    SPLIT: tl.constexpr,  # write partials per split (merged by merge_splits_kernel)
    PRECISION: tl.constexpr,  # "ieee" for fp32 dots in full precision (not tf32); None: the default
    MASK_EVERY_TILE: tl.constexpr = False,  # the mask on every tile, as before 5 December (the tile sweep's baseline)
    WINDOW: tl.constexpr = 0,  # a sliding window: a query at position p sees keys p - WINDOW < j <= p (0: none)
    SOFTCAP: tl.constexpr = 0.0,  # a cap of the scaled scores, SOFTCAP * tanh(score / SOFTCAP) (0: none)
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq = tl.load(q_block_seq_ptr + pid)
    first = tl.load(q_block_start_ptr + pid)
    seq_start = tl.load(query_start_ptr + seq)
    seq_end = tl.load(query_start_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - (seq_end - seq_start)  # position of the sequence's first query token

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < seq_end)
    q_pos = context_start + token - seq_start  # each row sees keys at positions <= q_pos
    dims = tl.arange(0, DIM_POW2)
    dim_ok = dims < HEAD_DIM
    token64 = token.to(tl.int64)
    q = tl.load(
        q_ptr + token64[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # Keys this block can see: up to the position of its last token; under a window, from its first token's window
    # start (no row sees a key before it). The splits share the tiles from the one holding that start.
    first_pos = context_start + first - seq_start
    last = tl.minimum(first + BLOCK_Q, seq_end) - 1
    last_pos = context_start + last - seq_start
    kv_len = tl.maximum(last_pos + 1, 0)
    num_tiles = tl.cdiv(kv_len, BLOCK_N)
    if WINDOW > 0:
        kv_lo = tl.maximum(first_pos - WINDOW + 1, 0)
        tile_start = kv_lo // BLOCK_N
    else:
        kv_lo = 0
        tile_start = 0
    per_split = tl.cdiv(num_tiles - tile_start, num_splits)
    tile_lo = tile_start + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_POW2], tl.float32)
    cache_head = kv_head.to(tl.int64) * stride_cache_head
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Tiles every row of the block sees whole (keys at or before its first query, all in the context; under a window,
    # at or after its last query's window start) take no mask: the causal diagonal and the context's end lie in the
    # last one or two tiles, a window's start in the first one or two. Tiles [open_lo, open_hi) of the split's.
    if MASK_EVERY_TILE:
        open_lo = tile_lo
        open_hi = tile_lo
    else:
        if WINDOW > 0:
            open_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(last_pos - WINDOW + 1, 0), BLOCK_N), tile_lo), tile_hi)
        else:
            open_lo = tile_lo
        whole = tl.minimum(first_pos + 1, kv_len) // BLOCK_N
        open_hi = tl.minimum(tl.maximum(whole, open_lo), tile_hi)
    if WINDOW > 0:
        for tile in range(tile_lo, open_lo):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, tile, k_cache_ptr, v_cache_ptr, table, cache_head, stride_cache_block, kv_lo, kv_len,
                q_pos, dims, dim_ok, scale_log2, BLOCK_N, PAGE, HEAD_DIM, PRECISION, True, WINDOW, SOFTCAP,
            )  # fmt: skip
    for tile in range(open_lo, open_hi):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, tile, k_cache_ptr, v_cache_ptr, table, cache_head, stride_cache_block, kv_lo, kv_len,
            q_pos, dims, dim_ok, scale_log2, BLOCK_N, PAGE, HEAD_DIM, PRECISION, False, WINDOW, SOFTCAP,
        )  # fmt: skip
    for tile in range(open_hi, tile_hi):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, tile, k_cache_ptr, v_cache_ptr, table, cache_head, stride_cache_block, kv_lo, kv_len,
            q_pos, dims, dim_ok, scale_log2, BLOCK_N, PAGE, HEAD_DIM, PRECISION, True, WINDOW, SOFTCAP,
        )  # fmt: skip

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    o_offs = token64[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    lse_offs = token64 * NUM_HEADS + head
    o_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        part = split.to(tl.int64) * num_tokens
        tl.store(out_ptr + part * (NUM_HEADS * HEAD_DIM) + o_offs, out, mask=o_mask)
        tl.store(lse_ptr + part * NUM_HEADS + lse_offs, lse, mask=row_ok)
    else:
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
        tl.store(lse_ptr + lse_offs, lse, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    out_ptr,  # [tokens, heads, head_dim]
    lse_ptr,  # [tokens, heads] fp32
    part_out_ptr,  # [splits, tokens, heads, head_dim] fp32, each normalized by its own sum
    part_lse_ptr,  # [splits, tokens, heads] fp32
    num_tokens,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_POW2: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
):
    """The exact merge of a row's split partials: weights exp(lse_s - max), renormalized."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_POW2)
    s_ok = s < num_splits
    row = s.to(tl.int64) * num_tokens * NUM_HEADS + t * NUM_HEADS + h
    lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, axis=0)
    dims = tl.arange(0, DIM_POW2)
    dim_ok = dims < HEAD_DIM
    o = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=s_ok[:, None] & dim_ok[None, :], other=0.0)
    merged = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, merged.to(out_ptr.dtype.element_ty), mask=dim_ok)
    log_total = tl.log(tl.where(total > 0.0, total, 1.0))  # (a row no split saw, a padding row's: no log of 0)
    tl.store(lse_ptr + t * NUM_HEADS + h, tl.where(total > 0.0, m_safe + log_total, float("-inf")))
