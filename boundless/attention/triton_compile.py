"""Compile the Triton kernels (attention, the layers' fused ops, a mixture's experts, a device window's next inputs)
for a GPU target without a GPU (``python -m boundless.attention.triton_compile``): what the device would compile at
the first step, checked ahead, with the shared memory each variant takes. The tests run it, so a kernel the
interpreter accepts but the compiler refuses (a global that is not constexpr, a shape a dot cannot take) fails on the
CPU too."""

from __future__ import annotations

import importlib
import inspect
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from boundless.attention import triton_kernels as kernels
from boundless.engine import window_inputs
from boundless.model import fp8_linear, fused_moe, triton_ops

_ATTENTION_ARGS = {
    "lse_ptr": "*fp32", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32",
    "q_block_seq_ptr": "*i32", "q_block_start_ptr": "*i32", "scale_log2": "fp32", "num_tokens": "i32",
    "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32",
    "stride_cache_head": "i32", "stride_cache_block": "i32",
}  # fmt: skip


def compile_kernel(fn, types: dict[str, str], consts: dict, target: GPUTarget, warps: int, stages: int) -> int:
    """Compile ``fn`` for ``target``; returns the bytes of shared memory it takes."""
    params = list(inspect.signature(fn.fn).parameters)
    signature = {p: "constexpr" if p in consts else types[p] for p in params}
    constexprs = {(params.index(k),): v for k, v in consts.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
    return int(compiled.metadata.shared)


@dataclass(frozen=True)
class CompileJob:
    """One kernel variant to compile: the kernel by its module's attribute (a job goes to another process), its
    argument types and constants, and its launch options."""

    key: str
    kernel: tuple[str, str]  # (module, name)
    types: dict[str, str]
    consts: dict
    warps: int
    stages: int

    def run(self, capability: int) -> tuple[str, int]:
        fn = getattr(importlib.import_module(self.kernel[0]), self.kernel[1])
        target = GPUTarget("cuda", capability, 32)
        return self.key, compile_kernel(fn, self.types, self.consts, target, self.warps, self.stages)


# PyTorch's 8-bit KV types by Triton's names for them (triton._utils.type_canonicalisation_dict), with the largest
# finite value the store saturates at (torch.finfo(...).max).
FP8_CACHE_TYPES = {"fp8e4nv": ("float8_e4m3fn", 448.0), "fp8e5": ("float8_e5m2", 57344.0)}


def fp8_cache_jobs() -> list[CompileJob]:
    """A bf16 model's kernels over an fp8 cache (``--kv-cache-dtype fp8``: Triton's ``fp8e4nv``, which needs sm_89
    or later): the store's rounding, a decode's and a prefill's widening reads; a decode's and the store over
    ``fp8_e5m2`` (Triton's ``fp8e5``), and a decode split over programs."""
    jobs = []
    for cache, variants in (
        ("fp8e4nv", (("decode", 1, 16, 128, 4, False), ("decode-split", 1, 16, 128, 4, True),
                     ("prefill", 32, 128, 64, 8, False))),
        ("fp8e5", (("decode", 1, 16, 128, 4, False),)),
    ):  # fmt: skip
        suffix = "" if cache == "fp8e4nv" else "-e5m2"
        for name, block_q, block_m, block_n, warps, split in variants:
            types = dict(_ATTENTION_ARGS, q_ptr="*bf16", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}",
                         out_ptr="*fp32" if split else "*bf16")  # fmt: skip
            jobs.append(
                CompileJob(
                    f"attention/bf16-fp8{suffix}-cache/d128/{name}", (kernels.__name__, "paged_attention_kernel"),
                    types,
                    dict(GROUP=4, NUM_HEADS=32, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=16,
                         HEAD_DIM=128, DIM_POW2=128, SPLIT=split, PRECISION=None, MASK_EVERY_TILE=False, WINDOW=0,
                         SOFTCAP=0.0),
                    warps, 3,
                )
            )  # fmt: skip
        jobs.append(
            CompileJob(
                f"store_kv/bf16-to-fp8{suffix}", (kernels.__name__, "store_kv_kernel"),
                dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}", slot_ptr="*i64",
                     stride_kt="i32", stride_vt="i32", stride_cache_head="i32"),
                dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_POW2=8, DIM_POW2=128, SATURATE=FP8_CACHE_TYPES[cache][1]),
                4, 1,
            )
        )  # fmt: skip
    return jobs


