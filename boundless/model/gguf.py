"""Load a llama.cpp GGUF checkpoint: its architecture, its weights under Hugging Face names, and its tokenizer.

The weights are dequantized to float32 bit-identically with ``gguf.quants.dequantize`` (the reference numpy code
that transformers uses; ``gguf_quants`` does the common types faster, to the same bits), and llama.cpp's Q/K row
permutation is undone for ``llama`` files, so the result is a plain Hugging Face ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` state dict (a Gemma 3 file's norms less the one llama.cpp's converter added to them:
``Gemma3ForCausalLM``'s; a gpt-oss file's experts stacked as ``GptOssForCausalLM`` holds them; a GLM-4.5 file's
multi-token prediction block left unread, as ``Glm4MoeForCausalLM`` leaves it).

The header is parsed here rather than with ``gguf.GGUFReader``: that reader builds a numpy view for every
element of every array, which costs seconds on a vocabulary of 50k-150k strings, while the loop below
takes tens of milliseconds.
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from boundless.model.arch import (
    CONFIG_DEFAULTS,
    GEMMA_ARCHITECTURES,
    QK_NORM_ARCHITECTURES,
    ModelArch,
    RopeScaling,
    yarn_scaling,
)
from boundless.model.gguf_quants import HELD_BITS, HELD_GROUP, dequantize, held_codes
from boundless.model.tensor_parallel import dense_sides
from boundless.model.tokenizer import Tokenizer

__all__ = [
    "GGUFHeader",
    "GGUFModel",
    "GGUFTensorInfo",
    "gguf_model_type",
    "hf_tensor_name",
    "llama3_rope_scaling_from_factors",
    "load_gguf",
    "model_arch_from_gguf",
    "read_gguf_header",
    "read_gguf_metadata",
]

# GGUF architecture name -> ModelArch.model_type. llama.cpp stores Mistral models as ``llama``.
_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "granite": "granite",
    "gpt-oss": "gpt_oss",
    "smollm3": "smollm3",
    "glm4moe": "glm4_moe",
}
# The architectures whose files llama.cpp writes with a router and stacked experts that this loader reads.
_MOE_ARCHITECTURES = ("qwen3_moe", "gpt_oss", "glm4_moe")

# Per-layer GGUF tensor name -> Hugging Face suffix under ``model.layers.{i}.``.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's names where they differ: its norm before the MLP is llama.cpp's ffn_norm, and it norms attention's and the
# MLP's outputs too.
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3's (Phi-4's): q/k/v in one matrix, gate/up in another (``ffn_up``), as this model fuses them.
_PHI3_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
# Qwen3's (and Gemma 3's) norms of each query and key head.
_HEAD_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# gpt-oss's (llama.cpp's gpt-oss): its norm before the MLP is post_attention_norm (the file has no ffn_norm), every
# projection of attention has a bias, o's too, and the router (``ffn_gate_inp``) is transformers' ``mlp.router``, with a
# bias. Its sinks and experts are named by :data:`_GPT_OSS_SINKS` and :data:`_GPT_OSS_EXPERT_PARTS`.
_GPT_OSS_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate_inp": "mlp.router",
}
# A logit per query head, which transformers names without ``.weight`` (llama.cpp's converter adds one).
_GPT_OSS_SINKS = "attn_sinks"
# gpt-oss's experts as llama.cpp stores them, [experts, rows, cols] with their biases [experts, rows]: gate and up
# apart (its converter splits transformers' tensor), or one tensor of gate's rows then up's (``ffn_gate_up_exps``, its
# converter's --fuse-gate-up-exps), and down. Each is a part of a stacked tensor of transformers'
# (:func:`_gpt_oss_experts` builds them): ``mlp.experts.gate_up_proj`` [experts, hidden, 2 * intermediate], gate and up
# interleaved by column, and ``mlp.experts.down_proj`` [experts, intermediate, hidden], each transposed; the biases
# ``gate_up_proj_bias`` (interleaved too) and ``down_proj_bias``.
_GPT_OSS_EXPERT_PARTS = {
    "ffn_gate_exps": "gate",
    "ffn_up_exps": "up",
    "ffn_gate_up_exps": "gate_up",
    "ffn_down_exps": "down",
}
# The parameters of a gpt-oss layer's mixture beside its router's weight, by transformers' names under ``mlp.``.
_GPT_OSS_MLP = (
    "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias",
)  # fmt: skip
# What llama.cpp runs gpt-oss's clamped SwiGLU with: its alpha always, its limit where a file says none (its loader
# reads no key for either; a file may hold the limit under ``swiglu_clamp_exp``, :func:`_gpt_oss_swiglu`).
# (GptOssConfig's defaults, which CONFIG_DEFAULTS holds.)
_GPT_OSS_SWIGLU_ALPHA = CONFIG_DEFAULTS["gpt_oss"]["swiglu_alpha"]
_GPT_OSS_SWIGLU_LIMIT = CONFIG_DEFAULTS["gpt_oss"]["swiglu_limit"]
# GLM-4.5's (llama.cpp's glm4moe, its converter's Glm4MoeModel): its norm before the MLP is post_attention_norm (as
# gpt-oss's), q/k/v have biases (attn_{q,k,v}.bias), the MLP of its first leading_dense_block_count layers is dense
# (ffn_gate/up/down), and its head norms (attn_q_norm, attn_k_norm: :data:`_HEAD_NORM_TENSORS`) are GLM-4.5's but not
# Air's. A sparse layer's router and stacked experts are every mixture's (:data:`_ROUTER_TENSOR`,
# :data:`_EXPERT_TENSORS`); its own tensors beside them are :data:`_GLM4_MOE_SPARSE_TENSORS`. Neither q nor k is
# permuted: llama.cpp runs its RoPE on rotating halves (NEOX), as transformers does.
_GLM4_MOE_LAYER_TENSORS = {
    **{name: hf for name, hf in _LAYER_TENSORS.items() if name != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
}
# A sparse GLM-4.5 layer's shared experts (``expert_shared_count`` experts' worth of a dense MLP) and its router's
# correction of each expert's score for choosing it (transformers' ``e_score_correction_bias``, which llama.cpp's
# converter renames to a bias of ``exp_probs_b``), by GGUF name less ``blk.N.``.
_GLM4_MOE_SPARSE_TENSORS = {
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
_GLM4_MOE_SCORE_BIAS = "exp_probs_b.bias"
# A glm4moe file's multi-token prediction (its config's num_nextn_predict_layers, the file's nextn_predict_layers):
# whole blocks after the decoder's (block_count counts them), each with tensors of its own under ``blk.N.nextn.``
# (eh_proj, enorm, hnorm, embed_tokens, shared_head_head, shared_head_norm). llama.cpp loads and skips them, as
# transformers' Glm4MoeForCausalLM leaves them unread: none is read here (:func:`_is_prediction_block`).
_NEXTN = "nextn"
# llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType; 0 none, which its glm4moe runs as sigmoid).
_GATING_SIGMOID = (0, 2)


class _GemmaFile(NamedTuple):
    """What llama.cpp fixes for a Gemma file rather than reading it: every ``window_pattern``-th layer attends the
    whole context (Gemma 3's files may say otherwise: ``pattern_in_file``), the others slide, by the file's window or
    ``default_window``, with RoPE on ``local_rope_theta`` (None: the file's base); the 27B (``layers_27b``) scales
    attention by ``hidden_size / heads``, the others by ``head_dim``; the caps of the scores and the logits where the
    file has none (``default_caps``), and whether the scores are capped at all (``caps_scores``: Gemma 3's never are,
    as in transformers)."""

    window_pattern: int
    pattern_in_file: bool
    default_window: int | None
    local_rope_theta: float | None
    layers_27b: int
    default_caps: tuple[float | None, float | None]
    caps_scores: bool


# (Gemma 2's early files, from converters of mid-2024, hold neither its window nor its caps: llama.cpp's defaults.)
_GEMMA_FILES = {
    "gemma2": _GemmaFile(2, False, 4096, None, 46, (50.0, 30.0), True),
    "gemma3_text": _GemmaFile(6, True, None, 10000.0, 62, (None, None), False),
}
# A sparse layer's router, and its experts' matrices stacked [experts, rows, cols], each expert's slice loaded under
# its Hugging Face name (mlp.experts.{e}.gate_proj.weight...).
_ROUTER_TENSOR = "ffn_gate_inp"
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# LongRoPE's short and long factors, one per rotated pair, as llama.cpp's converter writes Phi-3's 128k-context models'
# (Phi-3.5-mini's, Phi-4-mini's).
_LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
# Tensors that carry no parameter: llama3's and LongRoPE's RoPE factors are read into ``ModelArch.rope_scaling``
# instead.
_METADATA_TENSORS = {"rope_freqs.weight", *_LONGROPE_TENSORS}

_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALAR_DTYPES: dict[int, np.dtype] = {kind: np.dtype(fmt) for kind, fmt in _SCALAR_FORMATS.items()}


# --------------------------------------------------------------------------------------------------
# Header


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lies in the file. ``shape`` is in numpy/PyTorch order (rows first)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file

    @property
    def nbytes(self) -> int:
        block_elems, block_bytes = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block_elems * block_bytes


@dataclass(frozen=True)
class GGUFHeader:
    """The parsed header of a GGUF file: its metadata as plain Python values and its tensor table."""

    path: Path
    version: int
    metadata: dict[str, Any] = field(repr=False)
    tensors: dict[str, GGUFTensorInfo] = field(repr=False)


class _Cursor:
    """Sequential little-endian reads from a buffer."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, kind: int) -> Any:
        fmt = _SCALAR_FORMATS[kind]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def u32(self) -> int:
        return self.scalar(GGUFValueType.UINT32)

    def u64(self) -> int:
        return self.scalar(GGUFValueType.UINT64)

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return bytes(self.buf[start : self.pos]).decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(kind)

    def array(self) -> list[Any]:
        kind = self.u32()
        count = self.u64()
        if kind in _SCALAR_DTYPES:
            # Numeric arrays (token types, scores) are read in one go rather than element by element.
            dtype = _SCALAR_DTYPES[kind]
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        return [self.value(kind) for _ in range(count)]


def _map(path: Path) -> np.ndarray:
    # np.memmap rather than mmap.mmap: the views handed to numpy keep the mapping alive, so it is never
    # closed under them (an explicit mmap.close() raises BufferError while any view exists).
    return np.memmap(path, dtype=np.uint8, mode="r")


def _read_header(buf: np.ndarray, path: Path) -> GGUFHeader:
    cur = _Cursor(memoryview(buf))  # type: ignore[arg-type]  # (numpy types ndarray as a buffer from Python 3.12 on)
    if cur.u32() != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version = cur.u32()
    if version not in (2, 3):
        # A byte-swapped version number means a big-endian file, which this reader does not handle.
        raise ValueError(f"{path}: unsupported GGUF version {version} (only little-endian v2/v3 are read)")
    n_tensors = cur.u64()
    n_kv = cur.u64()
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.u32())
    infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.u64() for _ in range(cur.u32())]
        qtype = GGMLQuantizationType(cur.u32())
        # ggml lists dimensions innermost first; numpy wants them outermost first.
        infos.append((name, tuple(reversed(dims)), qtype, cur.u64()))
    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {name: GGUFTensorInfo(name, shape, qtype, data_start + rel) for name, shape, qtype, rel in infos}
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=tensors)


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table without reading any tensor data."""
    path = Path(path)
    return _read_header(_map(path), path)


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A GGUF file's key/value metadata as plain Python values (arrays become lists)."""
    return read_gguf_header(path).metadata


