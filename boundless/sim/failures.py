"""Instances that fail in a simulation (``boundless simulate --fail``): when each stops, and when the cluster sees it.

A failed instance stops where it is: the step it is running never ends (its tokens are never delivered), it starts
no other, and its KV streams never complete, as a crashed or hung engine's. The cluster is told as the Ray transport
(``cluster/client.py``) would find out: a *crash* at once (Ray fails every call to a dead actor, the poller's
pending ``drain`` first), a *hang* (its process stops answering) ``heartbeat_timeout_s`` later, when the poller's
``drain`` times out. Until then a hung instance takes the calls the router sends it and never runs them (the real
front end's ``add`` would block up to the timeout and fail the call over; the simulator does not stall the
dispatcher meanwhile). A *stuck* engine (its forward pass never returns, inside a process that still answers) keeps
taking calls too; its step in flight, or the next one it starts, never ends, and the front end's step watchdog
(``cluster/stuck_step.py``, the real rule on the report its heartbeat carries) finds it once that step has run
``step_timeout_s``. The dispatcher then decides what the real cluster's does (``Dispatcher.instance_lost``), and
the simulator carries it out (``sim/simulator.py``); with KV lending, the other instances' agents free what they
lent the lost one and recompute what it held for them (``sim/lending.py``).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from boundless.config import ClusterConfig


@dataclass(frozen=True)
class InstanceFailure:
    """Instance ``instance_id`` stops at ``at_s`` (virtual seconds from the run's start); ``hang``: it stops answering
    instead of dying, and is found out by a missed heartbeat; ``stuck``: its engine is stuck in a step (the one in
    flight, or the next) while the process answers, and is found out by the step watchdog."""

    instance_id: str
    at_s: float
    hang: bool = False
    stuck: bool = False

    def detected_at(self, heartbeat_timeout_s: float) -> float:
        """When the cluster calls a crashed or hung instance lost (a stuck one: when its step has run too long)."""
        return self.at_s + (heartbeat_timeout_s if self.hang else 0.0)

    def describe(self) -> str:
        kind = ":hang" if self.hang else ":stuck" if self.stuck else ""
        return f"{self.instance_id}@{self.at_s:g}{kind}"


def parse_failures(text: str) -> list[InstanceFailure]:
    """``ID@SECONDS[:hang|:stuck]`` comma-separated (``1@30,p0@12.5:hang``); raises ValueError naming the bad
    item."""
    failures = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        iid, at, rest = item.partition("@")
        seconds, _, kind = rest.partition(":")
        if not iid or not at or kind not in ("", "hang", "stuck", "crash"):
            raise ValueError(f"{item!r} is not ID@SECONDS, ID@SECONDS:hang or ID@SECONDS:stuck")
        try:
            at_s = float(seconds)
        except ValueError:
            raise ValueError(f"{item!r}: {seconds!r} is not a number of seconds") from None
        failures.append(InstanceFailure(iid.strip(), at_s, kind == "hang", kind == "stuck"))
    return failures


def instance_ids(cluster: ClusterConfig) -> list[str]:
    """The instances of a simulated cluster, as the simulator names them: ``0``.. or, with roles, ``p0``.. ``d0``.."""
    if cluster.disaggregated:
        prefill, decode = cluster.roles
        return [f"p{i}" for i in range(prefill)] + [f"d{i}" for i in range(decode)]
    return [str(i) for i in range(cluster.instances)]


def check_failures(failures: Collection[InstanceFailure], cluster: ClusterConfig) -> None:
    """Raise ValueError for failures the simulated ``cluster`` cannot carry out."""
    if not failures:
        return
    ids = instance_ids(cluster)
    if len(ids) < 2:
        raise ValueError("one instance has no dispatcher and nothing to fail over to: use --instances 2 or more")
    seen = set()
    for failure in failures:
        if failure.instance_id not in ids:
            raise ValueError(f"no instance {failure.instance_id!r} in this cluster (its instances: {', '.join(ids)})")
        if failure.instance_id in seen:
            raise ValueError(f"instance {failure.instance_id!r} fails more than once")
        if not (math.isfinite(failure.at_s) and failure.at_s >= 0):
            raise ValueError(f"{failure.describe()}: the time must be a number of seconds, not negative")
        seen.add(failure.instance_id)
