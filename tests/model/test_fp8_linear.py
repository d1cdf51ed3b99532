"""``--quantization fp8``: products of e4m3 weights (a scale per row) and activations quantized per token, against
the exact product of the same rounded operands; a model loaded so (its dense matrices in e4m3, the rest as it was,
another KV fingerprint) answering close to the unquantized one through the engine; the refusals."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from boundless.config import ConfigError, EngineConfig, ModelConfig
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model import fp8_linear as fp8
from boundless.model.fp8_linear import FP8, FP8_MAX, check_quantization, fp8_linear, quantize_rows
from boundless.model.loader import LoadedModel, load_model
from boundless.model.random_model import TinySpec, write_random_model

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

_TRITON_RUNS = triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
# The 8B shape's products (Llama-3.1-8B: hidden 4096, 32 heads and 8 kv heads of 128, MLP 14,336): (in, out).
_LLAMA_8B_PRODUCTS = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def _rounded_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x's rows rounded to e4m3 at their own scale (fp32's largest magnitude times fp32's 1/448, the quotient in
    fp32), times the weight as held: in float64."""
    rows = x.reshape(-1, x.shape[-1]).float()
    x_scale = (rows.abs().amax(dim=1, keepdim=True) * (1 / FP8_MAX)).clamp_min(1e-12)
    xq = (rows / x_scale).to(FP8).double() * x_scale.double()
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


def test_a_mixtures_experts_are_quantized_with_a_scale_per_row(
    model_dirs: dict[str, Path], load: Callable[[str], LoadedModel]
) -> None:
    """``--quantization fp8`` holds a mixture's experts in e4m3 too, a scale per expert's output row (vLLM's FP8
    mixture), the router in the model's type: the model scores a prompt as the unquantized one does, within what
    e4m3 rounds away."""
    moe = load_model(str(model_dirs["tiny-qwen3-moe"]), quantization="fp8")
    sparse = next(layer for layer in moe.model.layers if layer.moe is not None)
    assert sparse.qkv_weight.dtype == FP8 and sparse.gate_up_weight is None
    experts = sparse.moe
    assert experts is not None and experts.held == "fp8" and experts.router.dtype == torch.float32
    assert experts.gate_up.dtype == FP8 and experts.down.dtype == FP8
    assert experts.gate_up_scale.shape == (*experts.gate_up.shape[:2], 1)
    unquantized = next(layer for layer in load("tiny-qwen3-moe").model.layers if layer.moe is not None).moe
    assert unquantized is not None
    for e in range(experts.router.shape[0]):
        gate_up, down = experts.expert(e, torch.float32)
        torch.testing.assert_close(gate_up, unquantized.gate_up[e], rtol=0.07, atol=1e-3)  # (e4m3: 3 mantissa bits)
        torch.testing.assert_close(down, unquantized.down[e], rtol=0.07, atol=1e-3)
    tokens, scores = _answer(moe, [5, 9, 13, 17, 21, 25])
    assert len(tokens) == 6 and len(scores) == 5


