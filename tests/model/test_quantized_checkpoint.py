"""FP8 checkpoints (``quantization_config``): a random model's weights quantized as Qwen's FP8 models (blocks of
``weight_block_size``), llm-compressor's (compressed-tensors, per output channel) and vLLM's per-tensor fp8 are
written beside the same model's weights dequantized in fp32; both load to the same parameters, whatever order the
weights and their scales come in. Other quantizations are refused in words (GPTQ's and AWQ's load:
``tests/model/test_packed_int.py``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from model_files import greedy_tokens
from safetensors.torch import load_file, save_file

from boundless.attention import triton_paged
from boundless.config import ConfigError
from boundless.model.fp8_linear import Fp8Stack
from boundless.model.loader import load_model
from boundless.model.random_model import TinySpec, write_random_model
from boundless.model.tensor_parallel import TensorParallel

FP8_MAX = 448.0
TEST_DEVICE = os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu")  # (conftest's)
_ON_CPU = TEST_DEVICE == "cpu"


def _quantize(w: torch.Tensor, scheme: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [out, in] in e4m3 and its scale (per tensor, per output row, or per block), as the scheme stores them."""
    if scheme == "tensor":
        scale = w.abs().max() / FP8_MAX
        return (w / scale).to(torch.float8_e4m3fn), scale.reshape(1)
    if scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        return (w / scale).to(torch.float8_e4m3fn), scale
    rows, cols = block
    scale = torch.empty(math.ceil(w.shape[0] / rows), math.ceil(w.shape[1] / cols))
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            scale[i, j] = tile.abs().max() / FP8_MAX
            q[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _dequantized(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    w = q.float()
    if scale.numel() == 1 or scale.shape == (w.shape[0], 1):
        return w * scale.reshape(-1, 1) if scale.numel() > 1 else w * scale
    spread = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return w * spread[: w.shape[0], : w.shape[1]]


SCHEMES = {
    # scheme: (quantization_config, the scale's name)
    "block": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [48, 48]},
        "weight_scale_inv",
    ),
    "channel": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        },
        "weight_scale",
    ),
    "tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, "weight_scale"),
}


