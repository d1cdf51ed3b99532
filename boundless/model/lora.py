"""LoRA adapters: PEFT checkpoints loaded beside the base weights, applied per request in a shared batch.

An adapter adds ``scale * B @ A`` to some of a layer's projection matrices (``A``: rank x in, ``B``: out x rank).
It is never merged into the base weights: requests of different adapters, and of none, share one forward pass.
Each layer's base matmuls run over every token, then for each adapter in the step its tokens' rows get
``(x @ A.T) @ B.T`` added (vLLM's punica kernels do the same grouping on a GPU).

The model fuses q/k/v and gate/up into one matrix each (``model/llama.py``), so an adapter's q, k and v (and gate
and up) pairs are fused alike when loaded: their ``A``s stacked, their ``B``s (the scale folded in) placed block
by block, one pair of matmuls per fused matrix. A projection the adapter leaves alone gets zero rows.

Checkpoints are PEFT's ``save_pretrained`` layout: ``adapter_config.json`` and ``adapter_model.safetensors``,
LoRA on the attention and MLP projections (``q_proj`` ... ``down_proj``, and the fused ``qkv_proj`` and
``gate_up_proj`` of Phi-3's and GLM-4's checkpoints), with ``lora_alpha``, ``use_rslora``,
``rank_pattern`` and ``alpha_pattern``. Anything that would change the model elsewhere (DoRA, biases, trained
embeddings or head, ``modules_to_save``) is refused with an error rather than silently dropped.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from boundless.model import cpu_kernels
from boundless.model.arch import NOT_TEXT_PREFIXES, ModelArch
from boundless.model.rope import interleaved_to_halves
from boundless.model.tensor_parallel import ONE_DEVICE, TensorParallel, shard_plan

# The four fused matrices of a layer an adapter may touch, in the order the layer applies them.
QKV, O_PROJ, GATE_UP, DOWN = range(4)
_PROJECTIONS = {  # PEFT module name -> the fused matrix it is part of
    "q_proj": QKV,
    "k_proj": QKV,
    "v_proj": QKV,
    "o_proj": O_PROJ,
    "gate_proj": GATE_UP,
    "up_proj": GATE_UP,
    "down_proj": DOWN,
    # (Phi-3's q/k/v and gate/up, GLM-4's gate/up: one module in their checkpoints, so in PEFT's adapters of them)
    "qkv_proj": QKV,
    "gate_up_proj": GATE_UP,
}


def checkpoint_modules(arch: ModelArch) -> tuple[str, ...]:
    """The projections an adapter of ``arch``'s model may name, as its checkpoint (so PEFT) names them: Phi-3's
    fused q/k/v and gate/up, GLM-4's fused gate/up, the others' seven apart. (A module the model has not, a hand-made
    adapter's ``q_proj`` beside Phi-3's ``qkv_proj`` say, is refused rather than summed into the fused matrix.)"""
    fused = arch.fused_projections
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    hidden = {name for f in fused for name in parts[f]}
    return tuple(m for m in _PROJECTIONS if m not in hidden and (m not in parts or m in fused))


# (A multimodal model's language model has its own prefix: Gemma 3's, as PEFT names it on transformers 5, or 4.50.)
_KEY = re.compile(
    r"^base_model\.model\.(?:model\.(?:language_model\.)?|language_model\.model\.)layers\.(\d+)\."
    r"(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter cannot be loaded or used: the message says why."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with, as vLLM names it: ``lora_name`` is how requests refer to it (the served
    ``model`` name), ``lora_int_id`` a positive number unique among loaded adapters, ``lora_path`` a directory
    with PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise LoRAError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:
            raise LoRAError(f"LoRA adapter {self.lora_name!r}: lora_int_id must be positive, not {self.lora_int_id}")


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path``, or vLLM's JSON ``{"name": ..., "path": ...}``."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        text = text.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as e:
                raise LoRAError(f"--lora-modules: {text!r} is not JSON ({e})") from None
            if (
                not isinstance(spec, dict)
                or not isinstance(spec.get("name"), str)
                or not isinstance(spec.get("path"), str)
            ):
                raise LoRAError(f'--lora-modules: {text!r} must be {{"name": ..., "path": ...}}')
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = text.partition("=")
            if not sep:
                raise LoRAError(f"--lora-modules: {text!r} must be name=path")
        if not name or not path:
            raise LoRAError(f"--lora-modules: {text!r} needs both a name and a path")
        return cls(name, path)


@dataclass
class LoRAProjection:
    """An adapter's low-rank pair for one fused matrix: ``a`` [rank, in] and ``b`` [out, rank], the scale folded into
    ``b``. For the native CPU kernel (fp32 on the CPU), also ``b`` transposed and each rank column's nonzero rows of
    ``b`` (a fused ``b`` is block-diagonal): ``bt`` [rank, out] and ``spans`` [rank, 2]."""

    a: torch.Tensor
    b: torch.Tensor
    bt: torch.Tensor | None = None
    spans: torch.Tensor | None = None


@dataclass
class LoRAAdapter:
    """A loaded adapter: per layer, the pair of each fused target it changes (None where it changes nothing), on the
    model's device and in its dtype. ``digest`` identifies the weights: the KV it produces is named by it."""

    request: LoRARequest
    layers: list[tuple[LoRAProjection | None, ...]]
    digest: str


