"""A persistent KV block store on a local (or shared) directory, keyed by the chained block hash.

The directory is the index: a block is the file ``<path>/<layout digest>/<key[:1] hex>/<key hex>.kv``
(format in ``kv/block_file.py``), so a store opened by a new process finds what earlier processes wrote,
and a different model, dtype, block size or KV shape looks in another subdirectory: it can never hit, and
its eviction never touches the others' files. What the store keeps in memory (sizes and LRU stamps of its
files) is a cache of the directory, rebuilt by a scan at start and every ``rescan_seconds`` while writing;
``contains`` and ``read`` ask the file system itself.

Several processes may share a directory. Files are written to a temporary name and renamed into place, so
two writers of one block leave one whole copy, and a reader holding a file open keeps reading it whole even
if another process evicts or replaces it. LRU stamps are file modification times the store sets itself (on
write and on every hit), since access times are often off. Each process evicts down to
``low_watermark`` of the capacity when its picture of the directory exceeds it; that picture counts other
processes' files from its last scan, so the directory may overshoot by what others wrote since.

I/O trouble on write (full disk, unwritable directory) never raises: it is counted, logged, and turns writes off
for ``write_off_seconds``; reads go on. A file system full below the capacity also evicts the least recently used
blocks (to ``low_watermark`` of what the store holds), so writes land again after the pause. A file that fails its
checks is counted, logged, removed and never served. Each kind of trouble is logged at most once every
``warn_every_seconds``, with the count not logged since.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from boundless.kv.block_file import (
    FORMAT_VERSION,
    BlockFileError,
    BlockFileSpec,
    dtype_name,
    payload_view,
    read_block_file,
    read_block_file_into,
    write_block_file,
)
from boundless.kv.block_hash import BlockHash

if TYPE_CHECKING:
    from boundless.model.loader import LoadedModel

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_KEY_HEX = 32  # a BlockHash is 16 bytes
_GIB = 1 << 30
_T = TypeVar("_T")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a write refused for want of room: the store's own blocks can make it
# Errors that say the process is short of something for now (descriptors, memory), not that the file is bad.
_BUSY = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.ENOBUFS)
_EVICTION_ROUNDS = 4  # (choices of victims made again without the files that could not be removed)
_R = TypeVar("_R")


@dataclass(frozen=True)
class StoreLayout:
    """What must match for a stored block to be usable; its digest names the store's subdirectory and is in
    every file's header."""

    fingerprint: str  # the model's (weights digest, dtype): ``LoadedModel.fingerprint``
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of_model(
        cls, model: LoadedModel, block_size: int, fingerprint: str, kv_dtype: torch.dtype | None = None
    ) -> StoreLayout:
        """The layout of ``model``'s KV blocks named ``fingerprint`` (the engine's: ``ModelIdentity.fingerprint``,
        ``LoadedModel.kv_fingerprint``), held in ``kv_dtype`` (``--kv-cache-dtype``; default the model's).

        A rank of a model split over devices (``--tensor-parallel-size``) holds its key/value heads of each block: its
        files are its own, under a layout of their own (each rank reads and writes its share of every block)."""
        arch, tp = model.arch, model.tensor_parallel
        dtype = model.dtype if kv_dtype is None else kv_dtype
        fingerprint = fingerprint if tp.size == 1 else f"{fingerprint}:rank{tp.rank}"
        return cls(fingerprint, arch.num_layers, arch.num_kv_heads, block_size, arch.head_dim, dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block's KV across all layers: [layers, 2, kv_heads, block_size, head_dim]."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def digest(self) -> bytes:
        text = (
            f"boundless-kv-store:v{FORMAT_VERSION}:{self.fingerprint}:{self.num_layers}:{self.num_kv_heads}:"
            f"{self.block_size}:{self.head_dim}:{dtype_name(self.dtype)}"
        )
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    def file_spec(self, num_blocks: int = 1) -> BlockFileSpec:
        return BlockFileSpec(self.digest(), self.dtype, (num_blocks, *self.block_shape))

    def describe(self) -> str:
        return (
            f"model {self.fingerprint}, {self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_dim}, "
            f"block {self.block_size}, {dtype_name(self.dtype)}"
        )


@dataclass(frozen=True)
class StoreStats:
    """Counters since the store was opened (by this process), and what the directory holds for its layout."""

    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    read_seconds: float
    write_seconds: float
    blocks_written: int
    evictions: int
    checksum_failures: int  # files that failed a check on read: counted, removed, never served
    read_errors: int  # files the file system would not open or read (EACCES, EIO): counted, removed or forgotten
    evict_errors: int  # files eviction could not remove: skipped (the next ones go instead) until the next rescan
    write_errors: int  # writes the file system refused (each turns writes off for a while)
    writes_dropped: int  # blocks not written because writes were off
    blocks_held: int
    bytes_held: int
    capacity_bytes: int
    writes_enabled: bool


@dataclass(frozen=True, slots=True)
class _Entry:
    size: int
    stamp_ns: int  # the file's mtime: the LRU stamp


def choose_evictions(entries: Mapping[BlockHash, _Entry], held_bytes: int, target_bytes: int) -> list[BlockHash]:
    """The least recently used blocks to remove so that at most ``target_bytes`` remain held."""
    victims: list[BlockHash] = []
    for key, entry in sorted(entries.items(), key=lambda kv: kv[1].stamp_ns):
        if held_bytes <= target_bytes:
            break
        victims.append(key)
        held_bytes -= entry.size
    return victims


class DiskKVStore:
    """KV blocks in files under ``path``, bounded by ``capacity_bytes``, shared by the processes that open it.

    ``clock`` gives wall time in seconds: LRU stamps (comparable across processes) and the write-off window.
    ``durable`` fsyncs every file before it is renamed into place (see docs/kv-store.md for why it is off by
    default). ``io_threads`` read or write the files of one call side by side. Each kind of trouble (a damaged
    file, a refused write) is logged at most once every ``warn_every_seconds``. ``mid_write`` is for tests:
    called halfway through each file's payload.
    """

    def __init__(
        self,
        path: str | Path,
        layout: StoreLayout,
        capacity_bytes: int,
        *,
        durable: bool = False,
        clock: Callable[[], float] = time.time,
        low_watermark: float = 0.9,
        rescan_seconds: float = 30.0,
        write_off_seconds: float = 60.0,
        stale_temp_seconds: float = 600.0,
        io_threads: int = 4,
        warn_every_seconds: float = 600.0,
        mid_write: Callable[[Path], None] | None = None,
    ) -> None:
        self.root = Path(path)
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.dir = self.root / layout.digest().hex()
        self._spec = layout.file_spec()
        self._file_bytes = self._spec.file_bytes
        self._durable = durable
        self._clock = clock
        self._low_watermark = low_watermark
        self._rescan_seconds = rescan_seconds
        self._write_off_seconds = write_off_seconds
        self._stale_temp_seconds = stale_temp_seconds
        self._mid_write = mid_write
        self._io_threads = io_threads
        self._pool: ThreadPoolExecutor | None = None
        self._tmp_names = itertools.count()
        self._lock = threading.Lock()
        self._index: dict[BlockHash, _Entry] = {}
        self._held_bytes = 0
        self._scanned_at = float("-inf")
        self._last_stamp_ns = 0
        self._writes_off_until = float("-inf")
        self._warn_every_seconds = warn_every_seconds
        self._warned_at: dict[str, float] = {}
        self._unwarned: dict[str, int] = {}
        self._hits = self._misses = self._bytes_read = self._bytes_written = self._blocks_written = 0
        self._evictions = self._checksum_failures = self._write_errors = self._writes_dropped = 0
        self._read_errors = self._evict_errors = 0
        # Blocks whose file would not read and could not be removed: held by none, and not written over, until the
        # next rescan (see _unreadable_file).
        self._unreadable: set[BlockHash] = set()
        # Blocks whose file eviction could not remove: passed over by eviction until the next rescan.
        self._stuck: set[BlockHash] = set()
        self._read_seconds = self._write_seconds = 0.0
        try:
            if not self.dir.is_dir():
                self._clear_place(self.dir)  # (a file under the layout's name: writes failed for good)
                self.dir.mkdir(parents=True, exist_ok=True)
            self._write_layout_note()
        except OSError as e:
            self._write_failed(e)
        self._rescan()
        with self._lock:
            over = self._held_bytes > capacity_bytes
        if over:
            self._evict()

    # -- reading ---------------------------------------------------------------------------------------

    def contains(self, key: BlockHash) -> bool:
        """Whether a whole-sized file for ``key`` of this layout is there (one ``stat``; contents checked on read).

        A file of another size under a block's name can only be damaged (files are renamed into place whole, and
        every layout has its own subdirectory): it is rejected here as a read would reject it.
        """
        if key in self._unreadable:
            return False
        path = self._path(key)
        try:
            st = os.stat(path)
        except OSError:
            return False
        if st.st_size == self._file_bytes:
            return True
        self._reject(path, st.st_ino, key, BlockFileError(f"{st.st_size} bytes where {self._file_bytes} are expected"))
        return False

    def read(self, keys: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """Each block's KV, [layers, 2, kv_heads, block_size, head_dim] on the CPU, or None (missing or bad)."""
        start = time.perf_counter()
        out = self._each(self._read_one, keys)
        self._count_reads(sum(b is not None for b in out), len(out), start)
        return out

    def read_into(self, keys: Sequence[BlockHash], out: torch.Tensor) -> list[bool]:
        """Read each block into ``out[i]`` (``out``: [n >= len(keys), layers, 2, kv_heads, block_size, head_dim], a
        contiguous CPU tensor of the layout's dtype that the caller reuses); which came back whole. A block that
        did not holds undefined bytes. Saves :meth:`read`'s fresh memory per block (its page faults cost more
        than the copy out of the page cache) for a caller that copies the blocks on anyway (the engine's loader
        into host memory)."""
        shape = (*out.shape[:1], *self.layout.block_shape)
        if tuple(out.shape) != shape or out.shape[0] < len(keys) or out.dtype != self.layout.dtype:
            raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not hold {len(keys)} blocks of {self.layout}")
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("out must be a contiguous CPU tensor")
        start = time.perf_counter()
        ok = self._each(lambda i: self._read_one_into(keys[i], payload_view(out[i])), range(len(keys)))
        self._count_reads(sum(ok), len(ok), start)
        return ok

    def _count_reads(self, hits: int, asked: int, start: float) -> None:
        with self._lock:
            self._hits += hits
            self._misses += asked - hits
            self._bytes_read += hits * self._file_bytes
            self._read_seconds += time.perf_counter() - start

    def _each(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``fn`` over ``items``, side by side on the I/O threads: several I/Os in flight, and checksums and
        copies on several cores (the system calls and zlib release the GIL)."""
        if len(items) < 2 or self._io_threads < 2:
            return [fn(item) for item in items]
        with self._lock:  # a loader and a writer thread may both get here first
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="kv-disk-io")
            pool = self._pool
        return list(pool.map(fn, items))

    def _read_one(self, key: BlockHash) -> torch.Tensor | None:
        return self._read_file(key, lambda fd, size: read_block_file(fd, size, key, self._spec)[0])

    def _read_one_into(self, key: BlockHash, payload: memoryview) -> bool:
        read = self._read_file(key, lambda fd, size: read_block_file_into(fd, size, key, self._spec, payload) or True)
        return read is not None

    def _read_file(self, key: BlockHash, read: Callable[[int, int], _R]) -> _R | None:
        """``read(fd, size)`` on the block's file; None when it is missing, unreadable or fails its checks."""
        path = self._path(key)
        try:
            # (Non-blocking: a FIFO under a block's name would block the loader's thread in open until a writer came.)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):  # (no file: nor a shard directory to hold it)
            return None
        except OSError as e:
            if e.errno in _BUSY:  # (this process's trouble, not the file's: a miss, the file kept)
                self._warn("busy", f"disk KV store {self.root}: cannot open {path.name} now: {e}")
            else:
                self._unreadable_file(path, key, f"cannot open it: {e}")
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a directory, a FIFO, a device: no block file
                self._reject(path, st.st_ino, key, BlockFileError("not a regular file"))
                return None
            os.set_blocking(fd, True)  # (a file's reads as ever: some network file systems honour the flag)
            try:
                result = read(fd, st.st_size)
            except BlockFileError as e:
                self._reject(path, st.st_ino, key, e)
                return None
            except OSError as e:
                self._unreadable_file(path, key, f"cannot read it: {e}")
                return None
        finally:
            os.close(fd)
        self._touch(path, key)
        return result

    def _reject(self, path: Path, inode: int, key: BlockHash, error: BlockFileError) -> None:
        with self._lock:
            self._checksum_failures += 1
            entry = self._index.pop(key, None)
            if entry is not None:
                self._held_bytes -= entry.size
        self._warn("bad", f"disk KV store {self.root}: {path.name} failed its check ({error}); removed")
        try:
            # Only the file we read: another process may have renamed a good copy into place since.
            st = os.stat(path)
            if st.st_ino == inode:
                if stat.S_ISDIR(st.st_mode):  # (unlink refuses one, and every write of the block would fail on it)
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
        except OSError:
            pass

    def _unreadable_file(self, path: Path, key: BlockHash, why: str) -> None:
        """A block's file the file system would not open or read (permissions, a bad sector): counted, and removed
        so that the block is written again. One that cannot be removed is held by none and not written (a write
        over it would fail as the removal did, and turn every write off for a while) until the next rescan tries
        again. (Kept, it missed on every start for good: the store said it held the block, so no write came.)"""
        with self._lock:
            self._read_errors += 1
            entry = self._index.pop(key, None)
            if entry is not None:
                self._held_bytes -= entry.size
        try:
            os.unlink(path)
            outcome = "removed"
        except FileNotFoundError:
            outcome = "gone already"
        except OSError as e:
            self._unreadable.add(key)
            outcome = f"left ({e.strerror}); the block is not written again until the next rescan"
        self._warn("read", f"disk KV store {self.root}: {path.name}: {why}; {outcome}")

    def _touch(self, path: Path, key: BlockHash) -> None:
        stamp = self._stamp_ns()
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            return  # evicted meanwhile, or a read-only directory: the LRU order just ages
        with self._lock:
            entry = self._index.get(key)
            if entry is None:  # written by another process since our last scan
                self._held_bytes += self._file_bytes
            self._index[key] = _Entry(self._file_bytes, stamp)

    def age(self, keys: Sequence[BlockHash], seconds: float) -> int:
        """Set the LRU stamps of these blocks back by ``seconds``: they are evicted before every block used since
        (by any process; the stamps live in the files). Program-aware eviction calls it for blocks whose programs
        have all finished. Returns how many were there. A process that reads a block meanwhile stamps it anew
        (a read between our stat and utime is overwritten: that block only goes sooner than it should)."""
        back_ns = int(seconds * 1e9)
        aged = 0
        for key in keys:
            path = self._path(key)
            try:
                stamp = max(1, os.stat(path).st_mtime_ns - back_ns)
                os.utime(path, ns=(stamp, stamp))
            except OSError:
                continue  # evicted meanwhile, or a read-only directory: the order just stays LRU
            aged += 1
            with self._lock:
                entry = self._index.get(key)
                if entry is None:  # written by another process since our last scan
                    self._held_bytes += self._file_bytes
                self._index[key] = _Entry(self._file_bytes, stamp)
        return aged

    def held_keys(self) -> list[BlockHash]:
        """The blocks this layout holds as of the last scan and this process's own writes, least recently used
        first (no I/O: the directory as the store last saw it; ``read`` still checks each file)."""
        with self._lock:
            entries = list(self._index.items())
        entries.sort(key=lambda kv: kv[1].stamp_ns)
        return [key for key, _ in entries]

    # -- writing ---------------------------------------------------------------------------------------

    def write(self, keys: Sequence[BlockHash], blocks: torch.Tensor) -> int:
        """Store ``blocks`` [layers, 2, kv_heads, n, block_size, head_dim] (any device) under ``keys``.

        Returns how many of them the store now holds (written, or already there). Raises only for a caller's
        error (shape or dtype); I/O trouble is counted and turns writes off for a while.
        """
        expected = (*self.layout.block_shape[:3], len(keys), *self.layout.block_shape[3:])
        if tuple(blocks.shape) != expected or blocks.dtype != self.layout.dtype:
            raise ValueError(
                f"blocks {tuple(blocks.shape)} {blocks.dtype} do not match the store's layout {expected} "
                f"{self.layout.dtype}"
            )
        if not keys:
            return 0
        if self._clock() < self._writes_off_until:
            with self._lock:
                self._writes_dropped += len(keys)
            return 0
        start = time.perf_counter()
        # [n, layers, 2, kv_heads, block_size, head_dim]: each block one contiguous slice (one copy of all n).
        per_block = blocks.detach().permute(3, 0, 1, 2, 4, 5).contiguous().cpu()
        held = self._each(lambda i: self._store_one(keys[i], per_block[i]), range(len(keys)))
        with self._lock:
            self._write_seconds += time.perf_counter() - start
            rescan = self._clock() - self._scanned_at >= self._rescan_seconds
        if rescan:
            self._rescan()
        with self._lock:
            over = self._held_bytes > self.capacity_bytes
        if over:
            self._evict()
        return sum(held)

    def _store_one(self, key: BlockHash, block: torch.Tensor) -> bool:
        """Write one block unless it is there already; whether the store holds it after."""
        if self._clock() < self._writes_off_until:  # an earlier block of this call failed
            with self._lock:
                self._writes_dropped += 1
            return False
        if key in self._unreadable:  # (its file stays, and would refuse the write: see _unreadable_file)
            return False
        path = self._path(key)
        if self.contains(key):
            self._touch(path, key)
            return True
        try:
            self._write_file(path, key, payload_view(block))
        except OSError as e:
            self._write_failed(e)
            return False
        with self._lock:
            self._blocks_written += 1
            self._bytes_written += self._file_bytes
        return True

    def _write_file(self, path: Path, key: BlockHash, payload: memoryview) -> None:
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{next(self._tmp_names)}{_TMP_SUFFIX}")
        stamp = self._stamp_ns()
        try:
            write_block_file(
                path, tmp, key, self._spec, payload, mtime_ns=stamp, durable=self._durable, mid_write=self._mid_write
            )
        except (FileNotFoundError, NotADirectoryError) as e:
            if isinstance(e, NotADirectoryError):
                self._clear_shard(path.parent)
            path.parent.mkdir(parents=True, exist_ok=True)  # a shard directory not yet made (or removed)
            write_block_file(
                path, tmp, key, self._spec, payload, mtime_ns=stamp, durable=self._durable, mid_write=self._mid_write
            )
        with self._lock:
            old = self._index.get(key)
            self._held_bytes += self._file_bytes - (old.size if old else 0)
            self._index[key] = _Entry(self._file_bytes, stamp)
            self._unreadable.discard(key)

    def _clear_shard(self, shard: Path) -> None:
        """Remove what is not a directory under the layout's or a shard's name (a file put there): no block can be
        in it, and every write of its blocks failed and turned all writes off for ``write_off_seconds``, again after
        each pause, for good. Raises the ``OSError`` if the file cannot go; an error from above them comes again
        when the write is tried again."""
        for place in (self.dir, shard):  # (another I/O thread may have cleared it first: the write is tried again)
            self._clear_place(place)

    def _clear_place(self, place: Path) -> None:
        """Remove a file (not a directory) under a name the store's directories take, if there is one."""
        if os.path.lexists(place) and not place.is_dir():
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):  # (another I/O thread was first)
                place.unlink()
                self._warn("shard", f"disk KV store {self.root}: {place.name} was not a directory; removed")

    def _write_failed(self, error: OSError) -> None:
        with self._lock:
            self._write_errors += 1
            first = self._clock() >= self._writes_off_until  # (not the other I/O threads' failures of one call)
            self._writes_off_until = self._clock() + self._write_off_seconds
            held = self._held_bytes
        made_room = ""
        if first and error.errno in _DISK_FULL:
            # The file system filled below the store's capacity (a disk smaller than --kv-disk-gb, or shared): the
            # store never reached its own bound, so it would have kept all it holds and failed every write after each
            # pause, for good. Its least recently used blocks make room instead, as they would at the capacity.
            removed = self._evict(int(held * self._low_watermark))
            made_room = f"; removed {removed} least recently used blocks to make room"
        self._warn(
            "write",
            f"disk KV store {self.root}: writes off for {self._write_off_seconds:.0f} s after an error "
            f"({error}){made_room}; reads go on",
        )

    def _write_layout_note(self) -> None:
        """``layout.json`` beside the blocks: what they are, for people and for ``describe``."""
        note = self.dir / "layout.json"
        if note.exists():
            return
        text = json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "fingerprint": self.layout.fingerprint,
                "num_layers": self.layout.num_layers,
                "num_kv_heads": self.layout.num_kv_heads,
                "block_size": self.layout.block_size,
                "head_dim": self.layout.head_dim,
                "dtype": dtype_name(self.layout.dtype),
                "file_bytes": self._file_bytes,
            },
            indent=1,
        )
        tmp = note.with_name(f".layout.{os.getpid()}{_TMP_SUFFIX}")
        tmp.write_text(text + "\n")
        os.replace(tmp, note)

    # -- the directory as index, and eviction ---------------------------------------------------------

    def _path(self, key: BlockHash) -> Path:
        name = key.hex()
        return self.dir / name[:2] / f"{name}{_SUFFIX}"

    def _stamp_ns(self) -> int:
        """An LRU stamp: wall time, strictly increasing within this process (file times are often coarse)."""
        with self._lock:
            self._last_stamp_ns = max(int(self._clock() * 1e9), self._last_stamp_ns + 1)
            return self._last_stamp_ns

    def _rescan(self) -> None:
        """Rebuild the in-memory picture from the directory; remove temporary files left by killed writers."""
        index: dict[BlockHash, _Entry] = {}
        now = self._clock()
        try:
            shards = [e for e in os.scandir(self.dir) if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
        except OSError:
            shards = []
        for shard in shards:
            try:
                entries = list(os.scandir(shard.path))
            except OSError:
                continue
            for entry in entries:
                name = entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    continue  # a directory or a FIFO under a block's name holds no block (a read removes it)
                if name.endswith(_SUFFIX) and len(name) == _KEY_HEX + len(_SUFFIX):
                    try:
                        index[bytes.fromhex(name[:_KEY_HEX])] = _Entry(st.st_size, st.st_mtime_ns)
                    except ValueError:
                        continue
                elif name.endswith(_TMP_SUFFIX) and now - st.st_mtime >= self._stale_temp_seconds:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        with self._lock:
            self._index = index
            self._held_bytes = sum(e.size for e in index.values())
            self._scanned_at = now
            self._stuck = set()  # (tried again: a file made removable since goes as any other)
            self._unreadable = set()

    def _evict(self, target_bytes: int | None = None) -> int:
        """Remove least recently used files until this layout holds at most ``target_bytes`` (by default
        ``low_watermark`` of the capacity); how many it removed."""
        if target_bytes is None:
            target_bytes = int(self.capacity_bytes * self._low_watermark)
        with self._lock:
            evictions_before = self._evictions
        # A file that cannot be removed (immutable, a read-only shard) is skipped, and the next least recently used
        # go in its place: stopping at it, every eviction stopped there, and the store grew past its capacity for
        # good. It still takes its room (counted), and is tried again after the next rescan. A few rounds, each
        # choosing again without the ones skipped.
        for _ in range(_EVICTION_ROUNDS):
            with self._lock:
                stuck = self._stuck
                candidates = {k: e for k, e in self._index.items() if k not in stuck} if stuck else self._index
                victims = choose_evictions(candidates, self._held_bytes, target_bytes)
                planned = {key: self._index[key] for key in victims}
            skipped = 0
            for key, entry in planned.items():
                path = self._path(key)
                try:
                    st = os.stat(path)
                    if st.st_mtime_ns > entry.stamp_ns:
                        # Read (touched) by another process since we looked: no longer least recently used.
                        with self._lock:
                            self._index[key] = _Entry(st.st_size, st.st_mtime_ns)
                        continue
                    os.unlink(path)
                    removed = True
                except FileNotFoundError:
                    removed = False  # another process evicted it first
                except OSError as e:
                    skipped += 1
                    with self._lock:
                        self._evict_errors += 1
                        self._stuck.add(key)
                    self._warn("evict", f"disk KV store {self.root}: cannot evict {path.name}: {e}; skipped")
                    continue
                with self._lock:
                    if self._index.pop(key, None) is not None:
                        self._held_bytes -= entry.size
                    self._evictions += removed
            if not skipped:
                break
        with self._lock:
            return self._evictions - evictions_before

    def close(self) -> None:
        """Stop the I/O threads (the files stay: the store is reopened by path)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()

    # -- reporting -------------------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                hits=self._hits,
                misses=self._misses,
                bytes_read=self._bytes_read,
                bytes_written=self._bytes_written,
                read_seconds=self._read_seconds,
                write_seconds=self._write_seconds,
                blocks_written=self._blocks_written,
                evictions=self._evictions,
                checksum_failures=self._checksum_failures,
                read_errors=self._read_errors,
                evict_errors=self._evict_errors,
                write_errors=self._write_errors,
                writes_dropped=self._writes_dropped,
                blocks_held=len(self._index),
                bytes_held=self._held_bytes,
                capacity_bytes=self.capacity_bytes,
                writes_enabled=self._clock() >= self._writes_off_until,
            )

    def describe(self) -> str:
        """One line for the start-up log: what the store holds for this layout, and beside it."""
        s = self.stats()
        others = self._other_layouts()
        line = (
            f"KV disk store {self.root}: {s.blocks_held} blocks, {s.bytes_held / _GIB:.2f} of "
            f"{s.capacity_bytes / _GIB:.2f} GiB ({self.layout.describe()}; subdirectory {self.dir.name[:8]})"
        )
        if others:
            line += f"; {len(others)} other layout(s) beside it, untouched"
        if not s.writes_enabled:
            line += "; writes off"
        return line

    def _other_layouts(self) -> list[str]:
        try:
            return sorted(
                e.name
                for e in os.scandir(self.root)
                if e.is_dir() and len(e.name) == _KEY_HEX and e.name != self.dir.name
            )
        except OSError:
            return []

    def _warn(self, kind: str, message: str) -> None:
        """Log a kind of trouble at most once every ``warn_every_seconds``, saying how many went unlogged since: a
        burst (a whole directory of damaged files, the writes of one call on a full disk) is one line, and trouble
        found later is logged again (it was once per store: a second episode, days on, went unsaid)."""
        with self._lock:
            now = self._clock()
            last = self._warned_at.get(kind)
            quiet = last is not None and now - last < self._warn_every_seconds
            if quiet:
                self._unwarned[kind] = self._unwarned.get(kind, 0) + 1
            else:
                self._warned_at[kind] = now
                unwarned = self._unwarned.pop(kind, 0)
        if quiet:
            log.debug(message)
            return
        if unwarned:
            message += f" ({unwarned} more since the last such warning, not logged)"
        log.warning(message)
