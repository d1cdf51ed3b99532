"""LoRA adapters compute what PEFT computes on transformers' model with the same adapter, in batches that mix them.

Adapters are made and saved by PEFT itself (random ``A`` and ``B``: ``init_lora_weights=False``), then served by
the engine beside the base model; every prompt runs three times in one batch (base, adapter 1, adapter 2) and each
output must equal transformers' (base) or PEFT's (adapters) greedy output token for token.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from boundless.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.core import EngineCore
from boundless.engine.errors import InvalidRequestError
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import LLM, engine_config
from boundless.model.loader import LoadedModel
from boundless.model.lora import LoRAError, LoRAModule, LoRARequest, load_lora
from boundless.model.random_model import write_random_lora

MAX_NEW = 10
TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Agents call language models many times in a loop, with tools between the calls. " * 3,
    "def add(a, b):\n    return a + b\n",
]
# (And Phi-3's and GLM-4's fused modules, their checkpoints' own: PEFT adapts the names a model has.)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"]
# Adapter 1: every projection, rank 8. Adapter 2: q and v (PEFT's default on a Llama; Phi-3's fused q/k/v), rank 4,
# rsLoRA, its own alpha for v. Adapter 3: the MLP only, rank 2. (On the native path a layer half no adapter of the step
# changes stays one fused call: adapters 2 and 3 alone each leave one half fused.)
ADAPTERS = {
    "all8": {"r": 8, "lora_alpha": 16, "target_modules": ALL_MODULES},
    "attn4": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj", "qkv_proj"],
        "use_rslora": True,
        "alpha_pattern": {"self_attn.v_proj": 2},  # (a key naming the block too: PEFT matches the module's whole name)
    },
    "mlp2": {"r": 2, "lora_alpha": 4, "target_modules": ["gate_proj", "up_proj", "down_proj", "gate_up_proj"]},
}


def write_adapter(hf_model: Any, path: Path, seed: int, **lora_kwargs: Any) -> Any:
    """Save a random PEFT adapter for ``hf_model`` (left unchanged) at ``path``; returns PEFT's model with it."""
    # (The test extra installs PEFT; a GPU machine's own packages may lack it: scripts/gpu-check.sh's notes.)
    peft = pytest.importorskip("peft")
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():  # PEFT's default init of B is as large as A's; keep the change a perturbation
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    model.save_pretrained(str(path))
    return model.eval()


def _greedy_reference(model: Any, prompts: list[list[int]], device: torch.device) -> list[list[int]]:
    """Greedy outputs of exactly ``MAX_NEW`` tokens, EOS held back until then (the engine's ``min_tokens``)."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            seq = model.generate(
                input_ids=torch.tensor([p], device=device),
                attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(seq[0, len(p) :].tolist())
    return outs


class AdapterCase:
    """A model, two adapters written by PEFT, and the reference outputs of all three."""

    def __init__(self, loaded: LoadedModel, hf: Any, root: Path) -> None:
        self.loaded = loaded
        self.prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
        self.paths = {name: root / name for name in ADAPTERS}
        self.expected = {None: _greedy_reference(hf, self.prompts, loaded.device)}
        for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
            peft_model = write_adapter(hf, self.paths[name], seed, **kwargs)
            self.expected[name] = _greedy_reference(peft_model, self.prompts, loaded.device)
            del peft_model

    def engine(self, **model: Any) -> EngineCore:
        modules = tuple(f"{name}={path}" for name, path in self.paths.items())
        config = EngineConfig(
            model=ModelConfig(max_model_len=512, enable_lora=True, lora_modules=modules, **model),
            cache=CacheConfig(num_kv_blocks=256),
            scheduler=SchedulerConfig(),
        )
        return EngineCore.from_model(self.loaded, config)


_CASES: dict[str, AdapterCase] = {}
_ON_CPU = os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu") == "cpu"  # (conftest's TEST_DEVICE)


def _case(name: str, load: Callable, hf_model: Callable, tmp_path_factory: pytest.TempPathFactory) -> AdapterCase:
    if name not in _CASES:
        _CASES[name] = AdapterCase(load(name), hf_model(name), tmp_path_factory.mktemp(f"lora-{name}"))
    return _CASES[name]


@pytest.fixture(
    scope="module",
    params=[
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma3",
        "tiny-gemma2",
        "tiny-granite",
        "tiny-glm4",
        "tiny-phi3",
        # (PEFT's run of the real model, 25 s on the CPU: the slow suite there; the tiny models' in the fast one.)
        pytest.param("smollm2-135m", marks=pytest.mark.slow if _ON_CPU else ()),
    ],
)
def case(
    request: pytest.FixtureRequest, load: Callable, hf_model: Callable, tmp_path_factory: pytest.TempPathFactory
) -> AdapterCase:
    return _case(request.param, load, hf_model, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(load: Callable, hf_model: Callable, tmp_path_factory: pytest.TempPathFactory) -> AdapterCase:
    """The tiny Llama's case, for what does not depend on the model (the API, scheduling, errors)."""
    return _case("tiny-llama", load, hf_model, tmp_path_factory)