def _write_pair(
    root: Path, scheme: str, split: bool = False, spec: TinySpec | None = None, block_size: list[int] | None = None
) -> tuple[Path, Path]:
    """A random model (``spec``'s) written twice: its linear weights quantized by ``scheme`` (with ``split``, the
    scales in a file read before the weights'; ``block_size``, the blocks' instead of 48 x 48), and dequantized in
    fp32 (no quantization_config)."""
    source = write_random_model(root / "source", spec or TinySpec(weight_std=0.3))
    quant, scale_name = SCHEMES[scheme]
    if block_size is not None:
        quant = {**quant, "weight_block_size": block_size}
    block = tuple(quant.get("weight_block_size", (48, 48)))
    quantized, reference = root / "fp8", root / "reference"
    for d in (quantized, reference):
        shutil.copytree(source, d)
        (d / "model.safetensors").unlink()
    tensors = load_file(str(source / "model.safetensors"))
    weights, scales, plain = {}, {}, {}
    for name, w in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            q, s = _quantize(w, scheme, block)  # type: ignore[arg-type]
            weights[name], scales[name.removesuffix("weight") + scale_name] = q, s
            if scheme == "tensor":
                scales[name.removesuffix("weight") + "input_scale"] = torch.ones(1)  # (static activations: dropped)
            plain[name] = _dequantized(q, s, block)  # type: ignore[arg-type]
        else:
            weights[name] = plain[name] = w
    if split:
        save_file(scales, str(quantized / "a-scales.safetensors"))
        save_file(weights, str(quantized / "b-weights.safetensors"))
    else:
        save_file({**weights, **scales}, str(quantized / "model.safetensors"))
    save_file(plain, str(reference / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return quantized, reference


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_an_fp8_checkpoint_loads_as_its_weights_dequantized(tmp_path: Path, scheme: str) -> None:
    quantized, reference = _write_pair(tmp_path, scheme)
    got, want = load_model(str(quantized)), load_model(str(reference))
    params, expected = dict(got.model.named_parameters()), dict(want.model.named_parameters())
    assert params.keys() == expected.keys()
    for name, p in params.items():
        assert torch.equal(p, expected[name]), name
    # (Quantized: the weights moved from the source's, by up to half a step of e4m3 at their scale.)
    source = load_model(str(tmp_path / "source"))
    assert not torch.equal(source.model.layers[0].qkv_weight, got.model.layers[0].qkv_weight)


def test_scales_read_before_their_weights_find_them(tmp_path: Path) -> None:
    quantized, reference = _write_pair(tmp_path, "block", split=True)
    got, want = load_model(str(quantized)), load_model(str(reference))
    assert torch.equal(got.model.layers[1].gate_up_weight, want.model.layers[1].gate_up_weight)


def test_a_weight_without_its_scale_is_named(tmp_path: Path) -> None:
    quantized, _ = _write_pair(tmp_path, "channel")
    tensors = load_file(str(quantized / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(str(quantized))


@pytest.mark.parametrize(
    ("quant", "said"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantized with 'bitsandbytes', which does not load"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "does not load here: 4-bit GEMM ones"),
        ({"quant_method": "gptq", "bits": 3}, "2, 4 and 8-bit ones"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "format 'marlin'"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}},
            },
            "4-bit 'int', which do not load here",
        ),
    ],
)
def test_other_quantizations_are_refused_in_words(tmp_path: Path, quant: dict, said: str) -> None:
    root = write_random_model(tmp_path / "m", TinySpec())
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ConfigError, match=said):
        load_model(str(root))


