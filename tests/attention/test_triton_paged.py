"""The Triton attention backend against a dense reference: decodes, prefill chunks over a cached
prefix, GQA, head sizes that are not powers of two, pages smaller and larger than a kernel tile,
context split over programs and merged, sliding windows; the log-sum-exp that comes out with the output.

On a machine without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest), on the CPU; with one, on CUDA."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from paged_cases import (
    MIXES,
    SHAPES,
    check_matches_dense,
    check_padding_row,
    fused_views,
    paged_case,
)

from boundless.attention import triton_paged

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_paged.available(DEVICE), reason="triton unavailable")

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _backend(shape, num_blocks: int, dtype: torch.dtype = torch.float32) -> triton_paged.TritonPagedAttention:
    heads, kv_heads, head_dim, block_size = shape
    return triton_paged.TritonPagedAttention(heads, kv_heads, head_dim, num_blocks, block_size, DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_matches_dense(shape, mix: str, dtype: torch.dtype) -> None:
    case = paged_case(0, *shape, MIXES[mix], dtype, DEVICE)
    backend = _backend(shape, case.cache[0].shape[1], dtype)
    meta = backend.prepare(case.batch)
    out = backend.forward(case.q, case.k, case.v, case.cache, meta)
    check_matches_dense(case, out, meta.lse, TOLERANCE[dtype])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mix", list(MIXES))
def test_an_fp8_cache_is_stored_rounded_and_read_as_it_holds_them(
    mix: str, dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    """``--kv-cache-dtype fp8``: the store kernel rounds the step's K/V into the 8-bit cache (saturated), and the
    attention kernel widens each tile it reads to the queries' type: the dense reference over the K/V as the cache
    holds them, in the model's precision."""
    shape = (8, 2, 64, 16)
    case = paged_case(2, *shape, MIXES[mix], dtype, DEVICE, kv_dtype)
    backend = _backend(shape, case.cache[0].shape[1], dtype)
    meta = backend.prepare(case.batch)
    out = backend.forward(case.q, case.k, case.v, case.cache, meta)
    check_matches_dense(case, out, meta.lse, TOLERANCE[dtype])


