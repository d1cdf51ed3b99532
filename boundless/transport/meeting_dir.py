"""The directory a cluster's KV transport endpoints meet in, and the sweep of those whose server was killed.

Shared memory's endpoints keep their sockets and their slot files there (``transport/shm.py``); a slot is grown to
the largest message it carried, so a directory can hold gigabytes of ``/dev/shm``, which is memory. A server removes
its directory when it shuts down; one killed (SIGKILL, the OOM killer) could not, and its directory stayed until the
machine rebooted. So the server holds an ``flock`` on a lock file inside its directory for as long as it lives (the
kernel drops it when the process dies, however it dies), and every new directory's making first removes the
directories whose lock nobody holds. A lock, not a pid: containers sharing ``/dev/shm`` do not share pids.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass

log = logging.getLogger(__name__)

PREFIX = "boundless-kv-"
LOCK_FILE = ".holder.lock"


@dataclass
class MeetingDirectory:
    """A directory held by this process until :meth:`remove` (or its death)."""

    path: str
    lock_fd: int

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


def default_base() -> str:
    """Where meeting directories are made: ``/dev/shm`` (memory speed), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def make_meeting_directory(base: str | None = None) -> MeetingDirectory:
    """A fresh directory, locked for this process, after removing those abandoned in ``base``.

    It is made under a hidden name, locked, then renamed: a sweep running meanwhile in another process never sees it
    unlocked."""
    base = base or default_base()
    remove_abandoned(base)
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    making = os.path.join(base, f".{name}")
    os.makedirs(making)
    fd = os.open(os.path.join(making, LOCK_FILE), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    path = os.path.join(base, name)
    os.rename(making, path)
    return MeetingDirectory(path, fd)


def remove_abandoned(base: str) -> list[str]:
    """Remove the meeting directories in ``base`` whose lock no process holds; returns their paths. A directory
    without a lock file (made before locks were) or that this user may not lock is left as it is."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(base, name)
        try:
            fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its server lives
        finally:
            os.close(fd)  # (closing drops a lock taken just above)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info("removed %d KV transport directories left by servers that were killed: %s", len(removed), removed)
    return removed