def _run(core: EngineCore, jobs: list[tuple[str, list[int], str | None]]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)  # (transformers' min_new_tokens)
    for rid, prompt, lora in jobs:
        core.add_request(rid, prompt, dataclasses.replace(params, lora_name=lora))
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in jobs}
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id].extend(delta.new_token_ids)
    return out


def test_mixed_batch_matches_peft(case: AdapterCase) -> None:
    """Base, adapter 1 and adapter 2 requests of every prompt in one batch: each equals its reference."""
    core = case.engine(max_loras=3)
    names = [None, *ADAPTERS]
    jobs = [(f"{name}-{i}", p, name) for i, p in enumerate(case.prompts) for name in names]
    got = _run(core, jobs)
    for name in names:
        assert [got[f"{name}-{i}"] for i in range(len(case.prompts))] == case.expected[name], name
    # The adapters change the outputs (else the test could not tell them apart).
    assert case.expected["all8"] != case.expected[None]
    assert case.expected["attn4"] != case.expected[None]
    assert case.expected["mlp2"] != case.expected[None]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_alone_beside_the_base_model(llama: AdapterCase, name: str) -> None:
    """One adapter in a step with the base model: the halves of each layer it leaves alone run fused."""
    core = llama.engine()
    jobs = [(f"{n}-{i}", p, n) for i, p in enumerate(llama.prompts) for n in (None, name)]
    got = _run(core, jobs)
    for n in (None, name):
        assert [got[f"{n}-{i}"] for i in range(len(llama.prompts))] == llama.expected[n], n


def test_mixed_batch_on_the_pytorch_path(llama: AdapterCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the layers' PyTorch path (other dtypes and devices; the test above takes the native CPU path)."""
    from boundless.model import llama as llama_module

    monkeypatch.setattr(llama_module.cpu_kernels, "usable", lambda t: False)
    core = llama.engine(max_loras=3)
    assert all(layer.packed is None for layer in llama.loaded.model.layers)
    names = [None, *ADAPTERS]
    got = _run(core, [(f"{name}-{i}", p, name) for i, p in enumerate(llama.prompts) for name in names])
    for name in names:
        assert [got[f"{name}-{i}"] for i in range(len(llama.prompts))] == llama.expected[name], name


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow if _ON_CPU else ()) for n in ("tiny-llama", "tiny-qwen2")]
)
def test_mixed_batch_on_the_triton_kernels(
    name: str, load: Callable, hf_model: Callable, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The GPU path's fused layers with adapters (on the CPU in Triton's interpreter); on CUDA, steps of the base
    model alone replay CUDA graphs and steps with adapters run eagerly, in one run."""
    from boundless.attention import triton_paged

    case = _case(name, load, hf_model, tmp_path_factory)
    if not triton_paged.available(case.loaded.device):
        pytest.skip("triton unavailable")
    core = case.engine(max_loras=3, attention_backend="triton")
    names = [None, *ADAPTERS]
    got = _run(core, [(f"{n}-{i}", p, n) for i, p in enumerate(case.prompts) for n in names])
    for n in names:
        assert [got[f"{n}-{i}"] for i in range(len(case.prompts))] == case.expected[n], n
    got = _run(core, [(f"again-{i}", p, None) for i, p in enumerate(case.prompts)])  # the base model alone
    assert [got[f"again-{i}"] for i in range(len(case.prompts))] == case.expected[None]


def test_prefix_cache_keeps_adapters_apart(case: AdapterCase) -> None:
    """A prompt cached by the base model is not a prefix hit for an adapter's request (its KV differs), but is for
    the same adapter's next request; outputs stay equal to the references throughout."""
    core = case.engine(max_loras=1)
    prompt = case.prompts[2]
    index = 2
    first = _run(core, [("base", prompt, None)])
    assert first["base"] == case.expected[None][index]
    got = _run(core, [("a", prompt, "all8")])
    assert got["a"] == case.expected["all8"][index]
    cached_a = core.scheduler.stats.num_prompt_tokens_cached
    assert cached_a == 0, "the adapter's request reused the base model's KV"
    got = _run(core, [("a2", prompt, "all8")])
    assert got["a2"] == case.expected["all8"][index]
    assert core.scheduler.stats.num_prompt_tokens_cached > cached_a  # its own KV is found again
    # What a prefill engine says it holds (a DE-read call's push starts after it) is counted per adapter too.
    held = len(prompt) // core.kv.block_size
    assert core.memory_prefix_blocks(prompt) == held
    assert core.memory_prefix_blocks(prompt, SamplingParams(lora_name="all8")) == held
    assert core.memory_prefix_blocks(prompt, SamplingParams(lora_name="attn4")) == 0  # loaded, not run on this prompt
    assert core.memory_prefix_blocks(prompt, SamplingParams(lora_name="nope")) == 0


