"""The FlexAttention backend against a dense reference: decodes, prefill chunks over a cached prefix, GQA, head
sizes that are not powers of two, pages of several sizes, blocks shared by two sequences (a cached prefix), padding
rows; the log-sum-exp that comes out with the output, and the partials DistAttention merges.

On the CPU FlexAttention runs its eager reference, which applies the mask to every (query, key) pair; the block
mask, which the kernel alone reads, is checked by FlexAttention compiled for the CPU (``test_block_mask_*``); on
CUDA the backend runs compiled. Sliding windows (``window``): against the windowed dense reference, with block masks
that list the windows' blocks alone."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from paged_cases import MIXES, SHAPES, check_matches_dense, check_padding_row, paged_case

from boundless.attention import flex_paged
from boundless.attention.backend import AttentionBatch
from boundless.attention.paged import TorchPagedAttention
from boundless.attention.partials import merge_partials
from boundless.engine.sampling_params import SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not flex_paged.available(), reason="FlexAttention with AuxRequest needs torch 2.9+")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


# (On CUDA a page is a key tile, and a tile of fewer than 16 keys does not compile: pages of 4 there are refused.)
FLEX_SHAPES = [s for s in SHAPES if s[3] >= 16 or DEVICE.type != "cuda"]


@pytest.fixture(autouse=True)
def _fresh_compiles():
    """On CUDA every shape compiles: the compiles of one test are dropped after it, so that a session of tests stays
    under torch.compile's limit on one function's compiles."""
    yield
    if DEVICE.type == "cuda":
        torch._dynamo.reset()


def _backend(shape, num_blocks: int, **kw) -> flex_paged.FlexPagedAttention:
    heads, kv_heads, head_dim, block_size = shape
    return flex_paged.FlexPagedAttention(heads, kv_heads, head_dim, num_blocks, block_size, DEVICE, **kw)


def _windows(block_size: int) -> dict[str, int]:
    """Sliding windows for pages of ``block_size``: of one key, of less than a page, of a few pages, and past every
    context of the cases (``MIXES``: 200 at most)."""
    return {"one": 1, "under-a-page": block_size // 2 + 1, "pages": 2 * block_size + 3, "past": 1000}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("shape", FLEX_SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_matches_dense(shape, mix: str, dtype: torch.dtype) -> None:
    case = paged_case(0, *shape, MIXES[mix], dtype, DEVICE)
    backend = _backend(shape, case.cache[0].shape[1])
    meta = backend.prepare(case.batch)
    assert len(meta.launches) == len({ql == 1 for ql, _ in MIXES[mix]})  # decodes and prefills apart
    out = backend.forward(case.q, case.k, case.v, case.cache, meta)
    check_matches_dense(case, out, meta.lse, TOLERANCE[dtype])


# Each shape with each window of ``_windows`` once, each mix with each window once, each (shape, mix) at least once: 12
# cases of the 36 (a window's dense reference is the costly part).
WINDOW_CASES = [
    (shape, mix, name)
    for i, shape in enumerate(FLEX_SHAPES)
    for j, mix in enumerate(MIXES)
    for k, name in enumerate(_windows(16))
    if (i + j + k) % 3 == 0
]


@pytest.mark.parametrize(
    "shape, mix, name", WINDOW_CASES, ids=lambda x: "h{}kv{}d{}bs{}".format(*x) if isinstance(x, tuple) else x
)
def test_a_sliding_window_matches_dense(shape, mix: str, name: str) -> None:
    """A layer's sliding window (``forward``'s ``window``, among several declared): the windowed dense reference's
    output and log-sum-exp, decodes and prefill chunks over cached prefixes alike."""
    windows = _windows(shape[3])
    case = paged_case(0, *shape, MIXES[mix], torch.float32, DEVICE, window=windows[name])
    backend = _backend(shape, case.cache[0].shape[1], windows=list(windows.values()))
    meta = backend.prepare(case.batch)
    out = backend.forward(case.q, case.k, case.v, case.cache, meta, window=windows[name])
    check_matches_dense(case, out, meta.lse, TOLERANCE[torch.float32])


@pytest.mark.parametrize("mix", list(MIXES))
def test_gemma2s_capped_scores_at_its_own_scale(mix: str) -> None:
    """Gemma 2's attention: scores at the model's own scale, capped by the backend's ``score_mod`` before the block
    mask, in a windowed layer and a whole one of the same model."""
    shape, scale, cap = (4, 2, 32, 16), 12**-0.5, 2.0
    for window in (None, 9):
        case = paged_case(5, *shape, MIXES[mix], torch.float32, DEVICE, window=window, scale=scale, softcap=cap)
        backend = _backend(shape, case.cache[0].shape[1], windows=[9], scale=scale, softcap=cap)
        meta = backend.prepare(case.batch)
        out = backend.forward(case.q, case.k, case.v, case.cache, meta, window=window)
        check_matches_dense(case, out, meta.lse, TOLERANCE[torch.float32])
        uncapped = paged_case(5, *shape, MIXES[mix], torch.float32, DEVICE, window=window, scale=scale)
        assert not torch.allclose(out.double().cpu(), uncapped.expected, atol=1e-3)


def test_a_window_of_one_key_gives_each_querys_own_value() -> None:
    """With a window of 1 a query sees its own key alone: its output is its own value and its log-sum-exp its own
    score, as output and as the partial DistAttention merges (attention over the whole context, the window
    ignored, would not give them)."""
    heads, kv_heads, d, bs = 4, 2, 16, 16
    case = paged_case(4, heads, kv_heads, d, bs, MIXES["mixed"], torch.float32, DEVICE)
    backend = _backend((heads, kv_heads, d, bs), case.cache[0].shape[1], windows=[1, 3])
    meta = backend.prepare(case.batch)
    out = backend.forward(case.q, case.k, case.v, case.cache, meta, window=1)
    own_v = case.v.repeat_interleave(heads // kv_heads, dim=1)
    own_score = (case.q * case.k.repeat_interleave(heads // kv_heads, dim=1)).sum(-1) * d**-0.5
    torch.testing.assert_close(out, own_v, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(meta.lse, own_score, rtol=2e-5, atol=2e-5)
    assert not torch.allclose(out.double().cpu(), case.expected, atol=1e-2)  # (the whole context's differs)
    partial = backend.forward_partial(case.q, case.k, case.v, case.cache, backend.prepare(case.batch), window=1)
    torch.testing.assert_close(merge_partials([partial]), own_v, rtol=2e-5, atol=2e-5)


def test_a_window_not_declared_is_refused() -> None:
    """A window's block masks are made for the windows declared at construction (the engine declares its layers'):
    another is refused with its name before anything is stored, as is a window of no keys."""
    shape = (4, 2, 16, 16)
    case = paged_case(5, *shape, [(1, 40), (8, 20)], torch.float32, DEVICE)
    backend = _backend(shape, case.cache[0].shape[1], windows=[8])
    before = [c.clone() for c in case.cache]
    with pytest.raises(ValueError, match=r"sliding window 16 was not declared .*\[8\]"):
        backend.forward(case.q, case.k, case.v, case.cache, backend.prepare(case.batch), window=16)
    assert all(torch.equal(a, b) for a, b in zip(case.cache, before, strict=True))
    with pytest.raises(ValueError, match="at least one key"):
        _backend(shape, 10, windows=[4, 0])


def test_a_block_two_sequences_share_is_read_by_both() -> None:
    """A cached prefix: two sequences' tables start with the same physical blocks; each reads them at its own
    positions, and neither reads the other's own blocks (each is absent from the other's inverse table)."""
    heads, kv_heads, d, bs = 4, 2, 16, 16
    case = paged_case(3, heads, kv_heads, d, bs, [(1, 50), (1, 40)], device=DEVICE)
    shared = case.batch.block_tables[0][:2]  # the first sequence's first 32 positions
    nb = case.cache[0].shape[1]
    tables = [case.batch.block_tables[0], shared + case.batch.block_tables[1][2:]]
    for cache in case.cache:  # the second sequence's first 32 keys are the first's
        cache[:, case.batch.block_tables[1][:2]] = cache[:, shared]
    batch = AttentionBatch(1 + 1, [1, 1], [50, 40], tables, case.batch.slot_mapping, bs, DEVICE)
    reference = TorchPagedAttention(heads, kv_heads, d, nb)
    want = reference.forward(case.q, case.k, case.v, [c.clone() for c in case.cache], reference.prepare(batch))
    backend = _backend((heads, kv_heads, d, bs), nb)
    got = backend.forward(case.q, case.k, case.v, case.cache, backend.prepare(batch))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_padding_rows_store_nothing_and_attend_to_nothing() -> None:
    """A padded batch: slot -1 stores nothing, and a sequence of length 0 yields zeros and a log-sum-exp of -inf."""
    check_padding_row(lambda num_blocks: _backend((4, 2, 16, 16), num_blocks), DEVICE)


def test_partials_merge_with_the_torch_backends() -> None:
    """DistAttention's use: the partial of a split context from this backend merges with the PyTorch backend's
    partial of the rest into attention over the whole."""
    heads, kv_heads, d, bs = 8, 2, 32, 16
    chunks = [(1, 96), (1, 40), (12, 64)]
    batch, cache, q, k, v, expected, _ = paged_case(9, heads, kv_heads, d, bs, chunks, torch.float32, DEVICE)
    nb = cache[0].shape[1]
    # The first two blocks of every sequence are "remote": the rest's local part starts at a block boundary.
    head_tables = [t[:2] for t in batch.block_tables]
    local = AttentionBatch(
        batch.num_decodes, batch.query_lens, [s - 32 for s in batch.seq_lens], [t[2:] for t in batch.block_tables],
        batch.slot_mapping, bs, DEVICE,
    )  # fmt: skip
    backend = _backend((heads, kv_heads, d, bs), nb)
    mine = backend.forward_partial(q, k, v, cache, backend.prepare(local))
    reference = TorchPagedAttention(heads, kv_heads, d, nb)
    # The remote part: every query sees all 32 earlier keys (a 0-token step over them).
    kvh = cache[0].shape[0]
    keys = torch.stack([cache[0][:, t].reshape(kvh, 32, d) for t in head_tables])
    values = torch.stack([cache[1][:, t].reshape(kvh, 32, d) for t in head_tables])
    seq_of = torch.repeat_interleave(torch.arange(3), torch.tensor(batch.query_lens))
    kk = keys[seq_of].repeat_interleave(heads // kv_heads, dim=1)  # [tokens, heads, 32, d]
    vv = values[seq_of].repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,thsd->ths", q, kk) * reference.scale
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - m)
    from boundless.attention.partials import AttentionPartial

    theirs = AttentionPartial(m=m, e=p.sum(-1, keepdim=True), o=torch.einsum("ths,thsd->thd", p, vv))
    merged = merge_partials([mine, theirs])
    torch.testing.assert_close(merged.double().cpu(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tile", [16, 64])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("shape", FLEX_SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_block_mask_lists_every_visible_key_and_full_blocks_are_wholly_visible(shape, mix: str, tile: int) -> None:
    """What the kernel reads and the eager reference does not: every key a query sees lies in a block its tile
    lists, a block listed full (visited without the mask) is seen whole by every query of the tile, and no block is
    listed that no query of the tile sees (tiles of queries larger and smaller than pages), for the whole context's
    mask and each sliding window's (whose lists leave out the blocks before the windows)."""
    batch, cache, *_ = paged_case(1, *shape, MIXES[mix], device=DEVICE)
    windows = _windows(shape[3])
    backend = _backend(shape, cache[0].shape[1], prefill_tile=tile, windows=list(windows.values()))
    bs, nb = shape[3], cache[0].shape[1]
    keys = torch.arange(nb * bs, device=DEVICE)
    for launch in backend.prepare(batch).launches:
        b, ql = launch.num_seqs, launch.query_len
        assert set(launch.block_masks) == {None, *windows.values()}
        seqs, queries = torch.arange(b, device=DEVICE), torch.arange(ql, device=DEVICE)
        for window, mask in launch.block_masks.items():
            head = torch.zeros((), dtype=torch.long, device=DEVICE)
            seen = mask.mask_mod(seqs[:, None, None], head, queries[None, :, None], keys).cpu()  # [seqs, queries, keys]
            q_tile = mask.BLOCK_SIZE[0]
            assert (mask.full_kv_num_blocks is None) == (ql == 1)  # (a decode lists every block partial)
            for i in range(b):
                for t in range(-(-ql // q_tile)):
                    full = [] if ql == 1 else mask.full_kv_indices[i, 0, t, : mask.full_kv_num_blocks[i, 0, t]].tolist()
                    partial = mask.kv_indices[i, 0, t, : mask.kv_num_blocks[i, 0, t]].tolist()
                    assert not set(full) & set(partial), window
                    rows = seen[i, t * q_tile : (t + 1) * q_tile].view(-1, nb, bs)
                    visible = set(rows.any(dim=(0, 2)).nonzero().flatten().tolist())
                    assert visible == set(full) | set(partial), window  # (all it sees, nothing it does not)
                    live = [j for j in range(t * q_tile, min((t + 1) * q_tile, ql)) if seen[i, j].any()]
                    for block in full:
                        assert seen[i, live].view(len(live), nb, bs)[:, block].all(), window


def test_a_long_contexts_decode_visits_its_windows_blocks_alone() -> None:
    """The point of a window's block mask: a decode over 200 keys in pages of 16 with a window of 20 lists the two
    pages its window reaches, not the context's 13; a prefill tile lists partial the pages at its queries' window
    starts and causal edge, full those between (seen whole by every query of the tile)."""
    shape = (4, 2, 16, 16)
    batch, cache, *_ = paged_case(2, *shape, [(1, 200), (1, 60), (64, 200)], device=DEVICE)
    backend = _backend(shape, cache[0].shape[1], prefill_tile=16, windows=[20, 40])
    decodes, prefill = backend.prepare(batch).launches
    assert decodes.block_masks[None].kv_num_blocks[:, 0, 0].tolist() == [13, 4]
    window = decodes.block_masks[20]
    assert window.kv_num_blocks[:, 0, 0].tolist() == [2, 2]  # (keys 180..199: pages 11, 12; 40..59: pages 2, 3)
    assert window.kv_indices[0, 0, 0, :2].tolist() == batch.block_tables[0][11:13]
    assert window.kv_indices[1, 0, 0, :2].tolist() == batch.block_tables[1][2:4]
    # The prefill's tiles of 16 queries at positions 136.., 152.., 168.., 184..: the whole context's lists every page
    # before the tile full; a window of 20 (from 117, 133, ...) sees no page whole, one of 40 (from 97, 113, ...) one.
    table = batch.block_tables[2]

    def lists(mask) -> tuple[list[list[int]], list[list[int]]]:
        partial = [mask.kv_indices[0, 0, t, : mask.kv_num_blocks[0, 0, t]].tolist() for t in range(4)]
        full = [mask.full_kv_indices[0, 0, t, : mask.full_kv_num_blocks[0, 0, t]].tolist() for t in range(4)]
        return partial, full

    assert lists(prefill.block_masks[None]) == (
        [table[t + 8 : t + 10] for t in range(4)], [table[: t + 8] for t in range(4)]
    )  # fmt: skip
    assert lists(prefill.block_masks[20]) == ([table[t + 7 : t + 10] for t in range(4)], [[]] * 4)
    assert lists(prefill.block_masks[40]) == (
        [[table[t + 6], *table[t + 8 : t + 10]] for t in range(4)], [[table[t + 7]] for t in range(4)]
    )  # fmt: skip


@pytest.mark.parametrize("tile", [16, 64])
def test_the_gpu_kernel_finds_each_full_list_where_it_reads_it(tile: int) -> None:
    """FlexAttention's GPU kernel (PyTorch 2.11's template) finds a tile's list of full blocks at the offset of its
    list of partial blocks, computed with the partial list's strides: both lists must be as wide. Read that way,
    each tile's full list is its sequence's first blocks, and a sliding window's is its own full list (its pages
    within the window). (The GPU's lists are laid out here on the CPU: with lists of different widths, every sequence
    but the first read other blocks on the H200, and attended wrongly.)"""
    shape = (8, 2, 64, 16)
    batch, cache, *_ = paged_case(0, *shape, MIXES["mixed"])
    backend = _backend(shape, cache[0].shape[1], prefill_tile=tile, windows=[40])
    backend.pool_wide_lists = False  # (the GPU's layout of the lists)
    (_, launch) = backend.prepare(batch).launches  # the prefill chunks, over cached prefixes: full blocks
    tables = batch.block_tables[batch.num_decodes :]
    for window, mask in launch.block_masks.items():
        partial_ids, full_ids, full_counts = mask.kv_indices, mask.full_kv_indices, mask.full_kv_num_blocks
        assert int(full_counts.sum()) > 0
        stride_h, stride_m = partial_ids.stride(1), partial_ids.stride(2)
        flat = full_ids.flatten()
        for i, table in enumerate(tables):
            for t in range(full_counts.shape[2]):
                at = i * stride_h + t * stride_m  # (one head of the mask: the batch row i is its sparse_hz_offset)
                count = int(full_counts[i, 0, t])
                assert flat[at : at + count].tolist() == full_ids[i, 0, t, :count].tolist()
                if window is None:
                    assert flat[at : at + count].tolist() == table[:count]


@pytest.mark.slow
@pytest.mark.skipif(DEVICE.type == "cuda", reason="CUDA runs the kernel in every test")
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("mix", list(MIXES))
def test_block_mask_lists_what_the_kernel_must_visit(mix: str, window: int | None) -> None:
    """FlexAttention compiled for the CPU reads the block mask (it visits the listed blocks alone and skips the
    mask on full ones), as the GPU's kernel does: its output is the dense reference's, so the block mask lists
    every visible key and calls full no block that is not, for the whole context and sliding windows. (The CPU's
    compiled kernel has no log-sum-exp: the output alone.)"""
    shape = (8, 2, 64, 16)
    batch, cache, q, k, v, expected, _ = paged_case(0, *shape, MIXES[mix], window=window)
    backend = _backend(shape, cache[0].shape[1], prefill_tile=16, windows=[window] if window else [])
    meta = backend.prepare(batch)
    backend.store_kv(k, v, *cache, meta.slot_mapping)
    kvh, nb, bs, d = cache[0].shape
    keys, values = cache[0].view(1, kvh, nb * bs, d), cache[1].view(1, kvh, nb * bs, d)
    compiled = torch.compile(flex_paged.flex_attention, dynamic=False)
    out = torch.empty_like(q)
    for launch in meta.launches:
        rows = q[launch.start : launch.end]
        b, ql = launch.num_seqs, launch.query_len
        queries = rows.new_zeros(b * ql, *rows.shape[1:])
        queries[launch.rows if launch.rows is not None else slice(None)] = rows
        o = compiled(queries.view(b, ql, *rows.shape[1:]).transpose(1, 2), keys, values,
                     block_mask=launch.block_masks[window], scale=backend.scale, enable_gqa=True)  # fmt: skip
        o = o.transpose(1, 2).reshape(b * ql, *rows.shape[1:])
        out[launch.start : launch.end] = o[launch.rows] if launch.rows is not None else o
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("pool_wide", [True, False], ids=["cpu-lists", "gpu-lists"])
def test_an_engines_steps_compile_flex_attention_a_few_times(tiny_llama, monkeypatch, pool_wide: bool) -> None:
    """On CUDA every call goes through torch.compile, which compiles again whenever what it guards on changes: the
    engine's steps change their batch and chunk lengths every step. Here torch.compile runs with its eager backend
    (the same tracing and guards, PyTorch's ops for the kernel) over an engine's steps of shrinking batches, chunked
    prompts and growing tables: a handful of compiles, not one a step (a compile takes seconds on a GPU, and past
    the limit torch.compile gives up), and the tokens of the backend with the same layers around attention
    (PyTorch's on the CPU, the Triton kernels' on CUDA). The block lists laid out as the CPU's (as wide as the pool)
    and as the GPU's (as wide as the step's longest table: a width that changes step to step). Without CUDA graphs:
    their capture compiles too, once a bucket size."""
    from torch._dynamo.utils import counters

    from boundless.engine.core import EngineCore
    from boundless.llm import engine_config

    def eager_compiled(dynamic):
        return torch.compile(flex_paged.flex_attention, backend="eager", fullgraph=True, dynamic=dynamic)

    monkeypatch.setattr(flex_paged, "_compiled", functools.cache(eager_compiled))
    torch._dynamo.reset()

    def run(backend: str) -> tuple[list[list[int]], int]:
        config = engine_config(
            tiny_llama.name, max_model_len=256, num_kv_blocks=48, attention_backend=backend,
            max_num_batched_tokens=48, enforce_eager=True,
        )  # fmt: skip
        core = EngineCore.from_model(tiny_llama, config)
        attention = core.executor.runner.attention
        if backend == "flex":
            attention.compiled = True
            attention.pool_wide_lists = pool_wide
        rnd = random.Random(0)
        for i in range(12):
            prompt = [rnd.randrange(5, 200) for _ in range(rnd.randrange(3, 60))]
            core.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=rnd.randrange(2, 24)))
        out: dict[str, list[int]] = {str(i): [] for i in range(12)}
        steps = 0
        while core.has_unfinished():
            for delta in core.step():
                out[delta.request_id] += delta.new_token_ids
            steps += 1
        return [out[str(i)] for i in range(12)], steps

    # (The backend whose layers around attention are flex's: on CUDA both fuse them in Triton kernels.)
    expected, _ = run("triton" if DEVICE.type == "cuda" else "torch")
    before = counters["stats"]["unique_graphs"]
    got, steps = run("flex")
    compiles = counters["stats"]["unique_graphs"] - before
    assert got == expected
    assert steps >= 20 and 1 <= compiles <= 6, (steps, compiles)


def test_pages_too_small_for_the_gpu_kernel_are_refused() -> None:
    """On CUDA a key tile is a page, and Triton's matrix product wants 16 keys: pages of 8 are refused with the flag
    to change (nothing touches the device before the check, so it runs anywhere); off CUDA they run."""
    with pytest.raises(ValueError, match="--block-size 8 is too small"):
        flex_paged.FlexPagedAttention(4, 2, 16, 10, 8, torch.device("cuda"))
    assert flex_paged.FlexPagedAttention(4, 2, 16, 10, 8, torch.device("cpu")).block_size == 8
