"""KV cache events: which named blocks a tier gained and lost, as vLLM reports them to KV-aware routers.

The block pools write to a :class:`KVEventLog` when one is attached (``--kv-events-config``): a full block named in
the prefix cache is a :class:`BlockStored`, a name dropped (eviction, a failed step's blocks) a :class:`BlockRemoved`,
a reset of the prefix cache one :class:`AllBlocksCleared`. The engine takes a step's events after the step and hands
them to a publisher (``kv/event_publisher.py``), which encodes them in vLLM's wire form (``kv/event_wire.py``). With
no log attached the pools make no event objects at all.

Names stay our 16-byte block names here; the wire form turns them into vLLM's 64-bit integers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from boundless.kv.block_hash import BlockHash

# vLLM's names for the tier a block sits in. The engine's own pool is "GPU" whatever the device (routers take "GPU"
# for the pool attention reads, Dynamo's StorageTier::Device); host memory is "CPU", as vLLM's CPU offloading says.
MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"


@dataclass(frozen=True, slots=True)
class LoraTag:
    """The adapter whose weights computed a block's KV (its names are the adapter's own, ``set_namespace``)."""

    lora_id: int
    lora_name: str


@dataclass(slots=True)
class BlockStored:
    """A run of consecutive full blocks named in ``medium``: ``block_hashes[0]``'s parent is ``parent_block_hash``
    (None: it is a prompt's first block, or the tier does not say, as host memory does not), and ``block_tokens[i]``
    are block ``i``'s tokens (none where the tier does not say). The tuples are the cache's own, shared: the wire form
    joins them, on the publisher's thread."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    block_tokens: Sequence[tuple[int, ...]]
    medium: str
    lora: LoraTag | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Names ``medium`` no longer holds (consecutive removals from one tier are one event)."""

    block_hashes: list[BlockHash]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every name in memory (device and host) was dropped: ``reset_prefix_cache``."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventLog:
    """The events of the step being decided and run, in the order they happened; :meth:`take` empties it."""

    events: list[KVEvent] = field(default_factory=list)

    def stored(
        self,
        medium: str,
        names: Sequence[BlockHash],
        parent: BlockHash | None,
        tokens: Sequence[tuple[int, ...]],
        lora: LoraTag | None = None,
    ) -> None:
        """Blocks ``names`` (consecutive, each holding ``tokens[i]``) were named in ``medium``, the first after
        ``parent``. Below the device only the names are sent, as vLLM's CPU offloading sends them: its blocks are
        copies of device blocks whose chain the device events told."""
        if medium == MEDIUM_DEVICE:
            self.events.append(BlockStored(list(names), parent, tokens, medium, lora))
        else:
            self.events.append(BlockStored(list(names), None, (), medium, lora))

    def removed(self, medium: str, name: BlockHash) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(name)
        else:
            self.events.append(BlockRemoved([name], medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out
