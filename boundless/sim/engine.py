"""The simulator's engine: the real :class:`EngineCore`, sized from an :class:`EngineConfig` as the real
one is, with a cost-model executor in place of the network.

Only the model's description is read (architecture and tokenizer, from its GGUF metadata or
``config.json``); no weights. The tokenizer is the model's own, so the engine detokenizes and checks
stop strings exactly as the real one does and there is no text-less mode to keep in step with it.
It is cheap: ~0.1 s to build from the bundled GGUF's metadata, and detokenizing placeholder tokens
took ~6% of a simulation run (the README's ``boundless simulate`` command).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from boundless.cluster.links import Link
from boundless.config import ConfigError, EngineConfig, ModelConfig
from boundless.engine.builder import ModelIdentity, size_engine
from boundless.engine.core import EngineCore
from boundless.kv.block_hash import BlockHash
from boundless.kv.tier_io import DEFAULT_WRITE_QUEUE_BLOCKS
from boundless.model.arch import ModelArch
from boundless.model.gguf import model_arch_from_gguf, read_gguf_header
from boundless.model.loader import check_overrides, dtype_name, hf_arch, model_dtype, resolve_model_path
from boundless.model.tokenizer import Tokenizer
from boundless.programs.policy import SchedulingPolicy
from boundless.sim.cost import HOST_COPY_BYTES_PER_S, StepCost
from boundless.sim.executor import CostModelExecutor, DiskCost, SimulatedDisk
from boundless.sim.links import LinkSpec
from boundless.sim.remote import SimulatedRemoteIO

# Without a hardware profile: this machine's measured host copies, a local NVMe disk (sim/cost.py).
HOST_COPY = LinkSpec(HOST_COPY_BYTES_PER_S)
DEFAULT_DISK_COST = DiskCost()


@dataclass(frozen=True)
class SimulatedModel:
    """What an engine needs of a model it does not run: its shape, tokenizer, dtype and identity."""

    arch: ModelArch
    tokenizer: Tokenizer
    dtype: torch.dtype
    identity: ModelIdentity

    @staticmethod
    def read(config: ModelConfig) -> SimulatedModel:
        path = resolve_model_path(config.model)
        check_overrides(path, config.overrides)
        if path.is_file():
            header = read_gguf_header(path)
            tokenizer = Tokenizer.from_gguf(header.metadata)
            shapes = {name: info.shape for name, info in header.tensors.items()}
            # No RoPE factors: they change no size, and reading them means reading tensor data.
            arch = model_arch_from_gguf(header.metadata, shapes, tokenizer=tokenizer)
        else:
            tokenizer = Tokenizer.from_hf_dir(path)
            arch = hf_arch(path, config.overrides)
        eos = tuple(sorted(set(tokenizer.eos_token_ids) | set(arch.eos_token_ids)))  # as ModelIdentity.of
        # Its own fingerprint: a simulated instance's KV blocks are never a real one's.
        dtype = model_dtype(config.dtype, path, torch.device(config.device))
        fingerprint = hashlib.sha256(f"sim:{arch.fingerprint()}:{dtype_name(dtype)}".encode()).hexdigest()[:16]
        identity = ModelIdentity(config.model, arch.vocab_size, eos, fingerprint, "sim")
        return SimulatedModel(arch, tokenizer, dtype, identity)


def ranks_memory(config: EngineConfig, kv_heads: int) -> EngineConfig:
    """The config the simulator sizes an engine of a split model by (``--tensor-parallel-size N``), of ``kv_heads``
    key/value heads: its memory flags are each GPU's, as the real engine's ranks each hold ``--kv-cache-gb`` and
    ``--kv-host-gb`` of their share of every block, so N GPUs hold N times one's whole blocks (``kv_heads`` times where
    they are fewer than the GPUs: each GPU then holds one head of every block). (``--num-kv-blocks`` and
    ``--kv-disk-gb`` count whole blocks already.)"""
    n, cache = min(config.model.tensor_parallel_size, kv_heads), config.cache
    if n == 1:
        return config
    cache = dataclasses.replace(cache, kv_cache_gb=cache.kv_cache_gb * n)
    if cache.kv_host_gb is None and cache.swap_space_gb is not None:
        cache = dataclasses.replace(cache, swap_space_gb=cache.swap_space_gb * n)
    else:
        cache = dataclasses.replace(cache, kv_host_gb=cache.host_gb * n)
    return dataclasses.replace(config, cache=cache)


def simulated_engine(
    config: EngineConfig,
    model: SimulatedModel,
    cost: StepCost,
    clock: Callable[[], float],
    policy: SchedulingPolicy | None = None,
    host_copy: LinkSpec = HOST_COPY,
    disk_cost: DiskCost = DEFAULT_DISK_COST,
    storage_link: Link | None = None,
    store: OrderedDict[BlockHash, None] | None = None,
    remote: Callable[[int], SimulatedRemoteIO] | None = None,
    kv_bytes_per_token: int | None = None,
    max_model_len: int | None = None,
) -> EngineCore:
    """An engine instance sized by :func:`size_engine` from ``config``, whose steps take ``cost``'s time, its
    copies between memory tiers cross ``host_copy`` and its disk store costs ``disk_cost`` (its reads crossing
    ``storage_link`` when given: a link the instances of a node share). ``store``: the names the disk store
    holds, shared with other instances (the real store is one directory); ``remote(bytes_per_block)``: its
    end of the KV fabric to other instances (prefill/decode roles). ``kv_bytes_per_token``: what the copies,
    reads and streams move per token when it is not ``model``'s (a profile's model: the GPU's, not the one
    whose tokenizer and block bookkeeping the engine uses). ``max_model_len``: the context it admits, in place of
    one pool's (KV lending: the cluster's memory, as ``bench longctx`` raises it)."""
    if config.scheduler.speculative_config is not None:
        raise ConfigError(
            "--speculative-config: the simulator does not model speculative decoding (its executor samples no tokens "
            "that drafts could be checked against)"
        )
    # (A prefill/decode role's engine, or lending's, gives no block back past a sliding window: ``size_engine``.)
    layout = size_engine(config, model.arch, model.dtype, release_windows=remote is None and max_model_len is None)
    if max_model_len is not None:
        layout = dataclasses.replace(layout, max_model_len=max_model_len)
    block_bytes = kv_bytes_per_token * layout.block_size if kv_bytes_per_token else layout.bytes_per_block
    disk = None
    if layout.disk_bytes:
        disk = SimulatedDisk(
            layout.disk_bytes // layout.bytes_per_block,
            block_bytes,
            disk_cost,
            DEFAULT_WRITE_QUEUE_BLOCKS,
            storage_link,
            store,
        )
    executor = CostModelExecutor(
        cost,
        block_bytes,
        host_copy.bytes_per_s,
        clock=clock,
        disk=disk,
        host_copy_latency_s=host_copy.latency_s,
        remote=remote(block_bytes) if remote is not None else None,
    )
    return EngineCore(config, layout, model.identity, model.tokenizer, executor, clock, policy)
