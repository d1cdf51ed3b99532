"""The DistAttention round trip over a real shared-memory transport: a creditor's service computes the partial of
a debtor's query rows over blocks it holds, and the debtor's merge of it with its own partial over the rest of
the context equals attention over the whole context."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from boundless.attention.partial_service import PartialClient, PartialServer, RemotePartialError
from boundless.attention.partials import merge_partials, scores_partial
from boundless.attention.remote_partials import LentBlocks, QuerySegment, lent_partial
from boundless.transport.shm import ShmTransport

KVH, BS, D, NB = 2, 16, 16, 12
SCALE = D**-0.5


@pytest.fixture
def caches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(KVH, NB, BS, D, generator=g), torch.randn(KVH, NB, BS, D, generator=g)


@pytest.fixture
def ends(tmp_path: Path) -> Iterator[tuple[ShmTransport, ShmTransport]]:
    debtor, creditor = ShmTransport(tmp_path, "debtor", timeout_s=10), ShmTransport(tmp_path, "creditor", timeout_s=10)
    yield debtor, creditor
    debtor.close()
    creditor.close()


def _dense(ids: list[int], cache: torch.Tensor) -> torch.Tensor:
    """[kv_heads, tokens, D] of these blocks in order."""
    return cache[:, ids].reshape(KVH, -1, D)


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """Softmax attention of every row of q [T, H, D] over all of keys, values [KVH, S, D]; no mask; the scores capped
    at ``softcap`` (Gemma 2's) when given."""
    g = q.shape[1] // KVH
    k, v = keys.repeat_interleave(g, 0), values.repeat_interleave(g, 0)
    scores = torch.einsum("thd,hsd->ths", q.double(), k.double()) * SCALE
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("ths,hsd->thd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("rows", [5, 24])  # decode rows (the native kernel), a prefill chunk's (matmuls)
@pytest.mark.usefixtures("parallel_native_kernels")  # (the native kernel's parallel loop too)
@pytest.mark.parametrize("heads", [2, 4])  # MHA and GQA
def test_lent_partial_native_and_torch_agree_with_softmax(caches, heads: int, rows: int) -> None:
    k_cache, v_cache = caches
    q = torch.randn(rows, heads, D)
    ids = [7, 2, 9]
    part = lent_partial(q, k_cache, v_cache, ids, SCALE)
    want = _reference(q, _dense(ids, k_cache), _dense(ids, v_cache))
    torch.testing.assert_close(merge_partials([part]), want, atol=1e-5, rtol=1e-5)
    # The PyTorch path (a non-contiguous cache keeps the native kernel out) gives the same partial's output.
    nc_k, nc_v = (c.transpose(2, 3).contiguous().transpose(2, 3) for c in (k_cache, v_cache))
    torch.testing.assert_close(merge_partials([lent_partial(q, nc_k, nc_v, ids, SCALE)]), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
def test_lent_blocks_in_another_type_are_attended_as_the_creditor_holds_them(caches, kv_dtype: torch.dtype) -> None:
    """A creditor whose pool holds KV in 8 or 16 bits (``--kv-cache-dtype``): a debtor's fp32 queries are scored over
    the blocks as held, in fp32 over an 8-bit pool (not cast to it)."""
    k_cache, v_cache = (c.to(kv_dtype) for c in caches)
    q = torch.randn(6, 4, D)
    ids = [3, 8]
    part = lent_partial(q, k_cache, v_cache, ids, SCALE)
    want = _reference(q, _dense(ids, k_cache).float(), _dense(ids, v_cache).float())
    tol = 1e-5 if kv_dtype == torch.float8_e4m3fn else 2e-2  # (a 16-bit pool scores in its own type)
    torch.testing.assert_close(merge_partials([part]).float(), want, atol=tol, rtol=tol)


def test_round_trip_over_shm_merges_to_attention_over_the_whole_context(ends, caches) -> None:
    debtor_net, creditor_net = ends
    k_cache, v_cache = caches
    lent = {"d/0": LentBlocks((3, 5)), "d/1": LentBlocks((8,)), "d/2": LentBlocks((1, 0))}
    server = PartialServer(creditor_net, lambda layer: (k_cache * (layer + 1), v_cache), lent.get, SCALE)
    server.add_peer(debtor_net.address)
    client = PartialClient(debtor_net, timeout_s=10)
    try:
        # Two requests in one message: 3 rows over moves d/0 and d/1 (three blocks), 2 rows over d/2.
        q = torch.randn(5, 4, D)
        segments = [QuerySegment(3, ("d/0", "d/1")), QuerySegment(2, ("d/2",))]
        for layer in (0, 1):
            remote = client.collect(client.send(creditor_net.address, layer, q, segments))
            # The debtor's own partial over two more blocks of each request, merged with the creditor's.
            local_ids = [10, 11]
            kl = k_cache * (layer + 1)
            local = scores_partial(
                q.view(5, KVH, 2, D).permute(1, 0, 2, 3).reshape(KVH, 10, D),
                _dense(local_ids, kl),
                _dense(local_ids, v_cache),
                SCALE,
            )
            local_rows = type(local)(
                *(x.view(KVH, 5, 2, -1).permute(1, 0, 2, 3).reshape(5, 4, -1) for x in (local.m, local.e, local.o))
            )
            got = merge_partials([local_rows, remote])
            for rows, ids in ((slice(0, 3), [3, 5, 8]), (slice(3, 5), [1, 0])):
                want = _reference(q[rows], _dense(ids + local_ids, kl), _dense(ids + local_ids, v_cache))
                torch.testing.assert_close(got[rows], want, atol=1e-5, rtol=1e-5)
        # (The server counts a reply once its send has completed, which may be after the client has read it.)
        deadline = time.monotonic() + 10
        while server.stats.round_trips < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert client.stats.round_trips == 2 and server.stats.round_trips == 2
        # A move the creditor does not hold is answered with an error, not a hang.
        with pytest.raises(RemotePartialError, match="status 1"):
            client.collect(client.send(creditor_net.address, 0, q[:1], [QuerySegment(1, ("d/9",))]))
    finally:
        server.close()


@pytest.mark.parametrize("rows", [3, 24])  # decode rows (the native kernel's count), a prefill chunk's (matmuls)
@pytest.mark.parametrize(("first", "window"), [(50, 1), (50, 5), (50, 20), (50, 40), (50, 100), (48, 40), (32, 40)])
def test_lent_partial_within_a_sliding_window(caches, rows: int, first: int, window: int) -> None:
    """Rows at positions ``first + i`` after the lent keys see only those within their window: the partial is
    attention over those keys, and a row whose window starts past every lent key is an empty partial (e = 0). (At
    48 and 32 with a window of 40 the first row sees every lent key and the later ones fewer.)"""
    k_cache, v_cache = caches
    q = torch.randn(rows, 4, D)
    ids = [7, 2, 9]  # 48 keys
    part = lent_partial(q, k_cache, v_cache, ids, SCALE, window=window, first_position=first)
    keys, values = _dense(ids, k_cache), _dense(ids, v_cache)
    out = merge_partials([part])
    for i in range(rows):
        lo = first + i - window + 1
        if lo >= keys.shape[1]:
            assert part.e[i].eq(0).all() and out[i].eq(0).all()
            continue
        want = _reference(q[i : i + 1], keys[:, max(0, lo) :], values[:, max(0, lo) :])
        torch.testing.assert_close(out[i : i + 1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [3, 24])  # decode rows (the native kernel's count), a prefill chunk's (matmuls)
@pytest.mark.parametrize("window", [None, 20])
def test_lent_partial_of_gemma2s_capped_scores(caches, rows: int, window: int | None) -> None:
    """A creditor's partial of a model whose scores are capped (Gemma 2's): the capped attention over the lent keys,
    on the native kernel and the matmuls, within a window or not; uncapped it would differ."""
    k_cache, v_cache = caches
    q = 3 * torch.randn(rows, 4, D)  # (scores that reach past the cap)
    ids = [7, 2, 9]
    part = lent_partial(q, k_cache, v_cache, ids, SCALE, window=window, first_position=40, softcap=1.5)
    keys, values = _dense(ids, k_cache), _dense(ids, v_cache)
    out = merge_partials([part])
    for i in range(rows):
        lo = 0 if window is None else max(0, 40 + i - window + 1)
        if lo >= keys.shape[1]:
            assert part.e[i].eq(0).all()
            continue
        want = _reference(q[i : i + 1], keys[:, lo:], values[:, lo:], softcap=1.5)
        torch.testing.assert_close(out[i : i + 1], want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(want, _reference(q[i : i + 1], keys[:, lo:], values[:, lo:]), atol=1e-3)


def test_a_segments_window_reaches_the_creditor(ends, caches) -> None:
    """A window and each segment's first position go over the wire: the creditor's partial is the windowed one."""
    debtor_net, creditor_net = ends
    k_cache, v_cache = caches
    lent = {"d/0": LentBlocks((3, 5))}
    server = PartialServer(creditor_net, lambda layer: (k_cache, v_cache), lent.get, SCALE)
    server.add_peer(debtor_net.address)
    client = PartialClient(debtor_net, timeout_s=10)
    try:
        q = torch.randn(4, 4, D)
        segments = [QuerySegment(2, ("d/0",), first_position=40), QuerySegment(2, ("d/0",), first_position=33)]
        got = merge_partials([client.collect(client.send(creditor_net.address, 0, q, segments, window=10))])
        keys, values = _dense([3, 5], k_cache), _dense([3, 5], v_cache)
        for row, position in enumerate([40, 41, 33, 34]):
            lo = position - 10 + 1
            want = _reference(q[row : row + 1], keys[:, lo:], values[:, lo:])
            torch.testing.assert_close(got[row : row + 1], want, atol=1e-5, rtol=1e-5)
    finally:
        server.close()
