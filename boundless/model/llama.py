"""A Llama-family decoder (Llama 2/3, Mistral, Mixtral, Phi-3, Qwen2, Qwen3, Qwen3-MoE, Gemma 2/3, Granite, GLM-4,
gpt-oss, SmolLM2) in our own PyTorch modules.

The model takes a flat batch: every token of every sequence in one dimension, with its position,
and an attention context prepared once per step. It never sees padding. Weights load from Hugging
Face names; q/k/v and gate/up are fused into single matrices so each layer runs four matmuls.

On the CPU in fp32, when the native kernels build (:mod:`boundless.model.cpu_kernels`), the
layers run on weights packed once at :meth:`LlamaModel.prepare`: RMSNorm, RoPE (q and k in one
pass, in place) and four packed matmuls whose epilogues add the residual and apply
SiLU(gate) * up, all writing into per-thread buffers reused across layers and steps. Every other
device and dtype runs the PyTorch path, which computes the same thing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from boundless import native
from boundless.attention.backend import AttentionBackend, soft_cap
from boundless.attention.partials import merge_with_sinks
from boundless.config import ConfigError
from boundless.kv.tensors import PagedKVCache
from boundless.model import cpu_kernels
from boundless.model.arch import ModelArch
from boundless.model.fp8_linear import FP8, Fp8Stack, fp8_linear, quantizable, quantize_rows
from boundless.model.fused_moe import held_linear
from boundless.model.int_stack import IntStack
from boundless.model.lora import DOWN, GATE_UP, O_PROJ, QKV, LoRABatch
from boundless.model.moe import SparseMoE
from boundless.model.rope import RotaryEmbedding, apply_rotary_, interleaved_to_halves
from boundless.model.tensor_parallel import ONE_DEVICE

# Token counts up to which the CPU multiplies as (weight @ x.T).T (see `linear`).
_CPU_SMALL_BATCH = 256


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    widened: cpu_kernels.PackedWeight | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias``; with ``scale``, ``weight`` is e4m3 and this its scale per row (``--quantization
    fp8``: :func:`~boundless.model.fp8_linear.fp8_linear`; ``widened``: on the CPU, the e4m3 weight in fp32, packed).

    On the CPU, for the few tokens of a decode step, the BLAS is faster (20% on 2 AVX2 cores) with
    the weight matrix as the left operand, ``(weight @ x.T).T``; for large batches the transpose
    back costs more than it saves.
    """
    if scale is not None:
        return fp8_linear(x, weight, scale, bias, None if widened is None else widened.matmul)
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= _CPU_SMALL_BATCH:
        # Transposing back to row-major keeps every later op (and the next matmul) on the layout it expects.
        # (A bias joins the product before its one rounding, as F.linear's: added after, a 16-bit sum rounded twice.)
        out = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, x.t())
        return out.t().contiguous()
    return F.linear(x, weight, bias)


class HeldWeightMismatch(ValueError):
    """A checkpoint weight that does not come in the form its matrix is held in as stored (a projection its config
    did not say it left unquantized, or FP8 of another kind): the loader then loads the checkpoint dequantized."""