def _module_regex(key: str) -> str:
    """A ``rank_pattern``/``alpha_pattern`` key as PEFT matches it: against the end of a module's name."""
    return rf"(.*\.)?{key}$"


def _pattern_value(patterns: Mapping[str, float], module: str, default: float) -> float:
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: the first key that matches the end of the module's name
    (the keys are checked to be regular expressions when the config is read)."""
    for key, value in patterns.items():
        if re.match(_module_regex(key), module):
            return value
    return default


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_config_types(path: Path, config: dict) -> None:
    """The fields the loader reads hold what PEFT writes there, or a ``LoRAError`` says which does not."""
    for key in ("r", "lora_alpha"):
        if key in config and not _is_number(config[key]):
            raise LoRAError(f"LoRA adapter {path}: adapter_config.json's {key} must be a number, not {config[key]!r}")
    if "r" in config and config["r"] <= 0:  # (PEFT refuses it too; its default alpha, r, would scale by r / r)
        raise LoRAError(f"LoRA adapter {path}: adapter_config.json's r must be a positive number, not {config['r']!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise LoRAError(
                f"LoRA adapter {path}: adapter_config.json's {key} must be an object of module patterns to numbers, "
                f"not {patterns!r}"
            )
        for pattern, value in patterns.items():
            if not _is_number(value):
                raise LoRAError(
                    f"LoRA adapter {path}: adapter_config.json's {key}[{pattern!r}] must be a number, not {value!r}"
                )
            try:
                re.compile(_module_regex(pattern))
            except re.error as e:
                raise LoRAError(
                    f"LoRA adapter {path}: adapter_config.json's {key} key {pattern!r} is not a regular expression "
                    f"({e})"
                ) from None


def _read_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    try:
        if not config_file.is_file():
            raise LoRAError(f"LoRA adapter {path}: no adapter_config.json")
        config = json.loads(config_file.read_text())
    except OSError as e:
        raise LoRAError(f"LoRA adapter {path}: cannot read adapter_config.json ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise LoRAError(f"LoRA adapter {path}: adapter_config.json is not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise LoRAError(f"LoRA adapter {path}: adapter_config.json is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoRAError(
            f"LoRA adapter {path}: adapter_config.json must hold a JSON object, not {type(config).__name__} "
            f"{config!r:.40}"
        )
    _check_config_types(path, config)
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {path}: peft_type {config.get('peft_type')!r} is not LORA")
    refused = {
        "use_dora": "DoRA",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
        "modules_to_save": "modules_to_save (fully trained modules)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise LoRAError(f"LoRA adapter {path}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {path}: trained biases (bias={config['bias']!r}) are not supported")
    return config


def _read_weights(
    request: LoRARequest, weights_file: Path, arch: ModelArch
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The adapter's tensors by (layer, PEFT module) and side (``A``/``B``); a file safetensors cannot read is a
    ``LoRAError`` that says so."""
    from safetensors import SafetensorError, safe_open

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules = checkpoint_modules(arch)
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key.removeprefix("base_model.model.").startswith(NOT_TEXT_PREFIXES):  # (an all-linear adapter's)
                    continue
                match = _KEY.match(key)
                if match is None or match.group(2) not in modules:
                    raise LoRAError(
                        f"LoRA adapter {request.lora_name!r}: weight {key!r} is not LoRA on a layer's attention or "
                        f"MLP projections as this {arch.model_type} model names them ({', '.join(modules)})"
                    )
                layer, module, side = int(match.group(1)), match.group(2), match.group(3)
                if layer >= arch.num_layers:
                    raise LoRAError(
                        f"LoRA adapter {request.lora_name!r}: {key!r} is past the model's {arch.num_layers} layers"
                    )
                pairs.setdefault((layer, module), {})[side] = f.get_tensor(key)
    except SafetensorError as e:
        raise LoRAError(
            f"LoRA adapter {request.lora_name!r}: {weights_file.name} is not a readable safetensors file ({e})"
        ) from None
    except OSError as e:
        raise LoRAError(
            f"LoRA adapter {request.lora_name!r}: cannot read {weights_file.name} ({e.strerror or e})"
        ) from None
    return pairs