def test_offline_lora_request(llama: AdapterCase) -> None:
    """vLLM's offline form: ``LLM(enable_lora=True)`` and ``generate(..., lora_request=LoRARequest(...))``, the
    adapter loaded on first use; a list gives one per prompt."""

    llm = LLM.from_config(engine_config(str(llama.loaded.path), enable_lora=True, max_model_len=256), llama.loaded)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)  # (transformers' min_new_tokens)
    lora = LoRARequest("all8", 1, str(llama.paths["all8"]))
    outs = llm.generate(llama.prompts[:2], params, lora_request=lora)
    assert [o.outputs[0].token_ids for o in outs] == llama.expected["all8"][:2]
    outs = llm.generate(llama.prompts[:2], params, lora_request=[None, lora])
    assert [o.outputs[0].token_ids for o in outs] == [llama.expected[None][0], llama.expected["all8"][1]]


def test_max_loras_bounds_a_step(llama: AdapterCase) -> None:
    """With ``max_loras=1`` a step holds one adapter's requests (and the base model's); the others wait."""
    core = llama.engine(max_loras=1)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, lora in enumerate([None, "all8", "attn4", "all8"]):
        core.add_request(str(i), llama.prompts[0], dataclasses.replace(params, lora_name=lora))
    stats = core.stats()
    assert stats.lora_waiting == {"all8": 2, "attn4": 1, "mlp2": 0}
    assert stats.lora_running == {"all8": 0, "attn4": 0, "mlp2": 0}
    seen: list[set[str]] = []
    first = True
    while core.has_unfinished():
        sched = core.schedule()
        if first:  # the base request and the first adapter's two run; the other adapter's waits (/metrics' gauges)
            assert core.stats().lora_running == {"all8": 2, "attn4": 0, "mlp2": 0}
            assert core.stats().lora_waiting["attn4"] == 1
            first = False
        seen.append({c.sampling_params.lora_name for c in sched.chunks} - {None})
        core.finish_step(sched, core.execute(sched))
    assert all(len(s) <= 1 for s in seen)
    assert {"all8"} in seen and {"attn4"} in seen


def test_unknown_adapter_and_disabled_lora(llama: AdapterCase) -> None:
    core = llama.engine()
    params = SamplingParams(max_tokens=2, lora_name="nope")
    with pytest.raises(InvalidRequestError, match="'nope' is not loaded") as unknown:
        core.add_request("x", llama.prompts[0], params)
    assert unknown.value.code == "model_not_found"  # (the server's 404, as for a model it never listed)
    plain = EngineCore.from_model(llama.loaded, EngineConfig(model=ModelConfig(max_model_len=256)))
    with pytest.raises(LoRAError, match="--enable-lora"):
        plain.add_lora(LoRARequest("all8", 1, str(llama.paths["all8"])))
    # A name already loaded is refused (vLLM's rule), not silently kept: unload it first.
    before = core.loras["all8"]
    with pytest.raises(LoRAError, match="'all8' has already been loaded"):
        core.add_lora(LoRARequest("all8", 9, str(llama.paths["attn4"])))
    assert core.loras["all8"] == before
    # An adapter that an unfinished request runs with stays loaded; once the request is gone it can go.
    core.add_request("user", llama.prompts[0], SamplingParams(max_tokens=2, lora_name="attn4"))
    with pytest.raises(LoRAError, match="in use by 1 unfinished requests"):
        core.remove_lora("attn4")
    assert "attn4" in core.loras
    core.abort("user")
    assert core.remove_lora("attn4") and "attn4" not in core.loras
    assert not core.remove_lora("attn4")


# -- the loader's errors ------------------------------------------------------------------------


def _broken_copy(src: Path, dst: Path, config: dict | None = None, edit: Callable[[dict], None] | None = None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def _drop_first_b(tensors: dict) -> None:
    del tensors[next(k for k in sorted(tensors) if "lora_B" in k)]


def _add_head(tensors: dict) -> None:
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 4)


