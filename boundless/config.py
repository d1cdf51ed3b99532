"""Typed configuration, one dataclass per layer, each field one command-line flag.

Validation happens when a config is built, so bad values fail at start-up with a message that
names the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

from boundless.api.reasoning import REASONING_PARSERS
from boundless.api.tool_calls import TOOL_CALL_PARSERS
from boundless.engine.sampling_params import MAX_LOGPROBS
from boundless.kv.cache_dtype import KV_CACHE_DTYPES
from boundless.model.generation_config import generation_overrides
from boundless.model.lora import LoRAError, LoRAModule
from boundless.programs.registry import POLICIES


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag."""


def _require(ok: bool, flag: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"--{flag.replace('_', '-')}: {message}")


# The largest memory or store size a flag takes, in GiB (a PiB): past it, no machine; far past it, bytes that overflow.
MAX_GIB = float(1 << 20)


def _require_finite(config: object) -> None:
    """Every number of ``config`` (a config dataclass) finite: float flags take ``inf`` and ``nan`` as argparse reads
    them, and an infinite size or timeout passed each flag's own bounds to fail later, deep inside (``--kv-cache-gb
    inf`` in the pool's sizing, ``--max-body-mb inf`` in the server's limit: OverflowError tracebacks)."""
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if isinstance(value, float):
            _require(math.isfinite(value), f.name, f"must be a finite number, not {value}")


def _flags_given(config: object, names: Sequence[str]) -> list[str]:
    """Those of ``config``'s fields ``names`` (a config dataclass's) that are away from their defaults, as
    ``--flag``s: what start-up names as ignored where they do not act."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    return [f"--{name.replace('_', '-')}" for name in names if getattr(config, name) != defaults[name]]


def _json_object(flag: str, text: str) -> dict[str, Any]:
    """A flag's JSON object (``--speculative-config``'s, say); anything else raises :class:`ConfigError`."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--{flag.replace('_', '-')}: not JSON ({e})") from None
    _require(isinstance(value, dict), flag, "must be a JSON object")
    return value


