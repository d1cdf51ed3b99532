#!/usr/bin/env bash
# The GPU checks of one device session, run from the repository root with the device's own python3 (PyTorch,
# Triton, transformers; nothing installed), in at most 10 minutes (the default part, below).
# GPU_CHECK_PART=flex (under 10 minutes), GPU_CHECK_PART=more (~7 minutes), GPU_CHECK_PART=moe (the mixtures of
# experts' fused kernels and MXFP4, ~9 minutes) and GPU_CHECK_PART=quantized (FP8, GPTQ and AWQ checkpoints' dense
# matrices held as stored, ~6 minutes) are runs for later sessions (two
# parts with their machine starts pass a session's 15 minutes of device time). flex: FlexAttention's tests on CUDA
# (--attention-backend flex: the kernel library against our Triton kernels), then `bench gpu --shapes tiles` (the
# attention kernels' tile shapes swept on the 1B shape, against FlexAttention and SDPA) and the engine on it on the
# decode-heavy case. more: the sampler's,
# speculative and suffix decoding's, structured
# outputs', LoRA's (against PEFT, skipped unless its wheel travels in .whl: `pip download --no-deps peft==0.21.2`),
# multi-step's and the detokenizer's tests on CUDA, then the sliding windows'. Structured outputs need xgrammar, absent there: they skip unless
# its wheels travel in .whl (the device tool's README; for its Python 3.12: `pip download --no-deps
# --only-binary=:all: --python-version 3.12 ... xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2`), installed below when
# present.
# Before a run, `bash scripts/device-build.sh` here builds the hot modules for the machine's Python into .device-build/:
# carry it (run(..., carry=[".device-build"])), else the engine's host work there runs from source (the H200 runs of
# 4-5 December did: their host figures are of the source).
# Logs and figures go to ${OUT:-gpu-check}/.
set -o pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site
fi
# The hot modules compiled for this Python where the run carries them (scripts/device-build.sh, run here first): the
# engine's host work then runs as `make` builds it, as on a user's machine. Without them it runs from source.
if [ -d .device-build/compiled ]; then
    export BOUNDLESS_CACHE_DIR=$PWD/.device-build
fi
python3 -c "from boundless import compiled; from boundless.engine import scheduler; print('compiled modules:', compiled.is_compiled(scheduler))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
if [ "${GPU_CHECK_PART:-main}" = flex ]; then
    # FlexAttention (--attention-backend flex), compiled: its tests against the dense reference and the block mask,
    # transformers' greedy tokens and DistAttention on it; then the attention kernels' tile shapes on the 1B shape's
    # prefill and decode against FlexAttention and SDPA (each case and tile compiles FlexAttention once).
    # (Every new shape compiles, some seconds each: the kernel's tests and the graph runner's first; the parity
    # tests, which the CPU runs in CI, only if time is left.)
    BOUNDLESS_TEST_DEVICE=cuda timeout 200 python3 -m pytest -p no:cacheprovider -q -rfE --tb=short --maxfail=5 \
        -k "flex and not smollm2" tests/attention/test_flex_paged.py tests/engine/test_cuda_graphs.py \
        tests/engine/test_dist_attention.py tests/model/test_reference.py 2>&1 | tee "$out/pytest-flex.log" | tail -15
    timeout 260 python3 -m boundless.bench.gpu --shapes tiles --json "$out/bench-tiles.json" 2>&1 \
        | tee "$out/bench-tiles.log" | tail -12
    # The engine on FlexAttention, with its CUDA graphs, on the decode-heavy case against transformers (last: the
    # compiles of its shapes may not fit, and nothing after it is lost).
    timeout 120 python3 -m boundless.bench.gpu --shapes 1b --cases 1 --windows 16 --attention-backend flex \
        --json "$out/bench-flex.json" 2>&1 | tee "$out/bench-flex.log" | tail -25
    exit
fi
if [ "${GPU_CHECK_PART:-main}" = moe ]; then
    # Mixtures of experts on CUDA (7 December, CPU-checked only): the fused experts' kernels against the per-expert
    # path (bfloat16 too) and reading MXFP4, a mixture's captured decode graphs against eager, the MoE models and
    # gpt-oss held in MXFP4 against transformers; then `bench gpu --shapes moe` (gpt-oss-20b's widths, 8 layers, MXFP4
    # experts: against transformers, eagerly and dequantized beside it).
    BOUNDLESS_TEST_DEVICE=cuda timeout 200 python3 -m pytest -p no:cacheprovider -q -rfE --tb=short --maxfail=5 \
        -k "fused_moe or mixture or moe or gpt_oss or gpt-oss" tests/model/test_fused_moe.py \
        tests/engine/test_cuda_graphs.py tests/model/test_reference.py tests/model/test_quantized_checkpoint.py \
        2>&1 | tee "$out/pytest-moe.log" | tail -15
    timeout 360 python3 -m boundless.bench.gpu --shapes moe --json "$out/bench-moe.json" 2>&1 \
        | tee "$out/bench-moe.log" | tail -25
    exit
