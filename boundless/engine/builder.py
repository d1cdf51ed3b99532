"""Sizing and wiring of one engine instance, for the real model and for the simulator alike.

:func:`size_engine` cuts the instance's memory into KV blocks and fixes its context length (pure);
:func:`build_model_executor` wires the network, the KV memory, the attention backend and the
sampler into a :class:`~boundless.engine.executor.ModelExecutor`. The simulator sizes its engines
with the same function and gives them a cost-model executor instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from boundless.attention import flex_paged, triton_paged
from boundless.attention.backend import AttentionBackend
from boundless.attention.paged import TorchPagedAttention
from boundless.config import ConfigError, EngineConfig
from boundless.engine.cuda_graphs import DecodeGraphs
from boundless.engine.executor import ModelExecutor
from boundless.engine.runner import ModelRunner
from boundless.engine.sampler import Sampler
from boundless.engine.structured_output import Grammars
from boundless.engine.tensor_parallel import TensorParallelRanks
from boundless.kv.cache_dtype import kv_cache_dtype
from boundless.kv.disk_store import DiskKVStore, StoreLayout
from boundless.kv.tensors import PagedKVCache
from boundless.kv.throttled_store import ReadLink, ThrottledStore
from boundless.kv.tiers import BlockStore, HostKVTier, KVTier
from boundless.kv.transfer import HOST, TierId
from boundless.model.arch import ModelArch
from boundless.model.loader import LoadedModel
from boundless.model.pooling import EmbeddingPooling
from boundless.model.rope import uses_long_factors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLayout:
    """How one instance's KV memory is cut up, and the context length that follows from it."""

    block_size: int
    num_blocks: int  # device KV blocks
    num_host_blocks: int  # host blocks: swapped-out requests and named blocks evicted from the device
    bytes_per_block: int  # one block's KV across all layers
    max_model_len: int
    kv_dtype: torch.dtype  # what the KV cache holds (--kv-cache-dtype): the model's type, or an 8-bit one
    disk_bytes: int = 0  # most the disk store may hold (0: no disk tier)
    # The sliding window of every layer (None: none, or some layer attends the whole context): a request's blocks
    # that have left it go back to the pool when it runs short (``KVCacheManager.release_outside_window``).
    window: int | None = None
    # A LongRoPE model's keys and queries rotated by its long factors (``rope.uses_long_factors`` of the context asked
    # for, the model's own by default, not of what the pool holds: the outputs are not the pool's choice).
    rope_long: bool = False


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory as the driver reports it (``torch.cuda.mem_get_info``): free and total bytes."""

    free: int
    total: int

    @staticmethod
    def of(device: torch.device) -> DeviceMemory | None:
        """The device's memory now; None for a device that is not CUDA."""
        if device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(free, total)


@dataclass(frozen=True)
class ModelIdentity:
    """What the engine's bookkeeping knows of its model: no weights."""

    name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    fingerprint: str  # names KV blocks: equal fingerprints mean interchangeable KV
    device: str
    pooling: EmbeddingPooling = field(default_factory=EmbeddingPooling)  # how its embeddings are made
    generates: bool = True  # False: it only embeds (a base model saved with no LM head)

    @staticmethod
    def of(loaded: LoadedModel, layout: EngineLayout) -> ModelIdentity:
        """``loaded``'s, in an engine of ``layout`` (its KV's name: ``LoadedModel.kv_fingerprint``)."""
        eos = tuple(sorted(set(loaded.tokenizer.eos_token_ids) | set(loaded.arch.eos_token_ids)))
        return ModelIdentity(
            loaded.name, loaded.arch.vocab_size, eos, loaded.kv_fingerprint(layout.rope_long), str(loaded.device),
            loaded.pooling, loaded.generates,
        )  # fmt: skip