def json_strings(flag: str, text: str) -> list[str]:
    """A flag's JSON list of strings (``--allowed-origins``'s, say); anything else raises :class:`ConfigError`."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--{flag.replace('_', '-')}: not JSON ({e}); give a list such as '[\"*\"]'") from None
    _require(
        isinstance(value, list) and all(isinstance(v, str) for v in value),
        flag,
        "must be a JSON list of strings, such as '[\"*\"]'",
    )
    return value


ANY_JSON = '["*"]'  # (CORS's defaults, vLLM's: any origin, method and header)
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flex")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's
KV_WRITE_POLICIES = ("through", "back", "off")
KV_EVICTIONS = ("lru", "program")
QUANTIZATIONS = ("fp8",)  # --quantization: what is applied at load (boundless.model.fp8_linear)


@dataclass(frozen=True)
class ModelConfig:
    model: str = field(default="smollm2-135m", metadata={"help": "model name, Hugging Face directory or GGUF file"})
    dtype: str = field(
        default="float32",
        metadata={
            "help": "float32, bfloat16, float16, or vLLM's names: half (float16), float (float32), auto (float32 on "
            "the CPU; on a GPU the checkpoint's 16-bit type, float16 for a 32-bit one, as vLLM's)"
        },
    )
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N"})
    quantization: str | None = field(
        default=None,
        metadata={
            "help": "fp8: the layers' matrices held in e4m3 with a scale per row, their products in FP8 with each "
            "token's activations quantized as it runs (vLLM's online FP8; half a 16-bit model's weight bytes; on "
            "CUDA sm_89 or later in bfloat16; on the CPU for checking only: the matrices are also held widened for "
            "its kernels, more memory, not less). A checkpoint quantized already loads as it says without it (FP8, "
            "GPTQ and AWQ ones dequantized, GGUF files)"
        },
    )
    max_model_len: int | None = field(
        default=None,
        metadata={
            "help": "context length; it must fit in the KV pool (default: the model's, capped by the pool). As vLLM's: "
            "32k is 32,000 tokens, 32K 32,768, and auto or -1 the default",
            "type": lambda text: context_length(text),
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of the generator shared by requests that set no seed"})
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "devices one model is split across (Megatron's tensor parallelism, as vLLM's): each holds 1/N of "
            "every layer's matrices and of the KV cache, the ranks summing their products after each half-layer. "
            "On CUDA ranks take the devices from --device on (cuda:0, cuda:1, ...); on the CPU they are processes "
            "sharing its cores (for checking). Heads, key/value heads and MLP features must split evenly",
            "aliases": ("-tp",),
        },
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "auto (triton on CUDA where Triton is installed, else torch), torch (PyTorch, and native kernels "
            "on the CPU), triton (paged-attention kernels for CUDA, with CUDA graphs for decode steps; on the CPU "
            "only under TRITON_INTERPRET=1) or flex (PyTorch's FlexAttention: compiled on CUDA, with CUDA graphs for "
            "decode steps; its eager reference on the CPU, slow)"
        },
    )
    enforce_eager: bool = field(
        default=False, metadata={"help": "run every step eagerly: no CUDA graphs for decode steps"}
    )
    flash_prefill: bool = field(
        default=False,
        metadata={
            "help": "with the triton backend on CUDA, in bf16 or fp16: a step's prefill chunks attend in one call "
            "of FlashAttention's variable-length kernel (PyTorch's), a chunk over a cached prefix over its context "
            "gathered from the cache; decodes stay on the Triton kernels. Not yet run on a GPU"
        },
    )
    enable_lora: bool = field(
        default=False, metadata={"help": "serve LoRA adapters (PEFT checkpoints) beside the model"}
    )
    lora_modules: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "LoRA adapters to load at start-up, each name=path (or vLLM's JSON, "
            '\'{"name": "sql", "path": "/adapters/sql"}\'); requests name one as their model'
        },
    )
    max_loras: int = field(default=1, metadata={"help": "most LoRA adapters in one step"})
    max_lora_rank: int = field(default=16, metadata={"help": "largest LoRA rank accepted"})
    allow_long_max_model_len: bool = field(
        default=False,
        metadata={
            "help": "accept a --max-model-len past the model's context (its positions, or YaRN's derived length), as "
            "vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 does: the model was not trained there"
        },
    )
    max_logprobs: int = field(
        default=MAX_LOGPROBS,
        metadata={
            "help": "the most alternatives per token a request may ask for (logprobs, top_logprobs, prompt_logprobs; "
            "vLLM's flag): past it a 400; -1 the whole vocabulary"
        },
    )
    hf_overrides: str = field(
        default="",
        metadata={
            "help": "a JSON object whose keys replace those of the model directory's config.json (vLLM's), e.g. "
            '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\' '
            "for Qwen's long contexts"
        },
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if isinstance(self.max_model_len, str) or self.max_model_len == -1:  # (vLLM's forms, as the flag reads them)
            try:
                object.__setattr__(self, "max_model_len", context_length(str(self.max_model_len)))
            except argparse.ArgumentTypeError as e:
                raise ConfigError(f"--max-model-len: {e}") from None
        _require(self.max_logprobs >= -1, "max_logprobs", "must be -1 (the whole vocabulary) or more")
        _require(self.dtype in DTYPE_NAMES, "dtype", f"unknown dtype {self.dtype!r}; one of {', '.join(DTYPE_NAMES)}")
        _require(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            "quantization",
            f"{self.quantization!r} is not applied here; fp8 is (a checkpoint quantized otherwise loads as its config "
            "says: FP8 ones dequantized, GGUF files)",
        )
        _ = self.overrides  # (a bad one fails here, naming the flag)
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"unknown backend {self.attention_backend!r}; one of {', '.join(ATTENTION_BACKENDS)}",
        )
        _require(
            re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
            "device",
            f"unknown device {self.device!r}; cpu, cuda or cuda:N",
        )
        _require(-(2**63) <= self.seed < 2**63, "seed", "must be a signed 64-bit integer")
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len", "must be positive")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _require(self.max_loras >= 1, "max_loras", "must be >= 1")
        _require(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        _require(self.enable_lora or not self.lora_modules, "lora_modules", "needs --enable-lora")
        names = [m.name for m in self.loras]
        _require(len(set(names)) == len(names), "lora_modules", f"adapter names repeat: {names}")

    @property
    def loras(self) -> tuple[LoRAModule, ...]:
        """``--lora-modules``, parsed."""
        try:
            return tuple(LoRAModule.parse(text) for text in self.lora_modules)
        except LoRAError as e:
            raise ConfigError(str(e)) from None

    @property
    def overrides(self) -> dict[str, Any]:
        """``hf_overrides`` read: the keys to replace in ``config.json``."""
        if not self.hf_overrides:
            return {}
        return _json_object("hf_overrides", self.hf_overrides)


KV_EVENT_PUBLISHERS = ("zmq", "null")
KV_EVENT_FORMATS = ("map", "array")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events for KV-aware routers, as vLLM's ``--kv-events-config`` JSON names them (``kv/events.py``,
    ``kv/event_publisher.py``): with ``enable_kv_cache_events`` and the ``zmq`` publisher, each step's stored and
    removed blocks go out on a ZMQ PUB socket at ``endpoint`` (bound when it has ``*``, ``::``, ``ipc://`` or
    ``inproc://``, else connected), under ``topic``; ``replay_endpoint`` (a ROUTER socket) resends the last
    ``buffer_steps`` batches from a sequence number; ``hwm`` is the PUB socket's high-water mark and
    ``max_queue_size`` the batches waiting for the publisher thread (beyond it a batch is dropped, not waited for).
    ``event_format`` (ours): ``map``, each event a tagged map as vLLM sends them since its PR 42892, and replayed
    batches with their topic (its PR 45177, 0.26 on), or ``array``, the tagged arrays and topic-less replays of vLLM
    0.23 and before."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_format: str = "map"

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From the flag's JSON object; a bad one raises :class:`ConfigError` naming the key."""
        spec = _json_object("kv_events_config", text)
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - set(known))
        _require(not unknown, "kv_events_config", f"unknown keys {unknown}; known: {sorted(known)}")
        hints = typing.get_type_hints(cls)
        for key, value in spec.items():
            want = _base_type(hints[key])
            ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
            _require(
                ok or (value is None and known[key].default is None),
                "kv_events_config",
                f"{key} must be {want.__name__}, not {value!r}",
            )
        config = cls(**spec)
        _require(config.publisher in KV_EVENT_PUBLISHERS, "kv_events_config", "publisher must be zmq or null")
        _require(config.event_format in KV_EVENT_FORMATS, "kv_events_config", "event_format must be map or array")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            _require(getattr(config, key) > 0, "kv_events_config", f"{key} must be positive")
        _require(config.endpoint.startswith(_ZMQ_SCHEMES), "kv_events_config", "endpoint must be tcp, ipc or inproc")
        _require(
            config.replay_endpoint is None or config.replay_endpoint.startswith(_ZMQ_SCHEMES),
            "kv_events_config",
            "replay_endpoint must be tcp, ipc or inproc",
        )
        return config


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_gb: float = field(default=2.0, metadata={"help": "memory for the KV block pool, in GiB"})
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "the type KV is stored in: auto (the model's), bfloat16, or fp8 (= fp8_e4m3) and fp8_e5m2, which "
            "hold twice a 16-bit model's tokens in the same memory (four times an fp32 one's), rounded to 8 bits "
            "with no scale (vLLM's flag)"
        },
    )
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "size of the KV pool in blocks (overrides --kv-cache-gb)"}
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata={
            "help": "on CUDA, instead of --kv-cache-gb: the KV pool takes this fraction of the GPU's memory less "
            "what is in use once the weights are loaded (theirs and any other process's); the rest of the memory is "
            "left to activations and CUDA graphs (vLLM's flag; sized as SGLang's --mem-fraction-static)"
        },
    )
    enable_prefix_caching: bool = field(default=True, metadata={"help": "share full KV blocks between requests"})
    kv_host_gb: float | None = field(
        default=None,
        metadata={
            "help": "host memory for KV, in GiB (default 1.0): the blocks of preempted requests, and full blocks "
            "evicted from the device, kept by name for later prefix hits (0: none; preempted requests are "
            "recomputed and evicted blocks are gone)"
        },
    )
    swap_space_gb: float | None = field(
        default=None,
        metadata={
            "help": "host memory for the KV of preempted requests only, in GiB: evicted blocks are not kept below "
            "the device (the device-only baseline, as before host memory was a tier); instead of --kv-host-gb"
        },
    )
    kv_disk_path: str | None = field(
        default=None,
        metadata={"help": "directory of the persistent KV store: full blocks below host memory, across restarts"},
    )
    kv_disk_gb: float = field(
        default=16.0,
        metadata={
            "help": "most disk space the KV store may take for this layout, in GiB (each model, block size and KV "
            "dtype keeps its blocks in a subdirectory of its own, under a bound of its own)"
        },
    )
    kv_load_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds a request waits for its KV blocks from the disk store before it is admitted without "
            "them and computes them (stuck storage); no new load starts while a timed-out one is in flight"
        },
    )
    layerwise_load: str = field(
        default="off",
        metadata={
            "help": "on: a load from a store behind an emulated storage link (--storage-gbps) is usable layer by "
            "layer as the link carries it, and its request's prefill runs meanwhile, each layer waiting for its "
            "own KV only (a lone request's first token sooner; a batch waits at the layers with it); under "
            "--kv-path dualpath a prefill engine likewise prefills as a decode engine's push lands (set it alike on "
            "every engine); off: the request waits until every byte of its load has arrived, the rest of the batch "
            "running meanwhile"
        },
    )
    kv_write_policy: str = field(
        default="through",
        metadata={
            "help": "when full blocks go to the disk store: through (once computed, from a background writer "
            "that drops writes rather than slow a step), back (when they leave host memory, and all in memory at a "
            "stop) or off (read only)"
        },
    )
    kv_events_config: str | None = field(
        default=None,
        metadata={
            "help": "KV cache events for KV-aware routers, as vLLM's JSON: '{\"enable_kv_cache_events\": true, "
            '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\' publishes each '
            "step's stored and removed blocks in vLLM's wire form on a ZMQ PUB socket (with --instances, instance i "
            "on the port plus i); keys publisher (zmq or null), buffer_steps, hwm, max_queue_size, event_format (map "
            "or array) as well"
        },
    )
    kv_eviction: str = field(
        default="lru",
        metadata={
            "help": "which cached KV blocks each tier gives up first: lru (least recently used) or program (those "
            "of finished or idle-past-TTL programs, then of the lowest-priority programs, before hot programs'; "
            "LRU among equals)"
        },
    )

    @property
    def host_gb(self) -> float:
        """Host memory for KV: --kv-host-gb, or --swap-space-gb, else 1 GiB."""
        if self.kv_host_gb is not None:
            return self.kv_host_gb
        return self.swap_space_gb if self.swap_space_gb is not None else 1.0

    @property
    def kv_events(self) -> KVEventsConfig | None:
        return KVEventsConfig.parse(self.kv_events_config) if self.kv_events_config is not None else None

    @property
    def host_caches(self) -> bool:
        """Whether host memory keeps named blocks evicted from the device (not with --swap-space-gb)."""
        return self.swap_space_gb is None

    def ignored_store_flags(self) -> list[str]:
        """The flags given that act on the disk store only, as ``--flag``s, without ``--kv-disk-path`` (start-up says
        so, as of the cluster's flags: ``ClusterConfig.ignored_role_flags``)."""
        return [] if self.kv_disk_path is not None else _flags_given(self, STORE_FLAGS)

    def __post_init__(self) -> None:
        _require_finite(self)
        _require(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, "block_size", "must be a power of two"
        )
        _require(self.kv_cache_gb > 0, "kv_cache_gb", "must be positive")
        for name in ("kv_cache_gb", "kv_host_gb", "swap_space_gb", "kv_disk_gb"):  # (1e308 GiB overflowed in bytes)
            size = getattr(self, name)
            _require(size is None or size <= MAX_GIB, name, f"{size} GiB is more than any machine holds")
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"unknown KV cache dtype {self.kv_cache_dtype!r}; one of {', '.join(KV_CACHE_DTYPES)}",
        )
        _require(self.num_kv_blocks is None or self.num_kv_blocks > 0, "num_kv_blocks", "must be positive")
        _require(
            self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            "must be in (0, 1]",
        )
        _require(self.kv_host_gb is None or self.kv_host_gb >= 0, "kv_host_gb", "must not be negative")
        _require(self.swap_space_gb is None or self.swap_space_gb >= 0, "swap_space_gb", "must not be negative")
        _require(
            self.kv_host_gb is None or self.swap_space_gb is None,
            "swap_space_gb",
            "host memory for swap only, or --kv-host-gb for swap and caching: give one of them",
        )
        _require(self.kv_disk_gb > 0, "kv_disk_gb", "must be positive")
        _require(self.kv_load_timeout_s > 0, "kv_load_timeout_s", "must be positive")
        _ = self.kv_events  # a bad --kv-events-config fails here
        _require(self.layerwise_load in ("on", "off"), "layerwise_load", "must be on or off")
        _require(
            self.kv_eviction in KV_EVICTIONS,
            "kv_eviction",
            f"unknown eviction order {self.kv_eviction!r}; one of {', '.join(KV_EVICTIONS)}",
        )
        _require(
            self.kv_write_policy in KV_WRITE_POLICIES,
            "kv_write_policy",
            f"unknown policy {self.kv_write_policy!r}; one of {', '.join(KV_WRITE_POLICIES)}",
        )
        if self.kv_disk_path is not None:
            _require(bool(self.kv_disk_path), "kv_disk_path", "must name a directory")
            _require(self.enable_prefix_caching, "kv_disk_path", "needs prefix caching: the store keeps blocks by name")
            _require(
                self.host_gb > 0 and self.host_caches,
                "kv_disk_path",
                "needs host memory that caches (--kv-host-gb > 0, not --swap-space-gb): disk blocks load into it",
            )


