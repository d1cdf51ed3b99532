"""Python face of ``cpu_kernels.cpp``: packed fp32 matmuls with fused epilogues, RMSNorm, RoPE.

On 2 AVX2 cores the packed matmul runs the decoder's four matrices at ~115 GFLOPS for a
32-token decode step (MKL ~85 on the same shapes) and ~150 for a 2048-token prefill step, and
its epilogues fold the residual adds and SiLU(gate) * up into the matmuls. :func:`available`
says whether the library loaded; callers keep their PyTorch path otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from boundless import native
from boundless.native import F, I, L, P

_SIGNATURES = {
    "bl_abi_version": (I, []),
    "bl_pack": (None, [P, L, L, L, P, I]),
    "bl_pack_glu": (None, [P, L, L, L, P, I]),
    "bl_pack_glu_bias": (None, [P, L, P]),
    "bl_gemm": (None, [P, L, L, L, P, L, P, P, L, I, I]),
    "bl_rmsnorm": (None, [P, L, P, P, L, L, L, F, I]),
    "bl_rope": (None, [P, L, L, L, L, L, P, P, P, P, P, L, F, I]),
    "bl_layer_in": (None, [P, P, F, P, L, L, P, P, L, P, L, L, L, P, P, P, P, P, L, I]),
    "bl_layer_out": (None, [P, L, P, L, L, P, P, F, P, P, L, P, P, I]),
    "bl_argmax_rows": (None, [P, L, L, L, P]),
    "bl_lora_add": (None, [P, L, P, L, L, P, P, P, L, L, L, P, L, I]),
}

_PANEL = 24  # output features per packed panel (NR in the C++ source)
STORE, ACCUMULATE, GLU = 0, 1, 2


_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")


def _lib():
    return native.load("cpu_kernels", _SOURCE, _SIGNATURES)


def available() -> bool:
    return _lib() is not None


def usable(t: torch.Tensor) -> bool:
    """Whether tensors like ``t`` (device, dtype) can take the native path."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and available()


