"""Architectures read from a Hugging Face ``config.json``: what each model type sets, and what is refused."""

from __future__ import annotations

import pytest

from boundless.model.arch import ModelArch


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