# Qwen3-MoE's FP8 checkpoints: every expert matrix e4m3 in blocks (128 x 128 there) that tile it.
MOE = TinySpec(kind="qwen3_moe", weight_std=0.3, seed=4)


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=pytest.mark.slow if _ON_CPU else ())])
def test_an_fp8_mixtures_experts_are_held_as_stored(tmp_path: Path, backend: str) -> None:
    """An FP8 checkpoint's experts held as it stores them (``quantized_experts``: the default on CUDA): e4m3 bytes as
    written, a scale a block, gate's and up's stacked; dequantized they are the reference's weights to the bit, and
    the engine gives its tokens (on the native path, each expert dequantized as it is packed; in the Triton kernels,
    each tile's product scaled as it sums). The other layers' weights load dequantized as before."""
    quantized, reference = _write_pair(tmp_path, "block", spec=MOE, block_size=[16, 16])
    held = load_model(str(quantized), device=TEST_DEVICE, quantized_experts=True)
    plain = load_model(str(reference), device=TEST_DEVICE)
    moe, want = held.model.layers[0].moe, plain.model.layers[0].moe
    assert moe is not None and want is not None
    assert moe.held == "fp8" and moe.fp8_block == (16, 16) and moe.gate_up.dtype == torch.float8_e4m3fn
    assert moe.gate_up_scale.shape == (8, 2 * 32 // 16, 64 // 16)
    stored = load_file(str(quantized / "model.safetensors"))["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert torch.equal(moe.gate_up[3, 32:].view(torch.uint8).cpu(), stored.view(torch.uint8))
    for e in range(8):
        gate_up, down = moe.expert(e, torch.float32)
        assert torch.equal(gate_up, want.gate_up[e]) and torch.equal(down, want.down[e])
    assert torch.equal(held.model.layers[1].qkv_weight, plain.model.layers[1].qkv_weight)
    if backend == "triton" and not triton_paged.available(held.device):
        pytest.skip("triton unavailable")
    assert greedy_tokens(held, backend) == greedy_tokens(plain, backend)


def test_fp8_experts_in_blocks_that_do_not_tile_them_load_dequantized(tmp_path: Path) -> None:
    """Blocks of 48 do not tile 32-row experts: held as stored they cannot be (refused when asked), and by default
    they load dequantized."""
    quantized, _ = _write_pair(tmp_path, "block", spec=MOE)
    with pytest.raises(ConfigError, match="held as stored only from"):
        load_model(str(quantized), quantized_experts=True)
    moe = load_model(str(quantized)).model.layers[0].moe
    assert moe is not None and moe.held is None and moe.gate_up.dtype == torch.float32


def test_fp8_experts_are_held_only_in_blocks_the_kernel_tiles() -> None:
    """quant_method fp8 with blocks that tile the experts and that the kernel's tiles of inputs fall within (a power of
    two of 16 or more: Qwen3's 128); blocks of 48 tile these experts but not the kernel's tiles: they load dequantized.
    compressed-tensors' blocks may be one group's (another's the experts'): dequantized too."""
    from boundless.model.arch import ModelArch
    from boundless.model.loader import quantized_experts_form
    from boundless.model.quantized_checkpoint import QuantizedCheckpoint

    arch = ModelArch(
        model_type="qwen3_moe", vocab_size=64, hidden_size=96, intermediate_size=64, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=24, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
        tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, sparse_layers=(0,),
    )  # fmt: skip
    assert quantized_experts_form(QuantizedCheckpoint("fp8", (16, 16)), arch) == "fp8"
    assert quantized_experts_form(QuantizedCheckpoint("fp8", (48, 48)), arch) is None
    assert quantized_experts_form(QuantizedCheckpoint("compressed-tensors", (16, 16)), arch) is None
    assert quantized_experts_form(QuantizedCheckpoint("fp8", None), arch) is None


# A dense model's FP8 checkpoint held as stored (``quantized_dense``: the default on a GPU with FP8, one rank).
GLM4 = TinySpec(kind="glm4", num_heads=4, num_kv_heads=2, head_dim=32, seed=16, partial_rotary_factor=0.5)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_each_tensor_parallel_rank_holds_its_share_of_an_fp8_checkpoints_blocks(tmp_path: Path, kv_heads: int) -> None:
    """Over two ranks each rank holds its share of every matrix in e4m3 with its blocks' scales, cut once held (q/k/v's
    and gate/up's rows, o's and down's inputs, whole blocks each; one key/value head held by both ranks): dequantized,
    each rank's matrices are its share of the reference's weights as the dequantized load cuts them."""
    spec = TinySpec(weight_std=0.3, num_kv_heads=kv_heads)
    quantized, reference = _write_pair(tmp_path, "block", spec=spec, block_size=[16, 16])
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        held = load_model(str(quantized), quantized_dense=True, tensor_parallel=tp)
        plain = load_model(str(reference), tensor_parallel=tp)
        for layer, want in zip(held.model.layers, plain.model.layers, strict=True):
            assert layer.fp8_block == (16, 16)
            for name in ("qkv", "o", "gate_up", "down"):
                weight, scale = getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_scale")
                dense = Fp8Stack(weight[None], scale[None], (16, 16)).dequantized(0, torch.float32)
                assert torch.equal(dense, getattr(want, f"{name}_weight")), (rank, name)


def test_which_fp8_checkpoints_are_held_over_ranks() -> None:
    """A rank's share of every matrix must be whole blocks; a checkpoint's fused matrices (Phi-3's, GLM-4's gate/up)
    and scales per tensor or channel load dequantized over ranks."""
    from boundless.model.arch import ModelArch
    from boundless.model.loader import holds_quantized_dense, quantized_dense_form
    from boundless.model.quantized_checkpoint import QuantizedCheckpoint

    arch = ModelArch(
        model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    blocks = QuantizedCheckpoint("fp8", (16, 16), uniform=True)
    assert quantized_dense_form(blocks, arch, ranks=2) == "blocks"
    assert quantized_dense_form(QuantizedCheckpoint("fp8", (32, 32), uniform=True), arch, ranks=2) is None  # (kv: 16)
    assert quantized_dense_form(blocks, dataclasses.replace(arch, model_type="phi3"), ranks=2) is None
    cuda = torch.device("cuda")  # (the rule only: nothing runs there)
    assert not holds_quantized_dense(None, "rows", cuda, 2, torch.bfloat16)
    with pytest.raises(ConfigError, match="scale per tensor or channel held as stored are not split"):
        holds_quantized_dense(True, "rows", cuda, 2, torch.bfloat16)


@pytest.mark.parametrize(
    ("spec", "block"), [(None, [16, 16]), (GLM4, [32, 16])], ids=["llama", "glm4-fused-interleaved"]
)
@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=pytest.mark.slow if _ON_CPU else ())])
def test_an_fp8_checkpoints_dense_matrices_are_held_as_stored(
    tmp_path: Path, spec: TinySpec | None, block: list[int], backend: str
) -> None:
    """Qwen3-FP8's form (a scale a block): every attention and MLP matrix held in e4m3, the bytes as written, its
    scales a block (q's, k's and v's rows stacked as their rows are; GLM-4's fused gate_up_proj as it comes, its q and
    k rows reordered within each head as they load, the blocks whole heads); dequantized they are the reference's
    weights to the bit, and the engine gives its tokens: on the native path each matrix dequantized once as it is
    packed, in the Triton kernel each tile's product scaled as it sums. Doubled scales give other tokens."""
    quantized, reference = _write_pair(tmp_path, "block", spec=spec, block_size=block)
    held = load_model(str(quantized), device=TEST_DEVICE, quantized_dense=True)
    plain = load_model(str(reference), device=TEST_DEVICE)
    rows, cols = block
    for layer, want in zip(held.model.layers, plain.model.layers, strict=True):
        assert layer.fp8_block == (rows, cols)
        for name in ("qkv", "o", "gate_up", "down"):
            weight, scale = getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_scale")
            assert weight.dtype == torch.float8_e4m3fn and scale.shape == (
                weight.shape[0] // rows,
                weight.shape[1] // cols,
            )
            dense = Fp8Stack(weight[None], scale[None], (rows, cols)).dequantized(0, torch.float32)
            assert torch.equal(dense, getattr(want, f"{name}_weight")), name
    if spec is None:
        stored = load_file(str(quantized / "model.safetensors"))["model.layers.1.self_attn.k_proj.weight"]
        assert torch.equal(held.model.layers[1].qkv_weight[64:96].view(torch.uint8).cpu(), stored.view(torch.uint8))
    if backend == "triton" and not triton_paged.available(held.device):
        pytest.skip("triton unavailable")
    tokens = greedy_tokens(held, backend)
    assert tokens == greedy_tokens(plain, backend)
    with torch.no_grad():
        for layer in held.model.layers:
            layer.gate_up_scale.mul_(2)  # (not down's: GLM-4's norm after the MLP would undo it)
            layer.widened.clear()  # (the native path's packed copies, made again from the scales)
    assert greedy_tokens(held, backend) != tokens


