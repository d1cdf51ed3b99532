"""The disk store's reads of a model split over tensor-parallel ranks, as rank 0 reports them to the KV manager.

Each rank keeps its share of every block (its key/value heads) in files of its own (``StoreLayout.of_model``) and
reads them into its own host blocks, with the same block ids as rank 0's, in a loader of its own. A read is
therefore done only once every rank's is: before that, some rank may still be writing into the host blocks the
read reserved. And it found only as many leading blocks as every rank found: a block whose share is missing or
damaged on one rank (evicted there first, a failed write, a flipped bit) is recomputed on all of them, as a block
missing on one device is.

Probes (a read that only counts what the store has) run on rank 0 alone: what they count is a hint, and a load
that finds less is recomputed from where it stops.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from boundless.kv.disk_moves import DiskRead, DiskReadDone


class SplitReads:
    """Rank 0's account of the loads it has sent the other ranks (``ranks`` of them, numbered from 1): which each
    rank has finished, and what each found. Pure bookkeeping; the pipes are the caller's."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._found: dict[int, dict[int, DiskReadDone]] = {}  # read id -> rank -> that rank's finished read
        self._held: list[DiskReadDone] = []  # rank 0's finished reads, in the order they finished, not yet agreed

    def expect(self, reads: Iterable[DiskRead]) -> list[DiskRead]:
        """Note the step's reads; those the other ranks run (loads, not probes), to send them."""
        loads = [read for read in reads if not read.is_probe]
        for read in loads:
            self._found[read.read_id] = {}
        return loads

    def rank_done(self, rank: int, done: DiskReadDone) -> None:
        """Rank ``rank`` (1 or more) finished its share of a load (one not expected is ignored: its step failed)."""
        found = self._found.get(done.read_id)
        if found is not None:
            found[rank] = done

    def agree(self, rank0: Sequence[DiskReadDone]) -> list[DiskReadDone]:
        """With rank 0's reads finished since the last call, every read now finished on every rank (a probe at once),
        in the order rank 0 finished them: found as far as every rank found, in the slowest rank's seconds."""
        self._held.extend(rank0)
        agreed, held = [], []
        for done in self._held:
            found = self._found.get(done.read_id)
            if found is None:  # (a probe: rank 0's alone)
                agreed.append(done)
            elif len(found) == self.ranks:
                del self._found[done.read_id]
                shares = [done, *found.values()]
                agreed.append(
                    DiskReadDone(done.read_id, min(s.num_found for s in shares), max(s.seconds for s in shares))
                )
            else:
                held.append(done)
        self._held = held
        return agreed

    @property
    def waiting(self) -> bool:
        """Whether a read rank 0 has finished waits for another rank's."""
        return bool(self._held)
