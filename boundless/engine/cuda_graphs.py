"""Decode steps replayed as CUDA graphs.

A decode step runs hundreds of small kernels (norms, rotary, the attention launches, activations);
launched one by one from Python, the GPU waits on the CPU. :class:`DecodeGraphs` captures the
forward pass and LM head of a decode-only batch once per batch-size bucket, over input buffers at
fixed addresses, and replays it: a step copies its token ids, positions, KV slots, context lengths
and block tables into the buffers (padding rows get slot -1 and context 0, so they store and
attend to nothing) and launches one graph. Mixed and prefill steps run eagerly.

Without :meth:`DecodeGraphs.capture` (on the CPU, in tests) :meth:`DecodeGraphs.run` runs the same
forward pass over the same buffers eagerly: everything but the graph itself.
"""

from __future__ import annotations

import gc
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from boundless.attention.backend import padded_table, to_device, to_host
from boundless.attention.flex_paged import FlexAttentionMetadata, FlexPagedAttention
from boundless.attention.triton_paged import TritonAttentionMetadata, TritonPagedAttention
from boundless.engine.scheduler import AHEAD_TOKEN, ScheduledChunk
from boundless.engine.window_inputs import StepInputs, advance
from boundless.kv.tensors import PagedKVCache
from boundless.model.llama import LlamaModel


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every 16 up to ``max_batch`` (a step of n decodes
    replays the smallest bucket that holds it)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes) | {max_batch})


@dataclass
class DeviceWindow:
    """A multi-step window queued on the device (:meth:`DecodeGraphs.launch_window`): its tokens [window, n] there (row
    ``i`` of pass ``j`` is chunk ``i``'s when it has more than ``j`` passes, else 0) and the marks around its passes
    (CUDA events on a GPU, the timer's readings elsewhere). Reading either back waits for the window."""

    chunks: list[ScheduledChunk]
    tokens: torch.Tensor
    marks: list
    host_tokens: torch.Tensor  # the tokens' copy in host memory, complete once ``copied`` has passed
    copied: torch.cuda.Event | None = None

    def read(self) -> list[list[int]]:
        """The tokens, pass by pass (waits for the window's own passes and their copy, not for what follows them)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host_tokens.tolist()

    def seconds(self) -> list[float]:
        """Each pass's seconds (waits for the window to end)."""
        return [seconds_between(a, z) for a, z in itertools.pairwise(self.marks)]

    @staticmethod
    def mark(on_gpu: bool, timer: Callable[[], float]) -> Any:
        """A mark between a window's passes: a CUDA event recorded now on a GPU, the timer's reading elsewhere."""
        if not on_gpu:
            return timer()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def queued(
        chunks: Sequence[ScheduledChunk], tokens: torch.Tensor, marks: list, timer: Callable[[], float]
    ) -> DeviceWindow:
        """The window whose passes were queued after ``marks``' first: its last mark, and on a GPU its tokens' copy to
        the host queued now, behind its passes and ahead of a window queued after it (reading them back then waits for
        this window alone: a copy made at the read would wait for everything queued by then)."""
        on_gpu = tokens.is_cuda
        marks.append(DeviceWindow.mark(on_gpu, timer))
        if not on_gpu:
            return DeviceWindow(list(chunks), tokens, marks, tokens)
        host, copied = to_host(tokens)
        return DeviceWindow(list(chunks), tokens, marks, host, copied)

    def last_tokens(self, request_ids: Sequence[str]) -> torch.Tensor:
        """The last token each of these requests draws in the window, on the device (nothing waits)."""
        n = len(self.chunks)
        row = {c.request_id: i for i, c in enumerate(self.chunks)}
        index = [(self.chunks[row[rid]].num_steps - 1) * n + row[rid] for rid in request_ids]
        return self.tokens.view(-1).index_select(
            0, to_device(torch.tensor(index, dtype=torch.long), self.tokens.device)
        )

    def fill(self, ids: torch.Tensor, rows: Sequence[int], request_ids: Sequence[str]) -> None:
        """Write into ``ids``' ``rows`` the last token each of these requests draws in the window, on the device
        (nothing waits): the inputs of a step decided ahead's chunks that follow this window."""
        last = self.last_tokens(request_ids)
        if list(rows) == list(range(len(rows))):  # (the steady state: every row follows, in order)
            ids[: len(rows)].copy_(last)
        else:  # (a request left out of the step before, back: its token is known)
            ids.index_copy_(0, to_device(torch.tensor(rows, dtype=torch.long), ids.device), last)


