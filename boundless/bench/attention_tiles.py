"""``bench gpu --shapes tiles``: the Triton attention kernels' tile shapes swept on the 1B shape's attention.

Each case is one layer's attention of a step the offline cases take: whole prompts of 8,000 tokens in one chunk (the
long-prompt case's prefill), a chunk of a prompt over its cached first half, 256 decodes over 256 tokens of context
(the decode-heavy case) and 8 decodes over 8,000 (the long case's decode). Every tile shape of the grid runs each
case of its kind (prefill or decode) on the same inputs; its output is checked against the default shape's, and
its time set beside the default's, beside FlexAttention's on the same paged cache (``--attention-backend flex``, at
a few query tiles for prefill) and beside PyTorch's ``scaled_dot_product_attention`` on the same tensors laid out
densely (FlashAttention on a GPU), where that computes the same thing. The next step for a case is then a
measurement away: a tile default, or a kernel change, or the kernel library in place of ours, or neither (it is at
SDPA's speed already).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from boundless.attention import flex_paged, triton_paged
from boundless.attention.backend import AttentionBackend, AttentionBatch
from boundless.attention.flex_paged import FlexPagedAttention
from boundless.attention.triton_paged import TileConfig, TritonPagedAttention
from boundless.bench.timing import device_seconds


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int


@dataclass(frozen=True)
class TileCase:
    """One step's attention: (query tokens, context after the step) per sequence, decodes (one query token) only or
    prefill chunks only."""

    name: str
    chunks: tuple[tuple[int, int], ...]

    @property
    def decode(self) -> bool:
        return all(q == 1 for q, _ in self.chunks)

    def flops(self, shape: AttentionShape) -> float:
        """Two matrix products (scores and values) over every (query, visible key) pair."""
        pairs = sum(q * (ctx - q) + q * (q + 1) // 2 for q, ctx in self.chunks)
        return 4.0 * pairs * shape.heads * shape.head_dim


LLAMA_1B = AttentionShape(heads=32, kv_heads=8, head_dim=64, block_size=16)
CASES = (
    TileCase("prefill_2x8000", ((8000, 8000),) * 2),
    TileCase("chunk_4000_over_8000", ((4000, 8000),) * 2),
    TileCase("decode_256x256", ((1, 256),) * 256),
    TileCase("decode_8x8000", ((1, 8000),) * 8),
)
INNER_CALLS = 10  # calls timed back to back per repeat (a decode's attention is tens of microseconds)
# (Pages of 16: the least FlexAttention takes on CUDA.)
TINY_SHAPE = AttentionShape(heads=4, kv_heads=2, head_dim=16, block_size=16)
TINY_CASES = (
    TileCase("prefill_2x24", ((24, 24),) * 2),
    TileCase("chunk_8_over_20", ((8, 20),) * 2),
    TileCase("decode_4x20", ((1, 20),) * 4),
)


def tile_grid(decode: bool, tiny: bool = False, small: bool = False) -> list[TileConfig]:
    """The tile shapes swept for a kind of case: the default's first, then the default with the mask on every tile
    (the kernel before 5 December) and, for decodes, split over twice the programs. ``small``: the default and five
    neighbours (a device session's run, where the whole grid's compiles would take minutes)."""
    base = TileConfig()
    if tiny:  # (Triton's interpreter: two shapes that run quickly)
        return [
            TileConfig(prefill_rows=32, prefill_kv_tile=32, decode_kv_tile=32, prefill_warps=4, stages=1),
            TileConfig(prefill_rows=16, prefill_kv_tile=16, decode_kv_tile=16, prefill_warps=4, stages=1),
        ]
    if small:
        changes: list[dict[str, Any]] = (
            [dict(mask_every_tile=True), dict(decode_kv_tile=64), dict(split_programs_per_sm=4),
             dict(decode_kv_tile=64, decode_warps=2, stages=2), dict(decode_warps=2, stages=2)]
            if decode
            else [dict(mask_every_tile=True), dict(prefill_rows=64, prefill_warps=4), dict(prefill_kv_tile=128),
                  dict(prefill_warps=4), dict(prefill_rows=64, prefill_kv_tile=128, prefill_warps=4, stages=2)]
        )  # fmt: skip
        return [base] + [dataclasses.replace(base, **c) for c in changes]
    if decode:
        grid = [
            dataclasses.replace(base, decode_kv_tile=tile, decode_warps=warps, stages=stages)
            for tile in (32, 64, 128)
            for warps in (2, 4, 8)
            for stages in (2, 3)
        ]
    else:
        grid = [
            dataclasses.replace(base, prefill_rows=rows, prefill_kv_tile=tile, prefill_warps=warps, stages=stages)
            for rows in (64, 128)
            for tile in (32, 64, 128)
            for warps in (4, 8)
            for stages in (2, 3)
        ]
    extra = [dataclasses.replace(base, mask_every_tile=True)]  # the kernel before 5 December
    if decode:  # decodes split over more programs (the long ones: their batch leaves the GPU idle)
        extra.append(dataclasses.replace(base, split_programs_per_sm=4))
    return [base, *extra] + [t for t in grid if t != base]


@dataclass
class CaseTensors:
    """A case's inputs: the step's batch, the KV cache with random context, and the new tokens' q, k and v."""

    batch: AttentionBatch
    cache: tuple[torch.Tensor, torch.Tensor]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    num_blocks: int


