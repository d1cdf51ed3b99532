"""FP8 checkpoints (``quantization_config``): a random model's weights quantized as Qwen's FP8 models (blocks of
``weight_block_size``), llm-compressor's (compressed-tensors, per output channel) and vLLM's per-tensor fp8 are
written beside the same model's weights dequantized in fp32; both load to the same parameters, whatever order the
weights and their scales come in. Other quantizations are refused in words (GPTQ's and AWQ's load:
``tests/model/test_packed_int.py``)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from boundless.config import ConfigError
from boundless.model.loader import load_model
from boundless.model.random_model import TinySpec, write_random_model

FP8_MAX = 448.0


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


def _write_pair(root: Path, scheme: str, split: bool = False) -> tuple[Path, Path]:
    """A random model written twice: its linear weights quantized by ``scheme`` (with ``split``, the scales in a file
    read before the weights'), and dequantized in fp32 (no quantization_config)."""
    source = write_random_model(root / "source", TinySpec(weight_std=0.3))
    quant, scale_name = SCHEMES[scheme]
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