def test_a_mixtures_shared_experts_are_quantized_with_a_scale_per_row(
    model_dirs: dict[str, Path], load: Callable[[str], LoadedModel]
) -> None:
    """GLM-4.5's shared experts (a dense MLP beside the routed ones) in e4m3 too, a scale per output row, as a dense
    layer's matrices: within e4m3's rounding of the unquantized ones, and the layer's output within its rounding of
    the unquantized layer's, on the native path (dequantized, packed) and the PyTorch one (``fp8_linear``)."""
    quantized = load_model(str(model_dirs["tiny-glm4-moe"]), quantization="fp8")
    plain = load("tiny-glm4-moe")
    sparse = next(layer.moe for layer in quantized.model.layers if layer.moe is not None)
    want = next(layer.moe for layer in plain.model.layers if layer.moe is not None)
    assert sparse is not None and want is not None and want.shared_gate_up is not None
    assert sparse.shared_gate_up is not None and sparse.shared_gate_up.dtype == FP8
    assert sparse.shared_down_scale is not None and sparse.shared_down_scale.shape == (1, want.shared_down.shape[0])
    shared = sparse.shared_matrices(torch.float32)
    assert shared is not None
    torch.testing.assert_close(shared[0], want.shared_gate_up, rtol=0.07, atol=1e-3)  # (e4m3: 3 mantissa bits)
    x = torch.randn(5, want.router.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = want.shared(x)
        assert reference is not None
        for packed in (False, True):
            sparse.packed_shared = None
            if packed:
                sparse.pack()
            got = sparse.shared(x)
            assert got is not None
            torch.testing.assert_close(got, reference, rtol=0.1, atol=0.1 * reference.abs().max().item())
            assert not torch.equal(got, reference)
    tokens, scores = _answer(quantized, [5, 9, 13, 17, 21, 25])
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


def test_the_products_arguments_meet_cudas_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``_scaled_mm`` is given, checked by PyTorch's own rules for CUDA (its meta function, on fake CUDA tensors:
    no GPU needed): the activations row-major and the weight's transpose column-major, sides multiples of 16, the
    scales fp32 [M, 1] and [1, N], contiguous; for the 8B shape's products, a decode's few rows and a prefill's many,
    and for the product scaled after (the way round a shape cuBLASLt refuses). A layout the GPU would refuse fails
    here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(fp8, "quantize_activations", fp8._quantize_torch)  # (no Triton launch on fake tensors)
    calls: list[tuple] = []
    real = torch._scaled_mm

    def spy(a, b, **kwargs):
        calls.append((a, b, kwargs))
        return real(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    with FakeTensorMode():
        for k, n in _LLAMA_8B_PRODUCTS:
            weight, scale = quantize_rows(torch.empty(n, k, device="cuda", dtype=torch.bfloat16))
            assert weight.is_contiguous() and scale.shape == (1, n) and scale.dtype == torch.float32
            for rows in (1, 3, 64, 127, 300):
                for shape in ((rows, k), (1, rows, k)):
                    x = torch.empty(*shape, device="cuda", dtype=torch.bfloat16)
                    out = fp8_linear(x, weight, scale, None)
                    assert out.shape == (*shape[:-1], n) and out.dtype == torch.bfloat16
                    monkeypatch.setattr(fp8, "ROWWISE_REFUSED", {(rows, k, n)})
                    assert fp8_linear(x, weight, scale, None).dtype == torch.bfloat16
                    monkeypatch.setattr(fp8, "ROWWISE_REFUSED", set())
        # A weight whose side is no multiple of 16 is refused there: quantizable() keeps such a matrix unquantized.
        odd, odd_scale = quantize_rows(torch.empty(40, 64, device="cuda"))
        assert not fp8.quantizable(odd)
        with pytest.raises(RuntimeError, match="divisible by 16"):
            fp8_linear(torch.empty(2, 64, device="cuda", dtype=torch.bfloat16), odd, odd_scale, None)
    a, b, kwargs = calls[0]
    assert a.stride() == (4096, 1) and b.stride() == (1, 4096) and kwargs["out_dtype"] == torch.bfloat16
    assert {c[2]["scale_a"].shape for c in calls} >= {(1, 1), (64, 1), torch.Size([])}


def test_a_shape_cublaslt_refuses_is_scaled_after_the_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuBLASLt's heuristic has refused scales per row for some shapes (a long inner side, few rows: H100): such a
    product is taken with unit scales into fp32 and scaled after, the same sums; the refusal is met once a shape."""
    gen = torch.Generator().manual_seed(3)
    q, scale = quantize_rows(torch.randn(32, 64, generator=gen))
    x = torch.randn(4, 64, generator=gen)
    want = fp8_linear(x, q, scale, None)
    real, refusals = torch._scaled_mm, []

    def refusing(a, b, *, scale_a, scale_b, out_dtype):
        if scale_a.numel() > 1:
            refusals.append(a.shape)
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmulAlgoGetHeuristic")
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", refusing)
    monkeypatch.setattr(fp8, "ROWWISE_REFUSED", set())
    for _ in range(2):
        torch.testing.assert_close(fp8_linear(x, q, scale, None), want, rtol=1e-5, atol=1e-5)
    assert refusals == [(4, 64)]
    assert sorted(fp8.ROWWISE_REFUSED) == [(4, 64, 32)]


if triton is not None:

    @triton.jit
    def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n).to(out_ptr.dtype.element_ty), mask=i < n)


def _triton_cast(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) cast to e4m3 by Triton: in the interpreter, its own rounding (which differs from the GPU's and
    PyTorch's at ties and where rounding up reaches a power of two)."""
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x.contiguous(), out, x.numel(), BLOCK=1024)
    return out


