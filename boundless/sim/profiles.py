"""Hardware profiles: what a step, a host copy and a disk read cost on one kind of machine.

A profile is a JSON file (``boundless/sim/profiles/<name>.json``, or any path) with a step model and
the links an instance uses, and the source of every number in it. Two kinds of step model:

- ``fitted``: a per-term model of this engine's CPU steps (:class:`~boundless.sim.step_model.StepTimeModel`:
  a base, per request, per matmul row on the slowest of ``threads``, per 4-row group of the matmul
  micro-kernel, per cached token read, per query-key pair), fitted by ``boundless simulate calibrate`` from the
  real engine's steps on this machine (Vidur and DistServe fit their step times term by term the same way).
  Profiles fitted before the matmul terms hold the engine's own ``AttentionTimeModel`` (``per_token_s``) and
  load as that model on one thread;
- ``roofline``: a GPU's published peak bf16 FLOP/s and HBM bandwidth, and a stated model shape: a step
  takes the longer of its FLOPs at the peak and its bytes (weights, KV read and written) at the
  bandwidth, each scaled by an efficiency, plus a fixed per-step overhead.

Links (``host_copy``, ``storage_read``, ``storage_write``, ``network``, and optionally ``gpu_interconnect``) are a
bandwidth and a latency each.

A model split over N GPUs of a node (``--tensor-parallel-size N``, :func:`with_tensor_parallel`) is priced on a
roofline profile: each GPU does 1/N of the FLOPs and reads 1/N of the weights and of the KV (its heads), then the GPUs
sum their partial products twice a layer, a ring all-reduce over ``gpu_interconnect``; each GPU moves its share of
every KV block over links of its own (its PCIe lanes, its NIC), so an instance's links carry N times one GPU's.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from pathlib import Path
from typing import Any

import torch

from boundless.engine.attention_time import ChunkShape, shapes_of
from boundless.engine.multi_step import PassRow
from boundless.engine.scheduler import SchedulerOutput
from boundless.kv.cache_dtype import kv_cache_dtype as kv_cache_dtype_named
from boundless.sim.cost import StepCost
from boundless.sim.executor import DiskCost
from boundless.sim.links import LinkSpec
from boundless.sim.step_model import TERMS, StepTimeModel

# (The package's directory, not this file's: compiled, the module is loaded from a build elsewhere.)
PROFILE_DIR = Path(str(importlib.resources.files("boundless.sim"))) / "profiles"


@dataclass(frozen=True)
class FittedStepCost:
    """A step's seconds from a fitted per-term model, over the step's chunk shapes."""

    model: StepTimeModel

    def step_time(self, sched: SchedulerOutput, contention: float = 0.0) -> float:
        """The step's seconds, with the requests that left the engine at the step before (the field the real engine
        records with each step: ``EngineCore.finish_step``)."""
        return self.model.predict(shapes_of(sched), contention, sched.departures)

    def predict(self, shapes: Sequence[ChunkShape], contention: float = 0.0) -> float:
        return self.model.predict(shapes, contention)

    @property
    def contended(self) -> bool:
        """Whether the other engines' steps beside one slow it (the simulator then tells each step how many)."""
        return self.model.per_contention_s > 0


@dataclass(frozen=True)
class ModelShape:
    """The model a roofline profile describes (dense, grouped-query attention)."""

    name: str
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # bf16
    # What the KV cache holds an element of K or V in (--kv-cache-dtype: 1 in fp8); None: the weights' type's bytes.
    kv_bytes_per_element: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        element = self.bytes_per_param if self.kv_bytes_per_element is None else self.kv_bytes_per_element
        return 2 * self.layers * self.kv_heads * self.head_dim * element  # K and V


_num_passes = itemgetter(2)  # a PassRow's


