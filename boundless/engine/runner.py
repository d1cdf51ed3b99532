"""Runs one scheduled step: flat batch tensors in, logits and sampled tokens out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from boundless.attention.backend import AttentionBackend, AttentionBatch, to_device
from boundless.attention.partial_service import RemotePartialError
from boundless.engine.cuda_graphs import DecodeGraphs, DeviceWindow
from boundless.engine.errors import EngineLost
from boundless.engine.logprobs import PromptScores, PromptSpan, SampledToken, score_prompt_spans
from boundless.engine.sampler import Sampler
from boundless.engine.scheduler import AHEAD_TOKEN, ScheduledChunk, SchedulerOutput
from boundless.engine.speculative import accepted_tokens
from boundless.engine.tensor_parallel import TensorParallelRanks
from boundless.kv.tensors import PagedKVCache
from boundless.model.llama import LlamaModel
from boundless.model.lora import LoRAAdapter, LoRARequest, load_lora, lora_batch
from boundless.model.pooling import EmbeddingPooling


@dataclass
class StepLogits:
    """Next-token logits [rows, vocab] (fp32) for the chunks that sample, in that order (a chunk with drafts: a row
    per position it samples at, each row's chunk counting the drafts before it as output); and the prompt tokens the
    step scored (``SamplingParams.prompt_logprobs``), by request id."""

    logits: torch.Tensor
    chunks: list[ScheduledChunk]
    prompt_scores: dict[str, PromptScores] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # embedding requests' (``SamplingParams.embed``)


@dataclass
class FlatBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionBatch
    sample_indices: torch.Tensor
    sample_chunks: list[ScheduledChunk]
    prompt_spans: list[PromptSpan] = field(default_factory=list)  # rows whose logits score prompt tokens
    lora_rows: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # each LoRA adapter's runs of rows
    # Rows of decodes decided ahead (their input is AHEAD_TOKEN: the token the step in flight draws), and their chunks.
    ahead_rows: list[int] = field(default_factory=list)
    ahead_chunks: list[ScheduledChunk] = field(default_factory=list)
    # Embedding requests' chunks and their runs of rows (mean pooling adds every prompt token's hidden state).
    embed_spans: list[tuple[ScheduledChunk, int, int]] = field(default_factory=list)


class ModelRunner:
    """Owns the model, the KV memory and the sampler of one instance.

    With ``graphs``, a step of decodes only (the common step) replays a captured CUDA graph; every
    other step runs eagerly. With ``ranks`` the model is rank 0 of a tensor-parallel one
    (``engine/tensor_parallel.py``): every forward pass is started on the other ranks first.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: PagedKVCache,
        attention: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        ranks: TensorParallelRanks | None = None,
        pooling: EmbeddingPooling | None = None,
        classifier: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        self.pooling = pooling or EmbeddingPooling()  # how embedding requests' hidden states become embeddings
        self.classifier = classifier  # a classifier's head [labels, hidden]: its requests' "embeddings" are its logits
        # Mean pooling: each embedding request's sum of its prompt's hidden states so far, and how many were added.
        self._pool_sums: dict[str, tuple[torch.Tensor, int]] = {}
        self.ranks = ranks  # a tensor-parallel model's other ranks: each forward pass is run on them too
        self.kv_cache = kv_cache
        self.attention = attention
        self.sampler = sampler
        self.device = device
        self.graphs = graphs
        self.loras: dict[str, LoRAAdapter] = {}  # loaded LoRA adapters by name (``add_lora``)

    def add_lora(self, request: LoRARequest, max_rank: int) -> LoRAAdapter:
        """Load an adapter (or replace one of the same name); its requests may run from the next step. A split
        model's other ranks load their parts of it too (rank 0's first: a bad adapter is refused before they hear of
        it)."""
        model = self.model
        adapter = load_lora(
            request, model.arch, model.embed_tokens.weight.dtype, self.device, max_rank, model.tensor_parallel,
            model.whole_arch,
        )  # fmt: skip
        if self.ranks is not None:
            self.ranks.add_lora(request, max_rank)
        self.loras[request.lora_name] = adapter
        return adapter

    def remove_lora(self, name: str) -> bool:
        if self.ranks is not None and name in self.loras:
            self.ranks.remove_lora(name)
        return self.loras.pop(name, None) is not None

    def build_batch(self, sched: SchedulerOutput) -> FlatBatch:
        """Lay the step out flat, decodes first (the attention backend batches them), each LoRA adapter's requests
        together (its rows one run: no gather and scatter around its matmuls)."""
        bs = self.kv_cache.block_size
        chunks = sorted(sched.chunks, key=_layout_order)
        ids: list[int] = []
        rows = PositionsAndSlots(bs)
        sample_indices: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        prompt_spans: list[PromptSpan] = []
        lora_rows: dict[str, list[tuple[int, int]]] = {}
        ahead_rows: list[int] = []
        ahead_chunks: list[ScheduledChunk] = []
        embed_spans: list[tuple[ScheduledChunk, int, int]] = []
        for chunk in chunks:
            start = chunk.start_pos
            n = len(chunk.token_ids)
            lora_name = chunk.sampling_params.lora_name
            if lora_name is not None:
                lora_rows.setdefault(lora_name, []).append((len(ids), len(ids) + n))
            if chunk.prompt_targets:  # token t is scored by position t - 1's row
                first_row = len(ids) + chunk.prompt_targets_from - 1 - start
                top_k = chunk.sampling_params.prompt_logprobs or 0
                prompt_spans.append(
                    PromptSpan(chunk.request_id, first_row, chunk.prompt_targets, chunk.prompt_targets_from, top_k)
                )
            if chunk.sampling_params.embed:
                embed_spans.append((chunk, len(ids), len(ids) + n))
            ids.extend(chunk.token_ids)
            table, first = chunk.block_ids, chunk.first_block
            if n == 1:  # a decode: most rows of a step
                rows.add_one(start, table[start // bs - first] * bs + start % bs)
                if chunk.token_ids[0] == AHEAD_TOKEN:
                    ahead_rows.append(len(ids) - 1)
                    ahead_chunks.append(chunk)
            else:
                rows.add_run(start, n, table, first)
            if chunk.draft_token_ids:  # speculative decoding: sample after the last known token and each draft
                drafts = len(chunk.draft_token_ids)
                sample_indices.extend(range(len(ids) - 1 - drafts, len(ids)))
                sample_chunks += [
                    dataclasses.replace(chunk, num_output_tokens=chunk.num_output_tokens + j) for j in range(drafts + 1)
                ]
            elif chunk.sample:
                sample_indices.append(len(ids) - 1)
                sample_chunks.append(chunk)
        dev = self.device
        positions, slots = rows.tensors(dev)
        attention = AttentionBatch(
            num_decodes=sum(1 for c in chunks if len(c.token_ids) == 1),
            query_lens=[len(c.token_ids) for c in chunks],
            # A context whose leading blocks live on other instances: the local part starts after them.
            seq_lens=[c.start_pos + len(c.token_ids) - c.first_block * bs for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            slot_mapping=slots,
            block_size=bs,
            device=dev,
            remote=tuple(c.remote for c in chunks) if any(c.remote for c in chunks) else (),
        )
        return FlatBatch(
            input_ids=to_device(torch.from_numpy(np.fromiter(ids, np.int64, len(ids))), dev),
            positions=positions,
            attention=attention,
            sample_indices=to_device(torch.tensor(sample_indices, dtype=torch.long), dev),
            sample_chunks=sample_chunks,
            prompt_spans=prompt_spans,
            lora_rows=lora_rows,
            ahead_rows=ahead_rows,
            ahead_chunks=ahead_chunks,
            embed_spans=embed_spans,
        )

    @torch.inference_mode()
    def forward(
        self,
        sched: SchedulerOutput,
        on_layer: Callable[[int], None] | None = None,
        before_layer: Callable[[int], None] | None = None,
        follows: DeviceWindow | None = None,
    ) -> StepLogits:
        """Run the step; ``on_layer(i)`` is called once layer ``i`` has stored its KV, ``before_layer(i)`` before
        layer ``i`` reads any (never in a CUDA graph). ``follows``: the step still running on the device whose draws
        are the inputs of this step's chunks decided ahead (``Scheduler.schedule_ahead``), taken there."""
        decodes_only = all(len(c.token_ids) == 1 for c in sched.chunks)
        # Leading blocks lent or given back past a sliding window: the graphs' tables start at a request's first block.
        offset = any(c.first_block for c in sched.chunks)
        scoring = self.needs_hidden_states(sched.chunks)
        adapted = any(c.sampling_params.lora_name is not None for c in sched.chunks)  # (graphs hold base weights only)
        if (
            self.graphs is not None
            and follows is None
            and decodes_only
            and not offset
            and not scoring
            and not adapted
            and on_layer is None
            and before_layer is None
            and self.graphs.fits(len(sched.chunks))
        ):
            return self._forward_graph(sched.chunks)
        batch = self.build_batch(sched)
        if batch.ahead_rows:
            if follows is None:
                raise RuntimeError("a step decided ahead ran without the step whose tokens are its inputs")
            follows.fill(batch.input_ids, batch.ahead_rows, [c.request_id for c in batch.ahead_chunks])
        meta = self.attention.prepare(batch.attention)
        lora = lora_batch(self.loras, batch.lora_rows, self.device) if batch.lora_rows else None
        if self.ranks is not None:  # (a send cut short loses the ranks; a failure before any leaves them in step)
            self.ranks.forward(
                batch.input_ids, batch.positions, batch.attention, batch.lora_rows, batch.sample_indices,
                batch.prompt_spans,
            )  # fmt: skip
        # A split vocabulary's logits and prompt scores are gathered over the ranks, which compute their columns beside
        # rank 0's: a failure there is one inside the pass. Else the ranks are done once the model's pass is.
        logits: torch.Tensor | None = None
        scores: dict[str, PromptScores] = {}
        try:
            hidden = self.model(
                batch.input_ids, batch.positions, self.attention, self.kv_cache, meta, on_layer, before_layer, lora
            )
            if self.ranks is not None and self.model.vocab_split:
                logits, scores = self._logits(hidden, batch)
        except (EngineLost, RemotePartialError):  # (the latter agreed by every rank: the ranks are in step)
            raise
        except BaseException as e:
            if self.ranks is None:
                raise
            # The other ranks are part-way through this pass, waiting at a sum or a gather that will not come: a next
            # pass's would meet theirs out of step, so none may run. (An interrupt, Ctrl-C in a notebook, is raised as
            # itself, the ranks lost all the same.)
            lost = self.ranks.lose(f"rank 0's forward pass failed ({type(e).__name__}: {e})")
            if not isinstance(e, Exception):
                raise
            raise lost from e
        if batch.embed_spans and self.pooling.kind == "mean":
            self._add_to_means(hidden, batch.embed_spans)
        if logits is None:
            logits, scores = self._logits(hidden, batch)
        last = hidden[batch.sample_indices]
        return StepLogits(logits, batch.sample_chunks, scores, self._embeddings(last, batch.sample_chunks))

    def _logits(self, hidden: torch.Tensor, batch: FlatBatch) -> tuple[torch.Tensor, dict[str, PromptScores]]:
        """The logits of the rows sampled, and the prompt spans' scores."""
        logits = self.model.compute_logits(hidden[batch.sample_indices])
        spans = batch.prompt_spans
        return logits, score_prompt_spans(hidden, spans, self.model.compute_logits) if spans else {}

    def needs_hidden_states(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether a step's chunks need hidden states, which a graph or a device window does not hand back: a prompt's
        scores, an embedding (its last chunk; every chunk under mean pooling)."""
        mean = self.pooling.kind == "mean"
        return any(c.prompt_targets or (c.sampling_params.embed and (c.sample or mean)) for c in chunks)

    def forget_pooled(self, request_ids: Iterable[str]) -> None:
        """Drop what mean pooling kept of requests that ended (aborted, failed) before their prompts did."""
        for request_id in request_ids:
            self._pool_sums.pop(request_id, None)

    def _add_to_means(self, hidden: torch.Tensor, spans: list[tuple[ScheduledChunk, int, int]]) -> None:
        for chunk, start, end in spans:
            rows = hidden[start:end].float().sum(dim=0)
            # (A chunk from the prompt's start begins anew: a request recomputed after preemption.)
            kept = None if chunk.start_pos == 0 else self._pool_sums.get(chunk.request_id)
            total, count = kept if kept is not None else (torch.zeros_like(rows), 0)
            self._pool_sums[chunk.request_id] = (total + rows, count + end - start)

    def _embeddings(self, last: torch.Tensor, chunks: list[ScheduledChunk]) -> dict[str, list[float]]:
        """The pooled states of the embedding requests whose prompt ends in this step, in fp32: their last rows
        (``last``, one per chunk that samples) or, under mean pooling, the means of their prompts' rows; through a
        classifier's head where the model has one. (An embedding is made of one by its reader:
        ``EmbeddingPooling.embedding``.)"""
        rows = [i for i, c in enumerate(chunks) if c.sampling_params.embed]
        if not rows:
            return {}
        if self.pooling.kind == "mean":
            means = []
            for i in rows:
                total, count = self._pool_sums.pop(chunks[i].request_id)
                means.append(total / count)
            pooled = torch.stack(means)
        else:
            pooled = last[torch.tensor(rows, device=last.device)].float()
        if self.classifier is not None:
            pooled = pooled @ self.classifier.T
        return {chunks[i].request_id: vector.tolist() for i, vector in zip(rows, pooled.cpu(), strict=True)}

    def _forward_graph(self, chunks: list[ScheduledChunk]) -> StepLogits:
        assert self.graphs is not None
        logits = self.graphs.run(chunks).float()  # (the graphs' are in the model's dtype)
        rows = [i for i, c in enumerate(chunks) if c.sample]
        if len(rows) < len(chunks):  # a one-token chunk in the middle of a prompt samples nothing
            logits = logits[torch.tensor(rows, device=logits.device)]
        return StepLogits(logits=logits, chunks=[chunks[i] for i in rows])

    @torch.inference_mode()
    def launch_window(
        self, sched: SchedulerOutput, timer: Callable[[], float], follows: DeviceWindow | None = None
    ) -> DeviceWindow | None:
        """Queue a multi-step window's passes on the device, with no host work between them
        (``DecodeGraphs.launch_window``); :func:`window_tokens` reads its tokens back. None when the window cannot run
        so: no graphs, a chunk the graphs do not take (lent blocks, a LoRA adapter), or one whose sampling needs the
        host each pass (``Sampler.draws_alone``); the executor then runs its passes one by one. ``follows``: the step
        still running on the device whose last tokens are the inputs of this window's chunks decided ahead
        (``Scheduler.schedule_ahead``)."""
        chunks = sched.chunks
        graphs = self.graphs
        if graphs is None or not self._graphs_take(chunks):
            return None
        sampler, vocab = self.sampler, self.model.arch.vocab_size
        return graphs.launch_window(
            chunks, lambda rows: sampler.plan_draw(rows, self.device, vocab), sampler.draw_planned, timer, follows
        )

    def _graphs_take(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a window of these chunks' decodes runs on the graphs: there are graphs, the batch fits them, no chunk
        has leading blocks elsewhere (lent, or given back past a window) or a LoRA adapter (the graphs hold the base
        weights), and each draws its tokens alone (``Sampler.draws_alone``: no drafts, no sampling that needs the host
        each pass)."""
        return (
            self.graphs is not None
            and self.graphs.fits(len(chunks))
            and not any(c.first_block or c.sampling_params.lora_name is not None for c in chunks)
            and all(map(self.sampler.draws_alone, chunks))
        )

    @torch.inference_mode()
    def launch_on_device(
        self, sched: SchedulerOutput, timer: Callable[[], float], follows: DeviceWindow | None = None
    ) -> DeviceWindow | None:
        """Queue a step with prefill chunks on the device as a window of one pass (asynchronous scheduling): its
        forward pass and its draws, its tokens left there, so that the step decided after it can take its inputs from
        them while it runs (``Scheduler.schedule_ahead``). ``follows``: the step still running whose draws are this
        one's inputs for its chunks decided ahead. None when it cannot run so: no graphs (asynchronous scheduling
        overlaps the steps of an engine on CUDA graphs), a chunk with lent (or released) blocks or drafts, one that
        scores its prompt, or one that samples by rules that need the host (``Sampler.draws_alone``); it then runs to
        its end as ever (after ``follows``, if any)."""
        chunks = sched.chunks
        sampling = [c for c in chunks if c.sample]
        if (
            self.graphs is None
            or not chunks
            or any(c.first_block or c.prompt_targets or c.draft_token_ids for c in chunks)
            or not all(map(self.sampler.draws_alone, sampling))
        ):
            return None
        marks = [DeviceWindow.mark(self.device.type == "cuda", timer)]
        step = self.forward(sched, follows=follows)
        if step.chunks:
            sampler = self.sampler
            plan = sampler.plan_draw(step.chunks, self.device, self.model.arch.vocab_size)
            tokens = sampler.draw_planned(step.logits, plan).view(1, -1)
        else:  # (the middle of prompts only: nothing drawn)
            tokens = torch.empty(1, 0, dtype=torch.long, device=self.device)
        return DeviceWindow.queued(step.chunks, tokens, marks, timer)

    @torch.inference_mode()
    def sample(self, step: StepLogits) -> tuple[dict[str, SampledToken], dict[str, list[SampledToken]]]:
        """A token for each chunk that samples, by request id; and for each chunk with drafts, the tokens it keeps
        after that one (``speculative.accepted_tokens``: the drafts that matched, then a correction or bonus)."""
        if not step.chunks:
            return {}, {}
        tokens = self.sampler.sample(step.logits, step.chunks)
        first: dict[str, SampledToken] = {}
        later: dict[str, list[SampledToken]] = {}
        i = 0
        while i < len(tokens):
            chunk = step.chunks[i]
            first[chunk.request_id] = tokens[i]
            drafts = chunk.draft_token_ids
            if drafts:
                rows = tokens[i : i + len(drafts) + 1]
                kept = accepted_tokens([t.token_id for t in rows], drafts)
                later[chunk.request_id] = rows[1:kept]
                i += len(drafts) + 1
            else:
                i += 1
        return first, later


class PositionsAndSlots:
    """A step's token positions and KV cache slots, row by row: a decode's as two ints, a chunk's as one run made
    from the blocks it spans (a Python expression per token cost ~1 ms of a 16,384-token prefill step, the GPU idle)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._positions: list[np.ndarray] = []
        self._slots: list[np.ndarray] = []
        self._one_positions: list[int] = []  # decodes since the last run
        self._one_slots: list[int] = []

    def add_one(self, position: int, slot: int) -> None:
        self._one_positions.append(position)
        self._one_slots.append(slot)

    def add_run(self, start: int, n: int, table: list[int], first_block: int) -> None:
        """Positions ``start .. start + n - 1`` of a sequence whose block ``table`` starts at its block
        ``first_block``."""
        self._take_ones()
        bs = self.block_size
        lo, hi = start // bs - first_block, (start + n - 1) // bs - first_block
        spanned = np.asarray(table[lo : hi + 1], dtype=np.int64) * bs
        if len(spanned) != hi - lo + 1:  # (a slice falls short silently: a missing slot would store KV elsewhere)
            raise IndexError(f"positions {start}..{start + n - 1} run past the {len(table)} blocks of their table")
        offset = start % bs
        self._slots.append((spanned[:, None] + np.arange(bs)).ravel()[offset : offset + n])
        self._positions.append(np.arange(start, start + n, dtype=np.int64))

    def _take_ones(self) -> None:
        if self._one_positions:
            self._positions.append(np.array(self._one_positions, dtype=np.int64))
            self._slots.append(np.array(self._one_slots, dtype=np.int64))
            self._one_positions, self._one_slots = [], []

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions and the slots, int64 on ``device`` (copied through pinned memory: nothing waits for the
        device)."""
        self._take_ones()
        out = []
        for parts in (self._positions, self._slots):
            joined = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
            out.append(to_device(torch.from_numpy(joined), device))
        return out[0], out[1]


def _layout_order(chunk: ScheduledChunk) -> tuple[bool, str]:
    lora = chunk.sampling_params.lora_name
    return len(chunk.token_ids) != 1, "" if lora is None else lora


def window_tokens(window: DeviceWindow) -> tuple[list[dict[str, SampledToken]], list[float]]:
    """A device window's tokens, each pass's by request id, and each pass's seconds: the one wait for the device in
    the window."""
    chunks = window.chunks
    passes = []
    for j, row in enumerate(window.read()):
        passes.append({c.request_id: SampledToken(t) for c, t in zip(chunks, row, strict=True) if c.num_steps > j})
    return passes, window.seconds()
