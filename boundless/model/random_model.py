"""Small random Llama-family checkpoints, written as real Hugging Face directories.

Tests and benchmarks that need a model other than the bundled one build it here: a
``config.json``, a ``model.safetensors`` with random weights and a byte-level BPE tokenizer
trained on a few sentences, with a chat template. Nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from boundless.model.arch import ModelArch

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Agents call language models many times in a loop, with tools between the calls.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 12, 345 and 6789 appear in text; so do names like Paris and Rome.",
    "A long context holds a whole conversation, and the cache keeps its keys and values.",
]


@dataclass(frozen=True)
class TinySpec:
    """The shape of a random model. ``kind`` is llama, qwen2, qwen3, qwen3_moe, mistral, mixtral, phi3, gemma2,
    gemma3_text, granite, glm4, gpt_oss or smollm3 (Gemma's: its sliding-window layers all but every
    ``sliding_window_pattern``-th, Gemma 3's rotated on ``local_rope_theta``, its softmax scale
    ``query_pre_attn_scalar ** -0.5``, Gemma 2's scores and logits capped at ``attn_logit_softcap`` and
    ``final_logit_softcap``; Granite's four multipliers; GLM-4's biases, fused gate/up, four norms a layer and
    ``partial_rotary_factor``, interleaved). ``head_dim``:
    by default ``hidden_size // num_heads`` (Qwen3's are wider: its attention is wider than its hidden size). A
    qwen3_moe model's layers are sparse (``num_experts`` experts of ``moe_intermediate_size``,
    ``num_experts_per_tok`` a token), but for ``mlp_only_layers``; a mixtral model's are all sparse, its experts
    ``moe_intermediate_size`` wide too. ``sliding_window``: a window over every layer (a qwen2 or qwen3 model's
    from layer ``max_window_layers`` on, as transformers reads it). A phi3 model's RoPE may rotate part of each head
    (``partial_rotary_factor``, Phi-4-mini's) and its ``rope_scaling`` be LongRoPE's, over
    ``original_max_position_embeddings``. A gpt_oss model's layers are all sparse, its even ones windowed, its experts
    clamped at ``swiglu_limit`` and with ``mxfp4`` saved as the Hub's MXFP4 blocks; a smollm3 model's every
    ``no_rope_layer_interval``-th layer rotates nothing."""

    kind: str = "llama"
    vocab_size: int = 384
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_scaling: dict | None = None
    rope_theta: float = 10000.0
    weight_std: float = 0.3  # large enough that greedy choices are not near-ties
    seed: int = 0
    dtype: str = "float32"  # of the weights written
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    mlp_only_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    max_window_layers: int = 0
    sliding_window_pattern: int = 6
    local_rope_theta: float = 10000.0
    query_pre_attn_scalar: int = 256
    attn_logit_softcap: float | None = 50.0
    final_logit_softcap: float | None = 30.0
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # Granite's multipliers (GraniteConfig's defaults).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # gpt-oss's clamp of its experts' gate and up, and its experts' weights as MXFP4 blocks and scales.
    swiglu_limit: float = 7.0
    mxfp4: bool = False
    # An FP8 checkpoint's (Qwen3-*-FP8's quant_method fp8): every layer's projections in e4m3, a scale a block of
    # (rows, inputs).
    fp8_block: tuple[int, int] | None = None
    # A GPTQ checkpoint's (AutoGPTQ's 4-bit format): every layer's projections in 4 bits, a scale and a zero point a
    # group of this many inputs.
    gptq_group: int | None = None
    # SmolLM3's layer without RoPE every this many.
    no_rope_layer_interval: int = 4
    # GLM-4.5's: its first dense layers, shared experts, groups of experts (and those chosen), the routed weights'
    # scale, Qwen3's head norms or not.
    first_k_dense_replace: int = 1
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    use_qk_norm: bool = False


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok


def write_byte_fallback_tokenizer(root: str | Path, corpus: list[str], vocab_size: int) -> Path:
    """A small Llama-2-style tokenizer written to the new directory ``root``: SentencePiece's ``▁`` for a space, and a
    byte fallback (a ``<0xNN>`` token for every byte) for the characters its pieces do not hold; its decoder turns a
    run of bytes that holds one that is no UTF-8 into a replacement character a byte, valid characters before it
    included. With a ``config.json`` of its vocabulary, so that it loads as a model directory's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    root = Path(root)
    root.mkdir()
    (root / "tokenizer.json").write_text(json.dumps(spec))
    config = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": len(vocab)}))
    return root


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}
_GEMMA = ("gemma2", "gemma3_text")


