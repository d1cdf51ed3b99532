"""The KV transport's meeting directories: a killed server's is removed by the next server's start, a live one's is
kept (real processes, killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from boundless.transport.meeting_dir import LOCK_FILE, make_meeting_directory, remove_abandoned

# A server's part: make a directory, fill a slot file there, say where, and live until killed.
_HOLDER = """
import sys, time
from boundless.transport.meeting_dir import make_meeting_directory
d = make_meeting_directory(sys.argv[1])
with open(d.path + "/rank0.to.rank1", "wb") as f:
    f.write(bytes(1 << 20))
print(d.path, flush=True)
time.sleep(600)
"""


def _holder(base: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(base)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_killed_servers_directory_is_removed_when_the_next_is_made_and_a_live_ones_kept(tmp_path: Path) -> None:
    # Before, a server killed with SIGKILL left its directory, slot files of up to the largest message each, in
    # /dev/shm (memory) until the machine rebooted.
    killed, killed_path = _holder(tmp_path)
    alive, alive_path = _holder(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert os.path.exists(os.path.join(killed_path, "rank0.to.rank1"))
        mine = make_meeting_directory(str(tmp_path))
        assert not os.path.exists(killed_path)
        assert os.path.exists(os.path.join(alive_path, "rank0.to.rank1"))
        assert os.path.isdir(mine.path) and remove_abandoned(str(tmp_path)) == []  # its own is held too
        mine.remove()
        assert not os.path.exists(mine.path)
    finally:
        alive.kill()
        alive.wait()
    assert remove_abandoned(str(tmp_path)) == [alive_path]


def test_a_directory_without_a_lock_file_is_left_alone(tmp_path: Path) -> None:
    # (Made by a server from before the locks, or by another program under the same prefix: not ours to judge.)
    other = tmp_path / "boundless-kv-1-0123abcd"
    other.mkdir()
    (other / "rank0.sock").write_bytes(b"")
    assert remove_abandoned(str(tmp_path)) == [] and other.exists()
    assert not (other / LOCK_FILE).exists()
