"""The GPU attention backend: paged attention with the Triton kernels of :mod:`triton_kernels`.

``prepare`` turns a step's :class:`AttentionBatch` into a few int32 tensors (uploaded in one copy):
block tables, context lengths and the mapping of kernel programs to query blocks. A step is at most
two kernel launches per layer, one over its decodes (one query token per program row block, the
context split over several programs when the batch is too small to fill the GPU) and one over its
prefill chunks (many query tokens per program), after one launch that stores the step's K/V. No
gathers, no padding to the longest context, no copies of K/V for grouped-query attention.

A sliding-window layer (``forward``'s ``window``) passes its window to the attention kernel, which reads only the
tiles in its queries' windows; the metadata is the same for every layer of a step, windowed or not. FlashAttention's
variable-length path (``flash_prefill``) serves only layers without a window.

:class:`DecodeMetadataBuffers` holds the same tensors at fixed addresses for CUDA-graph replay.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from boundless.attention.backend import AttentionBatch, padded_table, upload_ints
from boundless.attention.partials import PartialsFromLse
from boundless.kv.cache_dtype import from_cache, index_select, is_fp8, to_cache

try:
    import triton

    from boundless.attention import triton_kernels as kernels
except ImportError:  # pragma: no cover - triton ships with PyTorch's CUDA builds and the test extra
    triton = None
    kernels = None  # type: ignore[assignment]


def available(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: CUDA with Triton, or the CPU under ``TRITON_INTERPRET=1``."""
    if kernels is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write ``k``, ``v`` [tokens, kv_heads, head_dim] into the cache [kv_heads, blocks, block_size, head_dim] at
    ``slots`` in one launch; slot -1 (a padding row) stores nothing."""
    t = k.shape[0]
    if t == 0:
        return
    kv_heads, head_dim = k.shape[1], k.shape[2]
    if is_fp8(k_cache.dtype) and k_cache.device.type == "cpu":
        # Triton's interpreter rounds to fp8 wrongly where rounding up reaches the next power of two (0.49 becomes
        # 0.25); the GPU's conversion (round to nearest, saturated) is right. So on the CPU the host rounds first.
        k, v = to_cache(k, k_cache.dtype), to_cache(v, v_cache.dtype)
    assert k.stride(-1) == 1 and k.stride(-2) == head_dim and v.stride(-2) == head_dim
    saturate = float(torch.finfo(k_cache.dtype).max) if is_fp8(k_cache.dtype) and k.dtype != k_cache.dtype else 0.0
    kernels.store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), k_cache.stride(0),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, HEADS_POW2=_pow2(kv_heads), DIM_POW2=_pow2(head_dim),
        SATURATE=saturate,
    )  # fmt: skip


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class TileConfig:
    """Kernel tile shapes: rows of a decode program, rows of a prefill program, keys per tile of each. The defaults
    are the fastest of ``bench gpu --shapes tiles`` on an H200 (bf16, the 1B shape: docs/engine.md), where a
    decode's tiles of 128 keys took 8-14% less time than tiles of 64 and a prefill's tiles of 128 keys 25% more."""

    decode_rows: int = 16
    prefill_rows: int = 128
    prefill_kv_tile: int = 64
    decode_kv_tile: int = 128
    prefill_warps: int = 8
    decode_warps: int = 4
    stages: int = 3
    # The causal mask on every key tile, as before 5 December; else only on the tiles that need it (the last one or
    # two of a block of queries). A baseline for the tile sweep, which measures the two.
    mask_every_tile: bool = False
    # Programs per multiprocessor that split decodes aim for: a decode's context is split over programs when its
    # batch alone leaves fewer (flash-decoding).
    split_programs_per_sm: int = 2

    @staticmethod
    def for_device(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
        if device.type != "cuda":  # the interpreter: small tiles
            return TileConfig(prefill_rows=32, prefill_kv_tile=32, decode_kv_tile=32, prefill_warps=4, stages=1)
        if dtype == torch.float32:  # twice the bytes per tile: smaller tiles, fewer stages in shared memory
            return TileConfig(prefill_rows=64, prefill_kv_tile=32, decode_kv_tile=32, prefill_warps=4, stages=2)
        return TileConfig()


@dataclass
class KernelLaunch:
    """One attention launch over a run of sequences whose tokens are rows ``[start, end)`` of q."""

    start: int
    end: int
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [seqs] int32
    query_start: torch.Tensor  # [seqs + 1] int32, relative to ``start``
    q_block_seq: torch.Tensor  # [programs] int32
    q_block_start: torch.Tensor  # [programs] int32, relative to ``start``
    block_q: int  # query tokens per program
    num_splits: int = 1
    # Split partials, [splits, tokens, heads, head_dim] and [splits, tokens, heads], when num_splits > 1.
    part_out: torch.Tensor | None = None
    part_lse: torch.Tensor | None = None
    # Prefill chunks that each start their prompt (no cached context: their keys are the step's own rows), with the
    # longest chunk's length.
    fresh: bool = False
    max_query: int = 0
    # FlashAttention's view of a prefill launch (``flash_prefill``): each sequence's first key in the launch's keys
    # [seqs + 1] int32, the longest context, and where the keys lie in the cache (each sequence's whole context in
    # order, [keys] int32; None for a fresh launch, whose keys are the step's rows).
    key_start: torch.Tensor | None = None
    max_key: int = 0
    key_slots: torch.Tensor | None = None


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64; -1 stores nothing (padding rows)
    launches: list[KernelLaunch] = field(default_factory=list)
    # Log-sum-exp of every (token, head) of the last layer run with this metadata: [tokens, heads] fp32.
    lse: torch.Tensor | None = None
    # Run before each forward pass over buffers the caller refills (CUDA graphs): none, the kernels read the buffers
    # as they are (FlexAttention's remakes its block mask).
    refresh: Callable[[], None] | None = None


class VarlenAttention(Protocol):
    """Causal attention of variable-length sequences packed in rows, FlashAttention's variable-length call: q
    [tokens, heads, head_dim] over k, v [keys, kv_heads, head_dim], sequence i's queries rows ``cu_q[i]:cu_q[i+1]``
    and its keys ``cu_k[i]:cu_k[i+1]``, the causal mask aligned to the bottom right (a sequence's last query sees all
    its keys). Returns the output [tokens, heads, head_dim] and the log-sum-exp [heads, tokens] (fp32)."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
        max_q: int, max_k: int, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip


def flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:class:`VarlenAttention` by FlashAttention's kernel in PyTorch (``_flash_attention_forward``, CUDA, bf16 or
    fp16): grouped-query heads as they are, the mask aligned to the bottom right as FlashAttention's since 2.1."""
    o, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
    )
    if lse.shape != (q.shape[1], q.shape[0]):  # (its unpadded layout: [heads, tokens])
        raise RuntimeError(f"FlashAttention's log-sum-exp came back {tuple(lse.shape)}, not [heads, tokens]")
    return o, lse


def varlen_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:class:`VarlenAttention` computed densely in float64, a sequence at a time (any device, slow): the reference
    that FlashAttention's call is checked against, at start-up and in the tests."""
    group = q.shape[1] // k.shape[1]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for i in range(len(cq) - 1):
        qi = q[cq[i] : cq[i + 1]].double()
        ki, vi = (x[ck[i] : ck[i + 1]].double().repeat_interleave(group, dim=1) for x in (k, v))
        nq, nk = qi.shape[0], ki.shape[0]
        s = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        rows, cols = torch.arange(nq, device=q.device), torch.arange(nk, device=q.device)
        s = s.masked_fill(cols[None, :] > rows[:, None] + (nk - nq), -math.inf)  # (causal from the bottom right)
        out[cq[i] : cq[i + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vi).to(q.dtype)
        lse[:, cq[i] : cq[i + 1]] = s.logsumexp(-1).float()
    return out, lse


def check_varlen(varlen: VarlenAttention, device: torch.device, dtype: torch.dtype) -> str | None:
    """A variable-length call tried on a small case (two sequences, one over a longer context, grouped heads)
    against :func:`varlen_reference`: None when it agrees, else what went wrong. ``--flash-prefill`` asks this of
    FlashAttention's at start-up: a PyTorch build whose call is missing, or masks otherwise, is refused there, not
    found in wrong outputs."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 64, generator=gen).to(device, dtype) for n, h in ((12, 4), (29, 2), (29, 2)))
    cu_q = torch.tensor([0, 7, 12], dtype=torch.int32, device=device)  # 7 queries over 24 keys, then 5 over 5
    cu_k = torch.tensor([0, 24, 29], dtype=torch.int32, device=device)
    try:
        out, lse = varlen(q, k, v, cu_q, cu_k, 7, 24, 0.125)
    except Exception as e:  # (the call missing from this build, or refusing these tensors)
        return f"{type(e).__name__}: {e}"
    want_out, want_lse = varlen_reference(q, k, v, cu_q, cu_k, 7, 24, 0.125)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    if tuple(lse.shape) != tuple(want_lse.shape):
        return f"its log-sum-exp came back {tuple(lse.shape)}, not {tuple(want_lse.shape)}"
    worst = max(float((out.float() - want_out.float()).abs().max()), float((lse - want_lse).abs().max()))
    return None if worst <= tol else f"it differs from attention computed densely by {worst:.3g}"


def key_slots(tables: torch.Tensor, key_start: torch.Tensor, num_keys: int, block_size: int) -> torch.Tensor:
    """Where each sequence's keys lie in a paged cache, its whole context in order, the sequences one after another:
    key ``j`` of the launch is position ``j - key_start[i]`` of the sequence ``i`` whose keys hold it (``tables``
    [seqs, blocks] int32). Made on the device, from the tensors the launch uploaded: no per-token work on the host.
    int32 [num_keys]."""
    rows = torch.arange(num_keys, dtype=torch.int32, device=tables.device)
    seq = torch.searchsorted(key_start[1:], rows, right=True)
    pos = rows - key_start[seq]
    return (tables[seq, pos // block_size] * block_size + pos % block_size).to(torch.int32)


def gather_keys(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows of a cache [kv_heads, blocks, block_size, head_dim] at ``slots``, as [keys, kv_heads, head_dim]
    (contiguous: FlashAttention's layout); an 8-bit cache's as their bytes (``cache_dtype.index_select``)."""
    return index_select(cache.permute(1, 2, 0, 3).flatten(0, 1), 0, slots)


# A launch over cached prefixes gathers its contexts for FlashAttention when they hold at most this many keys per
# query row: a copy of the keys costs little beside attention that reads each of them for several queries, and the
# copy's memory stays a few times the step's tokens.
GATHERED_KEYS_PER_QUERY = 4


def flash_takes(
    launch: KernelLaunch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> bool:
    """Whether ``launch`` attends on FlashAttention (``flash_prefill``): it was prepared for it, its layer has no
    sliding ``window`` nor its model a ``softcap`` (:class:`VarlenAttention` takes neither), and FlashAttention can
    read the views it would take (q's rows; k's and v's too where its keys
    are the step's rows, not copies).

    A windowed layer takes the Triton kernel: :class:`VarlenAttention` has no window, and FlashAttention's windowed
    call (``_flash_attention_forward``'s ``window_size_left``) could not be checked against the reference without a
    GPU (``check_varlen`` would need a windowed case too)."""
    if launch.key_start is None or window is not None or softcap:
        return False
    return _flash_aligned(q, *((k, v) if launch.key_slots is None else ()))


def _flash_aligned(*tensors: torch.Tensor) -> bool:
    """Whether FlashAttention's kernel, which reads 16 bytes at a time, can take these views: rows and heads 8
    elements apart (or a multiple), at 16-byte addresses (else the Triton kernel attends: a misaligned read would
    fault the device, not raise)."""
    return all(t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0 and t.data_ptr() % 16 == 0 for t in tensors)


class TritonPagedAttention(PartialsFromLse):
    """Paged attention on the GPU (and on the CPU under the Triton interpreter, for tests). ``scale``: the softmax
    scale (by default ``head_dim ** -0.5``); ``softcap``: Gemma 2's cap of the scaled scores (a compile-time constant of
    the kernel), or None."""

    # The model runs its layers with the fused Triton kernels of boundless.model.triton_ops around it.
    fused_layers = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.bfloat16,
        tiles: TileConfig | None = None,
        max_splits: int = 16,
        flash_prefill: bool = False,
        varlen: VarlenAttention = flash_varlen,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        if kernels is None:
            raise RuntimeError("the triton attention backend needs the triton package")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.tiles = tiles or TileConfig.for_device(device, dtype)
        self.max_splits = max_splits
        # A step's prefill chunks go to FlashAttention's variable-length kernel (CUDA, bf16/fp16) in one call: the
        # chunks over a cached prefix with their contexts gathered from the cache.
        self.flash_prefill = flash_prefill
        self.varlen = varlen
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        # Programs that fill the GPU (two per multiprocessor by default).
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.target_programs = self.tiles.split_programs_per_sm * sms
        self.decode_rows = max(self.tiles.decode_rows, _pow2(self.group))
        self.prefill_block_q = max(1, self.tiles.prefill_rows // self.group)
        self.prefill_rows = max(16, _pow2(self.prefill_block_q * self.group))

    # -- once per step -----------------------------------------------------------------------

    def num_splits(self, num_decodes: int, max_context: int) -> int:
        """Split a decode's context over programs when the decodes alone leave the GPU idle (and each
        split still gets a few tiles)."""
        programs = num_decodes * self.num_kv_heads
        if programs >= self.target_programs:
            return 1
        tiles = -(-max_context // self.tiles.decode_kv_tile)
        return max(1, min(self.max_splits, -(-self.target_programs // programs), tiles // 4))

    def prepare(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        nd = batch.num_decodes
        n = len(batch.query_lens)
        ints: list[list[int]] = []  # every int32 array of the step, uploaded in one copy
        shapes: list[tuple[int, ...]] = []

        def add(values: list[int], shape: tuple[int, ...]) -> int:
            ints.append(values)
            shapes.append(shape)
            return len(ints) - 1

        plans = []
        tokens = 0
        for lo, hi, block_q in ((0, nd, 1), (nd, n, self.prefill_block_q)):
            if lo == hi:
                continue
            qlens = batch.query_lens[lo:hi]
            tables = batch.block_tables[lo:hi]
            width = max(1, max(len(t) for t in tables))
            flat = padded_table(tables, width)
            starts = [0]
            for q in qlens:
                starts.append(starts[-1] + q)
            seqs, firsts = [], []
            for i in range(len(qlens)):
                for first in range(starts[i], starts[i + 1], block_q):
                    seqs.append(i)
                    firsts.append(first)
            ids = (
                add(flat, (hi - lo, width)),
                add(batch.seq_lens[lo:hi], (hi - lo,)),
                add(starts, (hi - lo + 1,)),
                add(seqs, (len(seqs),)),
                add(firsts, (len(firsts),)),
            )
            seq_lens = batch.seq_lens[lo:hi]
            splits = self.num_splits(hi - lo, max(seq_lens)) if block_q == 1 else 1
            fresh = block_q > 1 and qlens == seq_lens  # (each chunk is its whole context)
            # FlashAttention's keys (``flash_prefill``): a fresh launch's are its rows ("rows"); a launch over cached
            # prefixes gathers its contexts (their starts' view and their number), where they are few enough per query
            # (a verify chunk of drafts over a long context stays on the Triton kernel).
            keys: tuple[int, int] | str | None = None
            if block_q > 1 and self.flash_prefill:
                if fresh:
                    keys = "rows"
                elif sum(seq_lens) <= GATHERED_KEYS_PER_QUERY * starts[-1]:
                    key_start = [0]
                    for length in seq_lens:
                        key_start.append(key_start[-1] + length)
                    keys = (add(key_start, (hi - lo + 1,)), key_start[-1])
            plans.append((tokens, tokens + starts[-1], block_q, splits, ids, fresh, max(qlens), max(seq_lens), keys))
            tokens += starts[-1]
        views = upload_ints(ints, shapes, self.device)
        meta = TritonAttentionMetadata(slot_mapping=batch.slot_mapping)
        for start, end, block_q, splits, ids, fresh, max_query, max_key, keys in plans:
            table_view, lens_view, starts_view, seqs_view, firsts_view = (views[i] for i in ids)
            launch = KernelLaunch(
                start,
                end,
                table_view,
                lens_view,
                starts_view,
                seqs_view,
                firsts_view,
                block_q=block_q,
                fresh=fresh,
                max_query=max_query,
            )
            self._set_splits(launch, splits)
            if keys == "rows":  # fresh: the keys are the step's rows, as the queries
                launch.key_start, launch.max_key = launch.query_start, max_key
            elif isinstance(keys, tuple):
                launch.key_start, launch.max_key = views[keys[0]], max_key
                launch.key_slots = key_slots(launch.block_tables, launch.key_start, keys[1], self.block_size)
            meta.launches.append(launch)
        return meta

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start: torch.Tensor,
        programs: torch.Tensor,
        max_context: int,
    ) -> TritonAttentionMetadata:
        """Metadata of a decode-only step over tensors the caller fills before each run (CUDA-graph
        replay): ``query_start`` is ``arange(n + 1)`` and ``programs`` ``arange(n)``; a padding row
        has slot -1 and context length 0. The split count is fixed for ``max_context``."""
        n = seq_lens.shape[0]
        launch = KernelLaunch(0, n, block_tables, seq_lens, query_start, programs, programs, block_q=1)
        self._set_splits(launch, self.num_splits(n, max_context))
        return TritonAttentionMetadata(slot_mapping=slot_mapping, launches=[launch])

    def _set_splits(self, launch: KernelLaunch, splits: int) -> None:
        launch.num_splits = splits
        if splits > 1:
            rows = launch.end - launch.start
            launch.part_out = torch.empty(
                splits, rows, self.num_heads, self.head_dim, dtype=torch.float32, device=self.device
            )
            launch.part_lse = torch.empty(splits, rows, self.num_heads, dtype=torch.float32, device=self.device)

    # -- every layer ---------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: TritonAttentionMetadata,
        window: int | None = None,
    ) -> torch.Tensor:
        """:meth:`AttentionBackend.forward`: ``window`` reaches the kernel as a compile-time constant (a variant per
        window size; a CUDA graph captures each layer's launch with its own), for metadata from ``prepare`` and from
        ``decode_metadata`` alike."""
        if window is not None and window < 1:
            raise ValueError(f"a sliding window holds at least one key (the query's own), not {window}")
        k_cache, v_cache = cache
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.lse is None or meta.lse.shape[0] != q.shape[0]:
            meta.lse = torch.empty(q.shape[0], self.num_heads, dtype=torch.float32, device=q.device)
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        for launch in meta.launches:
            if flash_takes(launch, q, k, v, window, self.softcap):
                self.attend_flash(q, k, v, cache, launch, out, meta.lse)
            else:
                self.attend(q, k_cache, v_cache, launch, out, meta.lse, window)
        return out

    def attend_flash(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
        launch: KernelLaunch, out: torch.Tensor, lse: torch.Tensor,
    ) -> None:  # fmt: skip
        """A launch of prefill chunks in one call of FlashAttention's variable-length kernel (:attr:`varlen`): a fresh
        launch over its own ``k`` and ``v`` rows, else over each sequence's whole context gathered from the cache
        (after the step's store: its own keys are there too). Causal attention over the whole context: never a
        sliding-window layer's (``flash_takes``)."""
        rows = slice(launch.start, launch.end)
        assert launch.key_start is not None
        if launch.key_slots is None:
            # Rounded as the cache holds them (a no-op in the model's type): what the Triton kernel would read.
            keys = from_cache(to_cache(k[rows], cache[0].dtype), q.dtype)
            values = from_cache(to_cache(v[rows], cache[1].dtype), q.dtype)
        else:
            keys = from_cache(gather_keys(cache[0], launch.key_slots), q.dtype)
            values = from_cache(gather_keys(cache[1], launch.key_slots), q.dtype)
        o, row_lse = self.varlen(
            q[rows], keys, values, launch.query_start, launch.key_start, launch.max_query, launch.max_key, self.scale
        )
        out[rows] = o
        lse[rows] = row_lse.t()

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Write ``k``, ``v`` [tokens, kv_heads, head_dim] into the cache at ``slots``."""
        store_kv(k, v, k_cache, v_cache, slots)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        launch: KernelLaunch,
        out: torch.Tensor,
        lse: torch.Tensor,
        window: int | None = None,
    ) -> None:
        """Attention of rows ``[launch.start, launch.end)`` of ``q`` over their sequences' cached
        context (under a sliding ``window``, the keys in each query's window), written (normalized) to the same rows
        of ``out``, with the log-sum-exp in ``lse``."""
        q_rows = q[launch.start : launch.end]
        o_rows = out[launch.start : launch.end]
        lse_rows = lse[launch.start : launch.end]
        rows = launch.end - launch.start
        programs = launch.q_block_seq.shape[0]
        if rows == 0 or programs == 0:
            return
        decode = launch.block_q == 1
        block_m = self.decode_rows if decode else self.prefill_rows
        split = launch.num_splits > 1
        if split:
            assert launch.part_out is not None and launch.part_lse is not None
            target, target_lse = launch.part_out, launch.part_lse
            stride_t, stride_h = self.num_heads * self.head_dim, self.head_dim
        else:
            target, target_lse = o_rows, lse_rows
            stride_t, stride_h = o_rows.stride(0), o_rows.stride(1)
        assert q_rows.stride(-1) == 1 and o_rows.stride(-1) == 1
        grid = (programs, self.num_kv_heads, launch.num_splits)
        kernels.paged_attention_kernel[grid](
            target, target_lse, q_rows, k_cache, v_cache,
            launch.block_tables, launch.seq_lens, launch.query_start, launch.q_block_seq, launch.q_block_start,
            self.scale * kernels.LOG2E, rows,
            q_rows.stride(0), q_rows.stride(1), stride_t, stride_h,
            launch.block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
            GROUP=self.group, NUM_HEADS=self.num_heads, BLOCK_Q=launch.block_q, BLOCK_M=block_m,
            BLOCK_N=self.tiles.decode_kv_tile if decode else self.tiles.prefill_kv_tile, PAGE=self.block_size,
            HEAD_DIM=self.head_dim, DIM_POW2=_pow2(self.head_dim),
            SPLIT=split, PRECISION="ieee" if q.dtype == torch.float32 else None,
            MASK_EVERY_TILE=self.tiles.mask_every_tile, WINDOW=window or 0, SOFTCAP=float(self.softcap or 0.0),
            num_warps=self.tiles.decode_warps if decode else self.tiles.prefill_warps, num_stages=self.tiles.stages,
        )  # fmt: skip
        if split:
            kernels.merge_splits_kernel[(rows, self.num_heads)](
                o_rows, lse_rows, launch.part_out, launch.part_lse, rows, launch.num_splits,
                o_rows.stride(0), o_rows.stride(1),
                NUM_HEADS=self.num_heads, HEAD_DIM=self.head_dim, DIM_POW2=_pow2(self.head_dim),
                SPLITS_POW2=_pow2(launch.num_splits),
            )  # fmt: skip
