"""The policies by name: the one list of names that config validation and ``--policy`` use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from boundless.programs.policies import ATLASPolicy, MLFQPolicy, PLASPolicy, QueueConfig
from boundless.programs.policy import FCFSPolicy, SchedulingPolicy

if TYPE_CHECKING:  # config imports this module for POLICIES
    from boundless.config import SchedulerConfig

_QUEUE_POLICIES = {cls.name: cls for cls in (MLFQPolicy, PLASPolicy, ATLASPolicy)}
POLICIES: tuple[str, ...] = (FCFSPolicy.name, *_QUEUE_POLICIES)


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    """The policy object a scheduler config names."""
    if config.policy == FCFSPolicy.name:
        return FCFSPolicy(ttl_s=config.program_ttl_s)
    if config.policy not in _QUEUE_POLICIES:
        raise ValueError(f"unknown policy {config.policy!r}; one of {', '.join(POLICIES)}")
    queues = QueueConfig(
        num_queues=config.num_queues,
        base_s=config.queue_base_s,
        growth=config.queue_growth,
        beta=config.starvation_beta,
        ttl_s=config.program_ttl_s,
        order_by_program=config.queue_order == "program",
    )
    return _QUEUE_POLICIES[config.policy](queues)