def case_tensors(case: TileCase, shape: AttentionShape, dtype: torch.dtype, device: torch.device) -> CaseTensors:
    """Random inputs for ``case``: each sequence's blocks drawn at random from the pool (the KV of its cached
    context is random too), its new tokens' slots at the end of its context."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    bs = shape.block_size
    blocks_each = [-(-ctx // bs) for _, ctx in case.chunks]
    num_blocks = sum(blocks_each) + 1
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    tables, slots = [], []
    for (new, ctx), nb in zip(case.chunks, blocks_each, strict=True):
        table = [free.pop() for _ in range(nb)]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - new, ctx)]
    tokens = sum(q for q, _ in case.chunks)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    cache = (
        rand(shape.kv_heads, num_blocks, bs, shape.head_dim),
        rand(shape.kv_heads, num_blocks, bs, shape.head_dim),
    )
    batch = AttentionBatch(
        num_decodes=len(case.chunks) if case.decode else 0,
        query_lens=[q for q, _ in case.chunks],
        seq_lens=[ctx for _, ctx in case.chunks],
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_size=bs,
        device=device,
    )
    q = rand(tokens, shape.heads, shape.head_dim)
    k = rand(tokens, shape.kv_heads, shape.head_dim)
    v = rand(tokens, shape.kv_heads, shape.head_dim)
    return CaseTensors(batch, cache, q, k, v, num_blocks)


def kernel_run(
    tensors: CaseTensors, shape: AttentionShape, tiles: TileConfig, dtype: torch.dtype, device: torch.device
) -> Callable[[], torch.Tensor]:
    """The case's attention with these tiles, as the engine runs it: the step's metadata made once, then each call
    stores the new tokens' KV and attends."""
    backend = TritonPagedAttention(
        shape.heads, shape.kv_heads, shape.head_dim, tensors.num_blocks, shape.block_size, device, dtype, tiles=tiles
    )
    return _engine_run(backend, tensors)


def _engine_run(backend: AttentionBackend, tensors: CaseTensors) -> Callable[[], torch.Tensor]:
    """A layer's attention as the engine runs it: the step's metadata made once, then each call stores the new
    tokens' KV and attends."""
    meta = backend.prepare(tensors.batch)
    return lambda: backend.forward(tensors.q, tensors.k, tensors.v, tensors.cache, meta)


FLEX_PREFILL_TILES = (32, 64, 128)  # FlexAttention's query rows per tile swept on prefill cases (the engine's: 64)


def flex_run(
    tensors: CaseTensors, shape: AttentionShape, device: torch.device, prefill_tile: int | None = None
) -> Callable[[], torch.Tensor]:
    """The case's attention on FlexAttention (``--attention-backend flex``), as the engine runs it, compiled for the
    case's shapes (the engine's compiles turn symbolic where shapes change, which a sweep of fixed cases would
    measure after the first case)."""
    backend = FlexPagedAttention(
        shape.heads, shape.kv_heads, shape.head_dim, tensors.num_blocks, shape.block_size, device, prefill_tile,
        dynamic=False,
    )  # fmt: skip
    return _engine_run(backend, tensors)


def flex_rows(
    tensors: CaseTensors,
    case: TileCase,
    shape: AttentionShape,
    reference: torch.Tensor | None,
    repeats: int,
    prefill_tiles: Sequence[int | None] = FLEX_PREFILL_TILES,
) -> list[dict]:
    """FlexAttention on the case, for each of its prefill tiles (None: the engine's; a decode case: that one alone):
    seconds, TFLOP/s and its difference from the Triton kernel's output; a tile that fails (a compile error) is noted
    and the others go on."""
    device = tensors.q.device
    return [
        {"prefill_tile": tile}
        | timed_row(functools.partial(flex_run, tensors, shape, device, tile), tensors, case, shape, reference, repeats)
        for tile in ((None,) if case.decode else prefill_tiles)
    ]


def tolerance(dtype: torch.dtype) -> float:
    """How far a kernel's output may lie from the reference kernel's in ``dtype``."""
    return 2e-5 if dtype == torch.float32 else 3e-2


