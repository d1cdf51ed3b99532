"""The disk KV store: round trips, persistence across processes, layouts that never mix, bounded size with
LRU eviction, and the faults of issue 12 (truncated file, flipped bit, another layout's file, a writer killed
mid-write, two writers of one block, eviction racing reads, a full disk, refused and unwritable writes).

Other processes are real ones (``disk_store_worker.py``); the file system is the real one."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from disk_store_worker import LAYOUT, FakeClock, block_of, blocks_of, key_of

from boundless.kv.block_file import HEADER_SIZE
from boundless.kv.disk_store import DiskKVStore, StoreLayout
from boundless.kv.tensors import PagedKVCache
from boundless.model.loader import LoadedModel

WORKER = Path(__file__).with_name("disk_store_worker.py")
REPO = Path(__file__).resolve().parents[2]
FILE_BYTES = LAYOUT.file_spec().file_bytes
BIG = 1 << 40


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _worker(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [*prefix, sys.executable, str(WORKER), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _result(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1]) | {"stderr": stderr}


def _file(store: DiskKVStore, i: int) -> Path:
    return store._path(key_of(i))


def _temp_files(root: Path) -> list[Path]:
    return list(root.rglob("*.tmp"))


def test_blocks_from_the_kv_cache_round_trip(tmp_path: Path, tiny_llama: LoadedModel) -> None:
    arch = tiny_llama.arch
    layout = StoreLayout.of_model(tiny_llama, 16, tiny_llama.fingerprint)
    # On the model's device (a GPU where the tests run on one): blocks leave it for the disk and come back.
    cache = PagedKVCache(arch.num_layers, arch.num_kv_heads, arch.head_dim, 8, 16, tiny_llama.dtype, tiny_llama.device)
    cache.data.normal_()
    store = DiskKVStore(tmp_path, layout, BIG)
    keys = [key_of(i) for i in range(3)]
    assert store.write(keys, cache.read_blocks([5, 1, 6])) == 3
    got = store.read([*keys, key_of(99)])
    assert got[3] is None
    assert all(b.device.type == "cpu" for b in got[:3])
    cache.write_blocks([0, 2, 3], torch.stack(got[:3], dim=3))
    assert torch.equal(cache.read_blocks([0, 2, 3]), cache.read_blocks([5, 1, 6]))
    s = store.stats()
    assert (s.hits, s.misses, s.blocks_written, s.blocks_held) == (3, 1, 3, 3)
    assert s.bytes_read == s.bytes_written == s.bytes_held == 3 * layout.file_spec().file_bytes
    assert "3 blocks" in store.describe()


def test_a_new_process_finds_what_another_wrote(tmp_path: Path) -> None:
    assert _result(_worker("write", str(tmp_path), "5"))["stored"] == 5
    store = DiskKVStore(tmp_path, LAYOUT, BIG)
    assert store.stats().blocks_held == 5
    assert all(store.contains(key_of(i)) for i in range(5))
    got = store.read([key_of(i) for i in range(6)])
    assert [torch.equal(b, block_of(i)) for i, b in enumerate(got[:5])] == [True] * 5
    assert got[5] is None


def test_writing_a_held_block_again_writes_nothing(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, LAYOUT, BIG)
    assert store.write([key_of(0), key_of(1)], blocks_of([0, 1])) == 2
    assert store.write([key_of(1), key_of(2)], blocks_of([1, 2])) == 2
    assert store.stats().blocks_written == 3
    with pytest.raises(ValueError, match="layout"):
        store.write([key_of(3)], blocks_of([3]).to(torch.float16))


@pytest.mark.parametrize(
    "other",
    [
        {"fingerprint": "another-model"},
        {"dtype": torch.bfloat16},
        {"block_size": 32},
        {"num_kv_heads": 4},
        {"num_layers": 3},
        {"head_dim": 32},
    ],
)
def test_another_layout_never_hits_and_deletes_nothing(tmp_path: Path, other: dict) -> None:
    mine = DiskKVStore(tmp_path, LAYOUT, BIG)
    assert mine.write([key_of(i) for i in range(3)], blocks_of([0, 1, 2])) == 3
    layout = StoreLayout(**{**LAYOUT.__dict__, **other})
    theirs = DiskKVStore(tmp_path, layout, 2 * layout.file_spec().file_bytes, low_watermark=1.0)  # room for 2
    assert theirs.stats().blocks_held == 0
    assert not any(theirs.contains(key_of(i)) for i in range(3))
    assert theirs.read([key_of(i) for i in range(3)]) == [None] * 3
    # Writing past its capacity under the same keys evicts only its own files.
    assert theirs.write([key_of(i) for i in range(3)], blocks_of([0, 1, 2], layout)) == 3
    assert theirs.stats().evictions == 1
    assert "1 other layout" in theirs.describe()
    reopened = DiskKVStore(tmp_path, LAYOUT, BIG)
    got = reopened.read([key_of(i) for i in range(3)])
    assert all(b is not None and torch.equal(b, block_of(i)) for i, b in enumerate(got))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _flip_payload_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 1000] ^= 0x10
    path.write_bytes(data)


def _flip_header_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the key
    path.write_bytes(data)


def _swap_for_another_block(path: Path) -> None:
    """Another block's whole, valid file under this block's name."""
    other = next(p for p in path.parents[1].rglob("*.kv") if p != path)
    shutil.copyfile(other, path)


@pytest.mark.parametrize(
    "damage", [_truncate, _flip_payload_bit, _flip_header_bit, _swap_for_another_block], ids=lambda f: f.__name__
)
def test_a_damaged_file_is_detected_counted_removed_and_never_served(
    tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    store = DiskKVStore(tmp_path, LAYOUT, BIG)
    store.write([key_of(0), key_of(1)], blocks_of([0, 1]))
    damage(_file(store, 0))
    assert store.read([key_of(0)]) == [None]
    assert store.stats().checksum_failures == 1
    assert not _file(store, 0).exists()
    assert torch.equal(store.read([key_of(1)])[0], block_of(1))  # its neighbour is untouched
    assert store.write([key_of(0)], blocks_of([0])) == 1  # recomputed, stored again, served again
    assert torch.equal(store.read([key_of(0)])[0], block_of(0))


def test_a_file_of_another_layout_under_this_layouts_name_is_rejected(tmp_path: Path) -> None:
    other = StoreLayout(**{**LAYOUT.__dict__, "fingerprint": "another-model"})
    theirs = DiskKVStore(tmp_path, other, BIG)
    theirs.write([key_of(0)], blocks_of([0]))
    mine = DiskKVStore(tmp_path, LAYOUT, BIG)
    _file(mine, 0).parent.mkdir(parents=True)
    shutil.copyfile(_file(theirs, 0), _file(mine, 0))  # same size, same key: only the header tells
    assert mine.contains(key_of(0))
    assert mine.read([key_of(0)]) == [None]
    assert mine.stats().checksum_failures == 1
    assert _file(theirs, 0).exists()


def test_damaged_files_are_logged_again_after_a_quiet_while_with_the_count_not_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # One line per kind of trouble at most every ten minutes: a burst of damaged files is one line, and a damaged file
    # found later (bad sectors a day after the first flipped bit) is logged again, naming it and the ones in between.
    # Before, only the store's first damaged file was ever logged: every later one, a day later too, went unsaid.
    clock = FakeClock()
    store = DiskKVStore(tmp_path, LAYOUT, BIG, clock=clock, io_threads=1)
    store.write([key_of(i) for i in range(5)], blocks_of(list(range(5))))
    for i in range(5):
        _flip_payload_bit(_file(store, i))
    with caplog.at_level(logging.WARNING, logger="boundless.kv.disk_store"):
        assert store.read([key_of(i) for i in range(3)]) == [None] * 3
        clock.now += 60
        assert store.read([key_of(3)]) == [None]
        assert [r.message for r in caplog.records if "failed its check" in r.message] == [
            f"disk KV store {tmp_path}: {key_of(0).hex()}.kv failed its check (payload checksum mismatch); removed"
        ]
        clock.now += 24 * 3600
        assert store.read([key_of(4)]) == [None]
    lines = [r.message for r in caplog.records if "failed its check" in r.message]
    assert len(lines) == 2 and f"{key_of(4).hex()}.kv failed its check" in lines[1]
    assert "3 more since the last such warning" in lines[1]
    assert store.stats().checksum_failures == 5


def test_a_truncated_file_is_not_contained_and_is_counted_and_removed(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, LAYOUT, BIG)
    store.write([key_of(0)], blocks_of([0]))
    _truncate(_file(store, 0))
    assert not store.contains(key_of(0))  # a probe (one stat) sees it: it is never read, yet still counted
    assert store.stats().checksum_failures == 1 and store.stats().blocks_held == 0
    assert not _file(store, 0).exists()


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"x")


def _fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize("make", [_directory, _fifo], ids=["directory", "fifo"])
def test_something_not_a_file_under_a_blocks_name_is_removed_and_the_block_written_again(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    """A directory or a FIFO where a block file goes: a read neither blocks (a FIFO's open waited for a writer, the
    loader's thread with it, for good) nor serves it; it is counted and removed, also a directory (unlink refused it,
    and every write of the block then failed, turning writes off); a new start does not index it."""
    store = DiskKVStore(tmp_path, LAYOUT, BIG)
    store.write([key_of(1)], blocks_of([1]))
    path = _file(store, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    make(path)
    fresh = DiskKVStore(tmp_path, LAYOUT, BIG)
    assert fresh.stats().blocks_held == 1  # not indexed
    assert not fresh.contains(key_of(0)) and not path.exists()
    make(path)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(store.read([key_of(0)])), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert got == [[None]], "the read blocked"
    assert not path.exists() and store.stats().checksum_failures >= 1
    assert store.write([key_of(0)], blocks_of([0])) == 1
    assert torch.equal(store.read([key_of(0)])[0], block_of(0))


def test_a_file_under_a_shards_name_is_removed_and_its_blocks_written_again(tmp_path: Path) -> None:
    """A file where a shard directory goes: every write of its blocks failed (not a directory) and turned all writes
    off for a while, again after each pause, so the store wrote nothing for good. It is removed and the block
    written; the other shards' blocks are untouched."""
    store = DiskKVStore(tmp_path, LAYOUT, BIG)
    store.write([key_of(1)], blocks_of([1]))
    shard = _file(store, 0).parent
    assert shard != _file(store, 1).parent
    shutil.rmtree(shard, ignore_errors=True)
    shard.write_bytes(b"not a directory")
    assert store.read([key_of(0)]) == [None]  # a miss, not an error
    assert store.write([key_of(0)], blocks_of([0])) == 1
    assert store.stats().write_errors == 0 and store.stats().writes_enabled
    assert shard.is_dir() and torch.equal(store.read([key_of(0)])[0], block_of(0))
    assert torch.equal(store.read([key_of(1)])[0], block_of(1))