@pytest.mark.parametrize("decode_tile, prefill_tile", [(64, 16), (16, 64)])
def test_decodes_and_prefill_chunks_take_their_own_key_tiles(decode_tile: int, prefill_tile: int) -> None:
    """A step's decodes and prefill chunks each read keys in tiles of their kind's size (the H200's fastest differ:
    128 for a decode, 64 for a prefill), the decodes' context split over programs by their own tile: the dense
    reference's output either way."""
    shape = (8, 2, 64, 16)
    chunks = [(1, 1000), (1, 70), (20, 20), (9, 40), (16, 32)]
    batch, cache, q, k, v, expected, expected_lse = paged_case(5, *shape, chunks, torch.float32, DEVICE)
    backend = triton_paged.TritonPagedAttention(
        *shape[:3], cache[0].shape[1], shape[3], DEVICE, torch.float32,
        tiles=triton_paged.TileConfig(
            prefill_rows=32, prefill_kv_tile=prefill_tile, decode_kv_tile=decode_tile, prefill_warps=4, stages=1
        ),
    )  # fmt: skip
    backend.target_programs = 10**6  # (as if the GPU were huge: the decodes split by their tiles)
    meta = backend.prepare(batch)
    assert meta.launches[0].num_splits == {64: 4, 16: 15}[decode_tile]  # (4 tiles or more a split: 16 tiles, 63)
    out = backend.forward(q, k, v, cache, meta)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(meta.lse.double().cpu(), expected_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mask_every_tile", [False, True], ids=["masked-tiles-only", "every-tile-masked"])
def test_tiles_wholly_visible_take_no_mask(mask_every_tile: bool) -> None:
    """The kernel masks only the tiles a block of queries does not see whole (the causal diagonal, the context's
    end); the sweep's baseline masks every tile. Both are attention over the dense reference, for decodes whose
    context is split over programs (a split may hold no whole tile, or only whole ones) and chunks over a cached
    prefix whose blocks of queries start past several whole tiles."""
    shape = (8, 2, 64, 16)
    chunks = [(1, 1000), (1, 33), (1, 32), (70, 70), (40, 200), (16, 32)]
    batch, cache, q, k, v, expected, expected_lse = paged_case(7, *shape, chunks, torch.float32, DEVICE)
    tiles = dataclasses.replace(
        triton_paged.TileConfig.for_device(DEVICE, torch.float32), mask_every_tile=mask_every_tile
    )
    backend = triton_paged.TritonPagedAttention(
        *shape[:3], cache[0].shape[1], shape[3], DEVICE, torch.float32, tiles=tiles
    )
    backend.target_programs = 10**6  # (split the decodes' contexts: 3 of them)
    backend.max_splits = 3
    meta = backend.prepare(batch)
    assert meta.launches[0].num_splits == 3
    out = backend.forward(q, k, v, cache, meta)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(meta.lse.double().cpu(), expected_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mix", list(MIXES))
def test_a_launch_of_whole_prompts_starts_is_marked_fresh(mix: str) -> None:
    """``--flash-prefill`` takes a launch whose chunks each start their prompt (their keys are the step's own) to
    FlashAttention's variable-length kernel: such a launch is marked, with its longest chunk; a launch holding a
    chunk over a cached prefix, and decodes, are not."""
    shape = (8, 2, 64, 16)
    batch, cache, *_ = paged_case(0, *shape, MIXES[mix], torch.float32, DEVICE)
    meta = _backend(shape, cache[0].shape[1]).prepare(batch)
    for launch in meta.launches:
        chunks = MIXES[mix][len(MIXES[mix]) - len(launch.seq_lens) :] if launch.block_q > 1 else []
        assert launch.fresh == (bool(chunks) and all(q == ctx for q, ctx in chunks))
        assert launch.fresh == (mix == "prefills" and launch.block_q > 1)
        assert not launch.fresh or launch.max_query == max(q for q, _ in chunks)


@pytest.mark.parametrize("mix", ["prefills", "mixed"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_flash_prefill_takes_every_prefill_chunk_in_one_call(shape, mix: str) -> None:
    """``--flash-prefill``: a step's prefill chunks in one variable-length call (FlashAttention's on CUDA; here its
    dense equivalent, the same call): whole prompts over their own rows, chunks over a cached prefix over their
    contexts gathered from the cache. The dense reference's output and log-sum-exp, with q, k and v the strided views
    of a fused projection; decodes stay on the Triton kernel."""
    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        calls.append((q.shape[0], k.shape[0], cu_k.tolist()))
        lens_q, lens_k = torch.diff(cu_q).tolist(), torch.diff(cu_k).tolist()
        assert (max_q, max_k) == (max(lens_q), max(lens_k))  # (FlashAttention's grid is sized by them)
        return triton_paged.varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale)

    case = paged_case(3, *shape, MIXES[mix], torch.float32, DEVICE)
    heads, kv_heads, d, bs = shape
    backend = triton_paged.TritonPagedAttention(
        heads, kv_heads, d, case.cache[0].shape[1], bs, DEVICE, torch.float32, flash_prefill=True, varlen=varlen
    )
    meta = backend.prepare(case.batch)
    out = backend.forward(*fused_views(case.q, case.k, case.v), case.cache, meta)
    check_matches_dense(case, out, meta.lse, 2e-5)
    prefills = [(q, ctx) for q, ctx in MIXES[mix] if q > 1]
    contexts = [0]
    for _, ctx in prefills:
        contexts.append(contexts[-1] + ctx)
    assert calls == [(sum(q for q, _ in prefills), contexts[-1], contexts)]  # (fresh: the keys are the queries' rows)


def test_short_chunks_over_long_contexts_stay_on_the_triton_kernel() -> None:
    """A launch whose contexts hold more than ``GATHERED_KEYS_PER_QUERY`` keys per query row (a verify chunk of drafts,
    a short turn over a long history) is not gathered for FlashAttention: its copy would cost more than the attention
    it serves. The Triton kernel attends, with the dense reference's output."""
    shape = (8, 2, 64, 16)
    case = paged_case(8, *shape, [(1, 30), (4, 300), (3, 200)], torch.float32, DEVICE)

    def varlen(*args):
        raise AssertionError("the variable-length call was made")

    backend = triton_paged.TritonPagedAttention(
        *shape[:3], case.cache[0].shape[1], shape[3], DEVICE, torch.float32, flash_prefill=True, varlen=varlen
    )
    meta = backend.prepare(case.batch)
    assert triton_paged.GATHERED_KEYS_PER_QUERY * 7 < 500 and meta.launches[-1].key_start is None
    check_matches_dense(case, backend.forward(case.q, case.k, case.v, case.cache, meta), meta.lse, 2e-5)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="FlashAttention runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flashattentions_call_passes_the_start_up_check(dtype: torch.dtype) -> None:
    """The check ``--flash-prefill`` makes at start-up, on the device's own FlashAttention call."""
    assert triton_paged.check_varlen(triton_paged.flash_varlen, DEVICE, dtype) is None


def test_without_flash_prefill_every_chunk_takes_the_triton_kernel() -> None:
    """Without ``flash_prefill`` no launch has FlashAttention's keys, and the variable-length call is never made."""
    shape = (8, 2, 64, 16)
    case = paged_case(4, *shape, MIXES["mixed"], torch.float32, DEVICE)

    def varlen(*args):
        raise AssertionError("the variable-length call was made")

    backend = triton_paged.TritonPagedAttention(
        *shape[:3], case.cache[0].shape[1], shape[3], DEVICE, torch.float32, varlen=varlen
    )
    meta = backend.prepare(case.batch)
    assert all(launch.key_start is None and launch.key_slots is None for launch in meta.launches)
    check_matches_dense(case, backend.forward(case.q, case.k, case.v, case.cache, meta), meta.lse, 2e-5)


def test_the_start_up_check_refuses_a_call_that_masks_or_answers_otherwise() -> None:
    """``--flash-prefill``'s start-up check of the variable-length call: the reference passes; a call whose causal
    mask is aligned to the top left (a query over a longer context sees too little), one whose log-sum-exp is laid
    out [tokens, heads], and one that raises are each refused with what went wrong."""
    reference = triton_paged.varlen_reference
    assert triton_paged.check_varlen(reference, DEVICE, torch.float32) is None

    def top_left(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        outs, lses = [], []
        for i in range(len(cu_q) - 1):
            a, b, c = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i])
            one = torch.tensor([0, b - a], dtype=torch.int32)
            out, lse = reference(q[a:b], k[c : c + b - a], v[c : c + b - a], one, one, b - a, b - a, scale)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses, dim=1)

    def tokens_first(*args):
        out, lse = reference(*args)
        return out, lse.t()

    def missing(*args):
        raise RuntimeError("no such operator")

    assert "differs from attention computed densely" in triton_paged.check_varlen(top_left, DEVICE, torch.float32)
    assert "log-sum-exp came back (12, 4)" in triton_paged.check_varlen(tokens_first, DEVICE, torch.float32)
    assert triton_paged.check_varlen(missing, DEVICE, torch.float32) == "RuntimeError: no such operator"


def test_key_slots_lay_each_context_out_in_order() -> None:
    """The gathered keys of a launch: each sequence's context, position by position, through its block table."""
    tables = torch.tensor([[5, 2, 0], [7, 1, 3]], dtype=torch.int32)
    key_start = torch.tensor([0, 5, 14], dtype=torch.int32)  # contexts of 5 and 9, pages of 4
    slots = triton_paged.key_slots(tables, key_start, 14, 4)
    assert slots.tolist() == [20, 21, 22, 23, 8] + [28, 29, 30, 31, 4, 5, 6, 7, 12]
    cache = torch.arange(2 * 8 * 4 * 3, dtype=torch.float32).view(2, 8, 4, 3)  # [kv_heads, blocks, page, head_dim]
    keys = triton_paged.gather_keys(cache, slots)
    assert keys.shape == (14, 2, 3) and keys.is_contiguous()
    assert torch.equal(keys[4], cache[:, 2, 0]) and torch.equal(keys[13], cache[:, 3, 0])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="FlashAttention runs on CUDA")
