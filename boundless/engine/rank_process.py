"""A rank past the first of a tensor-parallel engine, in its own process (``engine/tensor_parallel.py`` starts it):
what rank 0 sends it, and the loop that does to its share of the model and of the KV memory what rank 0 does to its.

The process is a fresh interpreter (``python -c ... rank_main()``): its spec comes on stdin, and it calls rank 0 back
for its pipe. It loads its share, waits for the KV memory's layout, builds its pools and attention, joins the ranks'
sum, then applies each message in order: the step's KV moves (block copies; the disk store's loads, writes and
eviction hints, on its own store: its share of each block; its block streams to and from other instances' ranks), a
LoRA adapter to load or drop, a forward pass, the endpoint to open for block streams (a prefill or decode engine's, or
a lending instance's), KV lending's words (``engine/rank_lending.py``: its share of a move, a debtor to serve).
It says each load of its store's and each of its streams as it finishes (rank 0 reports one done once every rank's is:
``kv/split_reads.py``, ``kv/split_streams.py``). It ends when the pipe closes or says stop (an empty message), or when
rank 0's process is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from boundless.attention.backend import AttentionBatch
from boundless.attention.partial_service import RemotePartialError
from boundless.cluster.links import instance_links
from boundless.engine.logprobs import PromptSpan, score_prompt_spans
from boundless.engine.rank_lending import RankLending
from boundless.kv.remote_io import RemoteIO
from boundless.kv.tier_io import TierIO
from boundless.kv.transfer import DEVICE
from boundless.model.lora import LoRAAdapter, load_lora, lora_batch
from boundless.model.shared_memory_sum import SharedMemorySum
from boundless.model.tensor_parallel import RankSum, TensorParallel, TensorParallelGroup
from boundless.transport.endpoints import EndpointSpec, open_endpoint

if TYPE_CHECKING:
    from boundless.attention.backend import AttentionBackend
    from boundless.config import ClusterConfig, EngineConfig
    from boundless.engine.builder import EngineLayout
    from boundless.engine.executor import LandingCopies
    from boundless.kv.tensors import PagedKVCache
    from boundless.model.loader import LoadedModel

# How long a sum waits for every rank (a rank stuck this long is lost), and joining the group at start-up.
SUM_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class StepInputs:
    """What a rank needs of one forward pass: its token ids, positions and attention batch, on the CPU, and each LoRA
    adapter's runs of rows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionBatch
    lora_rows: dict[str, list[tuple[int, int]]]
    # The rows rank 0 computes logits of (a split vocabulary: every rank computes its columns of them at once).
    sample_indices: torch.Tensor
    prompt_spans: list[PromptSpan]

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        batch = self.attention
        attention = dataclasses.replace(batch, slot_mapping=batch.slot_mapping.to(device), device=device)
        return self.input_ids.to(device), self.positions.to(device), attention


@dataclass(frozen=True)
class RankSpec:
    """How a rank builds itself: the engine's config, its rank, the CPU threads it may use, rank 0's process, and where
    the ranks sum (the KV memory's layout comes later, once rank 0 has sized it)."""

    config: EngineConfig
    rank: int
    threads: int
    rank0_pid: int
    store_port: int | None  # the process group's store (ranks on CUDA, or CPUs that sum through gloo)
    sum_file: str | None  # else the shared-memory sum's file (``model/shared_memory_sum.py``)


@dataclass(frozen=True)
class RankEndpoint:
    """How each rank opens its endpoint for block streams to and from other instances' ranks: as rank 0's ``endpoint``
    (its rank among the instances, its world's size), in a world of the other instances' ranks of its number (a
    directory of its own under ``endpoint``'s), each rank behind an emulated network link of its own, as ``cluster``
    gives each instance (``--net-gbps``: a GPU's own NIC), with rank 0's stream ``timeout_s`` and ``layerwise``
    sends."""

    endpoint: EndpointSpec
    cluster: ClusterConfig
    timeout_s: float
    layerwise: bool

    def for_rank(self, rank: int) -> EndpointSpec:
        return dataclasses.replace(self.endpoint, directory=os.path.join(self.endpoint.directory, f"tp-rank{rank}"))


