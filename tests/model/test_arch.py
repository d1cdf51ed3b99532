"""Architectures read from a Hugging Face ``config.json``: what each model type sets, and what is refused."""

from __future__ import annotations

import pytest
import torch

from boundless.model.arch import ModelArch
from boundless.model.rope import inverse_frequencies


def test_configs_this_model_cannot_follow_are_refused() -> None:
    """Phi-3's variants with RoPE on part of each head (Phi-4-mini) or longrope scaling (its 128k models) are refused
    by name rather than run wrongly; a Phi-3 config of full RoPE reads as the fused Llama it is."""
    base = {"model_type": "phi3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "sliding_window": 2047}  # fmt: skip
    arch = ModelArch.from_hf_config(base)
    assert arch.model_type == "phi3" and arch.sliding_window == 2047 and not arch.num_experts
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelArch.from_hf_config({**base, "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="longrope"):
        ModelArch.from_hf_config({**base, "rope_scaling": {"type": "longrope", "short_factor": [1.0]}})


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