# CacheConfig's fields that act on the disk store only (CacheConfig.ignored_store_flags).
STORE_FLAGS = ("kv_disk_gb", "kv_load_timeout_s", "kv_write_policy")

SPECULATIVE_METHODS = ("ngram", "suffix")
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
_SUFFIX_KEYS = (
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's ``--speculative-config`` JSON names it (``engine/speculative.py``).

    ``ngram`` (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's last ``n``
    tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``), up to ``num_speculative_tokens``.
    vLLM's defaults: one of the lookup bounds given alone sets the other, neither sets both to 5.

    ``suffix`` (suffix decoding, Arctic Inference's, vLLM's ``method: suffix``): the likeliest continuation of the
    sequence's end among the request's own tokens and the outputs of the last ``suffix_decoding_max_cached_requests``
    requests (0: the request's own only), over matches of up to ``suffix_decoding_max_tree_depth`` tokens; a match
    of ``m`` tokens proposes at most ``m * suffix_decoding_max_spec_factor`` tokens, each while its estimated
    probability stays at least ``suffix_decoding_min_token_prob``. vLLM's defaults (24, 10,000, 1.0, 0.1), and
    ``num_speculative_tokens`` defaults to the tree depth.

    ``disable_by_batch_size`` (vLLM's key): a step that chose more requests than this proposes nothing (a large
    batch is compute-bound, where drafts cost about what they save). ``num_speculative_tokens_per_batch_size``
    (vLLM's dynamic speculative decoding): ``[[start, end, k], ...]``, inclusive ranges of a step's number of
    requests from 1, sorted and apart, each with its most drafts a request (0: none; a gap and the sizes past the last
    range take the range before; never above ``num_speculative_tokens``)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON object; a bad one raises :class:`ConfigError` naming the key."""
        spec = _json_object("speculative_config", text)
        known = {
            "method",
            "num_speculative_tokens",
            "disable_by_batch_size",
            "num_speculative_tokens_per_batch_size",
            *_NGRAM_KEYS,
            *_SUFFIX_KEYS,
        }
        unknown = sorted(set(spec) - known)
        _require(not unknown, "speculative_config", f"unknown keys {unknown}; known: {sorted(known)}")
        method = spec.get("method")
        _require(
            method in SPECULATIVE_METHODS,
            "speculative_config",
            f"method {method!r} is not one of {', '.join(SPECULATIVE_METHODS)} (draft models, EAGLE and MTP are not "
            "built)",
        )
        assert isinstance(method, str)  # (_require raised otherwise)
        other = sorted(set(spec) & set(_SUFFIX_KEYS if method == "ngram" else _NGRAM_KEYS))
        _require(not other, "speculative_config", f"{other} do not apply to method {method!r}")

        def integer(key: str, least: int, default: int | None = None) -> int | None:
            value = spec.get(key, default)
            _require(
                value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= least),
                "speculative_config",
                f"{key} must be an integer >= {least}, not {value!r}",
            )
            return value

        def number(key: str, default: float, most: float) -> float:
            value = spec.get(key, default)
            _require(
                isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= most,
                "speculative_config",
                f"{key} must be a number >= 0{'' if most == math.inf else f' and <= {most:g}'}, not {value!r}",
            )
            return float(value)

        num = integer("num_speculative_tokens", 1)
        batch = integer("disable_by_batch_size", 1)
        per_batch = _batch_size_schedule(spec.get("num_speculative_tokens_per_batch_size"))
        if method == "suffix":
            depth = integer("suffix_decoding_max_tree_depth", 1, cls.suffix_decoding_max_tree_depth)
            cached = integer("suffix_decoding_max_cached_requests", 0, cls.suffix_decoding_max_cached_requests)
            factor = number("suffix_decoding_max_spec_factor", cls.suffix_decoding_max_spec_factor, math.inf)
            prob = number("suffix_decoding_min_token_prob", cls.suffix_decoding_min_token_prob, 1.0)
            assert depth is not None and cached is not None  # (their defaults)
            return cls(
                method,
                num or depth,
                disable_by_batch_size=batch,
                num_speculative_tokens_per_batch_size=per_batch,
                suffix_decoding_max_tree_depth=depth,
                suffix_decoding_max_cached_requests=cached,
                suffix_decoding_max_spec_factor=factor,
                suffix_decoding_min_token_prob=prob,
            )
        lo, hi = integer("prompt_lookup_min", 1), integer("prompt_lookup_max", 1)
        _require(num is not None, "speculative_config", "num_speculative_tokens is required")
        assert num is not None  # (_require raised otherwise)
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = lo or hi, hi or lo
        assert lo is not None and hi is not None  # (the one given stands for both)
        _require(lo <= hi, "speculative_config", "prompt_lookup_min must not exceed prompt_lookup_max")
        return cls(method, num, lo, hi, batch, per_batch)

    def max_drafts(self, batch_size: int) -> int:
        """The most drafts a request may get in a step that chose ``batch_size`` requests (0: none)."""
        if self.disable_by_batch_size is not None and batch_size > self.disable_by_batch_size:
            return 0
        most = self.num_speculative_tokens
        for start, _, k in self.num_speculative_tokens_per_batch_size or ():
            if start > batch_size:
                break
            most = min(k, self.num_speculative_tokens)
        return most


def _batch_size_schedule(value: object) -> tuple[tuple[int, int, int], ...] | None:
    """vLLM's ``num_speculative_tokens_per_batch_size``, checked (ranges from 1, sorted, apart, k >= 0)."""
    if value is None:
        return None
    key = "num_speculative_tokens_per_batch_size"
    _require(
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(e, list) and len(e) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in e)
            for e in value
        ),
        "speculative_config",
        f"{key} must be a non-empty list of [range_start, range_end, num_speculative_tokens], not {value!r}",
    )
    assert isinstance(value, list)  # (_require raised otherwise)
    schedule = tuple((start, end, k) for start, end, k in value)
    previous_end = 0
    for start, end, k in schedule:
        _require(
            previous_end < start <= end and k >= 0,
            "speculative_config",
            f"{key}: [{start}, {end}, {k}] must start after the range before it, end no earlier than it starts and "
            "have a count >= 0",
        )
        previous_end = end
    _require(schedule[0][0] == 1, "speculative_config", f"{key}: the first range must start at 1")
    return schedule


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "token budget of one step"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests in one step"})
    num_scheduler_steps: int = field(
        default=1,
        metadata={
            "help": "multi-step decoding: a step of decodes only runs this many forward passes for the same batch, "
            "scheduled once (each request's slots allocated up front, tokens past its stop discarded); arrivals "
            "and finishes take effect at the window's end"
        },
    )
    async_scheduling: bool = field(
        default=False,
        metadata={
            "help": "on CUDA graphs: decide and queue the next decode step (or --num-scheduler-steps window) while "
            "this one runs on the GPU, its first tokens taken there (vLLM's --async-scheduling); a request that "
            "stops in a step has run one more, its tokens dropped, and an arrival waits for the step in flight"
        },
    )
    speculative_config: str | None = field(
        default=None,
        metadata={
            "help": 'speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' proposes the tokens that followed the latest '
            'earlier match of the sequence\'s last 4 to 2 tokens; \'{"method": "suffix"}\' (suffix decoding) the '
            "likeliest continuation among the request's tokens and the last 10,000 requests' outputs; either is "
            "verified in one forward pass (greedy output unchanged, sampled output of the same distribution; grammars "
            "and penalties apply to each position)"
        },
    )
    policy: str = field(
        default="atlas",
        metadata={"help": f"order of service: {', '.join(POLICIES)} (atlas equals plas for single threads)"},
    )
    num_queues: int = field(default=12, metadata={"help": "K, the number of priority queues (mlfq, plas, atlas)"})
    queue_base_s: float = field(default=0.1, metadata={"help": "upper bound of the top queue's service range, s"})
    queue_growth: float = field(default=2.0, metadata={"help": "each queue's range is this many times the last"})
    starvation_beta: float = field(
        default=10.0, metadata={"help": "promote a call to the top when wait/service >= this"}
    )
    program_ttl_s: float = field(default=600.0, metadata={"help": "forget programs idle this long"})
    queue_order: str = field(
        default="program",
        metadata={
            "help": "order within a queue (plas, atlas): call (by call arrival) or program (by the program's "
            "first arrival, so a program's calls follow one another and its prefix cache stays warm)"
        },
    )

    prefill_batching: str = field(
        default="tokens",
        metadata={
            "help": "what bounds a step's prefills: tokens (the step budget alone) or attention (also their "
            "predicted time, fitted from the engine's own steps, under the time of a full step of fresh tokens: "
            "DualPath's attention-time batching for prefill engines)"
        },
    )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config) if self.speculative_config is not None else None

    def __post_init__(self) -> None:
        _require_finite(self)
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be positive")
        _require(self.prefill_batching in ("tokens", "attention"), "prefill_batching", "must be tokens or attention")
        _require(self.max_num_seqs > 0, "max_num_seqs", "must be positive")
        _require(self.num_scheduler_steps >= 1, "num_scheduler_steps", "must be >= 1")
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)
            _require(
                self.num_scheduler_steps == 1,
                "speculative_config",
                "does not combine with --num-scheduler-steps above 1 (a window's passes have no drafts to verify)",
            )
        _require(self.policy in POLICIES, "policy", f"unknown policy {self.policy!r}; one of {', '.join(POLICIES)}")
        _require(self.num_queues >= 1, "num_queues", "must be >= 1")
        _require(self.queue_base_s > 0, "queue_base_s", "must be positive")
        _require(self.queue_growth > 1, "queue_growth", "must be > 1")
        _require(self.starvation_beta > 0, "starvation_beta", "must be positive")
        _require(self.program_ttl_s > 0, "program_ttl_s", "must be positive")
        _require(self.queue_order in ("call", "program"), "queue_order", "must be call or program")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8000, metadata={"help": "port to bind"})
    api_key: str | None = field(
        default=None,
        metadata={"help": "require this bearer token (default: $BOUNDLESS_API_KEY, else vLLM's $VLLM_API_KEY)"},
    )
    served_model_name: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "the names clients call the model by, any of them; /v1/models lists each, adapters name the "
            "first as their parent (default: --model; several as vLLM's)"
        },
    )
    max_waiting: int = field(default=512, metadata={"help": "waiting requests beyond which the server answers 429"})
    max_body_mb: float = field(default=8.0, metadata={"help": "largest request body, in MiB (else 413)"})
    max_stored_responses: int = field(
        default=1024, metadata={"help": "finished /v1/responses kept for previous_response_id and GET (oldest dropped)"}
    )
    allow_runtime_lora_updating: bool = field(
        default=False,
        metadata={
            "help": "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; with "
            "--enable-lora and one instance)"
        },
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata={
            "help": "deepseek_r1, qwen3 or glm45 (<think>...</think>), mistral ([THINK]...[/THINK]), openai_gptoss "
            "(gpt-oss's harmony messages: its analysis channel): return a reasoning model's thinking as the message's "
            "reasoning, apart from its content (vLLM's flag)"
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "the chat template of chat requests, instead of the model's (which a base model may lack): a Jinja "
            "file's path, or the template itself (vLLM's flag)"
        },
    )
    generation_config: str = field(
        default="auto",
        metadata={
            "help": "auto: a request's omitted sampling parameters (temperature, top_p, top_k, min_p, "
            "repetition_penalty, max_tokens) default to the model's generation_config.json, as vLLM's do; vllm: to "
            "the API's own defaults; a directory: to its generation_config.json's (vLLM's three forms)"
        },
    )
    override_generation_config: str | None = field(
        default=None,
        metadata={
            "help": "vLLM's: a JSON object of generation_config.json's sampling keys (temperature, top_p, top_k, "
            "min_p, repetition_penalty, max_new_tokens) that replace or add to what --generation-config gives, e.g. "
            "'{\"temperature\": 0.5}'"
        },
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata={
            "help": "read tool calls in this shape only (vLLM's names): hermes (JSON in <tool_call> tags), qwen3_coder "
            "or qwen3_xml (Qwen3-Coder's XML in them), llama3_json or llama4_json (bare JSON), pythonic or "
            "llama4_pythonic (a Python list of calls, Llama 3.2's and 4's), mistral ([TOOL_CALLS]), phi4_mini_json "
            "(functools[...]), granite (a JSON list after <|tool_call|>), deepseek_v3 or deepseek_v31, glm45 or glm47 "
            "(GLM-4.5's <tool_call>NAME blocks of <arg_key>/<arg_value> pairs), openai "
            "(gpt-oss's harmony calls to functions.NAME; its messages then read as --reasoning-parser openai_gptoss "
            "reads them); without it, all of them"
        },
    )
    strict_tool_calls: bool = field(
        default=False,
        metadata={
            "help": "hold every tool call to its tool's schema under tool_choice auto, as if each tool said strict: "
            "true (vLLM's VLLM_ENFORCE_STRICT_TOOL_CALLING); by default only the calls of tools that say so are held, "
            "where the call format is known (a tagged --tool-call-parser, or a chat template that writes <tool_call>)"
        },
    )
    exclude_tools_when_tool_choice_none: bool = field(
        default=False,
        metadata={
            "help": "leave a request's tools out of its prompt when its tool_choice is none (vLLM's flag); by default "
            "they stay, as vLLM keeps them: the prompt is then the same whether an agent's call lets the model use its "
            "tools or not, and its prefix is cached for both"
        },
    )
    enable_auto_tool_choice: bool = field(
        default=False,
        metadata={
            "help": "vLLM's flag, accepted so its command lines run: here tool calls are read whenever a request "
            "sends tools and tool_choice is not none"
        },
    )
    structured_outputs_in_reasoning: bool = field(
        default=False,
        metadata={
            "help": "with --reasoning-parser: hold the reasoning to a request's grammar too (vLLM's "
            "enable_in_reasoning); by default the grammar begins once the model has finished thinking"
        },
    )

    return_tokens_as_token_ids: bool = field(
        default=False,
        metadata={
            "help": "logprobs name their tokens token_id:<id> (a token's text may be no whole character) unless a "
            "request says otherwise (vLLM's flag)"
        },
    )

    # The log, and how uvicorn serves (vLLM's flags, under its names).
    disable_log_stats: bool = field(
        default=False,
        metadata={
            "help": "no periodic stats line in the log (vLLM's flag); by default every 10 s each instance's prompt "
            "and generation throughput, running and waiting requests, KV cache usage and prefix cache hit rate, at "
            "INFO while it has work"
        },
    )
    enable_log_requests: bool = field(
        default=False,
        metadata={
            "help": "log each request as it is taken: its id, prompt, token ids and sampling parameters (vLLM's flag; "
            "--max-log-len shortens them)"
        },
    )
    disable_log_requests: bool = field(
        default=False,
        metadata={"help": "vLLM's older flag, accepted so its command lines run: requests are logged only with "
                  "--enable-log-requests"},
    )  # fmt: skip
    max_log_len: int | None = field(
        default=None,
        metadata={"help": "with --enable-log-requests: the most prompt characters and token ids a line shows"},
    )
    uvicorn_log_level: str = field(
        default="info", metadata={"help": f"uvicorn's log level: {', '.join(UVICORN_LOG_LEVELS)} (vLLM's flag)"}
    )
    root_path: str = field(
        default="",
        metadata={"help": "the path prefix a proxy serves the API under, e.g. /llm (ASGI's root_path, vLLM's flag)"},
    )
    ssl_keyfile: str | None = field(
        default=None, metadata={"help": "serve HTTPS with this private key file (PEM), with --ssl-certfile"}
    )
    ssl_certfile: str | None = field(
        default=None,
        metadata={"help": "serve HTTPS with this certificate file (PEM), with --ssl-keyfile or holding the key too"},
    )

    # Cross-origin requests (CORS: boundless/api/cors.py), so that a page in a browser may call the API.
    allowed_origins: str = field(
        default=ANY_JSON,
        metadata={"help": "origins a browser may call the API from, a JSON list (vLLM's): '[\"https://a.example\"]'"},
    )
    allow_credentials: bool = field(
        default=False,
        metadata={
            "help": "let cross-origin requests carry cookies and authorization (vLLM's flag; also under the name "
            "it had here before, --allowed-credentials)",
            "aliases": ("--allowed-credentials",),
        },
    )
    allowed_methods: str = field(
        default=ANY_JSON, metadata={"help": "HTTP methods cross-origin requests may use, a JSON list (vLLM's flag)"}
    )
    allowed_headers: str = field(
        default=ANY_JSON, metadata={"help": "headers cross-origin requests may send, a JSON list (vLLM's flag)"}
    )

    @property
    def generation_overrides(self) -> dict[str, Any]:
        """``--override-generation-config`` read and checked: generation_config.json's keys to their values."""
        if self.override_generation_config is None:
            return {}
        overrides = _json_object("override_generation_config", self.override_generation_config)
        try:
            generation_overrides(overrides)
        except ValueError as e:
            raise ConfigError(f"--override-generation-config: {e}") from None
        return overrides

    def __post_init__(self) -> None:
        _require_finite(self)
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            json_strings(name, getattr(self, name))  # (a bad list stops serve before the model loads)
        _require(0 < self.port < 65536, "port", "must be in 1..65535")
        _require(self.max_waiting > 0, "max_waiting", "must be positive")
        _require(0 < self.max_body_mb <= MAX_GIB, "max_body_mb", "must be positive, at most a TiB")
        _require(
            self.api_key is None
            or (self.api_key != "" and self.api_key.isprintable() and self.api_key.strip() == self.api_key),
            "api_key",
            "must be printable text without blanks around it (an empty key would turn authentication off; leave the "
            "flag out for none)",
        )
        _require(all(name.strip() for name in self.served_model_name), "served_model_name", "a name must not be empty")
        _require(self.max_stored_responses >= 0, "max_stored_responses", "must not be negative")
        _require(
            self.generation_config in ("auto", "vllm") or Path(self.generation_config).expanduser().is_dir(),
            "generation_config",
            f"must be auto, vllm or a directory (of a generation_config.json), not {self.generation_config!r}",
        )
        _ = self.generation_overrides  # (a bad one fails here, naming the flag)
        _require(
            self.tool_call_parser in (None, *TOOL_CALL_PARSER_NAMES),
            "tool_call_parser",
            f"must be one of {', '.join(TOOL_CALL_PARSER_NAMES)}",
        )
        _require(
            self.reasoning_parser in (None, *REASONING_PARSERS),
            "reasoning_parser",
            f"must be one of {', '.join(REASONING_PARSERS)}",
        )
        _require(
            not (self.enable_log_requests and self.disable_log_requests),
            "disable_log_requests",
            "contradicts --enable-log-requests: give one",
        )
        _require(self.max_log_len is None or self.max_log_len >= 0, "max_log_len", "must not be negative")
        _require(
            self.uvicorn_log_level in UVICORN_LOG_LEVELS,
            "uvicorn_log_level",
            f"must be one of {', '.join(UVICORN_LOG_LEVELS)}",
        )
        _require(
            self.root_path == "" or (self.root_path.startswith("/") and not self.root_path.endswith("/")),
            "root_path",
            f"must be a path that starts with / and does not end with one, e.g. /llm, not {self.root_path!r}",
        )
        _require(
            self.ssl_keyfile is None or self.ssl_certfile is not None,
            "ssl_certfile",
            "HTTPS needs the certificate (--ssl-certfile) beside the key (a file of both is given alone)",
        )
        for name in ("ssl_keyfile", "ssl_certfile"):
            path = getattr(self, name)
            _require(path is None or Path(path).expanduser().is_file(), name, f"{path!r} is not a file")