class PackedLinear:
    """A weight pre-packed for oneDNN's CPU matmul, used for the LM head (the largest matrix).

    Packing once saves re-laying the 49K x 576 matrix out on every decode step; on other devices
    and dtypes, or if this build of PyTorch lacks the kernel, it falls back to :func:`linear`.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.packed = None
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
                probe = torch.randn(3, weight.shape[1])
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
                if torch.allclose(got, F.linear(probe, weight), rtol=1e-4, atol=1e-3):
                    self.packed = packed
            except (RuntimeError, AttributeError):
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return linear(x, self.weight)


class _PackedHead:
    """The LM head on the native CPU path (10% faster than oneDNN's packed matmul here)."""

    def __init__(self, weight: cpu_kernels.PackedWeight) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.matmul(x.contiguous())  # fp32 CPU rows [tokens, hidden]


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalized in fp32. Llama's rounds the normalized row to the input's dtype before the
    weight; Gemma's (``fp32_weight``) holds its weight (``1 + w``) in fp32 whatever the model's dtype and rounds once,
    after the weight, as transformers' Gemma3RMSNorm does."""

    def __init__(self, size: int, eps: float, fp32_weight: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fp32_weight = fp32_weight

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RMSNorm:
        if not self.fp32_weight:
            return super()._apply(fn, recurse)
        before = self.weight.data
        super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:  # the model cast to its dtype: this weight only moves, unrounded
            self.weight.data = before.to(self.weight.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight:
            return (xf * self.weight).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def fused(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """The GPU path's kernel of this norm (``triton_ops.rms_norm``); with ``delta``, ``x += delta`` first, in
        place."""
        from boundless.model import triton_ops

        return triton_ops.rms_norm(x, self.weight, self.eps, delta=delta, round_normed=not self.fp32_weight)


# Checkpoint matrices that are already this model's fused ones (Phi-3's), by module name.
_FUSED = {"qkv_proj": "qkv_weight", "gate_up_proj": "gate_up_weight"}


def _norm_names(arch: ModelArch, layer: DecoderLayer) -> dict[str, torch.Tensor]:
    """A layer's norms' weights by its checkpoint's names: Llama's two, and a layer of four norms' as each model
    names them (Gemma's ``post_attention_layernorm`` is its norm of attention's output, ``pre_feedforward_layernorm``
    the one before the MLP; GLM-4 keeps Llama's two and adds ``post_self_attn_layernorm`` and
    ``post_mlp_layernorm``)."""
    names: dict[str, torch.Tensor] = {
        "input_layernorm": layer.input_norm.weight,
        "post_attention_layernorm": layer.post_attention_norm.weight,
    }
    attn_out, mlp_out = layer.attn_out_norm, layer.mlp_out_norm
    if attn_out is None or mlp_out is None:
        return names
    if arch.model_type == "glm4":
        return {**names, "post_self_attn_layernorm": attn_out.weight, "post_mlp_layernorm": mlp_out.weight}
    return {
        **names,
        "post_attention_layernorm": attn_out.weight,
        "pre_feedforward_layernorm": layer.post_attention_norm.weight,
        "post_feedforward_layernorm": mlp_out.weight,
    }


class _Workspace(threading.local):
    """Activation buffers reused across layers and steps (one set per thread), so that a prefill
    step does not fault in fresh pages for every intermediate."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < rows * cols:
            buf = torch.empty(rows * cols, dtype=torch.float32)
            self.buffers[name] = buf
        return buf[: rows * cols].view(rows, cols)


class _PackedLayer:
    """One layer's matrices packed for :class:`cpu_kernels.PackedWeight`, carved from ``arena``
    (from ``offset``; :meth:`size` floats)."""

    def __init__(self, layer: DecoderLayer, arena: torch.Tensor, offset: int) -> None:
        def take(weight: torch.Tensor, glu: bool = False) -> torch.Tensor:
            nonlocal offset
            n = cpu_kernels.PackedWeight.packed_size(weight.shape, glu)
            offset += n
            return arena[offset - n : offset]

        self.qkv = cpu_kernels.PackedWeight(layer.qkv_weight, layer.qkv_bias, storage=take(layer.qkv_weight))
        self.o = cpu_kernels.PackedWeight(layer.o_weight, storage=take(layer.o_weight))
        self.gate_up: cpu_kernels.PackedWeight | None = None
        self.down: cpu_kernels.PackedWeight | None = None
        if layer.gate_up_weight is not None and layer.down_weight is not None:  # (a sparse layer has experts instead)
            self.gate_up = cpu_kernels.PackedWeight(
                layer.gate_up_weight, glu=True, storage=take(layer.gate_up_weight, glu=True)
            )
            self.down = cpu_kernels.PackedWeight(layer.down_weight, storage=take(layer.down_weight))
        # A sparse layer's experts, each packed as a dense MLP is (SparseMoE.pack: SiLU(gate) * up in the first
        # matmul's epilogue, or gpt-oss's activation after it).
        self.experts = [] if layer.moe is None else layer.moe.pack(take)
        q_norm, k_norm = layer.q_norm, layer.k_norm
        self.head_norm = (
            None
            if q_norm is None or k_norm is None
            else cpu_kernels.HeadNorm(q_norm.weight.detach(), k_norm.weight.detach(), layer.num_heads, q_norm.eps)
        )

    @staticmethod
    def size(layer: DecoderLayer) -> int:
        size = cpu_kernels.PackedWeight.packed_size
        total = size(layer.qkv_weight.shape) + size(layer.o_weight.shape)
        if layer.gate_up_weight is not None and layer.down_weight is not None:
            total += size(layer.gate_up_weight.shape, glu=True) + size(layer.down_weight.shape)
        if layer.moe is not None:
            total += layer.moe.packed_size()
        return total


class DecoderLayer(nn.Module):
    """One decoder layer: attention, then the MLP, or in a sparse layer (``index`` among ``arch.sparse_layers``) the
    mixture of experts."""

    def __init__(self, arch: ModelArch, index: int = 0) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.rotary_dim = arch.rotary_dim  # each head's leading dimensions RoPE rotates (Phi-4-mini's: 3/4 of them)
        self.rope = index not in arch.nope_layers  # (SmolLM3's layers without positional encoding rotate nothing)
        # What attention's and the MLP's outputs are multiplied by as they join the residual stream (Granite's).
        self.residual_multiplier = arch.residual_multiplier
        self.window = arch.layer_window(index)  # its sliding window (None: the whole context)
        # Gemma 3's sliding-window layers rotate by their own RoPE table (LlamaModel.local_rope).
        self.local_rope = self.window is not None and arch.local_rope_theta is not None
        self.gelu = arch.hidden_act == "gelu_pytorch_tanh"  # the MLP's gate activation (else SiLU)
        q_size = arch.num_heads * arch.head_dim
        kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_sizes = (q_size, kv_size, kv_size)
        self.qkv_weight = nn.Parameter(torch.empty(q_size + 2 * kv_size, arch.hidden_size))
        self.qkv_bias = nn.Parameter(torch.zeros(q_size + 2 * kv_size)) if arch.qkv_bias else None
        self.o_weight = nn.Parameter(torch.empty(arch.hidden_size, q_size))
        self.o_bias = nn.Parameter(torch.zeros(arch.hidden_size)) if arch.o_bias else None
        # gpt-oss's sink logit per query head (attention_sinks), or None.
        self.sinks = nn.Parameter(torch.zeros(arch.num_heads)) if arch.attention_sinks else None
        self.moe = SparseMoE(arch) if index in arch.sparse_layers else None
        self.gate_up_weight: nn.Parameter | None = None
        self.down_weight: nn.Parameter | None = None
        if self.moe is None:
            self.gate_up_weight = nn.Parameter(torch.empty(2 * arch.intermediate_size, arch.hidden_size))
            self.down_weight = nn.Parameter(torch.empty(arch.hidden_size, arch.intermediate_size))
        fp32 = arch.fp32_norms  # (Gemma's and gpt-oss's norms: weights in fp32, rounded once)
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fp32)
        self.post_attention_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fp32)
        # Qwen3 and Gemma 3: an RMSNorm over each query and each key head, before RoPE.
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, fp32) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, fp32) if arch.qk_norm else None
        # Gemma and GLM-4: attention's and the MLP's outputs normed before they join the residual stream (Gemma's
        # checkpoint's post_attention_layernorm and post_feedforward_layernorm, its pre_feedforward_layernorm being
        # post_attention_norm here, the norm before the MLP; GLM-4's post_self_attn_layernorm and post_mlp_layernorm).
        self.attn_out_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fp32) if arch.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, fp32) if arch.sandwich_norms else None
        self.packed: _PackedLayer | None = None  # set by LlamaModel.prepare on the native path
        # --quantization fp8: each dense matrix's scale per output row [1, out] (its weight then in e4m3); None:
        # unquantized. An FP8 checkpoint's matrices held as stored (hold_fp8): the same, or with ``fp8_block`` a scale
        # a block (rows, inputs) [out / rows, in / inputs].
        self.qkv_scale: torch.Tensor | None = None
        self.o_scale: torch.Tensor | None = None
        self.gate_up_scale: torch.Tensor | None = None
        self.down_scale: torch.Tensor | None = None
        self.fp8_block: tuple[int, int] | None = None
        # A GPTQ or AWQ checkpoint's matrices held in their bits (hold_int): codes in ``{name}_weight``, scales and
        # zero points [out, groups] in ``{name}_scale`` and ``{name}_zero``; (bits, group size, -1: a matrix's inputs).
        self.int_form: tuple[int, int] | None = None
        self.held_as_stored = False  # (hold_fp8, hold_int: the loader's weights of these matrices come as stored)
        # On the CPU, in any dtype (LlamaModel.prepare): each e4m3 matrix widened to fp32 (one held as a checkpoint
        # stores it with scales a block or in 4 or 8 bits: dequantized into fp32) and packed for the native kernel,
        # whose products give a row the same sums whatever rows share its step (fp8_linear's ``widened``).
        self.widened: dict[str, cpu_kernels.PackedWeight] = {}
        # And in fp32 a mixture's experts (unquantized) packed as the native path packs them, for the same reason.
        self.widened_experts: list[tuple[cpu_kernels.PackedWeight, cpu_kernels.PackedWeight]] = []
        # Tensor parallelism (model/tensor_parallel.py): the sum over the ranks of a row-parallel product, in place;
        # None on one device.
        self.reduce: Callable[[torch.Tensor], None] | None = None

    def dense_matrices(self) -> list[str]:
        """The names of the layer's dense matrices (``{name}_weight``): attention's, and the MLP's unless it has
        experts."""
        return ["qkv", "o"] + (["gate_up", "down"] if self.moe is None else [])

    def hold_fp8(self, block: tuple[int, int] | None) -> None:
        """Hold the layer's dense matrices as an FP8 checkpoint stores them: e4m3 weights, and a scale per output row
        (``block`` None: per tensor or per channel in the checkpoint, the product :func:`fp8_linear`'s) or one a
        ``block`` (rows, inputs) (Qwen3's 128 x 128: :func:`held_linear`'s). Made on the meta device, before
        the weights are allocated and loaded: half a 16-bit model's bytes."""
        for name in self.dense_matrices():
            weight = getattr(self, f"{name}_weight")
            out, inputs = weight.shape
            shape = (1, out) if block is None else (out // block[0], inputs // block[1])
            self._hold(
                name,
                torch.empty_like(weight, dtype=FP8),
                scale=torch.empty(shape, dtype=torch.float32, device=weight.device),
            )
        self.fp8_block, self.held_as_stored = block, True

    def hold_int(self, bits: int, group_size: int, act_order: bool = False) -> None:
        """Hold the layer's dense matrices as a GPTQ or AWQ checkpoint packs them, in ``bits`` (4 or 8) a weight with
        a scale and a zero point a group of ``group_size`` inputs (-1: all of a matrix's), as
        :class:`~boundless.model.int_stack.IntStack` lays them out: a quarter (an eighth of fp32's) of a 16-bit
        model's bytes in 4 bits. Under GPTQ's ``act_order``, each matrix's inputs held sorted by group, in the order
        ``{name}_perm`` gives (``PackedIntCheckpoint.held``; the product reorders its input so). Made on the meta
        device, before the weights are allocated and loaded."""
        for name in self.dense_matrices():
            weight = getattr(self, f"{name}_weight")
            out, inputs = weight.shape
            groups = 1 if group_size == -1 else inputs // group_size
            parts = {
                "scale": torch.empty(out, groups, dtype=torch.float32, device=weight.device),
                "zero": torch.empty(out, groups, dtype=torch.uint8, device=weight.device),
            }
            if act_order:
                parts["perm"] = torch.empty(inputs, dtype=torch.int32, device=weight.device)
            self._hold(name, torch.empty(out, inputs * bits // 8, dtype=torch.uint8, device=weight.device), **parts)
        self.int_form, self.held_as_stored = (bits, group_size), True

    def _hold(self, name: str, weight: torch.Tensor, **parts: torch.Tensor) -> None:
        """Matrix ``name`` held as ``weight`` with ``parts`` beside it (``{name}_scale``...), each a parameter (a
        plain attribute until now, the scale: a parameter moves with the module and loads by its name)."""
        setattr(self, f"{name}_weight", nn.Parameter(weight, requires_grad=False))
        delattr(self, f"{name}_scale")
        for part, tensor in parts.items():
            self.register_parameter(f"{name}_{part}", nn.Parameter(tensor, requires_grad=False))

    def held_stack(self, name: str) -> Fp8Stack | IntStack:
        """The matrix ``name`` held as a quantized checkpoint stores it, in FP8 blocks (:meth:`hold_fp8`) or in its
        bits (:meth:`hold_int`), as a stack of one (the experts' kernel's operand)."""
        weight, scale = getattr(self, f"{name}_weight"), getattr(self, f"{name}_scale")
        if self.int_form is None:
            assert self.fp8_block is not None
            return Fp8Stack(weight[None], scale[None], self.fp8_block)
        bits, group_size = self.int_form
        group = weight.shape[1] * 8 // bits if group_size == -1 else group_size
        return IntStack(weight[None], scale[None], getattr(self, f"{name}_zero")[None], bits, group)

    def quantize_fp8(self) -> None:
        """The layer's dense matrices (attention's, and the MLP's unless it has experts) to e4m3 with a scale per
        output row; a matrix ``_scaled_mm`` cannot take (sides not multiples of 16) stays as it is, and one held as
        an FP8 checkpoint stores it (:meth:`hold_fp8`) too. A mixture's experts too (``SparseMoE.quantize_fp8``: read
        by the fused experts' kernel, which takes any sides)."""
        if self.moe is not None:
            self.moe.quantize_fp8()
        for name in ("qkv", "o", "gate_up", "down"):
            weight = getattr(self, f"{name}_weight")
            if weight is None or not quantizable(weight) or getattr(self, f"{name}_scale") is not None:
                continue
            q, scale = quantize_rows(weight.data)
            setattr(self, f"{name}_weight", nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", scale)

    def widen_fp8(self, on: bool, fp32: bool = False) -> None:
        """``on``: each quantized matrix widened to fp32 (exact; one held in FP8 blocks or in its bits
        dequantized into fp32, its product then not scaled) and packed for the native CPU kernel, once; else none
        (another device: ``_scaled_mm`` and the Triton kernels take the matrices as held). ``fp32`` (a model in fp32
        on the CPU): a mixture's router and experts packed too, as the native path packs them."""
        if not on:
            self.widened, self.widened_experts = {}, []
            return
        for name in ("qkv", "o", "gate_up", "down"):
            weight, scale = getattr(self, f"{name}_weight"), getattr(self, f"{name}_scale")
            if scale is not None and name not in self.widened:
                if self.int_form is not None or self.fp8_block is not None:  # (dequantized: its product not scaled)
                    widened = self.held_stack(name).dequantized(0, torch.float32)
                else:
                    widened = weight.detach().float()
                self.widened[name] = cpu_kernels.PackedWeight(widened)
        moe = self.moe
        if moe is None or not fp32:
            self.widened_experts = []
            return
        if not self.widened_experts or moe.packed_router is None:
            self.widened_experts = moe.pack()

    def product(
        self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None, kernel: bool = False
    ) -> torch.Tensor:
        """``x`` times the matrix ``name`` (qkv, o, gate_up or down), with its bias (q/k/v's, or ``bias`` given): the
        PyTorch path's products (``kernel``: the GPU path's, whose matrices held as a checkpoint stores them take the
        Triton kernel)."""
        bias = self.qkv_bias if name == "qkv" else bias
        weight, scale, widened = getattr(self, f"{name}_weight"), getattr(self, f"{name}_scale"), self.widened.get(name)
        if self.int_form is not None or self.fp8_block is not None:  # (held in a form only its kernel reads)
            if (perm := getattr(self, f"{name}_perm", None)) is not None:  # (act-order: inputs held by group)
                x = x.index_select(-1, perm)
            if widened is not None and not kernel and x.device.type == "cpu":  # (dequantized once, packed)
                out = widened.matmul(x.reshape(-1, x.shape[-1]).float())
                out = out if bias is None else out.add_(bias)
                return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
            return held_linear(x, self.held_stack(name), bias, kernel)
        return linear(x, weight, bias, scale, widened)

    def activate(self, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's gated activation, ``act(gate) * up`` (SiLU, or Gemma's tanh-approximated GELU), into ``out`` if
        given; SiLU's overwrites ``gate``."""
        if self.gelu:
            return torch.mul(F.gelu(gate, approximate="tanh"), up, out=out)
        return torch.mul(F.silu(gate, inplace=True), up, out=out)

    def _norm_heads_(self, heads: torch.Tensor) -> None:
        """Qwen3's norm of each query and key head (``heads``: [tokens, q + k heads, head_dim]), in place."""
        if self.q_norm is None or self.k_norm is None:
            return
        q, k = heads[:, : self.num_heads], heads[:, self.num_heads :]
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
        cache: tuple[torch.Tensor, torch.Tensor],
        attn_meta: Any,
        lora: LoRABatch | None = None,
        index: int = 0,
    ) -> torch.Tensor:
        """The PyTorch path; updates ``hidden`` in place and returns it. ``lora``: the step's adapters, applied to
        their rows of each projection (``index``: this layer's number)."""
        t = hidden.shape[0]
        x = self.input_norm(hidden)
        qkv = self.product("qkv", x)
        if lora is not None:
            lora.add_(index, QKV, x, qkv)
        q_size, kv_size, _ = self.qkv_sizes
        # q and k heads sit side by side in each row: rotate them together, in place.
        heads = qkv[:, : q_size + kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        self._norm_heads_(heads)
        if self.rope:
            apply_rotary_(self._rotated(heads), cos, sin)
        q, k, v = (part.view(t, -1, self.head_dim) for part in qkv.split(self.qkv_sizes, dim=-1))
        attn = self._attend(attention, q, k, v, cache, attn_meta).reshape(t, -1)
        out = self._o_projection(attn, lora, index)
        hidden += self._scaled(out if self.attn_out_norm is None else self.attn_out_norm(out))
        x = self.post_attention_norm(hidden)
        if self.moe is not None:
            hidden += self._summed(self.moe(x, self.widened_experts))
            return hidden
        assert self.gate_up_weight is not None and self.down_weight is not None
        gate_up = self.product("gate_up", x)
        if lora is not None:
            lora.add_(index, GATE_UP, x, gate_up)
        act = self.activate(*gate_up.chunk(2, dim=-1))
        out = self.product("down", act)
        out = self._summed(out if lora is None else lora.add_(index, DOWN, act, out))
        hidden += self._scaled(out if self.mlp_out_norm is None else self.mlp_out_norm(out))
        return hidden

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        """A product about to join the residual stream, times ``residual_multiplier`` (in place; itself for 1), as
        transformers' Granite multiplies it before the add."""
        return out if self.residual_multiplier == 1.0 else out.mul_(self.residual_multiplier)

    def _rotated(self, heads: torch.Tensor) -> torch.Tensor:
        """The dimensions of ``heads`` [tokens, heads, head_dim] that RoPE rotates: a view of the leading
        ``rotary_dim`` of each head (all of them but for a partial rotary factor)."""
        return heads if self.rotary_dim == self.head_dim else heads[..., : self.rotary_dim]

    def _summed(self, partial: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A row-parallel product (o, down) summed over the tensor-parallel ranks, in place; itself on one device.
        ``bias``: its bias (gpt-oss's o), added once, after the sum."""
        if self.reduce is not None:
            self.reduce(partial)
        return partial if bias is None else partial.add_(bias)

    def _o_projection(
        self, attn: torch.Tensor, lora: LoRABatch | None, index: int, kernel: bool = False
    ) -> torch.Tensor:
        """o's product of ``attn`` with its adapters' share, summed over the tensor-parallel ranks, and its bias
        (gpt-oss's): in the product on one device (rounded once, as ``nn.Linear`` rounds it), once after the sum when
        split (the PyTorch and the GPU paths)."""
        split = self.reduce is not None
        out = self.product("o", attn, None if split else self.o_bias, kernel)
        if lora is not None:
            lora.add_(index, O_PROJ, attn, out)
        return self._summed(out, self.o_bias if split else None)

    def _attend(
        self,
        attention: AttentionBackend,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        attn_meta: Any,
    ) -> torch.Tensor:
        """The backend's attention of the layer (its window), storing the step's keys and values; with sinks
        (gpt-oss's), its partial merged with them (``merge_with_sinks``): every backend offers ``forward_partial``."""
        if self.sinks is None:
            return attention.forward(q, k, v, cache, attn_meta, self.window)
        part = attention.forward_partial(q, k, v, cache, attn_meta, self.window)  # type: ignore[attr-defined]
        return merge_with_sinks(part, self.sinks)

    def forward_fused(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attention: AttentionBackend,
        cache: tuple[torch.Tensor, torch.Tensor],
        attn_meta: Any,
        lora: LoRABatch | None = None,
        index: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The GPU path: the PyTorch path's matmuls with the fused Triton kernels of
        :mod:`boundless.model.triton_ops` between them. ``hidden + delta`` is the residual stream in (``delta``: the
        layer before's MLP output, or None), added in place by this layer's first norm (one kernel for the add and
        the norm, as vLLM's fused add-RMSNorm); returns ``hidden`` and this layer's MLP output, for the next layer's
        norm (or the model's last) to add."""
        from boundless.model import triton_ops as ops

        t = hidden.shape[0]
        norm_in, norm_post = self.input_norm, self.post_attention_norm
        x = norm_in.fused(hidden, delta)
        qkv = self.product("qkv", x, kernel=True)
        if lora is not None:
            lora.add_(index, QKV, x, qkv)
        q_size, kv_size, _ = self.qkv_sizes
        heads = qkv[:, : q_size + kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        self._norm_heads_(heads)
        if self.rope:
            ops.rotary_(self._rotated(heads), positions, rope.cos, rope.sin)
        q, k, v = (part.view(t, -1, self.head_dim) for part in qkv.split(self.qkv_sizes, dim=-1))
        attn = self._attend(attention, q, k, v, cache, attn_meta).reshape(t, -1)
        out = self._o_projection(attn, lora, index, kernel=True)
        if self.attn_out_norm is not None:
            out = self.attn_out_norm.fused(out)
        # hidden += o_proj(attn), and its norm, in one kernel.
        x = norm_post.fused(hidden, self._scaled(out))
        if self.moe is not None:
            return hidden, self._summed(self.moe.forward_fused(x))
        assert self.gate_up_weight is not None and self.down_weight is not None
        gate_up = self.product("gate_up", x, kernel=True)
        if lora is not None:
            lora.add_(index, GATE_UP, x, gate_up)
        act = self.activate(*gate_up.chunk(2, dim=-1)) if self.gelu else ops.silu_mul(gate_up)
        out = self.product("down", act, kernel=True)
        out = self._summed(out if lora is None else lora.add_(index, DOWN, act, out))
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm.fused(out)
        return hidden, self._scaled(out)

    def forward_packed(
        self,
        hidden: torch.Tensor,
        step: _PackedStep,
        attention: AttentionBackend,
        cache: tuple[torch.Tensor, torch.Tensor],
        attn_meta: Any,
        lora: LoRABatch | None = None,
        index: int = 0,
    ) -> torch.Tensor:
        """The native CPU path (fp32, weights packed); updates ``hidden`` in place.

        Each half of the layer (up to attention, after it) is one fused call, unless a LoRA adapter of the step
        changes one of its projections: that half's calls are then taken apart so that the adapters' rows are added
        where each projection ends. RoPE is linear, so q and k rotate after their adapters' share is added, as
        transformers does. Gate/up's kernel returns the activation, so when an adapter changes gate or up the matmul
        stores gate and up (``glu_halves``) and the activation follows in PyTorch. (PEFT's default adapter on a
        Llama changes q and v only: the second half stays fused.)"""
        packed = self.packed
        assert packed is not None
        rope, x = step.local_rope if self.local_rope else step.rope, step.x
        heads = self.num_heads + self.num_kv_heads
        rotated = self.rotary_dim if self.rope else 0  # (the kernel rotates the leading `rotated` of each head)
        if lora is None or not lora.touches(index, QKV):
            cpu_kernels.layer_in(
                hidden, self.input_norm.weight, self.input_norm.eps, x, packed.qkv, step.qkv, heads, self.head_dim,
                rotated, step.positions, rope.cos, rope.sin, packed.head_norm,
            )  # fmt: skip
        else:
            cpu_kernels.rms_norm(hidden, self.input_norm.weight, self.input_norm.eps, x)
            lora.add_(index, QKV, x, packed.qkv.matmul(x, step.qkv))
            cpu_kernels.rope_(
                step.qkv, heads, self.head_dim, rotated, step.positions, rope.cos, rope.sin, packed.head_norm
            )
        # (reshape: a backend's output may be strided so that no view flattens it, PyTorch's for some head sizes)
        attn = self._attend(attention, step.q, step.k, step.v, cache, attn_meta).reshape(x.shape[0], -1)
        if attn.stride(1) != 1 or attn.stride(0) != attn.shape[1]:
            attn = attn.contiguous()
        post, attn_out_norm, mlp_out_norm = self.post_attention_norm, self.attn_out_norm, self.mlp_out_norm
        gate_up, down = packed.gate_up, packed.down
        # (The products go straight into the stream where nothing comes between: no sum over ranks, norm or multiplier.)
        direct = (
            self.reduce is None and attn_out_norm is None and self.residual_multiplier == 1.0 and self.o_bias is None
        )
        if (gate_up is not None and down is not None and direct) and (
            not self.gelu and (lora is None or not any(lora.touches(index, t) for t in (O_PROJ, GATE_UP, DOWN)))
        ):
            cpu_kernels.layer_out(attn, hidden, packed.o, post.weight, post.eps, x, gate_up, step.act, down)
            return hidden
        # Taken apart: for LoRA adapters, to sum a tensor-parallel rank's products with the others' before each is
        # added to the stream (an adapter's share of a rank's product, from the rank's part of its A, is in the sum),
        # for Gemma's norms of the products and its GELU (the kernel's gate is SiLU), or Granite's multiplier.
        if direct:
            packed.o.matmul(attn, hidden, accumulate=True)
            if lora is not None:
                lora.add_(index, O_PROJ, attn, hidden)
        else:
            out = packed.o.matmul(attn)
            if lora is not None:
                lora.add_(index, O_PROJ, attn, out)
            out = self._summed(out, self.o_bias)
            if attn_out_norm is not None:
                cpu_kernels.rms_norm(out, attn_out_norm.weight, attn_out_norm.eps, out)
            hidden += self._scaled(out)
        cpu_kernels.rms_norm(hidden, post.weight, post.eps, x)
        if self.moe is not None:
            hidden += self._summed(self.moe(x, packed.experts))
            return hidden
        assert gate_up is not None and down is not None
        if self.gelu or (lora is not None and lora.touches(index, GATE_UP)):
            halves = gate_up.glu_halves(x)
            if lora is not None:
                lora.add_(index, GATE_UP, x, halves)
            gate, up = halves.chunk(2, dim=-1)
            act = self.activate(gate, up, out=step.act)
        else:
            act = gate_up.matmul(x, step.act)
        if direct:  # (Gemma's output norms come both or neither)
            down.matmul(act, hidden, accumulate=True)
            if lora is not None:
                lora.add_(index, DOWN, act, hidden)
        else:
            out = down.matmul(act)
            if lora is not None:
                lora.add_(index, DOWN, act, out)
            out = self._summed(out)
            if mlp_out_norm is not None:
                cpu_kernels.rms_norm(out, mlp_out_norm.weight, mlp_out_norm.eps, out)
            hidden += self._scaled(out)
        return hidden


class _PackedStep:
    """What every layer of one native forward shares: the workspace buffers (and q/k/v views
    into the qkv buffer), the positions and the RoPE table."""

    def __init__(
        self,
        layer: DecoderLayer,
        tokens: int,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        ws: _Workspace,
        act_width: int,
        local_rope: RotaryEmbedding | None = None,
    ):
        packed = layer.packed
        assert packed is not None
        hidden_size = packed.o.out_features
        self.x = ws.get("x", tokens, hidden_size)
        self.qkv = ws.get("qkv", tokens, packed.qkv.out_features)
        self.act = ws.get("act", tokens, act_width)  # (the dense layers' activations; 0 wide with none)
        self.q, self.k, self.v = (y.view(tokens, -1, layer.head_dim) for y in self.qkv.split(layer.qkv_sizes, dim=-1))
        self.positions = positions
        self.rope = rope
        self.local_rope = rope if local_rope is None else local_rope  # (the sliding-window layers' own, Gemma's)


if TYPE_CHECKING:

    class _DecoderLayers(nn.ModuleList):
        """The model's layers as the type checker sees them (``nn.ModuleList`` types its items as any ``Module``); at
        run time the plain ``nn.ModuleList``."""

        @overload
        def __getitem__(self, idx: slice) -> _DecoderLayers: ...

        @overload
        def __getitem__(self, idx: int) -> DecoderLayer: ...

        def __getitem__(self, idx: int | slice) -> DecoderLayer | _DecoderLayers: ...

        def __iter__(self) -> Iterator[DecoderLayer]: ...

else:
    _DecoderLayers = nn.ModuleList


class LlamaModel(nn.Module):
    """Decoder stack with its embedding, final norm and LM head."""

    def __init__(self, arch: ModelArch, vocab_rows: int | None = None) -> None:
        """``vocab_rows``: a tensor-parallel rank's rows of the embedding and LM head (its ``1/N`` of the vocabulary,
        ``tensor_parallel.vocab_rows``); None: the whole vocabulary."""
        super().__init__()
        self.arch = arch
        rows = arch.vocab_size if vocab_rows is None else vocab_rows
        self.vocab_split = vocab_rows is not None
        # An empty weight (the checkpoint's comes next): Embedding's own random init, on the meta device the loader
        # builds on, imports PyTorch's reference ops, 1.5 s of start-up.
        self.embed_tokens = nn.Embedding(rows, arch.hidden_size, _weight=torch.empty(rows, arch.hidden_size))
        self.layers = _DecoderLayers(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.fp32_norms)
        self.lm_head = None if arch.tie_word_embeddings else nn.Parameter(torch.empty(rows, arch.hidden_size))
        # A split vocabulary's sum of the ranks' embeddings and gather of their logits (sum_over); None alone.
        self.reduce: Callable[[torch.Tensor], None] | None = None
        self.gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.rope: RotaryEmbedding | None = None
        self.local_rope: RotaryEmbedding | None = None  # Gemma 3's sliding-window layers' own table
        self.head: PackedLinear | _PackedHead | None = None
        self._packed_key: tuple | None = None  # identity of the weights the layers were packed from
        self._act_width = 0
        self._workspace = _Workspace()
        self.quantized = False  # --quantization fp8 (quantize_fp8)
        # A tensor-parallel rank's network (model/tensor_parallel.py): the whole model's architecture and its place;
        # on one device ``arch`` and one rank of one (set by the loader).
        self.whole_arch = arch
        self.tensor_parallel = ONE_DEVICE

    def sum_over(
        self,
        reduce: Callable[[torch.Tensor], None] | None,
        gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Make this network one rank of a tensor-parallel model (``model/tensor_parallel.py``): each layer's
        row-parallel products summed over the ranks by ``reduce`` (in place) before they join the residual stream;
        with a split vocabulary, the embeddings summed too and the ranks' logits put side by side by ``gather``
        (every rank then computes logits whenever rank 0 does). None: summed nowhere (its ranks stopped)."""
        for layer in self.layers:
            layer.reduce = reduce
        self.reduce, self.gather = reduce, gather

    @property
    def summed(self) -> bool:
        """Whether this network is a tensor-parallel rank joined to others (:meth:`sum_over`)."""
        return self.reduce is not None

    def quantize_fp8(self) -> None:
        """``--quantization fp8``: every layer's dense matrices and a mixture's experts to e4m3
        (:meth:`DecoderLayer.quantize_fp8`); the embedding, the LM head and a mixture's router stay in the model's
        type."""
        with torch.no_grad():
            for layer in self.layers:
                layer.quantize_fp8()
        self.quantized = True

    def prepare(self, max_positions: int, rope_long: bool = False) -> None:
        """Once the weights are loaded: build the RoPE table and pack the LM head (and, for the
        native CPU path, every layer's matrices: once, until the weights change). An engine built
        on a model already prepared for as many positions keeps its table: another engine's CUDA
        graphs read that table by its address. ``rope_long``: a LongRoPE model's table by its long
        factors (``EngineLayout.rope_long``); a model whose table is the other factors' is refused
        (``ConfigError``) rather than its table replaced under the engine that runs on it."""
        weight = self.embed_tokens.weight
        head_weight = weight if self.lm_head is None else self.lm_head.data
        rope = self.rope
        if rope is not None and rope.long != rope_long:
            raise ConfigError(
                f"this model is prepared for LongRoPE's {'long' if rope.long else 'short'} factors by another engine "
                f"(its --max-model-len {'past' if rope.long else 'within'} the original context of "
                f"{self.arch.rope_scaling.original_max_position_embeddings}); an engine that rotates by the other "
                "factors needs the model loaded again"
            )
        if (
            rope is None
            or rope.cos.shape[0] < max_positions
            or rope.cos.device != weight.device
            or rope.cos.dtype != weight.dtype
        ):
            self.rope = RotaryEmbedding(self.arch, max_positions, weight.device, weight.dtype, long=rope_long)
            if self.arch.local_rope_theta is not None:
                self.local_rope = RotaryEmbedding(self.arch, max_positions, weight.device, weight.dtype, local=True)
        if not cpu_kernels.usable(weight) or self.quantized:
            for layer in self.layers:
                layer.packed = None
                if layer.moe is not None:
                    layer.moe.packed_router = None
                if self.quantized:
                    with torch.no_grad():
                        layer.widen_fp8(
                            weight.device.type == "cpu" and cpu_kernels.available(), cpu_kernels.usable(weight)
                        )
            self._packed_key = None
            self.head = PackedLinear(head_weight)
            return
        key = tuple((p.data_ptr(), p._version) for p in self.parameters())
        if key == self._packed_key:
            return
        with torch.no_grad():
            self.head = None
            for layer in self.layers:
                layer.packed = None
            # One arena on huge pages for every layer: the weights stream from memory each step.
            sizes = [_PackedLayer.size(layer) for layer in self.layers]
            arena = native.huge_page_empty(sum(sizes))
            offset = 0
            for layer, size in zip(self.layers, sizes, strict=True):
                layer.packed = _PackedLayer(layer, arena, offset)
                offset += size
            # The dense layers' activation width (the step's act buffer; 0 with no dense layer).
            self._act_width = self.arch.intermediate_size if any(lay.moe is None for lay in self.layers) else 0
            head = native.huge_page_empty(cpu_kernels.PackedWeight.packed_size(head_weight.shape))
            self.head = _PackedHead(cpu_kernels.PackedWeight(head_weight, storage=head))
        self._packed_key = key

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        kv_cache: PagedKVCache,
        attn_meta: Any,
        on_layer: Callable[[int], None] | None = None,
        before_layer: Callable[[int], None] | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of a flat batch. ``on_layer(i)`` is called once layer ``i`` has
        stored the step's KV (a prefill engine streams it to a decode engine meanwhile); ``before_layer(i)``
        before layer ``i`` reads any KV (a layerwise load waits there for that layer to arrive). ``lora``: the LoRA
        adapters of the step's requests and their rows (``model/lora.py``)."""
        assert self.rope is not None, "call prepare first"
        hidden = self._embed(input_ids)
        if getattr(attention, "fused_layers", False):  # a GPU backend: the layers' fused Triton kernels too
            delta = None  # each layer's MLP output, added to the stream by the next norm
            for i, layer in enumerate(self.layers):
                if before_layer is not None:
                    before_layer(i)
                rope = self.local_rope if layer.local_rope and self.local_rope is not None else self.rope
                hidden, delta = layer.forward_fused(
                    hidden, delta, positions, rope, attention, kv_cache.layer(i), attn_meta, lora, i
                )
                if on_layer is not None:
                    on_layer(i)
            return self.norm.fused(hidden, delta)
        if self._packed_key is not None and hidden.dtype == torch.float32 and hidden.device.type == "cpu":
            return self._forward_packed(hidden, positions, attention, kv_cache, attn_meta, on_layer, before_layer, lora)
        tables = {False: self.rope.lookup(positions)}
        if self.local_rope is not None:
            tables[True] = self.local_rope.lookup(positions)
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            cos, sin = tables[layer.local_rope and self.local_rope is not None]
            hidden = layer(hidden, cos, sin, attention, kv_cache.layer(i), attn_meta, lora, i)
            if on_layer is not None:
                on_layer(i)
        return self.norm(hidden)

    def _forward_packed(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        kv_cache: PagedKVCache,
        attn_meta: Any,
        on_layer: Callable[[int], None] | None = None,
        before_layer: Callable[[int], None] | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        rope = self.rope
        assert rope is not None
        positions = positions.to(torch.long).contiguous()
        if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < rope.cos.shape[0]:
            raise ValueError(f"positions beyond the RoPE table of {rope.cos.shape[0]}")
        hidden = hidden.contiguous()
        step = _PackedStep(
            self.layers[0], hidden.shape[0], positions, rope, self._workspace, self._act_width, self.local_rope
        )
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            hidden = layer.forward_packed(hidden, step, attention, kv_cache.layer(i), attn_meta, lora, i)
            if on_layer is not None:
                on_layer(i)
        return cpu_kernels.rms_norm(hidden, self.norm.weight, self.norm.eps, torch.empty_like(hidden))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (times Gemma's scale or Granite's multiplier, as transformers has each); with a split
        vocabulary, each rank's rows for its own tokens (zeros for the others'), summed over the ranks."""
        if not self.vocab_split:
            hidden = self.embed_tokens(input_ids)
            return hidden if self.arch.embedding_scale == 1.0 else hidden.mul_(self._embedding_scale(hidden))
        rows = self.embed_tokens.weight.shape[0]
        local = input_ids - self.tensor_parallel.rank * rows
        mine = (local >= 0) & (local < rows)
        hidden = self.embed_tokens(torch.where(mine, local, 0))
        hidden.mul_(mine.unsqueeze(-1).to(hidden.dtype))
        if self.reduce is not None:
            self.reduce(hidden)
        return hidden if self.arch.embedding_scale == 1.0 else hidden.mul_(self._embedding_scale(hidden))

    def _embedding_scale(self, hidden: torch.Tensor) -> float:
        # Gemma's scale rounded to the model's dtype as transformers rounds it (a float32 tensor cast), made on the
        # host: a tensor made on the device would be a copy inside a CUDA graph's capture. (Granite's multiplier is a
        # Python float there, as here.)
        if self.arch.norm_weight_offset == 0:
            return self.arch.embedding_scale
        return float(torch.tensor(self.arch.embedding_scale).to(hidden.dtype))

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Next-token logits of ``hidden``'s rows: in fp32, as the sampler takes them; else in the model's dtype
        (a greedy row's argmax is the same token, with no copy of [rows, vocab] in fp32 made and read). With a split
        vocabulary each rank computes its columns and the ranks' are put side by side: every rank calls this for the
        same rows at once."""
        assert self.head is not None, "call prepare first"
        logits = self.head(hidden)
        if self.vocab_split and self.gather is not None:
            logits = self.gather(logits)
        if self.arch.logits_scaling != 1.0:  # (Granite's)
            logits = logits / self.arch.logits_scaling
        if (cap := self.arch.final_logit_softcap) is not None:  # (Gemma 2's)
            logits = soft_cap(logits, cap)
        return logits.float() if float32 else logits

    # -- weights -----------------------------------------------------------------------------

    def hold_quantized_experts(
        self, form: str, block: tuple[int, int] | None = None, int_form: tuple[int, int] | None = None
    ) -> None:
        """Every sparse layer's experts held as a quantized checkpoint stores them, before its tensors load: ``mxfp4``
        blocks and scales (``SparseMoE.hold_mxfp4``), ``fp8`` weights with a scale a ``block``
        (``SparseMoE.hold_fp8``), or ``int`` codes of ``int_form`` (bits, group size: ``SparseMoE.hold_int``)."""
        for layer in self.layers:
            if layer.moe is None:
                continue
            if form == "mxfp4":
                layer.moe.hold_mxfp4()
            elif form == "int":
                assert int_form is not None
                layer.moe.hold_int(*int_form)
            else:
                assert form == "fp8" and block is not None
                layer.moe.hold_fp8(block)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up as they arrive."""
        arch = self.arch
        q_size = arch.num_heads * arch.head_dim
        kv_size = arch.num_kv_heads * arch.head_dim
        offsets = {"q_proj": (0, q_size), "k_proj": (q_size, kv_size), "v_proj": (q_size + kv_size, kv_size)}
        mlp_offsets = {"gate_proj": 0, "up_proj": arch.intermediate_size}
        seen: set[str] = set()
        orders: set[int] = set()  # (the input orders of act-order's fused matrices already loaded, by address)
        expected = self._expected_names()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue  # derived buffers, and a tied head saved beside its embedding
            if self._is_prediction_layer(name):
                continue  # (GLM-4.5's multi-token prediction layers: drafts this engine does not take from them)
            if name.endswith(".bias") and name not in expected and not tensor.any():
                continue  # (a zero bias adds nothing: AutoGPTQ saves one beside every layer it packs, Llama's too)
            target, rows = self._target(name, offsets, mlp_offsets)
            if target is None:
                raise ValueError(f"unexpected weight {name!r}")
            with torch.no_grad():
                dest = target if rows is None else target.narrow(0, rows[0], rows[1])
                tensor = self._as_loaded(name, tensor)
                if name.endswith(".weight_scale") and tensor.numel() == 1:  # (one for the tensor: each row's)
                    tensor = tensor.reshape(1, 1).expand(dest.shape)
                if dest.dtype in (FP8, torch.uint8) and tensor.dtype != dest.dtype:  # (held as stored: codes)
                    raise HeldWeightMismatch(
                        f"weight {name!r} comes as {tensor.dtype} where this checkpoint's weights are held as stored, "
                        f"in {dest.dtype}"
                    )
                if dest.shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
                if name.endswith(".weight_perm"):  # (q's, k's and v's inputs, one order: GPTQ's from one input)
                    if dest.data_ptr() in orders and not torch.equal(dest, tensor.to(dest.device)):
                        raise HeldWeightMismatch(f"{name!r} orders its inputs otherwise than its fused matrix's parts")
                    orders.add(dest.data_ptr())
                dest.copy_(tensor)
            seen.update(self._loaded_names(name))
        missing = expected - seen
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")

    def _is_prediction_layer(self, name: str) -> bool:
        """Whether ``name`` is a tensor of the layers GLM-4.5 saves past its decoder's (``num_nextn_predict_layers``:
        its multi-token prediction, which transformers and vLLM's model leave unread too)."""
        parts = name.split(".", 3)
        layer = parts[2] if len(parts) > 3 and parts[:2] == ["model", "layers"] else ""
        return self.arch.model_type == "glm4_moe" and layer.isdigit() and int(layer) >= self.arch.num_layers

    def _as_loaded(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as this model holds it: Gemma's norm weights with the one its norms add, in fp32 (they
        are held so: ``RMSNorm.fp32_weight``); GLM-4's q and k rows in the rotate-half order
        (``ModelArch.rope_interleaved``); gpt-oss's experts in this model's layout (``SparseMoE.as_loaded``); any
        other as it is. (A tensor of the wrong shape may come back so: the caller checks its shape.)"""
        arch = self.arch
        if (experts := self._in_experts(name)) is not None:
            _, moe, below = experts
            return moe.as_loaded(below, tensor)
        if name.endswith(".weight_perm"):
            return tensor  # (an order of the inputs, not of rows)
        if name.endswith((".weight_scale", ".weight_zero")) and (layer := self._layer_of(name)) and layer.fp8_block:
            return tensor  # (a scale a block of rows, each block whole heads: quantized_dense_form)
        interleaved = arch.rope_interleaved and name.split(".")[-2] in ("q_proj", "k_proj")
        if interleaved and tensor.dim() and not len(tensor) % arch.head_dim:  # (a 0-d scale is the tensor's: as is)
            return interleaved_to_halves(tensor, arch.head_dim, arch.rotary_dim)
        if not arch.norm_weight_offset or not name.endswith("norm.weight"):
            return tensor
        return tensor.float() + arch.norm_weight_offset

    def _layer_of(self, name: str) -> DecoderLayer | None:
        """The layer a ``model.layers.N.…`` name is in, else None."""
        parts = name.split(".", 3)
        if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return None
        index = int(parts[2])
        return self.layers[index] if index < len(self.layers) else None  # (past them: GLM-4.5's prediction layers)

    def holds_as_stored(self, name: str) -> bool:
        """Whether the quantized checkpoint weight ``name`` loads as the checkpoint stores it (with its scale beside
        it): an expert's of experts held in FP8 or in their bits (:meth:`hold_quantized_experts`), or a dense
        matrix's of a layer that holds them so (:meth:`hold_fp8`, :meth:`hold_int`); the rest load dequantized."""
        if (experts := self._in_experts(name)) is not None:
            return experts[1].held in ("fp8", "int") and ".experts." in name  # (a shared expert's: dequantized)
        layer = self._layer_of(name)
        parts = name.split(".")
        return layer is not None and layer.held_as_stored and len(parts) == 6 and parts[3] in ("self_attn", "mlp")

    def hold_fp8(self, block: tuple[int, int] | None) -> None:
        """Every layer's dense matrices held as an FP8 checkpoint stores them (:meth:`DecoderLayer.hold_fp8`), before
        its tensors load."""
        for layer in self.layers:
            layer.hold_fp8(block)
        self.quantized = True

    def hold_int(self, bits: int, group_size: int, act_order: bool = False) -> None:
        """Every layer's dense matrices held as a GPTQ or AWQ checkpoint packs them (:meth:`DecoderLayer.hold_int`),
        before its tensors load."""
        for layer in self.layers:
            layer.hold_int(bits, group_size, act_order)
        self.quantized = True

    def _in_experts(self, name: str) -> tuple[str, SparseMoE, str] | None:
        """For a name in a sparse layer's block: (the layer's prefix, its experts, the name below the block), else
        None. The block is the model's own name for it, or ``mlp`` (transformers 5 saves every model's so)."""
        parts = name.split(".")
        layer = self._layer_of(name)
        if len(parts) < 5 or layer is None:
            return None
        moe = layer.moe
        if moe is None or parts[3] not in (moe.block, "mlp"):
            return None
        return ".".join(parts[:3]), moe, ".".join(parts[4:])

    def _loaded_names(self, name: str) -> list[str]:
        """The checkpoint names (as :meth:`_expected_names` has them) a loaded tensor stands for: itself, or for an
        experts' tensor those its block's names give it (each expert of a stacked tensor)."""
        found = self._in_experts(name)
        if found is None:
            return [name]
        prefix, moe, below = found
        return [f"{prefix}.{moe.block}.{n}" for n in moe.loaded_names(below)]

    def _target(
        self, name: str, offsets: dict[str, tuple[int, int]], mlp_offsets: dict[str, int]
    ) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            return self.embed_tokens.weight, None
        if name == "model.norm.weight":
            return self.norm.weight, None
        if name == "lm_head.weight":
            return self.lm_head, None
        if len(parts) < 5 or parts[0] != "model" or parts[1] != "layers":
            return None, None
        layer = self.layers[int(parts[2])]
        if (experts := self._in_experts(name)) is not None:
            _, moe, below = experts
            return moe.target(below) or (None, None)
        module, leaf = parts[-2], parts[-1]
        if leaf in ("weight_scale", "weight_zero", "weight_perm") and layer.held_as_stored:
            return self._scale_target(layer, module, leaf.removeprefix("weight"), offsets, mlp_offsets)
        if leaf == "sinks":
            return layer.sinks, None
        if module == "o_proj" and leaf == "bias":
            return layer.o_bias, None
        if module in _FUSED:  # (a checkpoint that fuses them as this model does: ModelArch.fused_projections)
            return getattr(layer, _FUSED[module]), None
        if module in offsets:
            start, size = offsets[module]
            if leaf == "weight":
                return layer.qkv_weight, (start, size)
            return layer.qkv_bias, (start, size)
        if module in mlp_offsets:
            return layer.gate_up_weight, (mlp_offsets[module], self.arch.intermediate_size)
        simple = {"o_proj": layer.o_weight, "down_proj": layer.down_weight, **_norm_names(self.arch, layer)}
        if layer.q_norm is not None and layer.k_norm is not None:
            simple.update(q_norm=layer.q_norm.weight, k_norm=layer.k_norm.weight)
        return simple.get(module), None

    def _scale_target(
        self,
        layer: DecoderLayer,
        module: str,
        part: str,
        offsets: dict[str, tuple[int, int]],
        mlp_offsets: dict[str, int],
    ) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
        """Where a held matrix's scale, zero points or input order (``part``: ``_scale``, ``_zero``, ``_perm``) go
        (:meth:`DecoderLayer.hold_fp8`, :meth:`DecoderLayer.hold_int`): the rows of its fused matrix's that its rows
        take (an input order, the fused matrix's whole). An FP8 scale per row is held [1, out] (``fp8_linear``'s) and
        taken here as the [out, 1] it is stored as; a scale a block is [out / rows, in / inputs], a row a block of
        rows; a GPTQ or AWQ matrix's are [out, groups], a row a row."""
        if module in offsets:
            matrix, rows = "qkv", offsets[module]
        elif module in mlp_offsets:
            matrix, rows = "gate_up", (mlp_offsets[module], self.arch.intermediate_size)
        else:
            matrix = {"o_proj": "o", "down_proj": "down", "qkv_proj": "qkv", "gate_up_proj": "gate_up"}.get(module, "")
            rows = None
        held = getattr(layer, f"{matrix}{part}", None)
        if held is None:
            return None, None
        if part == "_perm":  # (one order for a fused matrix's inputs: each part's, the same; load_weights checks)
            return held, None
        if layer.int_form is not None:
            return held, rows
        if layer.fp8_block is None:
            return held.view(-1, 1), rows
        per = layer.fp8_block[0]
        return held, None if rows is None else (rows[0] // per, rows[1] // per)

    def _expected_names(self) -> set[str]:
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not None:
            names.add("lm_head.weight")
        fused = self.arch.fused_projections
        qkv = ["qkv_proj"] if "qkv_proj" in fused else ["q_proj", "k_proj", "v_proj"]
        for i in range(self.arch.num_layers):
            p = f"model.layers.{i}."
            dense = [p + f"self_attn.{m}.weight" for m in (*qkv, "o_proj")]
            if self.arch.qkv_bias:
                names.update(p + f"self_attn.{m}.bias" for m in ("q_proj", "k_proj", "v_proj"))
            if self.arch.o_bias:
                names.add(p + "self_attn.o_proj.bias")
            if self.arch.attention_sinks:
                names.add(p + "self_attn.sinks")
            moe = self.layers[i].moe
            if moe is not None:
                names.update(f"{p}{moe.block}.{n}" for n in moe.expected_names())
            else:
                mlp = (
                    ("gate_up_proj", "down_proj") if "gate_up_proj" in fused else ("gate_proj", "up_proj", "down_proj")
                )
                dense += [p + f"mlp.{m}.weight" for m in mlp]
            names.update(dense)
            if self.layers[i].held_as_stored:  # (a quantized checkpoint's matrices held as stored: their scales too)
                names.update(n + "_scale" for n in dense)
            if self.layers[i].int_form is not None:  # (and a GPTQ or AWQ checkpoint's zero points, input orders)
                names.update(n + "_zero" for n in dense)
                if getattr(self.layers[i], "qkv_perm", None) is not None:
                    names.update(n + "_perm" for n in dense)
            names.update(p + f"{n}.weight" for n in _norm_names(self.arch, self.layers[i]))
            if self.arch.qk_norm:
                names.update(p + f"self_attn.{m}.weight" for m in ("q_norm", "k_norm"))
        return names