def test_eviction_removes_the_least_recently_used(tmp_path: Path) -> None:
    clock = FakeClock()
    store = DiskKVStore(tmp_path, LAYOUT, 4 * FILE_BYTES, clock=clock, low_watermark=1.0)
    for i in range(4):
        clock.now += 1
        store.write([key_of(i)], blocks_of([i]))
    clock.now += 1
    assert store.read([key_of(0)])[0] is not None  # 0 is now more recent than 1, 2 and 3
    clock.now += 1
    store.write([key_of(4)], blocks_of([4]))
    assert [store.contains(key_of(i)) for i in range(5)] == [True, False, True, True, True]
    s = store.stats()
    assert (s.evictions, s.blocks_held, s.bytes_held) == (1, 4, 4 * FILE_BYTES)
    # The order lives in the files: a new process evicts by it too.
    clock.now += 1
    assert DiskKVStore(tmp_path, LAYOUT, 2 * FILE_BYTES, clock=clock, low_watermark=1.0).stats().blocks_held == 2
    assert [store.contains(key_of(i)) for i in range(5)] == [True, False, False, False, True]


def test_eviction_counts_and_respects_other_processes(tmp_path: Path) -> None:
    clock = FakeClock()
    a = DiskKVStore(tmp_path, LAYOUT, 4 * FILE_BYTES, clock=clock, low_watermark=1.0, rescan_seconds=0)
    b = DiskKVStore(tmp_path, LAYOUT, 4 * FILE_BYTES, clock=clock, low_watermark=1.0, rescan_seconds=0)
    for i in range(3):
        clock.now += 1
        a.write([key_of(i)], blocks_of([i]))
    clock.now += 1
    assert a.read([key_of(0)])[0] is not None  # A's read stamps the file: B sees it
    for i in (10, 11):
        clock.now += 1
        b.write([key_of(i)], blocks_of([i]))
    assert b.stats().bytes_held == 4 * FILE_BYTES  # A's files counted: 5 blocks, one evicted
    assert [a.contains(key_of(i)) for i in (0, 1, 2, 10, 11)] == [True, False, True, True, True]
    assert a.read([key_of(1)]) == [None]  # A asks the directory, not its picture of it


