"""What the GGUF tests and the reference tests both do with a tiny model: write its directory as a GGUF file as
llama.cpp's converter writes one, and run an engine on prompts collecting each step's logits (or, for the quantized
checkpoints' tests, their greedy tokens)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from boundless.engine.core import EngineCore
from boundless.engine.executor import StepResult
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel


def add_bpe_vocabulary(writer: gguf.GGUFWriter, vocab: dict[str, Any]) -> None:
    """A directory's byte-level BPE vocabulary (its ``tokenizer.json``, ``vocab``) as llama.cpp stores one: GPT-2's
    pre-tokenizer, the tokens in id order (``<|...|>`` ones control tokens), the merges."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    tokens = sorted(vocab["model"]["vocab"], key=vocab["model"]["vocab"].get)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["model"]["merges"]])


def add_shape(writer: gguf.GGUFWriter, config: dict[str, Any], head_dim: bool = False) -> None:
    """The shape every llama.cpp converter writes, from a directory's ``config.json``: context, widths, layers, heads,
    the norms' epsilon; with ``head_dim`` the key and value heads' size too (Gemma's and gpt-oss's converters)."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    if head_dim:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def write_directory_gguf(
    source: Path,
    path: Path,
    arch: gguf.MODEL_ARCH,
    metadata: Callable[[gguf.GGUFWriter, dict[str, Any]], None] = lambda writer, config: None,
    permute_qk: bool = False,
) -> None:
    """The model directory ``source`` as a GGUF file of llama.cpp's architecture ``arch`` at ``path``: the shape every
    converter writes, the byte-level BPE vocabulary, the tensors under ``gguf``'s own name map in F32 (q and k
    permuted for llama.cpp's RoPE with ``permute_qk``, as its ``LlamaModel`` does), and what ``metadata(writer,
    config)`` adds of the architecture's own (keys, and tensors that are no parameters)."""
    from safetensors.torch import load_file

    config = json.loads((source / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, arch=gguf.MODEL_ARCH_NAMES[arch])
    add_shape(writer, config)
    writer.add_rope_freq_base(config["rope_theta"])
    add_bpe_vocabulary(writer, json.loads((source / "tokenizer.json").read_text()))
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    metadata(writer, config)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        assert gguf_name is not None, name
        array = tensor.float().numpy()
        if permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = llama_cpp_permute(array, heads if "q_proj" in name else kv_heads)
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``convert_hf_to_gguf.LlamaModel.permute``, as llama.cpp applies it to Q and K."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def greedy_tokens(loaded: LoadedModel, backend: str = "auto") -> list[list[int]]:
    """Two prompts' 8 greedy tokens each on an engine of ``loaded`` (``--attention-backend backend``), a small pool:
    what the tests of a checkpoint held one way and loaded another compare."""
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


def step_logits(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[torch.Tensor]:
    """Each prompt's logits of each step ([steps, vocab], on the CPU), the prompts run together on ``core`` with
    ``params``, each step scheduled, run and sampled as the engine's own step does."""
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
    logits: dict[str, list[torch.Tensor]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished():
        sched = core.scheduler.schedule()
        step = core.executor.runner.forward(sched)
        for chunk, row in zip(step.chunks, step.logits, strict=True):
            logits[chunk.request_id].append(row.cpu().clone())
        core.finish_step(sched, StepResult(core.executor.runner.sample(step)[0], 0.0))
    return [torch.stack(logits[str(i)]) for i in range(len(prompts))]


def write_gpt_oss_gguf(
    source: Path,
    path: Path,
    experts: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.MXFP4,
    fuse_gate_up: bool = False,
    skip: tuple[str, ...] = (),
) -> None:
    """The gpt-oss directory ``source`` as llama.cpp's converter (``GptOssModel``) writes it, at ``path``: architecture
    ``gpt-oss``, its keys (each expert's size, the window, YaRN's factor, original context and betas; the SwiGLU's limit
    under ``swiglu_clamp_exp`` only where it is not llama.cpp's 7), the directory's vocabulary and chat template, the
    tensors under ``gguf``'s name map in F32 (``attn_sinks.weight``, ``post_attention_norm``, the router as
    ``ffn_gate_inp``) and the experts [experts, out, in] in ``experts`` (MXFP4 with ``gguf``'s quantizer: a directory of
    MXFP4 blocks comes out with its own values), gate and up taken apart from transformers' interleaved columns, or one
    tensor of gate's rows then up's with ``fuse_gate_up`` (its converter's --fuse-gate-up-exps). Tensors named in
    ``skip`` are left out."""
    from safetensors.torch import load_file

    from boundless.model.mxfp4 import dequantize_mxfp4

    config = json.loads((source / "config.json").read_text())
    rope, layers = config["rope_scaling"], config["num_hidden_layers"]
    writer = gguf.GGUFWriter(path, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    add_shape(writer, config, head_dim=True)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if config["swiglu_limit"] != 7.0:
        writer.add_swiglu_clamp_exp([config["swiglu_limit"]] * layers)
    add_bpe_vocabulary(writer, json.loads((source / "tokenizer.json").read_text()))
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(json.loads((source / "tokenizer_config.json").read_text())["chat_template"])

    def add(name: str, tensor: torch.Tensor) -> None:
        if name in skip:
            return
        array = tensor.float().contiguous().numpy()
        if tensor.dim() == 3 and experts == gguf.GGMLQuantizationType.MXFP4:
            writer.add_tensor(name, gguf.quants.quantize(array, experts), raw_dtype=experts)
        else:
            assert tensor.dim() < 3 or experts == gguf.GGMLQuantizationType.F32
            writer.add_tensor(name, array)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, layers)
    weights = load_file(str(source / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith("_scales"):
            continue  # (read with its blocks)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("_blocks"):  # [experts, out, in / 32, 16] as [experts, out, in]
            name = name.removesuffix("_blocks")
            tensor = dequantize_mxfp4(tensor, weights[name + "_scales"], torch.float32)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, in, out] as [experts, out, in]
            tensor = tensor.transpose(1, 2)
        if name.endswith("experts.down_proj"):
            add(f"blk.{layer}.ffn_down_exps.weight", tensor)
        elif name.endswith("experts.down_proj_bias"):
            add(f"blk.{layer}.ffn_down_exps.bias", tensor)
        elif name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
            leaf = "bias" if name.endswith("_bias") else "weight"
            gate, up = tensor[:, 0::2], tensor[:, 1::2]  # (transformers' gate columns are the even ones, up's the odd)
            if fuse_gate_up:
                add(f"blk.{layer}.ffn_gate_up_exps.{leaf}", torch.cat([gate, up], dim=1))
            else:
                add(f"blk.{layer}.ffn_gate_exps.{leaf}", gate)
                add(f"blk.{layer}.ffn_up_exps.{leaf}", up)
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            add(gguf_name + (".weight" if name.endswith(".sinks") else ""), tensor)  # (the converter adds it to sinks)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_glm4_moe_gguf(
    source: Path,
    path: Path,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    skip: tuple[str, ...] = (),
    groups: bool = True,
) -> dict[str, torch.Tensor]:
    """The GLM-4.5 directory ``source`` as llama.cpp's converter (``Glm4MoeModel``) writes it, at ``path``:
    architecture ``glm4moe``; ``block_count`` its decoder's layers and its multi-token prediction layers after them
    (``nextn_predict_layers``), each head's size, RoPE on ``int(head_dim * partial_rotary_factor)`` dimensions, the
    experts' count, size and shared count, the leading dense layers, sigmoid gating, the weights' scale and
    renormalization; the groups of experts and those chosen (``expert_group_count`` and ``expert_group_used_count``,
    which llama.cpp's converters write since late 2025: an older file's have none, ``groups`` false); the directory's
    vocabulary (under GPT-2's pre-tokenizer: the converter's own is ``glm4``). Tensors under ``gguf``'s name map: the
    router ``ffn_gate_inp``, the experts stacked [experts, out, in] (``ffn_{gate,up,down}_exps``), the score correction
    ``exp_probs_b.bias`` (the converter's renaming of ``e_score_correction_bias``), the shared experts
    ``ffn_{gate,up,down}_shexp``, the prediction layer's own ``blk.N.nextn.*``, and beside them, as GLM-4.5's
    prediction layer is a whole decoder layer, the last decoder layer's tensors under its block (the tiny directory
    saves two of its tensors only). Matrices in ``qtype`` (``gguf``'s quantizer), norms and biases in F32, as
    llama.cpp's quantizer leaves them. Tensors named in ``skip`` are left out.

    Returns the Hugging Face-named tensors (float32) a reader must give: the directory's, as ``gguf``'s reference
    dequantizes what was written, each expert's matrices apart, without the prediction layer's."""
    from safetensors.torch import load_file

    config = json.loads((source / "config.json").read_text())
    layers, nextn = config["num_hidden_layers"], config.get("num_nextn_predict_layers", 0)
    blocks, head_dim = layers + nextn, config["head_dim"]
    writer = gguf.GGUFWriter(path, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GLM4_MOE])
    add_shape(writer, {**config, "num_hidden_layers": blocks}, head_dim=True)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * config.get("partial_rotary_factor", 0.5)))
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if groups:
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    add_bpe_vocabulary(writer, json.loads((source / "tokenizer.json").read_text()))
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])

    expected: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, array: np.ndarray) -> np.ndarray:
        """Write ``array`` (norms and biases in F32, matrices in ``qtype``); what reading it back gives."""
        if gguf_name in skip:
            return array
        if array.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, array)
            return array
        packed = gguf.quants.quantize(array, qtype)
        writer.add_tensor(gguf_name, packed, raw_dtype=qtype)
        return gguf.quants.dequantize(packed, qtype).astype(np.float32)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, blocks)
    weights = {name: tensor.float().numpy() for name, tensor in load_file(str(source / "model.safetensors")).items()}
    last = f"model.layers.{layers - 1}."
    weights.update(
        {f"model.layers.{layers}.{n.removeprefix(last)}": w for n, w in weights.items() if n.startswith(last)}
    )

    def in_decoder(name: str) -> bool:
        return not name.startswith("model.layers.") or int(name.split(".")[2]) < layers

    stacks: dict[str, list[str]] = {}  # (a layer's stacked tensor: its experts' names, by expert)
    for name, array in weights.items():
        parts = name.split(".")
        if parts[3:5] == ["mlp", "experts"]:  # (model.layers.L.mlp.experts.E.W.weight: written stacked, below)
            stacks.setdefault(f"model.layers.{parts[2]}.mlp.experts.{parts[6]}.weight", []).append(name)
            continue
        hf_name = name.replace("e_score_correction_bias", "e_score_correction.bias")  # (the converter's renaming)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        back = add(gguf_name, array)
        if in_decoder(name):
            expected[name] = torch.from_numpy(back)
    for stacked, members in stacks.items():
        members.sort(key=lambda n: int(n.split(".")[5]))
        gguf_name = names.get_name(stacked, try_suffixes=(".weight",))
        assert gguf_name is not None, stacked
        back = add(gguf_name, np.stack([weights[n] for n in members]))
        if in_decoder(stacked):
            expected.update((n, torch.from_numpy(back[e])) for e, n in enumerate(members))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
