"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): each token's hidden state goes to its top-k experts, chosen
by a router, and their outputs are summed with the router's weights.

The experts' weights are stacked, as transformers 5 keeps them: ``gate_up`` [experts, 2 * intermediate, hidden]
(gate rows, then up rows) and ``down`` [experts, hidden, intermediate]. Checkpoints on disk name each expert's
matrices apart (Qwen3-MoE's ``mlp.experts.{e}.gate_proj.weight``..., Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``, ``w3`` up and ``w2`` down); :meth:`SparseMoE.target` places them.

A step groups its tokens by expert (one sort), so each expert that any token chose runs one matmul pair over all of
its tokens: with few tokens (decoding) that is at most ``tokens * top_k`` experts' weights read, not all of them.
Choosing the experts reads the routing back to the host (which experts, how many tokens each), so a step with a
sparse layer cannot be captured in a CUDA graph: the runner runs such models eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from boundless.model.arch import ModelArch

if TYPE_CHECKING:
    from boundless.model.cpu_kernels import PackedWeight


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
        # On the CPU in fp32 (LlamaModel.prepare): the router packed for the native kernel, whose product gives a row
        # the same logits whatever rows share its step (PyTorch's CPU product sums a lone row otherwise: its experts'
        # weights, and even its experts, changed with the batch).
        self.packed_router: PackedWeight | None = None
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, inter))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [tokens, top_k] and their weights, as transformers' router computes them: a softmax
        in fp32 over the router's logits, the top k, renormalized to sum to one with ``norm_topk_prob``."""
        packed = self.packed_router
        if packed is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            logits = packed.matmul(x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, x.shape[-1]).contiguous())
        else:
            logits = F.linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, packed: Sequence[tuple[PackedWeight, PackedWeight]] = ()) -> torch.Tensor:
        """The experts' weighted sum for each row of ``x`` [tokens, hidden]. ``packed``: each expert's gate/up and
        down packed for the native CPU kernels (the activation in the first matmul's epilogue), else PyTorch."""
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
                y = down.matmul(gate_up.matmul(x[rows]))
            else:
                gate, up = F.linear(x[rows], self.gate_up[expert]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down[expert])
            out.index_add_(0, rows, y * picked[start : start + count, None])
            start += count
        return out

    def target(self, name: str) -> tuple[torch.Tensor, tuple[int, int] | None] | None:
        """Where a checkpoint tensor named ``name`` (below the layer's :attr:`block`) goes: (the parameter, or one
        expert's slice of it; the rows within it), or None for a name that is not this block's."""
        parts = name.split(".")
        if parts == ["gate", "weight"]:
            return self.router, None
        if parts[:1] != ["experts"]:
            return None
        if parts[1:] == ["gate_up_proj"]:  # transformers 5's stacked form
            return self.gate_up, None
        if parts[1:] == ["down_proj"]:
            return self.down, None
        if len(parts) != 4 or not parts[1].isdigit() or parts[3] != "weight":
            return None
        expert = int(parts[1])
        if expert >= self.router.shape[0]:
            return None
        names = self.names
        rows = {names["gate"]: (0, self.inter), names["up"]: (self.inter, self.inter)}.get(parts[2])
        if rows is not None:
            return self.gate_up[expert], rows
        return (self.down[expert], None) if parts[2] == names["down"] else None

    def loaded_names(self, name: str) -> list[str]:
        """The per-expert names (:meth:`expected_names`') a tensor :meth:`target` placed stands for: a stacked
        tensor, every expert's; any other, its own name (:meth:`target` takes only this block's names)."""
        experts = range(self.router.shape[0])
        if name == "experts.gate_up_proj":
            return [f"experts.{e}.{self.names[m]}.weight" for e in experts for m in ("gate", "up")]
        if name == "experts.down_proj":
            return [f"experts.{e}.{self.names['down']}.weight" for e in experts]
        return [name]

    def expected_names(self) -> list[str]:
        """The per-expert names a checkpoint holds this block's weights under, below the layer's :attr:`block`."""
        names = ["gate.weight"]
        for e in range(self.router.shape[0]):
            names += [f"experts.{e}.{self.names[m]}.weight" for m in ("gate", "up", "down")]
        return names
