"""``--quantization fp8``: products of e4m3 weights (a scale per row) and activations quantized per token, against
the exact product of the same rounded operands; a model loaded so (its dense matrices in e4m3, the rest as it was,
another KV fingerprint) answering close to the unquantized one through the engine; the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from boundless.config import ConfigError, EngineConfig, ModelConfig
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.model.fp8_linear import FP8, FP8_MAX, check_quantization, fp8_linear, quantize_rows
from boundless.model.loader import LoadedModel, load_model


def _rounded_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x's rows rounded to e4m3 at their own scale, times the weight as held: in float64."""
    rows = x.reshape(-1, x.shape[-1]).double()
    x_scale = (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    xq = (rows / x_scale).float().to(FP8).double() * x_scale
    return xq @ (q.double() * scale.double().t()).t()


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64), (0, 64)], ids=["rows", "batched", "empty"])
def test_the_product_is_that_of_the_rounded_operands(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen)
    w[7] *= 100  # an outlier row keeps its own scale: the others are not flattened
    bias = torch.randn(48, generator=gen)
    x = torch.randn(*shape, generator=gen)
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.shape == (1, 48)
    # Each row within half an e4m3 step (2^-4 relative, at its largest value) of the weight it stands for.
    assert ((q.float() * scale.t() - w).abs() <= w.abs().amax(dim=1, keepdim=True) / 16).all()
    out = fp8_linear(x, q, scale, bias)
    assert out.shape == (*shape[:-1], 48) and out.dtype == x.dtype
    want = (_rounded_product(x, q, scale) + bias.double()).reshape(*shape[:-1], 48)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)


def test_a_row_of_zeros_gives_the_bias() -> None:
    q, scale = quantize_rows(torch.randn(16, 32))
    bias = torch.arange(16.0)
    assert torch.equal(fp8_linear(torch.zeros(2, 32), q, scale, bias), bias.expand(2, 16))


@pytest.fixture(scope="module")
def fp8_llama(model_dirs: dict[str, Path]) -> LoadedModel:
    return load_model(str(model_dirs["tiny-llama"]), quantization="fp8")


def test_a_model_quantized_holds_its_dense_matrices_in_e4m3_and_the_rest_as_it_was(
    fp8_llama: LoadedModel, tiny_llama: LoadedModel
) -> None:
    for layer, plain in zip(fp8_llama.model.layers, tiny_llama.model.layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):
            assert getattr(layer, f"{name}_weight").dtype == FP8
            assert getattr(layer, f"{name}_scale").shape == (1, getattr(plain, f"{name}_weight").shape[0])
        assert torch.equal(layer.input_norm.weight, plain.input_norm.weight)
    assert torch.equal(fp8_llama.model.embed_tokens.weight, tiny_llama.model.embed_tokens.weight)
    assert fp8_llama.model.lm_head is not None and fp8_llama.model.lm_head.dtype == torch.float32
    # KV computed on quantized weights is another model's: never a prefix hit on the other's, here or in a store.
    assert fp8_llama.fingerprint != tiny_llama.fingerprint


def _answer(loaded: LoadedModel, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], list[float]]:
    """Greedy tokens through an engine, and each prompt token's log-probability after those before it."""
    engine = EngineCore.from_model(loaded, EngineConfig(model=ModelConfig(max_model_len=256)))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
    engine.add_request("r", prompt, params)
    tokens, scores = [], []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.new_token_ids
            if delta.prompt_logprobs is not None:
                scores = [s.logprob for s in delta.prompt_logprobs[1:] if s is not None]
    return tokens, scores


def test_the_engine_runs_a_quantized_model_close_to_the_unquantized_one(smollm2: LoadedModel) -> None:
    """The bundled model with its layers in FP8, through the engine (prefill and decode, the CPU's packed path left
    for the quantized layers): 60 tokens of the README scored within a few tenths of a nat each of the unquantized
    model's (its mean negative log-likelihood moves by 1.4% over 300: docs/engine.md), and its greedy answer starts
    alike. (A random tiny model is no judge: its untrained layers amplify each product's 3% error.)"""
    quantized = load_model("smollm2-135m", quantization="fp8")
    assert quantized.model.layers[0].qkv_weight.dtype == FP8
    text = (Path(__file__).parents[2] / "README.md").read_text()[2000:4000]
    prompt = smollm2.tokenizer.encode(text)[:60]
    (q_tokens, q_scores), (tokens, scores) = _answer(quantized, prompt), _answer(smollm2, prompt)
    shift = [abs(a - b) for a, b in zip(q_scores, scores, strict=True)]
    assert len(shift) == 59 and sum(shift) / len(shift) < 0.45  # (0.31 here; a wrong scale: nats)
    assert abs(sum(q_scores) / sum(scores) - 1) < 0.05
    assert q_tokens[:2] == tokens[:2]


def test_a_mixtures_experts_stay_unquantized(model_dirs: dict[str, Path]) -> None:
    moe = load_model(str(model_dirs["tiny-qwen3-moe"]), quantization="fp8")
    sparse = next(layer for layer in moe.model.layers if layer.moe is not None)
    assert sparse.qkv_weight.dtype == FP8 and sparse.gate_up_weight is None
    assert all(p.dtype == torch.float32 for p in sparse.moe.parameters())
    tokens, scores = _answer(moe, [5, 9, 13, 17, 21, 25])
    assert len(tokens) == 6 and len(scores) == 5


def test_unknown_methods_and_gpus_without_fp8_are_refused() -> None:
    with pytest.raises(ConfigError, match="'awq' is not applied here"):
        ModelConfig(quantization="awq")
    with pytest.raises(ConfigError, match="'int8' is not applied here"):
        check_quantization("int8", torch.device("cpu"), torch.float32)
    check_quantization("fp8", torch.device("cpu"), torch.float32)  # (the CPU's reference product: any type)
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match="takes --dtype bfloat16"):
            check_quantization("fp8", torch.device("cuda"), torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's FP8 products")
def test_the_product_on_cuda_in_bfloat16() -> None:
    """On a GPU with FP8 tensor cores: ``_scaled_mm`` with a scale per row of each side, into bfloat16."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 products on this GPU")
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(256, 128, generator=gen), torch.randn(37, 128, generator=gen)
    q, scale = quantize_rows(w.cuda())
    out = fp8_linear(x.cuda().bfloat16(), q, scale, None)
    assert out.dtype == torch.bfloat16
    want = _rounded_product(x.bfloat16().float(), q.cpu(), scale.cpu())
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)
