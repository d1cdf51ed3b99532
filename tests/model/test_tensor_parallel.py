"""A model split over tensor-parallel ranks (``model/tensor_parallel.py``): the ranks' slices of a checkpoint put
back together are the checkpoint, and the ranks' networks, run side by side (threads here, each its rank of a gloo
group), give the whole model's hidden states on every rank, on each CPU path (the native kernels in fp32, PyTorch's
in bf16, FP8 products) and for each way the architectures differ (biases, per-head norms, fused checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rank_threads import in_threads

from boundless.attention.backend import AttentionBatch
from boundless.attention.paged import TorchPagedAttention
from boundless.config import ConfigError
from boundless.kv.tensors import PagedKVCache
from boundless.model.arch import ModelArch
from boundless.model.loader import LoadedModel, hf_arch, load_model
from boundless.model.random_model import TinySpec, random_weights, write_random_model
from boundless.model.tensor_parallel import (
    TensorParallel,
    TensorParallelGroup,
    check_shardable,
    shard_arch,
    shard_weights,
)

PROMPT = [3, 17, 99, 5, 250, 41, 8, 77, 120, 64, 33, 2, 190, 11, 45, 300, 7, 81, 150]


def _arch(spec: TinySpec, root: Path) -> ModelArch:
    return hf_arch(write_random_model(root, spec, weights=False))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "phi3"])
def test_the_ranks_slices_put_back_together_are_the_checkpoint(kind: str, tmp_path: Path) -> None:
    """Column-parallel matrices (and biases) by rows, row-parallel ones by columns, Phi-3's fused q/k/v and gate/up
    rank by rank in their parts' order, the embedding and LM head by vocabulary rows; the norms whole on every rank."""
    spec = TinySpec(kind=kind, num_heads=4, num_kv_heads=2)
    arch = _arch(spec, tmp_path)
    whole = dict(random_weights(spec))
    ranks = [dict(shard_weights(iter(whole.items()), arch, TensorParallel(r, 2))) for r in range(2)]
    q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    for name, tensor in whole.items():
        parts = [rank[name] for rank in ranks]
        module = name.split(".")[-2]
        if module in ("o_proj", "down_proj"):
            assert all(p.shape[1] == tensor.shape[1] // 2 for p in parts), name
            assert torch.equal(torch.cat(parts, 1), tensor), name
        elif module == "qkv_proj":
            split = [p.split([q // 2, kv // 2, kv // 2]) for p in parts]
            assert torch.equal(torch.cat([torch.cat([s[i] for s in split]) for i in range(3)]), tensor)
        elif module == "gate_up_proj":
            split = [p.split([inter // 2, inter // 2]) for p in parts]
            assert torch.equal(torch.cat([torch.cat([s[i] for s in split]) for i in range(2)]), tensor)
        elif module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
            assert all(p.shape[0] == tensor.shape[0] // 2 for p in parts), name
            assert torch.equal(torch.cat(parts, 0), tensor), name
        else:
            assert all(torch.equal(p, tensor) for p in parts), name
    if kind == "qwen2":
        assert any(n.endswith("q_proj.bias") for n in whole)


def test_the_ranks_slices_of_stacked_experts_are_each_experts_share(tmp_path: Path) -> None:
    """gpt-oss's experts (transposed, gate and up interleaved by column): a rank's columns are whole gate/up pairs of
    its features, each expert's alike, down's rows its features; the down bias rank 0's alone (the routing weight
    scales it inside the ranks' sum); the sinks by the rank's heads, the router whole."""
    spec = TinySpec(kind="gpt_oss", num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=8)
    arch = _arch(spec, tmp_path)
    whole = dict(random_weights(spec))
    ranks = [dict(shard_weights(iter(whole.items()), arch, TensorParallel(r, 2))) for r in range(2)]
    p = "model.layers.0."
    gate_up = whole[p + "mlp.experts.gate_up_proj"]  # [experts, hidden, 2 * inter]
    halves = [rank[p + "mlp.experts.gate_up_proj"] for rank in ranks]
    assert torch.equal(torch.cat(halves, 2), gate_up) and halves[0].shape[2] == gate_up.shape[2] // 2
    assert torch.equal(
        torch.cat([r[p + "mlp.experts.down_proj"] for r in ranks], 1), whole[p + "mlp.experts.down_proj"]
    )
    bias = p + "mlp.experts.down_proj_bias"
    assert torch.equal(ranks[0][bias], whole[bias]) and not ranks[1][bias].any()
    assert torch.equal(torch.cat([r[p + "self_attn.sinks"] for r in ranks]), whole[p + "self_attn.sinks"])
    assert all(torch.equal(r[p + "mlp.router.weight"], whole[p + "mlp.router.weight"]) for r in ranks)


def test_a_model_the_ranks_cannot_split_evenly_is_refused_naming_the_flag(tmp_path: Path) -> None:
    arch = _arch(TinySpec(num_heads=4, num_kv_heads=2), tmp_path / "gqa")
    assert shard_arch(arch, 2).num_kv_heads == 1 and shard_arch(arch, 2).intermediate_size == 64
    # Fewer key/value heads than ranks: each held by the ranks of its query heads (vLLM's replication).
    assert (shard_arch(arch, 4).num_heads, shard_arch(arch, 4).num_kv_heads) == (1, 1)
    with pytest.raises(ConfigError, match="4 attention heads do not split evenly over 3"):
        check_shardable(arch, 3)
    odd = _arch(TinySpec(num_heads=6, num_kv_heads=3, hidden_size=48, intermediate_size=96), tmp_path / "odd")
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 2: the model's 3 key/value heads neither split"):
        check_shardable(odd, 2)
    wide = _arch(TinySpec(num_heads=8, num_kv_heads=2, intermediate_size=96), tmp_path / "wide")
    check_shardable(wide, 8)  # (2 divides 8: four ranks to each key/value head)
    twelve = _arch(TinySpec(num_heads=12, num_kv_heads=4, hidden_size=48, intermediate_size=96), tmp_path / "twelve")
    with pytest.raises(ConfigError, match="4 key/value heads neither split evenly over 6 devices nor, fewer, divide"):
        check_shardable(twelve, 6)
    moe = _arch(TinySpec(kind="qwen3_moe", num_heads=4, num_kv_heads=2, head_dim=32), tmp_path / "moe")
    check_shardable(moe, 2)
    assert shard_arch(moe, 2).moe_intermediate_size == 16 and shard_arch(moe, 2).num_experts == 8
    odd_experts = _arch(
        TinySpec(kind="qwen3_moe", num_heads=4, num_kv_heads=2, head_dim=32, moe_intermediate_size=34),
        tmp_path / "odd-experts",
    )
    with pytest.raises(ConfigError, match="34 features of each expert do not split evenly over 4"):
        check_shardable(odd_experts, 4)
    with pytest.raises(ConfigError, match="do not split evenly"):
        load_model(str(write_random_model(tmp_path / "m", TinySpec(num_heads=4, num_kv_heads=2))),
                   tensor_parallel=TensorParallel(0, 3))  # fmt: skip


def _hidden(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    """The final hidden states of one prompt, prefilled into a KV cache of the model's own."""
    return _run(loaded, tokens)[0]


def _run(loaded: LoadedModel, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The final hidden states of one prompt, prefilled into a KV cache of the model's own, and their logits."""
    arch, n, bs = loaded.arch, len(tokens), 16
    blocks = -(-n // bs)
    cache = PagedKVCache(arch.num_layers, arch.num_kv_heads, arch.head_dim, blocks, bs, loaded.dtype, loaded.device)
    attention = TorchPagedAttention(
        arch.num_heads, arch.num_kv_heads, arch.head_dim, blocks, arch.attention_scale, arch.attn_logit_softcap
    )
    batch = AttentionBatch(0, [n], [n], [list(range(blocks))], torch.arange(n), bs, loaded.device)
    loaded.model.prepare(64)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(tokens), torch.arange(n), attention, cache, attention.prepare(batch))
        return hidden.float(), loaded.model.compute_logits(hidden)


def _ranks_hidden(path: Path, size: int, **load: object) -> list[torch.Tensor]:
    """Each rank's final hidden states, the ranks run side by side in threads of this process."""
    return [h for h, _ in _ranks_run(path, size, **load)]


def _ranks_run(path: Path, size: int, **load: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's final hidden states and logits (each computes its columns of the vocabulary and the ranks' are put
    side by side), the ranks run side by side in threads of this process."""
    store = dist.HashStore()
    ranks = [load_model(str(path), tensor_parallel=TensorParallel(r, size), **load) for r in range(size)]  # type: ignore[arg-type]

    def run(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        group = TensorParallelGroup(store, TensorParallel(rank, size), torch.device("cpu"), 60)
        ranks[rank].model.sum_over(group.all_reduce_, group.all_gather)
        return _run(ranks[rank], PROMPT)

    out = in_threads(size, run)
    assert all(ranks[r].arch.num_heads * size == ranks[r].full_arch.num_heads for r in range(size))  # type: ignore[union-attr]
    return out


GEMMA3 = TinySpec(
    kind="gemma3_text", num_heads=4, num_kv_heads=1, head_dim=32, seed=11, sliding_window=10, sliding_window_pattern=2
)
PHI4_MINI = TinySpec(
    kind="phi3", hidden_size=128, num_heads=4, num_kv_heads=2, seed=14, tie_word_embeddings=True,
    partial_rotary_factor=0.75, max_position_embeddings=512, original_max_position_embeddings=48,
    rope_scaling={"type": "longrope", "short_factor": [1.0] * 12, "long_factor": [1.0 + i for i in range(12)]},
)  # fmt: skip
CASES = {
    # (spec, load options, tolerance against the whole model)
    "llama-native-fp32": (TinySpec(num_heads=4, num_kv_heads=2), {}, 1e-4),
    "qwen2-biases": (TinySpec(kind="qwen2", num_heads=4, num_kv_heads=4, seed=1), {}, 1e-4),
    "qwen3-head-norms": (TinySpec(kind="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, seed=2), {}, 1e-4),
    "phi3-fused": (TinySpec(kind="phi3", num_heads=4, num_kv_heads=2, seed=6), {}, 1e-4),
    # (Gemma 3: each rank's products summed before they are normed; its one key/value head on both ranks.)
    "gemma3-norms-of-sums": (GEMMA3, {}, 1e-4),
    # (Phi-4-mini: each rank's heads rotated on their leading 3/4, by LongRoPE's factors; tied embeddings.)
    "phi4-mini-partial-longrope": (PHI4_MINI, {}, 1e-4),
    # (GLM-4: each rank's q and k rows reordered within its heads; its products' sums normed.)
    "glm4-interleaved-norms": (
        TinySpec(kind="glm4", num_heads=4, num_kv_heads=2, head_dim=32, seed=16, partial_rotary_factor=0.5),
        {},
        1e-4,
    ),
    # (Granite: each rank's products summed before the sum is multiplied into the stream.)
    "granite-multipliers": (
        TinySpec(
            kind="granite",
            num_heads=4,
            num_kv_heads=2,
            seed=15,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=8.0,
        ),
        {},
        1e-4,
    ),
    "llama-torch-bf16": (TinySpec(num_heads=4, num_kv_heads=2), {"dtype": "bfloat16"}, 0.15),
    # (Mixtures: the router whole, each expert's features split, the experts' partial sums added as the MLP's.)
    "qwen3-moe-experts": (TinySpec(kind="qwen3_moe", num_heads=4, num_kv_heads=2, head_dim=32, seed=3), {}, 1e-4),
    "mixtral-experts": (TinySpec(kind="mixtral", num_heads=4, num_kv_heads=2, seed=4), {}, 1e-4),
    # (GLM-4.5-Air's kind: the router and its correction whole, two shared experts' width split as a dense MLP, q/k/v
    # biases, no head norms; 2 groups, 1 chosen.)
    "glm4-moe-shared-experts": (
        TinySpec(
            kind="glm4_moe",
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            partial_rotary_factor=0.5,
            moe_intermediate_size=32,
            n_shared_experts=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            seed=22,
        ),
        {},
        1e-4,
    ),
    # (gpt-oss: its sinks by heads, o's bias after the sum, its experts' interleaved columns, down's bias rank 0's.)
    "gpt-oss-sinks-experts": (
        TinySpec(kind="gpt_oss", num_heads=4, num_kv_heads=2, head_dim=16, seed=17, sliding_window=8, swiglu_limit=2.0),
        {},
        1e-4,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_ranks_give_the_whole_models_hidden_states(case: str, tmp_path: Path) -> None:
    """Two ranks' residual streams after the last layer are each the unsplit model's (the sums in another order: within
    rounding), and the same on both ranks, and so are their logits (the vocabulary split over them: 384 tokens); four
    ranks where the heads allow it."""
    spec, load, tol = CASES[case]
    path = write_random_model(tmp_path / "m", spec)
    whole, whole_logits = _run(load_model(str(path), **load), PROMPT)  # type: ignore[arg-type]
    # Four ranks where the key/value heads split over them (qwen2's 4), and where they are fewer and held twice (the
    # GQA models' 2: each rank one query head, its key/value head shared with the rank beside it).
    sizes = [2, 4] if case in ("qwen2-biases", "llama-native-fp32", "phi3-fused") else [2]
    for size in sizes:
        runs = _ranks_run(path, size, **load)
        for h, logits in runs:
            assert torch.allclose(h, whole, atol=tol, rtol=tol), (size, (h - whole).abs().max())
            assert torch.equal(h, runs[0][0])
            # Each rank's columns of the vocabulary (its rows of the LM head) put side by side: the whole logits.
            assert logits.shape == whole_logits.shape
            assert torch.allclose(logits, whole_logits, atol=10 * tol, rtol=10 * tol)
    # (A tolerance that would pass anything is no test: a rank without the sums is far off.)
    alone = load_model(str(path), tensor_parallel=TensorParallel(0, 2), **load)  # type: ignore[arg-type]
    assert not torch.allclose(_hidden(alone, PROMPT), whole, atol=tol, rtol=tol)


def test_fp8_ranks_are_as_near_the_unquantized_model_as_one_fp8_device(tmp_path: Path) -> None:
    """Under ``--quantization fp8`` each rank quantizes its own slices (a row-parallel matrix's scales over its half
    of each row, the activations per token over its half): not one device's numbers, but as near the unquantized
    model's as they are (random weights make FP8's error large: a quarter of the hidden states' norm here)."""
    path = write_random_model(tmp_path / "m", TinySpec(num_heads=4, num_kv_heads=2))
    exact = _hidden(load_model(str(path)), PROMPT)
    one_device = _relative(_hidden(load_model(str(path), quantization="fp8"), PROMPT), exact)
    ranks = _ranks_hidden(path, 2, quantization="fp8")
    assert torch.equal(ranks[0], ranks[1])
    assert 0.01 < _relative(ranks[0], exact) < 1.25 * one_device


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kind", ["qwen2", "phi3", "gpt_oss"])
def test_a_rank_reads_its_parts_of_the_files_as_the_slices_of_whole_tensors(kind: str, tmp_path: Path) -> None:
    """From a safetensors directory a rank reads only its parts (safetensors' slices; gpt-oss's stacked experts along
    their second and third dimensions, its down bias as zeros past rank 0): the network is the one cut from the same
    tensors read whole (the path of GGUF files, dequantized checkpoints and weights drawn in memory)."""
    spec = TinySpec(kind=kind, num_heads=4, num_kv_heads=2, sliding_window=8 if kind == "gpt_oss" else None)
    path = write_random_model(tmp_path / "m", spec)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        read = load_model(str(path), tensor_parallel=tp).model.state_dict()
        cut = load_model(str(path), weights=("same", random_weights(spec)), tensor_parallel=tp).model.state_dict()
        assert read.keys() == cut.keys()
        assert all(torch.equal(read[k], cut[k]) for k in read), rank
