"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): each token's hidden state goes to its top-k experts, chosen
by a router, and their outputs are summed with the router's weights.

The experts' weights are stacked, as transformers 5 keeps them: ``gate_up`` [experts, 2 * intermediate, hidden]
(gate rows, then up rows) and ``down`` [experts, hidden, intermediate]. Checkpoints on disk name each expert's
matrices apart (Qwen3-MoE's ``mlp.experts.{e}.gate_proj.weight``..., Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``, ``w3`` up and ``w2`` down); :meth:`SparseMoE.target` places them.

A step groups its tokens by expert (one sort), so each expert that any token chose runs one matmul pair over all of
its tokens: with few tokens (decoding) that is at most ``tokens * top_k`` experts' weights read, not all of them.
gpt-oss's experts have biases (as has its router), interleave gate and up by column and clamp both before a SwiGLU of
their own (``ModelArch.swiglu_limit``); its checkpoints stack them transposed, ``gate_up_proj`` [experts, hidden,
2 * intermediate] and ``down_proj`` [experts, intermediate, hidden], put in this layout as they load
(:meth:`SparseMoE.as_loaded`).

Choosing the experts so reads the routing back to the host (which experts, how many tokens each): the CPU's path. The
GPU's (:meth:`SparseMoE.forward_fused`) groups the tokens on the device and runs each product as one Triton launch
over all experts (``model/fused_moe.py``), with no read back, so its decode steps are captured in CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from boundless.model.arch import ModelArch
from boundless.model.fp8_linear import FP8, Fp8Stack, fp8_linear, quantizable, quantize_rows, quantize_stack
from boundless.model.int_stack import IntStack
from boundless.model.mxfp4 import Mxfp4Stack

if TYPE_CHECKING:
    from boundless.model.cpu_kernels import PackedWeight


# gpt-oss's expert tensors that load in another layout (SparseMoE.as_loaded), by their dimensions.
_GPT_OSS_DIMS = {
    "experts.gate_up_proj": 3, "experts.gate_up_proj_bias": 2, "experts.down_proj": 3,
    "experts.gate_up_proj_blocks": 4, "experts.gate_up_proj_scales": 3,
}  # fmt: skip


# gpt-oss's MXFP4 tensors by their checkpoint's names (below the block), and the parameters that hold them
# (SparseMoE.hold_mxfp4).
_MXFP4_PARAMETERS = {
    f"experts.{stack}_proj_{part}": f"{stack}_{part}" for stack in ("gate_up", "down") for part in ("blocks", "scales")
}


def blocks_tile(block: tuple[int, int], inter: int, hidden: int) -> bool:
    """Whether blocks of ``block`` (rows, inputs) tile every expert matrix, [2 * inter, hidden] and [hidden, inter]
    (gate's and up's rows apart: a block of rows never straddles them)."""
    rows, cols = block
    return not (inter % rows or hidden % rows or inter % cols or hidden % cols)


class SparseMoE(nn.Module):
    """The router and the stacked experts of one sparse layer."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        experts, inter, hidden = arch.num_experts, arch.moe_intermediate_size, arch.hidden_size
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.inter = inter
        # Each expert's matrices by their checkpoint names: Mixtral's w1 (gate), w3 (up), w2 (down).
        mixtral = arch.model_type == "mixtral"
        self.block = "block_sparse_moe" if mixtral else "mlp"
        self.names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {
            "gate": "gate_proj", "up": "up_proj", "down": "down_proj"
        }  # fmt: skip
        self.router = nn.Parameter(torch.empty(experts, hidden))
        # gpt-oss's: the router's and the experts' biases, and its clamped SwiGLU's limit and gain (None: SiLU * up).
        biased = arch.expert_biases
        self.router_bias = nn.Parameter(torch.zeros(experts)) if biased else None
        self.gate_up_bias = nn.Parameter(torch.zeros(experts, 2 * inter)) if biased else None
        self.down_bias = nn.Parameter(torch.zeros(experts, hidden)) if biased else None
        self.swiglu_limit = arch.swiglu_limit
        self.swiglu_alpha = arch.swiglu_alpha
        # GLM-4.5's (DeepSeek-V3's routing): sigmoid scores, each expert's correction of its score for choosing it
        # (held in fp32 whatever the model's type, as transformers holds it), groups of experts, a scale of the
        # weights; and its shared experts, a dense MLP every token takes beside the routed ones.
        self.groups, self.groups_chosen = arch.expert_groups, arch.expert_groups_chosen
        self.routed_scaling_factor = arch.routed_scaling_factor
        self.score_bias = nn.Parameter(torch.zeros(experts)) if arch.expert_score == "sigmoid" else None
        shared = arch.num_shared_experts * inter
        self.shared_gate_up = nn.Parameter(torch.empty(2 * shared, hidden)) if shared else None
        self.shared_down = nn.Parameter(torch.empty(hidden, shared)) if shared else None
        self.packed_shared: tuple[PackedWeight, PackedWeight] | None = None
        # --quantization fp8: the shared experts' matrices in e4m3, a scale per output row [1, out] (quantize_fp8).
        self.shared_gate_up_scale: torch.Tensor | None = None
        self.shared_down_scale: torch.Tensor | None = None
        # On the CPU in fp32 (LlamaModel.prepare): the router packed for the native kernel, whose product gives a row
        # the same logits whatever rows share its step (PyTorch's CPU product sums a lone row otherwise: its experts'
        # weights, and even its experts, changed with the batch).
        self.packed_router: PackedWeight | None = None
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, inter))
        # How the two stacks are held, if not in the model's type: "mxfp4" (gpt-oss's, as its checkpoints hold them:
        # hold_mxfp4; parameters gate_up_blocks, gate_up_scales, down_blocks and down_scales in their place) or "fp8"
        # (--quantization fp8: quantize_fp8; gate_up and down in e4m3, gate_up_scale and down_scale beside them) or
        # "int" (a GPTQ or AWQ checkpoint's: hold_int; gate_up and down their codes, with _scale and _zero).
        self.held: str | None = None
        self.fp8_block = (1, 0)  # held in fp8: the block a scale covers (rows, inputs; 0 inputs: the whole row)
        self.int_form = (4, -1)  # held as GPTQ or AWQ pack them ("int": hold_int): (bits, group size, -1: a row)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> SparseMoE:
        # (GLM-4.5's router and its correction stay in fp32 whatever the model's type, as transformers and vLLM hold
        # them: a cast to the model's type only moves them.)
        kept = [] if self.score_bias is None else [(p, p.data) for p in (self.router, self.score_bias)]
        super()._apply(fn, recurse)
        for param, before in kept:
            if param.dtype != torch.float32:
                param.data = before.to(param.device)
        return self

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [tokens, top_k] and their weights, as transformers' router computes them: a softmax
        in fp32 over the router's logits, the top k, renormalized to sum to one with ``norm_topk_prob`` (the weights
        in ``x``'s type); or GLM-4.5's sigmoid scores (:meth:`_sigmoid_route`, the weights in fp32)."""
        packed = self.packed_router
        if packed is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            logits = packed.matmul(x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, x.shape[-1]).contiguous())
        elif self.score_bias is not None:  # (GLM-4.5's router: in fp32, as transformers runs it)
            logits = F.linear(x.float(), self.router)
        else:
            logits = F.linear(x, self.router, self.router_bias)
        if self.score_bias is not None:
            return self._sigmoid_route(logits)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def _sigmoid_route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GLM-4.5's (DeepSeek-V3's) choice, as transformers' Glm4MoeTopkRouter makes it: sigmoid scores; each group's
        worth its two best corrected scores (score plus ``score_bias``), the best ``groups_chosen`` groups kept; the
        top k corrected scores among them; their plain scores renormalized (``norm_topk_prob``) and scaled by
        ``routed_scaling_factor``, in fp32 (each expert's rounded output is weighted in fp32 and rounded once, as
        transformers weights it)."""
        assert self.score_bias is not None
        scores = logits.float().sigmoid()
        choice = scores + self.score_bias
        if self.groups > 1:
            per_group = choice.shape[-1] // self.groups
            group_scores = choice.view(-1, self.groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
            kept = torch.topk(group_scores, self.groups_chosen, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores).scatter_(1, kept, 1).bool().repeat_interleave(per_group, dim=1)
            choice = choice.masked_fill(~mask, float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.routed_scaling_factor

    def shared(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor | None:
        """The shared experts' output for rows ``x`` (None without them): a SiLU-gated MLP, on the native kernels
        where packed (:meth:`pack`), in one Triton kernel's activation on the GPU path (``fused``)."""
        if self.shared_gate_up is None or self.shared_down is None:
            return None
        packed = self.packed_shared
        if packed is not None and not fused and x.device.type == "cpu" and x.dtype == torch.float32:
            return packed[1].matmul(packed[0].matmul(x.contiguous()))
        gate_up = self._shared_product(x, self.shared_gate_up, self.shared_gate_up_scale)
        if fused:
            from boundless.model import triton_ops

            return self._shared_product(triton_ops.silu_mul(gate_up), self.shared_down, self.shared_down_scale)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._shared_product(F.silu(gate) * up, self.shared_down, self.shared_down_scale)

    @staticmethod
    def _shared_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """``x`` times a shared expert's matrix: in e4m3 with its scale per row (``fp8_linear``; on the CPU the
        matrix dequantized, as the native path packs it: PyTorch's CPU ``_scaled_mm`` sums a row otherwise in
        another batch), or as it is."""
        if scale is None:
            return F.linear(x, weight)
        if x.device.type == "cpu":
            return F.linear(x, (weight.float() * scale.t()).to(x.dtype))
        return fp8_linear(x, weight, scale, None)

    def shared_matrices(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared experts' gate/up and down in ``dtype`` (dequantized when in e4m3), or None without them."""
        if self.shared_gate_up is None or self.shared_down is None:
            return None
        pairs = ((self.shared_gate_up, self.shared_gate_up_scale), (self.shared_down, self.shared_down_scale))
        gate_up, down = (w.to(dtype) if s is None else (w.float() * s.t()).to(dtype) for w, s in pairs)
        return gate_up, down

    def hold_mxfp4(self) -> None:
        """Hold the experts' two stacks as MXFP4 blocks and scales (uint8 ``[experts, out, in / 32, 16]`` and
        ``[experts, out, in / 32]``, gpt-oss's checkpoint's own, gate and up rows put apart as they load): a quarter of
        bfloat16's bytes, read by the GPU path's kernels as they are (``fused_moe``), dequantized an expert at a time
        on the others. Made on the meta device, before the weights are allocated and loaded."""
        if self.gate_up_bias is None:
            raise ValueError("only gpt-oss's experts are held in MXFP4")
        if self.held is not None:
            raise ValueError(f"the experts are held in {self.held} already")
        for name in ("gate_up", "down"):
            weight = getattr(self, name)
            experts, rows, cols = weight.shape
            if cols % 32:
                raise ValueError(f"MXFP4 blocks hold 32 values: the experts' {cols} inputs are not a multiple of 32")
            for part, shape in (("blocks", (experts, rows, cols // 32, 16)), ("scales", (experts, rows, cols // 32))):
                param = nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=weight.device), requires_grad=False)
                self.register_parameter(f"{name}_{part}", param)
            self.register_parameter(name, None)
        self.held = "mxfp4"

    def hold_fp8(self, block: tuple[int, int]) -> None:
        """Hold the experts' two stacks as an FP8 checkpoint stores them (Qwen3-MoE's): e4m3 weights, a scale each
        ``block`` (rows, inputs) in ``gate_up_scale`` and ``down_scale``, gate's and up's scale rows stacked as their
        rows are; half a 16-bit model's bytes, read by the GPU path's kernels as they are. Made on the meta device,
        before the weights are allocated and loaded."""
        if self.held is not None:
            raise ValueError(f"the experts are held in {self.held} already")
        if not blocks_tile(block, self.inter, self.router.shape[1]):
            raise ValueError(f"FP8 blocks of {block[0]} x {block[1]} do not tile the experts' matrices")
        rows, cols = block
        for name in ("gate_up", "down"):
            weight = getattr(self, name)
            experts, out, inputs = weight.shape
            setattr(self, name, nn.Parameter(torch.empty_like(weight, dtype=FP8), requires_grad=False))
            scales = torch.empty(experts, out // rows, inputs // cols, device=weight.device)
            self.register_parameter(f"{name}_scale", nn.Parameter(scales, requires_grad=False))
        self.held, self.fp8_block = "fp8", block

    def hold_int(self, bits: int, group_size: int) -> None:
        """Hold the experts' two stacks as a GPTQ or AWQ checkpoint packs them (Qwen3-MoE's ``*-GPTQ-Int4``), in
        ``bits`` (4 or 8) a weight with a scale and a zero point a group of ``group_size`` inputs (-1: a matrix's
        all), as :class:`~boundless.model.int_stack.IntStack` lays them out (``gate_up``/``down`` their codes,
        ``_scale`` and ``_zero`` beside them; gate's and up's rows stacked): a quarter of a 16-bit model's bytes in 4
        bits, read by the GPU path's kernels as they are. Made on the meta device, before the weights are allocated
        and loaded."""
        if self.held is not None:
            raise ValueError(f"the experts are held in {self.held} already")
        for name in ("gate_up", "down"):
            weight = getattr(self, name)
            experts, out, inputs = weight.shape
            groups = 1 if group_size == -1 else inputs // group_size
            codes = torch.empty(experts, out, inputs * bits // 8, dtype=torch.uint8, device=weight.device)
            setattr(self, name, nn.Parameter(codes, requires_grad=False))
            for part, dtype in (("scale", torch.float32), ("zero", torch.uint8)):
                held = torch.empty(experts, out, groups, dtype=dtype, device=weight.device)
                self.register_parameter(f"{name}_{part}", nn.Parameter(held, requires_grad=False))
        self.held, self.int_form = "int", (bits, group_size)

    def quantize_fp8(self) -> None:
        """``--quantization fp8``: the two stacks in e4m3 with a scale per expert's output row (vLLM's FP8 mixture
        holds them so too), half a 16-bit model's bytes, read by the GPU path's kernels as they are; dequantized an
        expert at a time on the others. Experts held in MXFP4 (or otherwise as stored) stay so. The shared experts'
        matrices too (GLM-4.5's: ~4 GB of its 16-bit bytes), as a dense layer's are, where ``_scaled_mm`` takes
        them."""
        for name in ("shared_gate_up", "shared_down"):
            weight = getattr(self, name)
            if weight is not None and weight.dtype != FP8 and quantizable(weight):
                q, scale = quantize_rows(weight.data)
                setattr(self, name, nn.Parameter(q, requires_grad=False))
                setattr(self, f"{name}_scale", scale)
        if self.held is not None:
            return
        for name in ("gate_up", "down"):
            stack = quantize_stack(getattr(self, name).data)
            setattr(self, name, nn.Parameter(stack.weight, requires_grad=False))
            self.register_parameter(f"{name}_scale", nn.Parameter(stack.scales, requires_grad=False))
        self.held = "fp8"

    def stack(self, name: str) -> torch.Tensor | Mxfp4Stack | Fp8Stack | IntStack:
        """The stack ``name`` (``gate_up`` or ``down``) as held (:attr:`held`). (Looked up each time: moving the
        module, as ``to_empty`` does, replaces its parameters.)"""
        if self.held == "mxfp4":
            return Mxfp4Stack(getattr(self, f"{name}_blocks"), getattr(self, f"{name}_scales"))
        if self.held == "fp8":
            return Fp8Stack(getattr(self, name), getattr(self, f"{name}_scale"), self.fp8_block)
        if self.held == "int":
            codes, (bits, group_size) = getattr(self, name), self.int_form
            group = codes.shape[2] * 8 // bits if group_size == -1 else group_size
            return IntStack(codes, getattr(self, f"{name}_scale"), getattr(self, f"{name}_zero"), bits, group)
        return getattr(self, name)

    def expert(self, index: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``index``'s gate/up [2 * inter, hidden] and down [hidden, inter], dequantized into ``dtype`` when
        held quantized."""
        gate_up, down = self.stack("gate_up"), self.stack("down")
        if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor):
            return gate_up[index], down[index]
        assert not isinstance(gate_up, torch.Tensor) and not isinstance(down, torch.Tensor)
        return gate_up.dequantized(index, dtype), down.dequantized(index, dtype)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gated activation of an expert's gate and up halves side by side: ``SiLU(gate) * up``, or gpt-oss's
        clamped SwiGLU (``swiglu_limit``), as transformers' GptOssExperts computes it."""
        gate, up = gate_up.chunk(2, dim=-1)
        limit, alpha = self.swiglu_limit, self.swiglu_alpha
        if limit is None or alpha is None:  # (ModelArch has both or neither)
            return F.silu(gate) * up
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    @property
    def glu_epilogue(self) -> bool:
        """Whether the native kernel's gate/up matmul applies the activation (SiLU(gate) * up) as it ends; gpt-oss's
        clamped SwiGLU follows its plain product instead."""
        return self.swiglu_limit is None

    def packed_size(self) -> int:
        """The floats :meth:`pack` takes for every expert."""
        from boundless.model.cpu_kernels import PackedWeight

        glu, hidden = self.glu_epilogue, self.router.shape[1]
        each = PackedWeight.packed_size((2 * self.inter, hidden), glu) + PackedWeight.packed_size((hidden, self.inter))
        shared = 0
        if self.shared_gate_up is not None and self.shared_down is not None:
            shared = PackedWeight.packed_size(self.shared_gate_up.shape, True)
            shared += PackedWeight.packed_size(self.shared_down.shape)
        return self.router.shape[0] * each + shared

    def pack(
        self, storage: Callable[[torch.Tensor, bool], torch.Tensor] | None = None
    ) -> list[tuple[PackedWeight, PackedWeight]]:
        """Each expert's gate/up and down (with their biases) packed for the native CPU kernels, the router too
        (:attr:`packed_router`); ``storage(weight, glu)``: where each packed matrix goes (a fresh tensor if None)."""
        from boundless.model.cpu_kernels import PackedWeight

        def packed(weight: torch.Tensor, bias: torch.Tensor | None, glu: bool = False) -> PackedWeight:
            return PackedWeight(weight, bias, glu=glu, storage=None if storage is None else storage(weight, glu))

        self.packed_router = PackedWeight(self.router, self.router_bias)
        if (shared := self.shared_matrices(torch.float32)) is not None:  # (the native kernels take fp32)
            self.packed_shared = (packed(shared[0], None, True), packed(shared[1], None))
        gate_up_bias, down_bias = self.gate_up_bias, self.down_bias
        packed_experts = []
        for e in range(self.router.shape[0]):
            gate_up, down = self.expert(e, torch.float32)  # (the native kernels take fp32)
            packed_experts.append((
                packed(gate_up, None if gate_up_bias is None else gate_up_bias[e], self.glu_epilogue),
                packed(down, None if down_bias is None else down_bias[e]),
            ))  # fmt: skip
        return packed_experts

    def forward(self, x: torch.Tensor, packed: Sequence[tuple[PackedWeight, PackedWeight]] = ()) -> torch.Tensor:
        """The experts' weighted sum for each row of ``x`` [tokens, hidden]. ``packed``: each expert's gate/up and
        down packed for the native CPU kernels (:meth:`pack`), else PyTorch."""
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.router.shape[0]).tolist()  # (the one read to the host)
        tokens = order // self.top_k
        picked = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start : start + count]
            if packed:
                gate_up, down = packed[expert]
                product = gate_up.matmul(x[rows])  # (with the SiLU epilogue, the activation already)
                y = down.matmul(product if self.glu_epilogue else self.activate(product))
            else:
                gate_up_bias, down_bias = self.gate_up_bias, self.down_bias
                gate_up_weight, down_weight = self.expert(expert, x.dtype)
                halves = F.linear(x[rows], gate_up_weight, None if gate_up_bias is None else gate_up_bias[expert])
                y = F.linear(self.activate(halves), down_weight, None if down_bias is None else down_bias[expert])
            out.index_add_(0, rows, (y * picked[start : start + count, None]).to(out.dtype))
            start += count
        shared = self.shared(x)
        return out if shared is None else out + shared

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` on the GPU path (and in Triton's interpreter): the experts' two products each one launch,
        the tokens grouped on the device (``fused_moe.expert_products``)."""
        from boundless.model import fused_moe, triton_ops

        experts, weights = self.route(x)
        activate = triton_ops.silu_mul if self.swiglu_limit is None else self.activate  # (one kernel for SiLU * up)
        biases = self.gate_up_bias, self.down_bias
        out = fused_moe.expert_products(
            x, experts, weights, self.stack("gate_up"), self.stack("down"), activate, *biases
        )
        shared = self.shared(x, fused=True)
        return out if shared is None else out + shared

    def target(self, name: str) -> tuple[torch.Tensor, tuple[int, int] | None] | None:
        """Where a checkpoint tensor named ``name`` (below the layer's :attr:`block`) goes: (the parameter, or one
        expert's slice of it; the rows within it), or None for a name that is not this block's."""
        parts = name.split(".")
        if parts == ["gate", "weight"]:
            return self.router, None
        if parts == ["gate", "e_score_correction_bias"] and self.score_bias is not None:
            return self.score_bias, None
        if parts[0] == "shared_experts" and self.shared_gate_up is not None and parts[2:] == ["weight"]:
            shared = self.shared_gate_up.shape[0] // 2
            rows = {"gate_proj": (0, shared), "up_proj": (shared, shared)}.get(parts[1])
            if rows is not None:
                return self.shared_gate_up, rows
            return (self.shared_down, None) if parts[1] == "down_proj" and self.shared_down is not None else None
        biases = {
            "router.bias": self.router_bias, "experts.gate_up_proj_bias": self.gate_up_bias,
            "experts.down_proj_bias": self.down_bias,
        }  # fmt: skip
        if self.router_bias is not None and (name == "router.weight" or name in biases):  # (gpt-oss's names)
            return (self.router if name == "router.weight" else biases[name]), None  # type: ignore[return-value]
        if parts[:1] != ["experts"]:
            return None
        if self.held == "mxfp4":  # (gpt-oss's MXFP4 blocks and scales, held as they are)
            held = _MXFP4_PARAMETERS.get(name)
            return None if held is None else (getattr(self, held), None)
        if parts[1:] == ["gate_up_proj"]:  # transformers 5's stacked form
            return self.gate_up, None
        if parts[1:] == ["down_proj"]:
            return self.down, None
        # (An FP8 checkpoint's scales, a GPTQ or AWQ checkpoint's scales and zero points, held as stored.)
        held_leaves = {"fp8": ("weight_scale",), "int": ("weight_scale", "weight_zero")}.get(self.held or "", ())
        if len(parts) != 4 or not parts[1].isdigit() or not (parts[3] == "weight" or parts[3] in held_leaves):
            return None
        expert = int(parts[1])
        if expert >= self.router.shape[0]:
            return None
        names = self.names
        suffix = parts[3].removeprefix("weight")
        # (An FP8 scale's rows: one a block of rows.)
        inter = self.inter // self.fp8_block[0] if suffix and self.held == "fp8" else self.inter
        gate_up, down = (getattr(self, f"{stack}{suffix}") for stack in ("gate_up", "down"))
        rows = {names["gate"]: (0, inter), names["up"]: (inter, inter)}.get(parts[2])
        if rows is not None:
            return gate_up[expert], rows
        return (down[expert], None) if parts[2] == names["down"] else None

    def as_loaded(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor named ``name`` (below the block) in this layout: gpt-oss's stacked experts transposed,
        their gate and up columns (and biases, and the rows of MXFP4 blocks and scales) de-interleaved (gate the even
        ones, up the odd ones, as transformers' GptOssExperts reads them) into gate's half then up's; any other as it
        is (as is one of another shape: the caller refuses it)."""
        if name in _MXFP4_PARAMETERS and tensor.dtype != torch.uint8:  # (a cast would make bytes of other values)
            raise ValueError(f"MXFP4 {name} are uint8, not {tensor.dtype}")
        if self.gate_up_bias is None or tensor.dim() != _GPT_OSS_DIMS.get(name):
            return tensor
        if name == "experts.down_proj":
            return tensor.transpose(1, 2)
        interleaved = tensor.transpose(1, 2) if name == "experts.gate_up_proj" else tensor  # (along dimension 1)
        return torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], dim=1)

    def loaded_names(self, name: str) -> list[str]:
        """The per-expert names (:meth:`expected_names`') a tensor :meth:`target` placed stands for: a stacked
        tensor, every expert's; any other, its own name (:meth:`target` takes only this block's names)."""
        experts = range(self.router.shape[0])
        if self.router_bias is not None:  # (gpt-oss's names are the stacked ones)
            return [name]
        if name == "experts.gate_up_proj":
            return [f"experts.{e}.{self.names[m]}.weight" for e in experts for m in ("gate", "up")]
        if name == "experts.down_proj":
            return [f"experts.{e}.{self.names['down']}.weight" for e in experts]
        return [name]

    def expected_names(self) -> list[str]:
        """The per-expert names a checkpoint holds this block's weights under, below the layer's :attr:`block`."""
        if self.router_bias is not None:
            stacked: tuple[str, ...] = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
            if self.held == "mxfp4":
                stacked = (*(name.removeprefix("experts.") for name in _MXFP4_PARAMETERS), *stacked[1::2])
            return ["router.weight", "router.bias", *(f"experts.{n}" for n in stacked)]
        names = ["gate.weight"]
        if self.score_bias is not None:
            names.append("gate.e_score_correction_bias")
        if self.shared_gate_up is not None:
            names += [f"shared_experts.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        # (Held as an FP8, GPTQ or AWQ checkpoint stores them: their scales and zero points too.)
        leaves = {"fp8": ("weight", "weight_scale"), "int": ("weight", "weight_scale", "weight_zero")}.get(
            self.held or "", ("weight",)
        )
        for e in range(self.router.shape[0]):
            names += [f"experts.{e}.{self.names[m]}.{leaf}" for m in ("gate", "up", "down") for leaf in leaves]
        return names