def test_a_writer_killed_mid_write_leaves_no_valid_file(tmp_path: Path) -> None:
    proc = _worker("pause", str(tmp_path))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "paused" in line, proc.communicate()[1]
    tmp = Path(json.loads(line)["paused"])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert tmp.exists() and tmp.stat().st_size < FILE_BYTES  # the half-written temporary file
    store = DiskKVStore(tmp_path, LAYOUT, BIG)  # a fresh temporary file may be another writer's: kept
    assert not store.contains(key_of(0))
    assert store.read([key_of(0)]) == [None]
    assert store.stats().blocks_held == 0 and tmp.exists()
    DiskKVStore(tmp_path, LAYOUT, BIG, stale_temp_seconds=0)  # an old one is a dead writer's: removed
    assert _temp_files(tmp_path) == []


def test_two_processes_writing_the_same_blocks_leave_one_valid_copy(tmp_path: Path) -> None:
    # Both pause halfway through block 0 until the other is there too: the writes overlap.
    barrier = tmp_path / "barrier"
    procs = [_worker("write", str(tmp_path / "store"), "3", "--barrier", str(barrier)) for _ in range(2)]
    assert [_result(p)["stored"] for p in procs] == [3, 3]
    assert len(list(barrier.iterdir())) == 2
    store = DiskKVStore(tmp_path / "store", LAYOUT, BIG)
    assert len(list(store.dir.rglob("*.kv"))) == 3
    assert _temp_files(tmp_path) == []
    got = store.read([key_of(i) for i in range(3)])
    assert all(b is not None and torch.equal(b, block_of(i)) for i, b in enumerate(got))


