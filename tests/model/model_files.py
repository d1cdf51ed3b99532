"""What the GGUF tests and the reference tests both do with a tiny model: write its directory as a GGUF file as
llama.cpp's converter writes one, and run an engine on prompts collecting each step's logits."""

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


def add_bpe_vocabulary(writer: gguf.GGUFWriter, vocab: dict[str, Any]) -> None:
    """A directory's byte-level BPE vocabulary (its ``tokenizer.json``, ``vocab``) as llama.cpp stores one: GPT-2's
    pre-tokenizer, the tokens in id order (``<|...|>`` ones control tokens), the merges."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    tokens = sorted(vocab["model"]["vocab"], key=vocab["model"]["vocab"].get)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["model"]["merges"]])


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
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
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
