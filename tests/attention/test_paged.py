"""Paged attention against a dense reference: the native CPU kernel and the PyTorch path, decodes
and prefill chunks (with and without a cached prefix), GQA, several head sizes and block sizes;
and partials over disjoint parts of the context merging into attention over their union."""

from __future__ import annotations

import random

import pytest
import torch
from paged_cases import PagedCase, check_matches_dense, paged_case

from boundless.attention import cpu_attention
from boundless.attention.backend import padded_table
from boundless.attention.paged import TorchPagedAttention
from boundless.attention.partials import AttentionPartial, combine_partials, merge_partials, scores_partial

pytestmark = pytest.mark.usefixtures("parallel_native_kernels")  # (the native kernels' parallel loops too)


def _case(seed: int, heads: int, kv_heads: int, head_dim: int, block_size: int, chunks: list[tuple[int, int]]):
    batch, cache, q, k, v, expected, _ = paged_case(seed, heads, kv_heads, head_dim, block_size, chunks)
    return batch, cache, q, k, v, expected


SHAPES = [
    # heads, kv heads, head dim, block size
    (9, 3, 64, 16),
    (4, 2, 16, 16),
    (4, 4, 16, 4),
    (8, 2, 128, 32),
    (2, 1, 24, 8),  # a head size the kernel has no specialization for
]
MIXES = {
    "decodes": [(1, 1), (1, 17), (1, 200), (1, 64), (1, 33)],
    "prefills": [(37, 37), (5, 5), (128, 128)],
    "mixed": [(1, 70), (1, 3), (20, 20), (9, 40), (16, 16 + 16)],  # chunked prefill over a cached prefix
}


def _backend(heads: int, kv_heads: int, head_dim: int, cache: tuple[torch.Tensor, torch.Tensor]):
    return TorchPagedAttention(heads, kv_heads, head_dim, cache[0].shape[1])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_paged_attention_matches_dense(
    shape: tuple[int, int, int, int], mix: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    heads, kv_heads, head_dim, block_size = shape
    if native and not cpu_attention.supports(head_dim, torch.device("cpu")):
        pytest.skip("native attention kernel unavailable here")
    if not native:
        monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    batch, cache, q, k, v, expected = _case(0, heads, kv_heads, head_dim, block_size, MIXES[mix])
    backend = _backend(heads, kv_heads, head_dim, cache)
    meta = backend.prepare(batch)
    assert (meta.native is not None) == native
    out = backend.forward(q, k, v, cache, meta)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-5)
    # The new keys and values landed in their slots.
    kvh, nb, bs, d = cache[0].shape
    torch.testing.assert_close(cache[0].view(kvh, nb * bs, d)[:, batch.slot_mapping], k.transpose(0, 1))
    torch.testing.assert_close(cache[1].view(kvh, nb * bs, d)[:, batch.slot_mapping], v.transpose(0, 1))


def test_native_takes_strided_queries_and_keys() -> None:
    """The model hands over q, k, v as views into its fused qkv rows."""
    if not cpu_attention.supports(64, torch.device("cpu")):
        pytest.skip("native attention kernel unavailable here")
    heads, kv_heads, d = 9, 3, 64
    batch, cache, q, k, v, expected = _case(1, heads, kv_heads, d, 16, MIXES["mixed"])
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qs, ks, vs = (x.view(x.shape[0], -1, d) for x in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1))
    backend = _backend(heads, kv_heads, d, cache)
    out = backend.forward(qs, ks, vs, cache, backend.prepare(batch))
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-5)