# gpt-oss's YaRN as GptOssConfig has it, over a tiny model's original context of 64 positions.
_GPT_OSS_YARN = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 64,
}  # fmt: skip


# A mixture of experts' checkpoint names: its block, and each expert's gate, up and down matrices.
_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "glm4_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def _head_dim(spec: TinySpec) -> int:
    return spec.head_dim or spec.hidden_size // spec.num_heads


def _config(spec: TinySpec) -> dict:
    cfg = {
        "architectures": [_ARCHITECTURES[spec.kind]],
        "model_type": spec.kind,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": _head_dim(spec),
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": spec.dtype,
    }
    if spec.rope_scaling:
        cfg["rope_scaling"] = spec.rope_scaling
    if spec.kind in ("qwen2", "qwen3", "qwen3_moe"):
        cfg["use_sliding_window"] = spec.sliding_window is not None
        if spec.sliding_window is not None:
            cfg.update(sliding_window=spec.sliding_window, max_window_layers=spec.max_window_layers)
    if spec.kind in ("qwen3", "qwen3_moe"):
        cfg["attention_bias"] = False
    if spec.kind == "qwen3_moe":
        cfg.update(
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=list(spec.mlp_only_layers),
            output_router_logits=False,
        )
    if spec.kind in ("mistral", "mixtral", "phi3"):
        cfg["sliding_window"] = spec.sliding_window
    if spec.kind == "phi3":
        cfg["pad_token_id"] = 0  # (Phi-3's default, 32000, is past a small vocabulary)
        if spec.partial_rotary_factor != 1.0:
            cfg["partial_rotary_factor"] = spec.partial_rotary_factor
        if spec.original_max_position_embeddings is not None:
            cfg["original_max_position_embeddings"] = spec.original_max_position_embeddings
    if spec.kind == "glm4":
        cfg.update(partial_rotary_factor=spec.partial_rotary_factor, attention_bias=True, pad_token_id=0)
    if spec.kind == "granite":
        cfg.update(
            embedding_multiplier=spec.embedding_multiplier,
            residual_multiplier=spec.residual_multiplier,
            attention_multiplier=spec.attention_multiplier,
            logits_scaling=spec.logits_scaling,
            attention_bias=False,
            mlp_bias=False,
        )
    if spec.kind in _GEMMA:  # (as the Hub's Gemma configs have it: transformers 5 reads these names too)
        del cfg["hidden_act"]
        gemma2 = spec.kind == "gemma2"
        cfg.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=spec.sliding_window,
            query_pre_attn_scalar=spec.query_pre_attn_scalar,
            attention_bias=False,
            final_logit_softcapping=spec.final_logit_softcap if gemma2 else None,
            attn_logit_softcapping=spec.attn_logit_softcap if gemma2 else None,
            pad_token_id=0,
        )
        if not gemma2:
            cfg.update(sliding_window_pattern=spec.sliding_window_pattern, rope_local_base_freq=spec.local_rope_theta)
    if spec.kind == "gpt_oss":  # (its intermediate_size is each expert's; every other layer slides, the first too)
        del cfg["rope_theta"]
        cfg.update(
            intermediate_size=spec.moe_intermediate_size,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            sliding_window=spec.sliding_window,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)],
            attention_bias=True,
            swiglu_limit=spec.swiglu_limit,
            rms_norm_eps=1e-5,
            rope_scaling=_GPT_OSS_YARN | {"rope_theta": spec.rope_theta, **(spec.rope_scaling or {})},
            output_router_logits=False,
            pad_token_id=0,
        )
        if spec.mxfp4:
            unquantized = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
            cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": unquantized}
    if spec.kind == "smollm3":
        cfg.update(
            no_rope_layer_interval=spec.no_rope_layer_interval, attention_bias=False, mlp_bias=False, pad_token_id=0
        )
    if spec.kind == "glm4_moe":
        cfg.update(
            partial_rotary_factor=spec.partial_rotary_factor,
            attention_bias=True,
            use_qk_norm=spec.use_qk_norm,
            moe_intermediate_size=spec.moe_intermediate_size,
            n_routed_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            n_shared_experts=spec.n_shared_experts,
            n_group=spec.n_group,
            topk_group=spec.topk_group,
            routed_scaling_factor=spec.routed_scaling_factor,
            first_k_dense_replace=spec.first_k_dense_replace,
            norm_topk_prob=True,
            num_nextn_predict_layers=1,
            pad_token_id=0,
        )
    if spec.gptq_group is not None:
        cfg["quantization_config"] = {
            "quant_method": "gptq", "bits": 4, "group_size": spec.gptq_group, "desc_act": False, "sym": False,
            "checkpoint_format": "gptq",
        }  # fmt: skip
    if spec.fp8_block is not None:
        cfg["quantization_config"] = {
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(spec.fp8_block)
        }  # fmt: skip
    if spec.kind == "mixtral":  # (its intermediate_size is each expert's)
        cfg.update(
            intermediate_size=spec.moe_intermediate_size,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            output_router_logits=False,
        )
    return cfg