def test_fp8_matrices_with_a_scale_per_channel_are_held_as_fp8_quantization_holds_them(tmp_path: Path) -> None:
    """llm-compressor's FP8 (a scale per output channel) held as stored: the e4m3 bytes and scales ``--quantization
    fp8`` would make of the dequantized weights (each row's largest value at 448), so the same products and tokens;
    the checkpoint's own, not rounded again."""
    quantized, reference = _write_pair(tmp_path, "channel")
    held = load_model(str(quantized), quantized_dense=True)
    again = load_model(str(reference), quantization="fp8")
    layer, want = held.model.layers[1], again.model.layers[1]
    assert layer.fp8_block is None and layer.gate_up_scale.shape == (1, 256)
    assert torch.equal(layer.gate_up_weight.view(torch.uint8), want.gate_up_weight.view(torch.uint8))
    torch.testing.assert_close(layer.gate_up_scale, want.gate_up_scale, rtol=1e-6, atol=0)
    assert greedy_tokens(held) == greedy_tokens(again)


@pytest.mark.parametrize("spec", [None, GLM4], ids=["llama", "glm4-interleaved-0d-scales"])
def test_a_scale_per_tensor_is_every_row_of_its_matrix(tmp_path: Path, spec: TinySpec | None) -> None:
    """vLLM's per-tensor FP8: q's, k's and v's one scale each spread over their rows of the fused matrix; dequantized
    the matrices are the reference's to the bit. The activations' static scales are dropped (dynamic per token).
    AutoFP8 saves each scale 0-d: so too (GLM-4's q and k rows reordered as they load, their scale as it is). Held,
    the model computes otherwise than dequantized: its KV is named apart (the fingerprint)."""
    quantized, reference = _write_pair(tmp_path, "tensor", spec=spec)
    if spec is not None:
        stored = load_file(str(quantized / "model.safetensors"))
        save_file({k: v.reshape(()) if k.endswith("_scale") else v for k, v in stored.items()},
                  str(quantized / "model.safetensors"))  # fmt: skip
    held = load_model(str(quantized), quantized_dense=True)
    assert held.fingerprint != load_model(str(quantized)).fingerprint
    plain = load_model(str(reference))
    scales = load_file(str(quantized / "model.safetensors"))
    layer = held.model.layers[0]
    q, kv = (64, 32) if spec is None else (128, 64)
    for name, rows in (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)), ("v_proj", slice(q + kv, q + 2 * kv))):
        stored = scales[f"model.layers.0.self_attn.{name}.weight_scale"]
        assert torch.equal(layer.qkv_scale[0, rows], stored.expand(rows.stop - rows.start))
    for layer, want in zip(held.model.layers, plain.model.layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):
            dense = getattr(layer, f"{name}_weight").float() * getattr(layer, f"{name}_scale").t()
            assert torch.equal(dense, getattr(want, f"{name}_weight")), name


