"""The simulator's executor: no network, placeholder tokens, and a step time from a cost model."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from mypy_extensions import mypyc_attr

from boundless.cluster.links import Link, Traffic
from boundless.engine.attention_time import ChunkShape
from boundless.engine.executor import StepResult
from boundless.engine.multi_step import PassRow, window_iteration, window_shapes
from boundless.engine.sampler import SampledToken
from boundless.engine.scheduler import ScheduledChunk, SchedulerOutput
from boundless.kv.block_hash import BlockHash
from boundless.kv.disk_moves import (
    DiskAge,
    DiskIOStats,
    DiskRead,
    DiskReadDone,
    DiskWrite,
    DiskWriteDone,
    TierReport,
)
from boundless.kv.remote_moves import RemoteReport
from boundless.model.lora import LoRAError, LoRARequest
from boundless.sim.cost import (
    DISK_LATENCY_S,
    DISK_READ_BYTES_PER_S,
    DISK_WRITE_BYTES_PER_S,
    HOST_COPY_BYTES_PER_S,
    StepCost,
)
from boundless.sim.remote import SimulatedRemoteIO

# Where placeholder tokens start: above the low ids where tokenizers keep their special tokens.
PLACEHOLDER_TOKEN = 100


class ShapeCost(Protocol):
    """A step cost that prices a step from its chunk shapes alone (the profiles' fitted and roofline models)."""

    def predict(self, shapes: Sequence[ChunkShape]) -> float: ...


class WindowCost(Protocol):
    """A step cost that prices a multi-step window's passes from its rows, without their shapes (the roofline)."""

    def predict_passes(self, rows: Sequence[PassRow], first: int, end: int) -> list[float]: ...


@mypyc_attr(native_class=False)  # (compiled, a class that derives from dict must stay a Python class)
class _AnyPlaceholder(dict):
    """A window pass's input tokens for the cost model, which reads only the batch's shape."""

    def __missing__(self, key: str) -> int:
        return PLACEHOLDER_TOKEN


_PLACEHOLDERS = _AnyPlaceholder()
# A step's report of an executor without a disk or a fabric (immutable: one for every step).
_NO_TIER_REPORT = TierReport()
_NO_REMOTE_REPORT = RemoteReport()


@dataclass(frozen=True)
class DiskCost:
    """What the disk store's reads and writes take: a fixed latency per request, then bytes at a bandwidth."""

    read_bytes_per_s: float = DISK_READ_BYTES_PER_S
    write_bytes_per_s: float = DISK_WRITE_BYTES_PER_S
    latency_s: float = DISK_LATENCY_S


class SimulatedDisk:
    """The disk store in virtual time: the names it holds (up to ``capacity_blocks``, least recently used out
    first), one loader and one writer, each serving its requests in turn, and a writer queue of
    ``write_queue_blocks`` beyond which writes are dropped, as the real executor's.

    With ``read_link`` (a :class:`~boundless.cluster.links.Link` that several instances' disks share: a node's
    storage NIC), reads cross that link in arrival order with every other reader's, at the link's rate, instead
    of this disk's own read bandwidth; the latency is still paid per read. With ``store``, the names are that
    shared dict's: what one instance writes, another finds."""

    def __init__(
        self,
        capacity_blocks: int,
        bytes_per_block: int,
        cost: DiskCost,
        write_queue_blocks: int,
        read_link: Link | None = None,
        store: OrderedDict[BlockHash, None] | None = None,
    ) -> None:
        self.capacity_blocks = capacity_blocks
        self.bytes_per_block = bytes_per_block
        self.cost = cost
        self.write_queue_blocks = write_queue_blocks
        self.read_link = read_link
        # The names stored; ``store`` when given (one store that several instances read and write by name).
        self.keys: OrderedDict[BlockHash, None] = store if store is not None else OrderedDict()
        self.stats = DiskIOStats()
        self._loader_free_at = 0.0
        self._writer_free_at = 0.0
        self._reads: list[tuple[float, DiskReadDone, DiskRead]] = []  # (done at, result, the read)
        self._writes: list[tuple[float, tuple[BlockHash, ...]]] = []
        self._dropped: list[DiskWriteDone] = []

    def read(self, read: DiskRead, now: float) -> None:
        found = 0
        while found < len(read.keys) and read.keys[found] in self.keys:
            self.keys.move_to_end(read.keys[found])
            found += 1
        loaded = 0 if read.is_probe else found
        if (
            self.read_link is not None
        ):  # queued with the other readers of the link (KV traffic: first come, first served)
            transfer = self.read_link.submit(loaded * self.bytes_per_block, now, Traffic.KV)
            done = self.read_link.estimated_finish(transfer) + self.cost.latency_s
        else:
            start = max(now, self._loader_free_at)
            done = start + self.cost.latency_s + loaded * self.bytes_per_block / self.cost.read_bytes_per_s
            self._loader_free_at = done
        self._reads.append((done, DiskReadDone(read.read_id, found, done - now), read))

    def write(self, write: DiskWrite, now: float) -> None:
        n = len(write.keys)
        queued = sum(len(keys) for done_at, keys in self._writes if done_at > now)
        if queued + n > self.write_queue_blocks:
            self.stats.blocks_dropped += n
            self._dropped.append(DiskWriteDone(dropped=write.keys))
            return
        start = max(now, self._writer_free_at)
        self._writer_free_at = start + self.cost.latency_s + n * self.bytes_per_block / self.cost.write_bytes_per_s
        self._writes.append((self._writer_free_at, write.keys))

    def age(self, age: DiskAge) -> None:
        """Put these names first in the eviction order (as the real store's stamps set back a day would)."""
        for key in reversed(age.keys):
            if key in self.keys:
                self.keys.move_to_end(key, last=False)
                self.stats.blocks_aged += 1

    def next_read_done(self) -> float | None:
        return min((done_at for done_at, _, _ in self._reads), default=None)

    def report(self, now: float) -> TierReport:
        """Reads and writes done by ``now``."""
        reads = []
        for _, result, read in [r for r in self._reads if r[0] <= now]:
            reads.append(result)
            if read.is_probe:
                self.stats.probes += 1
            else:
                self.stats.loads += 1
                self.stats.load_seconds += result.seconds
                self.stats.blocks_loaded += result.num_found
                self.stats.blocks_missing += len(read.keys) - result.num_found
        self._reads = [r for r in self._reads if r[0] > now]
        writes = list(self._dropped)
        self._dropped = []
        for _, keys in [w for w in self._writes if w[0] <= now]:
            for key in keys:
                self.keys[key] = None
                self.keys.move_to_end(key)
            while len(self.keys) > self.capacity_blocks:
                self.keys.popitem(last=False)
            self.stats.blocks_written += len(keys)
            writes.append(DiskWriteDone(written=keys))
        self._writes = [w for w in self._writes if w[0] > now]
        return TierReport(tuple(reads), tuple(writes), DiskIOStats(**vars(self.stats)))


class CostModelExecutor:
    """Runs steps in virtual time: every sampling chunk gets a placeholder token, and a step takes the
    seconds ``cost`` gives it plus its copies between memory tiers at ``host_copy_bytes_per_s``.

    With ``disk`` (a :class:`SimulatedDisk`), the disk store's reads and writes take virtual time in the
    background, as the real executor's do: they finish at the time the disk's cost model gives, on
    ``clock``, and are reported with the first step that ends after them; a step with nothing to run but
    reads to wait for lasts until the first of them finishes.

    The placeholder is deterministic: ``token_id`` when one is asked for (an EOS, say, to end calls
    early), else the first id from :data:`PLACEHOLDER_TOKEN` up that is neither an EOS nor one of the
    request's stop tokens, so every call runs to the length its caller set, as the workload fixes it.
    """

    def __init__(
        self,
        cost: StepCost,
        bytes_per_block: int,
        host_copy_bytes_per_s: float = HOST_COPY_BYTES_PER_S,
        token_id: int | None = None,
        clock: Callable[[], float] | None = None,
        disk: SimulatedDisk | None = None,
        host_copy_latency_s: float = 0.0,
        remote: SimulatedRemoteIO | None = None,
    ) -> None:
        self.cost = cost
        self.bytes_per_block = bytes_per_block
        self.host_copy_bytes_per_s = host_copy_bytes_per_s
        self.host_copy_latency_s = host_copy_latency_s
        self.token_id = token_id
        self.clock = clock
        self.disk = disk
        self.remote = remote  # KV streams to and from other instances (prefill/decode roles)
        # How much the other instances step beside this one now (0-1), for a cost whose steps slow with it
        # (a fitted profile's per_contention_s: engines sharing this machine's memory); set by the simulator.
        self.contention: Callable[[], float] | None = None
        self._elapsed = 0.0  # the time, when no clock is given: the steps' seconds summed

    @property
    def cost(self) -> StepCost:
        return self._cost

    @cost.setter
    def cost(self, cost: StepCost) -> None:
        """A new cost (KV lending wraps the profile's in its own, ``sim/lending.py``) and what it can price: checked
        once here, and again when replaced, so that a wrapped window cost is not called past its wrapper (by the
        method's presence, as a runtime-checkable Protocol would: a compiled module's protocols are not checkable)."""
        self._cost = cost
        self._shape_cost = cast(ShapeCost, cost) if callable(getattr(cost, "predict", None)) else None
        self._window_cost = cast(WindowCost, cost) if callable(getattr(cost, "predict_passes", None)) else None

    def execute(self, sched: SchedulerOutput) -> StepResult:
        now = self.clock() if self.clock is not None else self._elapsed
        sampled = {c.request_id: SampledToken(self._placeholder(c)) for c in sched.chunks if c.sample}
        copied = len(sched.transfers) * self.bytes_per_block  # between memory tiers, a block each
        pass_seconds: list[float] = []  # a window's, each pass's (empty: one pass)
        if not sched.chunks:
            seconds = 0.0
        elif self.contention is not None:  # a multi-step window's later passes are charged alone
            seconds = self.cost.step_time(sched, self.contention())  # type: ignore[call-arg]
        elif self._window_cost is not None:  # every pass priced from the window's rows (no shapes to make)
            pass_seconds = self._window_cost.predict_passes(window_shapes(sched).rows, 0, sched.window)
            seconds = pass_seconds[0]
        else:
            seconds = self.cost.step_time(sched)
        later: list[dict[str, SampledToken]] = []
        if sched.window == 1:
            pass_seconds = []
        else:  # multi-step decoding: the batch's later passes, each chunk one position on
            steps = [(c.request_id, c.num_steps) for c in sched.chunks]
            ends = {n for _, n in steps}
            tokens: dict[str, SampledToken] = {}
            for j in range(1, sched.window):
                if j == 1 or j in ends:  # the passes between two chunks' ends sample the same requests: one dict
                    tokens = {rid: sampled[rid] for rid, n in steps if n > j}
                later.append(tokens)
            if not pass_seconds and self._shape_cost is not None:  # priced from each pass's shapes (no batch to build)
                predict, shapes = self._shape_cost.predict, window_shapes(sched)
                pass_seconds = [seconds] + [predict(shapes[j]) for j in range(1, sched.window)]
            elif not pass_seconds:
                pass_seconds = [seconds] + [self._pass_time(sched, j) for j in range(1, sched.window)]
            seconds = sum(pass_seconds)
        if copied:  # the copies go before the forward pass, as the model executor applies them
            seconds += self.host_copy_latency_s + copied / self.host_copy_bytes_per_s
        if self.remote is not None:  # streams start whatever else happens: their peers wait for them
            self.remote.start(sched.remote_recvs, sched.remote_sends, now, now + seconds)
        elif sched.remote_recvs or sched.remote_sends:
            raise RuntimeError("a step moves KV to or from another instance, but this executor has no fabric")
        if self.disk is not None:
            for write in sched.disk_writes:
                self.disk.write(write, now)
            for age in sched.disk_ages:
                self.disk.age(age)
            for read in sched.disk_reads:
                self.disk.read(read, now)
        if not sched.chunks:  # nothing to compute: wait for the disk's next read, else the next stream's end
            waits = [self.disk.next_read_done()] if self.disk is not None else []
            if self.remote is not None and sched.num_remote_in_flight and not any(w is not None for w in waits):
                waits.append(self.remote.next_done())  # None: a stream not sent yet; the simulator parks it
            known = [w for w in waits if w is not None]
            if known:
                seconds = max(seconds, min(known) - now)
        report = self.disk.report(now + seconds) if self.disk is not None else _NO_TIER_REPORT
        remote_report = self.remote.report(now + seconds) if self.remote is not None else _NO_REMOTE_REPORT
        self._elapsed += seconds
        return StepResult(sampled, seconds, report, remote_report, tuple(later), tuple(pass_seconds))

    def _pass_time(self, sched: SchedulerOutput, j: int) -> float:
        """Seconds of pass ``j`` of a multi-step window, from that pass's batch (a cost model that does not price
        shapes)."""
        return self.cost.step_time(window_iteration(sched, j, _PLACEHOLDERS))

    def close(self) -> None:
        """Nothing runs in the background in virtual time."""

    def count_stored(self, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` the simulated store holds (0 without one)."""
        if self.disk is None:
            return 0
        found = 0
        while found < len(keys) and keys[found] in self.disk.keys:
            found += 1
        return found

    def add_lora(self, request: LoRARequest, max_rank: int) -> str:
        """The cost models price the base model's steps only."""
        raise LoRAError("the simulator does not model LoRA adapters")

    def remove_lora(self, name: str) -> bool:
        return False

    def _placeholder(self, chunk: ScheduledChunk) -> int:
        if self.token_id is not None:
            return self.token_id
        if not chunk.sampling_params.stop_token_ids and PLACEHOLDER_TOKEN not in chunk.eos_token_ids:
            return PLACEHOLDER_TOKEN  # (most chunks: no set made)
        ending = set(chunk.eos_token_ids) | set(chunk.sampling_params.stop_token_ids)
        token = PLACEHOLDER_TOKEN
        while token in ending:
            token += 1
        return token
