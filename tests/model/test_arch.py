"""Architectures read from a Hugging Face ``config.json``: what each model type sets, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from boundless.model.arch import ModelArch
from boundless.model.rope import inverse_frequencies


def test_configs_this_model_cannot_follow_are_refused() -> None:
    """RoPE on part of each head and LongRoPE are Phi-3's (Phi-4-mini's, its 128k models'): another architecture's
    config with them is refused by name rather than run wrongly (transformers' others rotate whole heads), and so is a
    LongRoPE config whose factors do not number one per rotated pair; as is any architecture's MLP of another
    activation than SiLU (it ran as SiLU). A Phi-3 config of full RoPE reads as the fused Llama it is."""
    base = {"model_type": "phi3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "sliding_window": 2047}  # fmt: skip
    arch = ModelArch.from_hf_config(base)
    assert arch.model_type == "phi3" and arch.sliding_window == 2047 and not arch.num_experts and arch.rotary_dim == 8
    assert ModelArch.from_hf_config({**base, "partial_rotary_factor": 0.75}).rotary_dim == 6
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelArch.from_hf_config({**base, "model_type": "llama", "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="an even number"):  # (8 x 0.3: 2.4, so 2; 8 x 0.2: 1)
        ModelArch.from_hf_config({**base, "partial_rotary_factor": 0.2})
    longrope = {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    assert ModelArch.from_hf_config({**base, "rope_scaling": longrope}).rope_scaling.kind == "longrope"
    with pytest.raises(ValueError, match="longrope"):
        ModelArch.from_hf_config({**base, "model_type": "mistral", "rope_scaling": longrope})
    with pytest.raises(ValueError, match="short_factor must list 4"):
        ModelArch.from_hf_config({**base, "rope_scaling": {**longrope, "short_factor": [1.0]}})
    # An MLP of another activation (transformers builds the config's hidden_act; this model's MLPs are SiLU-gated).
    assert ModelArch.from_hf_config({**base, "hidden_act": "swish"}) == arch
    assert ModelArch.from_hf_config({**base, "hidden_activation": "gelu_pytorch_tanh"}) == arch  # (Gemma's name)
    for model_type in ("llama", "qwen3_moe"):
        with pytest.raises(ValueError, match="hidden_act 'gelu'"):
            ModelArch.from_hf_config({**base, "model_type": model_type, "hidden_act": "gelu"})


_QWEN3 = {"model_type": "qwen3", "vocab_size": 100, "hidden_size": 256, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "rope_theta": 1e6}  # fmt: skip

YARN_CASES = {
    # Qwen3's long context: an original 32,768 positions four times over.
    "qwen3": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 40960, 131072),
    # Qwen2.5's (no original length: the model's own).
    "qwen2.5": ({"type": "yarn", "factor": 4.0}, 32768, 131072),
    # DeepSeek's attention scale from mscale and mscale_all_dim, betas given.
    "mscales": (
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        163840,
        163840,
    ),
    # An attention factor given, the ramp's ends not rounded.
    "untruncated": (
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
            "attention_factor": 1.3,
        },
        256,
        256,
    ),
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_matches_transformers(case: str) -> None:
    """YaRN's frequencies bit for bit and its attention factor as transformers computes them from the same config, and
    the context vLLM derives from it (the original context times the factor)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling, max_positions, context = YARN_CASES[case]
    config = {**_QWEN3, "max_position_embeddings": max_positions, "rope_scaling": scaling}
    want_freqs, want_factor = ROPE_INIT_FUNCTIONS["yarn"](Qwen3Config(**config), "cpu")
    arch = ModelArch.from_hf_config(config)
    assert torch.equal(inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling), want_freqs)
    assert arch.rope_scaling.attention_factor == want_factor
    assert arch.context_length == context