def test_eviction_racing_reads_never_serves_a_torn_block(tmp_path: Path) -> None:
    n = 24
    proc = _worker("churn", str(tmp_path), str(n), "15", "6")  # 24 blocks through room for 6, 15 times
    assert proc.stdout is not None and "started" in proc.stdout.readline()
    store = DiskKVStore(tmp_path, LAYOUT, BIG)
    reads = 0
    while proc.poll() is None:
        for i, block in enumerate(store.read([key_of(i) for i in range(n)])):
            reads += 1
            assert block is None or torch.equal(block, block_of(i))
    assert _result(proc)["evictions"] > 0
    assert reads > 0 and store.stats().checksum_failures == 0


def test_refused_writes_turn_writes_off_for_a_while_and_reads_go_on(tmp_path: Path) -> None:
    DiskKVStore(tmp_path, LAYOUT, BIG).write([key_of(0), key_of(1)], blocks_of([0, 1]))
    out = _result(_worker("refused", str(tmp_path), "2"))
    assert out["read_before"] == [True, True]
    assert (out["refused"], out["while_off"], out["refused_again"], out["after_limit_lifted"]) == (0, 0, 0, 2)
    assert out["enabled_while_off"] is False
    assert out["read_after"] == [True, True]
    assert out["stats"]["write_errors"] == 2 and out["stats"]["writes_dropped"] == 1 + 2 + 1
    assert out["stderr"].count("writes off") == 1  # warned once
    assert _temp_files(tmp_path) == []


def _can_mount_tmpfs() -> bool:
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True) if shutil.which("unshare") else None
    return probe is not None and probe.returncode == 0