def _in_halves_order(b: torch.Tensor, module: str, arch: ModelArch) -> torch.Tensor:
    """An adapter's B (its shape checked) with its rows of q and of k in the rotate-half order the model holds
    those rows in (``ModelArch.rope_interleaved``, GLM-4's: ``rope.interleaved_to_halves``); v's and the rest as
    they are."""
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    spans = {"q_proj": [(0, q_size)], "k_proj": [(0, kv_size)], "qkv_proj": [(0, q_size), (q_size, q_size + kv_size)]}
    if module not in spans:
        return b
    b = b.clone()  # (B may be the file's tensor itself: float() of a float32 one is no copy)
    for start, end in spans[module]:
        b[start:end] = interleaved_to_halves(b[start:end], arch.head_dim, arch.rotary_dim)
    return b


def load_lora(
    request: LoRARequest,
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device,
    max_rank: int,
    tensor_parallel: TensorParallel = ONE_DEVICE,
    whole_arch: ModelArch | None = None,
) -> LoRAAdapter:
    """Read a PEFT LoRA checkpoint for a model of ``arch``; every error names the adapter and what is wrong: a
    malformed or unreadable checkpoint is a ``LoRAError``, never another exception.

    For rank ``tensor_parallel`` of a split model (``arch`` its share, ``whole_arch`` the model's): the rank's part of
    each projection's adapter, cut as its weight is (``tensor_parallel.shard_plan``): B's rows where the projection is
    split by rows (q/k/v, gate/up: its outputs are the rank's), A's columns where it is split by columns (o, down: its
    inputs are the rank's, and the ranks' partial products, the adapter's among them, are summed after)."""
    path = Path(request.lora_path).expanduser()
    try:
        is_dir = path.is_dir()
    except (OSError, ValueError) as e:  # a path the file system refuses: too long, a NUL, not encodable
        raise LoRAError(
            f"LoRA adapter {request.lora_name!r}: cannot use the path {request.lora_path!r} ({e})"
        ) from None
    if not is_dir:
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: {path} is not a directory")
    config = _read_config(path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: {path} has no adapter_model.safetensors")
    pairs = _read_weights(request, weights_file, arch)
    if tensor_parallel.size > 1:
        whole = whole_arch or arch
        for (layer, module), ab in pairs.items():
            side = "A" if module in ("o_proj", "down_proj") else "B"
            if side in ab:  # (its shape is checked against the rank's below)
                name = f"model.layers.{layer}.{module}.weight"  # (what shard_plan reads of a weight's name)
                plan = shard_plan(name, ab[side].shape, whole, tensor_parallel)
                if plan is not None and ab[side].dim() == 2:
                    ab[side] = plan.take(ab[side]).contiguous()
    if not pairs:
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: adapter_model.safetensors holds no LoRA weights")
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    out_sizes = {  # each part's rows within its fused matrix, and the input width
        "q_proj": (0, q_size, arch.hidden_size),
        "k_proj": (q_size, kv_size, arch.hidden_size),
        "v_proj": (q_size + kv_size, kv_size, arch.hidden_size),
        "o_proj": (0, arch.hidden_size, q_size),
        "gate_proj": (0, arch.intermediate_size, arch.hidden_size),
        "up_proj": (arch.intermediate_size, arch.intermediate_size, arch.hidden_size),
        "down_proj": (0, arch.hidden_size, arch.intermediate_size),
        "qkv_proj": (0, q_size + 2 * kv_size, arch.hidden_size),
        "gate_up_proj": (0, 2 * arch.intermediate_size, arch.hidden_size),
    }
    fused_out = {
        QKV: q_size + 2 * kv_size,
        O_PROJ: arch.hidden_size,
        GATE_UP: 2 * arch.intermediate_size,
        DOWN: arch.hidden_size,
    }
    alpha = float(config.get("lora_alpha", 8))  # (PEFT's LoraConfig default when the file names none)
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))
    # Per layer and fused target: the parts (A, scaled B, row offset) to fuse.
    parts: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        # (Its name in the model, block and all, as PEFT matches alpha_pattern's keys against it: "self_attn.v_proj".)
        block = "self_attn" if _PROJECTIONS[module] in (QKV, O_PROJ) else "mlp"
        name = f"model.layers.{layer}.{block}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {request.lora_name!r}: {name} lacks lora_{'B' if 'A' in ab else 'A'}")
        if layer in arch.sparse_layers and _PROJECTIONS[module] in (GATE_UP, DOWN):
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r}: {name} is a mixture-of-experts layer's MLP; adapters of the "
                "experts are not supported (the attention's are)"
            )
        a, b = ab["A"].float(), ab["B"].float()
        start, rows, cols = out_sizes[module]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != cols or b.shape != (rows, r):
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r}: {name} has A {tuple(a.shape)} and B {tuple(b.shape)}; this "
                f"model needs A [rank, {cols}] and B [{rows}, rank]"
            )
        if arch.rope_interleaved:
            b = _in_halves_order(b, module, arch)
        if r == 0:  # (its scale alpha / r would divide by zero: a 500 where the adapter is at fault)
            raise LoRAError(f"LoRA adapter {request.lora_name!r}: {name} has rank 0 (A {tuple(a.shape)})")
        if r > max_rank:
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r}: rank {r} of {name} exceeds --max-lora-rank {max_rank}"
            )
        module_alpha = _pattern_value(alpha_pattern, name, alpha)
        scale = module_alpha / math.sqrt(r) if rslora else module_alpha / r
        # In the model's type, scaled, as the adapter runs (B of 1e5 is inf in fp16): loaded, values that are not
        # finite made NaN logits, and a sampled row's draw failed the whole step, the base model's requests with it.
        scaled = b * scale
        if not (bool(torch.isfinite(a.to(dtype)).all()) and bool(torch.isfinite(scaled.to(dtype)).all())):
            raise LoRAError(
                f"LoRA adapter {request.lora_name!r}: {name} holds values that are not finite (NaN or inf) once scaled "
                f"by lora_alpha / r and in {str(dtype).removeprefix('torch.')}"
            )
        target = _PROJECTIONS[module]
        parts.setdefault((layer, target), []).append((a, scaled, start))
    layers: list[list[LoRAProjection | None]] = [[None, None, None, None] for _ in range(arch.num_layers)]
    for (layer, target), group in parts.items():
        a_cat = torch.cat([a for a, _, _ in group])
        b_fused = torch.zeros(fused_out[target], a_cat.shape[0])
        spans = torch.zeros(a_cat.shape[0], 2, dtype=torch.long)
        col = 0
        for a, b, start in group:
            b_fused[start : start + b.shape[0], col : col + a.shape[0]] = b
            spans[col : col + a.shape[0]] = torch.tensor([start, start + b.shape[0]])
            col += a.shape[0]
        proj = LoRAProjection(a_cat.to(device, dtype).contiguous(), b_fused.to(device, dtype).contiguous())
        if cpu_kernels.usable(proj.a) and proj.a.shape[0] <= cpu_kernels.LORA_MAX_RANK:
            proj.bt, proj.spans = proj.b.t().contiguous(), spans
        layers[layer][target] = proj
    digest = hashlib.sha256()
    try:
        digest.update((path / "adapter_config.json").read_bytes())
        with weights_file.open("rb") as f:
            for piece in iter(lambda: f.read(1 << 20), b""):
                digest.update(piece)
    except OSError as e:
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: cannot read {path} ({e.strerror or e})") from None
    return LoRAAdapter(request, [tuple(layer) for layer in layers], digest.hexdigest()[:16])