@pytest.mark.parametrize("mix", ["prefills", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES[:1] + SHAPES[2:], ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_flash_prefill_matches_dense(shape, dtype: torch.dtype, mix: str) -> None:
    """A step's prefill chunks through FlashAttention's variable-length kernel (``flash_prefill``), whole prompts and
    chunks over a cached prefix (its causal mask from the bottom right), with q, k and v as the strided views of a
    fused projection the model passes: the dense reference's output and log-sum-exp, and the new tokens' KV stored in
    the cache for the steps after."""
    chunks = [(37, 37), (5, 5), (70, 70), (16, 16)] if mix == "prefills" else [(1, 50), (37, 90), (5, 5), (70, 300)]
    case = paged_case(2, *shape, chunks, dtype, DEVICE)
    heads, kv_heads, d, bs = shape
    backend = triton_paged.TritonPagedAttention(
        heads, kv_heads, d, case.cache[0].shape[1], bs, DEVICE, dtype, flash_prefill=True
    )
    meta = backend.prepare(case.batch)
    prefill = meta.launches[-1]
    assert prefill.key_start is not None and prefill.fresh == (mix == "prefills")
    views = fused_views(case.q, case.k, case.v)
    assert triton_paged._flash_aligned(*views)  # (FlashAttention takes them: not the Triton kernel's fallback)
    out = backend.forward(*views, case.cache, meta)
    check_matches_dense(case, out, meta.lse, TOLERANCE[dtype])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("mix", ["prefills", "mixed"])
def test_flash_prefill_over_an_fp8_cache_attends_over_what_it_holds(mix: str, kv_dtype: torch.dtype) -> None:
    """``--flash-prefill`` with ``--kv-cache-dtype fp8``: a fresh launch's own keys rounded as the cache holds them, a
    launch over cached prefixes gathered from the 8-bit cache (as its bytes) and widened, for FlashAttention's call
    (on CUDA; elsewhere the float64 reference call): attention over the K/V as the cache holds them."""
    chunks = [(37, 37), (5, 5), (70, 70), (16, 16)] if mix == "prefills" else [(1, 50), (37, 90), (5, 5), (70, 300)]
    shape = (8, 2, 64, 16)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    case = paged_case(2, *shape, chunks, dtype, DEVICE, kv_dtype)
    varlen = triton_paged.flash_varlen if DEVICE.type == "cuda" else triton_paged.varlen_reference
    backend = triton_paged.TritonPagedAttention(
        *shape[:3], case.cache[0].shape[1], shape[3], DEVICE, dtype, flash_prefill=True, varlen=varlen
    )
    meta = backend.prepare(case.batch)
    prefill = meta.launches[-1]
    assert prefill.key_start is not None and (prefill.key_slots is None) == (mix == "prefills")
    views = fused_views(case.q, case.k, case.v)
    assert triton_paged.flash_takes(prefill, *views)
    out = backend.forward(*views, case.cache, meta)
    check_matches_dense(case, out, meta.lse, TOLERANCE[dtype])


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_context_merges_exactly(splits: int) -> None:
    """Decodes whose context is split over programs: the merged partials are attention over the whole."""
    shape = (8, 2, 64, 16)
    chunks = [(1, 1000), (1, 5), (1, 129), (4, 40)]
    batch, cache, q, k, v, expected, expected_lse = paged_case(splits, *shape, chunks, torch.float32, DEVICE)
    backend = _backend(shape, cache[0].shape[1])
    backend.target_programs = 10**6  # as if the GPU were huge: always split
    backend.max_splits = splits
    meta = backend.prepare(batch)
    assert meta.launches[0].num_splits == splits and meta.launches[1].num_splits == 1
    out = backend.forward(q, k, v, cache, meta)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(meta.lse.double().cpu(), expected_lse, rtol=2e-5, atol=2e-5)


def test_takes_strided_views_of_fused_qkv() -> None:
    """The model hands over q, k, v as views into its fused qkv rows."""
    heads, kv_heads, d, bs = 8, 2, 64, 16
    batch, cache, q, k, v, expected, _ = paged_case(5, heads, kv_heads, d, bs, MIXES["mixed"], torch.float32, DEVICE)
    backend = _backend((heads, kv_heads, d, bs), cache[0].shape[1])
    out = backend.forward(*fused_views(q, k, v), cache, backend.prepare(batch))
    torch.testing.assert_close(out.double().cpu(), expected, rtol=2e-5, atol=2e-5)


def test_padding_rows_store_nothing_and_attend_to_nothing() -> None:
    """A CUDA graph pads its batch: slot -1 stores nothing, and a sequence of length 0 yields zeros."""
    check_padding_row(lambda num_blocks: _backend((4, 2, 16, 16), num_blocks), DEVICE)


def test_views_flashattention_cannot_read_go_to_the_triton_kernel() -> None:
    """FlashAttention reads 16 bytes at a time: q, k, v whose rows or heads are not 8 elements apart, or that start
    off a 16-byte address, are not handed to it (a misaligned read would fault the device)."""
    fused = torch.zeros(10, 3 * 64 + 8, dtype=torch.float16, device=DEVICE)
    aligned = fused[:, :64].view(10, 1, 64)
    assert triton_paged._flash_aligned(aligned, aligned, aligned)
    assert not triton_paged._flash_aligned(aligned, fused[:, 1:65].view(10, 1, 64), aligned)  # 2 bytes in
    odd_rows = torch.zeros(10, 1, 68, dtype=torch.float16, device=DEVICE)[:, :, :64]  # rows 68 elements apart
    assert not triton_paged._flash_aligned(aligned, aligned, odd_rows)


# Sliding windows (a query at p sees keys p - window < j <= p): the interpreter's tiles are 32 keys, pages 16, 4 or 64.
# A subset of shape x mix x window (the interpreter is slow): a window of one key, one within a page, one across pages
# and tiles, one past every context; in fp32, and fp16 for two.
WINDOW_CASES = (
    [(SHAPES[0], mix, window, torch.float32) for mix in MIXES for window in (1, 5, 45, 1000)]
    + [(SHAPES[1], mix, window, torch.float32) for mix in MIXES for window in (3, 45)]
    + [(SHAPES[2], mix, window, torch.float32) for mix in MIXES for window in (40, 150)]
    + [(SHAPES[0], "mixed", 45, torch.float16), (SHAPES[2], "decodes", 150, torch.float16)]
)


@pytest.mark.parametrize(
    "shape, mix, window, dtype",
    WINDOW_CASES,
    ids=["h{}kv{}d{}bs{}-{}-w{}-{}".format(*s, m, w, str(d).split(".")[-1]) for s, m, w, d in WINDOW_CASES],
)
def test_a_sliding_window_matches_dense(shape, mix: str, window: int, dtype: torch.dtype) -> None:
    """A windowed layer (``forward``'s ``window``): the dense reference's output and log-sum-exp over each query's
    window, for the metadata every layer of the step shares."""
    case = paged_case(0, *shape, MIXES[mix], dtype, DEVICE, window=window)
    backend = _backend(shape, case.cache[0].shape[1], dtype)
    meta = backend.prepare(case.batch)
    out = backend.forward(case.q, case.k, case.v, case.cache, meta, window)
    check_matches_dense(case, out, meta.lse, TOLERANCE[dtype])


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("mix", list(MIXES))
def test_gemma2s_capped_scores_at_its_own_scale(mix: str, window: int | None) -> None:
    """Gemma 2's attention: scores at the model's own scale, capped (``SOFTCAP``, in the scores' own units though the
    kernel keeps them in log2's), before the mask; decodes, splits and prefill chunks, within a window or not."""
    shape, scale, cap = (4, 2, 32, 16), 12**-0.5, 2.0
    case = paged_case(5, *shape, MIXES[mix], torch.float32, DEVICE, window=window, scale=scale, softcap=cap)
    heads, kv_heads, head_dim, block_size = shape
    backend = triton_paged.TritonPagedAttention(
        heads, kv_heads, head_dim, case.cache[0].shape[1], block_size, DEVICE, torch.float32, scale=scale, softcap=cap
    )
    meta = backend.prepare(case.batch)
    out = backend.forward(case.q, case.k, case.v, case.cache, meta, window)
    check_matches_dense(case, out, meta.lse, TOLERANCE[torch.float32])
    uncapped = paged_case(5, *shape, MIXES[mix], torch.float32, DEVICE, window=window, scale=scale)
    assert not torch.allclose(out.double().cpu(), uncapped.expected, atol=1e-3)


def test_a_window_is_not_the_whole_context() -> None:
    """The window is applied, not ignored: a window of one key is each query's own value (its score the log-sum-exp),
    and a window of a few keys differs from attention over the whole context; the same metadata without a window is
    attention over the whole context."""
    shape = (8, 2, 64, 16)
    chunks = MIXES["mixed"]
    whole = paged_case(1, *shape, chunks, torch.float32, DEVICE)
    backend = _backend(shape, whole.cache[0].shape[1])
    meta = backend.prepare(whole.batch)
    own = backend.forward(whole.q, whole.k, whole.v, whole.cache, meta, 1)
    v = whole.v.repeat_interleave(shape[0] // shape[1], dim=1)
    torch.testing.assert_close(own, v, rtol=2e-5, atol=2e-5)
    scores = (whole.q * whole.k.repeat_interleave(shape[0] // shape[1], dim=1)).sum(-1) * shape[2] ** -0.5
    torch.testing.assert_close(meta.lse, scores, rtol=2e-5, atol=2e-5)
    windowed = paged_case(1, *shape, chunks, torch.float32, DEVICE, window=7)
    assert torch.equal(windowed.q, whole.q) and torch.equal(windowed.k, whole.k)  # (the same step)
    assert (windowed.expected - whole.expected).abs().max() > 0.1
    out = backend.forward(windowed.q, windowed.k, windowed.v, windowed.cache, meta, 7)
    check_matches_dense(windowed, out, meta.lse, 2e-5)
    check_matches_dense(whole, backend.forward(whole.q, whole.k, whole.v, whole.cache, meta), meta.lse, 2e-5)


@pytest.mark.parametrize("splits", [3, 7])
def test_a_windowed_decodes_splits_share_its_windows_tiles(splits: int) -> None:
    """A windowed decode whose context is split over programs splits the tiles from its window's first, not from the
    context's: the leading splits each hold part of the window (a finite log-sum-exp), those past its tiles none
    (merged as empty), and the merge is attention over the window."""
    shape = (8, 2, 64, 16)
    window = 100
    chunks = [(1, 1000), (1, 5), (1, 129), (4, 40)]
    case = paged_case(splits, *shape, chunks, torch.float32, DEVICE, window=window)
    backend = _backend(shape, case.cache[0].shape[1])
    backend.target_programs = 10**6  # as if the GPU were huge: always split
    backend.max_splits = splits
    meta = backend.prepare(case.batch)
    decodes = meta.launches[0]
    assert decodes.num_splits == splits and meta.launches[1].num_splits == 1
    check_matches_dense(case, backend.forward(case.q, case.k, case.v, case.cache, meta, window), meta.lse, 2e-5)
    tile = backend.tiles.decode_kv_tile
    tiles = (1000 - 1) // tile - (1000 - window) // tile + 1  # the window's tiles of the 1000-key decode
    per_split = -(-tiles // splits)
    busy = -(-tiles // per_split)
    assert decodes.part_lse is not None
    seen = torch.isfinite(decodes.part_lse[:, 0]).all(dim=-1).tolist()
    assert seen == [True] * busy + [False] * (splits - busy)


@pytest.mark.parametrize("mask_every_tile", [False, True], ids=["masked-tiles-only", "every-tile-masked"])
def test_a_window_masks_the_tiles_its_start_cuts(mask_every_tile: bool) -> None:
    """Under a window the tiles a block of queries sees whole lie between its last query's window start and its first
    query: those before (the window's start cuts them) are masked too, and the tiles before its first query's window
    are not read. Blocks of chunks over a cached prefix, whole prompts, decodes split over programs; with the mask on
    every tile alike."""
    shape = (8, 2, 64, 16)
    window = 50
    chunks = [(1, 1000), (1, 33), (70, 70), (40, 200), (16, 32)]
    case = paged_case(7, *shape, chunks, torch.float32, DEVICE, window=window)
    tiles = dataclasses.replace(
        triton_paged.TileConfig.for_device(DEVICE, torch.float32), mask_every_tile=mask_every_tile
    )
    backend = triton_paged.TritonPagedAttention(
        *shape[:3], case.cache[0].shape[1], shape[3], DEVICE, torch.float32, tiles=tiles
    )
    backend.target_programs = 10**6
    backend.max_splits = 3
    meta = backend.prepare(case.batch)
    check_matches_dense(case, backend.forward(case.q, case.k, case.v, case.cache, meta, window), meta.lse, 2e-5)


@pytest.mark.parametrize("mix", ["prefills", "mixed"])
def test_a_windowed_layer_of_flash_prefill_takes_the_triton_kernel(mix: str) -> None:
    """``--flash-prefill``: the variable-length call has no window, so a windowed layer's prefill chunks take the
    Triton kernel (the windowed reference's output), while the step's layers without a window take the call."""
    shape = (8, 2, 64, 16)
    window = 20
    calls = []

    def varlen(*args):
        calls.append(args[0].shape[0])
        return triton_paged.varlen_reference(*args)

    case = paged_case(3, *shape, MIXES[mix], torch.float32, DEVICE, window=window)
    backend = triton_paged.TritonPagedAttention(
        *shape[:3], case.cache[0].shape[1], shape[3], DEVICE, torch.float32, flash_prefill=True, varlen=varlen
    )
    meta = backend.prepare(case.batch)
    views = fused_views(case.q, case.k, case.v)
    prefill = meta.launches[-1]
    assert triton_paged.flash_takes(prefill, *views) and not triton_paged.flash_takes(prefill, *views, window)
    check_matches_dense(case, backend.forward(*views, case.cache, meta, window), meta.lse, 2e-5)
    assert calls == []
    backend.forward(*views, case.cache, meta)  # (a layer without a window: the call)
    assert calls == [prefill.end - prefill.start]


def test_a_cuda_graphs_decode_metadata_takes_the_window_through_forward() -> None:
    """A CUDA graph's decode metadata (``decode_metadata``, over buffers refilled before each replay) is the same for
    every layer: a windowed layer's window reaches the kernel through ``forward``, its context split as the graph's
    longest context sets, padding rows attending to nothing."""
    shape = (4, 2, 16, 16)
    window = 24
    chunks = [(1, 300), (1, 17), (1, 64)]
    case = paged_case(9, *shape, chunks, torch.float32, DEVICE, window=window)
    backend = _backend(shape, case.cache[0].shape[1])
    backend.target_programs = 10**6
    n, width = 4, 32  # a padding row; tables as wide as the graph's longest context
    tables = torch.zeros(n, width, dtype=torch.int32)
    for i, table in enumerate(case.batch.block_tables):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    meta = backend.decode_metadata(
        torch.cat([case.batch.slot_mapping, torch.tensor([-1], device=DEVICE)]),
        tables.to(DEVICE),
        torch.tensor([*case.batch.seq_lens, 0], dtype=torch.int32, device=DEVICE),
        torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
        torch.arange(n, dtype=torch.int32, device=DEVICE),
        width * shape[3],
    )
    assert meta.launches[0].num_splits > 1
    q, k, v = (torch.cat([x, torch.randn(1, *x.shape[1:], device=DEVICE)]) for x in (case.q, case.k, case.v))
    out = backend.forward(q, k, v, case.cache, meta, window)
    torch.testing.assert_close(out[:3].double().cpu(), case.expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(meta.lse[:3].double().cpu(), case.expected_lse, rtol=2e-5, atol=2e-5)
    assert torch.equal(out[3].cpu(), torch.zeros(shape[0], shape[2])) and meta.lse[3].eq(-math.inf).all()


def test_a_window_holds_at_least_one_key() -> None:
    """A window of no keys is a caller's mistake (no window is None), refused before anything is stored."""
    shape = (4, 2, 16, 16)
    case = paged_case(0, *shape, [(1, 5)], torch.float32, DEVICE)
    backend = _backend(shape, case.cache[0].shape[1])
    with pytest.raises(ValueError, match="at least one key"):
        backend.forward(case.q, case.k, case.v, case.cache, backend.prepare(case.batch), 0)