def _rows_ok(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1


class PackedWeight:
    """A weight [N, K] (and bias [N]) packed once for :meth:`matmul`.

    ``glu=True`` takes a fused gate/up weight [2I, K] and makes ``matmul`` return
    ``silu(x @ gate.T) * (x @ up.T)`` [*, I] directly.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        glu: bool = False,
        storage: torch.Tensor | None = None,
    ) -> None:
        lib = _lib()
        assert lib is not None and weight.dtype == torch.float32 and weight.dim() == 2
        weight = weight.detach().contiguous()
        n, k = weight.shape
        self.glu = glu
        self.in_features = k
        self.out_features = n // 2 if glu else n
        size = self.packed_size(weight.shape, glu)
        if storage is None:
            storage = torch.empty(size, dtype=torch.float32)
        assert storage.dtype == torch.float32 and storage.is_contiguous() and storage.numel() == size
        self.packed = storage
        panels = size // (k * _PANEL)
        nt = native.threads()
        if glu:
            lib.bl_pack_glu(weight.data_ptr(), k, self.out_features, k, self.packed.data_ptr(), nt)
        else:
            lib.bl_pack(weight.data_ptr(), k, n, k, self.packed.data_ptr(), nt)
        self.bias = None
        if bias is not None:
            bias = bias.detach().float().contiguous()
            self.bias = torch.zeros(panels * _PANEL, dtype=torch.float32)
            if glu:
                lib.bl_pack_glu_bias(bias.data_ptr(), self.out_features, self.bias.data_ptr())
            else:
                self.bias[:n] = bias

    @staticmethod
    def packed_size(shape: tuple[int, int] | torch.Size, glu: bool = False) -> int:
        """Floats the packed form of a weight of ``shape`` takes."""
        n, k = shape
        per_panel = _PANEL // 2 if glu else _PANEL
        return -(-(n // 2 if glu else n) // per_panel) * k * _PANEL

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """``x @ W.T (+ bias)`` into ``out`` (rows contiguous), or added to it with ``accumulate``."""
        assert _rows_ok(x) and x.shape[1] == self.in_features and x.dtype == torch.float32
        m = x.shape[0]
        if out is None:
            assert not accumulate
            out = torch.empty(m, self.out_features, dtype=torch.float32)
        assert _rows_ok(out) and out.shape == (m, self.out_features)
        mode = GLU if self.glu else (ACCUMULATE if accumulate else STORE)
        assert not (self.glu and accumulate)
        _lib().bl_gemm(
            x.data_ptr(),
            x.stride(0),
            m,
            self.in_features,
            self.packed.data_ptr(),
            self.out_features,
            None if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            mode,
            native.threads(),
        )
        return out

    def glu_halves(self, x: torch.Tensor) -> torch.Tensor:
        """A GLU weight's ``x @ [gate; up].T (+ bias)`` before the activation, [*, 2I] with the gates first: the
        packed matmul stores each panel's 12 gate and 12 up features side by side, which are put back in order
        (LoRA adds its share to gate and up before SiLU)."""
        assert self.glu and _rows_ok(x) and x.shape[1] == self.in_features and x.dtype == torch.float32
        m, width = x.shape[0], self.packed.numel() // self.in_features  # panels x 24 columns
        raw = torch.empty(m, width, dtype=torch.float32)
        _lib().bl_gemm(
            x.data_ptr(),
            x.stride(0),
            m,
            self.in_features,
            self.packed.data_ptr(),
            width,
            None if self.bias is None else self.bias.data_ptr(),
            raw.data_ptr(),
            raw.stride(0),
            STORE,
            native.threads(),
        )
        halves = raw.view(m, width // _PANEL, 2, _PANEL // 2).transpose(1, 2).reshape(m, 2, -1)
        return halves[:, :, : self.out_features].reshape(m, 2 * self.out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` row by row, into ``out``."""
    assert _rows_ok(x) and _rows_ok(out) and weight.is_contiguous() and out.shape == x.shape
    t, h = x.shape
    _lib().bl_rmsnorm(
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), t, h, eps, native.threads()
    )
    return out


