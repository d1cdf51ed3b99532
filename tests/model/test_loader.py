"""What a model's name and ``--dtype`` resolve to: a Hugging Face id read from the local cache (nothing downloaded),
and vLLM's dtype names."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from boundless.config import ConfigError, ModelConfig
from boundless.llm import LLM, engine_config
from boundless.model.llama import LlamaModel, RMSNorm
from boundless.model.loader import (
    LoadedModel,
    ModelNotFoundError,
    check_fits,
    load_model,
    model_dtype,
    resolve_model_path,
)
from boundless.model.random_model import TinySpec, write_random_model

REPO = "tiny-org/Tiny-Llama-Instruct"


def _cache_snapshot(cache: Path, revision: str, ref: str | None = "main") -> Path:
    """A model laid out as ``huggingface_hub`` caches it: ``models--owner--name/snapshots/<revision>``, with the ref
    naming the revision (none: ``ref`` None)."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = write_random_model(repo / "snapshots" / revision, TinySpec(num_layers=1))
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(revision)
    return snapshot


def test_a_hub_id_is_read_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLM("owner/name")`` loads the snapshot ``refs/main`` names in the Hugging Face cache (``HF_HUB_CACHE``, else
    ``HF_HOME/hub``), as vLLM does offline; an id not cached is a clear error that says nothing is downloaded."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(ModelNotFoundError, match="nothing is downloaded"):
        resolve_model_path(REPO)
    _cache_snapshot(cache, "0" * 40)  # an older one
    current = _cache_snapshot(cache, "a" * 40)
    assert resolve_model_path(REPO) == current
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert resolve_model_path(REPO) == current
    out = LLM(REPO, max_model_len=64, kv_cache_gb=0.01).generate([[5, 6, 7]])[0]
    assert len(out.outputs[0].token_ids) == 16  # (the default max_tokens: a random model rarely says EOS)


def test_a_cached_id_without_a_ref_takes_its_one_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    only = _cache_snapshot(tmp_path, "b" * 40, ref=None)
    assert resolve_model_path(REPO) == only
    _cache_snapshot(tmp_path, "c" * 40, ref=None)  # two, and no ref to choose: not guessed
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        resolve_model_path(REPO)


def test_vllms_dtype_names(tmp_path: Path) -> None:
    """``half`` and ``float`` are float16 and float32; ``auto`` is float32 on the CPU and, on a GPU, the checkpoint's
    16-bit type (float16 for a 32-bit one, bfloat16 for a GGUF file's quantized weights)."""
    assert ModelConfig(dtype="half").dtype == "float16" and ModelConfig(dtype="float").dtype == "float32"
    with pytest.raises(ConfigError, match="unknown dtype 'fp8'"):
        ModelConfig(dtype="fp8")
    path = write_random_model(tmp_path / "m", TinySpec(num_layers=1))
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert model_dtype("auto", path, cpu) == torch.float32
    config = json.loads((path / "config.json").read_text())
    for stored, expected in [("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float16)]:
        (path / "config.json").write_text(json.dumps({**config, "torch_dtype": stored}))
        assert model_dtype("auto", path, gpu) == expected
    older = {k: v for k, v in config.items() if k != "torch_dtype"}
    (path / "config.json").write_text(json.dumps({**older, "dtype": "bfloat16"}))  # (transformers 5's key)
    assert model_dtype("auto", path, gpu) == torch.bfloat16
    assert model_dtype("auto", resolve_model_path("smollm2-135m"), gpu) == torch.bfloat16
    loaded = load_model(str(path), dtype="auto")
    assert loaded.dtype == torch.float32 and loaded.model.norm.weight.dtype == torch.float32
    # The KV fingerprint names the dtype used: auto's KV on the CPU is float32's, and no other's.
    assert loaded.fingerprint == load_model(str(path), dtype="float32").fingerprint
    assert loaded.fingerprint != load_model(str(path), dtype="bfloat16").fingerprint
    assert engine_config(str(path), dtype="half").model.dtype == "float16"


def test_gpt_oss_names_no_dtype_and_is_bfloat16(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    """gpt-oss's Hub configs name no dtype: ``auto`` on a GPU takes its tensors' bfloat16 (vLLM's choice), not the
    float16 a config without one gives another model; a dtype the config names still wins."""
    path = Path(shutil.copytree(model_dirs["tiny-gpt-oss"], tmp_path / "g"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "torch_dtype"}))
    gpu = torch.device("cuda")
    assert model_dtype("auto", path, gpu) == torch.bfloat16
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    assert model_dtype("auto", path, gpu) == torch.float16


def test_weights_larger_than_the_device_are_refused_in_words(load: Callable[[str], LoadedModel]) -> None:
    """Before anything is allocated: the weights' size in their dtype against the device's free memory."""
    arch = load("tiny-gpt-oss").arch
    with torch.device("meta"):
        model = LlamaModel(arch).to(torch.bfloat16)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    check_fits(model, size, "cuda:0")
    with pytest.raises(ConfigError, match=r"weights take 0\.0 GiB in bfloat16, more than the 0\.0 GiB free on cuda:0"):
        check_fits(model, size - 1, "cuda:0")


def test_gemma3_is_never_float16(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    """Gemma 3's activations overflow float16: ``auto`` gives it bfloat16 on a GPU even where its checkpoint is 32-bit
    (float16 for any other model's), and ``--dtype float16`` is refused in words, as vLLM does."""
    path = Path(shutil.copytree(model_dirs["tiny-gemma3"], tmp_path / "g"))
    gpu = torch.device("cuda")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    assert model_dtype("auto", path, gpu) == torch.bfloat16
    assert model_dtype("auto", model_dirs["tiny-llama"], gpu) == torch.float16
    assert model_dtype("auto", path, torch.device("cpu")) == torch.float32
    with pytest.raises(ConfigError, match="--dtype float16: Gemma's activations overflow float16"):
        load_model(str(path), dtype="float16")
    bf16 = load_model(str(path), dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.model.layers[0].input_norm.weight.dtype == torch.float32
    # A Gemma norm's weight stays fp32 through a cast, unrounded (1 + 2^-10 is not a bfloat16).
    norm = RMSNorm(4, 1e-6, fp32_weight=True)
    norm.weight.data.fill_(1 + 2**-10)
    assert norm.to(torch.bfloat16).weight.eq(1 + 2**-10).all() and norm.weight.dtype == torch.float32
    assert RMSNorm(4, 1e-6).to(torch.bfloat16).weight.dtype == torch.bfloat16  # (any other's is cast)


def test_a_cuda_device_this_process_cannot_use_is_refused_in_words(tmp_path: Path) -> None:
    """``--device cuda`` (or a ``cuda:N`` past the GPUs there are) is a :class:`ConfigError` naming the device, which
    ``boundless serve`` prints as one line: without CUDA it was PyTorch's traceback from inside the weights'
    allocation ("Torch not compiled with CUDA enabled")."""
    model = write_random_model(tmp_path / "m", TinySpec(num_layers=1))
    past = f"cuda:{torch.cuda.device_count() + 3}"
    with pytest.raises(ConfigError, match=f"device {past}: "):
        load_model(str(model), device=past)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device cuda: CUDA is not available here"):
            load_model(str(model), device="cuda")