def _bad_shape(tensors: dict) -> None:
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = torch.zeros(8, 3)


def _rank_zero(tensors: dict) -> None:
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    a, b = tensors[key], tensors[key.replace("lora_A", "lora_B")]
    tensors[key], tensors[key.replace("lora_A", "lora_B")] = a[:0].clone(), b[:, :0].clone()


def _huge_b(tensors: dict) -> None:
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key] = torch.full_like(tensors[key], 3e38)  # (all8's scale is 16 / 8: 6e38, past fp32's largest)


def _nan_b(tensors: dict) -> None:
    """(Loaded, such an adapter made NaN logits, and a sampled row's draw failed the whole step.)"""
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key] = torch.full_like(tensors[key], float("nan"))


@pytest.mark.parametrize(
    ("config", "edit", "message"),
    [
        ({"use_dora": True}, None, "DoRA"),
        ({"bias": "lora_only"}, None, "biases"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"peft_type": "IA3"}, None, "not LORA"),
        (None, _drop_first_b, "lacks lora_B"),
        (None, _add_head, "not LoRA on a layer"),
        (None, _bad_shape, "this model needs A"),
        (None, _rank_zero, r"has rank 0 \(A \(0, "),
        (None, _nan_b, r"holds values that are not finite \(NaN or inf\)"),
        (None, _huge_b, r"not finite \(NaN or inf\) once scaled"),  # (finite, but inf once scaled)
    ],
)
def test_loader_refuses_what_it_cannot_apply(
    llama: AdapterCase, tmp_path: Path, config: dict | None, edit: Callable | None, message: str
) -> None:
    path = _broken_copy(llama.paths["all8"], tmp_path / "bad", config, edit)
    loaded = llama.loaded
    with pytest.raises(LoRAError, match=message):
        load_lora(LoRARequest("bad", 1, str(path)), loaded.arch, loaded.dtype, loaded.device, 16)


