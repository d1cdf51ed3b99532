"""MXFP4 checkpoints (gpt-oss's experts): their blocks and scales dequantized as transformers dequantizes them."""

from __future__ import annotations

import pytest
import torch

from boundless.config import ConfigError
from boundless.model.mxfp4 import Mxfp4Checkpoint, dequantize_mxfp4
from boundless.model.quantized_checkpoint import QuantizedCheckpoint


def _blocks_and_scales(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)  # 3 experts, 10 rows of 128
    scales = torch.randint(100, 140, (3, 10, 4), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_dequantized_as_transformers_dequantizes() -> None:
    """Every nibble's e2m1 value (all sixteen, both signs of zero) times its block's power of two: transformers'
    dequantized tensor, bit for bit, in its layout ([experts, in, out])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _blocks_and_scales()
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # (each nibble value, low and high)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    ((name, got),) = list(Mxfp4Checkpoint().dequantized(iter([("w_scales", scales), ("w_blocks", blocks)])))
    assert name == "w" and got.shape == want.shape == (3, 128, 10)
    assert torch.equal(got, want)
    assert torch.equal(
        dequantize_mxfp4(blocks, scales)[0, 0, :4],
        torch.tensor([0.0, 0.0, 0.5, 0.5]) * 2.0 ** (int(scales[0, 0, 0]) - 127),
    )


def test_unpaired_or_misshapen_blocks_are_refused() -> None:
    blocks, scales = _blocks_and_scales()
    with pytest.raises(ValueError, match="without their scales"):
        list(Mxfp4Checkpoint().dequantized(iter([("a.w_blocks", blocks), ("a.bias", scales)])))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :3])
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), scales)
    mxfp4 = {"quant_method": "mxfp4"}
    assert isinstance(QuantizedCheckpoint.of({"model_type": "gpt_oss", "quantization_config": mxfp4}), Mxfp4Checkpoint)
    with pytest.raises(ConfigError, match="MXFP4 checkpoints load for gpt-oss only"):  # (its experts' layout)
        QuantizedCheckpoint.of({"model_type": "llama", "quantization_config": mxfp4})


def test_experts_are_held_in_mxfp4_where_the_kernels_read_them() -> None:
    """By default on CUDA with Triton and one rank (the fused experts' kernel reads the blocks), dequantized on the
    CPU; asked of a checkpoint whose experts cannot be held as stored, or over ranks, refused in words."""
    from boundless.model.loader import holds_quantized_experts as holds

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not holds(None, "mxfp4", cpu, 1)
    assert holds(None, "mxfp4", cuda, 1) and not holds(None, "mxfp4", cuda, 2) and not holds(None, None, cuda, 1)
    assert holds(True, "mxfp4", cpu, 1) and not holds(False, "mxfp4", cuda, 1)
    with pytest.raises(ConfigError, match="only from an MXFP4 checkpoint"):
        holds(True, None, cpu, 1)
    with pytest.raises(ConfigError, match="tensor-parallel"):
        holds(True, "mxfp4", cuda, 2)


def test_a_gguf_files_experts_are_not_held_in_mxfp4() -> None:
    from boundless.model.loader import load_model

    with pytest.raises(ConfigError, match="GGUF file's experts load dequantized"):
        load_model("smollm2-135m", quantized_experts=True)


def test_dequantized_in_float16_where_the_values_fit() -> None:
    """A scale of 2**16 times 0.5 is 32768, which float16 holds (its 2**16 alone it does not: the power is taken in
    fp32 first)."""
    blocks = torch.full((1, 1, 16), 0x11, dtype=torch.uint8)  # (0.5 in both nibbles)
    values = dequantize_mxfp4(blocks, torch.tensor([[143]], dtype=torch.uint8), torch.float16)
    assert values.dtype == torch.float16 and torch.equal(values, torch.full((1, 32), 32768.0, dtype=torch.float16))
