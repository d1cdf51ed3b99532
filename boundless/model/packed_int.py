"""Integer weight-only checkpoints, GPTQ's and AWQ's: each layer's weights in a few bits, packed into int32, with a
scale and a zero point per group of input features, brought back to floats as they stream in.

A linear layer ``W`` of ``in`` inputs and ``out`` outputs is stored as three or four tensors (``W.qweight``,
``W.qzeros``, ``W.scales``, and GPTQ's ``W.g_idx``), and its weight is, for input ``i`` of group ``g(i)``::

    weight[o, i] = (q[i, o] - z[g(i), o]) * s[g(i), o]

- **GPTQ** (``quant_method: gptq``; AutoGPTQ's and GPTQModel's checkpoints, ``TheBloke/*-GPTQ``): ``qweight`` is
  ``[in * bits / 32, out]``, each int32 holding ``32 / bits`` consecutive inputs of one output, the first in the
  lowest bits; ``qzeros`` is ``[groups, out * bits / 32]``, packed along the outputs alike; ``scales`` is ``[groups,
  out]``. The ``gptq`` checkpoint format (v1, the common one) stores each zero point less one; ``gptq_v2`` stores it as
  it is. A group is ``group_size`` consecutive inputs (-1: all of them), or with ``desc_act`` (act-order) the one
  ``g_idx[i]`` names. 2, 4 and 8 bits.
- **AWQ** (``quant_method: awq``, ``version: gemm``; AutoAWQ's, ``*-AWQ``): ``qweight`` is ``[in, out * bits / 32]``
  and ``qzeros`` ``[groups, out * bits / 32]``, each int32 holding 8 outputs of one input in AWQ's interleaved order
  (its ``j``-th four bits hold output ``[0, 2, 4, 6, 1, 3, 5, 7][j]`` of the 8); ``scales`` is ``[groups, out]``.
  4 bits, with zero points.

AutoGPTQ saves a bias beside every layer it packs, zeros where the model has none (Llama's): the model skips a zero
bias it has no place for. The layers come back in fp32 (the loader casts them to the model's type): the model then
runs as the unquantized one would on these weights, holding them whole; or, the layers ``keep`` names (a model's
dense matrices on a GPU: ``LlamaModel.hold_int``), in their 4 or 8 bits as
:class:`~boundless.model.int_stack.IntStack` holds them (``held``). Checked against AutoAWQ's
``dequantize_gemm`` and AutoGPTQ's CPU forward (``tests/model/test_packed_int.py``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from boundless.config import ConfigError
from boundless.model.int_stack import IntStack
from boundless.model.llama import HeldWeightMismatch

_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each four bits of an AWQ int32 hold, by position
_AWQ_UNDO = tuple(_AWQ_ORDER.index(c) for c in range(8))  # the position of each output


@dataclass(frozen=True)
class PackedIntCheckpoint:
    """How a GPTQ or AWQ checkpoint packs its layers (see the module docstring)."""

    method: str  # gptq or awq
    bits: int
    group_size: int  # inputs a group (-1: all)
    zero_offset: int = 0  # added to each stored zero point (1: GPTQ's v1 format)
    act_order: bool = False  # GPTQ's desc_act: each input's group is g_idx's
    # Every layer's matrices packed alike: no per-module overrides, and none of them left unquantized (AWQ's
    # ``modules_to_not_convert`` naming only heads and routers). Only then are they held in their bits (:meth:`holds`).
    uniform: bool = True
    # GPTQModel's ``dynamic``: (pattern, overrides) in the config's order. A module whose checkpoint name the first
    # matching pattern matches (``re.match``) is packed with the overrides (bits, group_size, desc_act), or, for a
    # pattern written ``-:…``, left unquantized: vLLM's rule, which matches its own fused modules' names (qkv_proj);
    # here each packed module's own, as GPTQModel packed it (q_proj).
    dynamic: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

    @staticmethod
    def of(method: str, quant: Mapping[str, Any]) -> PackedIntCheckpoint:
        """From a ``config.json``'s ``quantization_config`` of ``method`` (gptq or awq); what does not load is a
        ConfigError saying what does."""
        bits = int(quant.get("bits", quant.get("w_bit", 4)))
        group_size = int(quant.get("group_size", quant.get("q_group_size", -1)))
        _check_group(method, group_size)
        if method == "awq":
            version = str(quant.get("version", "gemm")).lower()
            if version != "gemm" or bits != 4 or not quant.get("zero_point", True):
                raise ConfigError(
                    f"this AWQ checkpoint ({bits}-bit, version {version!r}, zero_point {quant.get('zero_point')}) "
                    "does not load here: 4-bit GEMM ones with zero points do"
                )
            return PackedIntCheckpoint("awq", bits, group_size)
        form = "marlin" if quant.get("is_marlin_format") else str(quant.get("checkpoint_format", "gptq")).lower()
        if form not in ("gptq", "gptq_v2"):
            raise ConfigError(f"this GPTQ checkpoint's format {form!r} does not load here: gptq and gptq_v2 do")
        _check_bits(bits)
        dynamic = _dynamic(quant.get("dynamic"))
        offset = 1 if form == "gptq" else 0
        return PackedIntCheckpoint("gptq", bits, group_size, offset, bool(quant.get("desc_act")), not dynamic, dynamic)

    def of_layer(self, layer: str) -> PackedIntCheckpoint | None:
        """How the module ``layer`` (a checkpoint name: ``model.layers.3.mlp.down_proj``) is packed: this, or what
        the first ``dynamic`` pattern that matches it overrides; None where that pattern leaves it unquantized."""
        for pattern, overrides in self.dynamic:
            if not re.match(pattern.removeprefix("-:").removeprefix("+:"), layer):
                continue
            if pattern.startswith("-:"):
                return None
            values = dict(overrides)
            bits, group = int(values.get("bits", self.bits)), int(values.get("group_size", self.group_size))
            act_order = bool(values.get("desc_act", self.act_order))
            return dataclasses.replace(self, bits=bits, group_size=group, act_order=act_order, dynamic=())
        return self

    def dequantized(
        self, weights: Iterator[tuple[str, torch.Tensor]], keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` with each packed layer's parts replaced by its weight (fp32, ``[out, in]``), as soon as its
        parts have come (they may lie in different files, in any order). Other tensors pass as they are. A layer
        whose weight ``keep`` names comes held instead (:meth:`held`): ``NAME.weight`` its codes, beside them
        ``NAME.weight_scale`` and ``NAME.weight_zero`` (and under act-order ``NAME.weight_perm``, the order its
        inputs are held in)."""
        waiting: dict[str, dict[str, torch.Tensor]] = {}
        done: set[str] = set()
        for name, tensor in weights:
            part = next((p for p in _PARTS if name.endswith(p)), None)
            if part is None:
                yield name, tensor
                continue
            layer = name.removesuffix(part)
            if layer in done:  # (a g_idx after its layer was made: groups were by position)
                continue
            packing = self.of_layer(layer)
            if packing is None:
                raise ConfigError(f"{layer}: packed, where the checkpoint's dynamic settings leave it unquantized")
            parts = waiting.setdefault(layer, {})
            parts[part] = tensor
            if packing.parts_needed() <= parts.keys():
                del waiting[layer]
                done.add(layer)
                if keep is not None and keep(layer + ".weight"):
                    matrix, perm = packing.held(layer, parts)
                    yield layer + ".weight", matrix.codes[0]
                    yield layer + ".weight_scale", matrix.scales[0]
                    yield layer + ".weight_zero", matrix.zeros[0]
                    if perm is not None:
                        yield layer + ".weight_perm", perm
                else:
                    yield layer + ".weight", packing.weight(layer, parts)
        missing = {layer: sorted(self._needed_by(layer) - parts.keys()) for layer, parts in waiting.items()}
        if missing:
            raise ValueError(f"packed layers without all their parts: {dict(list(missing.items())[:3])}")

    def parts_needed(self) -> set[str]:
        """The tensors a layer packed so is made from (g_idx under act-order only: GPTQ saves it either way)."""
        return {".qweight", ".qzeros", ".scales"} | ({".g_idx"} if self.act_order else set())

    def _needed_by(self, layer: str) -> set[str]:
        packing = self.of_layer(layer)
        return packing.parts_needed() if packing is not None else set()

    def weight(self, layer: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One layer's weight, ``[out, in]`` in fp32, from its parts."""
        scales = parts[".scales"].to(torch.float32)
        if self.method == "awq":
            q = _awq_outputs(_unpack(parts[".qweight"], self.bits, dim=1))
            zeros = _awq_outputs(_unpack(parts[".qzeros"], self.bits, dim=1))
        else:
            q = _unpack(parts[".qweight"], self.bits, dim=0)
            zeros = (_unpack(parts[".qzeros"], self.bits, dim=1) + self.zero_offset) & ((1 << self.bits) - 1)
        inputs, outputs = q.shape
        if scales.shape[1] != outputs or zeros.shape != scales.shape:
            raise ValueError(
                f"{layer}: packed weights of {inputs} x {outputs} with scales {tuple(scales.shape)} and zero points "
                f"{tuple(zeros.shape)}"
            )
        groups = self._groups(layer, inputs, scales.shape[0], parts.get(".g_idx"))
        w = (q - zeros[groups]).to(torch.float32) * scales[groups]
        return w.t().contiguous()

    def holds(self, inputs: list[int], experts: bool = False) -> bool:
        """Whether matrices of these input widths can be held in their bits (:meth:`held`): 4 or 8 bits, each width a
        whole number of groups; in 4 bits groups of an even size (a byte's two inputs in one group: the kernel reads
        one scale a byte). A mixture's ``experts`` not under act-order (each expert's inputs in an order of its own).
        Not a checkpoint whose layers are packed in more than one way, or some left unquantized (``uniform``)."""
        size = self.group_size
        if self.bits not in (4, 8) or (self.bits == 4 and size != -1 and size % 2) or (experts and self.act_order):
            return False
        if not self.uniform:
            return False
        return size == -1 or all(n % size == 0 for n in inputs)

    def held(self, layer: str, parts: Mapping[str, torch.Tensor]) -> tuple[IntStack, torch.Tensor | None]:
        """One layer held in its bits: codes ``[out, in * bits / 8]`` (GPTQ's int32s transposed are these bytes;
        AWQ's outputs are put in order and their inputs paired), its scales and zero points ``[out, groups]``; the
        same weights :meth:`weight` makes (:meth:`IntStack.dequantized`), as a stack of one.

        Under act-order (GPTQ's ``desc_act``: input ``i`` in group ``g_idx[i]``), with the order its inputs are held
        in (int32 ``[in]``; else None): sorted by group (stably), so that each group's inputs lie together as the
        kernel reads them; the product then takes ``x[:, perm]`` (vLLM's GPTQ kernels reorder so too). Each group
        must hold ``group_size`` inputs, as GPTQ's do."""
        scales = parts[".scales"]
        mask = (1 << self.bits) - 1
        if self.method == "awq":
            codes = _pack_inputs(_awq_outputs(_unpack(parts[".qweight"], self.bits, dim=1)).t(), self.bits)
            zeros = _awq_outputs(_unpack(parts[".qzeros"], self.bits, dim=1))
        else:
            codes = parts[".qweight"].to(torch.int32).t().contiguous().view(torch.uint8)
            zeros = (_unpack(parts[".qzeros"], self.bits, dim=1) + self.zero_offset) & mask
        outputs, inputs = codes.shape[0], codes.shape[1] * 8 // self.bits
        if scales.shape[1] != outputs or zeros.shape != scales.shape:
            raise ValueError(
                f"{layer}: packed weights of {inputs} x {outputs} with scales {tuple(scales.shape)} and zero points "
                f"{tuple(zeros.shape)}"
            )
        groups = self._groups(layer, inputs, scales.shape[0], parts.get(".g_idx"))  # (within the scales)
        group = inputs if self.group_size == -1 else self.group_size
        perm = None
        if self.act_order:
            order = torch.argsort(groups, stable=True)
            if not torch.equal(groups[order], torch.arange(inputs, device=groups.device) // group):
                raise HeldWeightMismatch(f"{layer}: its g_idx gives groups of other sizes than {group} inputs")
            codes = _pack_inputs(_unpack_inputs(codes, self.bits)[:, order], self.bits)
            perm = order.to(torch.int32)
        scales, zeros = scales.t().float().contiguous(), zeros.t().to(torch.uint8).contiguous()
        return IntStack(codes.contiguous()[None], scales[None], zeros[None], self.bits, group), perm

    def _groups(self, layer: str, inputs: int, num_groups: int, g_idx: torch.Tensor | None) -> torch.Tensor:
        """Each input's group: g_idx's under act-order, else by position."""
        if self.act_order:
            assert g_idx is not None
            groups = g_idx.to(torch.long)
        else:
            size = inputs if self.group_size == -1 else self.group_size
            groups = torch.arange(inputs) // size
        if groups.shape != (inputs,) or int(groups.max()) >= num_groups or int(groups.min()) < 0:
            raise ValueError(f"{layer}: {inputs} inputs' groups do not fall in its {num_groups} groups of scales")
        return groups


def _check_group(method: str, group_size: int) -> None:
    if group_size == 0 or group_size < -1:
        raise ConfigError(f"this {method} checkpoint's group_size {group_size} is not a group of inputs")


def _check_bits(bits: int) -> None:
    if bits not in (2, 4, 8):
        raise ConfigError(f"this GPTQ checkpoint's {bits}-bit weights do not load here: 2, 4 and 8-bit ones do")


def _dynamic(dynamic: object) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    """GPTQModel's ``dynamic`` setting, checked: patterns that compile, and overrides of bits and group_size that
    load. Of the overrides only bits, group_size and desc_act change how a module is stored; the rest are left
    (sym: zero points are stored either way), as vLLM leaves them."""
    if not dynamic:
        return ()
    if not isinstance(dynamic, Mapping):
        raise ConfigError(f"this GPTQ checkpoint's dynamic setting is not a map of patterns: {dynamic!r}")
    rules = []
    for pattern, overrides in dynamic.items():
        try:
            re.compile(str(pattern).removeprefix("-:").removeprefix("+:"))
        except re.error as e:
            raise ConfigError(f"this GPTQ checkpoint's dynamic pattern {pattern!r} is not a regex: {e}") from None
        if not isinstance(overrides, Mapping | None):
            raise ConfigError(f"this GPTQ checkpoint's dynamic pattern {pattern!r} gives {overrides!r}, not settings")
        overrides = {k: v for k, v in (overrides or {}).items() if k in ("bits", "group_size", "desc_act")}
        _check_bits(int(overrides.get("bits", 4)))
        _check_group("gptq", int(overrides.get("group_size", -1)))
        rules.append((str(pattern), tuple(sorted(overrides.items()))))
    return tuple(rules)


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The ``32 / bits`` values each int32 of ``packed`` holds, the first in the lowest bits, laid out along ``dim``
    (0: an int32 holds consecutive rows; 1: consecutive columns), as int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    packed = packed.to(torch.int32)
    if dim == 0:
        values = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
        return values.reshape(packed.shape[0] * shifts.numel(), packed.shape[1])
    values = (packed.unsqueeze(2) >> shifts.view(1, 1, -1)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], packed.shape[1] * shifts.numel())


def _unpack_inputs(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Held codes ``[out, in * bits / 8]`` as one value an input ``[out, in]`` (4 bits: the low nibble first)."""
    return codes if bits == 8 else torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)


def _pack_inputs(values: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`_unpack_inputs` undone."""
    values = values.to(torch.uint8)
    return values if bits == 8 else values[:, 0::2] | (values[:, 1::2] << 4)


def _awq_outputs(values: torch.Tensor) -> torch.Tensor:
    """AWQ's interleaved outputs (each 8 in ``_AWQ_ORDER``) in their own order."""
    rows, cols = values.shape
    return values.view(rows, cols // 8, 8)[:, :, list(_AWQ_UNDO)].reshape(rows, cols)