def rank_sum(
    sum_file: str | None, store: dist.Store | None, tp: TensorParallel, device: torch.device, alive: Callable[[], bool]
) -> RankSum:
    """Rank ``tp.rank``'s side of the ranks' sum: through the shared-memory file when the ranks have one (``alive``: do
    the other ranks still run), else the process group over ``store``."""
    if sum_file is not None:
        return SharedMemorySum(sum_file, tp.rank, tp.size, alive, SUM_TIMEOUT_S)
    assert store is not None
    return TensorParallelGroup(store, tp, device, SUM_TIMEOUT_S)


def seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def _layout(pipe: Connection) -> EngineLayout | None:
    """The KV memory's layout rank 0 sends once it has sized it; None if it is gone or says stop."""
    try:
        data = pipe.recv_bytes()
    except (EOFError, OSError):
        return None
    return pickle.loads(data) if data else None


def _exit_with(rank0_pid: int) -> None:
    """End this rank once rank 0's process is gone, whatever it is doing (loading its share, or waiting at an NCCL sum,
    holding its GPU's memory): a Ray actor is killed with SIGKILL, and its restart takes the same GPUs."""
    while os.getppid() == rank0_pid:
        time.sleep(0.5)
    os._exit(1)


def rank_main() -> None:
    """A rank's interpreter: its spec from stdin, then :func:`serve_rank` over its pipe to rank 0."""
    spec, address, key = pickle.loads(sys.stdin.buffer.read())
    threading.Thread(target=_exit_with, args=(spec.rank0_pid,), name="tp-parent", daemon=True).start()
    pipe = Client(address, authkey=key)
    pipe.send(spec.rank)
    serve_rank(spec, pipe)


def serve_rank(spec: RankSpec, pipe: Connection) -> None:
    """A rank's process: load its share; with the layout rank 0 sends, build its KV memory and attention; join the sum;
    then make each step's KV moves (on its own disk store, with one) and run each forward pass rank 0 sends, until the
    pipe closes or says stop (an empty message)."""
    from boundless.engine.builder import kv_memory, make_attention, open_disk_store
    from boundless.model.loader import load_configured_model, rank_device

    config = spec.config
    size = config.model.tensor_parallel_size
    try:
        torch.set_num_threads(spec.threads)
        if config.model.device.startswith("cuda"):  # (before anything is placed: the current device is the rank's)
            torch.cuda.set_device(torch.device(rank_device(config.model.device, spec.rank)))
        loaded = load_configured_model(config.model, rank=spec.rank)
        layout = _layout(pipe)
        if layout is None:
            return  # rank 0 is gone, or stopped the ranks before they joined
        arch, device = loaded.arch, loaded.device
        model = loaded.model
        model.prepare(layout.max_model_len, layout.rope_long)
        kv_cache, lower_tiers = kv_memory(arch, layout, device)
        tiers: dict[Any, Any] = {DEVICE: kv_cache, **lower_tiers}
        attention = make_attention(config, arch, layout, device, loaded.dtype)
        voice = _RankVoice(pipe)
        kv_io = TierIO(
            tiers, open_disk_store(loaded, config, layout) if layout.disk_bytes else None,
            on_read_done=lambda done: voice.say("read", done),
        )  # fmt: skip
        store = None
        if spec.store_port is not None:  # (the process group's: it is joined once rank 0 has heard this rank loaded)
            store = dist.TCPStore("127.0.0.1", spec.store_port, size, False, timeout=seconds(JOIN_TIMEOUT_S))
    except BaseException:
        with contextlib.suppress(EOFError, OSError):
            pipe.send(("failed", traceback.format_exc(limit=-1).strip().splitlines()[-1]))
            # Open until rank 0 has read it: rank 0 may be writing the layout, and a write to a closed socket is
            # answered with a reset, which drops the error unread.
            while pipe.recv_bytes():
                pass
        return
    pipe.send(("loaded", None))
    group = rank_sum(
        spec.sum_file, store, TensorParallel(spec.rank, size), device, lambda: os.getppid() == spec.rank0_pid
    )
    model.sum_over(group.all_reduce_, group.all_gather)
    steps = _RankSteps(spec.rank, voice, loaded, kv_cache, attention, tiers, kv_io, group)
    try:
        steps.serve(pipe)
    finally:
        steps.close()