def seconds_between(a: Any, z: Any) -> float:
    """Seconds between two marks (:meth:`DeviceWindow.mark`): on a GPU, of the device's time between the events
    (waits for ``z``)."""
    if isinstance(z, torch.cuda.Event):
        z.synchronize()
        return a.elapsed_time(z) / 1e3
    return z - a


class DecodeGraphs:
    """One captured decode step per batch bucket, sharing one memory pool and one set of input buffers."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: PagedKVCache,
        attention: TritonPagedAttention | FlexPagedAttention,
        max_batch: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = device
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        max_blocks = -(-max_model_len // kv_cache.block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.programs = torch.arange(n, dtype=torch.int32, device=device)
        self.inputs = StepInputs(self.input_ids, self.positions, self.slots, self.seq_lens, self.block_tables)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._metas: dict[int, TritonAttentionMetadata | FlexAttentionMetadata] = {}
        # The RoPE table the graphs read, by address: kept alive if another engine built on the same model needs a
        # longer one (``LlamaModel.prepare``), whose memory would otherwise be reused under these graphs.
        self._rope = model.rope

    def fits(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.max_batch

    def _meta(self, b: int) -> TritonAttentionMetadata | FlexAttentionMetadata:
        return self.attention.decode_metadata(
            self.slots[:b],
            self.block_tables[:b],
            self.seq_lens[:b],
            self.query_start[: b + 1],
            self.programs[:b],
            self.max_model_len,
        )

    def _forward(self, b: int, meta: TritonAttentionMetadata | FlexAttentionMetadata) -> torch.Tensor:
        if meta.refresh is not None:
            meta.refresh()  # (FlexAttention's block mask from the buffers: inside the graph, each replay remakes it)
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.attention, self.kv_cache, meta)
        # In the model's dtype: a window's greedy rows take their argmax there (``Sampler.draw_planned``); a single
        # step's sampler takes them in fp32 (``ModelRunner``).
        return self.model.compute_logits(hidden, float32=False)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones then reuse its pool's memory). The
        buffers hold padding meanwhile, so the warm-up runs write no KV."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        # The window-inputs kernel compiled now rather than at the first window (every row inactive: the padding the
        # buffers hold stays as it is).
        rows = torch.zeros(1, self.max_batch, dtype=torch.long, device=self.device)
        advance(rows, 0, rows[0], self.inputs, self.kv_cache.block_size)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # No garbage collection while capturing: a collection there may free another engine's graphs (an earlier
        # `LLM` in the same process, left in a reference cycle), and freeing one mid-capture invalidates the capture
        # ("operation failed due to a previous error during capture"). PyTorch no longer collects before a capture.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(stream):
                for b in reversed(self.buckets):
                    meta = self._meta(b)
                    self._forward(b, meta)  # compiles the kernels and settles the allocator
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        logits = self._forward(b, meta)
                    self._graphs[b] = (graph, logits)
                    self._metas[b] = meta
        finally:
            if collecting:
                gc.enable()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only step of n one-token chunks; valid until the next run."""
        return self._replay(self._load(chunks))[: len(chunks)]

    def launch_window(
        self,
        chunks: Sequence[ScheduledChunk],
        plan: Callable[[Sequence[ScheduledChunk]], Any],
        draw: Callable[[torch.Tensor, Any], torch.Tensor],
        timer: Callable[[], float],
        follows: DeviceWindow | None = None,
    ) -> DeviceWindow:
        """Queue a multi-step window's passes (``engine/multi_step.py``) of one-token decodes, all on the device: each
        pass replays the graph and ``draw(logits, plan(rows))`` picks the tokens of the rows still decoding; the next
        pass's inputs are made there from them (the tokens, each position and context length one on, the slot from the
        block table the window's blocks are in already), so the host neither waits for a pass nor builds the next one:
        the GPU runs the window back to back. A chunk with fewer passes (``num_steps``) than the window turns into
        padding after its last, and draws nothing more (the shared generator's draws are those of the passes one by
        one). The plans and row indices of every pass are made before the first, and every copy from the host is
        queued in stream order: nothing waits for the device, which may still be running the window before.

        ``follows``: the step still running on the device whose tokens are the first inputs of this window's chunks
        decided ahead (asynchronous scheduling, ``Scheduler.schedule_ahead``): each such chunk's first token is its
        request's last token there, taken on the device (the chunk's own ``token_ids`` hold a placeholder)."""
        n = len(chunks)
        bs = self.kv_cache.block_size
        window = max(c.num_steps for c in chunks)
        b = self._load(chunks)
        dev = self.device
        if follows is not None:
            ahead = [i for i, c in enumerate(chunks) if c.token_ids[0] == AHEAD_TOKEN]
            if ahead:
                follows.fill(self.input_ids, ahead, [chunks[i].request_id for i in ahead])
        # Each pass's rows (those with more passes than it), made before the first pass: the set shrinks as rows end,
        # so it is made again only after a pass where some end (a row ends after its ``num_steps`` passes).
        ending = Counter(c.num_steps for c in chunks)
        passes: list[tuple[torch.Tensor | None, Any]] = []
        for j in range(window):
            if j == 0 or ending[j]:
                rows = [i for i, c in enumerate(chunks) if c.num_steps > j]
                index = None if len(rows) == n else to_device(torch.tensor(rows, dtype=torch.long), dev)
                current = (index, plan([chunks[i] for i in rows]))
            passes.append(current)
        steps = to_device(torch.tensor([c.num_steps for c in chunks]), dev)
        tokens = torch.zeros(window, n, dtype=torch.long, device=dev)  # (a padding row's 0 is a valid input id)
        on_gpu = dev.type == "cuda"
        marks: list = []
        for j, (index, rows_plan) in enumerate(passes):
            marks.append(DeviceWindow.mark(on_gpu, timer))
            logits = self._replay(b)[:n]
            if index is None:
                tokens[j] = draw(logits, rows_plan)
            else:
                tokens[j].index_copy_(0, index, draw(logits[index], rows_plan))
            if j + 1 < window:
                # Rows still decoding move one position on; a finished row stays where it was (its table's index
                # stays in range) and becomes padding: no KV stored, nothing attended.
                advance(tokens, j, steps, self.inputs, bs)
        return DeviceWindow.queued(chunks, tokens, marks, timer)

    def _load(self, chunks: Sequence[ScheduledChunk]) -> int:
        """Copy the inputs of a step of one-token chunks into the buffers (padding rows after them): each chunk's token,
        position, KV slot, context length and block table. Returns the bucket that holds them."""
        n = len(chunks)
        b = next(size for size in self.buckets if size >= n)
        bs = self.kv_cache.block_size
        positions = [c.start_pos for c in chunks]
        slots = [c.block_ids[p // bs] * bs + p % bs for c, p in zip(chunks, positions, strict=True)]
        block_tables = [c.block_ids for c in chunks]
        staging = torch.zeros(b, 4, dtype=torch.long)
        staging[:n] = torch.tensor(
            [[c.token_ids[0] for c in chunks], positions, slots, [p + 1 for p in positions]], dtype=torch.long
        ).t()
        staging[n:b, 2] = -1  # padding rows: no KV stored, nothing attended
        staging[n:b, 3] = 0
        # (Copies in stream order, each from its own pinned buffer: the window before may still be running.)
        dev = to_device(staging, self.device)
        self.input_ids[:b].copy_(dev[:, 0])
        self.positions[:b].copy_(dev[:, 1])
        self.slots[:b].copy_(dev[:, 2])
        self.seq_lens[:b].copy_(dev[:, 3])
        width = max(len(t) for t in block_tables)
        table = torch.tensor(padded_table(block_tables, width), dtype=torch.int32).view(n, width)
        self.block_tables[:n, :width].copy_(to_device(table, self.device))
        return b

    def _replay(self, b: int) -> torch.Tensor:
        """The logits [b, vocab] of the buffers' first ``b`` rows: the bucket's graph replayed (eagerly without one)."""
        if b in self._graphs:
            graph, logits = self._graphs[b]
            graph.replay()
            return logits
        if b not in self._metas:
            self._metas[b] = self._meta(b)
        return self._forward(b, self._metas[b])