_FACTORS = {n: [round(1.0 + 0.5 * i, 3) for i in range(n)] for n in (48, 64)}  # (graded: a swap of the lists tells)
LONGROPE_CASES = {
    # Phi-3.5-mini-instruct and Phi-3-mini-128k-instruct: 96-wide heads rotated whole, 4,096 original positions.
    "phi-3.5-mini": (
        {"hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 131072,
         "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
         "rope_scaling": {"type": "longrope", "short_factor": _FACTORS[48], "long_factor": [4.0] * 48}},
        96,
    ),
    # Phi-4-mini-instruct: 128-wide heads, RoPE on their leading 96 dimensions.
    "phi-4-mini": (
        {"hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8, "max_position_embeddings": 131072,
         "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
         "rope_scaling": {"type": "longrope", "short_factor": [1.5] * 48, "long_factor": _FACTORS[48]}},
        96,
    ),
    # The older name ("su"), no original context (Phi3Config's 4,096), an attention factor given.
    "su": (
        {"hidden_size": 512, "num_attention_heads": 4, "max_position_embeddings": 65536,
         "rope_scaling": {"type": "su", "short_factor": [1.0] * 64, "long_factor": _FACTORS[64],
                          "attention_factor": 1.1}},
        128,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", LONGROPE_CASES)
def test_longrope_matches_transformers(case: str) -> None:
    """LongRoPE's short and long frequencies bit for bit and its attention factor as transformers computes them from
    the same Phi-3 config (its short ones for a context within the original one, its long ones past it), over the
    rotated share of each head; an engine's context picks which (vLLM's rule)."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from boundless.model.rope import uses_long_factors

    config, rotary_dim = LONGROPE_CASES[case]
    config = {"model_type": "phi3", "vocab_size": 64, "intermediate_size": 64, "num_hidden_layers": 1, **config}
    hf = Phi3Config(**config)
    arch = ModelArch.from_hf_config(config)
    assert arch.rotary_dim == rotary_dim and arch.rope_scaling.kind == "longrope"
    original = arch.rope_scaling.original_max_position_embeddings
    assert original == 4096 and arch.context_length == config["max_position_embeddings"]
    for long in (False, True):
        want_freqs, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", original + 1 if long else None)
        got = inverse_frequencies(arch.rotary_dim, arch.rope_theta, arch.rope_scaling, long)
        assert torch.equal(got, want_freqs)
        assert arch.rope_scaling.attention_factor == want_factor
    assert not uses_long_factors(arch.rope_scaling, original)
    assert uses_long_factors(arch.rope_scaling, original + 1)


# ibm-granite/granite-3.3-8b-instruct's config.json (as the Hub has it).
GRANITE_3_3_8B = {
    "architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_multiplier": 0.0078125, "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12800,
    "logits_scaling": 16.0, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "granite",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "pad_token_id": 0,
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 49159,
}  # fmt: skip


def test_granite_reads_its_multipliers_as_transformers_does() -> None:
    """Granite 3.3's multipliers, and GraniteConfig's defaults where a config has none (a softmax scale of 1, not
    the head size's); its biases are refused as Llama's are (they bias o_proj too)."""
    from transformers import GraniteConfig

    arch = ModelArch.from_hf_config(GRANITE_3_3_8B)
    assert (arch.embedding_scale, arch.residual_multiplier, arch.attention_scale, arch.logits_scaling) == (
        12.0, 0.22, 0.0078125, 16.0,
    )  # fmt: skip
    assert arch.tie_word_embeddings and arch.num_kv_heads == 8 and arch.rope_theta == 1e7
    bare = {k: v for k, v in GRANITE_3_3_8B.items() if not k.endswith(("_multiplier", "_scaling"))}
    hf = GraniteConfig(**bare)
    arch = ModelArch.from_hf_config(bare)
    assert arch.embedding_scale == hf.embedding_multiplier and arch.residual_multiplier == hf.residual_multiplier
    assert arch.attention_scale == hf.attention_multiplier == 1.0 and arch.logits_scaling == hf.logits_scaling
    for field in ("attention_bias", "mlp_bias"):
        with pytest.raises(ValueError, match=field):
            ModelArch.from_hf_config({**GRANITE_3_3_8B, field: True})


# THUDM/GLM-4-9B-0414's config.json (as the Hub has it).
GLM4_9B = {
    "architectures": ["Glm4ForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 13696, "max_position_embeddings": 32768, "model_type": "glm4",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "pad_token_id": 151329,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 151552,
}  # fmt: skip


def test_glm4_reads_as_transformers_does() -> None:
    """GLM-4-9B-0414: RoPE on half of each head, interleaved; q/k/v biases; four norms a layer; and Glm4Config's
    defaults (half of each head, biases) where a config has none; its frequencies are transformers'."""
    from transformers import Glm4Config
    from transformers.models.glm4.modeling_glm4 import Glm4RotaryEmbedding

    arch = ModelArch.from_hf_config(GLM4_9B)
    assert arch.rotary_dim == 64 and arch.rope_interleaved and arch.qkv_bias and arch.sandwich_norms
    assert arch.eos_token_ids == (151329, 151336, 151338) and arch.num_kv_heads == 2 and not arch.tie_word_embeddings
    want, _ = Glm4RotaryEmbedding.compute_default_rope_parameters(Glm4Config(**GLM4_9B))
    assert torch.equal(inverse_frequencies(arch.rotary_dim, arch.rope_theta, arch.rope_scaling), want)
    bare = {k: v for k, v in GLM4_9B.items() if k not in ("partial_rotary_factor", "attention_bias")}
    assert ModelArch.from_hf_config(bare) == arch
    assert not ModelArch.from_hf_config({**GLM4_9B, "attention_bias": False}).qkv_bias


# gpt-oss-20b's config.json, as the Hub has it (its 24 layers: a window of 128 on the even ones).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088,
}  # fmt: skip


def test_gpt_oss_reads_as_transformers_does() -> None:
    """gpt-oss-20b: a window of 128 on every other layer from the first, sinks, biases on attention's four
    projections, 32 experts (4 a token) with biases and the clamped SwiGLU; its YaRN frequencies and attention factor
    transformers'; GptOssConfig's defaults where a config has none (its layer types, its scaling)."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    arch = ModelArch.from_hf_config(GPT_OSS_20B)
    assert arch.windows == (128,) and arch.full_attention_layers == tuple(range(1, 24, 2))
    assert arch.attention_sinks and arch.qkv_bias and arch.o_bias and arch.expert_biases and arch.fp32_norms
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (32, 4, 2880)
    assert arch.sparse_layers == tuple(range(24)) and (arch.swiglu_limit, arch.swiglu_alpha) == (7.0, 1.702)
    assert arch.context_length == 131072 and arch.eos_token_ids == (200002,)
    config = GptOssConfig(**GPT_OSS_20B)
    want_freqs, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert torch.equal(inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling), want_freqs)
    assert arch.rope_scaling.attention_factor == want_factor
    bare = {k: v for k, v in GPT_OSS_20B.items() if k not in ("layer_types", "rope_scaling", "swiglu_limit")}
    assert ModelArch.from_hf_config({**bare, "rope_theta": 150000.0}) == arch
    assert not ModelArch.from_hf_config({**GPT_OSS_20B, "attention_bias": False}).o_bias


def test_smollm3_reads_as_transformers_does() -> None:
    """SmolLM3-3B: every 4th layer without RoPE (SmolLM3Config's default), or the layers its ``no_rope_layers`` mark
    0; tied embeddings by default; biases refused as for a Llama."""
    from transformers import SmolLM3Config

    config = {"model_type": "smollm3", "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
              "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 128256, "rope_theta": 5000000.0,
              "max_position_embeddings": 65536}  # fmt: skip
    arch = ModelArch.from_hf_config(config)
    want = SmolLM3Config(**config).no_rope_layers
    assert arch.nope_layers == tuple(i for i, uses in enumerate(want) if not uses) == tuple(range(3, 36, 4))
    assert arch.tie_word_embeddings and arch.sliding_window is None
    marked = ModelArch.from_hf_config({**config, "no_rope_layers": [1] * 35 + [0]})
    assert marked.nope_layers == (35,) and marked.fingerprint() != arch.fingerprint()
    with pytest.raises(ValueError, match="attention_bias"):
        ModelArch.from_hf_config({**config, "attention_bias": True})


def test_a_mistral3_config_reads_as_its_text_model() -> None:
    """Mistral Small 3.1's config (Mistral3ForConditionalGeneration: a Pixtral vision tower beside a Mistral): its
    text_config, read as the Mistral it is; its top level's token ids where the text config has none."""
    text = {"model_type": "mistral", "head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768,
            "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 40,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None,
            "vocab_size": 131072, "hidden_act": "silu", "tie_word_embeddings": False}  # fmt: skip
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "text_config": text,
              "vision_config": {"model_type": "pixtral", "hidden_size": 1024}, "image_token_index": 10,
              "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    arch = ModelArch.from_hf_config(config)
    assert arch == ModelArch.from_hf_config({**text, "bos_token_id": 1, "eos_token_id": 2})
    assert (arch.model_type, arch.head_dim, arch.sliding_window, arch.eos_token_ids) == ("mistral", 128, None, (2,))


def test_fingerprints_of_models_before_yarn_are_unchanged() -> None:
    """A fingerprint names every KV block, on disk too: the YaRN fields enter only a YaRN model's (these digests were
    computed before they existed), and YaRN's parameters change it."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    base = {"model_type": "llama", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 2048, "rope_theta": 10000.0}  # fmt: skip
    assert ModelArch.from_hf_config({**base, "rope_scaling": llama3}).fingerprint() == "f4216bfc8cf83fdd"
    assert ModelArch.from_hf_config(base).fingerprint() == "76a26585d3a03bfc"
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    a = ModelArch.from_hf_config({**base, "rope_scaling": yarn}).fingerprint()
    b = ModelArch.from_hf_config({**base, "rope_scaling": {**yarn, "beta_fast": 16}}).fingerprint()
    assert len({a, b, "76a26585d3a03bfc"}) == 3


# Configs as transformers 5 makes and saves them (its own field names: rope_parameters, Qwen3-MoE's experts as
# num_local_experts), each with the settings its real checkpoints vary.
_SAVED = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
SAVED_CASES = {
    "llama3": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            },
        },
    ),
    "mistral": ("mistral", {"head_dim": 16, "sliding_window": 100}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": ("phi3", {"sliding_window": 2047}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": 100, "max_window_layers": 2}),
    "qwen3": ("qwen3", {"head_dim": 16, "tie_word_embeddings": True}),
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3_moe-step": ("qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 3, "decoder_sparse_step": 2}),
}


@pytest.mark.parametrize("case", SAVED_CASES)
def test_configs_transformers_saves_read_as_transformers_reads_them(case: str, tmp_path: Path) -> None:
    """A config.json that transformers itself wrote gives the network transformers builds from it: its experts and
    which layers have them, RoPE, heads, norms, tied head and window (a Qwen3-MoE's saved by transformers 5 names its
    experts num_local_experts: read as none, the model was dense and its checkpoint refused)."""
    from transformers import AutoConfig

    model_type, values = SAVED_CASES[case]
    AutoConfig.for_model(model_type, **{**_SAVED, **values}).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    arch = ModelArch.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    experts = config.num_local_experts if model_type in ("mixtral", "qwen3_moe") else 0
    if model_type == "qwen3_moe":
        step, dense = config.decoder_sparse_step, config.mlp_only_layers
        sparse = tuple(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
        assert arch.moe_intermediate_size == config.moe_intermediate_size
    else:
        sparse = tuple(range(config.num_hidden_layers)) if experts else ()
    if experts:
        assert arch.num_experts_per_tok == config.num_experts_per_tok
    assert (arch.num_experts, arch.sparse_layers) == (experts, sparse)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, head_dim)
    assert arch.rms_norm_eps == config.rms_norm_eps and arch.tie_word_embeddings == config.tie_word_embeddings
    rope = config.rope_parameters
    assert (arch.rope_theta, arch.rope_scaling.kind) == (rope["rope_theta"], rope["rope_type"])
    assert arch.rope_scaling.factor == rope.get("factor", 1.0)
    assert arch.sliding_window == getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    want = [getattr(config, "sliding_window", None) if kind == "sliding_attention" else None for kind in layer_types]
    assert [arch.layer_window(i) for i in range(arch.num_layers)] == want


# Gemma 3's text models as the Hub's config.json files have them (google/gemma-3-1b-it: the pattern of windows and the
# local RoPE base under their old names), the 4B's text config (linear scaling of the global layers' RoPE), the 27B's
# (a softmax scale from query_pre_attn_scalar that is not head_dim's), and each as transformers 5 saves it.
_GEMMA3_1B = {"model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
              "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
              "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768, "query_pre_attn_scalar": 256,
              "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
              "sliding_window": 512, "sliding_window_pattern": 6, "final_logit_softcapping": None,
              "attn_logit_softcapping": None, "attention_bias": False, "bos_token_id": 2,
              "eos_token_id": [1, 106]}  # fmt: skip
GEMMA3_CASES = {
    "1b": _GEMMA3_1B,
    "4b": {**_GEMMA3_1B, "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
           "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "sliding_window": 1024,
           "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "27b": {**_GEMMA3_1B, "hidden_size": 5376, "num_hidden_layers": 62, "num_attention_heads": 32,
            "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024},
}  # fmt: skip


@pytest.mark.parametrize("saved", [False, True], ids=["hub", "saved-by-transformers-5"])
@pytest.mark.parametrize("case", GEMMA3_CASES)
def test_gemma3_configs_read_as_transformers_reads_them(case: str, saved: bool, tmp_path: Path) -> None:
    """Which layers slide and by how much, each kind of layer's RoPE (base and scaling), the softmax scale, the
    embedding scale and the activation, as transformers' Gemma 3 has them from the same config."""
    from transformers import AutoConfig

    cfg = GEMMA3_CASES[case]
    config = AutoConfig.for_model(**cfg)
    if saved:
        config.save_pretrained(tmp_path)
        cfg = json.loads((tmp_path / "config.json").read_text())
        assert "rope_parameters" in cfg and "layer_types" in cfg
    arch = ModelArch.from_hf_config(cfg)
    want = [config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types]
    assert [arch.layer_window(i) for i in range(arch.num_layers)] == want
    assert arch.full_attention_layers == tuple(range(5, arch.num_layers, 6))
    local, full = config.rope_parameters["sliding_attention"], config.rope_parameters["full_attention"]
    assert (arch.local_rope_theta, arch.rope_theta) == (local["rope_theta"], full["rope_theta"])
    assert (arch.rope_scaling.kind, arch.rope_scaling.factor) == (full["rope_type"], full.get("factor", 1.0))
    assert arch.attention_scale == config.query_pre_attn_scalar**-0.5
    assert arch.embedding_scale == config.hidden_size**0.5 and arch.hidden_act == config.hidden_activation
    assert arch.tie_word_embeddings and arch.qk_norm and arch.sandwich_norms and arch.norm_weight_offset == 1.0
    assert arch.eos_token_ids == (1, 106) and arch.context_length == config.max_position_embeddings


def test_a_gemma3_multimodal_config_reads_as_its_text_model() -> None:
    """google/gemma-3-4b-it's config.json (Gemma3ForConditionalGeneration): its text_config names six fields and
    leaves the rest to transformers' defaults, its token ids at the top level; read as the text model transformers
    builds from it."""
    from transformers import Gemma3Config

    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
           "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}  # fmt: skip
    text = Gemma3Config(**cfg).text_config
    arch = ModelArch.from_hf_config(cfg)
    assert arch == ModelArch.from_hf_config(GEMMA3_CASES["4b"])  # (the text model's config, written out whole)
    shape = (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers, arch.num_heads)
    assert shape == (text.vocab_size, 2560, 10240, 34, text.num_attention_heads)
    assert (arch.num_kv_heads, arch.head_dim, arch.sliding_window) == (text.num_key_value_heads, text.head_dim, 1024)
    assert (arch.rope_scaling.kind, arch.rope_scaling.factor) == ("linear", 8.0)
    assert arch.eos_token_ids == (1, 106) and arch.context_length == text.max_position_embeddings


# Gemma 2 as the Hub's config.json files have it (google/gemma-2-2b-it; the 9B's and 27B's shapes, the 27B's softmax
# scale not its head size's).
_GEMMA2_2B = {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
              "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
              "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
              "max_position_embeddings": 8192, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
              "rope_theta": 10000.0, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
              "final_logit_softcapping": 30.0, "attention_bias": False, "cache_implementation": "hybrid",
              "bos_token_id": 2, "eos_token_id": [1, 107], "pad_token_id": 0}  # fmt: skip
GEMMA2_CASES = {
    "2b": _GEMMA2_2B,
    "9b": {**_GEMMA2_2B, "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
           "num_attention_heads": 16, "num_key_value_heads": 8},
    "27b": {**_GEMMA2_2B, "hidden_size": 4608, "intermediate_size": 36864, "num_hidden_layers": 46,
            "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 144},
}  # fmt: skip


@pytest.mark.parametrize("saved", [False, True], ids=["hub", "saved-by-transformers-5"])
@pytest.mark.parametrize("case", GEMMA2_CASES)
def test_gemma2_configs_read_as_transformers_reads_them(case: str, saved: bool, tmp_path: Path) -> None:
    """Gemma 2: every other layer slides (the first does), one RoPE for all, its caps of attention's scores and of the
    logits, its softmax scale, no head norms; as transformers' Gemma 2 has them from the same config."""
    from transformers import AutoConfig

    cfg = GEMMA2_CASES[case]
    config = AutoConfig.for_model(**cfg)
    if saved:
        config.save_pretrained(tmp_path)
        cfg = json.loads((tmp_path / "config.json").read_text())
    arch = ModelArch.from_hf_config(cfg)
    want = [config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types]
    assert [arch.layer_window(i) for i in range(arch.num_layers)] == want
    assert arch.full_attention_layers == tuple(range(1, arch.num_layers, 2))
    assert (arch.attn_logit_softcap, arch.final_logit_softcap) == (50.0, 30.0)
    assert arch.attention_scale == config.query_pre_attn_scalar**-0.5
    assert (arch.rope_theta, arch.local_rope_theta, arch.rope_scaling.kind) == (10000.0, None, "default")
    assert not arch.qk_norm and arch.sandwich_norms and arch.hidden_act == "gelu_pytorch_tanh"
    assert arch.eos_token_ids == (1, 107) and arch.context_length == 8192 and arch.tie_word_embeddings


def test_gemma_caps_as_transformers_has_them() -> None:
    """Gemma 2's caps (and head size) are transformers' defaults where its config leaves them out and none where it says
    null; a Gemma 3 config's caps as transformers' Gemma 3 takes them; EmbeddingGemma's attention both ways is refused
    by name."""
    bare = {k: v for k, v in _GEMMA2_2B.items() if not k.endswith("softcapping")}
    assert (ModelArch.from_hf_config(bare).attn_logit_softcap, ModelArch.from_hf_config(bare).final_logit_softcap) == (
        50.0,
        30.0,
    )
    nulls = {**_GEMMA2_2B, "attn_logit_softcapping": None, "final_logit_softcapping": None}
    assert ModelArch.from_hf_config(nulls).attn_logit_softcap is None
    # (transformers' Gemma 3 text model caps the logits a config asks it to, never the scores: its attention does not
    # pass the cap on; its multimodal model caps neither.)
    capped = ModelArch.from_hf_config({**_GEMMA3_1B, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0})
    assert (capped.attn_logit_softcap, capped.final_logit_softcap) == (None, 30.0)
    assert ModelArch.from_hf_config(_GEMMA3_1B).final_logit_softcap is None
    multimodal = {"model_type": "gemma3", "text_config": {**_GEMMA3_1B, "final_logit_softcapping": 30.0}}
    assert ModelArch.from_hf_config(multimodal).final_logit_softcap is None
    assert ModelArch.from_hf_config({k: v for k, v in _GEMMA2_2B.items() if k != "head_dim"}).head_dim == 256
    with pytest.raises(ValueError, match="use_bidirectional_attention is not supported"):
        ModelArch.from_hf_config({**_GEMMA3_1B, "use_bidirectional_attention": True})
    # (The fields a Gemma adds stay out of the fingerprints of the models before it.)
    llama = {"model_type": "llama", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 2048, "rope_theta": 10000.0}  # fmt: skip
    assert ModelArch.from_hf_config(llama).fingerprint() == "76a26585d3a03bfc"


@pytest.mark.parametrize(
    "model_type", ["llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text"]
)
@pytest.mark.parametrize("field", ["attention_bias", "mlp_bias"])
def test_projection_biases_are_transformers_or_refused(model_type: str, field: str) -> None:
    """With attention_bias or mlp_bias set, the q/k/v biases are those transformers' model of the config has, and a
    config whose model biases o_proj or the MLP (Llama's, Qwen3's) is refused naming the field: its checkpoint was
    refused with a shape error on o_proj.bias, and a Mistral's or Phi-3's, whose models read neither field, asked for
    q/k/v biases its checkpoint has not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # (Phi-3's default pad token, 32000, is past this vocabulary.)
    config = AutoConfig.for_model(model_type, **{**_SAVED, "num_hidden_layers": 1, "pad_token_id": 0, field: True})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q = getattr(attention, "q_proj", None) or attention.qkv_proj
    dense = [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    cfg = {**config.to_dict(), field: True}
    if attention.o_proj.bias is not None or any(m.bias is not None for m in dense):
        with pytest.raises(ValueError, match=f"{field} is not supported"):
            ModelArch.from_hf_config(cfg)
        return
    assert ModelArch.from_hf_config(cfg).qkv_bias == (q.bias is not None)


# A GLM-4.5-Air-shaped config.json (46 layers, 128 experts of 1,408, 8 a token, a shared expert, the first layer dense,
# q/k/v biases, RoPE on half of each 128-wide head), and GLM-4.5's differences (groups, a scale, head norms).
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "moe_intermediate_size": 1408, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "use_qk_norm": False, "vocab_size": 151552, "eos_token_id": [151329, 151336, 151338],
}  # fmt: skip


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "use_qk_norm": True, "first_k_dense_replace": 3},
    ],
)
def test_glm4_moe_reads_as_transformers_does(changes: dict) -> None:
    """GLM-4.5's config as transformers' Glm4MoeConfig reads it: its routed and shared experts, groups, scale, dense
    first layers, biases, head norms and half-rotated heads; the router's correction held in fp32 in a bf16 model."""
    from transformers import Glm4MoeConfig

    from boundless.model.llama import LlamaModel

    cfg = {**GLM45_AIR, **changes}
    arch = ModelArch.from_hf_config(cfg)
    theirs = Glm4MoeConfig(**cfg)
    assert (arch.num_experts, arch.num_experts_per_tok) == (theirs.n_routed_experts, theirs.num_experts_per_tok)
    assert (arch.moe_intermediate_size, arch.num_shared_experts) == (
        theirs.moe_intermediate_size,
        theirs.n_shared_experts,
    )
    assert (arch.expert_groups, arch.expert_groups_chosen) == (theirs.n_group, theirs.topk_group)
    assert arch.routed_scaling_factor == theirs.routed_scaling_factor and arch.expert_score == "sigmoid"
    assert arch.sparse_layers == tuple(range(theirs.first_k_dense_replace, 46)) and arch.norm_topk_prob
    assert arch.qkv_bias and not arch.o_bias and arch.qk_norm == theirs.use_qk_norm
    assert arch.rotary_dim == 64 and arch.head_dim == 128 and arch.rope_theta == 1e6
    small = ModelArch.from_hf_config(
        {
            **cfg,
            "num_hidden_layers": 2,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        }
    )
    with torch.device("meta"):
        model = LlamaModel(small).to(torch.bfloat16)
    moe = model.layers[1].moe
    assert moe is not None and moe.score_bias is not None and moe.score_bias.dtype == torch.float32
    assert (
        moe.router.dtype == torch.float32
        and moe.shared_gate_up is not None
        and moe.shared_gate_up.shape == (2816, 4096)
    )
    assert (
        ModelArch.from_hf_config(cfg).fingerprint()
        != ModelArch.from_hf_config({**cfg, "routed_scaling_factor": 3.0}).fingerprint()
    )