def test_an_adapter_of_modules_the_model_does_not_name_is_refused(
    load: Callable, hf_model: Callable, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Phi-3's checkpoint (so PEFT) names its q/k/v and gate/up fused: an adapter of a Llama's unfused q_proj on a
    Phi-3 is refused by name, not summed into the fused matrix; a Llama's adapter of a fused module likewise."""
    llama = _case("tiny-llama", load, hf_model, tmp_path_factory)
    phi3 = load("tiny-phi3")
    with pytest.raises(LoRAError, match=r"q_proj\.lora_A.* this phi3 model names them \(o_proj, down_proj, qkv_proj"):
        load_lora(LoRARequest("llamas", 1, str(llama.paths["attn4"])), phi3.arch, phi3.dtype, phi3.device, 16)

    def fused(tensors: dict) -> None:
        for key in list(tensors):
            tensors[key.replace(".q_proj.", ".qkv_proj.")] = tensors.pop(key)

    path = _broken_copy(llama.paths["attn4"], tmp_path / "fused", edit=fused)
    with pytest.raises(LoRAError, match=r"qkv_proj.* this llama model names them"):
        load_lora(LoRARequest("fused", 1, str(path)), llama.loaded.arch, llama.loaded.dtype, llama.loaded.device, 16)


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."], ids=["transformers-5", "4.50"])
def test_a_multimodal_gemma3_adapter_serves_its_text_models_share(
    prefix: str, load: Callable, hf_model: Callable, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """PEFT names an adapter of Gemma 3's 4B and up under the multimodal model's language model (transformers 5's
    prefix, or 4.50's), and an all-linear one has tensors on the vision tower and its projector too: the text model's
    share is served as the same adapter of the text model is, the vision tower's left unread."""
    case = _case("tiny-gemma3", load, hf_model, tmp_path_factory)
    root = tmp_path_factory.mktemp("multimodal-lora")

    def rename(tensors: dict) -> None:
        for key in list(tensors):
            tensors[key.replace("base_model.model.model.", f"base_model.model.{prefix}")] = tensors.pop(key)
        tensors["base_model.model.model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.lora_A.weight"] = (
            torch.zeros(8, 32)
        )

    path = _broken_copy(case.paths["all8"], root / "multimodal", edit=rename)
    config = EngineConfig(
        model=ModelConfig(max_model_len=512, enable_lora=True, lora_modules=(f"multimodal={path}",)),
        cache=CacheConfig(num_kv_blocks=256),
        scheduler=SchedulerConfig(),
    )
    core = EngineCore.from_model(case.loaded, config)
    got = _run(core, [(f"m-{i}", p, "multimodal") for i, p in enumerate(case.prompts)])
    assert [got[f"m-{i}"] for i in range(len(case.prompts))] == case.expected["all8"]


def test_an_adapter_config_without_lora_alpha_takes_peft_default_of_8(llama: AdapterCase, tmp_path: Path) -> None:
    """PEFT's LoraConfig reads a missing ``lora_alpha`` as 8 (its default): scaled as the same weights with
    ``lora_alpha: 8``, where it was scaled as alpha = r."""
    src = llama.paths["all8"]
    eight = _broken_copy(src, tmp_path / "eight", {"lora_alpha": 8})
    bare = _broken_copy(src, tmp_path / "bare")
    config = json.loads((bare / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (bare / "adapter_config.json").write_text(json.dumps(config))
    loaded = llama.loaded
    with_eight, without = (
        load_lora(LoRARequest(path.name, 1, str(path)), loaded.arch, loaded.dtype, loaded.device, 16)
        for path in (eight, bare)
    )
    pairs = [
        (a, b)
        for la, lb in zip(with_eight.layers, without.layers, strict=True)
        for a, b in zip(la, lb, strict=True)
        if a is not None
    ]
    assert pairs and all(torch.equal(a.b, b.b) for a, b in pairs)


def _write_config(text: str) -> Callable[[Path], None]:
    return lambda path: (path / "adapter_config.json").write_text(text)


def _write_weights(data: bytes) -> Callable[[Path], None]:
    return lambda path: (path / "adapter_model.safetensors").write_bytes(data)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (_write_weights(b"garbage, not safetensors"), "not a readable safetensors file"),
        (_write_weights(b""), "not a readable safetensors file"),
        (_write_config("[]"), "must hold a JSON object, not list"),
        (_write_config('"x"'), "must hold a JSON object, not str"),
        (_write_config('{"r": 8, "lora_alpha": "abc"}'), "lora_alpha must be a number, not 'abc'"),
        (_write_config('{"r": 0, "lora_alpha": 16}'), "r must be a positive number, not 0"),
        (_write_config('{"r": 8, "lora_alpha": null}'), "lora_alpha must be a number, not None"),
        (_write_config('{"r": 8, "lora_alpha": NaN}'), "lora_alpha must be a number"),
        (_write_config('{"r": 8, "alpha_pattern": {"(": 2}}'), r"key '\(' is not a regular expression"),
        (_write_config('{"r": 8, "alpha_pattern": [1]}'), "alpha_pattern must be an object"),
        (_write_config('{"r": 8, "alpha_pattern": {"q_proj": "x"}}'), "must be a number, not 'x'"),
        (lambda path: (path / "adapter_config.json").write_bytes(b"\xff\xfe{}"), "not UTF-8 text"),
    ],
    ids=[
        "garbage-weights",
        "empty-weights",
        "config-list",
        "config-str",
        "alpha-str",
        "rank-zero",
        "alpha-null",
        "alpha-nan",
        "pattern-regex",
        "pattern-list",
        "pattern-value",
        "config-not-utf8",
    ],
)
def test_loader_turns_malformed_files_into_lora_errors(
    llama: AdapterCase, tmp_path: Path, spoil: Callable[[Path], None], message: str
) -> None:
    """However an adapter's files are malformed, loading it is a ``LoRAError`` that says how (the server's 400,
    ``--lora-modules``' one line), never the reader's own exception (a 500, a traceback)."""
    path = _broken_copy(llama.paths["all8"], tmp_path / "bad")
    spoil(path)
    loaded = llama.loaded
    with pytest.raises(LoRAError, match=message):
        load_lora(LoRARequest("bad", 1, str(path)), loaded.arch, loaded.dtype, loaded.device, 16)
    # At start-up, the flag's one line.
    config = ModelConfig(max_model_len=256, enable_lora=True, lora_modules=(f"bad={path}",))
    with pytest.raises(ConfigError, match=f"--lora-modules: .*{message}"):
        EngineCore.from_model(loaded, EngineConfig(model=config))


def test_loader_refuses_paths_the_file_system_refuses(llama: AdapterCase) -> None:
    """A path component over 255 bytes is the OS's error (``is_dir`` raises it): a ``LoRAError`` too."""
    loaded = llama.loaded
    with pytest.raises(LoRAError, match=r"cannot use the path .*File name too long"):
        load_lora(LoRARequest("x", 1, "/" + "a" * 300), loaded.arch, loaded.dtype, loaded.device, 16)


def test_rank_limit_and_paths(llama: AdapterCase, tmp_path: Path) -> None:
    loaded = llama.loaded
    with pytest.raises(LoRAError, match="exceeds --max-lora-rank 4"):
        load_lora(LoRARequest("all8", 1, str(llama.paths["all8"])), loaded.arch, loaded.dtype, loaded.device, 4)
    with pytest.raises(LoRAError, match="not a directory"):
        load_lora(LoRARequest("x", 1, str(tmp_path / "missing")), loaded.arch, loaded.dtype, loaded.device, 16)
    with pytest.raises(LoRAError, match=r"no adapter_config\.json"):
        load_lora(LoRARequest("x", 1, str(tmp_path)), loaded.arch, loaded.dtype, loaded.device, 16)
    # At start-up the flag is named (the CLI prints it, no traceback).
    config = ModelConfig(max_model_len=256, enable_lora=True, lora_modules=(f"x={tmp_path / 'missing'}",))
    with pytest.raises(ConfigError, match="--lora-modules: LoRA adapter 'x'"):
        EngineCore.from_model(loaded, EngineConfig(model=config))


def test_lora_modules_parse() -> None:
    assert LoRAModule.parse("sql=/a/b") == LoRAModule("sql", "/a/b")
    assert LoRAModule.parse('{"name": "sql", "path": "/a/b", "base_model_name": "x"}') == LoRAModule("sql", "/a/b")
    for bad in ("sql", "=/a", '{"name": 1}', "{nope"):
        with pytest.raises(LoRAError):
            LoRAModule.parse(bad)


def test_served_adapters(llama: AdapterCase) -> None:
    """The OpenAI server serves each adapter as a model of its own (vLLM's ``/v1/models`` entry: root, parent): the
    real ``openai`` client's requests for the base model and both adapters, at once, each get their reference text;
    an unknown model gets a 404."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    openai = pytest.importorskip("openai")  # the server's packages (a GPU machine may lack them)

    from boundless.api.launch import start_in_thread
    from boundless.engine.async_engine import AsyncEngine

    engine = AsyncEngine(llama.engine(max_loras=2))
    server = start_in_thread(engine, "tiny", loras={name: str(path) for name, path in llama.paths.items()})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    tokenizer = llama.loaded.tokenizer
    try:
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"tiny", *ADAPTERS}
        assert models["all8"].model_extra["parent"] == "tiny"
        assert models["all8"].model_extra["root"] == str(llama.paths["all8"])
        assert client.models.retrieve("all8") == models["all8"]  # (OpenAI's retrieve: one card, the listing's)

        def complete(model: str, prompt: list[int]) -> str:
            reply = client.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body={"min_tokens": MAX_NEW}
            )
            return reply.choices[0].text

        jobs = [(name, i) for i in range(len(llama.prompts)) for name in (None, *ADAPTERS)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            texts = list(pool.map(lambda job: complete(job[0] or "tiny", llama.prompts[job[1]]), jobs))
        for (name, i), text in zip(jobs, texts, strict=True):
            # (A random model's output may end inside a character, which the stream holds back.)
            assert text == tokenizer.decode(llama.expected[name][i]).rstrip("\ufffd"), (name, i)
        with pytest.raises(openai.NotFoundError, match="'tiny', 'all8', 'attn4'"):
            complete("nope", llama.prompts[0])
        metrics = httpx.get(server.url + "/metrics").text
        assert 'boundless_lora_requests_running{adapter="all8",instance="0"} 0.0' in metrics
        assert 'boundless_lora_requests_waiting{adapter="attn4",instance="0"} 0.0' in metrics
        # The Responses API and chat take the adapter the same way: each answer is the offline engine's under it.
        messages = [{"role": "user", "content": "Name a city."}]
        offline = LLM.from_config(
            engine_config(str(llama.loaded.path), enable_lora=True, max_model_len=512), llama.loaded
        )
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        want = offline.chat(messages, greedy, lora_request=LoRARequest("attn4", 1, str(llama.paths["attn4"])))
        want_text = want[0].outputs[0].text
        response = client.responses.create(
            model="attn4", input=messages[0]["content"], max_output_tokens=MAX_NEW, temperature=0
        )
        assert response.model == "attn4" and response.output_text == want_text
        chat = client.chat.completions.create(model="attn4", messages=messages, max_tokens=MAX_NEW, temperature=0)
        assert chat.choices[0].message.content == want_text
    finally:
        server.stop()
        engine.shutdown()


def test_adapters_loaded_at_run_time(llama: AdapterCase, tmp_path: Path) -> None:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``--allow-runtime-lora-updating``): a loaded
    adapter is listed and served with its reference output, bad loads get a 400 that says why, and an unloaded one is
    a 404 again; with the flag off the routes are a 404."""
    import httpx

    openai = pytest.importorskip("openai")  # the server's packages (a GPU machine may lack them)

    from boundless.api.launch import start_in_thread
    from boundless.config import ServerConfig
    from boundless.engine.async_engine import AsyncEngine

    config = EngineConfig(model=ModelConfig(max_model_len=512, enable_lora=True), cache=CacheConfig(num_kv_blocks=128))
    engine = AsyncEngine(EngineCore.from_model(llama.loaded, config))
    server = start_in_thread(engine, "tiny", ServerConfig(allow_runtime_lora_updating=True))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    path = str(llama.paths["all8"])

    def complete(model: str) -> str:
        reply = client.completions.create(
            model=model, prompt=llama.prompts[1], max_tokens=MAX_NEW, temperature=0, extra_body={"min_tokens": MAX_NEW}
        )
        return reply.choices[0].text

    try:
        with pytest.raises(openai.NotFoundError):
            complete("sql")
        loaded = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": path})
        assert loaded.status_code == 200 and "added" in loaded.text
        assert {m.id for m in client.models.list().data} == {"tiny", "sql"}
        assert complete("sql") == llama.loaded.tokenizer.decode(llama.expected["all8"][1]).rstrip("\ufffd")
        again = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": path})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        bad = httpx.post(
            server.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(tmp_path / "none")}
        )
        assert bad.status_code == 400 and "not a directory" in bad.json()["error"]["message"]
        unnamed = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "", "lora_path": path})
        assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "lora_name"
        gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert gone.status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete("sql")
        assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404
        # A name that is not valid Unicode (a lone surrogate) is refused as every route refuses one, and nothing is
        # registered: the model list and the metrics, which would have to encode it, stay served.
        for route in ("load_lora_adapter", "unload_lora_adapter"):
            surrogate = httpx.post(
                f"{server.url}/v1/{route}",
                content=b'{"lora_name": "bad\\ud800name", "lora_path": "%s"}' % path.encode(),
                headers={"Content-Type": "application/json"},
            )
            assert surrogate.status_code == 400 and surrogate.json()["error"]["code"] == "invalid_encoding", route
        assert {m.id for m in client.models.list().data} == {"tiny"}
        assert httpx.get(server.url + "/metrics").status_code == 200
    finally:
        server.stop()
    off = start_in_thread(engine, "tiny")
    try:
        refused = httpx.post(off.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": path})
        assert refused.status_code == 404 and "--allow-runtime-lora-updating" in refused.json()["error"]["message"]
    finally:
        off.stop()
        engine.shutdown()


def test_concurrent_loads_of_one_name(llama: AdapterCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two loads of one name at once: the first (its reader held until the second has its answer) loads, the second
    is refused as already loaded; the listing and the requests both use the first's adapter."""
    import threading

    import httpx

    from boundless.api.launch import start_in_thread
    from boundless.config import ServerConfig
    from boundless.engine import runner
    from boundless.engine.async_engine import AsyncEngine

    reading, release = threading.Event(), threading.Event()
    real_load = runner.load_lora

    def slow_load(request: LoRARequest, *args: Any) -> Any:
        reading.set()
        release.wait(10)
        return real_load(request, *args)

    monkeypatch.setattr(runner, "load_lora", slow_load)
    config = EngineConfig(model=ModelConfig(max_model_len=512, enable_lora=True), cache=CacheConfig(num_kv_blocks=128))
    engine = AsyncEngine(EngineCore.from_model(llama.loaded, config))
    server = start_in_thread(engine, "tiny", ServerConfig(allow_runtime_lora_updating=True))
    first_path, second_path = str(llama.paths["all8"]), str(llama.paths["attn4"])

    def load(path: str) -> httpx.Response:
        return httpx.post(
            server.url + "/v1/load_lora_adapter", json={"lora_name": "race", "lora_path": path}, timeout=30
        )

    try:
        replies: list[httpx.Response] = []
        first = threading.Thread(target=lambda: replies.append(load(first_path)))
        first.start()
        assert reading.wait(10)
        second = threading.Thread(target=lambda: replies.append(load(second_path)))
        second.start()
        second.join(10)
        assert not second.is_alive()  # refused at once, not after waiting for the first's load
        release.set()
        first.join(30)
        second.join(30)
        assert sorted(r.status_code for r in replies) == [200, 400], [r.text for r in replies]
        refused = next(r for r in replies if r.status_code == 400)
        assert second_path in refused.request.content.decode() and "already been loaded" in refused.text
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["root"] for m in models if m["id"] == "race"] == [first_path]
        reply = httpx.post(
            server.url + "/v1/completions",
            json={
                "model": "race",
                "prompt": llama.prompts[1],
                "max_tokens": MAX_NEW,
                "temperature": 0,
                "min_tokens": MAX_NEW,
            },
            timeout=30,
        ).json()
        assert reply["choices"][0]["text"] == llama.loaded.tokenizer.decode(llama.expected["all8"][1]).rstrip("\ufffd")
    finally:
        release.set()
        server.stop()
        engine.shutdown()


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_mixture_of_experts_takes_attention_adapters_not_the_experts(
    load: Callable, hf_model: Callable, tmp_path: Path, name: str
) -> None:
    """On a Qwen3-MoE model and a gpt-oss one (o's bias after the adapter's share, the sinks) an adapter of q and v
    (PEFT's) computes what PEFT computes; one of the MLP names, which the experts are, is refused with the reason."""
    loaded = load(name)
    hf = hf_model(name)
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    expected = _greedy_reference(write_adapter(hf, tmp_path / "qv", 0, **ADAPTERS["attn4"]), prompts, loaded.device)
    base = _greedy_reference(hf, prompts, loaded.device)
    config = EngineConfig(
        model=ModelConfig(max_model_len=512, enable_lora=True, lora_modules=(f"qv={tmp_path / 'qv'}",)),
        cache=CacheConfig(num_kv_blocks=256),
        scheduler=SchedulerConfig(),
    )
    core = EngineCore.from_model(loaded, config)
    for i, p in enumerate(prompts):
        for lora in (None, "qv"):
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, lora_name=lora)
            core.add_request(f"{lora}-{i}", p, params)
    out: dict[str, list[int]] = {}
    while core.has_unfinished():
        for delta in core.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert [out[f"qv-{i}"] for i in range(len(prompts))] == expected != base
    assert [out[f"None-{i}"] for i in range(len(prompts))] == base
    mlp = write_random_lora(tmp_path / "mlp", loaded.arch, targets=("q_proj", "gate_proj"))
    with pytest.raises(LoRAError, match="mixture-of-experts"):
        load_lora(LoRARequest("mlp", 1, str(mlp)), loaded.arch, torch.float32, torch.device("cpu"), 16)