def test_fp8_matrices_are_held_only_in_forms_their_products_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Blocks of 48 do not tile a hidden size of 64: refused when asked, dequantized by default (and on the CPU by
    default the dense matrices load dequantized whatever their form). A checkpoint that leaves a projection
    unquantized (``ignore``) is not held either; one that says nothing of a projection it left in 32-bit is named
    when holding was asked for, and where it is the default (a GPU's) the checkpoint is read again dequantized."""
    quantized, _ = _write_pair(tmp_path, "block")
    with pytest.raises(ConfigError, match="dense matrices are held as stored only"):
        load_model(str(quantized), quantized_dense=True)
    assert load_model(str(quantized)).model.layers[0].qkv_weight.dtype == torch.float32
    tiled, _ = _write_pair(tmp_path / "tiled", "block", block_size=[16, 16])
    assert load_model(str(tiled)).model.layers[0].qkv_weight.dtype == torch.float32  # (the CPU: not by default)
    config = json.loads((tiled / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.1.mlp.down_proj"]
    (tiled / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="dense matrices are held as stored only"):
        load_model(str(tiled), quantized_dense=True)
    del config["quantization_config"]["modules_to_not_convert"]
    (tiled / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tiled / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].float() * 0.01
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(tiled / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"down_proj\.weight' comes as torch\.float32 where this checkpoint's"):
        load_model(str(tiled), quantized_dense=True)
    from boundless.model import loader

    held_by_default = loader.holds_quantized_dense
    monkeypatch.setattr(
        loader, "holds_quantized_dense", lambda asked, form, *rest: form is not None if asked is None else asked
    )
    assert held_by_default(None, "blocks", torch.device("cpu"), 1, torch.float32) is False
    with caplog.at_level("WARNING", logger="boundless.model.loader"):
        again = load_model(str(tiled))
    assert again.model.layers[0].qkv_weight.dtype == torch.float32 and not again.model.layers[0].held_as_stored
    assert "loading it dequantized" in caplog.text
    assert torch.equal(again.model.layers[1].down_weight, tensors[name])


def test_fp8_dense_forms() -> None:
    """Which checkpoints' dense matrices may be held: one scheme throughout (compressed-tensors' single group), blocks
    that tile every matrix with the kernel's tiles of inputs within them, and for GLM-4's interleaved RoPE, blocks of
    whole heads; a scale per row where ``_scaled_mm`` takes the sides (multiples of 16)."""
    from boundless.model.arch import ModelArch
    from boundless.model.loader import quantized_dense_form
    from boundless.model.quantized_checkpoint import QuantizedCheckpoint

    arch = ModelArch(
        model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    assert quantized_dense_form(QuantizedCheckpoint("fp8", (32, 32), uniform=True), arch) == "blocks"
    assert quantized_dense_form(QuantizedCheckpoint("fp8", (128, 128), uniform=True), arch) is None  # (kv: 64 rows)
    assert quantized_dense_form(QuantizedCheckpoint("fp8", (32, 8), uniform=True), arch) is None  # (tiles of 16)
    assert quantized_dense_form(QuantizedCheckpoint("fp8", (32, 32)), arch) is None  # (not one scheme throughout)
    assert quantized_dense_form(QuantizedCheckpoint("compressed-tensors", None, uniform=True), arch) == "rows"
    interleaved = dataclasses.replace(arch, model_type="glm4")
    assert quantized_dense_form(QuantizedCheckpoint("fp8", (16, 32), uniform=True), interleaved) is None
    assert quantized_dense_form(QuantizedCheckpoint("fp8", (32, 32), uniform=True), interleaved) == "blocks"
    groups = {"a": {"weights": {"num_bits": 8, "type": "float"}}, "b": {"weights": {"num_bits": 8, "type": "float"}}}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": groups}}
    assert QuantizedCheckpoint.of(config) == QuantizedCheckpoint("compressed-tensors", None, uniform=False)
    for ignored, uniform in (
        (["lm_head"], True), (["re:.*lm_head"], True), (["model.layers.0.mlp.gate", "lm_head"], True),
        (["model.layers.0.self_attn.o_proj"], False), (["re:.*o_proj"], False), (["model.layers.0.self_attn"], False),
    ):  # fmt: skip
        for key in ("modules_to_not_convert", "ignored_layers"):  # (HF's FP8 config's; AutoFP8's)
            config = {"quantization_config": {"quant_method": "fp8", key: ignored}}
            assert QuantizedCheckpoint.of(config).uniform is uniform, ignored  # type: ignore[union-attr]
    # compressed-tensors: one group over every linear layer is uniform; one over some of them is not; scales a group
    # of inputs are no scale per row.
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
    every = {"quant_method": "compressed-tensors", "config_groups": {"g": group}, "ignore": ["lm_head"]}
    assert QuantizedCheckpoint.of({"quantization_config": every}) == QuantizedCheckpoint(
        "compressed-tensors", None, uniform=True
    )
    some = {"quant_method": "compressed-tensors", "config_groups": {"g": {**group, "targets": ["re:.*q_proj"]}}}
    assert not QuantizedCheckpoint.of({"quantization_config": some}).uniform  # type: ignore[union-attr]
    grouped = {**group, "weights": {**group["weights"], "strategy": "group", "group_size": 32}}
    by_group = QuantizedCheckpoint.of(
        {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": grouped}}}
    )
    assert by_group == QuantizedCheckpoint("compressed-tensors", None, uniform=True, per_row=False)
    assert quantized_dense_form(by_group, arch) is None