TOOL_CALL_PARSER_NAMES = tuple(TOOL_CALL_PARSERS)
ROUTINGS = ("locality", "least-loaded", "round-robin")
KV_PATHS = ("basic", "dualpath", "oracle")
# ClusterConfig's fields that act with prefill and decode engines only (ClusterConfig.ignored_role_flags).
ROLE_FLAGS = ("kv_path", "kv_handoff_timeout_s", "pd_alpha", "pd_beta", "pd_z", "storage_gbps", "net_gbps")
KV_TRANSPORTS = ("shm", "nixl", "mooncake")
# ClusterConfig's fields that act with engines as Ray actors only (ClusterConfig.ignored_instance_flags).
INSTANCE_FLAGS = (
    "routing",
    "locality_threshold",
    "locality_max_imbalance",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "step_timeout_s",
    "restart_delay_s",
    "max_restarts",
    "restart_reset_s",
)
# Of those, the ones that act on one engine in the server's process too when its model is split over devices (a lost
# rank: the engine is restarted in place, ``EngineLoop``).
RESTART_FLAGS = ("restart_delay_s", "max_restarts", "restart_reset_s")
# ClusterConfig's fields that act with --kv-lending on only (ClusterConfig.ignored_lending_flags).
LENDING_FLAGS = (
    "lending_interval_s",
    "lending_debtor_max_batch",
    "lending_creditor_max_usage",
    "lending_creditor_headroom",
    "lending_min_gain",
    "lending_lookahead_chunks",
    "lending_request_pools",
    "lending_reservation_timeout_s",
    "lending_grant_timeout_s",
)