def test_an_unload_refused_while_in_use_keeps_the_adapter_for_a_restarted_engine(llama: AdapterCase) -> None:
    """An unload refused (a request still runs with the adapter) leaves it loaded, and an engine restarted in place
    (a split model that lost a rank) loads it again: the refused unload dropped it from the adapters to reload, and
    after the restart its requests were refused as not loaded while ``/v1/models`` still listed it."""
    from boundless.cluster.restarts import RestartPolicy, Restarts
    from boundless.engine.async_engine import ENGINE_ID, AsyncEngine
    from boundless.engine.errors import EngineLost

    config = EngineConfig(model=ModelConfig(max_model_len=512, enable_lora=True), cache=CacheConfig(num_kv_blocks=128))
    engine = AsyncEngine(
        EngineCore.from_model(llama.loaded, config),
        rebuild=lambda: EngineCore.from_model(llama.loaded, config),
        restarts=Restarts(RestartPolicy(delay_s=0.0), [ENGINE_ID]),
    )
    try:
        engine.add_lora(LoRARequest("sql", 7, str(llama.paths["all8"])))
        first = engine.core
        lost = {"once": True}
        launch = first.launch

        def launch_then_lose(*args: object, **kwargs: object) -> object:
            if lost["once"] and engine.core.has_work():
                lost["once"] = False
                raise EngineLost("rank 1 is gone (the test's)")
            return launch(*args, **kwargs)

        engine.add("long", llama.prompts[0], SamplingParams(max_tokens=400, lora_name="sql", ignore_eos=True))
        with pytest.raises(LoRAError, match="in use by 1 unfinished requests"):
            engine.remove_lora("sql")
        first.launch = launch_then_lose  # type: ignore[method-assign]
        deadline = time.monotonic() + 60
        while engine.core is first or engine.error is not None:
            assert time.monotonic() < deadline, "the engine was not restarted"
            time.sleep(0.05)
        assert "sql" in engine.core.loras

        async def tokens() -> list[int]:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, lora_name="sql")
            return [t async for d in engine.submit("after", llama.prompts[1], params) for t in d.new_token_ids]

        assert asyncio.run(tokens()) == llama.expected["all8"][1]
    finally:
        engine.shutdown()