fi
if [ "${GPU_CHECK_PART:-main}" = quantized ]; then
    # Quantized checkpoints' dense matrices held as stored (7 December, CPU-checked only): FP8 blocks through the
    # experts' kernel and GPTQ/AWQ codes too (dense matrices and experts), each against the dequantized product (bfloat16 too);
    # the tiny checkpoints held against their dequantized twins on both backends; the FP8 products' tests; then
    # `bench gpu --shapes 8b,fp8,int4`: the 8B batch-64 decode in bf16, as an FP8 checkpoint in blocks of 128 x 128
    # and as a 4-bit GPTQ one, the last two held as stored, each against its roofline (~6 minutes).
    BOUNDLESS_TEST_DEVICE=cuda timeout 150 python3 -m pytest -p no:cacheprovider -q -rfE --tb=short --maxfail=5 \
        -k "dense or fp8 or bits or int_stack" tests/model/test_fused_moe.py tests/model/test_quantized_checkpoint.py \
        tests/model/test_fp8_linear.py tests/model/test_int_stack.py tests/model/test_packed_int.py 2>&1 \
        | tee "$out/pytest-quantized.log" | tail -15
    timeout 360 python3 -m boundless.bench.gpu --shapes 8b,fp8,int4 --json "$out/bench-quantized.json" 2>&1 \
        | tee "$out/bench-quantized.log" | tail -25
    exit
fi
if [ "${GPU_CHECK_PART:-main}" = more ]; then
    # The sampler's and the decoding features' test files on CUDA (~4 minutes): a second device run.
    BOUNDLESS_TEST_DEVICE=cuda timeout 300 python3 -m pytest -p no:cacheprovider -q -rfE --tb=short --maxfail=5 \
        -k "not smollm2 and not simulator_refuses" \
        tests/engine/test_structured_output.py tests/engine/test_speculative.py tests/engine/test_suffix_decoding.py \
        tests/engine/test_sampler.py tests/model/test_lora.py tests/engine/test_multi_step.py \
        tests/engine/test_detokenizer.py tests/engine/test_embed_requests.py tests/engine/test_classify_requests.py \
        2>&1 | tee "$out/pytest-more.log" | tail -15
    # Sliding windows on CUDA (7 December, CPU-checked only): the Triton kernel's WINDOW tiles and splits, the
    # windowed models against transformers on both backends (their CUDA graphs too), DistAttention's masked lent keys;
    # gpt-oss (its sinks merged with the compiled kernels' log-sum-exp, its experts, DistAttention with sinks); and the
    # experts' two Triton launches (7 December, CPU-checked only: bfloat16, and a mixture's captured decode graphs).
    BOUNDLESS_TEST_DEVICE=cuda timeout 240 python3 -m pytest -p no:cacheprovider -q -rfE --tb=short --maxfail=5 \
        -k "(window or gpt_oss or gpt-oss or sinks or moe or mixture) and not smollm2" \
        tests/attention/test_triton_paged.py tests/model/test_reference.py tests/model/test_fused_moe.py \
        tests/engine/test_dist_attention.py tests/engine/test_cuda_graphs.py 2>&1 | tee "$out/pytest-window.log" | tail -15
    exit