def size_engine(
    config: EngineConfig,
    arch: ModelArch,
    dtype: torch.dtype,
    pools: float = 1,
    memory: DeviceMemory | None = None,
    release_windows: bool = True,
) -> EngineLayout:
    """Blocks from ``--num-kv-blocks``, ``--gpu-memory-utilization`` (of ``memory``, the device's once the weights are
    loaded) or ``--kv-cache-gb``, host blocks from ``--kv-host-gb``, the disk store's room from ``--kv-disk-gb`` (with
    ``--kv-disk-path``), and the context length: the asked one (which must fit in the pool), or the model's capped by
    the pool.

    ``release_windows``: a model whose every layer slides gives back the blocks past its window
    (``EngineLayout.window``), and its context is not capped by the pool; off for an engine whose requests' blocks are
    read whole or moved by index (a prefill/decode role's, KV lending's).

    ``pools``: how many instances' pools' worth of KV one request may hold. With KV lending its blocks beyond
    this pool live on creditors, so its context is capped by what they lend (``lending_plan.request_pools``), or by
    the cluster's memory (``bench longctx``).
    """
    cache = config.cache
    bs = cache.block_size
    kv_dtype = kv_cache_dtype(cache.kv_cache_dtype, dtype)
    per_block = PagedKVCache.bytes_per_block(arch.num_layers, arch.num_kv_heads, arch.head_dim, bs, kv_dtype)
    if cache.num_kv_blocks:
        num_blocks = cache.num_kv_blocks
    elif cache.gpu_memory_utilization is not None:
        num_blocks = _blocks_in_fraction(cache.gpu_memory_utilization, memory, per_block)
        gib = num_blocks * per_block / (1 << 30)
        log.info("KV pool: %d blocks (%.2f GiB) by --gpu-memory-utilization", num_blocks, gib)
    else:
        num_blocks = max(1, int(cache.kv_cache_gb * (1 << 30)) // per_block)
    num_host_blocks = int(cache.host_gb * (1 << 30)) // per_block
    disk_bytes = int(cache.kv_disk_gb * (1 << 30)) if cache.kv_disk_path else 0
    if disk_bytes and num_host_blocks == 0:
        raise ConfigError(f"--kv-host-gb: {cache.host_gb} GiB holds no {per_block}-byte block; disk loads need one")
    pool_tokens = int(num_blocks * pools) * bs
    asked = config.model.max_model_len
    window = released_window(arch) if release_windows else None
    # How far one request's KV may reach: the pool, or with every layer sliding, the model's context: the blocks past
    # the window go back, and a request holds a window and a step's chunk at most (once the pool has room for them).
    reach: int | None = pool_tokens
    if window is not None and num_blocks * bs >= window + config.scheduler.max_num_batched_tokens + bs:
        reach = None
    if asked is None:
        max_model_len = arch.context_length if reach is None else min(arch.context_length, reach)
    elif asked > arch.context_length and not config.model.allow_long_max_model_len:
        raise ConfigError(
            f"--max-model-len: {asked} tokens exceed the model's context ({arch.context_length}); outputs past it "
            "are not what the model was trained for. Pass --allow-long-max-model-len to run it anyway"
        )
    elif reach is not None and asked > reach:
        raise ConfigError(
            f"--max-model-len: {asked} tokens do not fit in the KV pool ({pool_tokens} tokens"
            + (f" in {pools:g} instances' pools" if pools > 1 else "")
            + "); raise --kv-cache-gb or --num-kv-blocks"
            + (
                f" (or lower --max-num-batched-tokens: with the model's sliding window of {window} tokens, a pool "
                "that holds a window, a step's tokens and a block serves any context)"
                if window is not None
                else ""
            )
        )
    else:
        max_model_len = asked
    rope_long = uses_long_factors(arch.rope_scaling, arch.context_length if asked is None else asked)
    return EngineLayout(
        bs, num_blocks, num_host_blocks, per_block, max_model_len, kv_dtype, disk_bytes, window, rope_long
    )


def released_window(arch: ModelArch) -> int | None:
    """The window past which a request's blocks may go back to the pool: the model's when every layer slides (a
    layer over the whole context reads every block)."""
    return None if arch.full_attention_layers else arch.sliding_window


def _blocks_in_fraction(fraction: float, memory: DeviceMemory | None, per_block: int) -> int:
    """The KV blocks that fit in ``fraction`` of the device's memory less what is in use (SGLang's static fraction)."""
    if memory is None:
        raise ConfigError("--gpu-memory-utilization sizes the KV pool on a CUDA device; elsewhere give --kv-cache-gb")
    gib = 1 << 30
    in_use = memory.total - memory.free
    room = int(fraction * memory.total) - in_use
    if room < per_block:
        raise ConfigError(
            f"--gpu-memory-utilization: {fraction:g} of the device's {memory.total / gib:.1f} GiB leaves no room for "
            f"KV: {in_use / gib:.1f} GiB is in use with the weights loaded; raise it"
        )
    return room // per_block


def open_disk_store(loaded: LoadedModel, config: EngineConfig, layout: EngineLayout) -> BlockStore:
    """The persistent KV store at ``--kv-disk-path``, laid out for this model (a split model's rank: its share of the
    blocks, in its share of ``--kv-disk-gb``)."""
    store_layout = StoreLayout.of_model(
        loaded, layout.block_size, loaded.kv_fingerprint(layout.rope_long), layout.kv_dtype
    )
    root = store_directory(config.cache.kv_disk_path or "")
    return DiskKVStore(root, store_layout, layout.disk_bytes // loaded.tensor_parallel.size)


def store_directory(path: str) -> Path:
    """``--kv-disk-path`` as a directory, made if it is not there; one that can never be is the flag's error."""
    root = Path(path).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        # (A path that can never be a directory is the flag's error; other trouble, an unwritable directory, is the
        # store's to live with: it reads on, and a read-only store is a use of its own.)
        raise ConfigError(f"--kv-disk-path: {root} is no directory, nor can it be made one ({e.strerror})") from None
    except OSError as e:
        if not root.is_dir():  # (nothing there to read either: /proc/kvstore served a store of nothing)
            raise ConfigError(f"--kv-disk-path: {root} does not exist, nor can it be made ({e.strerror})") from None
    return root


def physical_memory_bytes() -> int | None:
    """This machine's memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(config: EngineConfig, layout: EngineLayout, device: torch.device, memory: int | None) -> None:
    """KV pools in host memory (the device's pool on the CPU, and the host tier; each tensor-parallel rank's) that the
    machine's ``memory`` cannot hold are refused, naming the flag that sized them: allocated, they failed with the
    allocator's traceback (``--kv-host-gb 100000``), or were reserved and left the process to be killed when filled."""
    if memory is None:
        return
    gib = 1 << 30
    ranks = config.model.tensor_parallel_size  # (a split model's ranks each hold pools as large, on this machine)
    device_bytes = ranks * layout.num_blocks * layout.bytes_per_block if device.type == "cpu" else 0
    host_bytes = ranks * layout.num_host_blocks * layout.bytes_per_block
    cache = config.cache
    pool_flag = "--num-kv-blocks" if cache.num_kv_blocks else "--kv-cache-gb"
    if device_bytes > memory:
        raise ConfigError(
            f"{pool_flag}: a KV pool of {device_bytes / gib:.1f} GiB is more than this machine's memory "
            f"({memory / gib:.1f} GiB)"
        )
    if device_bytes + host_bytes > memory:
        host_flag = (
            "--swap-space-gb" if cache.kv_host_gb is None and cache.swap_space_gb is not None else "--kv-host-gb"
        )
        raise ConfigError(
            f"{host_flag}: {host_bytes / gib:.1f} GiB of KV in host memory"
            + (f", beside the KV pool's {device_bytes / gib:.1f} GiB," if device_bytes else "")
            + f" is more than this machine's memory ({memory / gib:.1f} GiB)"
        )


def build_model_executor(
    loaded: LoadedModel,
    config: EngineConfig,
    layout: EngineLayout,
    store: BlockStore | None = None,
    read_link: ReadLink | None = None,
    grammars: Grammars | None = None,
    ranks: TensorParallelRanks | None = None,
) -> ModelExecutor:
    """The network, its KV memory (device and host, and the disk store: ``store``, else the one at
    ``--kv-disk-path``; its reads wait for ``read_link``, an emulated storage link, when given),
    attention backend and sampler (compiling structured requests' grammars in ``grammars``, the engine's), ready to
    run steps. With ``--tensor-parallel-size``: ``ranks``, the other ranks launched already (they load beside rank 0:
    :func:`~boundless.engine.tensor_parallel.load_with_ranks`), else launched here; they are stopped if the engine
    cannot be built."""
    launched: list[TensorParallelRanks] = []  # (the ranks launched here, if none were given)
    try:
        return _build_model_executor(loaded, config, layout, store, read_link, grammars, ranks, launched)
    except BaseException:
        for given_or_launched in [ranks] if ranks is not None else launched:
            given_or_launched.close()
        raise


def _build_model_executor(
    loaded: LoadedModel,
    config: EngineConfig,
    layout: EngineLayout,
    store: BlockStore | None,
    read_link: ReadLink | None,
    grammars: Grammars | None,
    ranks: TensorParallelRanks | None,
    launched: list[TensorParallelRanks],
) -> ModelExecutor:
    arch = loaded.arch
    if loaded.model.summed:  # (before anything is shared with the engine running on it, or ranks launched for it)
        raise ValueError(
            "this network is rank 0 of another tensor-parallel engine already (its sums go to that engine's ranks): "
            "load the model again for another engine"
        )
    if loaded.tensor_parallel.size != config.model.tensor_parallel_size:
        raise ValueError(
            f"the model was loaded as {loaded.tensor_parallel.size} tensor-parallel rank(s)' share, the config asks "
            f"for {config.model.tensor_parallel_size}: load it with load_configured_model(config.model)"
        )
    check_host_memory(config, layout, loaded.device, physical_memory_bytes())
    loaded.model.prepare(layout.max_model_len, layout.rope_long)
    scaling = arch.rope_scaling
    if scaling.kind == "longrope":  # (as vLLM warns: the long factors cost some quality on short sequences)
        log.info(
            "LongRoPE: the %s factors (the context asked for, %d, is %s the original context of %d)",
            "long" if layout.rope_long else "short", config.model.max_model_len or arch.context_length,
            "past" if layout.rope_long else "within", scaling.original_max_position_embeddings,
        )  # fmt: skip
    kv_cache, lower_tiers = kv_memory(arch, layout, loaded.device)
    log.info(
        "KV pool: %d blocks of %d tokens (%d tokens, %.2f GiB in %s%s)",
        layout.num_blocks, layout.block_size, layout.num_blocks * layout.block_size,
        layout.num_blocks * layout.bytes_per_block / (1 << 30), str(layout.kv_dtype).removeprefix("torch."),
        f", on each of {config.model.tensor_parallel_size} ranks" if config.model.tensor_parallel_size > 1 else "",
    )  # fmt: skip
    attention = make_attention(config, arch, layout, loaded.device, loaded.dtype)
    if config.model.tensor_parallel_size > 1:
        # (The other ranks, launched by the caller to load beside rank 0, or now.)
        if ranks is None:
            ranks = TensorParallelRanks.launch(config, loaded.device)
            launched.append(ranks)
        ranks.join(layout, loaded.model)
    graphs = None
    graphed = (triton_paged.TritonPagedAttention, flex_paged.FlexPagedAttention)
    on_gpu = isinstance(attention, graphed) and loaded.device.type == "cuda"
    # (A tensor-parallel model runs eagerly: its other ranks run each step as rank 0 sends it. A mixture of experts
    # is captured: on this path its tokens are grouped on the device, SparseMoE.forward_fused.)
    if on_gpu and not config.model.enforce_eager and ranks is None:
        assert isinstance(attention, graphed)  # (on_gpu says so)
        graphs = DecodeGraphs(
            loaded.model, kv_cache, attention, config.scheduler.max_num_seqs, layout.max_model_len, loaded.device
        )
        graphs.capture()
    elif config.scheduler.async_scheduling:
        why = (
            "--enforce-eager" if config.model.enforce_eager
            else "--tensor-parallel-size (run eagerly)" if on_gpu and ranks is not None
            else f"{type(attention).__name__} on {loaded.device.type}"
        )  # fmt: skip
        log.warning(
            "--async-scheduling has no effect here: it overlaps steps run on CUDA graphs (the triton or flex backend "
            "on CUDA, without --enforce-eager, on one GPU); this engine has none: %s",
            why,
        )
    grammars = grammars or Grammars(loaded.tokenizer, arch.vocab_size)
    sampler = Sampler(loaded.device, seed=config.model.seed, grammars=grammars)
    runner = ModelRunner(
        loaded.model, kv_cache, attention, sampler, loaded.device, graphs, ranks, loaded.pooling, loaded.classifier
    )
    if store is None and layout.disk_bytes:
        store = open_disk_store(loaded, config, layout)
    if store is not None and read_link is not None:
        # A link that queues bytes ahead of their read (``ThrottledLink.begin``) carries them while files are read.
        store = ThrottledStore(
            store,
            read_link.transfer,
            read_link.transfer_parts,
            getattr(read_link, "begin", None),
            getattr(read_link, "announce", None),
        )
    if store is not None:
        describe = getattr(store, "describe", None)
        log.info(
            "%s; write policy %s",
            describe() if describe is not None else f"KV disk store {config.cache.kv_disk_path}: {store.stats()}",
            config.cache.kv_write_policy,
        )
    return ModelExecutor(
        runner,
        lower_tiers,
        store=store,
        layerwise_load=config.cache.layerwise_load == "on",
        layer_wait_timeout_s=config.cache.kv_load_timeout_s,
        device_steps=config.scheduler.async_scheduling,
    )


def kv_memory(arch: ModelArch, layout: EngineLayout, device: torch.device) -> tuple[PagedKVCache, dict[TierId, KVTier]]:
    """A network's KV memory as ``layout`` sizes it: the device pool, and the host memory below it where there is any
    (rank 0's and every other rank's of a split model alike: the same blocks, each its share of them)."""
    kv_cache = PagedKVCache(
        arch.num_layers, arch.num_kv_heads, arch.head_dim, layout.num_blocks, layout.block_size, layout.kv_dtype, device
    )
    lower: dict[TierId, KVTier] = {HOST: HostKVTier(kv_cache, layout.num_host_blocks)} if layout.num_host_blocks else {}
    return kv_cache, lower


def make_attention(
    config: EngineConfig, arch: ModelArch, layout: EngineLayout, device: torch.device, dtype: torch.dtype
) -> AttentionBackend:
    """The attention backend ``--attention-backend`` names (``auto``: the Triton kernels on CUDA, else PyTorch's; on
    the CPU always PyTorch's, whose native kernels Triton's interpreter is far slower than)."""
    name = config.model.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_paged.available(device) else "torch"
    if config.model.flash_prefill and name != "triton":
        raise ConfigError(f"--flash-prefill goes with the triton attention backend, not {name}")
    if name == "triton":
        if not triton_paged.available(device):
            raise ConfigError(
                "--attention-backend: triton needs CUDA and the triton package (or TRITON_INTERPRET=1 on the CPU)"
            )
        if config.model.flash_prefill:
            if not (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)):
                raise ConfigError("--flash-prefill: FlashAttention runs on CUDA in bfloat16 or float16")
            if not (arch.head_dim % 8 == 0 and arch.head_dim <= 256):
                raise ConfigError(f"--flash-prefill: FlashAttention takes heads of 8 to 256 by 8, not {arch.head_dim}")
            failed = triton_paged.check_varlen(triton_paged.flash_varlen, device, dtype)
            if failed is not None:
                raise ConfigError(f"--flash-prefill: FlashAttention's variable-length call failed its check: {failed}")
        return triton_paged.TritonPagedAttention(
            arch.num_heads, arch.num_kv_heads, arch.head_dim, layout.num_blocks, layout.block_size, device, dtype,
            flash_prefill=config.model.flash_prefill, scale=arch.attention_scale, softcap=arch.attn_logit_softcap,
        )  # fmt: skip
    if name == "flex":
        if layout.kv_dtype != dtype:
            raise ConfigError(
                f"--kv-cache-dtype {config.cache.kv_cache_dtype}: the flex backend attends over the KV pool in the "
                "model's type; take the triton or torch backend for a KV cache in another"
            )
        if not flex_paged.available():
            raise ConfigError("--attention-backend: flex needs PyTorch 2.9 or later (FlexAttention's log-sum-exp)")
        pool = layout.num_blocks * layout.block_size
        scores = config.scheduler.max_num_batched_tokens * arch.num_heads * pool * 4
        if device.type != "cuda" and scores > flex_paged.EAGER_SCORE_BYTES:
            raise ConfigError(
                f"--attention-backend flex on {device.type} runs FlexAttention's eager reference, which scores a "
                f"step's tokens against the whole KV pool: {scores / 2**30:.1f} GiB for --max-num-batched-tokens "
                f"{config.scheduler.max_num_batched_tokens} over {pool} pool tokens (at most "
                f"{flex_paged.EAGER_SCORE_BYTES / 2**30:.0f} GiB); shrink --num-kv-blocks or "
                "--max-num-batched-tokens, or take --attention-backend torch, the CPU's fast path"
            )
        try:
            return flex_paged.FlexPagedAttention(
                arch.num_heads, arch.num_kv_heads, arch.head_dim, layout.num_blocks, layout.block_size, device,
                windows=arch.windows, scale=arch.attention_scale, softcap=arch.attn_logit_softcap,
            )  # fmt: skip
        except ValueError as e:  # (pages too small for its GPU kernel)
            raise ConfigError(f"--attention-backend flex: {e}") from None
    return TorchPagedAttention(
        arch.num_heads, arch.num_kv_heads, arch.head_dim, layout.num_blocks,
        scale=arch.attention_scale, softcap=arch.attn_logit_softcap,
    )  # fmt: skip