def _in_small_tmpfs(mount: Path) -> tuple[str, ...]:
    """A worker's command prefix: its own mount namespace, with 256 KiB of tmpfs at ``mount`` (7 block files)."""
    return ("unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=256k tmpfs "{mount}" && exec "$@"', "sh")


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs a mount namespace (unshare -m) for a small tmpfs")
def test_a_full_disk_turns_writes_off_and_reads_go_on(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    # 256 KiB of tmpfs holds 7 files of 32 KiB + header; 12 blocks are offered, 4 per call.
    prefix = _in_small_tmpfs(mount)
    out = _result(_worker("fill", str(mount), "12", prefix=prefix))
    stored = out["stored"]
    assert stored[0] == 4 and 0 < stored[1] < 4 and stored[2] == 0
    # What was stored is whole, less the least recently used blocks removed to make room when the disk filled.
    evicted = out["stats"]["evictions"]
    assert evicted >= 1 and sum(out["valid"]) == sum(stored) - evicted and not any(out["valid"][8:])
    assert out["stats"]["write_errors"] >= 1 and out["temp_files"] == 0
    assert out["stderr"].count("writes off") == 1


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs a mount namespace (unshare -m) for a small tmpfs")
def test_a_full_disk_below_the_capacity_makes_room_by_lru_and_writes_again_after_the_pause(tmp_path: Path) -> None:
    # The store's capacity (1 TiB) is far above the disk's (256 KiB of tmpfs, 7 files): the file system fills first.
    # Before, the store kept all it held and every write after each pause failed again: it never wrote anything more.
    mount = tmp_path / "small"
    mount.mkdir()
    prefix = _in_small_tmpfs(mount)
    out = _result(_worker("refill", str(mount), "2", prefix=prefix))
    held = out["held_when_full"]
    assert held >= 5
    assert out["stored_after"][0] == 1  # room was made: the first write after the pause lands
    valid = out["valid"]
    assert valid[held] and not valid[0]  # the least recently used block made room, the new one is whole
    assert out["stats"]["evictions"] >= 1 and out["stats"]["write_errors"] >= 1
    assert "no space" in out["stderr"].lower() and "removed" in out["stderr"]


def test_an_unwritable_directory_serves_reads_with_writes_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make_unwritable: Callable
) -> None:
    root = tmp_path / "store"
    DiskKVStore(root, LAYOUT, BIG).write([key_of(0)], blocks_of([0]))
    undo = make_unwritable(root)
    if undo is None:
        pytest.skip("cannot make a directory unwritable here")
    try:
        with caplog.at_level(logging.WARNING, logger="boundless.kv.disk_store"):
            store = DiskKVStore(root, LAYOUT, BIG)
            assert torch.equal(store.read([key_of(0)])[0], block_of(0))
            assert store.write([key_of(1)], blocks_of([1])) == 0
            assert store.write([key_of(2)], blocks_of([2])) == 0
        s = store.stats()
        assert (s.write_errors, s.writes_dropped, s.writes_enabled) == (1, 1, False)
        assert sum("writes off" in r.message for r in caplog.records) == 1
        assert "writes off" in store.describe()
    finally:
        undo()


def test_read_into_fills_a_reused_buffer_and_reports_bad_files(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, LAYOUT, BIG)
    store.write([key_of(i) for i in range(3)], blocks_of([0, 1, 2]))
    _flip_payload_bit(_file(store, 1))
    out = torch.zeros((4, *LAYOUT.block_shape))
    assert store.read_into([key_of(0), key_of(1), key_of(2), key_of(9)], out) == [True, False, True, False]
    assert torch.equal(out[0], block_of(0)) and torch.equal(out[2], block_of(2))
    assert store.stats().checksum_failures == 1 and not _file(store, 1).exists()
    assert store.read_into([key_of(2)], out) == [True] and torch.equal(out[0], block_of(2))  # the buffer reused
    with pytest.raises(ValueError):
        store.read_into([key_of(0)], torch.zeros((1, *LAYOUT.block_shape), dtype=torch.float16))


def _refusing(monkeypatch: pytest.MonkeyPatch, name: str, path: Path, errno_: int = 13) -> None:
    """``os.<name>`` refuses ``path`` (as the file system refuses a file root's permissions do not cover, a bad
    sector, an immutable file); every other call goes through."""
    real = getattr(os, name)

    def refuse(target: object, *args: object, **kwargs: object) -> object:
        if Path(str(target)) == path:
            raise OSError(errno_, os.strerror(errno_), str(target))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(os, name, refuse)


def test_a_file_that_will_not_read_is_counted_removed_and_the_block_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block's file the file system will not open (EACCES, EIO): it was kept, and the store said it held the block,
    so no write came and the prefix missed on every start for good. Now counted (``read_errors``) and removed."""
    store = DiskKVStore(tmp_path, LAYOUT, BIG)
    store.write([key_of(0), key_of(1)], blocks_of([0, 1]))
    path = _file(store, 0)
    with monkeypatch.context() as patched:
        _refusing(patched, "open", path, 5)  # EIO
        assert store.read([key_of(0), key_of(1)])[0] is None
        assert store.stats().read_errors == 1 and not path.exists()
        assert not store.contains(key_of(0)) and store.contains(key_of(1))
    assert store.write([key_of(0)], blocks_of([0])) == 1  # written again, not skipped as held
    assert store.stats().blocks_written == 3 and torch.equal(store.read([key_of(0)])[0], block_of(0))


def test_an_unreadable_file_that_cannot_go_is_not_written_over_and_writes_stay_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the file cannot be removed, a write over it fails as the removal did (and turned every write off for a
    while, each time the block came again): it is held by none and not written, until the next rescan."""
    clock = FakeClock()
    store = DiskKVStore(tmp_path, LAYOUT, BIG, clock=clock, rescan_seconds=1000)
    store.write([key_of(0)], blocks_of([0]))
    path = _file(store, 0)
    for name, code in (("open", 5), ("unlink", 1), ("replace", 1), ("rename", 1)):
        _refusing(monkeypatch, name, path, code)
    assert store.read([key_of(0)]) == [None] and path.exists() and not store.contains(key_of(0))
    assert store.write([key_of(0), key_of(1)], blocks_of([0, 1])) == 1  # (the other block written)
    s = store.stats()
    assert (s.read_errors, s.write_errors, s.writes_enabled) == (1, 0, True)


def test_a_file_the_process_cannot_open_for_now_is_a_miss_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of file descriptors (EMFILE) is the process's trouble, not the file's: a miss, the file kept."""
    store = DiskKVStore(tmp_path, LAYOUT, BIG)
    store.write([key_of(0)], blocks_of([0]))
    with monkeypatch.context() as patched:
        _refusing(patched, "open", _file(store, 0), 24)
        assert store.read([key_of(0)]) == [None]
    assert store.stats().read_errors == 0 and torch.equal(store.read([key_of(0)])[0], block_of(0))


def test_a_file_eviction_cannot_remove_is_skipped_and_the_next_go_in_its_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The least recently used file cannot be removed (immutable, a read-only shard): eviction stopped there, every
    time, and the store grew past its capacity for good. Now it is skipped (counted as ``evict_errors``) and the
    next least recently used go instead."""
    clock = FakeClock()
    store = DiskKVStore(tmp_path, LAYOUT, 4 * FILE_BYTES, clock=clock, low_watermark=1.0)
    for i in range(4):
        clock.now += 1
        store.write([key_of(i)], blocks_of([i]))
    _refusing(monkeypatch, "unlink", _file(store, 0), 1)
    for i in (4, 5):
        clock.now += 1
        store.write([key_of(i)], blocks_of([i]))
    s = store.stats()
    assert s.evict_errors >= 1 and s.evictions == 2 and s.bytes_held == 4 * FILE_BYTES  # (the stuck one's counted)
    assert [store.contains(key_of(i)) for i in range(6)] == [True, False, False, True, True, True]


def test_a_file_under_the_layouts_name_is_removed_and_writes_go_on(tmp_path: Path) -> None:
    """A file where the layout's directory goes: every write failed, again after each pause, and a new process's
    start failed the same way, for good. It is removed, while serving (by whichever I/O thread of a write of many
    blocks meets it first, the others writing on) and at a start."""
    store = DiskKVStore(tmp_path, LAYOUT, BIG)
    for attempt in range(8):
        shutil.rmtree(store.dir)
        store.dir.write_bytes(b"junk")
        keys = list(range(16 * attempt, 16 * attempt + 16))
        assert store.write([key_of(i) for i in keys], blocks_of(keys)) == 16
        assert store.stats().write_errors == 0, attempt
    assert torch.equal(store.read([key_of(127)])[0], block_of(127))
    shutil.rmtree(store.dir)
    store.dir.write_bytes(b"junk")
    again = DiskKVStore(tmp_path, LAYOUT, BIG)
    assert again.dir.is_dir() and again.stats().writes_enabled
    assert again.write([key_of(1)], blocks_of([1])) == 1