class _RankVoice:
    """What a rank says to rank 0 on its pipe, from its loop and its loader's and streams' threads alike (one message
    at a time; a closed pipe: rank 0 is gone, and this rank ends with it)."""

    def __init__(self, pipe: Connection) -> None:
        self._pipe = pipe
        self._lock = threading.Lock()

    def say(self, kind: str, payload: object) -> None:
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._pipe.send_bytes(data)


class _RankSteps:
    """A joined rank's loop: each message rank 0 sends, in order, until its pipe closes or says stop."""

    def __init__(
        self,
        rank: int,
        voice: _RankVoice,
        loaded: LoadedModel,
        kv_cache: PagedKVCache,
        attention: AttentionBackend,
        tiers: dict[Any, Any],
        kv_io: TierIO,
        group: RankSum,
    ) -> None:
        self.rank = rank
        self.group = group
        self.voice = voice
        self.loaded = loaded
        self.kv_cache = kv_cache
        self.attention = attention
        self.tiers = tiers
        self.kv_io = kv_io
        self.loras: dict[str, LoRAAdapter] = {}  # (the adapters rank 0 has loaded, this rank's parts of them)
        self.transport: Any = None  # its endpoint for block streams, once rank 0 has said to open it
        self.remote: RemoteIO | None = None
        self.lending: RankLending | None = None  # its part in KV lending, once rank 0 has turned it on
        self._streaming = False  # streams started since the last forward pass (its layerwise sends end with it)
        self._on_layer: Callable[[int], None] | None = None
        self._landing: LandingCopies | None = None  # the step's copies of blocks still landing, layer by layer
        self._stop = threading.Event()

    def serve(self, pipe: Connection) -> None:
        with torch.inference_mode():
            while True:
                try:
                    data = pipe.recv_bytes()
                except (EOFError, OSError):
                    return  # rank 0 is gone
                if not data:
                    return  # (stop)
                kind, payload = pickle.loads(data)
                if kind == "moves":
                    self._moves(*payload)
                elif kind == "lora":
                    request, max_rank = payload
                    model = self.loaded.model
                    self.loras[request.lora_name] = load_lora(
                        request, model.arch, self.loaded.dtype, self.loaded.device, max_rank, model.tensor_parallel,
                        model.whole_arch,
                    )  # fmt: skip
                elif kind == "unlora":
                    self.loras.pop(payload, None)
                elif kind == "connect":
                    self._connect(payload)
                elif kind == "end":
                    self._end_step(ok=payload)
                elif kind == "lend":
                    self._lend(*payload)
                else:
                    self._forward(payload)

    def _moves(
        self, transfers: Any, loads: Any, writes: Any, ages: Any, recvs: Any, sends: Any, retire: Any, forward: bool
    ) -> None:
        """The step's moves in rank 0's order (``ModelExecutor.launch``): the writes' snapshots before the receives are
        posted (a receive may land in a block a write-back is taking to the store), the streams, then the copies (of
        blocks still landing from a counted-first receive, layer by layer during the ``forward`` pass, as the gates of
        this rank's share say; the gates of receives rank 0 has reported go first)."""
        self._end_step()  # (the last step's, should its forward pass not have come)
        snapshots = None
        if self.remote is not None:
            self.remote.retire(retire)
            snapshots = self.kv_io.snapshot_writes(writes) if recvs and writes else None
            with torch.inference_mode(False):  # (its staging tensors are written by its receiver thread, outside it)
                self._on_layer = self.remote.start(recvs, sends)
            self._streaming = True
        elif recvs or sends:
            raise RuntimeError(f"rank {self.rank}: a step moves KV to or from another instance before its endpoint")
        from boundless.engine.executor import split_landing  # (the executor's modules import this one)

        now, self._landing = split_landing(transfers, self.remote, self.tiers)
        self.kv_io.apply(loads, writes, now, ages, snapshots)
        self.kv_io.report()  # (rank 0 reports the moves: this rank's finished ones, kept for a report, are dropped)
        if not forward:
            self._end_step()

    def _forward(self, payload: StepInputs) -> None:
        model, device = self.loaded.model, self.loaded.device
        input_ids, positions, batch = payload.on(device)
        lora = lora_batch(self.loras, payload.lora_rows, device) if payload.lora_rows else None
        meta = self.attention.prepare(batch)
        before_layer = self._landing.before_layer if self._landing is not None else None
        try:
            hidden = model(
                input_ids, positions, self.attention, self.kv_cache, meta, self._on_layer, before_layer, lora
            )
        except RemotePartialError:  # (agreed by every rank after the last layer: rank 0 drops the step)
            self._end_step()
            return
        self._end_step()
        if model.vocab_split:  # (the logits rank 0 computes next, its columns of them here, in its order)
            model.compute_logits(hidden[payload.sample_indices.to(device)])
            if payload.prompt_spans:
                score_prompt_spans(hidden, payload.prompt_spans, model.compute_logits)

    def _end_step(self, ok: bool = True) -> None:
        """The step's forward pass is over, or it has none: the blocks still landing are copied whole, and the layerwise
        sends of its streams end (their trailers go out). Failed on rank 0 (not ``ok``): the copies are dropped (its
        requests do not run on them) and the sends fail."""
        landing, self._landing = self._landing, None
        if landing is not None and ok:
            landing.finish()
        if self.remote is not None and self._streaming:
            self.remote.end_step(ok=ok)
        self._streaming, self._on_layer = False, None

    def _connect(self, how: RankEndpoint) -> None:
        """Open this rank's endpoint and its block streams; say its address (or why it could not)."""
        try:
            self.transport = open_endpoint(how.for_rank(self.rank))
            link = instance_links(how.cluster, time.monotonic, time.sleep).net
            # (Its gates go once rank 0 has reported their receives: ``kv/split_streams.py``.)
            self.remote = RemoteIO(
                self.tiers, self.transport, link.transfer if link else None, how.timeout_s, layerwise=how.layerwise,
                rank=self.rank, retire_on_report=False,
            )  # fmt: skip
        except Exception as e:
            self.voice.say("failed", f"{type(e).__name__}: {e}")
            return
        threading.Thread(target=self._report_streams, name="tp-streams", daemon=True).start()
        self.voice.say("connected", self.transport.address)

    def _lend(self, op: str, payload: Any) -> None:
        """A KV-lending word from rank 0: turn lending on (its attention becomes DistAttention; with the endpoint rank 0
        had it open), or carry out a move's share or a debtor to serve (``RankLending.apply``)."""
        if op == "on":
            if self.transport is None:
                raise RuntimeError(f"rank {self.rank}: KV lending before its endpoint")
            self.lending = RankLending(
                self.rank, self.transport, self.kv_cache, self.attention, self.group.all_reduce_,
                lambda said, tag, error: self.voice.say("lent", (said, tag, error)), timeout_s=payload,
            )  # fmt: skip
            self.attention = self.lending.attention
            return
        if self.lending is None:
            raise RuntimeError(f"rank {self.rank}: a lending word ({op}) before lending was on")
        self.lending.apply(op, payload)

    def _report_streams(self) -> None:
        """Say each of this rank's streams as it finishes (rank 0 reports a stream once every rank's share is done)."""
        assert self.remote is not None
        while not self._stop.is_set():
            report = self.remote.report(wait_s=0.5)
            if report.recvs or report.sends or report.counts:  # (a count alone too: rank 0 names the blocks at it)
                self.voice.say("remote", report)

    def close(self) -> None:
        self._stop.set()
        try:
            if self.lending is not None:
                self.lending.close()
            if self.remote is not None:
                self.remote.close()
            if self.transport is not None:
                self.transport.close()
        finally:
            self.kv_io.close()  # (its writes handed over so far go to the store first)