class LoRABatch:
    """The adapters of one forward pass and the rows (flat-batch tokens) each applies to, a pair of matmuls each.

    ``groups``: pairs of an adapter and its rows, a slice when they are one run (the usual case: a request's tokens
    are consecutive), else an index tensor."""

    def __init__(self, groups: Sequence[tuple[LoRAAdapter, slice | torch.Tensor]]) -> None:
        self.groups = list(groups)

    def touches(self, layer: int, target: int) -> bool:
        """Whether an adapter of the batch changes that fused matrix of that layer."""
        return any(adapter.layers[layer][target] is not None for adapter, _ in self.groups)

    def add_(self, layer: int, target: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[rows] += (x[rows] @ A.T) @ B.T`` for each adapter's rows (``out`` may be a view); returns ``out``."""
        native = x.dtype == torch.float32 and x.stride(-1) == 1 and out.stride(-1) == 1
        for adapter, rows in self.groups:
            proj = adapter.layers[layer][target]
            if proj is None:
                continue
            if native and proj.bt is not None and proj.spans is not None:  # (set together)
                cpu_kernels.lora_add_(x, rows, proj.a, proj.bt, proj.spans, out)
                continue
            a, b = proj.a, proj.b
            if isinstance(rows, slice):
                out[rows] += (x[rows] @ a.t()) @ b.t()
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return out


def lora_batch(
    adapters: Mapping[str, LoRAAdapter], rows_by_name: Mapping[str, Sequence[tuple[int, int]]], device: torch.device
) -> LoRABatch:
    """The batch's adapters from each adapter's runs of rows ``[start, end)`` (consecutive runs merged)."""
    groups: list[tuple[LoRAAdapter, slice | torch.Tensor]] = []
    for name, runs in rows_by_name.items():
        merged: list[list[int]] = []
        for start, end in sorted(runs):
            if merged and merged[-1][1] == start:
                merged[-1][1] = end
            else:
                merged.append([start, end])
        if len(merged) == 1:
            groups.append((adapters[name], slice(merged[0][0], merged[0][1])))
        else:
            index = [i for start, end in merged for i in range(start, end)]
            groups.append((adapters[name], torch.tensor(index, dtype=torch.long, device=device)))
    return LoRABatch(groups)