def fp8_linear_jobs() -> list[CompileJob]:
    """``--quantization fp8``: the kernel that quantizes each product's activations on CUDA (bf16 rows to e4m3)."""
    return [
        CompileJob(
            "fp8_linear/quantize_rows", (fp8_linear.__name__, "_quantize_rows_kernel"),
            dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32", stride_x="i32", n_cols="i32"),
            dict(INV_FP8_LARGEST=fp8_linear._INV_FP8_MAX, TINY=fp8_linear._TINY, BLOCK=fp8_linear._QUANTIZE_BLOCK),
            4, 1,
        )
    ]  # fmt: skip


def fused_moe_jobs() -> list[CompileJob]:
    """A mixture's experts on the GPU path (``model/fused_moe.py``): a decode's tiles (few rows an expert) and a
    prefill's, with the biases and the routing weight, in bf16 and fp32, gpt-oss's experts read as MXFP4, and
    ``--quantization fp8``'s experts and an FP8 checkpoint's read as e4m3 (sm_89 or later), and an FP8 checkpoint's
    dense matrices through the same kernel (``held_linear``); and a GPTQ or AWQ checkpoint's experts and dense
    matrices in their bits (4 bits in groups of 128, in fp16, their checkpoints' type, and bf16; 8 bits)."""
    jobs = []
    for name, weight, scales, dtype, (block_m, block_n, block_k), bias, routed, scale_block, int_bits in (
        ("bf16/decode", "bf16", "bf16", "bf16", (16, 32, 64), False, False, (1, 0), 0),
        ("bf16/prefill-bias-routed", "bf16", "bf16", "bf16", (64, 64, 64), True, True, (1, 0), 0),
        ("fp32/decode", "fp32", "fp32", "fp32", (16, 32, 32), False, True, (1, 0), 0),
        ("mxfp4-bf16/decode-bias", "u8", "u8", "bf16", (16, 32, 64), True, False, (1, 0), 0),
        ("mxfp4-bf16/prefill-bias-routed", "u8", "u8", "bf16", (64, 64, 64), True, True, (1, 0), 0),
        ("fp8-bf16/decode", "fp8e4nv", "fp32", "bf16", (16, 32, 64), False, False, (1, 0), 0),
        ("bf16/decode-routed", "bf16", "bf16", "bf16", (16, 32, 64), False, True, (1, 0), 0),
        ("fp8-bf16/prefill-routed", "fp8e4nv", "fp32", "bf16", (64, 64, 64), False, True, (1, 0), 0),
        # (An FP8 checkpoint's experts, a scale a block of 128 x 128: Qwen3-30B-A3B-FP8's.)
        ("fp8-blocks-bf16/decode", "fp8e4nv", "fp32", "bf16", (16, 32, 64), False, False, (128, 128), 0),
        # (An FP8 checkpoint's dense matrices, one expert every row chose: held_linear's tiles, a bias or none.)
        ("fp8-blocks-bf16/dense-decode-bias", "fp8e4nv", "fp32", "bf16", (16, 64, 64), True, False, (128, 128), 0),
        ("fp8-blocks-bf16/dense-prefill", "fp8e4nv", "fp32", "bf16", (64, 64, 64), False, False, (128, 128), 0),
        # (GPTQ's and AWQ's codes: experts routed, dense matrices with Qwen2's q/k/v bias, in fp16 and bf16; 8 bits.)
        ("int4-fp16/decode-routed", "u8", "fp32", "fp16", (16, 32, 64), False, True, (1, 0), 4),
        ("int4-fp16/dense-prefill-bias", "u8", "fp32", "fp16", (64, 64, 64), True, False, (1, 0), 4),
        ("int4-bf16/dense-decode", "u8", "fp32", "bf16", (16, 64, 64), False, False, (1, 0), 4),
        ("int8-fp16/dense-decode", "u8", "fp32", "fp16", (16, 64, 64), False, False, (1, 0), 8),
    ):
        # (GLM-4.5's routing weights come in fp32, the others' in the model's type.)
        routing = "*fp32" if name == "bf16/decode-routed" else f"*{dtype}"
        ptr = f"*{dtype}"
        types = dict(
            out_ptr=ptr, a_ptr=ptr, w_ptr=f"*{weight}", scale_ptr=f"*{scales}", zero_ptr="*u8", bias_ptr=ptr,
            routing_ptr=routing,
            sorted_ptr="*i32", block_expert_ptr="*i32", num_rows_ptr="*i32", n_cols="i32", k_cols="i32",
            num_slots="i32", a_row_of_slot="i32", stride_am="i32", stride_we="i32", stride_wn="i32", stride_wk="i32",
            stride_se="i32", stride_sn="i32", stride_sk="i32", stride_be="i32", stride_om="i32",
        )  # fmt: skip
        consts = dict(
            HAS_BIAS=bias, ROUTED=routed, MXFP4=weight == "u8" and not int_bits, FP8=weight == "fp8e4nv",
            SCALE_N=scale_block[0], SCALE_K=scale_block[1], INT_BITS=int_bits, GROUP=128 if int_bits else 1,
            PRECISION="ieee" if dtype == "fp32" else None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )  # fmt: skip
        kernel = (fused_moe.__name__, "_expert_product_kernel")
        jobs.append(CompileJob(f"fused_moe/{name}", kernel, types, consts, 4, 3))
    return jobs


