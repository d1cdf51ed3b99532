"""The Triton attention kernels compile for an H100/H200 (sm_90) with Triton's own compiler, no GPU
needed: what the interpreter accepts but a GPU would refuse (a global that is not constexpr, a tile a
dot cannot take, shared memory beyond the chip's) fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

SHARED_MEMORY_PER_BLOCK = 227 * 1024  # sm_90's most per block


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    proc = subprocess.run(
        [sys.executable, "-m", "boundless.attention.triton_compile", "90"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared = json.loads(proc.stdout)
    # Per dtype (bf16, fp32): attention (d64, d128) x (decode, split, prefill; in bf16 also prefill with the mask on
    # every tile, the tile sweep's baseline, a sliding window's split decode and prefill, and Gemma 2's split decode
    # of capped scores), store, merge, and the
    # layers' rms_norm (Llama's and Gemma's), rotary and silu_mul; and a device
    # window's next-pass inputs; a bf16 model's over an fp8 cache (e4m3: decode, split decode, prefill, store; e5m2:
    # decode, store); --quantization fp8's activation quantizer; and a mixture's experts (bf16 decode and prefill, fp32,
    # gpt-oss's MXFP4 decode and prefill, --quantization fp8's e4m3 decode and prefill, an FP8 checkpoint's blocks,
    # GLM-4.5's routing weights in fp32; an FP8 checkpoint's dense matrices in blocks, a decode's and a prefill's);
    # and a GPTQ or AWQ checkpoint's matrices held in their bits (4 bits in fp16, decode and prefill, bf16; 8 bits).
    assert len(shared) == (2 * 7 + 2 + 4) + (2 * 3 + 2 + 4) + 1 + (4 + 2) + 1 + 9 + 2 + 4
    assert {
        "fused_moe/bf16/decode",
        "fused_moe/mxfp4-bf16/prefill-bias-routed",
        "fused_moe/fp8-bf16/decode",
        "fused_moe/fp8-blocks-bf16/dense-decode-bias",
        "fused_moe/fp8-blocks-bf16/dense-prefill",
        "fused_moe/int4-fp16/dense-prefill-bias",
        "fused_moe/int8-fp16/dense-decode",
    } <= shared.keys()
    assert {"attention/bf16/d128/prefill-window", "rms_norm-gemma/bf16"} <= shared.keys()
    assert "attention/bf16/d128/decode-split-window-softcap" in shared
    assert {"attention/bf16-fp8-cache/d128/decode", "store_kv/bf16-to-fp8", "fp8_linear/quantize_rows"} <= shared.keys()
    assert {"attention/bf16-fp8-e5m2-cache/d128/decode", "store_kv/bf16-to-fp8-e5m2"} <= shared.keys()
    assert all(0 <= b <= SHARED_MEMORY_PER_BLOCK for b in shared.values())


def test_the_fp8_cache_types_are_named_as_triton_names_pytorchs() -> None:
    """The compile's 8-bit cache types are the ones a launch over PyTorch's float8 tensors takes (Triton names a
    pointer's type from its tensor's dtype), and the store saturates at each type's largest finite value."""
    import torch
    from triton._utils import type_canonicalisation_dict

    from boundless.attention.triton_compile import FP8_CACHE_TYPES
    from boundless.kv.cache_dtype import FP8_DTYPES

    assert {getattr(torch, name) for name, _ in FP8_CACHE_TYPES.values()} == set(FP8_DTYPES)
    for triton_name, (torch_name, largest) in FP8_CACHE_TYPES.items():
        assert type_canonicalisation_dict[torch_name] == triton_name
        assert float(torch.finfo(getattr(torch, torch_name)).max) == largest