@dataclass(frozen=True)
class ClusterConfig:
    instances: int = field(default=1, metadata={"help": "engine instances; more than 1 runs them as Ray actors"})
    ray_address: str | None = field(default=None, metadata={"help": "join this Ray cluster (default: start one)"})
    routing: str = field(default="locality", metadata={"help": "locality, least-loaded or round-robin"})
    locality_threshold: int = field(
        default=2048, metadata={"help": "calls longer than this (tokens) go to their program's instance"}
    )
    locality_max_imbalance: int = field(
        default=4,
        metadata={
            "help": "a long call leaves its program's instance when that has this many more calls than the least loaded"
        },
    )
    heartbeat_interval_s: float = field(default=0.5, metadata={"help": "seconds between instance heartbeats"})
    heartbeat_timeout_s: float = field(default=5.0, metadata={"help": "an instance silent this long is dead"})
    step_timeout_s: float = field(
        default=120.0,
        metadata={
            "help": "an instance whose engine has been inside one step (a forward pass) this long is stuck: it is "
            "marked dead and its calls fail over (an idle engine is never timed out)"
        },
    )
    restart_delay_s: float = field(
        default=5.0,
        metadata={
            "help": "a lost instance is started again this many seconds after its loss, twice as long after each "
            "further loss of the same instance; it takes calls again from its first heartbeat"
        },
    )
    max_restarts: int = field(
        default=3, metadata={"help": "restarts per lost instance, those that fail included (0: never restart)"}
    )
    restart_reset_s: float = field(
        default=600.0,
        metadata={
            "help": "a restarted instance up this many seconds has its restarts forgotten: its next loss waits "
            "--restart-delay-s again and counts against --max-restarts from zero (0: never)"
        },
    )
    # Prefill/decode disaggregation (DualPath): the roles, the transport between them, the inter-engine
    # scheduler's thresholds, in tokens (cluster/pd_scheduler.py), and the emulated links (cluster/links.py).
    prefill_instances: int = field(
        default=0,
        metadata={
            "help": "prefill engines: with prefill and decode engines, a call is prefilled on one and its KV handed "
            "to the other, which decodes (0 with --decode-instances 0: every instance does both; one of them "
            "given alone makes the other 1)"
        },
    )
    decode_instances: int = field(default=0, metadata={"help": "decode engines (see --prefill-instances)"})
    kv_transport: str = field(
        default="shm",
        metadata={
            "help": "how KV moves between prefill and decode engines: shm (shared memory, one node), nixl or mooncake "
            "(across nodes; their packages must be installed)"
        },
    )
    kv_handoff_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "a KV stream between engines not complete in this many seconds is abandoned: its blocks are freed "
            "on both sides and recomputed"
        },
    )
    pd_alpha: int | None = field(
        default=None,
        metadata={
            "help": "a node whose storage read queue holds at most this many tokens of KV is ideal for prefill "
            "work (default: --max-num-batched-tokens)"
        },
    )
    pd_beta: int | None = field(
        default=None,
        metadata={
            "help": "a prefill engine with more unfinished tokens takes no more (default: 8 x --max-num-batched-tokens)"
        },
    )
    pd_z: int | None = field(
        default=None,
        metadata={
            "help": "high-token threshold of a decode engine (default: derived each round from its group's load "
            "and free KV)"
        },
    )
    kv_path: str = field(
        default="dualpath",
        metadata={
            "help": "with prefill and decode engines, where stored KV is read: basic (on the prefill engine), "
            "dualpath (on the prefill or the decode engine, whichever node's storage link would finish the read "
            "first) or oracle (no storage I/O; benchmarks only)"
        },
    )
    storage_gbps: float | None = field(
        default=None, metadata={"help": "emulate each instance's storage NIC at this many Gbit/s (default: no limit)"}
    )
    net_gbps: float | None = field(
        default=None,
        metadata={"help": "emulate each instance's compute-network NIC at this many Gbit/s (default: no limit)"},
    )
    kv_lending: str = field(
        default="off",
        metadata={
            "help": "on: instances with small batches move KV blocks of their longest requests to instances with "
            "memory to spare, planned by the gManager (Infinite-LLM); off: each instance keeps its own KV"
        },
    )
    lending_interval_s: float = field(
        default=2.0, metadata={"help": "seconds between the gManager's lending plans (at least a heartbeat interval)"}
    )
    lending_debtor_max_batch: int = field(
        default=8, metadata={"help": "instances running at most this many requests may borrow KV memory"}
    )
    lending_creditor_max_usage: float = field(
        default=0.6, metadata={"help": "instances using at most this share of their KV blocks may lend"}
    )
    lending_creditor_headroom: float = field(
        default=0.1, metadata={"help": "share of a creditor's KV blocks never lent: its own requests grow into them"}
    )
    lending_min_gain: float = field(
        default=0.01,
        metadata={"help": "a planned move must raise its two instances' modelled throughput by this share at least"},
    )
    lending_lookahead_chunks: int = field(
        default=1,
        metadata={
            "help": "a running request counts as waiting for blocks when its next N prefill chunks do not fit: "
            "plans act on a heartbeat-old report, so looking further ahead lends before the request stalls"
        },
    )
    lending_request_pools: float = field(
        default=1.0,
        metadata={
            "help": "with --kv-lending on, how many instances' pools' worth of KV one request may hold (its context "
            "limit): 1 admits one pool; more lets a request span instances, up to what the others lend "
            "(experimental: one longer than its pool starts on the gManager's grant, docs/lending.md)"
        },
    )
    lending_reservation_timeout_s: float = field(
        default=2.0,
        metadata={"help": "a creditor's reservation that no data fills in this many seconds is dropped"},
    )
    lending_grant_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "a request longer than its pool that the live instances could not hold even if all lent to it "
            "(one was lost and has not come back) fails after this many seconds, with a 503"
        },
    )

    def __post_init__(self) -> None:
        _require_finite(self)
        _require(self.instances >= 1, "instances", "must be >= 1")
        _require(self.prefill_instances >= 0, "prefill_instances", "must not be negative")
        _require(self.decode_instances >= 0, "decode_instances", "must not be negative")
        _require(
            self.kv_transport in KV_TRANSPORTS,
            "kv_transport",
            f"unknown transport {self.kv_transport!r}; one of {', '.join(KV_TRANSPORTS)}",
        )
        _require(self.kv_handoff_timeout_s > 0, "kv_handoff_timeout_s", "must be positive")
        _require(self.routing in ROUTINGS, "routing", f"unknown routing {self.routing!r}; one of {', '.join(ROUTINGS)}")
        _require(self.locality_threshold >= 0, "locality_threshold", "must not be negative")
        _require(self.locality_max_imbalance >= 0, "locality_max_imbalance", "must not be negative")
        _require(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be positive")
        _require(
            self.heartbeat_timeout_s > self.heartbeat_interval_s, "heartbeat_timeout_s", "must exceed the interval"
        )
        _require(self.step_timeout_s > 0, "step_timeout_s", "must be positive")
        _require(self.restart_delay_s >= 0, "restart_delay_s", "must not be negative")
        _require(self.max_restarts >= 0, "max_restarts", "must not be negative")
        _require(self.restart_reset_s >= 0, "restart_reset_s", "must not be negative")
        for name in ("pd_alpha", "pd_beta", "pd_z"):
            value = getattr(self, name)
            _require(value is None or value >= 0, name, "must not be negative")
        _require(self.kv_path in KV_PATHS, "kv_path", f"unknown path {self.kv_path!r}; one of {', '.join(KV_PATHS)}")
        _require(self.storage_gbps is None or self.storage_gbps > 0, "storage_gbps", "must be positive")
        _require(self.net_gbps is None or self.net_gbps > 0, "net_gbps", "must be positive")
        _require(self.kv_lending in ("on", "off"), "kv_lending", f"must be on or off, not {self.kv_lending!r}")
        _require(self.kv_lending == "off" or self.instances >= 2, "kv_lending", "needs --instances 2 or more")
        _require(
            self.kv_lending == "off" or not self.disaggregated,
            "kv_lending",
            "is not built for prefill and decode engines (--prefill-instances, --decode-instances)",
        )
        _require(
            self.instances == 1 or not (self.prefill_instances or self.decode_instances),
            "instances",
            "prefill and decode engines are counted by --prefill-instances and --decode-instances: leave it out",
        )
        _require(
            self.lending_interval_s >= self.heartbeat_interval_s,
            "lending_interval_s",
            "must be at least --heartbeat-interval-s: a plan needs fresh heartbeats",
        )
        _require(self.lending_debtor_max_batch >= 1, "lending_debtor_max_batch", "must be >= 1")
        _require(0 < self.lending_creditor_max_usage <= 1, "lending_creditor_max_usage", "must be in (0, 1]")
        _require(0 <= self.lending_creditor_headroom < 1, "lending_creditor_headroom", "must be in [0, 1)")
        _require(self.lending_min_gain >= 0, "lending_min_gain", "must not be negative")
        _require(self.lending_reservation_timeout_s > 0, "lending_reservation_timeout_s", "must be positive")
        _require(self.lending_lookahead_chunks >= 1, "lending_lookahead_chunks", "must be >= 1")
        _require(self.lending_request_pools >= 1, "lending_request_pools", "must be >= 1")
        _require(self.lending_grant_timeout_s > 0, "lending_grant_timeout_s", "must be positive")

    def ignored_role_flags(self) -> list[str]:
        """The flags given that act with prefill and decode engines only (the README's "with roles"), as ``--flag``s:
        without those engines they are accepted and ignored (``--kv-path`` as the others), and start-up says so. A flag
        left at its default is none of them."""
        return [] if self.disaggregated else _flags_given(self, ROLE_FLAGS)

    def ignored_lending_flags(self) -> list[str]:
        """As :meth:`ignored_role_flags`, the flags given that act with ``--kv-lending on`` only, and ``--kv-transport``
        where neither lending nor roles move KV between engines."""
        ignored = [] if self.kv_lending == "on" else _flags_given(self, LENDING_FLAGS)
        if self.kv_lending != "on" and not self.disaggregated:
            ignored += _flags_given(self, ("kv_transport",))
        return ignored

    def ignored_instance_flags(self, split: bool = False) -> list[str]:
        """As :meth:`ignored_role_flags`, the flags given that act where engines run as Ray actors behind the router
        only (routing, heartbeats, stuck steps, restarts), on one engine in the server's process; ``split``: its model
        is split over devices, and its restarts act on it (a lost rank)."""
        if self.runs_actors:
            return []
        return _flags_given(self, tuple(f for f in INSTANCE_FLAGS if not (split and f in RESTART_FLAGS)))

    @property
    def runs_actors(self) -> bool:
        """Whether the engines run as Ray actors behind a router (more than one instance, an existing Ray cluster, or
        prefill and decode engines), not as one engine in the server's process."""
        return self.instances > 1 or bool(self.ray_address) or self.disaggregated

    @property
    def disaggregated(self) -> bool:
        """Whether calls are split between prefill and decode engines."""
        return self.prefill_instances > 0 or self.decode_instances > 0

    @property
    def num_engines(self) -> int:
        """The engines the cluster runs: its instances, or its prefill and decode engines."""
        return sum(self.roles) if self.disaggregated else self.instances

    @property
    def roles(self) -> tuple[int, int]:
        """(prefill engines, decode engines): one of each at least when disaggregated."""
        return max(1, self.prefill_instances), max(1, self.decode_instances)


# -- flags ------------------------------------------------------------------------------------

C = TypeVar("C")


def _base_type(tp: Any) -> Any:
    """int for ``int | None``, and so on."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_flags(parser: argparse.ArgumentParser, cls: type, only: Sequence[str] | None = None) -> None:
    """Add one ``--flag`` per field of the dataclass ``cls`` (or of those named in ``only``: a command that takes
    some of a config's flags, under ``boundless serve``'s names, defaults and help)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        # A field's own names besides its flag's: another spelling that command lines already use.
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        tp = f.metadata.get("type") or _base_type(hints[f.name])  # (a field's own parse of its flag)
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if tp is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif typing.get_origin(tp) is tuple:  # tuple[str, ...]: one or more values
            group.add_argument(*flags, nargs="+", type=typing.get_args(tp)[0], default=default, help=help_text)
        else:
            # (No "(default: None)": a field without a value says in its help what stands for it, and the None
            # contradicted it, as --kv-host-gb's "default 1.0".)
            given = f" (default: {default})" if default not in (None, "") else ""
            group.add_argument(*flags, type=tp, default=default, help=help_text + given)


def context_length(text: str) -> int | None:
    """An argparse ``type`` for ``--max-model-len``, vLLM's human-readable form: a whole number, or one with a decimal
    suffix (``k`` 1,000, ``m``, ``g``; ``25.6k`` is 25,600) or a binary one (``K`` 1,024, ``M``, ``G``; whole numbers
    only), as Qwen's and Llama's model cards write contexts (``--max-model-len 128k``); ``auto`` or ``-1``: the default
    (None, the model's context capped by the pool)."""
    value = text.strip()
    if value.lower() == "auto" or value == "-1":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", value)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a context length: {text!r} (a number of tokens, e.g. 8192, 32k or 32K)")
    number, suffix = match.groups()
    if suffix in ("K", "M", "G") and "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a binary suffix takes a whole number (or write {number}{suffix.lower()})"
        )
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    tokens = Decimal(number) * scale  # (exact: in floats 16.1k is 16100.000000000002, refused as no whole number)
    if tokens != tokens.to_integral_value() or tokens < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens of at least 1")
    return int(tokens)