def compile_jobs() -> list[CompileJob]:
    """The variants a Llama-shaped model takes (GQA group 4, head size 64 and 128) in bf16 and fp32, and over an fp8
    cache."""
    attention = (kernels.__name__, "paged_attention_kernel")
    ops = triton_ops.__name__
    jobs = []
    for dtype, precision in (("bf16", None), ("fp32", "ieee")):
        ptr = f"*{dtype}"
        for head_dim in (64, 128):
            bf16 = dtype == "bf16"
            for name, block_q, block_m, block_n, warps, stages, split, every, window, softcap in (
                ("decode", 1, 16, 128 if bf16 else 32, 4, 3, False, False, 0, 0.0),
                ("decode-split", 1, 16, 128 if bf16 else 32, 4, 3, True, False, 0, 0.0),
                ("prefill", 32, 128, 64, 8, 3, False, False, 0, 0.0)
                if bf16
                else ("prefill", 16, 64, 32, 4, 2, False, False, 0, 0.0),
                *([("prefill-every-tile-masked", 32, 128, 64, 8, 3, False, True, 0, 0.0)] if bf16 else []),  # (sweep)
                # A sliding window's layers (Mistral's 4,096 keys), and Gemma 2's, its scores capped at 50.
                *([("decode-split-window", 1, 16, 128, 4, 3, True, False, 4096, 0.0)] if bf16 else []),
                *([("prefill-window", 32, 128, 64, 8, 3, False, False, 4096, 0.0)] if bf16 else []),
                *([("decode-split-window-softcap", 1, 16, 128, 4, 3, True, False, 4096, 50.0)] if bf16 else []),
            ):
                types = dict(_ATTENTION_ARGS, q_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr)
                types["out_ptr"] = "*fp32" if split else ptr
                consts = dict(
                    GROUP=4, NUM_HEADS=32, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=16,
                    HEAD_DIM=head_dim, DIM_POW2=head_dim, SPLIT=split, PRECISION=precision, MASK_EVERY_TILE=every,
                    WINDOW=window, SOFTCAP=softcap,
                )  # fmt: skip
                jobs.append(
                    CompileJob(f"attention/{dtype}/d{head_dim}/{name}", attention, types, consts, warps, stages)
                )
        jobs += [
            CompileJob(
                f"store_kv/{dtype}", (kernels.__name__, "store_kv_kernel"),
                dict(k_ptr=ptr, v_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, slot_ptr="*i64", stride_kt="i32",
                     stride_vt="i32", stride_cache_head="i32"),
                dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_POW2=8, DIM_POW2=128, SATURATE=0.0), 4, 1,
            ),
            CompileJob(
                f"merge_splits/{dtype}", (kernels.__name__, "merge_splits_kernel"),
                dict(out_ptr=ptr, lse_ptr="*fp32", part_out_ptr="*fp32", part_lse_ptr="*fp32", num_tokens="i32",
                     num_splits="i32", stride_ot="i32", stride_oh="i32"),
                dict(NUM_HEADS=32, HEAD_DIM=128, DIM_POW2=128, SPLITS_POW2=16), 4, 1,
            ),
            CompileJob(
                f"rms_norm/{dtype}", (ops, "_rms_norm_kernel"),
                dict(out_ptr=ptr, x_ptr=ptr, delta_ptr=ptr, weight_ptr=ptr, eps="fp32", stride_out="i32",
                     stride_x="i32", stride_delta="i32", n_cols="i32"),
                dict(ADD=True, ROUND=True, BLOCK=4096), 8, 1,
            ),
            CompileJob(  # (Gemma's: its weight in fp32, the product rounded once)
                f"rms_norm-gemma/{dtype}", (ops, "_rms_norm_kernel"),
                dict(out_ptr=ptr, x_ptr=ptr, delta_ptr=ptr, weight_ptr="*fp32", eps="fp32", stride_out="i32",
                     stride_x="i32", stride_delta="i32", n_cols="i32"),
                dict(ADD=True, ROUND=False, BLOCK=4096), 8, 1,
            ),
            CompileJob(
                f"rotary/{dtype}", (ops, "_rotary_kernel"),
                dict(x_ptr=ptr, pos_ptr="*i64", cos_ptr=ptr, sin_ptr=ptr, stride_t="i32", stride_h="i32",
                     stride_table="i32", num_heads="i32"),
                dict(HALF=64, HEADS_POW2=64, HALF_POW2=64), 4, 1,
            ),
            CompileJob(
                f"silu_mul/{dtype}", (ops, "_silu_mul_kernel"),
                dict(out_ptr=ptr, gate_up_ptr=ptr, stride_out="i32", stride_in="i32", n_cols="i32"),
                dict(BLOCK=1024), 4, 1,
            ),
        ]  # fmt: skip
    jobs.append(
        CompileJob(
            "window_inputs/advance", (window_inputs.__name__, "_advance_kernel"),
            dict(tokens_ptr="*i64", steps_ptr="*i64", input_ids_ptr="*i64", positions_ptr="*i64", slots_ptr="*i64",
                 seq_lens_ptr="*i32", block_tables_ptr="*i32", stride_bt="i32", n="i32", j="i32"),
            dict(PAGE=16, BLOCK=256), 4, 1,
        )
    )  # fmt: skip
    return jobs + fp8_cache_jobs() + fp8_linear_jobs() + fused_moe_jobs()


def compile_all(capability: int = 90, workers: int | None = None) -> dict[str, int]:
    """Every variant of :func:`compile_jobs` compiled for ``capability``, each core compiling its share (a cold
    Triton cache takes ~1 s a variant): the shared memory each takes, by key."""
    jobs = compile_jobs()
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    if workers == 1:
        return dict(job.run(capability) for job in jobs)
    # (Forked: each worker starts with the kernels' modules imported; 16 s against 28 s in one process, 2 cores.)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return dict(pool.map(CompileJob.run, jobs, [capability] * len(jobs)))


if __name__ == "__main__":
    json.dump(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90), sys.stdout, indent=1)