@dataclass(frozen=True)
class RooflineStepCost:
    """A step on a GPU: ``overhead + max(FLOPs / (peak * compute_eff), bytes / (bandwidth * memory_eff))``.

    FLOPs are ``2 * params`` per new token (the projections and MLPs) plus ``4 * layers * q_heads *
    head_dim`` per query-key pair (scores and the weighted sum); bytes are the weights once per step plus
    the KV of every cached token read and every new token written.
    """

    shape: ModelShape
    peak_flops: float
    hbm_bytes_per_s: float
    compute_efficiency: float
    memory_efficiency: float
    step_overhead_s: float
    # The model split over this many GPUs (``with_tensor_parallel``), which sum over ``all_reduce`` (their
    # interconnect): a pass is one GPU's share of it, plus ``2 * layers`` all-reduces of its new tokens' hidden states.
    tensor_parallel: int = 1
    all_reduce: LinkSpec | None = None

    def step_time(self, sched: SchedulerOutput) -> float:
        return self.predict(shapes_of(sched))

    def predict(self, shapes: Sequence[ChunkShape]) -> float:
        if not shapes:
            return 0.0
        return self.predict_passes([(c.cached, c.new, 1) for c in shapes], 0, 1)[0]  # a window of one pass

    def predict_passes(self, rows: Sequence[PassRow], first: int, end: int) -> list[float]:
        """Seconds of passes ``first`` to ``end - 1`` of a multi-step window of ``rows``
        (``multi_step.WindowPasses.rows``), summed from the rows without making each pass's shapes (pass ``j``'s: each
        row with more than ``j`` passes, ``j`` positions on). :meth:`predict` is a window of one pass."""
        per_token, per_pair, weight_bytes, kv_bytes, flop_rate, byte_rate, sum_s, sum_per_token_s = self._factors
        overhead = self.step_overhead_s
        # Pass j's sums (pairs as ChunkShape's) over the rows with more than j passes, in integers (so exactly those
        # summed row by row): kept as running sums, a row's terms dropped at the pass it ends, and j's terms added.
        # A window's rows are summed once, not once a pass (32 passes a window in the simulator).
        by_end = sorted(rows, key=_num_passes)
        tokens = starts = pairs0 = 0  # pairs0: the pairs at j = 0
        for start, new, _ in by_end:
            tokens += new
            starts += start
            pairs0 += new * start + new * (new + 1) // 2
        rows_left = len(by_end)
        seconds = []
        k = 0  # by_end[:k] have ended
        for j in range(first, end):
            while k < len(by_end) and by_end[k][2] <= j:
                start, new, _ = by_end[k]
                tokens -= new
                starts -= start
                rows_left -= 1
                pairs0 -= new * start + new * (new + 1) // 2
                k += 1
            compute = (per_token * tokens + per_pair * (pairs0 + j * tokens)) / flop_rate
            memory = (weight_bytes + kv_bytes * (starts + j * rows_left + tokens)) / byte_rate
            sums = sum_s + sum_per_token_s * tokens  # (a split model's all-reduces, not overlapped; else 0)
            seconds.append(overhead + (compute if compute > memory else memory) + sums)
        return seconds

    @cached_property
    def _factors(self) -> tuple[float, float, float, float, float, float, float, float]:
        """The per-pass formula's constant factors (per new token, per query-key pair, the weights' bytes, the KV bytes
        per token, the two rates, and a split model's all-reduces: a pass's fixed seconds and seconds per new token),
        made once: the simulator prices every forward pass. A split model's are one GPU's share."""
        s, n = self.shape, self.tensor_parallel
        # Each GPU holds its key/value heads; where they are fewer than the GPUs, one each (replicated, as vLLM does).
        kv_share = max(s.kv_heads // n, 1) / s.kv_heads
        sum_s = sum_per_token_s = 0.0
        if n > 1:
            assert self.all_reduce is not None, "a split model sums over its GPUs' interconnect"
            sums = 2 * s.layers  # after attention's o and the MLP's down, in every layer
            # A ring all-reduce sends and receives 2 (n - 1) / n of the tensor (bf16 hidden states) through each GPU.
            hidden_bytes = s.q_heads * s.head_dim * s.bytes_per_param
            sum_s = sums * self.all_reduce.latency_s
            sum_per_token_s = sums * 2 * (n - 1) / n * hidden_bytes / self.all_reduce.bytes_per_s
        return (
            2 * s.params / n,
            4 * s.layers * s.q_heads * s.head_dim / n,
            s.params * s.bytes_per_param / n,
            s.kv_bytes_per_token * kv_share,
            self.peak_flops * self.compute_efficiency,
            self.hbm_bytes_per_s * self.memory_efficiency,
            sum_s,
            sum_per_token_s,
        )


@dataclass(frozen=True)
class HardwareProfile:
    """A machine as the simulator sees it: its step model, its links, and where each number comes from."""

    name: str
    description: str
    step: StepCost
    host_copy: LinkSpec
    storage_read: LinkSpec
    storage_write: LinkSpec
    network: LinkSpec
    sources: dict[str, str] = field(default_factory=dict)
    gpu_interconnect: LinkSpec | None = None  # between the GPUs of a node (NVLink): a split model's all-reduces

    @property
    def disk_cost(self) -> DiskCost:
        """The disk store's cost (one latency for reads and writes: the read link's)."""
        return DiskCost(self.storage_read.bytes_per_s, self.storage_write.bytes_per_s, self.storage_read.latency_s)


LINK_NAMES = ("host_copy", "storage_read", "storage_write", "network")


def with_kv_cache_dtype(profile: HardwareProfile, kv_cache_dtype: str) -> HardwareProfile:
    """``profile`` serving its model with the KV cache in ``--kv-cache-dtype kv_cache_dtype``: a roofline step model's
    KV bytes per token (the KV a step reads and writes, and the blocks the tiers, the store and the network move) in
    that type. ``auto`` (the model's own type) and a profile without a model shape (a fitted step model, whose KV bytes
    are the simulated model's pools') are returned as they are."""
    step = profile.step
    if kv_cache_dtype == "auto" or not isinstance(step, RooflineStepCost):
        return profile
    element = kv_cache_dtype_named(kv_cache_dtype, torch.bfloat16).itemsize  # (not auto: the model's type is unused)
    shape = dataclasses.replace(step.shape, kv_bytes_per_element=element)
    return dataclasses.replace(profile, step=dataclasses.replace(step, shape=shape))


def with_tensor_parallel(profile: HardwareProfile, size: int) -> HardwareProfile:
    """``profile`` serving its model split over ``size`` GPUs of a node (``--tensor-parallel-size``; see the module's
    docstring). ValueError for a profile that cannot price it: a fitted one (one device's steps), one without a
    ``gpu_interconnect`` link, or a model whose heads do not split over ``size`` GPUs."""
    if size == 1:
        return profile
    step = profile.step
    if not isinstance(step, RooflineStepCost):
        raise ValueError(
            f"profile {profile.name!r} is fitted to one device's steps; a model split over GPUs is priced on a "
            "roofline profile (a100-80gb, h100, h200)"
        )
    if profile.gpu_interconnect is None:
        raise ValueError(f"profile {profile.name!r} has no links.gpu_interconnect to price the GPUs' all-reduces over")
    shape = step.shape
    if shape.q_heads % size or not (shape.kv_heads % size == 0 or size % shape.kv_heads == 0):
        raise ValueError(
            f"{shape.name}'s {shape.q_heads} attention heads and {shape.kv_heads} key/value heads do not split over "
            f"{size} GPUs"
        )
    # Each GPU moves its share of every block over its own links: 1/N of it, or one key/value head of it where they are
    # fewer than the GPUs (the GPUs holding the same head each move it).
    parallel = min(size, shape.kv_heads)  # (kv_links of the split profile)
    links = {
        name: dataclasses.replace(link, bytes_per_s=link.bytes_per_s * parallel)
        for name in LINK_NAMES
        if (link := getattr(profile, name)) is not None
    }
    split = dataclasses.replace(step, tensor_parallel=size, all_reduce=profile.gpu_interconnect)
    return dataclasses.replace(profile, step=split, **links)


def kv_links(profile: HardwareProfile | None) -> int:
    """How many links an instance's KV crosses at once: each GPU of a split instance moves its share over its own
    (``with_tensor_parallel``); one, unsplit. A link the flags set (``--net-gbps``, ``--storage-gbps``) is one GPU's,
    as ``serve`` gives each rank its own at that rate."""
    step = profile.step if profile is not None else None
    if not isinstance(step, RooflineStepCost) or step.tensor_parallel <= 1:
        return 1
    return min(step.tensor_parallel, step.shape.kv_heads)


def profile_names() -> list[str]:
    """The profiles shipped with the package."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def profile_data(name_or_path: str) -> dict[str, Any]:
    """A profile's JSON: a shipped profile by name (``cpu``, ``a100-80gb``, ``h100``, ``h200``) or a profile file by
    path (ValueError without either)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise ValueError(f"no profile {name_or_path!r}: a path, or one of {', '.join(profile_names())}")
    return json.loads(path.read_text())


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name or a profile file by path (:func:`profile_data`)."""
    return profile_from_dict(profile_data(name_or_path))


def profile_from_flag(flag: str, name_or_path: str) -> HardwareProfile:
    """:func:`load_profile` for a command's flag: no such profile, or a file that is not one, exits with the flag's
    one line (SystemExit), not a traceback."""
    try:
        return load_profile(name_or_path)
    except (ValueError, OSError) as e:  # (a file that is not a profile: JSON's error is a ValueError)
        raise SystemExit(f"{flag}: {e}") from None


def profile_from_dict(data: dict[str, Any]) -> HardwareProfile:
    step = data["step"]
    kind = step["kind"]
    if kind == "fitted":
        cost: StepCost = FittedStepCost(StepTimeModel.from_json(step["coefficients"], step.get("threads", 1)))
    elif kind == "roofline":
        cost = RooflineStepCost(
            shape=ModelShape(**step["model"]),
            peak_flops=step["peak_bf16_tflops"] * 1e12,
            hbm_bytes_per_s=step["hbm_tbytes_per_s"] * 1e12,
            compute_efficiency=step["compute_efficiency"],
            memory_efficiency=step["memory_efficiency"],
            step_overhead_s=step["step_overhead_s"],
        )
    else:
        raise ValueError(f"profile {data.get('name')!r}: unknown step kind {kind!r} (fitted or roofline)")
    links = {
        name: LinkSpec(data["links"][name]["gbytes_per_s"] * 1e9, data["links"][name].get("latency_s", 0.0))
        for name in LINK_NAMES
    }
    interconnect = data["links"].get("gpu_interconnect")
    return HardwareProfile(
        data["name"], data.get("description", ""), cost, sources=data.get("sources", {}),
        gpu_interconnect=None if interconnect is None else LinkSpec(
            interconnect["gbytes_per_s"] * 1e9, interconnect.get("latency_s", 0.0)
        ),
        **links,
    )  # fmt: skip


def fitted_profile_dict(
    name: str, description: str, model: StepTimeModel, links: dict[str, LinkSpec], sources: dict[str, str]
) -> dict[str, Any]:
    """A ``fitted`` profile as JSON data (what ``calibrate`` writes)."""
    coefficients = {t: getattr(model, t) for t in TERMS}
    return {
        "name": name,
        "description": description,
        "step": {"kind": "fitted", "threads": model.threads, "coefficients": coefficients},
        "links": {k: {"gbytes_per_s": v.bytes_per_s / 1e9, "latency_s": v.latency_s} for k, v in links.items()},
        "sources": sources,
    }
