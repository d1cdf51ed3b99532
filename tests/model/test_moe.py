"""The mixture of experts on its own: the grouped computation against a token-by-token one, on PyTorch and on the
packed native kernels, and the checkpoint's three layouts (per-expert names, Mixtral's names, transformers 5's stacked
tensors) loading the same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from boundless.model import cpu_kernels
from boundless.model.arch import ModelArch
from boundless.model.llama import LlamaModel
from boundless.model.moe import SparseMoE
from boundless.model.random_model import TinySpec, random_weights

pytestmark = pytest.mark.usefixtures("parallel_native_kernels")  # (the native kernels' parallel loops too)


def _arch(kind: str = "qwen3_moe", norm_topk_prob: bool = True) -> ModelArch:
    return ModelArch(
        model_type=kind, vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
        tie_word_embeddings=True, qk_norm=kind == "qwen3_moe", num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=40, norm_topk_prob=norm_topk_prob, sparse_layers=(0, 1),
    )  # fmt: skip


def _one_token_at_a_time(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through each of its experts, as the model's definition reads."""
    out = torch.zeros_like(x)
    experts, weights = moe.route(x)
    for t in range(x.shape[0]):
        for k in range(moe.top_k):
            e = int(experts[t, k])
            gate, up = F.linear(x[t], moe.gate_up[e]).chunk(2)
            out[t] += weights[t, k] * F.linear(F.silu(gate) * up, moe.down[e])
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_experts_equal_a_token_at_a_time(norm_topk_prob: bool, tokens: int) -> None:
    torch.manual_seed(tokens)
    moe = SparseMoE(_arch(norm_topk_prob=norm_topk_prob))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        x = torch.randn(tokens, 48)
        expected = _one_token_at_a_time(moe, x)
        torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)
        _, weights = moe.route(x)
        assert torch.allclose(weights.sum(-1), torch.ones(tokens)) == norm_topk_prob
        if cpu_kernels.available():  # each expert packed for the native kernels, as the native path has them
            packed = [
                (cpu_kernels.PackedWeight(gu.contiguous(), glu=True), cpu_kernels.PackedWeight(d.contiguous()))
                for gu, d in zip(moe.gate_up, moe.down, strict=True)
            ]
            torch.testing.assert_close(moe(x, packed), expected, rtol=1e-4, atol=1e-4)


