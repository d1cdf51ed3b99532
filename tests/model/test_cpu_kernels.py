"""The native CPU kernels of the decoder against PyTorch: packed matmuls with their epilogues
(bias, accumulate, SiLU(gate) * up), RMSNorm, RoPE, the fused layer halves, and the model's
native path against its PyTorch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from boundless import native
from boundless.model import cpu_kernels
from boundless.model.loader import LoadedModel
from boundless.model.rope import apply_rotary, apply_rotary_

pytestmark = [
    pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels unavailable here"),
    pytest.mark.usefixtures("parallel_native_kernels"),  # (their parallel loops too, in make test's workers)
]

# (out features, in features, rows): panel and row-block tails, decode and prefill sizes.
SHAPES = [(960, 576, 32), (50, 16, 7), (24, 8, 1), (576, 1536, 3), (26, 16, 300), (3072, 64, 2048)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}k{}m{}".format(*s))
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matmul(shape: tuple[int, int, int], bias: bool) -> None:
    n, k, m = shape
    gen = torch.Generator().manual_seed(n + k + m)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    packed = cpu_kernels.PackedWeight(w, b)
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(packed.matmul(x).double(), expected, rtol=1e-5, atol=1e-4)
    acc = torch.randn(m, n, generator=gen)
    into = acc.clone()
    assert packed.matmul(x, out=into, accumulate=True) is into
    torch.testing.assert_close(into.double(), acc.double() + expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(3072, 576, 32), (26, 16, 300), (40, 8, 5)], ids=lambda s: "i{}k{}m{}".format(*s))
def test_packed_glu(shape: tuple[int, int, int]) -> None:
    two_i, k, m = shape
    gen = torch.Generator().manual_seed(two_i)
    w = torch.randn(two_i, k, generator=gen) * 0.2
    x = torch.randn(m, k, generator=gen)
    packed = cpu_kernels.PackedWeight(w, glu=True)
    gate, up = F.linear(x.double(), w.double()).chunk(2, dim=-1)
    torch.testing.assert_close(packed.matmul(x).double(), F.silu(gate) * up, rtol=1e-5, atol=1e-4)
    # Before the activation (LoRA adds its share there), gates first, with and without a bias; sizes not a multiple of
    # the panel's 12 features leave padding that must not show.
    bias = torch.randn(two_i, generator=gen)
    for b in (None, bias):
        halves = cpu_kernels.PackedWeight(w, b, glu=True).glu_halves(x)
        torch.testing.assert_close(
            halves.double(), F.linear(x.double(), w.double(), None if b is None else b.double()), rtol=1e-5, atol=1e-4
        )


def test_packed_matmul_strided_rows_and_storage() -> None:
    """Rows may sit in a wider buffer, and the packed weight may live in caller storage."""
    w = torch.randn(48, 20)
    storage = native.huge_page_empty(cpu_kernels.PackedWeight.packed_size(w.shape))
    packed = cpu_kernels.PackedWeight(w, storage=storage)
    wide = torch.randn(9, 30)
    x = wide[:, 5:25]
    out = torch.zeros(9, 64)[:, 8:56]
    packed.matmul(x, out=out)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-5)


def test_rms_norm() -> None:
    x = torch.randn(37, 576) * 3
    w = torch.randn(576)
    got = cpu_kernels.rms_norm(x, w, 1e-5, torch.empty_like(x))
    expected = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 64, 24])
def test_rope_in_place_matches_reference(head_dim: int) -> None:
    t, heads = 11, 5
    positions = torch.tensor([0, 3, 7, 100, 2, 9, 50, 51, 52, 1, 5])
    table = torch.randn(128, head_dim // 2)
    cos, sin = table.cos(), table.sin()
    x = torch.randn(t, heads * head_dim + 7)  # a row wider than the rotated heads
    expected = x.clone()
    rows = x[:, : heads * head_dim].view(t, heads, head_dim)
    expected_rows = apply_rotary(rows, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    expected[:, : heads * head_dim] = expected_rows.reshape(t, -1)
    torch_inplace = x.clone()
    apply_rotary_(
        torch_inplace[:, : heads * head_dim].view(t, heads, head_dim),
        cos[positions].unsqueeze(1),
        sin[positions].unsqueeze(1),
    )
    cpu_kernels.rope_(x, heads, head_dim, head_dim, positions, cos, sin)
    torch.testing.assert_close(x, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch_inplace, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(32, 24), (128, 96), (20, 2)])
def test_rope_of_part_of_each_head_leaves_the_rest(head_dim: int, rotary_dim: int) -> None:
    """A partial rotary factor (Phi-4-mini's 3/4): the leading ``rotary_dim`` dimensions of each head rotate
    (rotate-half within them, as transformers' Phi-3), the others and the rest of the row pass unchanged."""
    t, heads = 7, 3
    positions = torch.tensor([0, 5, 9, 77, 2, 3, 40])
    table = torch.randn(128, rotary_dim // 2)
    cos, sin = table.cos(), table.sin()
    x = torch.randn(t, (heads + 1) * head_dim)
    expected = x.clone()
    rows = expected[:, : heads * head_dim].view(t, heads, head_dim)
    rows[..., :rotary_dim] = apply_rotary(
        rows[..., :rotary_dim], cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    )
    cpu_kernels.rope_(x, heads, head_dim, rotary_dim, positions, cos, sin)
    torch.testing.assert_close(x, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(x[:, heads * head_dim :], expected[:, heads * head_dim :])


@pytest.mark.parametrize("head_dim", [16, 128, 20])
def test_rope_normalizes_each_head_first(head_dim: int) -> None:
    """Qwen3's head norm in the RoPE pass: each query head (the first 3) by the query weight, each key head by the
    key weight, then rotated; the rest of the row (v) untouched."""
    t, q_heads, k_heads, eps = 9, 3, 2, 1e-6
    heads = q_heads + k_heads
    positions = torch.arange(t) * 7
    table = torch.randn(128, head_dim // 2)
    cos, sin = table.cos(), table.sin()
    x = torch.randn(t, (heads + k_heads) * head_dim) * 4
    q_w, k_w = torch.randn(head_dim), torch.randn(head_dim)

    def norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))

    expected = x.clone()
    rows = expected[:, : heads * head_dim].view(t, heads, head_dim)
    normed = torch.cat([norm(rows[:, :q_heads], q_w), norm(rows[:, q_heads:], k_w)], dim=1)
    rows.copy_(apply_rotary(normed, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)))
    cpu_kernels.rope_(x, heads, head_dim, head_dim, positions, cos, sin, cpu_kernels.HeadNorm(q_w, k_w, q_heads, eps))
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


def test_model_native_path_matches_torch_path(load) -> None:
    """One step of the tiny Qwen2 (q/k/v biases), Llama (GQA), Qwen3 (head norms), Qwen3-MoE (experts), Gemma 3 (its
    norms of the products, GELU and two RoPE tables), Phi-4-mini (RoPE on part of each head), Granite (its
    multipliers) and GLM-4 (its norms of the products) on both paths, same logits."""
    from boundless.attention.backend import AttentionBatch
    from boundless.attention.paged import TorchPagedAttention
    from boundless.kv.tensors import PagedKVCache

    for name in (
        "tiny-qwen2",
        "tiny-llama",
        "tiny-qwen3",
        "tiny-qwen3-moe",
        "tiny-mixtral",
        "tiny-gemma3",
        "tiny-gemma2",
        "tiny-phi4-mini",
        "tiny-granite",
        "tiny-glm4",
    ):
        model = load(name).model
        arch = model.arch
        prompts = [[11], [5, 9, 13, 2, 7], [3, 3, 8]]  # a one-token sequence (a "decode") first
        ids = torch.tensor([t for p in prompts for t in p])
        positions = torch.tensor([i for p in prompts for i in range(len(p))])
        batch = AttentionBatch(
            num_decodes=1,
            query_lens=[len(p) for p in prompts],
            seq_lens=[len(p) for p in prompts],
            block_tables=[[b] for b in range(len(prompts))],
            slot_mapping=torch.tensor([b * 16 + i for b, p in enumerate(prompts) for i in range(len(p))]),
            block_size=16,
            device=torch.device("cpu"),
        )
        outs = []
        for native_path in (True, False):
            model.prepare(256)
            if not native_path:
                for layer in model.layers:
                    layer.packed = None
                model._packed_key = None
            cache = PagedKVCache(arch.num_layers, arch.num_kv_heads, arch.head_dim, 8, 16, torch.float32, "cpu")
            backend = TorchPagedAttention(
                arch.num_heads, arch.num_kv_heads, arch.head_dim, 8, arch.attention_scale, arch.attn_logit_softcap
            )
            with torch.inference_mode():
                hidden = model(ids, positions, backend, cache, backend.prepare(batch))
                outs.append(model.compute_logits(hidden))
        model.prepare(256)  # leave the shared model packed for other tests
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_argmax_rows_matches_torch_ties_and_nan() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 1003, generator=gen)  # a row length that leaves a tail past the 8-wide loop
    x[1, 500] = x[1, 3] = 50.0  # a tie: the first index wins, as in torch
    x[2, 1001] = 60.0  # the largest value in the tail
    x[3] = float("-inf")
    x[3, 999] = -1.0
    x[4, :] = 2.0  # all equal
    assert (
        cpu_kernels.argmax_rows(x).tolist()
        == x.argmax(dim=-1).tolist()
        == [int(x[0].argmax()), 3, 1001, 999, 0, int(x[5].argmax())]
    )
    x[5, 17] = float("nan")  # torch ranks NaN highest; the kernel defers to it
    assert cpu_kernels.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
    assert cpu_kernels.argmax_rows(x[::2]).tolist() == x[::2].argmax(dim=-1).tolist()  # strided rows


@pytest.mark.parametrize("rank", [1, 8, 48, 100])
def test_lora_add_matches_torch(rank: int) -> None:
    """A LoRA adapter's share of a projection, for a slice of rows and for scattered rows, with a block-diagonal B
    (each rank column nonzero in its part's rows only, as a fused q/k/v B is)."""
    gen = torch.Generator().manual_seed(rank)
    k, n, t = 67, 90, 9
    x = torch.randn(t, k, generator=gen)
    a = torch.randn(rank, k, generator=gen)
    b = torch.zeros(n, rank)
    spans = torch.zeros(rank, 2, dtype=torch.long)
    for r in range(rank):  # three parts of the output, the rank columns dealt among them
        start, end = [(0, 40), (40, 61), (61, 90)][r % 3]
        b[start:end, r] = torch.randn(end - start, generator=gen)
        spans[r] = torch.tensor([start, end])
    out = torch.randn(t, n, generator=gen)
    for rows in (slice(2, 7), torch.tensor([0, 3, 8], dtype=torch.long)):
        want = out.clone().double()
        index = torch.arange(t)[rows]
        want[index] += (x.double()[index] @ a.double().t()) @ b.double().t()
        got = out.clone()
        cpu_kernels.lora_add_(x, rows, a, b.t().contiguous(), spans, got)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_prepare_keeps_a_rope_table_long_enough(tiny_llama: LoadedModel) -> None:
    """A second engine on the same loaded model keeps the RoPE table when it is long enough (an earlier engine's CUDA
    graphs read it by address); a longer context builds a longer one with the same rows."""
    model = tiny_llama.model  # (shared: other tests may have prepared it for longer already)
    model.prepare(256)
    table = model.rope
    length = table.cos.shape[0]
    model.prepare(128)
    model.prepare(length)
    assert model.rope is table
    model.prepare(2 * length)
    assert model.rope is not table and model.rope.cos.shape[0] == 2 * length
    torch.testing.assert_close(model.rope.cos[:length], table.cos, rtol=0, atol=0)
    torch.testing.assert_close(model.rope.sin[:length], table.sin, rtol=0, atol=0)
