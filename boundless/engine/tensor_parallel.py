"""The ranks past the first of a tensor-parallel engine (``--tensor-parallel-size``), each a process of its own
(``engine/rank_process.py``), as rank 0 sees and drives them.

Rank 0 is the engine: it schedules, runs its share of every forward pass and samples. Every other rank holds its
share of the weights and of the KV memory (``model/tensor_parallel.py``) and does to its own what rank 0 does to
its, in the same order: each step's block copies between device and host memory, its disk store's reads, writes
and eviction hints, and its block streams to and from other instances (the same block ids: the block tables are rank
0's, and every rank's pools have as many blocks; each rank's store holds its share of each block,
``kv/split_reads.py``; each rank streams its share to and from the peer's rank of its number, ``kv/split_streams.py``),
then the step's forward pass, whose sums meet rank 0's. Rank 0 sends both down a pipe per rank as plain inputs (the
moves; token ids, positions and the attention batch's tables), so no rank needs the scheduler's state. Logits and
sampling are rank 0's alone (the LM head is whole on each rank; the others' final hidden states are dropped). With
KV lending, each rank moves its share of a move's blocks and answers for its heads' partials
(``engine/split_lending.py``); those messages may come from a thread other than the engine loop's (a creditor's
handlers run beside its steps), so sending to the ranks and hearing them each go one thread at a time.

The ranks are started (:meth:`TensorParallelRanks.launch`) as early as the caller can, so that they load their shares
while rank 0 loads its own; once rank 0 has sized the KV memory, :meth:`TensorParallelRanks.join` sends them the
layout, waits for their KV memory and joins their sum.

A rank that fails or exits is found by rank 0 at its next send (its process has exited) or its next sum (shared
memory: the wait asks whether the ranks live; gloo reports the closed connection; NCCL, the watchdog's abort): the step
fails with :class:`RankLost`, an :class:`~boundless.engine.errors.EngineLost`, and the engine loop stops with it, as a
server whose engine died does: its requests in flight end with an error and ``/health`` answers unavailable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, Listener
from multiprocessing.connection import wait as wait_readable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from boundless.attention.backend import AttentionBatch
from boundless.config import ConfigError
from boundless.engine.errors import EngineLost
from boundless.engine.logprobs import PromptSpan
from boundless.engine.rank_process import JOIN_TIMEOUT_S, RankEndpoint, RankSpec, StepInputs, rank_sum, seconds
from boundless.kv.disk_moves import DiskAge, DiskRead, DiskReadDone, DiskWrite
from boundless.kv.remote_moves import RemoteRecv, RemoteReport, RemoteSend
from boundless.kv.split_reads import SplitReads
from boundless.kv.split_streams import SplitStreams
from boundless.kv.transfer import BlockTransfer
from boundless.model import shared_memory_sum
from boundless.model.lora import LoRARequest
from boundless.model.shared_memory_sum import SharedMemorySum
from boundless.model.tensor_parallel import RankSum, TensorParallel, check_shardable
from boundless.transport.meeting_dir import MeetingDirectory, make_meeting_directory

if TYPE_CHECKING:
    from boundless.config import EngineConfig
    from boundless.engine.builder import EngineLayout
    from boundless.model.llama import LlamaModel
    from boundless.model.loader import LoadedModel

log = logging.getLogger(__name__)


class RankLost(EngineLost):
    """A rank of a tensor-parallel engine failed or exited: the engine cannot run another step."""


class CpuThreadShare:
    """Each rank's share of the threads this process may use (PyTorch's, which OMP_NUM_THREADS sets), while split
    engines run on its CPU: reckoned from the count before the first such engine opened, rank 0's set in this process,
    and the count given back when the last closes (engines open and close in any order)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._before: int | None = None
        self._open = 0

    def take(self, size: int) -> int:
        """One more split engine of ``size`` ranks: each rank's threads (set for rank 0 here)."""
        with self._lock:
            if self._open == 0:
                self._before = torch.get_num_threads()
            self._open += 1
            assert self._before is not None
            share = max(1, self._before // size)
            torch.set_num_threads(share)
            return share

    def give_back(self) -> None:
        """One split engine fewer: with none left, the process's threads are what they were."""
        with self._lock:
            self._open -= 1
            if self._open == 0 and self._before is not None:
                torch.set_num_threads(self._before)
                self._before = None


CPU_THREADS = CpuThreadShare()


class TensorParallelRanks:
    """Ranks 1 to ``size - 1`` (see the module docstring); rank 0 is the caller. :meth:`launch` starts them loading,
    :meth:`join` makes them one model with rank 0's network."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        processes: list[subprocess.Popen[bytes]],
        pipes: list[Connection],
        store: dist.TCPStore | None,
        sum_dir: MeetingDirectory | None,
        sum_file: str | None,
    ) -> None:
        self.config = config
        self.device = device  # rank 0's
        self.processes = processes
        self.pipes = pipes
        self.store = store  # the process group's (CUDA, or a CPU that sums through gloo)
        self.sum_dir = sum_dir  # else the shared-memory sum's directory (removed at close) and file
        self.sum_file = sum_file
        self.group: RankSum | None = None  # (once joined)
        self.model: LlamaModel | None = None  # rank 0's network (once joined)
        self.lost: str | None = None  # why the ranks can run no more steps
        self.closed = threading.Event()
        self.reads = SplitReads(len(processes))  # the disk store's loads, each done once every rank's share is
        self.streams = SplitStreams(len(processes))  # block streams to and from other instances' ranks, alike
        # KV lending's shares of block moves awaited, by (word, ticket): each rank's word so far (its error, or "").
        self.lent: dict[tuple[str, int], dict[int, str]] = {}
        self.connected = False  # each rank has opened its endpoint for KV to and from other instances (connect)
        self._send_lock = threading.Lock()
        self._hear_lock = threading.Lock()

    @property
    def size(self) -> int:
        """The ranks, rank 0 among them."""
        return len(self.processes) + 1

    @staticmethod
    def launch(config: EngineConfig, device: torch.device | None = None) -> TensorParallelRanks:
        """Start the other ranks loading their shares (rank 0 on ``device``, else ``--device``'s); they wait for
        :meth:`join`. Returns at once."""
        size = config.model.tensor_parallel_size
        device = device or torch.device(config.model.device)
        threads = CPU_THREADS.take(size) if device.type == "cpu" else 1
        # Ranks on one machine's CPU sum through shared memory (1 ms a sum through gloo's loopback TCP); others through
        # a process group.
        store, sum_dir, sum_file = None, None, None
        if device.type == "cpu" and shared_memory_sum.usable():
            sum_dir = make_meeting_directory()
            sum_file = os.path.join(sum_dir.path, "sum")
            try:
                shared_memory_sum.create(sum_file, size)
            except OSError as e:  # (a small /dev/shm, as Docker's 64 MiB: gloo is slower, but works)
                log.warning("tensor parallelism: no room for the shared-memory sum (%s); the ranks sum through gloo", e)
                sum_dir.remove()
                sum_dir, sum_file = None, None
        if sum_file is None:
            store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=seconds(JOIN_TIMEOUT_S), wait_for_workers=False)
        # Fresh interpreters (not multiprocessing's spawn, which reruns the caller's main script in each: a script
        # calling LLM(...) unguarded would start ranks without end; nor fork, which copies rank 0's threads and CUDA
        # state), each given its spec on stdin, calling back here for its pipe.
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        processes: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, size):
                port = None if store is None else store.port
                spec = RankSpec(config, rank, threads, os.getpid(), port, sum_file)
                process = subprocess.Popen(
                    [sys.executable, "-c", "from boundless.engine.rank_process import rank_main; rank_main()"],
                    stdin=subprocess.PIPE,
                )
                assert process.stdin is not None
                process.stdin.write(pickle.dumps((spec, listener.address, key)))
                process.stdin.close()
                processes.append(process)
            pipes = _accept(listener, processes)
        except BaseException:
            _stop(processes, [])
            if sum_dir is not None:
                sum_dir.remove()
            if device.type == "cpu":
                CPU_THREADS.give_back()
            raise
        finally:
            listener.close()
        return TensorParallelRanks(config, device, processes, pipes, store, sum_dir, sum_file)

    def join(self, layout: EngineLayout, model: LlamaModel) -> None:
        """Send every rank the KV memory's ``layout``; once each has loaded its share and built its KV memory, join
        their sum and make ``model`` (rank 0's network) sum its products with theirs. A rank that fails to start is a
        :class:`RankLost` naming its error; every rank is then stopped."""
        size = self.config.model.tensor_parallel_size
        try:
            data = pickle.dumps(layout)
            for pipe in self.pipes:
                with contextlib.suppress(OSError):  # (a rank that failed to load: its error is read next)
                    pipe.send_bytes(data)
            for rank, (process, pipe) in enumerate(zip(self.processes, self.pipes, strict=True), start=1):
                _wait_loaded(rank, process, pipe)
            processes = self.processes
            self.group = rank_sum(
                self.sum_file, self.store, TensorParallel(0, size), self.device,
                lambda: all(p.poll() is None for p in processes),
            )  # fmt: skip
        except BaseException:
            self.close()
            raise
        self.model = model
        model.sum_over(self.all_reduce_, self.all_gather)
        if self.device.type == "cuda":
            threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        log.info("tensor parallelism: %d ranks on %s, ranks 1-%d in processes %s", size, self.device.type, size - 1,
                 ", ".join(str(p.pid) for p in self.processes))  # fmt: skip

    def moves(
        self,
        transfers: Sequence[BlockTransfer],
        reads: Sequence[DiskRead] = (),
        writes: Sequence[DiskWrite] = (),
        ages: Sequence[DiskAge] = (),
        recvs: Sequence[RemoteRecv] = (),
        sends: Sequence[RemoteSend] = (),
        forward: bool = False,
    ) -> None:
        """The step's KV moves, made on every rank as on rank 0 (``TierIO.apply``): its disk store's loads (each rank
        reads its share of the blocks, and says when it has: :meth:`reads_done`), writes and eviction hints, its
        block copies between device and host memory, and its block streams to and from other instances (each rank
        moves its share to or from the peer's rank of its number: :meth:`streams_done`). ``forward``: the step runs a
        forward pass next (during which a rank copies the layers of blocks still landing, as rank 0 does); with the
        moves go the receives reported since (their gates may go on every rank now)."""
        loads = self.reads.expect(reads)
        self.streams.expect(recvs, sends)
        if loads or writes or ages or transfers or recvs or sends:
            retire = self.streams.take_reported()
            moves = (list(transfers), loads, list(writes), list(ages), list(recvs), list(sends), retire, forward)
            self._send(("moves", moves))

    def reads_done(self, rank0: Sequence[DiskReadDone], wait_s: float = 0.0) -> tuple[DiskReadDone, ...]:
        """The loads now done on every rank, given rank 0's finished since the last call (``SplitReads.agree``); with
        ``wait_s``, wait that long at most for the other ranks when rank 0's wait for theirs."""
        self._hear(0.0)
        agreed = self.reads.agree(rank0)
        if not agreed and wait_s > 0 and self.reads.waiting:
            self._hear(wait_s)
            agreed = self.reads.agree(())
        return tuple(agreed)

    def end_step(self, ok: bool) -> None:
        """The step whose moves were sent failed on rank 0 (``ok`` False) before its forward pass ended: every rank
        fails its layerwise sends of the step, and drops its copies of blocks still landing."""
        self._send(("end", ok))

    def streams_done(self, rank0: RemoteReport, wait_s: float = 0.0) -> RemoteReport:
        """The block streams now done on every rank, given rank 0's report since the last call
        (``SplitStreams.agree``); with ``wait_s``, wait that long at most for the other ranks when rank 0's wait for
        theirs."""
        self._hear(0.0)
        agreed = self.streams.agree(rank0)
        if not (agreed.recvs or agreed.sends or agreed.counts) and wait_s > 0 and self.streams.waiting:
            self._hear(wait_s)
            agreed = self.streams.agree(RemoteReport(stats=rank0.stats))  # (rank 0's totals: agree adds the others')
        return agreed

    def connect(self, how: RankEndpoint) -> list[str]:
        """Every rank opens its endpoint for block streams (:class:`RankEndpoint`); their addresses, by rank from 1. A
        rank that cannot is a :class:`RankLost`."""
        self._send(("connect", how))
        addresses: dict[int, str] = {}
        deadline = time.monotonic() + how.endpoint.timeout_s + JOIN_TIMEOUT_S
        while len(addresses) < len(self.pipes):
            if time.monotonic() > deadline:
                raise self.lose("the ranks did not open their endpoints in time")
            self.check()
            self._hear(0.2, addresses)
        self.connected = True
        return [addresses[rank] for rank in range(1, len(self.pipes) + 1)]

    def lend(self, op: str, payload: object, awaits: tuple[str, int] | None = None) -> None:
        """A KV-lending message for every rank (``engine/rank_lending.py``'s ``RankLending``), and the word each will
        say of it (``awaits``: taken by :meth:`lend_done`; a word nobody awaits is dropped)."""
        if awaits is not None:
            with self._hear_lock:
                self.lent[awaits] = {}
        self._send(("lend", (op, payload)))

    def lend_done(self, awaits: tuple[str, int], timeout_s: float) -> list[str]:
        """Wait for every rank's word on its share of a lending block move (awaited since :meth:`lend`): the ranks'
        errors, none if each did its share. A rank silent for ``timeout_s`` counts as failed; its word, should it come
        later, is dropped."""
        deadline = time.monotonic() + timeout_s
        while len(self.lent.get(awaits, ())) < len(self.pipes) and time.monotonic() < deadline:
            self.check()
            self._hear(min(0.05, max(0.0, deadline - time.monotonic())))
        with self._hear_lock:
            said = self.lent.pop(awaits, {})
        errors = [f"rank {rank}: {error}" for rank, error in sorted(said.items()) if error]
        missing = [rank for rank in range(1, len(self.pipes) + 1) if rank not in said]
        return errors + [f"rank {rank}: no word in {timeout_s:g} s" for rank in missing]

    def lend_forget(self, awaits: tuple[str, int]) -> None:
        """Await that word no more (its move was given up): it is dropped when it comes."""
        with self._hear_lock:
            self.lent.pop(awaits, None)

    def _hear(self, timeout_s: float, addresses: dict[int, str] | None = None) -> None:
        """Take in what the ranks have said since (each load and stream of theirs as it finishes; while ``addresses``
        are awaited, their endpoints' addresses), waiting ``timeout_s`` at most for the first word."""
        with self._hear_lock:
            self._hear_locked(timeout_s, addresses)

    def _hear_locked(self, timeout_s: float, addresses: dict[int, str] | None) -> None:
        try:
            for pipe in wait_readable(self.pipes, timeout_s):
                assert isinstance(pipe, Connection)
                rank = self.pipes.index(pipe) + 1
                while pipe.poll():
                    kind, said = pickle.loads(pipe.recv_bytes())
                    if kind == "read":
                        self.reads.rank_done(rank, said)
                    elif kind == "remote":
                        self.streams.rank_done(rank, said)
                    elif kind == "lent":
                        word, ticket, error = said
                        words = self.lent.get((word, ticket))
                        if words is not None:  # (else a word of a wait given up: dropped)
                            words[rank] = error
                    elif kind == "connected" and addresses is not None:
                        addresses[rank] = said
                    elif kind == "failed" and addresses is not None:
                        raise self.lose(f"rank {rank} could not open its endpoint for KV streams: {said}")
                    else:  # (a rank says nothing else once joined)
                        raise self.lose(f"rank {rank} said {kind!r} out of turn")
        except (EOFError, OSError) as e:
            raise self.lose(f"a rank's pipe closed ({e})") from e

    def add_lora(self, request: LoRARequest, max_rank: int) -> None:
        """Every rank loads its parts of the adapter (from the same path: ranks share a machine, or its file system)."""
        self._send(("lora", (request, max_rank)))

    def remove_lora(self, name: str) -> None:
        self._send(("unlora", name))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBatch,
        lora_rows: dict[str, list[tuple[int, int]]] | None = None,
        sample_indices: torch.Tensor | None = None,
        prompt_spans: list[PromptSpan] | None = None,
    ) -> None:
        """Start the step's forward pass on every rank (rank 0 runs its own next; their sums meet), with the rows
        whose logits rank 0 computes after it (``sample_indices``, ``prompt_spans``)."""
        cpu = torch.device("cpu")
        batch = dataclasses.replace(attention, slot_mapping=attention.slot_mapping.to(cpu), device=cpu)
        samples = torch.empty(0, dtype=torch.long) if sample_indices is None else sample_indices.to(cpu)
        inputs = StepInputs(
            input_ids.to(cpu), positions.to(cpu), batch, dict(lora_rows or {}), samples, list(prompt_spans or [])
        )
        self._send(("forward", inputs))

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The group's gather (``RankSum.all_gather``), a failure of it said as the rank lost."""
        assert self.group is not None, "the ranks are not joined"
        try:
            return self.group.all_gather(tensor)
        except RuntimeError as e:
            raise self.lose(f"a gather over the ranks failed: {str(e).splitlines()[0] if str(e) else e!r}") from e

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """The group's sum (:meth:`TensorParallelGroup.all_reduce_`), a failure of it said as the rank lost."""
        assert self.group is not None, "the ranks are not joined"
        try:
            self.group.all_reduce_(tensor)
        except RuntimeError as e:
            raise self.lose(f"a sum over the ranks failed: {str(e).splitlines()[0] if str(e) else e!r}") from e

    def check(self) -> None:
        """Raise :class:`RankLost` if a rank has failed or exited (between steps: the engine stops)."""
        if self.lost is None and any(process.poll() is not None for process in self.processes):
            self.lose("")
        if self.lost is not None:
            raise RankLost(f"tensor parallelism: {self.lost}")

    def close(self) -> None:
        """Stop every rank (each exits at the end of its pipe; once the ranks are lost, at once: one may be waiting at a
        sum that will not come); rank 0's network sums nowhere again, and its threads are what they were."""
        if self.closed.is_set():
            return
        self.closed.set()  # (first: the watchdog then stops, not taking the ranks' stop for a loss)
        try:
            # (With a disk store, each rank's writer drains before it exits: TierIO.close's 30 s at most.)
            _stop(self.processes, self.pipes, 0.0 if self.lost else 40.0 if self.config.cache.kv_disk_path else 10.0)
        finally:  # (an interrupt while the ranks stop: what is rank 0's own is released all the same)
            if isinstance(self.group, SharedMemorySum):
                self.group.close()
            if self.sum_dir is not None:
                self.sum_dir.remove()
            if self.model is not None:
                self.model.sum_over(None)
            if self.device.type == "cpu":  # (its share of the CPU's threads, taken at launch)
                CPU_THREADS.give_back()

    def _watch(self) -> None:
        """On CUDA: a sum is queued on the device and never waits on the host, so a rank that dies leaves rank 0
        blocked at the step's next synchronization until NCCL's watchdog ends the process. Every second, look at the
        ranks' processes; once one has exited, abort the group, which fails the sums in flight (the step then fails,
        and the engine stops with the rank lost). Not yet run on a GPU."""
        while not self.closed.wait(1.0):
            if self.lost is not None or any(process.poll() is not None for process in self.processes):
                self.lose("")
                abort = getattr(self.group, "abort", None)
                if abort is not None:
                    with contextlib.suppress(Exception):
                        abort()
                return

    def _send(self, message: tuple[str, Any]) -> None:
        self.check()
        # (Pickled here, not by the pipe: its pickler would share tensors' storage by file descriptors.)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        sent = 0
        try:
            with self._send_lock:
                for pipe in self.pipes:
                    pipe.send_bytes(data)
                    sent += 1
        except (BrokenPipeError, ConnectionError, EOFError, OSError) as e:
            raise self.lose(f"rank {sent + 1}'s pipe closed ({e})") from e
        except BaseException as e:  # (an interrupt once sending began: some ranks have the step, or part of it)
            self.lose(f"interrupted while sending the ranks a step ({type(e).__name__})")
            raise

    def lose(self, why: str) -> RankLost:
        """Note why the ranks can go on no more (the first reason found: a rank that exited, else ``why``), and the
        error to raise."""
        if self.lost is None:
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is not None:
                    why = f"rank {rank} exited (code {process.returncode})" + (f": {why}" if why else "")
                    break
            self.lost = why
            log.error("tensor parallelism: %s", why)
            # The ranks left can run nothing more (some may wait at a sum that will not come, spinning on the CPU or
            # holding a GPU): stopped now, not when the engine is closed (a cluster may keep a lost engine a while).
            for process in self.processes:
                if process.poll() is None:
                    with contextlib.suppress(OSError):
                        process.kill()
        return RankLost(f"tensor parallelism: {self.lost}")


def load_with_ranks(config: EngineConfig) -> tuple[LoadedModel, TensorParallelRanks | None]:
    """Rank 0's share of ``config``'s model; when it is split, with the other ranks launched first, to load theirs
    meanwhile (for :meth:`EngineCore.from_model`, which joins them)."""
    from boundless.model.loader import check_device, hf_arch, load_configured_model, rank_device, resolve_model_path

    size = config.model.tensor_parallel_size
    if size > 1:  # (refused before any rank starts: a model that cannot split, a GGUF file's once loaded; a GPU short)
        path = resolve_model_path(config.model.model)
        if path.is_dir():
            check_shardable(hf_arch(path, config.model.overrides), size)
        try:
            check_device(torch.device(rank_device(config.model.device, size - 1)))
        except ConfigError as e:
            raise ConfigError(f"--tensor-parallel-size {size}: rank {size - 1}'s {e}") from None
    ranks = TensorParallelRanks.launch(config) if size > 1 else None
    try:
        return load_configured_model(config.model), ranks
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def _accept(listener: Listener, processes: Sequence[subprocess.Popen[bytes]]) -> list[Connection]:
    """Each rank's pipe, in rank order, as the ranks call back (one that exits first raises)."""
    found: dict[int, Connection] = {}
    failed: list[BaseException] = []

    def accept() -> None:
        try:
            while len(found) < len(processes):
                pipe = listener.accept()
                found[pipe.recv()] = pipe
        except BaseException as e:  # (the listener closed under it: a rank exited)
            failed.append(e)

    thread = threading.Thread(target=accept, name="tp-accept", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        for rank, process in enumerate(processes, start=1):
            if process.poll() is not None and rank not in found:
                for pipe in found.values():
                    pipe.close()
                raise RankLost(f"tensor parallelism: rank {rank} exited while starting (code {process.returncode})")
    if failed:
        raise RankLost(f"tensor parallelism: the ranks did not call back: {failed[0]}")
    return [found[rank] for rank in range(1, len(processes) + 1)]


def _wait_loaded(rank: int, process: subprocess.Popen[bytes], pipe: Connection) -> None:
    """Wait for rank ``rank`` to say it has loaded its share (a failure it reports, or its exit, raises)."""
    while not pipe.poll(0.2):
        if process.poll() is not None:
            raise RankLost(f"tensor parallelism: rank {rank} exited while loading (code {process.returncode})")
    try:
        kind, detail = pipe.recv()
    except (EOFError, OSError):
        raise RankLost(f"tensor parallelism: rank {rank} exited while loading") from None
    if kind != "loaded":
        raise RankLost(f"tensor parallelism: rank {rank} failed to start: {detail}")


def _stop(processes: Sequence[subprocess.Popen[bytes]], pipes: Sequence[Connection], wait_s: float = 10.0) -> None:
    """Tell each rank to stop, wait ``wait_s`` at most for all to exit, then kill those left."""
    for pipe in pipes:
        with contextlib.suppress(OSError, ValueError):  # (a rank gone already)
            pipe.send_bytes(b"")  # stop
        pipe.close()
    deadline = time.monotonic() + wait_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(1)