def _stacked(weights: dict[str, torch.Tensor], block: str, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """The same weights as transformers 5 saves them: each layer's experts in two stacked tensors under ``mlp``."""
    down = names[2]
    out, layers = {}, set()
    for name, tensor in weights.items():
        if f".{block}.experts." in name:
            layers.add(name.split(f".{block}.")[0])
        else:
            out[name.replace(f".{block}.", ".mlp.")] = tensor
    for layer in layers:
        count = sum(1 for n in weights if n.startswith(f"{layer}.{block}.experts.") and n.endswith(f".{down}.weight"))
        experts = [[weights[f"{layer}.{block}.experts.{e}.{m}.weight"] for m in names] for e in range(count)]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([d for _, _, d in experts])
    return out


@pytest.mark.parametrize(
    ("kind", "block", "names"),
    [("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")), ("mixtral", "block_sparse_moe", ("w1", "w3", "w2"))],
)
def test_per_expert_and_stacked_checkpoints_load_the_same(kind: str, block: str, names: tuple[str, str, str]) -> None:
    spec = TinySpec(kind=kind, num_layers=2, seed=5)
    weights = dict(random_weights(spec))
    arch = ModelArch.from_hf_config(
        {"model_type": kind, "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
         "intermediate_size": spec.moe_intermediate_size if kind == "mixtral" else spec.intermediate_size,
         "num_hidden_layers": 2, "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
         "num_experts": spec.num_experts, "num_local_experts": spec.num_experts,
         "num_experts_per_tok": spec.num_experts_per_tok, "moe_intermediate_size": spec.moe_intermediate_size,
         "norm_topk_prob": True}
    )  # fmt: skip
    assert arch.sparse_layers == (0, 1) and arch.norm_topk_prob
    per_expert, stacked = LlamaModel(arch), LlamaModel(arch)
    per_expert.load_weights(weights.items())
    stacked.load_weights(_stacked(weights, block, names).items())
    for (name, a), (_, b) in zip(per_expert.named_parameters(), stacked.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    gate, up, _ = names
    assert torch.equal(
        per_expert.layers[1].moe.gate_up[3], torch.cat([weights[f"model.layers.1.{block}.experts.3.{m}.weight"]
                                                          for m in (gate, up)])
    )  # fmt: skip
    # A missing expert is named.
    incomplete = {n: t for n, t in weights.items() if n != f"model.layers.0.{block}.experts.2.{names[2]}.weight"}
    with pytest.raises(ValueError, match=f"experts.2.{names[2]}"):
        LlamaModel(arch).load_weights(incomplete.items())
    assert dataclasses.replace(arch, num_experts=0, sparse_layers=()).fingerprint() != arch.fingerprint()


def test_gpt_oss_o_bias_is_rounded_once_with_its_product_in_bfloat16() -> None:
    """o's bias (gpt-oss's) joins its product before the one rounding to the model's dtype, as ``nn.Linear`` adds it
    (added after, the sum was rounded twice: 1-ulp differences in a third of the outputs); split over ranks it is
    added once, after the sum."""
    from boundless.model.llama import DecoderLayer

    arch = dataclasses.replace(
        _arch(), model_type="gpt_oss", qk_norm=False, qkv_bias=True, o_bias=True, attention_sinks=True,
        swiglu_limit=7.0, swiglu_alpha=1.702,
    )  # fmt: skip
    layer = DecoderLayer(arch, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=g))
    layer = layer.to(torch.bfloat16)
    attn = torch.randn(16, arch.num_heads * arch.head_dim, generator=g).to(torch.bfloat16)
    assert layer.o_bias is not None
    want = F.linear(attn, layer.o_weight, layer.o_bias)
    assert torch.equal(layer._o_projection(attn, None, 0), want)
    layer.reduce = lambda partial: partial.mul_(2)  # (two ranks holding the same partial)
    assert torch.allclose(layer._o_projection(attn / 2, None, 0), want, rtol=2e-2, atol=2e-2)


def test_glm4_moes_mixture_in_bfloat16_is_transformers_to_the_bit() -> None:
    """GLM-4.5's mixture in bf16 as transformers' Glm4MoeMoE computes it: its router and score correction held in fp32
    (the model cast to bf16 around them), the routing weights in fp32 weighting each expert's rounded output, the
    shared expert added once; equal to the bit (the weights rounded to bf16 first, 4,750 of 16,384 outputs were not)."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    cfg = dict(
        model_type="glm4_moe", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        first_k_dense_replace=1, norm_topk_prob=True,
    )  # fmt: skip
    theirs = Glm4MoeMoE(Glm4MoeConfig(**cfg))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        theirs.gate.e_score_correction_bias.copy_(torch.rand(8, generator=g) * 0.5)
    theirs = theirs.to(torch.bfloat16)
    gate = theirs.gate
    gate.weight.data, gate.e_score_correction_bias.data = gate.weight.data.float(), gate.e_score_correction_bias.float()
    ours = SparseMoE(ModelArch.from_hf_config(cfg))
    with torch.no_grad():
        ours.router.copy_(gate.weight)
        assert ours.score_bias is not None and ours.shared_gate_up is not None and ours.shared_down is not None
        ours.score_bias.copy_(gate.e_score_correction_bias)
        ours = ours.to(torch.bfloat16)
        assert ours.router.dtype == ours.score_bias.dtype == torch.float32
        ours.gate_up.copy_(theirs.experts.gate_up_proj)
        ours.down.copy_(theirs.experts.down_proj)
        shared = theirs.shared_experts
        ours.shared_gate_up.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        ours.shared_down.copy_(shared.down_proj.weight)
        x = torch.randn(64, 64, generator=g).to(torch.bfloat16)
        assert torch.equal(ours(x), theirs(x[None])[0])
