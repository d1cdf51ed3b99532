"""When a lost instance is started again: the cluster's restart decisions, pure functions of state and a clock.

An instance the dispatcher calls lost (its actor died, its heartbeat timed out, or its step is stuck:
``cluster/stuck_step.py``) is due a restart ``restart_delay_s`` later, each further restart of the same instance
waiting twice as long as the one before (a model that crashes as it loads must not be reloaded in a tight loop),
up to ``max_restarts`` per instance (0: never). An instance that then stays up ``reset_after_s`` after a restart
came up starts afresh: its next loss waits the first delay again, and counts against the limit from zero (a
server that runs for weeks must not lose an instance for good to three crashes a week apart). The front end
carries out a :class:`Restart` (a fresh Ray actor, or a fresh engine loop in process, with the instance's id,
config and role) and tells the dispatcher when the new instance answers its first heartbeat; only then does it
take calls again, with an empty KV cache and no load. A restart that fails (the actor does not start, or dies
before its first heartbeat) counts as a restart and is retried under the same limit, after the longer delay.
Kubernetes backs off a crashing container's restarts alike (10 s, doubling to 5 min, reset after 10 minutes up);
the Ray actors here are made with ``max_restarts=0`` so that the dispatcher, which knows what the instance held,
decides instead of Ray.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from boundless.config import ClusterConfig

# Each further restart of an instance waits this many times the last one's delay.
BACKOFF = 2.0

RestartState = Literal["alive", "down", "starting", "retired"]


@dataclass(frozen=True)
class RestartPolicy:
    """How soon a lost instance is started again (``delay_s``, times ``BACKOFF`` per restart it already had), how
    many times at most (``max_restarts``; 0 turns restarts off), and how long a restarted instance stays up before
    its restarts are forgotten (``reset_after_s``; 0: never)."""

    delay_s: float = 5.0
    max_restarts: int = 3
    reset_after_s: float = 600.0

    @classmethod
    def from_config(cls, config: ClusterConfig) -> RestartPolicy:
        return cls(config.restart_delay_s, config.max_restarts, config.restart_reset_s)

    def delay(self, restarts: int) -> float:
        """Seconds from a loss to the restart of an instance that had ``restarts`` restarts before (since its last
        reset)."""
        return self.delay_s * BACKOFF**restarts


@dataclass(frozen=True)
class Restart:
    """Start a fresh instance in place of lost ``instance_id`` (its ``attempt``-th restart): same id, config and
    role, an empty KV cache. The front end tells the dispatcher when it answers its first heartbeat
    (``instance_ready``), or that it is lost again (``instance_lost``: the restart failed)."""

    instance_id: str
    attempt: int


@dataclass
class _Record:
    state: RestartState = "alive"
    restarts: int = 0  # restarts begun (those that failed too)
    streak: int = 0  # of which since the instance last stayed up past the policy's reset: they set delay and limit
    up_since: float | None = None  # when its last restart came up (None: never restarted)
    due_at: float = 0.0  # while down: when its restart is due
    losses: int = 0
    failures: int = 0  # restarts that did not come up


class Restarts:
    """Which lost instances are started again, and when (see the module docstring). Told of losses and of
    restarted instances that are ready; asked which restarts are due."""

    def __init__(self, policy: RestartPolicy, instance_ids: Iterable[str]) -> None:
        self.policy = policy
        self._records = {iid: _Record() for iid in instance_ids}

    def state(self, instance_id: str) -> RestartState:
        return self._records[instance_id].state

    def lost(self, instance_id: str, now: float) -> None:
        """The instance (or its restart, while it was starting) is lost: its next restart is due after the delay
        for the restarts it already had since it last stayed up past the reset, unless it had them all."""
        record = self._records[instance_id]
        if record.state == "starting":
            record.failures += 1
        reset = self.policy.reset_after_s
        if record.state == "alive" and record.up_since is not None and reset > 0 and now - record.up_since >= reset:
            record.streak = 0
        record.losses += 1
        if record.streak < self.policy.max_restarts:
            record.state, record.due_at = "down", now + self.policy.delay(record.streak)
        else:
            record.state = "retired"

    def due(self, now: float) -> list[Restart]:
        """The restarts due by ``now`` (each instance's once: it is starting from here)."""
        restarts = []
        for iid, record in self._records.items():
            if record.state == "down" and record.due_at <= now:
                record.state = "starting"
                record.restarts += 1
                record.streak += 1
                restarts.append(Restart(iid, record.restarts))
        return restarts

    def next_due(self) -> float | None:
        """When the next restart is due (None: none is)."""
        return min((r.due_at for r in self._records.values() if r.state == "down"), default=None)

    def ready(self, instance_id: str, now: float) -> bool:
        """The restarted instance answered its first heartbeat at ``now``: True if it was starting (it is alive
        again)."""
        record = self._records[instance_id]
        if record.state != "starting":
            return False
        record.state, record.up_since = "alive", now
        return True

    def counts(self, instance_id: str) -> tuple[int, int, int]:
        """(times lost, restarts that came up, restarts that failed) of the instance."""
        record = self._records[instance_id]
        up = record.restarts - record.failures - (record.state == "starting")
        return record.losses, up, record.failures

    @property
    def num_restarted(self) -> int:
        """Restarts that came up, over every instance."""
        return sum(self.counts(iid)[1] for iid in self._records)

    @property
    def num_failed(self) -> int:
        return sum(r.failures for r in self._records.values())
