"""vLLM's ``--hf-overrides``: keys that replace a model directory's ``config.json`` (YaRN for a long context)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundless import LLM, SamplingParams
from boundless.config import ConfigError, ModelConfig
from boundless.llm import engine_config
from boundless.model.loader import hf_arch, hf_config, load_model
from boundless.sim.engine import SimulatedModel

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def test_overrides_replace_config_keys(model_dirs: dict[str, Path]) -> None:
    """A Qwen3 of 2,048 positions served with YaRN over 1,024 of them: its RoPE is YaRN's, its context 4,096 by
    default, its KV named apart from the same weights without the override; the simulator reads it alike."""
    path = str(model_dirs["tiny-qwen3"])
    plain, yarn = load_model(path), load_model(path, hf_overrides={"rope_scaling": YARN})
    assert plain.arch.rope_scaling.kind == "default" and plain.arch.context_length == 2048
    assert yarn.arch.rope_scaling.kind == "yarn" and yarn.arch.context_length == 4096
    assert plain.fingerprint != yarn.fingerprint
    llm = LLM(path, hf_overrides={"rope_scaling": YARN}, kv_cache_gb=0.05)  # vLLM's form: a dict
    assert llm.engine.max_model_len == 4096
    assert (
        llm.generate(
            "The fox",
        )[0]
        .outputs[0]
        .token_ids
    )
    simulated = SimulatedModel.read(
        ModelConfig(model=path, hf_overrides='{"rope_scaling": {"type": "yarn", "factor": 4}}')
    )
    assert simulated.arch.rope_scaling.kind == "yarn" and simulated.arch.context_length == 8192


def test_overridden_model_matches_transformers_with_the_same_overrides(model_dirs: dict[str, Path]) -> None:
    """tiny-qwen3's weights served with YaRN over 16 of its positions compute what transformers computes with the same
    override (the reference bench offline builds); without the override the tokens differ."""
    from boundless.bench.offline import hf_generate, load_hf_reference

    overrides = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}
    loaded = load_model(str(model_dirs["tiny-qwen3"]), hf_overrides=overrides)
    prompts = [loaded.tokenizer.encode(t) for t in ("The quick brown fox jumps over the lazy dog. " * 3, "Paris")]
    want = hf_generate(load_hf_reference(loaded), prompts, 12, 0, loaded.device)
    llm = LLM.from_config(engine_config(str(loaded.path), hf_overrides=overrides, max_model_len=256), loaded)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)] == want
    plain = load_model(str(model_dirs["tiny-qwen3"]))
    assert hf_generate(load_hf_reference(plain), prompts, 12, 0, plain.device) != want


@pytest.mark.parametrize(("text", "error"), [("{", "not JSON"), ("[1]", "must be a JSON object")])
def test_bad_overrides_are_refused(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=f"--hf-overrides: {error}"):
        ModelConfig(hf_overrides=text)


def test_overrides_the_model_cannot_follow_name_the_flag(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="--hf-overrides: unsupported rope scaling type 'dynamic'"):
        load_model(str(model_dirs["tiny-qwen3"]), hf_overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2}})


def test_a_gguf_file_takes_no_overrides() -> None:
    """Its hyperparameters are not a config.json: refused before anything loads (the bundled model is a GGUF file)."""
    with pytest.raises(ConfigError, match=r"--hf-overrides: .*GGUF"):
        LLM("smollm2-135m", hf_overrides={"rope_scaling": YARN})
    with pytest.raises(ConfigError, match=r"--hf-overrides: .*GGUF"):
        SimulatedModel.read(ModelConfig(hf_overrides='{"max_position_embeddings": 4096}'))


def test_an_override_of_a_sub_config_updates_its_keys(tmp_path: Path) -> None:
    """A multimodal config's ``text_config`` (Gemma 3's 4B and up) is a sub-config: an override of it updates the keys
    it names, as vLLM updates a nested config, where it replaced the whole (and the text model fell back to
    transformers' defaults, whose shapes the checkpoint did not have); any other dict is still replaced whole."""
    text = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 384,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    overrides = {"text_config": {"max_position_embeddings": 64, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}}
    arch = hf_arch(tmp_path, overrides)
    assert (arch.hidden_size, arch.num_layers, arch.max_position_embeddings) == (64, 2, 64)
    assert (arch.rope_scaling.kind, arch.rope_scaling.factor) == ("linear", 2.0)
    assert hf_config(tmp_path, overrides)["text_config"]["num_key_value_heads"] == 1
    (tmp_path / "config.json").write_text(json.dumps({**text, "quantization_config": {"quant_method": "fp8", "a": 1}}))
    replaced = hf_config(tmp_path, {"quantization_config": {"quant_method": "fp8"}})["quantization_config"]
    assert replaced == {"quant_method": "fp8"}  # (a plain dict, not a sub-config: replaced whole)