def test_native_partial_statistics() -> None:
    """m is the largest scaled score and e the sum of exp(score - m), per query row."""
    if not cpu_attention.supports(16, torch.device("cpu")):
        pytest.skip("native attention kernel unavailable here")
    heads, kv_heads, d = 4, 2, 16
    batch, cache, q, k, v, _ = _case(2, heads, kv_heads, d, 4, [(1, 9), (3, 7)])
    backend = _backend(heads, kv_heads, d, cache)
    cpu_attention.store_kv(k, v, cache[0], cache[1], batch.slot_mapping)
    nb = cpu_attention.make_batch(batch.query_lens, batch.seq_lens, batch.block_tables)
    part = cpu_attention.paged_partial(q, cache[0], cache[1], nb, backend.scale)
    row = 0
    for ql, ctx, table in zip(batch.query_lens, batch.seq_lens, batch.block_tables, strict=True):
        keys = torch.stack([cache[0][:, table[p // 4], p % 4] for p in range(ctx)])  # [ctx, kvh, d]
        for i in range(ql):
            pos = ctx - ql + i
            for h in range(heads):
                s = keys[: pos + 1, h // 2] @ q[row, h] * backend.scale
                torch.testing.assert_close(part.m[row, h, 0], s.max(), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(part.e[row, h, 0], (s - s.max()).exp().sum(), rtol=1e-5, atol=1e-5)
            row += 1


@pytest.mark.parametrize("mix", list(MIXES))
def test_native_finish_in_place_equals_merge_partials(mix: str) -> None:
    """With nothing to merge, the kernel divides o by e itself: the same bits merge_partials gives."""
    if not cpu_attention.supports(64, torch.device("cpu")):
        pytest.skip("native attention kernel unavailable here")
    heads, kv_heads, d = 9, 3, 64
    batch, cache, q, k, v, expected = _case(3, heads, kv_heads, d, 16, MIXES[mix])
    nb = cpu_attention.make_batch(batch.query_lens, batch.seq_lens, batch.block_tables)
    scale = d**-0.5
    cpu_attention.store_kv(k, v, cache[0], cache[1], batch.slot_mapping)
    reference = merge_partials([cpu_attention.paged_partial(q, cache[0], cache[1], nb, scale)])
    t = q.shape[0]
    out = (torch.full((t, heads, d), float("nan")), torch.empty(t, heads, 1), torch.empty(t, heads, 1))
    part = cpu_attention.store_and_attend(
        q, k, v, cache[0], cache[1], batch.slot_mapping, nb, scale, out, normalize=True
    )
    assert torch.equal(part.o, reference)
    torch.testing.assert_close(part.o.double(), expected, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("parts", [1, 2, 5])
def test_merge_of_partials_is_attention_over_the_union(parts: int) -> None:
    gen = torch.Generator().manual_seed(parts)
    n, length, ctx, d = 6, 3, 50, 32
    q = torch.randn(n, length, d, generator=gen)
    k = torch.randn(n, ctx, d, generator=gen)
    v = torch.randn(n, ctx, d, generator=gen)
    scale = d**-0.5
    cuts = sorted(random.Random(parts).sample(range(1, ctx), parts - 1))
    bounds = list(zip([0, *cuts], [*cuts, ctx], strict=True))
    partials = [scores_partial(q, k[:, a:b], v[:, a:b], scale) for a, b in bounds]
    expected = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1) @ v
    torch.testing.assert_close(merge_partials(partials), expected, rtol=1e-5, atol=1e-5)
    out = torch.empty_like(expected)
    assert merge_partials(partials, out=out) is out
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # Merging is associative: merging merged halves gives the same partial.
    if parts > 2:
        left, right = combine_partials(partials[:2]), combine_partials(partials[2:])
        torch.testing.assert_close(merge_partials([left, right]), expected, rtol=1e-5, atol=1e-5)


def test_empty_partial_contributes_nothing() -> None:
    o = torch.randn(2, 3, 8)
    full = AttentionPartial(m=torch.zeros(2, 3, 1), e=torch.full((2, 3, 1), 2.0), o=o)
    empty = AttentionPartial(m=torch.zeros(2, 3, 1), e=torch.zeros(2, 3, 1), o=torch.zeros(2, 3, 8))
    torch.testing.assert_close(merge_partials([full, empty]), o / 2)


def test_padded_table_lays_rows_out_with_zeros() -> None:
    """A step's block tables as one flat list (the backends' and the graph buffers' one tensor): rows in order, each
    padded to the width, empty rows all zeros."""
    assert padded_table([[4, 5], [], [7, 8, 9]], 3) == [4, 5, 0, 0, 0, 0, 7, 8, 9]
    assert padded_table([(1,)], 1) == [1] and padded_table([], 4) == []


KV_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:], ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_a_cache_in_another_type_is_read_as_it_holds_keys_and_values(
    shape: tuple[int, int, int, int], mix: str, kv_dtype: torch.dtype, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--kv-cache-dtype``: an fp32 model's K/V held in 8 or 16 bits. The step's new K/V are stored rounded, and
    attention (whole and as partials) is the dense reference's over the K/V as the cache holds them, a prompt's own
    new keys too: a chunk reads what a later chunk of the same prompt would. The native kernel widens 8-bit blocks
    through the type's table of values (a 16-bit cache takes the PyTorch path)."""
    heads, kv_heads, head_dim, block_size = shape
    if native and not cpu_attention.supports(head_dim, torch.device("cpu")):
        pytest.skip("native attention kernel unavailable here")
    if not native:
        monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    case = paged_case(3, heads, kv_heads, head_dim, block_size, MIXES[mix], torch.float32, "cpu", kv_dtype)
    assert case.cache[0].dtype == kv_dtype
    backend = _backend(heads, kv_heads, head_dim, case.cache)
    before = [c.clone() for c in case.cache]
    out = backend.forward(case.q, case.k, case.v, case.cache, backend.prepare(case.batch))
    check_matches_dense(case, out, case.expected_lse, 2e-5, check_lse=False)
    for c, b in zip(case.cache, before, strict=True):
        c.copy_(b)
    part = backend.forward_partial(case.q, case.k, case.v, case.cache, backend.prepare(case.batch))
    torch.testing.assert_close(merge_partials([part]).double(), case.expected, rtol=2e-5, atol=2e-5)


def test_keys_past_an_fp8_types_range_are_held_at_its_largest_value() -> None:
    """K/V beyond e4m3's 448 are stored as +-448, not as the NaN PyTorch's cast makes of them, so the sequence's
    later scores stay finite."""
    case = paged_case(4, 4, 2, 16, 16, [(9, 9), (1, 5)], torch.float32, "cpu", torch.float8_e4m3fn)
    k = case.k.clone()
    k[0, 0, 0], k[1, 1, 3] = 5000.0, -1e6
    backend = _backend(4, 2, 16, case.cache)
    out = backend.forward(case.q, k, case.v, case.cache, backend.prepare(case.batch))
    assert out.isfinite().all()
    kvh, nb, bs, d = case.cache[0].shape
    held = case.cache[0].view(kvh, nb * bs, d)[:, case.batch.slot_mapping].float()
    assert held[0, 0, 0] == 448.0 and held[1, 1, 3] == -448.0


def _whole_and_partial_match_dense(backend: TorchPagedAttention, case: PagedCase, window: int | None) -> torch.Tensor:
    """The backend's output and its partial (output and log-sum-exp) against ``case``'s dense reference; returns the
    output."""
    out = backend.forward(case.q, case.k, case.v, case.cache, backend.prepare(case.batch), window=window)
    check_matches_dense(case, out, case.expected_lse, 2e-5, check_lse=False)
    part = backend.forward_partial(case.q, case.k, case.v, case.cache, backend.prepare(case.batch), window=window)
    torch.testing.assert_close(merge_partials([part]).double(), case.expected, rtol=2e-5, atol=2e-5)
    lse = (part.m + part.e.log()).squeeze(-1)
    torch.testing.assert_close(lse.double(), case.expected_lse, rtol=2e-5, atol=2e-5)
    return out


# Windows of one key, of less than a block, of a few blocks (across the wide kernel's tiles), and past every context.
WINDOWS = [1, 5, 40, 1000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]], ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_sliding_window_attends_to_the_last_keys_only(
    shape: tuple[int, int, int, int], mix: str, window: int, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer's sliding window (Mistral's): each query sees its last ``window`` keys, itself included, whole and
    as partials, decodes and prefill chunks over cached prefixes alike (the native kernel's decode and prefill tiles
    skip the blocks before a tile's window)."""
    heads, kv_heads, head_dim, block_size = shape
    if native and not cpu_attention.supports(head_dim, torch.device("cpu")):
        pytest.skip("native attention kernel unavailable here")
    if not native:
        monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    case = paged_case(5, heads, kv_heads, head_dim, block_size, MIXES[mix], window=window)
    backend = _backend(heads, kv_heads, head_dim, case.cache)
    out = _whole_and_partial_match_dense(backend, case, window)
    if window < max(ctx for _, ctx in MIXES[mix]):  # (the window hides keys: whole attention would differ)
        whole = paged_case(5, heads, kv_heads, head_dim, block_size, MIXES[mix])
        assert not torch.allclose(out.double(), whole.expected, atol=1e-3)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_gemma2s_capped_scores_at_its_own_scale(
    mix: str, window: int | None, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 2's attention: the scores scaled by the model's own scale (``query_pre_attn_scalar ** -0.5``) and
    capped, ``cap * tanh(score / cap)``, before the mask, whole and as partials (the native kernel's decode and
    prefill tiles, PyTorch's scores), within a window or not; without the cap the outputs differ."""
    if not native:
        monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    scale, cap = 24**-0.5, 2.0  # (scores of q.k / sqrt(24) over 64 dimensions reach well past 2)
    case = paged_case(7, 8, 2, 64, 16, MIXES[mix], window=window, scale=scale, softcap=cap)
    backend = TorchPagedAttention(8, 2, 64, case.cache[0].shape[1], scale=scale, softcap=cap)
    out = _whole_and_partial_match_dense(backend, case, window)
    uncapped = paged_case(7, 8, 2, 64, 16, MIXES[mix], window=window, scale=scale)
    assert not torch.allclose(out.double(), uncapped.expected, atol=1e-3)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_window_over_an_fp8_cache(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native kernel's 8-bit path windows as its fp32 one."""
    if not native:
        monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    case = paged_case(6, 8, 2, 64, 16, MIXES["mixed"], torch.float32, "cpu", torch.float8_e4m3fn, window=24)
    backend = _backend(8, 2, 64, case.cache)
    out = backend.forward(case.q, case.k, case.v, case.cache, backend.prepare(case.batch), window=24)
    check_matches_dense(case, out, case.expected_lse, 2e-5, check_lse=False)
