"""Tensor parallelism (Megatron-LM's, as vLLM's ``--tensor-parallel-size``): one model across ``size`` devices.

Each rank holds a slice of every layer's matrices and attends with its share of the heads:

- q/k/v and gate/up are split by rows (column parallel): rank ``r`` holds its ``num_heads / size`` query heads, its
  ``num_kv_heads / size`` key/value heads and its ``intermediate_size / size`` MLP features, so its attention and
  its MLP activations need nothing of the other ranks;
- o and down are split by columns to match (row parallel): each rank's product is a partial sum of the whole
  product, and the ranks add theirs (one all-reduce after each half-layer), so every rank's residual stream is the
  whole model's again;
- the embedding, the norms and the LM head are whole on every rank (rank 0 alone computes logits);
- a mixture's router is whole on every rank, and each expert split as an MLP is: its gate/up rows and its down
  columns by the rank's share of its features (vLLM's tensor-parallel MoE), so each rank's experts' weighted sum is a
  partial sum of the whole one, added with the others' as the MLP's is; a down bias (gpt-oss's), which each token's
  routing weight scales inside that sum, is rank 0's alone (zeros on the others).

So a rank's network is the model with ``1/size`` of its heads and MLP features (:func:`shard_arch`), loaded from
the checkpoint's slices (:func:`shard_weights`), and its KV cache holds its heads only: the KV memory of a context
is spread over the ranks as its weights are. The ranks' products sum in another order than one device's, so their
logits differ from it by rounding (a few ulps), as vLLM's do.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.distributed as dist

from boundless.model.arch import ModelArch


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel model: rank ``rank`` of ``size``."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not one of {self.size}")


ONE_DEVICE = TensorParallel()  # a model on one device


def check_shardable(arch: ModelArch, size: int) -> None:
    """Refuse, naming the flag, a model that ``size`` ranks cannot split evenly (vLLM's rule: the heads, the MLP's
    features and each expert's each a multiple of the ranks, the key/value heads too or, fewer than the ranks, a
    divisor of them)."""
    from boundless.config import ConfigError  # (here: the config reads LoRA modules, whose loading cuts by ranks)

    if size == 1:
        return
    flag = f"--tensor-parallel-size {size}"
    sizes = [("attention heads", arch.num_heads), ("MLP features", arch.intermediate_size)]
    if arch.num_experts:
        sizes.append(("features of each expert", arch.moe_intermediate_size))
    for what, n in sizes:
        if n % size:
            raise ConfigError(f"{flag}: the model's {n} {what} do not split evenly over {size} devices")
    kv = arch.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ConfigError(
            f"{flag}: the model's {kv} key/value heads neither split evenly over {size} devices nor, fewer, divide "
            "them (each then held by as many ranks)"
        )


def kv_replicas(arch: ModelArch, size: int) -> int:
    """How many ranks hold each key/value head: 1 where they split over the ranks, else ``size / num_kv_heads`` (a
    rank's query heads all read one key/value head, which the ranks of its group each hold, as vLLM replicates it)."""
    return max(1, size // arch.num_kv_heads)


def dense_sides(arch: ModelArch, ranks: int = 1) -> tuple[list[int], list[int]] | None:
    """The sides of a layer's dense matrices that a rank holds over ``ranks`` ranks (all of them on one): their
    outputs (q's, k's or v's with each key/value head's replicas, o's, a dense MLP's gate's or up's) and their inputs
    (q/k/v's and gate/up's, o's, a dense MLP's down's); None where one does not split evenly."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim * kv_replicas(arch, ranks)
    mlp = [arch.intermediate_size] if len(arch.sparse_layers) < arch.num_layers else []
    if any(n % ranks for n in (q, kv, *mlp)):
        return None
    outputs = [q // ranks, kv // ranks, arch.hidden_size, *(n // ranks for n in mlp)]
    return outputs, [arch.hidden_size, q // ranks, *(n // ranks for n in mlp)]


def vocab_rows(arch: ModelArch, size: int) -> int | None:
    """The embedding's and LM head's rows a rank holds: ``1/size`` of the vocabulary where it splits evenly (vLLM
    splits them so; a rank then looks up only its tokens and computes only its logits), else None: whole on each."""
    if size == 1 or arch.vocab_size % size:
        return None
    return arch.vocab_size // size


def shard_arch(arch: ModelArch, size: int) -> ModelArch:
    """One rank's network: ``arch`` with ``1/size`` of its heads and MLP features, and of its key/value heads (or one,
    held by :func:`kv_replicas` ranks, where they are fewer than the ranks)."""
    check_shardable(arch, size)
    if size == 1:
        return arch
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // size,
        num_kv_heads=max(1, arch.num_kv_heads // size),
        intermediate_size=arch.intermediate_size // size,
        moe_intermediate_size=arch.moe_intermediate_size // size,
    )


@dataclass(frozen=True)
class ShardPlan:
    """Which parts of a checkpoint tensor a rank holds: the ranges ``(start, length)`` along ``dim``, put side by side
    in order (one range, or Phi-3's fused matrices' one per part); no range: zeros of its shape (a bias only rank 0
    adds, :func:`shard_plan`)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's parts of ``tensor``, whole."""
        if not self.ranges:
            return torch.zeros_like(tensor)
        parts = [tensor.narrow(self.dim, start, n) for start, n in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)


def shard_plan(name: str, shape: Sequence[int], arch: ModelArch, tp: TensorParallel) -> ShardPlan | None:
    """Rank ``tp``'s parts of the Hugging Face-named tensor ``name`` (of ``shape``) of the model ``arch`` (whole); None:
    all of it. Each column-parallel matrix's rows (its bias's too), each row-parallel one's columns; Phi-3's fused
    q/k/v and gate/up keep their layout: the rank's q, k and v rows (its gate and up rows) side by side."""
    if tp.size == 1:
        return None
    module = name.split(".")[-2] if "." in name else ""

    def mine(start: int, n: int, replicas: int = 1) -> tuple[int, int]:
        """The rank's share of ``n`` rows or columns from ``start``: its ``1/size``, or with ``replicas`` ranks to each
        part (key/value heads fewer than the ranks), its group's ``replicas/size``."""
        parts = tp.size // replicas
        return start + (tp.rank // replicas) * (n // parts), n // parts

    replicas = kv_replicas(arch, tp.size)
    if name.endswith(".self_attn.sinks"):  # (gpt-oss's sink of each query head: the rank's heads')
        return ShardPlan(0, (mine(0, shape[0]),))
    if module == "experts":  # (stacked experts: transformers 5's [experts, out, in], gpt-oss's [experts, in, out])
        return _stacked_experts_plan(name.rsplit(".", 1)[1], shape, arch, tp, mine)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return None if vocab_rows(arch, tp.size) is None else ShardPlan(0, (mine(0, shape[0]),))
    if module in ("q_proj", "gate_proj", "up_proj", "w1", "w3"):  # (Mixtral's experts' w1 and w3: gate and up)
        return ShardPlan(0, (mine(0, shape[0]),))
    if module in ("k_proj", "v_proj"):
        return ShardPlan(0, (mine(0, shape[0], replicas),))
    if module == "qkv_proj":
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        return ShardPlan(0, (mine(0, q), mine(q, kv, replicas), mine(q + kv, kv, replicas)))
    if module == "gate_up_proj":
        inter = arch.intermediate_size
        return ShardPlan(0, (mine(0, inter), mine(inter, inter)))
    if module in ("o_proj", "down_proj", "w2") and name.endswith(".weight"):
        return ShardPlan(1, (mine(0, shape[1]),))  # (held in 4 or 8 bits: codes [out, in * bits / 8], cut alike)
    if module in ("o_proj", "down_proj") and name.endswith((".weight_scale", ".weight_zero")) and len(shape) == 2:
        # (A held matrix's scales and zero points a group of inputs, [out, groups]: the rank's groups; one group of
        # all the inputs, every rank's.)
        return None if shape[1] == 1 else ShardPlan(1, (mine(0, shape[1]),))
    return None


def _stacked_experts_plan(
    leaf: str,
    shape: Sequence[int],
    arch: ModelArch,
    tp: TensorParallel,
    mine: Callable[[int, int], tuple[int, int]],
) -> ShardPlan | None:
    """A rank's parts of a mixture's stacked experts (``mlp.experts.LEAF``): each expert's share of the features. In
    transformers 5's layout gate's rows then up's ([experts, 2 * inter, hidden]) and down's columns; in gpt-oss's
    (transposed, gate and up interleaved by column: [experts, hidden, 2 * inter]) a run of whole gate/up column pairs,
    its bias's alike, down's rows; its down bias rank 0's alone."""
    if arch.model_type == "gpt_oss":
        dims = {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}
        if leaf == "down_proj_bias":
            return None if tp.rank == 0 else ShardPlan(0, ())
        return ShardPlan(dims[leaf], (mine(0, shape[dims[leaf]]),)) if leaf in dims else None
    if leaf == "gate_up_proj":
        inter = shape[1] // 2
        return ShardPlan(1, (mine(0, inter), mine(inter, inter)))
    return ShardPlan(2, (mine(0, shape[2]),)) if leaf == "down_proj" else None


def shard_weights(
    weights: Iterator[tuple[str, torch.Tensor]], arch: ModelArch, tp: TensorParallel
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank ``tp``'s parts (:func:`shard_plan`) of the Hugging Face-named ``weights`` of the model ``arch`` (whole),
    cut from tensors read whole (a GGUF file's, a quantized checkpoint's once dequantized, weights drawn in memory;
    a safetensors file's are read in parts: ``loader._safetensors_weights``)."""
    for name, tensor in weights:
        plan = shard_plan(name, tensor.shape, arch, tp)
        yield name, tensor if plan is None else plan.take(tensor)


class _Collective(Protocol):
    """What this module uses of a torch.distributed backend (``ProcessGroupGloo``, ``ProcessGroupNCCL``)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> dist.Work: ...


class RankSum(Protocol):
    """The ranks' sum of each row-parallel product, and their logits put side by side: :class:`TensorParallelGroup`,
    or on one machine's CPU :class:`~boundless.model.shared_memory_sum.SharedMemorySum`."""

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """``tensor`` becomes the sum of every rank's, in place."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` [rows, columns] side by side in rank order: [rows, ranks x columns]."""
        ...


class TensorParallelGroup:
    """The ranks' sum through a torch.distributed process group of their own over ``store`` (not torch's default
    group: a process may hold others): NCCL on CUDA, gloo on the CPU. ``timeout_s`` bounds joining it and each sum: a
    rank that never comes is an error, not a hang."""

    def __init__(self, store: dist.Store, tp: TensorParallel, device: torch.device, timeout_s: float) -> None:
        self.tp = tp
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            # (NCCL binds its communicator to the current device; ``cuda`` alone names the current one.)
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = cast(_Collective, dist.ProcessGroupNCCL(store, tp.rank, tp.size, options))
        else:
            self._group = cast(_Collective, dist.ProcessGroupGloo(store, tp.rank, tp.size, timeout))

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """``tensor`` becomes the sum of every rank's, in place."""
        self._group.allreduce([tensor]).wait()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` side by side along its last dimension, in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.tp.size)]
        self._group.allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def abort(self) -> None:
        """Fail the sums in flight (NCCL: a rank is gone and they would wait for it)."""
        abort = getattr(self._group, "abort", None)
        if abort is not None:
            abort()
