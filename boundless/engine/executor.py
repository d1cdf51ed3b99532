"""The executor seam: what runs a scheduled step.

``EngineCore`` hands every step's plain :class:`~boundless.engine.scheduler.SchedulerOutput` to an
executor and gets a :class:`StepResult` back. The model executor runs the network and samples; the
simulator's executor returns placeholder tokens and a step time from a cost model. Nothing else in
the engine differs between the two.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from boundless.engine.cuda_graphs import DeviceWindow, seconds_between
from boundless.engine.errors import EngineLost
from boundless.engine.logprobs import PromptScores
from boundless.engine.multi_step import window_iteration
from boundless.engine.runner import ModelRunner, window_tokens
from boundless.engine.sampler import SampledToken
from boundless.engine.scheduler import SchedulerOutput
from boundless.kv.block_hash import BlockHash
from boundless.kv.cache_dtype import index_copy, index_select
from boundless.kv.disk_moves import TierReport
from boundless.kv.host_copies import HostCopies, queue_host_copies
from boundless.kv.layer_gate import LayerGate, LayerWaits
from boundless.kv.remote_io import RemoteIO
from boundless.kv.remote_moves import RemoteReport
from boundless.kv.tier_io import DEFAULT_WRITE_QUEUE_BLOCKS, TierIO
from boundless.kv.tiers import BlockStore, HostKVTier, KVTier
from boundless.kv.transfer import DEVICE, HOST, BlockTransfer, TierId, plan_transfers
from boundless.model.lora import LoRARequest

# A step with nothing to run but disk reads in flight waits this long at most for one to finish, so that an
# engine waiting only for the disk does not spin.
READ_WAIT_S = 0.02


@dataclass(frozen=True)
class StepResult:
    """One executed step: a token per sampling chunk (by request id), the step's seconds, and the disk reads
    and writes and the block streams between instances that finished meanwhile (for the scheduler).

    A multi-step window (``engine/multi_step.py``) has its first pass's tokens in ``sampled``, each later pass's in
    ``later`` (for the chunks still in it), and each pass's seconds in ``pass_seconds`` (empty: one pass). A step
    with drafts (speculative decoding) has the tokens each request keeps after its first in ``later`` alike: the
    ``j``-th of each in ``later[j - 1]``.
    ``prompt_scores``: the prompt tokens the step scored, by request id (``SamplingParams.prompt_logprobs``)."""

    sampled: dict[str, SampledToken]
    elapsed_s: float
    tier_report: TierReport = field(default_factory=TierReport)
    remote_report: RemoteReport = field(default_factory=RemoteReport)
    later: tuple[dict[str, SampledToken], ...] = ()
    pass_seconds: tuple[float, ...] = ()
    prompt_scores: dict[str, PromptScores] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # embedding requests' (``SamplingParams.embed``)


class PendingStep:
    """A step handed to :meth:`ModelExecutor.launch`: its :class:`StepResult` from :meth:`wait`. A multi-step window
    on CUDA graphs is still on the device until then (``window``); any other step has its result already."""

    def __init__(
        self,
        executor: Executor,
        sched: SchedulerOutput,
        start: float,
        result: StepResult | None = None,
        window: DeviceWindow | None = None,
        follows: bool = False,
        copies: HostCopies | None = None,
    ) -> None:
        self.executor = executor
        self.sched = sched
        self.start = start
        self.result = result
        self.window = window
        self.follows = follows  # its first inputs were the window before's tokens, on the device
        self.copies = copies  # its demotions to host memory, landed once it is read back

    def wait(self) -> StepResult:
        """The step's result: a window's tokens read back (the one wait for the device in the window)."""
        if self.result is not None:
            return self.result
        ex = self.executor
        assert self.window is not None and isinstance(ex, ModelExecutor)
        try:
            passes, seconds = window_tokens(self.window)
            if self.copies is not None:  # (queued before the window's passes: run by now)
                self.copies.land()
        except BaseException:
            if ex.remote is not None:
                ex.remote.end_step(ok=False)
            raise
        if self.follows:
            # Launched while the window before ran: the wall time since the launch holds that window's passes; the
            # device's own times are this one's.
            pass_seconds, elapsed = seconds, sum(seconds)
        else:
            # (The first pass's seconds hold the step's work before it, as when the passes run one by one.)
            pass_seconds, elapsed = [ex.timer() - self.start - sum(seconds[1:]), *seconds[1:]], None
        self.result = ex._result(self.sched, passes[0], passes[1:], pass_seconds, {}, self.start, elapsed)
        return self.result


class Executor(Protocol):
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Apply the step's block transfers, run it, and sample a token for every chunk that samples."""
        ...

    def close(self) -> None:
        """Finish what was handed over for the background (writes to the disk store) and stop."""
        ...

    def count_stored(self, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` the disk store holds (a probe, no load; 0 without a store)."""
        ...

    def add_lora(self, request: LoRARequest, max_rank: int) -> str:
        """Load a LoRA adapter for the requests that name it; returns the digest of its weights."""
        ...

    def remove_lora(self, name: str) -> bool:
        """Drop a loaded adapter; False if none has that name."""
        ...


class ModelExecutor:
    """Runs steps on the real network: KV moves between tiers, the forward pass, sampling.

    The device tier is the runner's KV cache; ``lower_tiers`` are the memory tiers below it (host memory),
    by id; ``store`` is the disk store, if any, read and written in the background (``kv/tier_io.py``).
    ``timer`` measures the step (wall time by default); it is injected so that the step time a scheduler
    sees comes from one place. ``remote`` runs the block streams between this instance and its peers
    (``kv/remote_io.py``; prefill/decode disaggregation), built over these tiers by :meth:`connect`.
    ``layerwise_load``: loads from a store behind an emulated link are usable layer by layer as they arrive
    (``kv/layer_gate.py``); a step's forward pass waits at each layer for that layer of the loads it copies
    in, ``layer_wait_timeout_s`` at most (then goes on: the bytes are in host memory already).
    ``device_steps`` (asynchronous scheduling): a step of one-token decodes runs as a device window of one pass too,
    and so does a step with prefill whose every chunk samples, so that the next step can be queued behind it
    (``EngineCore.schedule_ahead``).
    """

    def __init__(
        self,
        runner: ModelRunner,
        lower_tiers: Mapping[TierId, KVTier],
        timer: Callable[[], float] = time.perf_counter,
        store: BlockStore | None = None,
        write_queue_blocks: int = DEFAULT_WRITE_QUEUE_BLOCKS,
        layerwise_load: bool = False,
        layer_wait_timeout_s: float = 10.0,
        device_steps: bool = False,
    ) -> None:
        self.runner = runner
        self.device_steps = device_steps
        self.tiers: dict[TierId, KVTier] = {DEVICE: runner.kv_cache, **lower_tiers}
        self.timer = timer
        self.kv_io = TierIO(self.tiers, store, write_queue_blocks, layerwise=layerwise_load)
        self.layer_wait_timeout_s = layer_wait_timeout_s
        self.remote: RemoteIO | None = None

    def connect(self, remote: Callable[[Mapping[TierId, KVTier]], RemoteIO]) -> RemoteIO:
        """Give the executor its block streams to other instances, built over its memory tiers."""
        self.remote = remote(self.tiers)
        kv_io = self.kv_io
        self.remote.gates_for = lambda refs: kv_io.gates_for([r.block_id for r in refs if r.tier == HOST])
        return self.remote

    def count_stored(self, keys: Sequence[BlockHash]) -> int:
        return self.kv_io.count_stored(keys)

    def add_lora(self, request: LoRARequest, max_rank: int) -> str:
        return self.runner.add_lora(request, max_rank).digest

    def remove_lora(self, name: str) -> bool:
        return self.runner.remove_lora(name)

    def execute(self, sched: SchedulerOutput) -> StepResult:
        return self.launch(sched).wait()

    def launch(self, sched: SchedulerOutput, follows: PendingStep | None = None) -> PendingStep:
        """Start a step: a multi-step window on CUDA graphs is queued on the device and read back by
        :meth:`PendingStep.wait` (the host may decide and queue the next window meanwhile: asynchronous scheduling);
        any other step runs to its end here. ``follows``: the window still running whose last tokens are this one's
        first inputs (``Scheduler.schedule_ahead``); it must have run on the device."""
        start = self.timer()
        after = follows.window if follows is not None else None
        assert follows is None or after is not None, "a window ahead follows one on the device"
        self.runner.sampler.forget(sched.finished_ids)
        self.runner.forget_pooled(sched.finished_ids)
        on_layer = None
        snapshots, snapshot_error = None, None
        if self.remote is not None and sched.remote_recvs and sched.disk_writes:
            # The step's writes to the store copy their blocks before its receives are posted: a receive's host
            # blocks may be ones evicted for it (KVCacheManager.expect_blocks), whose old KV a write-back is taking
            # to the store, and a peer's data may land as soon as the receive is posted.
            try:
                snapshots = self.kv_io.snapshot_writes(sched.disk_writes)
            except BaseException as e:  # raised below, once the streams and reads have started as ever
                snapshots, snapshot_error = [], e
        if self.remote is not None:  # streams start whatever else happens: their peers wait for them
            on_layer = self.remote.start(sched.remote_recvs, sched.remote_sends)
        elif sched.remote_recvs or sched.remote_sends:
            raise RuntimeError("a step moves KV to or from another instance, but this executor has no transport")
        ranks = self.runner.ranks
        try:
            transfers, landing = split_landing(sched.transfers, self.remote, self.tiers)
            if ranks is not None:  # (a split model: every rank's KV moves alike, its streams started with rank 0's)
                assert after is None, "a split model's steps run eagerly: none is decided ahead"
                # (Every transfer: each rank copies what still lands on it as its own receives' gates say.)
                ranks.moves(
                    sched.transfers, sched.disk_reads, sched.disk_writes, sched.disk_ages, sched.remote_recvs,
                    sched.remote_sends, forward=bool(sched.chunks),
                )  # fmt: skip
        except BaseException:
            if self.remote is not None:
                self.remote.end_step(ok=False)
            raise
        later: list[dict[str, SampledToken]] = []
        pass_seconds: list[float] = []
        sampled: dict[str, SampledToken] = {}
        prompt_scores: dict[str, PromptScores] = {}
        embeddings: dict[str, list[float]] = {}
        waits = None
        try:
            host_copies = None
            if after is not None:  # a window ahead: its demotions' copies queued behind the window running
                transfers, host_copies = queue_host_copies(transfers, self.tiers)
            try:
                self.kv_io.apply(sched.disk_reads, sched.disk_writes, transfers, sched.disk_ages, snapshots)
            except BaseException as e:
                if ranks is None:
                    raise
                # The other ranks made the copies: their KV and rank 0's no longer hold the same blocks.
                lost = ranks.lose(f"rank 0's block copies failed ({type(e).__name__}: {e})")
                if not isinstance(e, Exception):
                    raise
                raise lost from e
            if snapshot_error is not None:
                raise snapshot_error
            waits = self._layer_waits(sched)
            before_layer = _chain(waits.before_layer if waits is not None else None, landing)
            # Multi-step decoding on CUDA graphs: the whole window on the device, no host work between its passes.
            windowed = None
            decodes = _decodes_only(sched)
            # (Embeddings and prompt scores are made of hidden states: a step on the device hands back logits only.)
            hidden = self.runner.needs_hidden_states(sched.chunks)
            if on_layer is None and before_layer is None and not hidden:
                if sched.window > 1 or (decodes and (self.device_steps or after is not None)):
                    windowed = self.runner.launch_window(sched, self.timer, after)
                elif self.device_steps and not decodes:
                    # A step with prefill: on the device too (a window of one pass), so that the step after it can be
                    # decided and queued behind it.
                    windowed = self.runner.launch_on_device(sched, self.timer, after)
            if windowed is not None:
                return PendingStep(self, sched, start, window=windowed, follows=after is not None, copies=host_copies)
            # A step decided ahead that cannot run on the device, its sampling on the host: queued behind the step it
            # follows, whose draws are its inputs; reading its logits waits for both. Its seconds are its own, from
            # marks on the device (the wall time since its launch holds the rest of the step before).
            marks = [DeviceWindow.mark(self.runner.device.type == "cuda", self.timer)] if after is not None else []
            if sched.chunks:
                step = self.runner.forward(sched, on_layer, before_layer, follows=after)
                sampled, accepted = self.runner.sample(step)
                prompt_scores, embeddings = step.prompt_scores, step.embeddings
                if accepted:  # speculative decoding: the tokens kept after the first, as a window's later passes
                    depth = max(len(tokens) for tokens in accepted.values())
                    later = [{rid: ts[j] for rid, ts in accepted.items() if len(ts) > j} for j in range(depth)]
            if landing is not None:
                landing.finish()  # every layer copied (a step without a forward pass copies them here)
            if marks:
                marks.append(DeviceWindow.mark(self.runner.device.type == "cuda", self.timer))
            if sched.window > 1 and windowed is None:  # multi-step decoding: the next passes, each on the last's tokens
                pass_seconds.append(seconds_between(*marks) if marks else self.timer() - start)
                last = {rid: t.token_id for rid, t in sampled.items()}
                for j in range(1, sched.window):
                    begun = self.timer()
                    tokens, _ = self.runner.sample(self.runner.forward(window_iteration(sched, j, last)))
                    later.append(tokens)
                    last = {rid: t.token_id for rid, t in tokens.items()}
                    pass_seconds.append(self.timer() - begun)
            if host_copies is not None:  # (a step decided ahead, run here: its demotions land once the device ran them)
                if self.runner.device.type == "cuda":
                    torch.cuda.current_stream(self.runner.device).synchronize()
                host_copies.land()
        except BaseException:
            if self.remote is not None:
                self.remote.end_step(ok=False)
                if ranks is not None and not ranks.lost:  # (their streams of the step fail too)
                    with contextlib.suppress(EngineLost):
                        ranks.end_step(ok=False)
            raise
        finally:
            if waits is not None:
                self.kv_io.count_layer_waits(waits.waited_s, waits.timeouts)
        elapsed = (sum(pass_seconds) if pass_seconds else seconds_between(*marks)) if marks else None
        result = self._result(sched, sampled, later, pass_seconds, prompt_scores, start, elapsed, embeddings)
        return PendingStep(self, sched, start, result=result)

    def _result(
        self,
        sched: SchedulerOutput,
        sampled: dict[str, SampledToken],
        later: Sequence[dict[str, SampledToken]],
        pass_seconds: Sequence[float],
        prompt_scores: dict[str, PromptScores],
        start: float,
        elapsed: float | None = None,
        embeddings: dict[str, list[float]] | None = None,
    ) -> StepResult:
        """A step's result once its tokens are in: its block streams ended, the disk I/O and streams finished
        meanwhile collected, its seconds (``elapsed``, else since ``start``)."""
        if self.remote is not None:
            self.remote.end_step(ok=True)
        if elapsed is None:
            elapsed = self.timer() - start
        idle = not sched.chunks
        remote_wait = idle and sched.num_remote_in_flight > 0 and not sched.num_reads_in_flight
        read_wait_s = READ_WAIT_S if idle and sched.num_reads_in_flight else 0.0
        tier_report = self.kv_io.report(wait_s=read_wait_s)
        if self.runner.ranks is not None:  # (a load is done once every rank has its share of the blocks)
            reads = self.runner.ranks.reads_done(tier_report.reads, read_wait_s)
            tier_report = replace(tier_report, reads=reads)
        remote_wait_s = READ_WAIT_S if remote_wait else 0.0
        remote_report = self.remote.report(wait_s=remote_wait_s) if self.remote else RemoteReport()
        if self.remote is not None and self.runner.ranks is not None:  # (a stream is done once every rank's share is)
            remote_report = self.runner.ranks.streams_done(remote_report, remote_wait_s)
            # Rank 0's gates of the receives reported now go (the manager hears of them with this result), not at its
            # own share's end: a failure held for another rank's would leave a named block ungated here.
            self.remote.retire([done.recv_id for done in remote_report.recvs])
        return StepResult(
            sampled, elapsed, tier_report, remote_report, tuple(later), tuple(pass_seconds), prompt_scores,
            embeddings or {},
        )  # fmt: skip

    @property
    def num_layers(self) -> int:
        return int(self.runner.kv_cache.data.shape[0])

    def _layer_waits(self, sched: SchedulerOutput) -> LayerWaits | None:
        """The waits of the step's forward pass on layerwise loads still arriving: those of the host blocks its
        transfers copy in (the step that copies a loaded block waits through every layer, so later steps, which
        read the copy, need not)."""
        if not sched.chunks:
            return None
        gates = self.kv_io.gates_for([t.src.block_id for t in sched.transfers if t.src.tier == HOST])
        return LayerWaits(gates, self.layer_wait_timeout_s) if gates else None

    def release_memory(self) -> None:
        """After :meth:`close`: give back the KV memory (the device pool, host memory), so that a fresh engine in this
        process can take it (``EngineLoop``'s restart in place; on a GPU the old pool would leave the new one no
        room). This executor runs no step afterwards."""
        self.runner.kv_cache.release()
        host = self.tiers.get(HOST)
        if isinstance(host, HostKVTier):
            host.release()
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        # A split model's ranks first: each hands its share of the writes to its store while rank 0's writer drains
        # its own (rank 0's writes are snapshots in host memory by now; the ranks' stop would wait behind them).
        try:
            if self.runner.ranks is not None:
                self.runner.ranks.close()
        finally:
            try:
                if self.remote is not None:  # (its streams in flight are abandoned; their peers time out)
                    self.remote.close()
            finally:
                self.kv_io.close()


class LandingCopies:
    """A step's copies of blocks still landing from a peer, layer by layer: before layer ``i`` of the forward pass,
    wait for layer ``i`` of each block (raising ``LayerLost`` when its stream has failed) and copy that layer.

    The copies run in the order the manager decided them, after the step's other transfers (they copy host blocks a
    stream owns into device blocks the step's requests were just given; nothing else of the step reads or writes
    those). ``count_waits(waits, seconds)`` is told of each wait as it starts (1, 0) and as it ends (0, seconds)."""

    def __init__(
        self,
        transfers: Sequence[BlockTransfer],
        gates: dict[int, LayerGate],
        tiers: Mapping[TierId, KVTier],
        num_layers: int,
        count_waits: Callable[[int, float], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.gates = list({id(g): g for g in gates.values()}.values())
        self.num_layers = num_layers
        self.count_waits = count_waits
        self.clock = clock
        self._copies = []
        for batch in plan_transfers(transfers):  # one read and one write per pair of tiers, as apply_transfers
            src_data = tiers[batch.src_tier].data  # type: ignore[attr-defined]
            dst_data = tiers[batch.dst_tier].data  # type: ignore[attr-defined]
            self._copies.append(
                (
                    src_data,
                    torch.tensor(batch.src_ids, dtype=torch.long, device=src_data.device),
                    dst_data,
                    torch.tensor(batch.dst_ids, dtype=torch.long, device=dst_data.device),
                )
            )
        self.copied = 0  # layers copied so far

    def before_layer(self, layer: int) -> None:
        while self.copied <= layer:
            self._copy(self.copied)

    def finish(self) -> None:
        self.before_layer(self.num_layers - 1)

    def _copy(self, layer: int) -> None:
        for gate in self.gates:
            if gate.opened <= layer:  # the forward pass is ahead of the stream: it waits for the layer
                start = self.clock()
                self.count_waits(1, 0.0)
                try:
                    gate.wait_or_raise(layer)
                finally:
                    self.count_waits(0, self.clock() - start)
        for src_data, src_ids, dst_data, dst_ids in self._copies:
            rows = index_select(src_data[layer], 2, src_ids)
            index_copy(dst_data[layer], 2, dst_ids, rows)
        self.copied = layer + 1


def split_landing(
    transfers: Sequence[BlockTransfer], remote: RemoteIO | None, tiers: Mapping[TierId, KVTier]
) -> tuple[Sequence[BlockTransfer], LandingCopies | None]:
    """A step's transfers to copy now, and those whose host blocks a counted-first receive of ``remote`` is still
    landing (a DE-read push under ``--layerwise-load on``): copied layer by layer as the forward pass reaches each."""
    if remote is None or not transfers:
        return transfers, None
    gates = remote.recv_gates([t.src.block_id for t in transfers if t.src.tier == HOST])
    if not gates:
        return transfers, None
    landing = [t for t in transfers if t.src.tier == HOST and t.src.block_id in gates]
    now = [t for t in transfers if not (t.src.tier == HOST and t.src.block_id in gates)]
    return now, LandingCopies(landing, gates, tiers, remote.num_layers, remote.count_layer_waits)


def _decodes_only(sched: SchedulerOutput) -> bool:
    """Whether every chunk of the step decodes one token and samples the next (no prefill, no drafts)."""
    return bool(sched.chunks) and all(
        len(c.token_ids) == 1 and c.sample and not c.draft_token_ids for c in sched.chunks
    )


def _chain(waits: Callable[[int], None] | None, landing: LandingCopies | None) -> Callable[[int], None] | None:
    """The forward pass's hook before each layer: the layerwise loads' waits, then the landing copies."""
    if landing is None:
        return waits
    if waits is None:
        return landing.before_layer

    def before_layer(layer: int) -> None:
        waits(layer)
        landing.before_layer(layer)

    return before_layer
