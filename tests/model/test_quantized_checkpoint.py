"""FP8 checkpoints (``quantization_config``): a random model's weights quantized as Qwen's FP8 models (blocks of
``weight_block_size``), llm-compressor's (compressed-tensors, per output channel) and vLLM's per-tensor fp8 are
written beside the same model's weights dequantized in fp32; both load to the same parameters, whatever order the
weights and their scales come in. Other quantizations are refused in words (GPTQ's and AWQ's load:
``tests/model/test_packed_int.py``)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from boundless.attention import triton_paged
from boundless.config import ConfigError
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel, load_model
from boundless.model.random_model import TinySpec, write_random_model

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


def _greedy(loaded: LoadedModel, backend: str = "auto") -> list[list[int]]:
    core = EngineCore.from_model(
        loaded, engine_config(loaded.name, max_model_len=128, num_kv_blocks=32, attention_backend=backend)
    )
    prompts = [[5, 9, 13, 17, 21, 25], [7, 3, 11] * 5]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id].extend(delta.new_token_ids)
    return list(out.values())


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
    assert _greedy(held, backend) == _greedy(plain, backend)


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