def timed_row(
    make_run: Callable[[], Callable[[], torch.Tensor]],
    tensors: CaseTensors,
    case: TileCase,
    shape: AttentionShape,
    reference: torch.Tensor | None,
    repeats: int,
) -> dict[str, Any]:
    """One kernel on the case (``make_run`` builds its call): seconds, TFLOP/s and its difference from the reference
    output; a kernel that fails to build, compile or run is noted (``error``) and the sweep goes on."""
    device = tensors.q.device
    try:
        run = make_run()
        out = run().float()
        seconds = device_seconds(run, device, repeats, inner=INNER_CALLS)
    except Exception as e:  # (the kernel failing on this device: noted)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    row: dict[str, Any] = {"seconds": seconds, "tflops": case.flops(shape) / seconds / 1e12}
    if reference is not None:
        diff = float((out - reference).abs().max())
        row |= {"max_abs_diff": diff, "ok": diff <= tolerance(tensors.q.dtype)}
    return row


def flash_row(
    tensors: CaseTensors, case: TileCase, shape: AttentionShape, reference: torch.Tensor | None, repeats: int
) -> dict:
    """Prefill chunks on FlashAttention's variable-length kernel as ``--flash-prefill`` runs them (the Triton backend
    with ``flash_prefill``: its KV store, the chunks' contexts gathered from the cache where they have a cached
    prefix, then one call for the launch): seconds, TFLOP/s and its difference from the kernel's output; a failure
    is noted."""

    def make_run() -> Callable[[], torch.Tensor]:
        backend = TritonPagedAttention(
            shape.heads, shape.kv_heads, shape.head_dim, tensors.num_blocks, shape.block_size, tensors.q.device,
            tensors.q.dtype, flash_prefill=True,
        )  # fmt: skip
        launch = backend.prepare(tensors.batch).launches[-1]
        views = (tensors.q, tensors.k, tensors.v)
        if not triton_paged.flash_takes(launch, *views):  # (else the Triton kernel's time, mislabelled)
            raise RuntimeError("the case is not one --flash-prefill hands to FlashAttention")
        return _engine_run(backend, tensors)

    return timed_row(make_run, tensors, case, shape, reference, repeats)


LARGE_PAGE = 64  # FlexAttention reads a page a key tile (it may not span two): also timed at pages this large


