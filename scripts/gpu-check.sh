#!/usr/bin/env bash
# The GPU checks of one device session (about 5 minutes on an H200), run from the repository root with
# the device's own python3 (PyTorch, Triton, transformers; nothing installed): the Triton attention
# kernels, the CUDA-graph runner, the transformers parity tests (speculative decoding's among them), speculative
# decoding's own tests, LoRA adapters against PEFT (skipped unless PEFT's wheel travels in .whl: `pip download
# --no-deps peft==0.21.2`) and DistAttention on the kernels on CUDA, then
# `bench gpu` (windows of 16, with and without --async-scheduling). The sampler's tests run on CUDA too: penalties (in the parity tests) and structured outputs, whose
# xgrammar the device lacks: they skip unless its wheels travel in .whl (the device tool's README; for its Python
# 3.12: `pip download --no-deps --only-binary=:all: --python-version 3.12 ... xgrammar==0.2.9
# apache-tvm-ffi==0.1.15.post2`), installed below when present.
# Logs and figures go to ${OUT:-gpu-check}/.
set -o pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
BOUNDLESS_TEST_DEVICE=cuda timeout 180 python3 -m pytest -p no:cacheprovider -q --maxfail=5 \
    -k "not smollm2 and not simulator_refuses" \
    tests/attention/test_triton_paged.py tests/engine/test_cuda_graphs.py tests/model/test_reference.py \
    "tests/engine/test_dist_attention.py::test_distattention_on_the_triton_kernels" \
    tests/engine/test_structured_output.py tests/engine/test_speculative.py tests/engine/test_suffix_decoding.py \
    tests/engine/test_sampler.py \
    tests/model/test_lora.py tests/engine/test_multi_step.py tests/engine/test_detokenizer.py \
    2>&1 | tee "$out/pytest.log" | tail -15
timeout 300 python3 -m boundless.bench.gpu --shapes host,1b,8b --windows 16 --json "$out/bench-gpu.json" 2>&1 | tee "$out/bench.log" | tail -45