def random_weights(spec: TinySpec, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """The random weights of ``spec`` by Hugging Face name, one tensor at a time (drawn on ``device``
    in fp32, then cast to ``spec.dtype``); with ``spec.fp8_block``, each layer's projections as an FP8 checkpoint
    stores them (:func:`fp8_blocks`)."""
    weights = _drawn_weights(spec, device)
    assert spec.fp8_block is None or spec.gptq_group is None, "one quantization at a time"
    if spec.fp8_block is None and spec.gptq_group is None:
        yield from weights
        return
    for name, tensor in weights:
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight") and tensor.dim() == 2):
            yield name, tensor
        elif spec.gptq_group is not None:
            layer = name.removesuffix(".weight")
            qweight, qzeros, scales = gptq_4bit(tensor, spec.gptq_group)
            yield from ((layer + ".qweight", qweight), (layer + ".qzeros", qzeros), (layer + ".scales", scales))
        else:
            assert spec.fp8_block is not None
            q, scale = fp8_blocks(tensor, spec.fp8_block)
            yield name, q
            yield name + "_scale_inv", scale


def gptq_4bit(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] in AutoGPTQ's 4-bit format (v1): ``qweight`` int32 [in / 8, out] (8 consecutive inputs
    an int32, the first lowest), ``qzeros`` int32 [groups, out / 8] (each zero point stored less one) and ``scales``
    fp16 [groups, out], each group of ``group`` inputs by its own minimum and maximum."""
    out, inputs = weight.shape
    w = weight.float().t().reshape(inputs // group, group, out)
    low, high = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    scales = ((high - low) / 15).clamp_min(1e-6).half()
    zeros = (-low / scales.float()).round().clamp(0, 15)
    q = (w / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15).to(torch.int32).reshape(inputs, out)
    shifts = torch.arange(0, 32, 4, device=weight.device, dtype=torch.int32)
    qweight = (q.view(inputs // 8, 8, out) << shifts.view(1, 8, 1)).sum(dim=1, dtype=torch.int32)
    stored = (zeros.to(torch.int32) - 1) & 15
    qzeros = (stored.view(inputs // group, out // 8, 8) << shifts).sum(dim=2, dtype=torch.int32)
    return qweight, qzeros, scales


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as e4m3 with a scale a block of ``block`` (rows, inputs), each block's largest magnitude
    at e4m3's largest (448): ``weight ~= q * scale`` of its block. Blocks at the edges may be partial."""
    rows, cols = block
    out, inputs = weight.shape
    padded = torch.zeros(-(-out // rows) * rows, -(-inputs // cols) * cols, device=weight.device)
    padded[:out, :inputs] = weight.float()
    tiles = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scale = (tiles.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp_min(1e-12)
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:out, :inputs]
    return q.to(torch.float8_e4m3fn), scale


def _drawn_weights(spec: TinySpec, device: str | torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`random_weights` unquantized."""
    g = torch.Generator(device=device).manual_seed(spec.seed)
    head_dim = _head_dim(spec)
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    dtype = getattr(torch, spec.dtype)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * spec.weight_std).to(dtype)

    # (Gemma's norms multiply by 1 + weight: it saves weights about 0.)
    norm_mean = 0.0 if spec.kind in _GEMMA else 1.0

    def norm(size: int) -> torch.Tensor:
        return (norm_mean + 0.1 * (torch.randn(size, generator=g, device=device) * spec.weight_std)).to(dtype)

    # (Gemma multiplies its embeddings by sqrt(hidden_size): drawn that much smaller, its stream starts as the others'.)
    embed = rand(spec.vocab_size, h)
    yield "model.embed_tokens.weight", embed / h**0.5 if spec.kind in _GEMMA else embed
    yield "model.norm.weight", norm(h)
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", rand(spec.vocab_size, h)
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        if spec.kind == "phi3":  # q/k/v in one matrix, as are gate/up below
            yield p + "self_attn.qkv_proj.weight", torch.cat([rand(q, h), rand(kv, h), rand(kv, h)])
        else:
            yield p + "self_attn.q_proj.weight", rand(q, h)
            yield p + "self_attn.k_proj.weight", rand(kv, h)
            yield p + "self_attn.v_proj.weight", rand(kv, h)
        yield p + "self_attn.o_proj.weight", rand(h, q)
        if spec.kind == "gpt_oss":
            yield p + "self_attn.o_proj.bias", rand(h)
            yield p + "self_attn.sinks", rand(spec.num_heads) * 4  # (some heads then give their sink most weight)
        if spec.kind in ("qwen2", "glm4", "gpt_oss", "glm4_moe"):
            yield p + "self_attn.q_proj.bias", rand(q)
            yield p + "self_attn.k_proj.bias", rand(kv)
            yield p + "self_attn.v_proj.bias", rand(kv)
        if spec.kind in ("qwen3", "qwen3_moe", "gemma3_text") or (spec.kind == "glm4_moe" and spec.use_qk_norm):
            yield p + "self_attn.q_norm.weight", norm(head_dim)
            yield p + "self_attn.k_norm.weight", norm(head_dim)
        dense = layer in spec.mlp_only_layers or (spec.kind == "glm4_moe" and layer < spec.first_k_dense_replace)
        if spec.kind == "glm4_moe" and not dense:
            m = spec.moe_intermediate_size * spec.n_shared_experts
            # (Each expert's correction of its score for choosing it, saved in fp32: about the sigmoid scores' size.)
            yield p + "mlp.gate.e_score_correction_bias", torch.rand(spec.num_experts, generator=g, device=device) * 0.5
            yield p + "mlp.shared_experts.gate_proj.weight", rand(m, h)
            yield p + "mlp.shared_experts.up_proj.weight", rand(m, h)
            yield p + "mlp.shared_experts.down_proj.weight", rand(h, m)
        if spec.kind in _EXPERT_NAMES and not dense:
            block, gate, up, down = _EXPERT_NAMES[spec.kind]
            m = spec.moe_intermediate_size
            yield p + f"{block}.gate.weight", rand(spec.num_experts, h)
            for e in range(spec.num_experts):
                yield p + f"{block}.experts.{e}.{gate}.weight", rand(m, h)
                yield p + f"{block}.experts.{e}.{up}.weight", rand(m, h)
                yield p + f"{block}.experts.{e}.{down}.weight", rand(h, m)
        elif spec.kind == "gpt_oss":
            yield from _gpt_oss_experts(spec, p + "mlp.", rand)
        elif spec.kind in ("phi3", "glm4"):
            yield p + "mlp.gate_up_proj.weight", torch.cat([rand(i, h), rand(i, h)])
            yield p + "mlp.down_proj.weight", rand(h, i)
        else:
            yield p + "mlp.gate_proj.weight", rand(i, h)
            yield p + "mlp.up_proj.weight", rand(i, h)
            yield p + "mlp.down_proj.weight", rand(h, i)
        yield p + "input_layernorm.weight", norm(h)
        yield p + "post_attention_layernorm.weight", norm(h)
        if spec.kind in _GEMMA:
            yield p + "pre_feedforward_layernorm.weight", norm(h)
            yield p + "post_feedforward_layernorm.weight", norm(h)
        if spec.kind == "glm4":
            yield p + "post_self_attn_layernorm.weight", norm(h)
            yield p + "post_mlp_layernorm.weight", norm(h)
    if spec.kind == "glm4_moe":  # (its multi-token prediction layer, saved after the decoder's: read by neither model)
        p = f"model.layers.{spec.num_layers}."
        yield p + "eh_proj.weight", rand(h, 2 * h)
        yield p + "enorm.weight", norm(h)


def _gpt_oss_experts(
    spec: TinySpec, prefix: str, rand: Callable[..., torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's router and experts as its checkpoints name them: stacked, each matrix [experts, in, out] with gate
    and up interleaved by column (transformers' layout); with ``spec.mxfp4`` the matrices as the Hub's files hold
    them, MXFP4 blocks (two 4-bit values a byte, 32 a block) and a power-of-two scale a block, [experts, out, in / 32,
    ...]."""
    h, m, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    yield prefix + "router.weight", rand(e, h)
    yield prefix + "router.bias", rand(e)
    yield prefix + "experts.gate_up_proj_bias", rand(e, 2 * m)
    yield prefix + "experts.down_proj_bias", rand(e, h)
    if not spec.mxfp4:
        yield prefix + "experts.gate_up_proj", rand(e, h, 2 * m)
        yield prefix + "experts.down_proj", rand(e, m, h)
        return
    g = torch.Generator().manual_seed(spec.seed + 1)
    for name, rows, cols in (("gate_up_proj", 2 * m, h), ("down_proj", h, m)):
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        # (FP4 values reach 6: scales of 2**-5 to 2**-3 keep the weights about the others' size)
        scales = torch.randint(127 - 5, 127 - 2, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
        yield prefix + f"experts.{name}_blocks", blocks
        yield prefix + f"experts.{name}_scales", scales


def write_random_model(
    path: str | Path, spec: TinySpec | None = None, device: str | torch.device = "cpu", weights: bool = True
) -> Path:
    """Write a random model directory at ``path`` (created if needed) and return it. ``device`` draws
    the weights (a GPU draws billions in a second); ``weights=False`` writes only the config and the
    tokenizer, for a model whose weights are drawn in memory (:func:`random_weights`)."""
    spec = spec or TinySpec()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(_config(spec), indent=2))
    if weights:
        tensors = {k: v.contiguous().cpu() for k, v in random_weights(spec, device)}
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        del tensors
    tok = _train_tokenizer(min(spec.vocab_size, 384))
    tok.save(str(root / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": None,
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": spec.max_position_embeddings,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return root


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_lora(
    path: str | Path,
    arch: ModelArch,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = LORA_TARGETS,
    std: float = 0.05,
    seed: int = 0,
) -> Path:
    """Write a random LoRA adapter for a model of ``arch`` at ``path`` in PEFT's layout (``adapter_config.json``,
    ``adapter_model.safetensors``: what ``save_pretrained`` writes), for tests and benchmarks of adapters."""
    g = torch.Generator().manual_seed(seed)
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {  # (in, out) of each projection
        "q_proj": (arch.hidden_size, q),
        "k_proj": (arch.hidden_size, kv),
        "v_proj": (arch.hidden_size, kv),
        "o_proj": (q, arch.hidden_size),
        "gate_proj": (arch.hidden_size, arch.intermediate_size),
        "up_proj": (arch.hidden_size, arch.intermediate_size),
        "down_proj": (arch.intermediate_size, arch.hidden_size),
    }
    tensors = {}
    for layer in range(arch.num_layers):
        for module in targets:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none"}
    (root / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return root