fi
# The default part: one device session's run (its 15 minutes hold one machine start and one run of ~9 minutes), in
# the order of what the session's figures need most; each stage gets what it asks or what is left of the run's
# budget (GPU_CHECK_BUDGET seconds, 580 by default), so a slow stage costs the last ones, not the whole run.
# 1. On CUDA: the graph runner's tests (both backends), FlexAttention's against the dense reference in bf16 and its
#    block mask, the Triton kernel's tiles apart for decodes and prefills and its unmasked tiles, --flash-prefill's
#    FlashAttention call, DistAttention on both backends, transformers' greedy tokens on FlexAttention (tiny-llama),
#    an fp8 KV cache on the Triton kernels (--kv-cache-dtype fp8: the GPU's rounding, the kernels' widening reads),
#    --quantization fp8's products (the 8B shape's, 1 to 300 rows; cuBLASLt's refusals named in a warning), its
#    Triton quantizer against PyTorch's ops, and a quantized model on CUDA graphs and windows against eager.
# 2. `bench gpu --shapes 1b,8b --windows 16`: #16's figures (the 1B cases against transformers, the GPU's busy share
#    and idle gaps, the 8B decode against its roofline).
# 3. `bench gpu --shapes tiles --tiles-grid small`: one layer's attention on our kernel's default tiles and five
#    neighbours (the mask on every tile among them), on FlexAttention, on SDPA (FlashAttention) and as
#    --flash-prefill calls FlashAttention, for the 1B shape's prefill and decode cases.
# 4. The 8B decode with its layers in FP8 and its KV in fp8 (--quantization fp8 --kv-cache-dtype fp8: half the bytes
#    a step reads), against the same roofline's bytes.
# 5. The 1B cases again with --flash-prefill (what is left of the budget; the engine on FlexAttention is in the flex
#    part).
# Every stage but the last starts with all it asks (tests/test_gpu_check.py: their asks within the budget); the last
# gets what is left.
deadline=$((SECONDS + ${GPU_CHECK_BUDGET:-580}))
within() {  # the seconds a stage gets: what it asks, or what is left of the budget
    local left=$((deadline - SECONDS))
    left=$((left > 1 ? left : 1))  # (timeout 0 would mean none)
    echo $(($1 < left ? $1 : left))
}
BOUNDLESS_TEST_DEVICE=cuda timeout "$(within 170)" python3 -m pytest -p no:cacheprovider -q -rfE --tb=short \
    --maxfail=5 -k "not smollm2 and (bfloat16 or not matches_dense)" \
    tests/attention/test_triton_paged.py::test_flash_prefill_matches_dense \
    tests/attention/test_triton_paged.py::test_flash_prefill_takes_every_prefill_chunk_in_one_call \
    tests/attention/test_triton_paged.py::test_the_start_up_check_refuses_a_call_that_masks_or_answers_otherwise \
    tests/attention/test_triton_paged.py::test_flashattentions_call_passes_the_start_up_check \
    tests/attention/test_triton_paged.py::test_tiles_wholly_visible_take_no_mask \
    tests/attention/test_triton_paged.py::test_decodes_and_prefill_chunks_take_their_own_key_tiles \
    tests/attention/test_triton_paged.py::test_an_fp8_cache_is_stored_rounded_and_read_as_it_holds_them \
    tests/attention/test_triton_paged.py::test_flash_prefill_over_an_fp8_cache_attends_over_what_it_holds \
    tests/kv/test_cache_dtype.py::test_an_8_bit_prompt_gives_the_same_tokens_chunked_whole_or_from_the_prefix_cache \
    tests/model/test_fp8_linear.py::test_the_product_on_cuda_in_bfloat16 \
    tests/model/test_fp8_linear.py::test_the_8b_shapes_products_on_cuda \
    tests/model/test_fp8_linear.py::test_the_triton_quantizer_makes_the_rows_pytorchs_ops_make \
    tests/model/test_fp8_linear.py::test_a_quantized_model_on_cuda_graphs_and_windows_gives_the_eager_tokens \
    tests/engine/test_dist_attention.py::test_distattention_on_the_triton_kernels \
    tests/engine/test_cuda_graphs.py tests/attention/test_flex_paged.py \
    tests/engine/test_dist_attention.py::test_distattention_on_flex_attention \
    "tests/model/test_reference.py::test_greedy_matches_transformers_on_flex_attention[tiny-llama]" \
    2>&1 | tee "$out/pytest.log" | tail -15
timeout "$(within 190)" python3 -m boundless.bench.gpu --shapes 1b,8b --windows 16 --json "$out/bench-gpu.json" 2>&1 \
    | tee "$out/bench.log" | tail -45
timeout "$(within 80)" python3 -m boundless.bench.gpu --shapes tiles --tiles-grid small --repeats 3 \
    --json "$out/bench-tiles.json" 2>&1 | tee "$out/bench-tiles.log" | tail -12
timeout "$(within 110)" python3 -m boundless.bench.gpu --shapes 8b --windows 16 --quantization fp8 --kv-cache-dtype fp8 \
    --json "$out/bench-8b-fp8.json" 2>&1 | tee "$out/bench-8b-fp8.log" | tail -8
timeout "$(within 200)" python3 -m boundless.bench.gpu --shapes 1b --windows 16 --flash-prefill \
    --json "$out/bench-flash.json" 2>&1 | tee "$out/bench-flash.log" | tail -25
