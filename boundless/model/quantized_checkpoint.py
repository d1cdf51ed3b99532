"""Quantized checkpoints: which ones load, and their weights brought back to the model's type as they stream in.

A checkpoint says how it is quantized in ``config.json``'s ``quantization_config`` (older AutoAWQ and AutoGPTQ ones in a
``quant_config.json`` or ``quantize_config.json`` beside it). The FP8 ones load:

- ``quant_method: fp8`` (Qwen3-*-FP8, DeepSeek-V3's form; vLLM's own fp8 serialization): each quantized weight
  ``W.weight`` in float8 with ``W.weight_scale_inv``, one scale per block of ``weight_block_size`` (e.g. 128 x 128),
  or with ``W.weight_scale``, one for the tensor;
- ``quant_method: compressed-tensors`` with float weights (llm-compressor's FP8 models, the ``RedHatAI/*-FP8``
  ones): ``W.weight`` in float8 with ``W.weight_scale``, per tensor, per output channel or per block.

Each weight is dequantized as it arrives (``weight * scale``, the scale spread over its block) into the model's type;
activation scales (``input_scale``) and KV scales (``k_scale``, ``v_scale``) are dropped: the model then runs as the
unquantized one would on these weights, in its own type, and its KV in ``--kv-cache-dtype``'s. Or, on a GPU, the
weights are held as stored (the ``keep`` of :meth:`QuantizedCheckpoint.dequantized`: ``loader.quantized_dense_form``,
``quantized_experts_form``). Weights the
checkpoint left unquantized (its ``ignore`` list: often ``lm_head``) come as they are. GPTQ and AWQ checkpoints (integer
weights packed in int32) load through ``model/packed_int.py``, gpt-oss's MXFP4 ones through ``model/mxfp4.py``. Any
other method (bitsandbytes, integer
compressed-tensors) is refused in words; a GGUF file's quantized weights load as before.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from boundless.config import ConfigError
from boundless.model.mxfp4 import Mxfp4Checkpoint
from boundless.model.packed_int import PackedIntCheckpoint

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALES = (".weight_scale_inv", ".weight_scale")
_DROPPED = (".input_scale", ".k_scale", ".v_scale", ".kv_scale", ".output_scale")


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """How a checkpoint's weights are quantized: the method, and the block a scale covers (None: per tensor, per
    output channel or per group of inputs, as each scale's shape says; ``per_row``: not per group). ``uniform``: every
    quantized weight has the one scheme (quant_method fp8's; compressed-tensors' with one group that targets every
    linear layer), and the modules it leaves unquantized are none of a layer's attention or MLP matrices (``ignore``,
    ``modules_to_not_convert``, AutoFP8's ``ignored_layers``: ``lm_head`` usually), so its dense matrices may be held
    as stored (``loader.quantized_dense_form``)."""

    method: str
    block: tuple[int, int] | None = None
    uniform: bool = False
    per_row: bool = True  # (with no block: scales per tensor or per output channel, not per group of inputs)

    @staticmethod
    def of(
        config: Mapping[str, Any], directory: Path | None = None
    ) -> QuantizedCheckpoint | PackedIntCheckpoint | Mxfp4Checkpoint | None:
        """From a ``config.json`` (or, with none in it, from the file older AutoAWQ and AutoGPTQ releases wrote beside
        it in the model's ``directory``); None for an unquantized checkpoint, a :class:`PackedIntCheckpoint` for
        GPTQ's and AWQ's, an :class:`Mxfp4Checkpoint` for gpt-oss's. An unsupported method is a ConfigError."""
        quant = config.get("quantization_config") or (_sidecar_quantization(directory) if directory else None)
        if not quant:
            return None
        method = str(quant.get("quant_method", "")).lower()
        if method in ("gptq", "awq"):
            packed = PackedIntCheckpoint.of(method, quant)
            # (AWQ's modules left in 16 bits: a layer's matrix among them keeps the layers from being held.)
            layers = int(config.get("num_hidden_layers") or 1)
            uniform = packed.uniform and _awq_leaves_layers_quantized(quant.get("modules_to_not_convert"), layers)
            return dataclasses.replace(packed, uniform=uniform)
        if method == "mxfp4":
            if config.get("model_type") != "gpt_oss":  # (its layout is gpt-oss's stacked experts')
                raise ConfigError(
                    f"MXFP4 checkpoints load for gpt-oss only; this one is a {config.get('model_type')!r} model"
                )
            return Mxfp4Checkpoint()
        if method == "fp8":
            block = quant.get("weight_block_size")
            uniform = all(_leaves_layers_quantized(quant.get(k)) for k in ("modules_to_not_convert", "ignored_layers"))
            return QuantizedCheckpoint(method, (int(block[0]), int(block[1])) if block else None, uniform)
        if method == "compressed-tensors":
            groups = list((quant.get("config_groups") or {}).values())
            # (One group targeting every linear layer: the whole model in its one scheme.)
            uniform = len(groups) == 1 and groups[0].get("targets", ["Linear"]) == ["Linear"]
            uniform = uniform and _leaves_layers_quantized(quant.get("ignore"))
            per_row = all((g.get("weights") or {}).get("strategy") in ("tensor", "channel", None) for g in groups)
            return QuantizedCheckpoint(method, _compressed_tensors_block(quant), uniform, per_row)
        raise ConfigError(
            f"this checkpoint is quantized with {method or 'an unnamed method'!r}, which does not load here: FP8 "
            "checkpoints (quant_method fp8 or compressed-tensors' float weights), GPTQ, AWQ and MXFP4 ones, GGUF files "
            "and unquantized weights do"
        )

    def dequantized(
        self, weights: Iterator[tuple[str, torch.Tensor]], keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` with each quantized weight in fp32 (its scale applied) and the scales themselves gone. A
        weight and its scale may come in either order (they may lie in different files). A weight ``keep`` names
        (held as stored: a mixture's experts, ``SparseMoE.hold_fp8``; a model's dense matrices,
        ``LlamaModel.hold_fp8``) comes as it is, its scale beside it under ``NAME.weight_scale`` whatever the
        checkpoint calls it."""
        waiting: dict[str, torch.Tensor] = {}  # a quantized weight's name -> its weight, or its scale, seen first
        for name, tensor in weights:
            if name.endswith(_DROPPED):
                continue
            scale_of = next((name.removesuffix(s) for s in _SCALES if name.endswith(s)), None)
            if scale_of is None and tensor.dtype not in _FP8:
                yield name, tensor
                continue
            key = name if scale_of is None else scale_of + ".weight"
            if keep is not None and keep(key):
                yield (name, tensor) if scale_of is None else (key + "_scale", tensor.float())
                continue
            other = waiting.pop(key, None)
            if other is None:
                waiting[key] = tensor
                continue
            weight, scale = (tensor, other) if scale_of is None else (other, tensor)
            yield key, self.apply_scale(key, weight, scale)
        if waiting:
            raise ValueError(
                f"quantized weights without their scales (or scales without weights): {sorted(waiting)[:3]}"
            )

    def apply_scale(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``weight`` (float8, [out, in]) times its scale: one number, one per output row, or one per block."""
        w = weight.to(torch.float32)
        s = scale.to(torch.float32)
        if s.numel() == 1:
            return w * s.reshape(())
        if s.dim() == 2 and s.shape == (w.shape[0], 1):
            return w * s
        if s.dim() != 2:
            raise ValueError(f"{name}: a scale of shape {tuple(s.shape)} for a weight of {tuple(w.shape)}")
        rows, cols = self.block or (math.ceil(w.shape[0] / s.shape[0]), math.ceil(w.shape[1] / s.shape[1]))
        if (math.ceil(w.shape[0] / rows), math.ceil(w.shape[1] / cols)) != tuple(s.shape):
            raise ValueError(
                f"{name}: {tuple(s.shape)} scales do not cover a weight of {tuple(w.shape)} in blocks of {rows}x{cols}"
            )
        spread = s.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return w * spread[: w.shape[0], : w.shape[1]]


# The files older AutoAWQ and AutoGPTQ releases wrote their settings to, beside a config.json that says nothing of them
# (vLLM reads them too, with --quantization); each file's method, where its settings do not name one.
_SIDECARS = (("quant_config.json", "awq"), ("quantize_config.json", "gptq"))


def _sidecar_quantization(directory: Path) -> dict[str, Any] | None:
    """A model directory's quantization settings from AutoAWQ's ``quant_config.json`` (``w_bit``, ``q_group_size``,
    ``version``, ``zero_point``) or AutoGPTQ's ``quantize_config.json`` (``bits``, ``group_size``, ``desc_act``), with
    the method the file's name says when they name none; None when neither is there."""
    for name, method in _SIDECARS:
        path = directory / name
        if path.is_file():
            settings = json.loads(path.read_text())
            if not isinstance(settings, dict):
                raise ConfigError(f"{path}: quantization settings that are no JSON object")
            return {"quant_method": method, **settings}
    return None


# The modules a config may leave unquantized beside a layer's attention and MLP matrices: heads, embeddings, routers.
_NOT_DENSE = ("lm_head", "embed_tokens", "gate", "router", "shared_expert_gate")


def _leaves_layers_quantized(unquantized: object) -> bool:
    """Whether a config's list of the modules left unquantized names none of a layer's attention or MLP matrices:
    each entry's last name one of :data:`_NOT_DENSE`, or an expert's (a mixture's are held or not apart); a regex
    (``re:…``) only ``lm_head``'s."""
    if unquantized is None:
        return True
    if not isinstance(unquantized, list):
        return False
    for entry in map(str, unquantized):
        if entry.startswith("re:"):
            if entry.removeprefix("re:").strip(".*^$") != "lm_head":
                return False
        elif entry.rsplit(".", 1)[-1] not in _NOT_DENSE and "expert" not in entry:
            return False
    return True


# A layer's dense matrices as AutoAWQ and vLLM name them (vLLM: fused q/k/v and gate/up).
_DENSE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj", "mlp.down_proj")  # fmt: skip


def _awq_leaves_layers_quantized(unquantized: object, num_layers: int) -> bool:
    """Whether AWQ's ``modules_to_not_convert`` leaves every layer's attention and MLP matrices quantized: AutoAWQ and
    vLLM leave a module unquantized if any entry is a part of its name (``mlp.gate`` is of ``mlp.gate_proj``'s)."""
    if unquantized is None:
        return True
    if not isinstance(unquantized, list):
        return False
    names = [f"model.layers.{i}.{m}" for i in range(num_layers) for m in _DENSE]
    return not any(str(entry) in name for entry in unquantized for name in names)


def _compressed_tensors_block(quant: Mapping[str, Any]) -> tuple[int, int] | None:
    """A compressed-tensors config's weight blocks, refusing what is not float weights."""
    groups = quant.get("config_groups") or {}
    block = None
    for group in groups.values():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
            raise ConfigError(
                f"this checkpoint's compressed-tensors weights are {weights.get('num_bits')}-bit "
                f"{weights.get('type')!r}, which do not load here: 8-bit float (FP8) weights do"
            )
        if weights.get("strategy") == "block" and weights.get("block_structure"):
            rows, cols = weights["block_structure"]
            block = (int(rows), int(cols))
    if str(quant.get("format", "float-quantized")) not in ("float-quantized", "naive-quantized"):
        raise ConfigError(
            f"compressed-tensors' {quant.get('format')!r} format does not load here: float-quantized does"
        )
    return block