def positive_int(text: str) -> int:
    """An argparse ``type`` for a count: a whole number of at least 1. argparse names the flag in the error and
    exits 2 before the command runs (a count of 0 ran to a traceback, or nothing, after the work had begun)."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse ``type`` for a count where 0 says "the default" or "none": a whole number, not negative."""
    return _whole_number(text, 0)


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse ``type`` for a rate or a wait: a finite number, not negative (as :func:`positive_int`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number, not negative: {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type`` for a scale or a size: a finite number above 0 (as :func:`positive_int`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0: {text!r}")
    return value


N = TypeVar("N", int, float)


def comma_numbers(flag: str, text: str, kind: type[N], positive: bool = False) -> list[N]:
    """A flag's comma-separated numbers (``--rates``, a grid's sizes), each finite and not negative, or with
    ``positive`` above 0. Checked when the command runs, as simulate's own flags are: what is wrong exits with the
    flag's one line (SystemExit)."""
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        numbers = "whole numbers" if kind is int else "numbers"
        raise SystemExit(f"{flag}: {text!r} is not comma-separated {numbers}") from None
    if not all(math.isfinite(v) for v in values):  # (NaN too)
        raise SystemExit(f"{flag}: every value must be a finite number: {text!r}")
    if positive and not all(v > 0 for v in values):
        raise SystemExit(f"{flag}: every value must be positive: {text!r}")
    if not all(v >= 0 for v in values):
        raise SystemExit(f"{flag}: no value may be negative: {text!r}")
    return values


def from_flags(cls: type[C], args: argparse.Namespace) -> C:
    """Build ``cls`` from parsed flags; a bad value raises :class:`ConfigError`."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}  # type: ignore[arg-type]
    values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}
    return cls(**values)


def to_flags(config: object) -> list[str]:
    """The flags that :func:`from_flags` turns back into ``config`` (a config dataclass): those of its fields
    that differ from their defaults. For starting another process with the same configuration."""
    flags: list[str] = []
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            flags += [flag, *map(str, value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def check_serve_configs(engine: EngineConfig, server: ServerConfig, cluster: ClusterConfig) -> None:
    """What ``serve``'s configs refuse together (each checks its own values when built), before the model loads."""
    package = {"nixl": "nixl", "mooncake": "mooncake"}.get(cluster.kv_transport)
    if package is not None and (cluster.disaggregated or cluster.kv_lending == "on"):
        # (Else each instance loaded its model, then died opening its endpoint: an actor's traceback, a core dump.)
        _require(
            importlib.util.find_spec(package) is not None,
            "kv_transport",
            f"{cluster.kv_transport} needs the {package!r} package, which is not installed here",
        )
    if server.allow_runtime_lora_updating:
        # (Else each load_lora_adapter request failed, long after start-up, with a 400 naming the missing flag.)
        _require(engine.model.enable_lora, "allow_runtime_lora_updating", "needs --enable-lora")
        _require(
            not cluster.runs_actors,
            "allow_runtime_lora_updating",
            "needs a single engine instance (not --instances, --ray-address or prefill and decode engines); give a "
            "cluster its adapters with --lora-modules",
        )


def refuse_engine_flags(args: argparse.Namespace, command: str, set_by_command: dict[str, str]) -> None:
    """For a command that takes the engine's flags but sets some itself (``set_by_command``: field name -> how the
    command sets it): those given away from their defaults stop it with one line naming the flag (they were accepted
    and silently ignored)."""
    engine = (ModelConfig, CacheConfig, SchedulerConfig)
    defaults = {f.name: f.default for cls in engine for f in dataclasses.fields(cls)}
    for name, how in set_by_command.items():
        value = getattr(args, name)
        if (tuple(value) if isinstance(value, list) else value) != defaults[name]:
            raise SystemExit(f"--{name.replace('_', '-')}: {command} sets it itself ({how})")


def engine_config_from_flags(args: argparse.Namespace) -> EngineConfig:
    given = {arg: getattr(args, arg) for arg in VLLM_READ_ARGS if getattr(args, arg, None) is not None}
    vllm_engine_args(args.model, given, lambda arg: "--" + arg.replace("_", "-"))
    return EngineConfig(
        model=from_flags(ModelConfig, args),
        cache=from_flags(CacheConfig, args),
        scheduler=from_flags(SchedulerConfig, args),
    )


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        add_flags(parser, cls)
    group = parser.add_argument_group("vLLM's engine arguments, read as they apply here")
    group.add_argument(
        "--trust-remote-code", action="store_true", help="accepted: no code from a checkpoint runs here (each "
        "architecture is built in), so none is trusted or refused"
    )  # fmt: skip
    group.add_argument("--tokenizer", help="the model's own tokenizer is used: only the model's path is accepted")
    group.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
        help="prompts are always chunked to --max-num-batched-tokens: --no-enable-chunked-prefill is refused",
    )  # fmt: skip
    group.add_argument("--download-dir", help="refused: nothing is downloaded")


# vLLM's engine arguments (``LLM(...)``, ``vllm serve``) that this engine takes under another name. (On the command
# line argparse takes ``--swap-space`` as the prefix of ``--swap-space-gb``.)
VLLM_RENAMED_ARGS = {"swap_space": "swap_space_gb"}
# Those that ask for nothing here or for what this engine does not do (vllm_engine_args).
VLLM_READ_ARGS = ("trust_remote_code", "disable_log_stats", "tokenizer", "enable_chunked_prefill", "download_dir")


def vllm_engine_args(
    model: str, kwargs: dict[str, Any], name: Callable[[str], str] = lambda arg: arg
) -> dict[str, Any]:
    """Engine options with vLLM's engine arguments read: those with a meaning here under another name renamed, those
    that ask for nothing more here taken (``trust_remote_code``: no code from a checkpoint is run here;
    ``disable_log_stats``: an engine logs none, the server does), and those that ask for what this engine does not do
    refused with the reason (:class:`ConfigError`, naming the argument as ``name`` writes it: a flag on the command
    line)."""
    out = dict(kwargs)
    for old, new in VLLM_RENAMED_ARGS.items():
        if old in out:
            out[new] = out.pop(old)
    out.pop("trust_remote_code", None)
    out.pop("disable_log_stats", None)
    tokenizer = out.pop("tokenizer", None)
    if tokenizer is not None and tokenizer != model:
        raise ConfigError(f"{name('tokenizer')}: the model's own is used (its directory's or its GGUF file's)")
    if out.pop("enable_chunked_prefill", True) is False:
        raise ConfigError(
            f"{name('enable_chunked_prefill')}: prompts are always chunked to max_num_batched_tokens; set it to "
            "max_model_len or more to take each prompt whole"
        )
    if out.pop("download_dir", None) is not None:
        raise ConfigError(
            f"{name('download_dir')}: nothing is downloaded; give a model directory, a GGUF file or a hub id cached"
        )
    return out