# --------------------------------------------------------------------------------------------------
# Tensors


def _dequantize_tensor(buf: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor as a fresh, writable float32 array of shape ``info.shape``."""
    block_elems, block_bytes = GGML_QUANT_SIZES[info.qtype]
    *outer, inner = info.shape
    if inner % block_elems:
        raise ValueError(f"{info.name}: row of {inner} values is not a whole number of {info.qtype.name} blocks")
    raw = buf[info.offset : info.offset + info.nbytes].reshape(*outer, inner // block_elems * block_bytes)
    values = dequantize(raw, info.qtype).astype(np.float32, copy=False)
    # F32 comes back as a view of the read-only mapping; every other type is already a new array.
    return values if values.flags.writeable else values.copy()


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``, which interleaves each head's two rotary halves for its RoPE kernel.

    The inverse of ``convert_hf_to_gguf.LlamaModel.permute``; transformers' ``LlamaTensorProcessor`` does the same.
    """
    half = w.shape[0] // n_heads // 2
    return np.ascontiguousarray(w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """The Hugging Face parameter name for a GGUF tensor name of a ``model_type`` model (``ModelArch``'s); ``None``
    for a tensor that is not a parameter. (A gpt-oss file's gate and up experts, apart or fused, are both named by the
    one tensor of transformers' they make, ``mlp.experts.gate_up_proj``, and their biases by ``gate_up_proj_bias``. A
    glm4moe file's ``nextn`` tensors are none; the rest of its prediction blocks are named as layers past the
    decoder's, as its checkpoint names them, which :func:`read_gguf` leaves unread.)"""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name in _METADATA_TENSORS:
        return None
    parts = gguf_name.split(".")
    is_layer = len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit()
    if model_type == "glm4_moe" and len(parts) == 5 and parts[0] == "blk" and parts[2] == _NEXTN:
        return None  # (a multi-token prediction block's own tensor: blk.N.nextn.eh_proj.weight...)
    if is_layer and model_type == "glm4_moe" and f"{parts[2]}.{parts[3]}" in _GLM4_MOE_SPARSE_TENSORS:
        return f"model.layers.{parts[1]}.{_GLM4_MOE_SPARSE_TENSORS[f'{parts[2]}.{parts[3]}']}"
    if is_layer and model_type == "gpt_oss" and parts[2] == _GPT_OSS_SINKS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.self_attn.sinks"
    if is_layer and model_type == "gpt_oss" and parts[2] in _GPT_OSS_EXPERT_PARTS and parts[3] in ("weight", "bias"):
        # (gate's and up's parts are one tensor of transformers': load_gguf puts them together)
        stacked = "down_proj" if _GPT_OSS_EXPERT_PARTS[parts[2]] == "down" else "gate_up_proj"
        return f"model.layers.{parts[1]}.mlp.experts.{stacked}{'_bias' if parts[3] == 'bias' else ''}"
    layer_tensors = _layer_tensors(model_type)
    if is_layer and parts[2] in layer_tensors and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{parts[3]}"
    if is_layer and parts[2] in _HEAD_NORM_TENSORS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_HEAD_NORM_TENSORS[parts[2]]}.weight"
    if is_layer and parts[2] == _ROUTER_TENSOR and parts[3] == "weight":
        return f"model.layers.{parts[1]}.mlp.gate.weight"
    if is_layer and parts[2] in _EXPERT_TENSORS and parts[3] == "weight":  # stacked: split by expert at load
        return f"model.layers.{parts[1]}.mlp.experts.{{}}.{_EXPERT_TENSORS[parts[2]]}.weight"
    raise ValueError(
        f"unexpected GGUF tensor {gguf_name!r}: this loader knows only llama/qwen2/qwen3/phi3/gemma/granite/gpt-oss/"
        "glm4moe decoder tensors"
    )


def _layer_tensors(model_type: str) -> dict[str, str]:
    """A layer's GGUF tensor names and their Hugging Face suffixes, for a ``model_type`` model."""
    if model_type == "phi3":
        return _PHI3_LAYER_TENSORS
    if model_type == "gpt_oss":
        return _GPT_OSS_LAYER_TENSORS
    if model_type == "glm4_moe":
        return _GLM4_MOE_LAYER_TENSORS
    return _GEMMA_LAYER_TENSORS if model_type in GEMMA_ARCHITECTURES else _LAYER_TENSORS


def _expected_parameters(arch: ModelArch) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not arch.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(arch.num_layers):
        layer = {f"model.layers.{i}.{suffix}.weight" for suffix in _layer_tensors(arch.model_type).values()}
        if i in arch.sparse_layers and arch.expert_biases:  # (gpt-oss's: its router's weight is a layer tensor above)
            layer.update(f"model.layers.{i}.mlp.{name}" for name in _GPT_OSS_MLP)
        elif i in arch.sparse_layers:
            layer -= {f"model.layers.{i}.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
            layer.add(f"model.layers.{i}.mlp.gate.weight")
            layer.update(f"model.layers.{i}.mlp.experts.{{}}.{m}.weight" for m in _EXPERT_TENSORS.values())
            if arch.model_type == "glm4_moe":  # (its score correction; its shared experts where it has any)
                own = [
                    n
                    for k, n in _GLM4_MOE_SPARSE_TENSORS.items()
                    if k == _GLM4_MOE_SCORE_BIAS or arch.num_shared_experts
                ]
                layer.update(f"model.layers.{i}.{name}" for name in own)
        names.update(layer)
        if arch.qkv_bias:
            names.update(f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkv")
        if arch.o_bias:
            names.add(f"model.layers.{i}.self_attn.o_proj.bias")
        if arch.attention_sinks:
            names.add(f"model.layers.{i}.self_attn.sinks")
        if arch.qk_norm:
            names.update(f"model.layers.{i}.{suffix}.weight" for suffix in _HEAD_NORM_TENSORS.values())
    return names


def _is_prediction_block(gguf_name: str, arch: ModelArch) -> bool:
    """Whether ``gguf_name`` is a tensor of a glm4moe file's multi-token prediction blocks, the layers past its
    decoder's (:data:`_NEXTN`)."""
    parts = gguf_name.split(".")
    in_block = len(parts) >= 4 and parts[0] == "blk" and parts[1].isdigit()
    return arch.model_type == "glm4_moe" and in_block and int(parts[1]) >= arch.num_layers


def _gpt_oss_part(gguf_name: str) -> str | None:
    """Which part of a stacked experts' tensor of transformers' a gpt-oss file's tensor is (``gate``, ``up``,
    ``gate_up`` or ``down``: :data:`_GPT_OSS_EXPERT_PARTS`), or None for any other tensor."""
    parts = gguf_name.split(".")
    return _GPT_OSS_EXPERT_PARTS.get(parts[2]) if len(parts) == 4 and parts[0] == "blk" else None


def _gpt_oss_parts_complete(parts: Iterable[str]) -> bool:
    """Whether ``parts`` make up one stacked tensor: gate's and up's, or the two fused, or down's."""
    return set(parts) in ({"gate", "up"}, {"gate_up"}, {"down"})


def _check_gpt_oss_experts(tensors: Mapping[str, GGUFTensorInfo]) -> None:
    """A ``ValueError`` unless each of a gpt-oss file's stacked tensors has its parts, in one form: gate's and up's of
    one shape, or both fused (an even number of rows), or down's."""
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, info in tensors.items():
        part = _gpt_oss_part(name)
        if part is not None:
            stacked = hf_tensor_name(name, "gpt_oss")
            assert stacked is not None  # (an expert's part is a parameter)
            found.setdefault(stacked, {})[part] = info.shape
    for stacked, parts in sorted(found.items()):
        fused = parts.get("gate_up")
        if not _gpt_oss_parts_complete(parts):
            raise ValueError(f"GGUF file holds {sorted(parts)} of {stacked}: gate and up, or gate_up, or down")
        if "gate" in parts and parts["gate"] != parts["up"]:
            raise ValueError(f"GGUF file's gate {parts['gate']} and up {parts['up']} of {stacked} differ in shape")
        if fused is not None and (len(fused) < 2 or fused[1] % 2):
            raise ValueError(f"GGUF file's fused gate/up of {stacked} has shape {fused}: no two halves of rows")


def _gpt_oss_experts(name: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """transformers' stacked tensor ``name`` (``....mlp.experts.gate_up_proj``, ``down_proj`` or their ``_bias``) of
    llama.cpp's ``parts`` of it (:data:`_GPT_OSS_EXPERT_PARTS`: [experts, rows, cols], biases [experts, rows]): down's
    matrices transposed; gate's row r and up's row r as rows 2r and 2r + 1, then transposed (gate the even columns and
    up the odd ones, as transformers' GptOssExperts reads them); a bias as those rows. (Views where they can be: the
    model takes them apart again as it loads them, ``SparseMoE.as_loaded``.)"""
    bias = name.endswith("_bias")
    if "down" in parts:
        return parts["down"] if bias else parts["down"].transpose(1, 2)
    gate, up = (parts["gate"], parts["up"]) if "gate" in parts else parts["gate_up"].chunk(2, dim=1)
    interleaved = torch.stack([gate, up], dim=2).flatten(1, 2)
    return interleaved if bias else interleaved.transpose(1, 2)


# --------------------------------------------------------------------------------------------------
# Architecture


def _f32(value: float) -> float:
    """The shortest decimal that round-trips a float32, so that 9.99999974e-06 reads back as 1e-05.

    GGUF stores hyperparameters as float32; without this the same model read from its config.json and from
    its GGUF would get different ``ModelArch`` fingerprints.
    """
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _llama3_factors(theta: float, head_dim: int, scaling: RopeScaling) -> np.ndarray:
    """The ``rope_freqs`` tensor ``convert_hf_to_gguf`` writes for a llama3 RoPE scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        mid = 1 / ((1 - smooth) / scaling.factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, scaling.factor, mid))


def llama3_rope_scaling_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, original_max_position_embeddings: int = 8192
) -> RopeScaling:
    """Recover llama3 RoPE scaling parameters from the per-frequency ``rope_freqs`` tensor.

    llama.cpp does not store ``factor`` / ``low_freq_factor`` / ``high_freq_factor``; its converter bakes them
    into one divisor per rotary frequency. ``factor`` is the largest divisor. The two thresholds are only
    identifiable relative to the original context length, so that is taken as given (the converter itself
    always uses 8192 unless the config overrides it) and the frequency factors are fitted from the smoothly
    scaled band; Llama 3.1/3.2's own values (1, 4) are tried first so they come back exactly.
    """
    factors = np.asarray(factors, dtype=np.float64)
    factor = _f32(float(factors.max()))
    if factor == 1.0:
        return RopeScaling()
    candidate = RopeScaling("llama3", factor, 1.0, 4.0, original_max_position_embeddings)
    if np.allclose(_llama3_factors(theta, head_dim, candidate), factors, rtol=1e-5):
        return candidate
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv_wavelen = freqs.astype(np.float64) / (2 * math.pi)
    mid = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    if mid.sum() < 2:
        raise ValueError("cannot recover llama3 RoPE scaling: fewer than two smoothly scaled frequencies")
    # smooth = (old / wavelen - low) / (high - low) is linear in 1 / wavelen.
    smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_wavelen[mid], smooth, 1)
    old = original_max_position_embeddings
    low = -intercept * old / slope
    fitted = RopeScaling("llama3", factor, float(f"{low:.6g}"), float(f"{low + old / slope:.6g}"), old)
    if not np.allclose(_llama3_factors(theta, head_dim, fitted), factors, rtol=1e-4):
        raise ValueError("cannot recover llama3 RoPE scaling: rope_freqs does not follow the llama3 formula")
    return fitted


def _rope_scaling(
    meta: Mapping[str, Any],
    prefix: str,
    rope_factors: np.ndarray | None,
    theta: float,
    head_dim: int,
    context_length: int,
    truncate: bool = True,
) -> RopeScaling:
    """A file's RoPE scaling: llama3's from its ``rope_freqs`` tensor (``rope_factors``), linear's or YaRN's from its
    keys (YaRN's ramp between whole dimensions unless ``truncate`` is false, gpt-oss's), else none."""
    kind = meta.get(f"{prefix}.rope.scaling.type", "none")
    if rope_factors is not None:
        if kind not in ("none", "llama3"):
            raise ValueError(f"unsupported RoPE scaling: rope_freqs tensor together with scaling type {kind!r}")
        original = int(meta.get(f"{prefix}.rope.scaling.original_context_length", 8192))
        return llama3_rope_scaling_from_factors(rope_factors, theta, head_dim, original)
    if kind == "linear" or (kind == "none" and f"{prefix}.rope.scale_linear" in meta):
        factor = meta.get(f"{prefix}.rope.scaling.factor", meta.get(f"{prefix}.rope.scale_linear", 1.0))
        return RopeScaling("linear", _f32(factor)) if factor != 1.0 else RopeScaling()
    if kind == "yarn":  # (convert_hf_to_gguf writes the factor and the original context; the rest are defaults)
        scales = ("attn_factor", "yarn_attn_factor", "yarn_log_multiplier")
        scaled = [k for k in scales if f"{prefix}.rope.scaling.{k}" in meta]
        if scaled:
            raise ValueError(f"unsupported YaRN scaling: llama.cpp's {', '.join(scaled)} (DeepSeek's attention scale)")
        original = int(meta.get(f"{prefix}.rope.scaling.original_context_length", context_length))
        factor = _f32(meta.get(f"{prefix}.rope.scaling.factor", 1.0))
        beta_fast, beta_slow = (meta.get(f"{prefix}.rope.scaling.yarn_beta_{k}") for k in ("fast", "slow"))
        return yarn_scaling(
            factor, original, context_length, beta_fast=beta_fast, beta_slow=beta_slow, truncate=truncate
        )
    if kind != "none":
        raise ValueError(f"unsupported RoPE scaling type {kind!r} (supported: none, linear, llama3, yarn)")
    return RopeScaling()


def _partial_rotary_factor(meta: Mapping[str, Any], prefix: str, model_type: str, head_dim: int) -> float:
    """``ModelArch.partial_rotary_factor`` of a file's ``rope.dimension_count``, the leading dimensions of each head
    RoPE rotates: 1 for the whole head; for a phi3 file Phi-4-mini's share, for a glm4moe file GLM-4.5's half (their
    converters write ``int(head_dim * partial_rotary_factor)``: 96 of 128, 64 of 128); any other architecture's
    refused, as its config's is."""
    rotated = int(meta.get(f"{prefix}.rope.dimension_count", head_dim))
    if rotated == head_dim:
        return 1.0
    if model_type not in ("phi3", "glm4_moe"):
        raise ValueError("GGUF model applies RoPE to part of each head only, which ModelArch cannot express")
    share = rotated / head_dim
    # (ModelArch truncates head_dim * share back to the dimensions rotated: a share that rounds below them is refused
    # rather than rotating one pair fewer.)
    if not 0 < rotated < head_dim or int(head_dim * share) != rotated:
        raise ValueError(
            f"GGUF {prefix} model rotates {rotated} of each head's {head_dim} dimensions, which ModelArch cannot "
            "express"
        )
    return share


def _has_longrope_factors(tensor_shapes: Mapping[str, tuple[int, ...]], model_type: str, pairs: int) -> bool:
    """Whether a file holds LongRoPE's factor tensors, both, ``pairs`` values each (one per rotated pair); refused in
    any architecture but phi3 (transformers' LongRoPE is Phi-3's alone), or one without the other."""
    present = [name for name in _LONGROPE_TENSORS if name in tensor_shapes]
    if not present:
        return False
    if model_type != "phi3":
        raise ValueError(f"unsupported RoPE scaling: longrope ({', '.join(present)}) in a {model_type} file (Phi-3's)")
    if len(present) < len(_LONGROPE_TENSORS):
        raise ValueError(f"GGUF file has LongRoPE's {present[0]} without the other factors")
    for name in present:
        if tuple(tensor_shapes[name]) != (pairs,):
            raise ValueError(f"{name} has shape {tensor_shapes[name]}; LongRoPE needs {pairs} factors, one a pair")
    return True


def _longrope_attention_factor(stored: float | None, factor: float, original: int) -> float:
    """LongRoPE's scale of cos and sin for a file that holds ``stored`` (``rope.scaling.attn_factor``, or None).

    transformers' ``sqrt(1 + ln(factor) / ln(original))`` (1 for a factor of 1 or less), in float64, where the file
    holds none (a file converted before llama.cpp's converter wrote one) or that same value rounded to float32 (what the
    converter writes): so a file loads as its model's config.json does, to the bit, rather than a float32 rounding
    away. Any other value is the file's own, which llama.cpp runs it with (its converter writes ``0.1 ln(factor) + 1``
    for a Phi-3 config whose scaling is named ``yarn``)."""
    formula = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if stored is None or np.float32(stored) == np.float32(formula):
        return formula
    return _f32(stored)


def _longrope_scaling(
    meta: Mapping[str, Any], prefix: str, factors: tuple[np.ndarray, np.ndarray] | None, context_length: int
) -> RopeScaling:
    """A phi3 file's LongRoPE scaling: the original context ``rope.scaling.original_context_length``, the factor the
    ratio of ``context_length`` to it (as transformers computes Phi-3's: llama.cpp stores no factor), the attention
    factor of :func:`_longrope_attention_factor`, and the short and long factors of ``factors`` (the
    ``rope_factors_short`` and ``rope_factors_long`` tensors), each the shortest decimal of its float32, as
    hyperparameters are read here. Without ``factors`` (a read of the header alone: they change no size) the lists are
    left empty."""
    kind = meta.get(f"{prefix}.rope.scaling.type", "none")
    if kind not in ("none", "longrope"):
        raise ValueError(f"unsupported RoPE scaling: LongRoPE's factor tensors together with scaling type {kind!r}")
    original = int(meta.get(f"{prefix}.rope.scaling.original_context_length", context_length))
    factor = context_length / original
    short, long = (tuple(_f32(v) for v in f.tolist()) for f in factors) if factors is not None else ((), ())
    return RopeScaling(
        kind="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=_longrope_attention_factor(meta.get(f"{prefix}.rope.scaling.attn_factor"), factor, original),
        short_factor=short,
        long_factor=long,
    )


def gguf_model_type(meta: Mapping[str, Any]) -> str:
    """The ``ModelArch.model_type`` of a GGUF file's metadata; a ``ValueError`` for an architecture this does not
    read."""
    architecture = meta.get("general.architecture")
    if architecture not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {architecture!r}; supported: {', '.join(sorted(_ARCHITECTURES))}"
        )
    name = str(meta.get("general.name", "")) + " " + str(meta.get("general.basename", ""))
    if architecture == "llama" and "mistral" in name.lower():
        # llama.cpp converts Mistral as llama; the name is all that tells them apart.
        return "mistral"
    return _ARCHITECTURES[architecture]


def model_arch_from_gguf(
    meta: Mapping[str, Any],
    tensor_shapes: Mapping[str, tuple[int, ...]],
    *,
    rope_factors: np.ndarray | None = None,
    longrope_factors: tuple[np.ndarray, np.ndarray] | None = None,
    tokenizer: Tokenizer | None = None,
) -> ModelArch:
    """Build a :class:`ModelArch` from GGUF metadata and the tensor table (name -> numpy-order shape).

    Tied embeddings and q/k/v biases are read from which tensors exist, as llama.cpp does. ``rope_factors`` is
    the ``rope_freqs.weight`` tensor when the file has one (llama3 RoPE scaling); ``longrope_factors`` the
    ``rope_factors_short.weight`` and ``rope_factors_long.weight`` tensors of a phi3 file that has them (LongRoPE).
    """
    prefix = meta["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{prefix}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {prefix}.{name}")
        return value

    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    vocab_size, hidden = tensor_shapes["token_embd.weight"]
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError("GGUF model has different key and value head sizes, which ModelArch cannot express")
    theta = _f32(key("rope.freq_base", 10000.0))
    model_type = gguf_model_type(meta)
    partial = _partial_rotary_factor(meta, prefix, model_type, head_dim)
    if model_type not in _MOE_ARCHITECTURES and any(_ROUTER_TENSOR in name for name in tensor_shapes):
        raise ValueError(
            f"this GGUF {prefix} model is a mixture of experts (Mixtral's, in llama.cpp's layout), which this loader "
            "does not read; Qwen3-MoE's (qwen3moe), gpt-oss's and GLM-4.5's (glm4moe) it does, and Mixtral loads "
            "from a Hugging Face directory"
        )
    gpt_oss, glm = model_type == "gpt_oss", model_type == "glm4_moe"
    # (A glm4moe file's block_count counts its multi-token prediction blocks after the decoder's: llama.cpp's n_layer
    # is what is left.)
    layers = int(key("block_count")) - (_prediction_blocks(meta, prefix, tensor_shapes) if glm else 0)
    experts = int(meta.get(f"{prefix}.expert_count", 0)) if model_type == "qwen3_moe" else 0
    experts = int(key("expert_count")) if gpt_oss or glm else experts
    # (Every layer of gpt-oss's is sparse, as transformers builds it: one whose router is missing is a missing tensor.
    # GLM-4.5's are from leading_dense_block_count on, as llama.cpp reads it: 0 where the file has none.)
    dense = int(meta.get(f"{prefix}.leading_dense_block_count", 0)) if glm else 0
    sparse = tuple(
        i
        for i in range(layers)
        if gpt_oss or (glm and i >= dense) or (not glm and f"blk.{i}.{_ROUTER_TENSOR}.weight" in tensor_shapes)
    )
    context_length = int(key("context_length", 2048))
    if _has_longrope_factors(tensor_shapes, model_type, int(head_dim * partial) // 2):
        rope_scaling = _longrope_scaling(meta, prefix, longrope_factors, context_length)
    else:
        # (gpt-oss's YaRN ramps between fractional dimensions, as its config's truncate: false says and transformers
        # runs it; llama.cpp rounds the ramp's ends to whole dimensions for every model.)
        rope_scaling = _rope_scaling(meta, prefix, rope_factors, theta, head_dim, context_length, truncate=not gpt_oss)
    window = meta.get(f"{prefix}.attention.sliding_window")
    gemma = _GEMMA_FILES.get(model_type)
    caps: list[Any] = [None, None]
    if gemma is not None:
        window = window or gemma.default_window
        names = ("attn", "final")
        caps = [meta.get(f"{prefix}.{n}_logit_softcapping", d) for n, d in zip(names, gemma.default_caps, strict=True)]
        caps[0] = caps[0] if gemma.caps_scores else None
    return ModelArch(
        model_type=model_type,
        vocab_size=int(vocab_size),
        hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")),
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=context_length,
        tie_word_embeddings="output.weight" not in tensor_shapes,
        qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
        # (GLM-4.5's head norms are in its file or not, as its config's use_qk_norm says: llama.cpp reads them so.)
        qk_norm=model_type in QK_NORM_ARCHITECTURES or (glm and "blk.0.attn_q_norm.weight" in tensor_shapes),
        num_experts=experts,
        num_experts_per_tok=int(key("expert_used_count")) if experts else 0,
        moe_intermediate_size=int(key("expert_feed_forward_length")) if experts else 0,
        # (llama.cpp's qwen3moe always renormalizes the chosen experts' weights; gpt-oss's softmax over the chosen
        # logits alone gives the same weights; glm4moe's as its expert_weights_norm says, not where it says nothing)
        norm_topk_prob=bool(meta.get(f"{prefix}.expert_weights_norm", False)) if glm else bool(experts),
        sparse_layers=sparse if experts else (),
        rope_scaling=rope_scaling,
        sliding_window=int(window) if window and (model_type in ("mistral", "phi3", "gpt_oss") or gemma) else None,
        full_attention_layers=_full_attention_layers(meta, prefix, model_type, layers, gemma) if window else (),
        bos_token_id=tokenizer.bos_token_id if tokenizer is not None else meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tokenizer.eos_token_ids if tokenizer is not None else (),
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        local_rope_theta=gemma.local_rope_theta if gemma else None,
        # (Its query_pre_attn_scalar, which the file does not hold: the Hub's configs agree with llama.cpp's rule.)
        query_pre_attn_scalar=float(int(hidden) // num_heads if layers == gemma.layers_27b else head_dim)
        if gemma
        else None,
        attn_logit_softcap=_f32(caps[0]) if caps[0] else None,
        final_logit_softcap=_f32(caps[1]) if caps[1] else None,
        partial_rotary_factor=partial,
        o_bias=gpt_oss and "blk.0.attn_output.bias" in tensor_shapes,
        attention_sinks=gpt_oss,
        # (llama.cpp's SmolLM3: every 4th layer without RoPE, which the file does not say; SmolLM3Config's default)
        nope_layers=tuple(i for i in range(layers) if (i + 1) % 4 == 0) if model_type == "smollm3" else (),
        **(_granite_multipliers(meta, prefix) if model_type == "granite" else {}),
        **(_gpt_oss_swiglu(meta, prefix, layers) if gpt_oss else {}),
        **(_glm4_moe_routing(meta, prefix) if glm else {}),
    )


def _prediction_blocks(meta: Mapping[str, Any], prefix: str, tensor_shapes: Mapping[str, tuple[int, ...]]) -> int:
    """How many of a glm4moe file's blocks are multi-token prediction's, after the decoder's: its
    ``nextn_predict_layers`` (0 where it has none: llama.cpp's). A file whose ``nextn`` tensors lie in a decoder's
    layer is refused (llama.cpp refuses it too: they are no tensors of a decoder layer)."""
    blocks, count = int(meta[f"{prefix}.block_count"]), int(meta.get(f"{prefix}.nextn_predict_layers", 0))
    if not 0 <= count < blocks:
        raise ValueError(f"GGUF {prefix} model's nextn_predict_layers {count} is not below its block_count {blocks}")
    stray = sorted(
        {int(p[1]) for p in (n.split(".") for n in tensor_shapes) if len(p) == 5 and p[2] == _NEXTN and p[1].isdigit()}
        - set(range(blocks - count, blocks))
    )
    if stray:
        raise ValueError(
            f"GGUF {prefix} model holds multi-token prediction (nextn) tensors in block {stray[0]}, but its "
            f"nextn_predict_layers ({count}) makes only blocks {blocks - count}..{blocks - 1} prediction blocks"
        )
    return count


def _glm4_moe_routing(meta: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """A glm4moe file's routing, as llama.cpp reads it: sigmoid scores (``expert_gating_func`` sigmoid, or none,
    which its glm4moe runs as sigmoid; softmax is refused: no GLM-4.5 routes so); ``expert_shared_count`` shared
    experts (a key llama.cpp requires); the weights scaled by ``expert_weights_scale`` (not where it is 0 or missing,
    as llama.cpp now skips a 0); and groups, ``expert_group_count`` of them of which ``expert_group_used_count``
    are chosen, as llama.cpp's MoE reads them for every architecture (converters since late 2025 write the config's
    ``n_group`` and ``topk_group``; an older file holds none: one group, which GLM-4.5's, Air's and 4.6's configs
    say too)."""
    gating = int(meta.get(f"{prefix}.expert_gating_func", 0))
    if gating not in _GATING_SIGMOID:
        raise ValueError(
            f"GGUF {prefix} model's expert_gating_func is {gating}: GLM-4.5's experts are chosen by sigmoid scores (2)"
        )
    shared = meta.get(f"{prefix}.expert_shared_count")
    if shared is None:
        raise ValueError(f"GGUF metadata lacks {prefix}.expert_shared_count")
    groups = int(meta.get(f"{prefix}.expert_group_count", 0)) or 1
    chosen = int(meta.get(f"{prefix}.expert_group_used_count", 0)) or (1 if groups == 1 else 0)
    if not 0 < chosen <= groups:
        raise ValueError(
            f"GGUF {prefix} model's experts are in {groups} groups of which expert_group_used_count "
            f"{meta.get(f'{prefix}.expert_group_used_count')!r} are chosen: 1 to {groups} are needed"
        )
    scale = _f32(meta.get(f"{prefix}.expert_weights_scale", 0.0)) or 1.0
    return {
        "num_shared_experts": int(shared),
        "expert_score": "sigmoid",
        "expert_groups": groups,
        "expert_groups_chosen": chosen,
        "routed_scaling_factor": scale,
    }


def _full_attention_layers(
    meta: Mapping[str, Any], prefix: str, model_type: str, layers: int, gemma: _GemmaFile | None
) -> tuple[int, ...]:
    """The layers of a file with a sliding window that attend the whole context: Gemma's
    (:func:`_gemma_full_layers`), gpt-oss's odd ones (llama.cpp's rule for its architecture, which its files do not
    state: the even layers slide, the first too, as GptOssConfig's ``layer_types``), none of the others'."""
    if gemma is not None:
        return _gemma_full_layers(meta, prefix, layers, gemma)
    return tuple(range(1, layers, 2)) if model_type == "gpt_oss" else ()


def _gpt_oss_swiglu(meta: Mapping[str, Any], prefix: str, layers: int) -> dict[str, Any]:
    """A gpt-oss file's clamped SwiGLU: ``swiglu_alpha`` llama.cpp's 1.702 and ``swiglu_limit`` its 7.0, both
    GptOssConfig's defaults and what the Hub's models use; a file may hold another limit under ``swiglu_clamp_exp``
    (the key ``gguf`` defines for the clamp of the experts' SwiGLU, a value a layer: one for all of them here), which
    llama.cpp's gpt-oss does not read (its converter writes none)."""
    stored = meta.get(f"{prefix}.swiglu_clamp_exp")
    if stored is None:
        return {"swiglu_limit": _GPT_OSS_SWIGLU_LIMIT, "swiglu_alpha": _GPT_OSS_SWIGLU_ALPHA}
    limits = {_f32(v) for v in (stored if isinstance(stored, list) else [stored])}
    count = len(stored) if isinstance(stored, list) else layers
    if len(limits) != 1 or count != layers or not min(limits) > 0:
        raise ValueError(
            f"GGUF gpt-oss model's {prefix}.swiglu_clamp_exp is {stored!r}: one positive limit for all of its "
            f"{layers} layers is needed"
        )
    return {"swiglu_limit": limits.pop(), "swiglu_alpha": _GPT_OSS_SWIGLU_ALPHA}


def _granite_multipliers(meta: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """A granite file's four multipliers, as llama.cpp's converter writes Granite's config (``embedding_scale``,
    ``residual_scale``, ``attention.scale``, ``logit_scale``; GraniteConfig's 1 where a file has none)."""
    keys = {
        "embedding_multiplier": "embedding_scale",
        "residual_multiplier": "residual_scale",
        "attention_multiplier": "attention.scale",
        "logits_scaling": "logit_scale",
    }
    return {field: _f32(meta.get(f"{prefix}.{key}", 1.0)) for field, key in keys.items()}


def _gemma_full_layers(meta: Mapping[str, Any], prefix: str, layers: int, gemma: _GemmaFile) -> tuple[int, ...]:
    """The layers of a Gemma file that attend the whole context: every ``sliding_window_pattern``-th (llama.cpp's for
    its architecture, or a Gemma 3 file's own; a newer converter may write one flag a layer, true where it slides)."""
    key = f"{prefix}.attention.sliding_window_pattern"
    pattern = meta.get(key, gemma.window_pattern) if gemma.pattern_in_file else gemma.window_pattern
    if isinstance(pattern, list):
        return tuple(i for i, slides in enumerate(pattern[:layers]) if not slides)
    return tuple(i for i in range(layers) if (i + 1) % int(pattern) == 0)


# --------------------------------------------------------------------------------------------------
# Loading


@dataclass
class GGUFModel:
    """A GGUF checkpoint, ready to build a model from.

    ``tensors`` maps Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``...) to dequantized
    tensors in Hugging Face layout; ``lm_head.weight`` is present only when the file has its own output matrix
    (otherwise ``arch.tie_word_embeddings`` is true). ``metadata`` is the file's raw key/value metadata.
    """

    arch: ModelArch
    tensors: dict[str, torch.Tensor] = field(repr=False)
    tokenizer: Tokenizer = field(repr=False)
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class GGUFWeights:
    """A GGUF checkpoint whose weights are dequantized as they are read: ``weights`` yields each Hugging Face-named
    tensor once, in the file's order, so that a model loads a file larger than memory holds twice (its own weights and
    the file's dequantized). The rest as :class:`GGUFModel`'s, its header checked (every tensor named, none missing)
    before the first weight is read."""

    arch: ModelArch
    weights: Iterator[tuple[str, torch.Tensor]] = field(repr=False)
    tokenizer: Tokenizer = field(repr=False)
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)
    # (bits, group) of the layers' dense matrices where they come held in their blocks' codes (``read_gguf``'s
    # ``hold_dense``: ``NAME``, ``NAME_scale``, ``NAME_zero``, as ``LlamaModel.hold_int`` holds them); else None.
    held: tuple[int, int] | None = None


_T = TypeVar("_T")

# A layer's dense matrices by their Hugging Face names (a mixture's experts, shared or routed, are not among them).
_DENSE_MATRIX = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)\.weight"
)


# How many bytes of dequantized (fp32) tensors the reader may have done or under way ahead of the one taken.
_AHEAD_BYTES = 2 << 30


def _parallel_map(fn: Callable[[GGUFTensorInfo], _T], items: Iterable[GGUFTensorInfo]) -> Iterator[_T]:
    """``fn`` of each item, in order, a few at once: numpy releases the GIL inside its kernels, so threads overlap the
    dequantization of different tensors. Ahead of the one taken, at most two a worker are done or under way, and no
    more than :data:`_AHEAD_BYTES` of them in fp32 but for one (so memory holds a few dequantized tensors, not the
    file's: gpt-oss-120b's experts are 4 GB each in fp32); a consumer that stops, or an error, cancels the rest."""
    items = list(items)
    workers = min(len(items), os.cpu_count() or 1, 8)
    if workers <= 1:
        yield from (fn(item) for item in items)
        return

    def size(item: GGUFTensorInfo) -> int:
        return 4 * math.prod(item.shape)

    pool = ThreadPoolExecutor(max_workers=workers)
    pending: deque[tuple[Future[_T], int]] = deque()
    ahead = 0
    try:
        for item in items:
            while pending and (len(pending) >= 2 * workers or ahead + size(item) > _AHEAD_BYTES):
                future, nbytes = pending.popleft()
                ahead -= nbytes
                yield future.result()
            pending.append((pool.submit(fn, item), size(item)))
            ahead += size(item)
        while pending:
            yield pending.popleft()[0].result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def load_gguf(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32) -> GGUFModel:
    """Read a GGUF file whole (:func:`read_gguf`'s weights, all of them held)."""
    read = read_gguf(path, dtype=dtype)
    return GGUFModel(arch=read.arch, tensors=dict(read.weights), tokenizer=read.tokenizer, metadata=read.metadata)


def read_gguf(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, hold_dense: bool = False, ranks: int = 1
) -> GGUFWeights:
    """Read a GGUF file: architecture, dequantized weights under Hugging Face names (as they are taken), tokenizer.

    Supports the ``llama`` (Llama 1-3, Mistral, SmolLM...), ``qwen2``, ``qwen3``, ``qwen3moe``, ``phi3`` (Phi-3 and
    Phi-4, Phi-4-mini's RoPE on part of each head and the 128k-context models' LongRoPE), ``gemma2``, ``gemma3``,
    ``granite`` (Granite 3), ``gpt-oss`` (its experts in ggml's MXFP4 or any other type, gate and up apart or fused),
    ``smollm3`` and ``glm4moe`` (GLM-4.5, GLM-4.5-Air, GLM-4.6: its multi-token prediction blocks unread)
    architectures.
    ``dtype`` is what the returned tensors are cast to after float32 dequantization, each as it is dequantized.
    ``hold_dense``: the layers' dense matrices come as their blocks' codes, scales and zero points where every one of
    them is of one type of :data:`~boundless.model.gguf_quants.HELD_BITS` (Q8_0 or Q4_0; ``held`` says so), to be held
    so (``LlamaModel.hold_int``), and, cut over ``ranks`` tensor-parallel ranks, each rank's share of o's and down's
    inputs whole blocks; else, and the rest, dequantized.
    """
    path = Path(path)
    buf = _map(path)
    header = _read_header(buf, path)
    meta = header.metadata
    model_type = gguf_model_type(meta)
    tokenizer = Tokenizer.from_gguf(meta)
    rope_info = header.tensors.get("rope_freqs.weight")
    rope_factors = _dequantize_tensor(buf, rope_info) if rope_info is not None else None
    short, long = (header.tensors.get(name) for name in _LONGROPE_TENSORS)
    longrope = None
    if short is not None and long is not None:  # (one without the other is refused by model_arch_from_gguf)
        longrope = (_dequantize_tensor(buf, short), _dequantize_tensor(buf, long))
    shapes = {name: info.shape for name, info in header.tensors.items()}
    arch = model_arch_from_gguf(meta, shapes, rope_factors=rope_factors, longrope_factors=longrope, tokenizer=tokenizer)
    # Check names before the expensive part: unknown tensors raise in hf_tensor_name, missing ones here.
    wanted = [
        info
        for name, info in header.tensors.items()
        if hf_tensor_name(name, model_type) is not None and not _is_prediction_block(name, arch)
    ]
    missing = _expected_parameters(arch) - {hf_tensor_name(info.name, model_type) for info in wanted}
    missing = {name.format("*") for name in missing}
    if missing:
        raise ValueError(f"{path}: GGUF file lacks tensors for {sorted(missing)[:5]} ({len(missing)} in all)")
    if model_type == "gpt_oss":
        _check_gpt_oss_experts(header.tensors)

    # llama.cpp permutes Q and K only for the llama architecture (convert_hf_to_gguf's LlamaModel), Granite and SmolLM3.
    permute = model_type in ("llama", "mistral", "granite", "smollm3")
    dense = [info for info in wanted if _DENSE_MATRIX.fullmatch(hf_tensor_name(info.name, model_type) or "")]
    qtypes = {info.qtype for info in dense}
    held = None
    # (Each rank's share of every matrix's inputs whole blocks: o's and a dense MLP's down's are cut over the ranks.)
    sides = dense_sides(arch, ranks)
    whole_blocks = sides is not None and all(n % HELD_GROUP == 0 for n in sides[1])
    if hold_dense and whole_blocks and len(qtypes) == 1 and (qtype := next(iter(qtypes))) in HELD_BITS:
        held = (HELD_BITS[qtype], HELD_GROUP)
    held_names = {info.name for info in dense} if held else set()

    def prepare_held(info: GGUFTensorInfo) -> tuple[torch.Tensor, ...]:
        """A dense matrix's codes, scales and zero points (:func:`held_codes`), its rows unpermuted as its values'."""
        _, block_bytes = GGML_QUANT_SIZES[info.qtype]
        rows, inner = info.shape
        raw = buf[info.offset : info.offset + info.nbytes].reshape(rows, inner // HELD_GROUP * block_bytes)
        parts = held_codes(raw, info.qtype)
        heads = arch.num_heads if ".attn_q." in info.name else arch.num_kv_heads if ".attn_k." in info.name else 0
        if not (permute and heads):
            return parts
        return tuple(torch.from_numpy(_unpermute_rows(part.numpy(), heads)) for part in parts)

    def prepare(info: GGUFTensorInfo) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if info.name in held_names:
            return prepare_held(info)
        # (Cast as each is dequantized, so that only one float32 copy a worker is alive beside the cast ones.)
        array = _dequantize_tensor(buf, info)
        if permute and ".attn_q." in info.name:
            array = _unpermute_rows(array, arch.num_heads)
        elif permute and ".attn_k." in info.name:
            array = _unpermute_rows(array, arch.num_kv_heads)
        if arch.norm_weight_offset and info.name.endswith("norm.weight"):
            # (llama.cpp's converter stores the 1 + w a Gemma norm multiplies by: taken off again, as transformers reads
            # such a file, for the Hugging Face checkpoint's w.)
            array = array - arch.norm_weight_offset
        tensor = torch.from_numpy(array)
        if dtype == torch.float32 or (arch.fp32_norms and info.name.endswith("norm.weight")):
            return tensor  # (a norm the model holds in fp32 takes its weight unrounded, as read whole before)
        if model_type == "glm4_moe" and info.name.endswith(f".{_GLM4_MOE_SCORE_BIAS}"):
            return tensor  # (GLM-4.5's score correction, held in fp32 whatever the model's type: SparseMoE's)
        return tensor.to(dtype)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        parts: dict[str, dict[str, torch.Tensor]] = {}  # a gpt-oss file's stacked experts' tensors, by their parts
        for info, tensor in zip(wanted, _parallel_map(prepare, wanted), strict=True):
            name = hf_tensor_name(info.name, model_type)
            assert name is not None  # (wanted holds parameters only)
            if isinstance(tensor, tuple):  # (held: codes, scales, zero points)
                yield from zip((name, name + "_scale", name + "_zero"), tensor, strict=True)
                continue
            part = _gpt_oss_part(info.name) if model_type == "gpt_oss" else None
            if part is not None:  # (put together as soon as its last part is in: _check_gpt_oss_experts saw them all)
                parts.setdefault(name, {})[part] = tensor
                if _gpt_oss_parts_complete(parts[name]):
                    yield name, _gpt_oss_experts(name, parts.pop(name))
            elif "{}" in name:  # a stacked experts' tensor: each expert's matrix under its own name (views, no copy)
                yield from ((name.format(e), tensor[e]) for e in range(tensor.shape[0]))
            else:
                yield name, tensor

    return GGUFWeights(arch=arch, weights=weights(), tokenizer=tokenizer, metadata=meta, held=held)