@pytest.mark.skipif(not _TRITON_RUNS, reason="triton unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_triton_quantizer_makes_the_rows_pytorchs_ops_make(dtype: torch.dtype) -> None:
    """CUDA's activations are quantized by one Triton launch: the same scales as PyTorch's ops (bit for bit: the same
    fp32 divisions), and each row divided by its scale and rounded. On a GPU the rounded rows are PyTorch's; in the
    interpreter its own cast rounds otherwise at ties, so there they are compared with that cast of PyTorch's
    quotients. Rows wider than a block (two passes), a row of zeros, rows far apart in size, a strided view."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(4)
    for cols in (48, 1000, 2304):
        x = torch.randn(6, cols + 16, generator=gen) * torch.logspace(-4, 3, 6)[:, None]
        x[2] = 0
        rows = x.to(device, dtype)[:, 16:]  # (a view: rows cols + 16 apart)
        q, x_scale = fp8._quantize_triton(rows)
        want_q, want_scale = fp8._quantize_torch(rows)
        assert q.shape == rows.shape and q.is_contiguous() and x_scale.shape == (6, 1)
        assert torch.equal(x_scale, want_scale)
        if device.type == "cuda":
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        else:
            assert torch.equal(q.view(torch.uint8), _triton_cast(rows.float() / want_scale).view(torch.uint8))
    if device.type == "cuda":
        assert fp8.quantize_activations(rows)[0].data_ptr() != want_q.data_ptr()  # (CUDA takes the kernel)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's FP8 products")
def test_the_8b_shapes_products_on_cuda() -> None:
    """The 8B shape's products on the GPU for a decode's few rows and a prefill's many, against fp32 products of the
    same rounded operands (on the GPU, full fp32). A shape cuBLASLt refuses with scales per row is named in a warning
    (and still right, scaled after the product): the device run's log says which."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 products on this GPU")
    gen = torch.Generator(device="cuda").manual_seed(5)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for k, n in _LLAMA_8B_PRODUCTS:
            q, scale = quantize_rows(torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16))
            weight = q.float() * scale.t()
            for rows in (1, 16, 64, 127, 256, 300):
                x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                out = fp8_linear(x, q, scale, None)
                xq, x_scale = fp8._quantize_torch(x)
                want = (xq.float() * x_scale) @ weight.t()
                err = float((out.float() - want).norm() / want.norm())
                assert out.dtype == torch.bfloat16 and out.shape == (rows, n) and err < 1e-2, (k, n, rows, err)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    if fp8.ROWWISE_REFUSED:
        import warnings

        warnings.warn(f"cuBLASLt refused scales per row for (M, K, N) = {sorted(fp8.ROWWISE_REFUSED)}", stacklevel=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_a_quantized_model_on_cuda_graphs_and_windows_gives_the_eager_tokens(model_dirs: dict[str, Path]) -> None:
    """The products, their Triton quantizer and the scales read inside captured decode graphs and device windows:
    a bf16 model quantized to FP8 gives the eager engine's greedy tokens (one sequence: the same row count, so the
    same cuBLASLt kernel, eager and replayed), and a batch runs through the graphs' padded buckets."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 products on this GPU")
    loaded = load_model(str(model_dirs["tiny-llama"]), dtype="bfloat16", device="cuda", quantization="fp8")
    assert loaded.model.layers[0].qkv_weight.dtype == FP8
    prompt = [5, 9, 13, 17, 21, 25, 29]
    runs = {}
    for name, options in {
        "eager": dict(enforce_eager=True),
        "graphs": dict(),
        "windows": dict(num_scheduler_steps=4),
    }.items():
        config = engine_config(
            loaded.name, dtype="bfloat16", device="cuda", max_model_len=256, num_kv_blocks=64, max_num_seqs=8,
            attention_backend="triton", **options,
        )  # fmt: skip
        engine = EngineCore.from_model(loaded, config)
        assert (engine.executor.runner.graphs is None) == (name == "eager")
        out: dict[str, list[int]] = {}
        engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for batch in (False, True):  # the one sequence alone, then a batch that shrinks through the buckets
            for i in range(3 if batch else 0):
                params = SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True)
                engine.add_request(f"b{i}", [3 + i, 7, 11 + i], params)
            while engine.has_unfinished():
                for delta in engine.step():
                    out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        runs[name] = out
    for name, out in runs.items():
        assert [len(out[f"b{i}"]) for i in range(3)] == [5, 6, 7], name
    assert runs["graphs"]["r"] == runs["eager"]["r"] and runs["windows"]["r"] == runs["eager"]["r"]


def test_the_rooflines_weight_bytes_count_the_layers_as_held(fp8_llama: LoadedModel, tiny_llama: LoadedModel) -> None:
    """``bench gpu``'s roofline reads a quantized layer's matrices at a byte an element, with their rows' scales;
    the norms, the embedding and the head as they were."""
    from boundless.bench.gpu import weight_stream_bytes

    saved = 0
    for plain in tiny_llama.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            weight = getattr(plain, f"{name}_weight")
            saved += weight.numel() * (weight.element_size() - 1) - 4 * weight.shape[0]
    assert weight_stream_bytes(tiny_llama) - weight_stream_bytes(fp8_llama) == saved


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_quantized_layers_products_give_a_row_the_same_alone_or_in_a_batch(tmp_path: Path, dtype: str) -> None:
    """On the CPU a row's product is the same whatever rows share its step: a decode's one row, a verification chunk's
    five, a prefill's many. PyTorch's CPU ``_scaled_mm`` scales the operands before an fp32 product whose sums are
    ordered by the number of rows, so speculation changed SmolLM2's greedy tokens in FP8 at its tenth token (and a
    bfloat16 model's, chunked prefill); the CPU's products are now the native kernel's over the e4m3 matrices widened
    to fp32 (exact), which sum a row alike in any batch, scaled after."""
    root = write_random_model(tmp_path / "m", TinySpec(hidden_size=576, intermediate_size=1536, num_layers=1))
    loaded = load_model(str(root), dtype=dtype, quantization="fp8")
    loaded.model.prepare(64)
    layer = loaded.model.layers[0]
    gen = torch.Generator().manual_seed(5)
    for name in ("qkv", "o", "gate_up", "down"):
        weight = getattr(layer, f"{name}_weight")
        assert weight.dtype == FP8
        x = torch.randn(9, weight.shape[1], generator=gen).to(loaded.dtype)
        batch = layer.product(name, x)
        assert batch.dtype == loaded.dtype
        want = _rounded_product(x, weight, getattr(layer, f"{name}_scale"))
        tolerance = 1e-5 if loaded.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(batch.double(), want, rtol=tolerance, atol=tolerance * 10)
        for rows in (1, 2, 5):
            assert torch.equal(layer.product(name, x[:rows]), batch[:rows]), (name, rows)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_mixture_gives_a_row_the_same_alone_or_in_a_batch(tmp_path: Path, quantization: str | None) -> None:
    """A sparse layer on the CPU in fp32: a row's router logits and experts' sums are the same whatever rows share its
    step. The router's PyTorch product summed a lone row otherwise (its experts' weights changed with the batch,
    quantized or not), and a quantized model's experts ran in PyTorch's products (its layers are not packed)."""
    spec = TinySpec(kind="qwen3_moe", hidden_size=576, num_layers=1, head_dim=32, moe_intermediate_size=256, seed=3)
    loaded = load_model(str(write_random_model(tmp_path / "m", spec)), quantization=quantization)
    loaded.model.prepare(64)
    layer = loaded.model.layers[0]
    assert layer.moe is not None and layer.moe.packed_router is not None
    experts = layer.packed.experts if layer.packed is not None else layer.widened_experts
    assert experts and layer.moe.router.dtype == torch.float32
    assert layer.moe.held == ("fp8" if quantization else None)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(0))
    batch = layer.moe(x, experts)
    for rows in (1, 2, 5):
        assert torch.equal(layer.moe(x[:rows], experts), batch[:rows]), rows