class HeadNorm(NamedTuple):
    """Qwen3's RMSNorm over each head of q and k before RoPE: the weights [head_dim] of the query heads (the first
    ``q_heads`` of a row) and of the key heads, and the norm's epsilon."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    q_heads: int
    eps: float

    def args(self) -> tuple[int, int, int, float]:
        return self.q_weight.data_ptr(), self.k_weight.data_ptr(), self.q_heads, self.eps


_NO_HEAD_NORM = (None, None, 0, 0.0)


def rope_(
    x: torch.Tensor,
    heads: int,
    head_dim: int,
    rotary_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_norm: HeadNorm | None = None,
) -> None:
    """Rotate, in place, the leading ``rotary_dim`` dimensions of the first ``heads`` heads of every row of ``x``
    [tokens, >= heads * head_dim] (rotate-half layout within them); ``cos``/``sin`` [positions, rotary_dim / 2] are
    indexed by ``positions``. With ``head_norm``, each head is normalized first (Qwen3)."""
    # (rotary_dim 0: a layer without RoPE, SmolLM3's; only the heads' norms, if any, are applied)
    assert _rows_ok(x) and x.shape[1] >= heads * head_dim and rotary_dim in (0, cos.shape[1] * 2)
    assert rotary_dim <= head_dim
    assert positions.dtype == torch.long and positions.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    norm = _NO_HEAD_NORM if head_norm is None else head_norm.args()
    _lib().bl_rope(
        x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, rotary_dim, positions.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), *norm, native.threads(),
    )  # fmt: skip


def layer_in(
    hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    x: torch.Tensor,
    qkv_weight: PackedWeight,
    qkv: torch.Tensor,
    rot_heads: int,
    head_dim: int,
    rotary_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_norm: HeadNorm | None = None,
) -> None:
    """A layer up to attention, in one call: ``x = rms_norm(hidden)``, ``qkv = x @ Wqkv.T (+ bias)``,
    then RoPE on the leading ``rotary_dim`` dimensions of the first ``rot_heads`` heads of each row (each head
    normalized first, with ``head_norm``; its epsilon is ``eps``'s). Every tensor is row-contiguous (the caller
    checks shapes once per step)."""
    t, h = hidden.shape
    bias = qkv_weight.bias
    q_norm, k_norm, q_heads, _ = _NO_HEAD_NORM if head_norm is None else head_norm.args()
    _lib().bl_layer_in(
        hidden.data_ptr(), norm_weight.data_ptr(), eps, x.data_ptr(), t, h, qkv_weight.packed.data_ptr(),
        None if bias is None else bias.data_ptr(), qkv_weight.out_features, qkv.data_ptr(), rot_heads, head_dim,
        rotary_dim, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_norm, k_norm, q_heads, native.threads(),
    )  # fmt: skip


def layer_out(
    attn: torch.Tensor,
    hidden: torch.Tensor,
    o_weight: PackedWeight,
    norm_weight: torch.Tensor,
    eps: float,
    x: torch.Tensor,
    gate_up_weight: PackedWeight,
    act: torch.Tensor,
    down_weight: PackedWeight,
) -> None:
    """A layer after attention, in one call: ``hidden += attn @ Wo.T``, ``x = rms_norm(hidden)``,
    ``act = silu(x @ Wg.T) * (x @ Wu.T)``, ``hidden += act @ Wd.T``."""
    t, h = hidden.shape
    _lib().bl_layer_out(
        attn.data_ptr(), attn.shape[1], hidden.data_ptr(), t, h, o_weight.packed.data_ptr(), norm_weight.data_ptr(),
        eps, x.data_ptr(), gate_up_weight.packed.data_ptr(), gate_up_weight.out_features, act.data_ptr(),
        down_weight.packed.data_ptr(), native.threads(),
    )  # fmt: skip


LORA_MAX_RANK = 512  # (the kernel's stack buffer)


def lora_add_(
    x: torch.Tensor,
    rows: slice | torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    spans: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out[rows] += (x[rows] @ a.T) @ bt`` in place: a LoRA adapter's share of a projection for its rows (a slice, or
    int64 indices), ``bt`` being ``B`` transposed [rank, N] and ``spans`` [rank, 2] each rank column's nonzero
    columns of ``B``. One call for every row, where PyTorch takes four small ops."""
    assert _rows_ok(x) and _rows_ok(out) and a.is_contiguous() and bt.is_contiguous() and spans.is_contiguous()
    rank, k = a.shape
    assert rank <= LORA_MAX_RANK and x.shape[1] == k and bt.shape == (rank, out.shape[1])
    if isinstance(rows, slice):
        index, first, count = None, rows.start, rows.stop - rows.start
    else:
        assert rows.dtype == torch.long and rows.is_contiguous()
        index, first, count = rows.data_ptr(), 0, rows.numel()
    _lib().bl_lora_add(
        x.data_ptr(), x.stride(0), index, first, count, a.data_ptr(), bt.data_ptr(), spans.data_ptr(), rank, k,
        out.shape[1], out.data_ptr(), out.stride(0), native.threads(),
    )  # fmt: skip


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for fp32 CPU rows [R, N]: a vectorized max, then a scan for its first
    index, where PyTorch's argmax took ~6 ms for a 32 x 49K decode step (a tenth of the LM head)."""
    if not (usable(x) and _rows_ok(x)):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    _lib().bl_argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    if x.shape[0] and out.numpy().min() < 0:  # a NaN: torch's rule decides
        return x.argmax(dim=-1)
    return out