def large_pages(
    case: TileCase, shape: AttentionShape, tiles: TileConfig, dtype: torch.dtype, device: torch.device, repeats: int
) -> dict:
    """The case again with pages of ``LARGE_PAGE`` tokens (``--block-size``), for our kernel's default tiles and for
    FlexAttention at its default tile (its key tiles then as long as ours): seconds each, and FlexAttention's
    difference from the kernel's output."""
    big = dataclasses.replace(shape, block_size=LARGE_PAGE)
    tensors = case_tensors(case, big, dtype, device)
    found: dict = {}
    try:
        run = kernel_run(tensors, big, tiles, dtype, device)
        reference = run().float()
        found["default_s"] = device_seconds(run, device, repeats, inner=INNER_CALLS)
        (flex,) = flex_rows(tensors, case, big, reference, repeats, prefill_tiles=(None,))
        found["flex"] = flex
        found["flex_s"] = flex.get("seconds") if flex.get("ok") else None
    except Exception as e:  # (noted: the rest of the sweep goes on)
        found["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return found


def sdpa_run(tensors: CaseTensors, case: TileCase, shape: AttentionShape) -> Callable[[], torch.Tensor] | None:
    """PyTorch's fused attention on the same case laid out densely (every sequence as long as the longest context:
    the cases' sequences are), or None where its causal mask would differ from the kernel's (a chunk over a cached
    prefix: SDPA aligns the mask to the top left)."""
    lens = {ctx for _, ctx in case.chunks}
    if len(lens) != 1 or not (case.decode or all(q == ctx for q, ctx in case.chunks)):
        return None
    (ctx,) = lens
    n, bs = len(case.chunks), shape.block_size
    table = torch.tensor(tensors.batch.block_tables, device=tensors.q.device)  # [n, blocks]
    positions = torch.arange(ctx, device=table.device)
    slots = table[:, positions // bs] * bs + positions % bs  # [n, ctx]

    def dense(cache: torch.Tensor) -> torch.Tensor:  # [n, kv_heads, ctx, head_dim]
        flat = cache.view(shape.kv_heads, -1, shape.head_dim)
        return flat[:, slots].permute(1, 0, 2, 3).contiguous()

    k, v = dense(tensors.cache[0]), dense(tensors.cache[1])
    q = tensors.q.view(n, -1, shape.heads, shape.head_dim).transpose(1, 2).contiguous()  # [n, heads, q, head_dim]
    causal = not case.decode
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def sweep_case(
    case: TileCase,
    shape: AttentionShape,
    grid: Sequence[TileConfig],
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
) -> dict:
    """Every tile shape of ``grid`` on ``case`` (the first is the default, whose output the others must give), and
    SDPA: seconds, TFLOP/s, and the fastest shape that gives the default's output."""
    tensors = case_tensors(case, shape, dtype, device)
    flops = case.flops(shape)
    reference = None
    rows: list[dict[str, Any]] = []
    for tiles in grid:
        run = kernel_run(tensors, shape, tiles, dtype, device)
        try:
            got = run().float()
            seconds = device_seconds(run, device, repeats, inner=INNER_CALLS)
        except Exception as e:  # a shape the device cannot run (shared memory): noted, the sweep goes on
            rows.append({"tiles": dataclasses.asdict(tiles), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        if reference is None:
            reference = got
        diff = float((got - reference).abs().max())
        rows.append({
            "tiles": dataclasses.asdict(tiles), "seconds": seconds, "tflops": flops / seconds / 1e12,
            "max_abs_diff": diff, "ok": diff <= tolerance(dtype),
        })  # fmt: skip
    timed = [r for r in rows if r.get("ok")]
    out: dict = {
        "chunks": len(case.chunks), "tokens": sum(q for q, _ in case.chunks), "flops": flops, "configs": rows,
        "default_s": rows[0].get("seconds"), "best": min(timed, key=lambda r: r["seconds"]) if timed else None,
    }  # fmt: skip
    if flex_paged.available():
        out["flex"] = flex_rows(tensors, case, shape, reference, repeats)
        timed_flex = [r for r in out["flex"] if r.get("ok")]
        out["flex_s"] = min(r["seconds"] for r in timed_flex) if timed_flex else None
        if shape.block_size < LARGE_PAGE:
            out[f"page{LARGE_PAGE}"] = large_pages(case, shape, grid[0], dtype, device, repeats)
    if device.type == "cuda" and not case.decode:
        out["flash"] = flash_row(tensors, case, shape, reference, repeats)
    sdpa = sdpa_run(tensors, case, shape)  # (after the kernels ran: the cache holds the new tokens' KV too)
    if sdpa is not None:
        dense = sdpa().float()  # [sequences, heads, query tokens, head_dim]
        out["sdpa_s"] = device_seconds(sdpa, device, repeats, inner=INNER_CALLS)
        out["sdpa_tflops"] = flops / out["sdpa_s"] / 1e12
        if reference is not None:
            rows_first = dense.transpose(1, 2).reshape(reference.shape)
            out["sdpa_max_abs_diff"] = float((rows_first - reference).abs().max())
    return out


def cases(tiny: bool = False) -> tuple[AttentionShape, tuple[TileCase, ...]]:
    """The 1B shape's attention and its cases (``tiny``: small ones, for the interpreter)."""
    return (TINY_SHAPE, TINY_CASES) if tiny else (LLAMA_1B, CASES)


def sweep(
    case: TileCase, device: torch.device, dtype: torch.dtype, tiny: bool = False, repeats: int = 5, small: bool = False
) -> dict:
    """``case`` over its kind's tile grid (``small``: the default and five neighbours)."""
    if not triton_paged.available(device):
        raise RuntimeError("the Triton kernels cannot run here (CUDA, or the CPU with TRITON_INTERPRET=1)")
    shape, _ = cases(tiny)
    return sweep_case(case, shape, tile_grid(case.decode, tiny, small), dtype, device, repeats)


def summary_rows(results: dict) -> list[list[str]]:
    """A row per case (``results``: by case name): the default tiles' time, the fastest shape's (as it differs from
    the default), FlexAttention's fastest that agrees with the kernel, SDPA's, and at pages of ``LARGE_PAGE`` the
    default tiles' and FlexAttention's."""

    def ms(seconds: float | None) -> str:
        return f"{seconds * 1e3:.3f}" if seconds is not None else "-"

    rows = []
    for name, case in results.items():
        best = case.get("best") or {}
        default = case["configs"][0]["tiles"] if case.get("configs") else {}
        changed = ",".join(f"{k}={v}" for k, v in (best.get("tiles") or {}).items() if default.get(k) != v)
        times = [ms(case.get("default_s")), ms(best.get("seconds")), changed or "default", ms(case.get("flex_s"))]
        large = case.get(f"page{LARGE_PAGE}") or {}
        flash = case.get("flash") or {}
        rows.append([
            name, *times, ms(case.get("sdpa_s")), ms(flash.get("seconds") if flash.get("ok") else None),
            ms(large.get("default_s")), ms(large.get("flex_s")),
        ])  # fmt: skip
    return rows
