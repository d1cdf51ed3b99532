"""GPTQ and AWQ checkpoints (``model/packed_int.py``): a random model's linear weights quantized to a few bits a group
of inputs and packed as AutoGPTQ and AutoAWQ pack them load to exactly the weights they stand for; the bit order
is pinned by values AutoAWQ's ``dequantize_gemm`` gives (what does not load is refused in words:
``tests/model/test_quantized_checkpoint.py``).

The packers here follow the formats as AutoGPTQ's ``QuantLinear.pack`` and AutoAWQ's GEMM layout write them, one value
at a time (checked once against AutoAWQ 0.2.9's ``dequantize_gemm`` and AutoGPTQ 0.7.1's CPU forward: the same
weights, to the bit)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from model_files import greedy_tokens
from safetensors.torch import load_file, save_file

from boundless.attention import triton_paged
from boundless.config import ConfigError
from boundless.model.arch import ModelArch
from boundless.model.llama import HeldWeightMismatch
from boundless.model.loader import holds_quantized_dense, load_model, quantized_dense_form
from boundless.model.packed_int import PackedIntCheckpoint
from boundless.model.quantized_checkpoint import QuantizedCheckpoint
from boundless.model.random_model import TinySpec, write_random_model
from boundless.model.tensor_parallel import TensorParallel

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _pack_columns(values: np.ndarray, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[rows, cols] -> [rows, cols * bits / 32]: each int32 holds ``32 / bits`` consecutive columns, the first in the
    lowest bits (AWQ: its ``j``-th value is column ``order[j]`` of the 8)."""
    per = 32 // bits
    rows, cols = values.shape
    out = np.zeros((rows, cols // per), dtype=np.uint32)
    for r in range(rows):
        for k in range(cols // per):
            for j in range(per):
                out[r, k] |= np.uint32(int(values[r, k * per + (order[j] if order else j)]) << (bits * j))
    return torch.from_numpy(out.astype(np.int32))


def _pack_rows(values: np.ndarray, bits: int) -> torch.Tensor:
    """[rows, cols] -> [rows * bits / 32, cols]: each int32 holds ``32 / bits`` consecutive rows (GPTQ's qweight)."""
    return _pack_columns(values.T, bits).T.contiguous()


def _quantize(w: torch.Tensor, bits: int, group: int, g_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """``w`` [out, in] as integers q [in, out], zero points [groups, out] and scales [groups, out] (fp16), each group
    of inputs (``g_idx``) by its own min and max."""
    wt = w.t().double().numpy()
    top = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scales = np.empty((groups, wt.shape[1]))
    zeros = np.empty((groups, wt.shape[1]), dtype=np.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        scales[g] = np.maximum(hi - lo, 1e-6) / top
        zeros[g] = np.clip(np.round(-lo / scales[g]), 0, top)
    scales = torch.from_numpy(scales).half().double().numpy()  # (as stored)
    q = np.clip(np.round(wt / scales[g_idx] + zeros[g_idx]), 0, top).astype(np.int64)
    return q, zeros, torch.from_numpy(scales).half()


def _write(
    root: Path,
    method: str,
    bits: int = 4,
    act_order: bool = False,
    v2: bool = False,
    head: bool = False,
    spec: TinySpec | None = None,
    dynamic: dict[str, tuple[int, int] | None] | None = None,
) -> tuple[Path, Path]:
    """A random model (``spec``'s) written twice: packed as ``method`` packs it (with ``head``, its LM head too, as
    GPTQModel may), and its weights as the packed ones stand for them (fp32, no quantization_config). ``dynamic``:
    GPTQModel's per-module settings, a module's name that ends as a key's packed with that key's (bits, group size),
    or left in 16 bits (None), written into the config as patterns."""
    source = write_random_model(root / "source", spec or TinySpec(weight_std=0.3))
    packed, reference = root / method, root / "reference"
    for d in (packed, reference):
        shutil.copytree(source, d, dirs_exist_ok=True)
        (d / "model.safetensors").unlink()
    tensors, plain = {}, {}
    rng = np.random.default_rng(1)
    orders: dict[str, np.ndarray] = {}  # (act-order: one g_idx for the matrices of one input, as GPTQ makes them)
    for name, w in load_file(str(source / "model.safetensors")).items():
        packs = name.startswith("model.layers.") and name.endswith("_proj.weight")
        form = next((f for end, f in (dynamic or {}).items() if name.endswith(end + ".weight")), (bits, 16))
        if not (packs or (head and name == "lm_head.weight")) or form is None:
            tensors[name] = plain[name] = w
            continue
        width, group = form
        g_idx = np.arange(w.shape[1]) // group
        if act_order:  # (act-order: the groups follow the inputs' order of importance, not their positions)
            shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            g_idx = orders.setdefault(shared, rng.permutation(g_idx))
        q, zeros, scales = _quantize(w, width, group, g_idx)
        layer = name.removesuffix(".weight")
        if method == "awq":
            tensors[layer + ".qweight"] = _pack_columns(q, width, AWQ_ORDER)
            tensors[layer + ".qzeros"] = _pack_columns(zeros, width, AWQ_ORDER)
        else:
            tensors[layer + ".qweight"] = _pack_rows(q, width)
            stored = zeros if v2 else (zeros - 1) & ((1 << width) - 1)  # (v1 stores each zero point less one)
            tensors[layer + ".qzeros"] = _pack_columns(stored, width)
            tensors[layer + ".g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
            tensors[layer + ".bias"] = torch.zeros(w.shape[0], dtype=torch.float16)  # (AutoGPTQ's, Llama's layers too)
        tensors[layer + ".scales"] = scales
        plain[name] = torch.from_numpy((q - zeros[g_idx]) * scales.double().numpy()[g_idx]).t().float().contiguous()
    save_file(tensors, str(packed / "model.safetensors"))
    save_file(plain, str(reference / "model.safetensors"))
    quant = {"quant_method": method, "bits": bits, "group_size": 16}
    if method == "awq":
        quant |= {"version": "gemm", "zero_point": True}
    else:
        quant |= {"desc_act": act_order, "sym": False, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    if dynamic:  # (GPTQModel's patterns: ``+:`` packs the modules it matches otherwise, ``-:`` leaves them alone)
        rules = {
            end: ("-:", {}) if f is None else ("+:", {"bits": f[0], "group_size": f[1]}) for end, f in dynamic.items()
        }
        quant["dynamic"] = {f"{sign}.*\\.{re.escape(end)}$": rule for end, (sign, rule) in rules.items()}
    config = json.loads((source / "config.json").read_text())
    (packed / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return packed, reference


@pytest.mark.parametrize(
    ("method", "bits", "act_order", "v2", "head"),
    [
        ("awq", 4, False, False, False),
        ("gptq", 4, False, False, False),
        ("gptq", 4, True, False, False),
        ("gptq", 8, False, True, False),
        ("gptq", 4, False, False, True),
    ],
)
def test_a_packed_checkpoint_loads_as_the_weights_it_stands_for(
    tmp_path: Path, method: str, bits: int, act_order: bool, v2: bool, head: bool
) -> None:
    packed, reference = _write(tmp_path, method, bits, act_order, v2, head)
    got, want = load_model(str(packed)), load_model(str(reference))
    params, expected = dict(got.model.named_parameters()), dict(want.model.named_parameters())
    assert params.keys() == expected.keys()
    for name, p in params.items():
        assert torch.allclose(p, expected[name], rtol=0, atol=1e-6), name
    # (Quantized: the weights moved from the source's, by up to half a step of the group's scale.)
    source = load_model(str(tmp_path / "source"))
    assert not torch.allclose(source.model.layers[0].qkv_weight, got.model.layers[0].qkv_weight, atol=1e-3)


def test_gptqmodels_per_module_settings_are_read(tmp_path: Path) -> None:
    """GPTQModel's ``dynamic`` settings (a pattern of module names, and the bits and group size of the modules it
    matches, or ``-:`` for modules left unquantized), as vLLM reads them: a layer's down_proj in 8 bits, groups of
    32, and another's o_proj in 16 bits load as the weights they stand for (each was a shape error). A checkpoint so
    packed is not held in its bits: its fused matrices' parts could differ."""
    dynamic = {"1.mlp.down_proj": (8, 32), "0.self_attn.o_proj": None}
    packed, reference = _write(tmp_path, "gptq", dynamic=dynamic)
    got, want = load_model(str(packed)), load_model(str(reference))
    expected = dict(want.model.named_parameters())
    for name, p in got.model.named_parameters():
        assert torch.allclose(p, expected[name], rtol=0, atol=1e-6), name
    packing = QuantizedCheckpoint.of(json.loads((packed / "config.json").read_text()))
    assert isinstance(packing, PackedIntCheckpoint) and not packing.holds([64, 128])
    down = packing.of_layer("model.layers.1.mlp.down_proj")
    assert down is not None and (down.bits, down.group_size) == (8, 32)
    assert packing.of_layer("model.layers.0.self_attn.o_proj") is None
    other = packing.of_layer("model.layers.0.mlp.down_proj")  # (the config's bits and groups)
    assert other is not None and (other.bits, other.group_size) == (4, 16)
    with pytest.raises(ConfigError, match="dense matrices are held as stored only"):
        load_model(str(packed), quantized_dense=True)
    config = json.loads((packed / "config.json").read_text())
    rules = config["quantization_config"]["dynamic"]
    config["quantization_config"]["dynamic"] = {"+:.*(": {"bits": 8}}
    with pytest.raises(ConfigError, match="not a regex"):
        QuantizedCheckpoint.of(config)
    for bad, said in (({"+:.*": 8}, "gives 8, not settings"), ([".*"], "not a map of patterns")):
        config["quantization_config"]["dynamic"] = bad
        with pytest.raises(ConfigError, match=said):
            QuantizedCheckpoint.of(config)
    # Settings that do not change how a module is stored are left, as vLLM leaves them.
    config["quantization_config"]["dynamic"] = {k: {**v, "damp_percent": 0.1} for k, v in rules.items()}
    assert QuantizedCheckpoint.of(config) == packing
    # A module the settings leave unquantized but that comes packed is named.
    config["quantization_config"]["dynamic"] = {**rules, "-:.*layers\\.1\\.self_attn\\.q_proj$": {}}
    (packed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"layers\.1\.self_attn\.q_proj: packed, where"):
        load_model(str(packed))


@pytest.mark.parametrize(
    ("unquantized", "holds"),
    [
        (None, True),
        (["lm_head"], True),
        (["visual"], True),
        (["self_attn.o_proj"], False),
        (["mlp.gate"], False),  # (a part of mlp.gate_proj's name: AutoAWQ and vLLM leave gate_proj unquantized too)
        (["layers.1."], False),
    ],
)
def test_awq_modules_left_in_16_bits_keep_the_layers_from_being_held_only_if_they_are_a_layers(
    unquantized: list[str] | None, holds: bool
) -> None:
    """AWQ's ``modules_to_not_convert``: a head or a router left in 16 bits is no layer's matrix; an attention or MLP
    matrix left so keeps the layers' matrices from being held in their bits (read up front: not a failed load)."""
    quant = {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm", "zero_point": True}
    config = {"num_hidden_layers": 2, "quantization_config": {**quant, "modules_to_not_convert": unquantized}}
    packing = QuantizedCheckpoint.of(config)
    assert isinstance(packing, PackedIntCheckpoint) and packing.holds([64, 128]) == holds


def test_the_bit_order_is_autoawqs_and_autogptqs() -> None:
    """One int32 holding 0..7 in its eight four-bit fields, the first lowest: AWQ reads them as outputs
    0, 4, 1, 5, 2, 6, 3, 7 (AutoAWQ's dequantize_gemm gives these); GPTQ as inputs 0..7, less its zero point (v1:
    stored less one)."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    awq = PackedIntCheckpoint("awq", 4, 1)
    parts = {".qweight": word, ".qzeros": torch.zeros(1, 1, dtype=torch.int32), ".scales": torch.ones(1, 8)}
    assert awq.weight("w", parts).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    gptq = PackedIntCheckpoint("gptq", 4, -1, zero_offset=1)
    qweight = torch.cat([word, torch.zeros(1, 7, dtype=torch.int32)], dim=1)  # (8 inputs of output 0; 7 outputs more)
    zeros = torch.zeros(1, 1, dtype=torch.int32)  # (the 8 outputs' zero points, each stored 0: 1)
    parts = {".qweight": qweight, ".qzeros": zeros, ".scales": torch.full((1, 8), 0.5)}
    assert gptq.weight("w", parts)[0].tolist() == [(i - 1) * 0.5 for i in range(8)]


def test_a_layer_missing_a_part_is_named(tmp_path: Path) -> None:
    packed, _ = _write(tmp_path, "gptq")
    tensors = load_file(str(packed / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj"):
        load_model(str(packed))


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_settings_in_the_file_older_releases_wrote_beside_config_json_are_read(tmp_path: Path, method: str) -> None:
    """Older AutoAWQ releases kept their settings in ``quant_config.json`` (``w_bit``, ``q_group_size``, ``version``)
    and older AutoGPTQ ones in ``quantize_config.json``, with no ``quantization_config`` in ``config.json``: such a
    checkpoint was refused as an unexpected ``qweight``."""
    packed, reference = _write(tmp_path, method)
    config = json.loads((packed / "config.json").read_text())
    quant = config.pop("quantization_config")
    (packed / "config.json").write_text(json.dumps(config))
    if method == "awq":  # (AutoAWQ's names, and no method: the file's name says it)
        sidecar = {"zero_point": True, "q_group_size": quant["group_size"], "w_bit": quant["bits"], "version": "GEMM"}
        (packed / "quant_config.json").write_text(json.dumps(sidecar))
    else:
        sidecar = {k: v for k, v in quant.items() if k != "quant_method"}
        (packed / "quantize_config.json").write_text(json.dumps(sidecar))
    got, want = load_model(str(packed)), load_model(str(reference))
    expected = dict(want.model.named_parameters())
    for name, p in got.model.named_parameters():
        assert torch.allclose(p, expected[name], rtol=0, atol=1e-6), name
    (packed / ("quantize_config.json" if method == "gptq" else "quant_config.json")).write_text(
        json.dumps({**sidecar, "is_marlin_format": True} if method == "gptq" else {**sidecar, "version": "GEMV"})
    )
    with pytest.raises(ConfigError, match="does not load here"):
        load_model(str(packed))


# Held in their bits (``quantized_dense``: the default on a GPU with Triton, one rank): held_linear's products.
TEST_DEVICE = os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu")  # (conftest's)


@pytest.mark.parametrize(("method", "bits", "v2"), [("awq", 4, False), ("gptq", 4, False), ("gptq", 8, True)])
@pytest.mark.parametrize(
    "backend", ["auto", pytest.param("triton", marks=pytest.mark.slow if TEST_DEVICE == "cpu" else ())]
)
def test_a_packed_checkpoints_matrices_are_held_in_their_bits(
    tmp_path: Path, method: str, bits: int, v2: bool, backend: str
) -> None:
    """Every attention and MLP matrix held as its codes (a byte two 4-bit inputs, GPTQ's int32s transposed; AWQ's
    outputs put in order), scales and zero points a group, q's, k's and v's stacked as their rows are: a quarter of
    fp16's bytes in 4 bits; dequantized they are the weights the checkpoint stands for, and the engine gives the
    dequantized checkpoint's tokens (the native path dequantizes each matrix once as it packs it; the Triton kernel
    each tile in registers). Zero points moved by a 16th of the codes' range give other tokens."""
    packed, reference = _write(tmp_path, method, bits, v2=v2)
    held = load_model(str(packed), device=TEST_DEVICE, quantized_dense=True)
    plain = load_model(str(reference), device=TEST_DEVICE)
    for layer, want in zip(held.model.layers, plain.model.layers, strict=True):
        assert layer.int_form == (bits, 16)
        for name in ("qkv", "o", "gate_up", "down"):
            weight = getattr(want, f"{name}_weight")
            codes = getattr(layer, f"{name}_weight")
            assert codes.dtype == torch.uint8 and codes.shape == (weight.shape[0], weight.shape[1] * bits // 8)
            assert getattr(layer, f"{name}_scale").shape == (weight.shape[0], weight.shape[1] // 16)
            dense = layer.held_stack(name).dequantized(0, torch.float32)
            assert torch.allclose(dense, weight, rtol=0, atol=1e-6), name
    if backend == "triton" and not triton_paged.available(held.device):
        pytest.skip("triton unavailable")
    tokens = greedy_tokens(held, backend)
    assert tokens == greedy_tokens(plain, backend)
    with torch.no_grad():
        for layer in held.model.layers:
            layer.gate_up_zero.add_(1 << (bits - 3))  # (a 16th of the codes' range)
            layer.widened.clear()  # (the native path's packed copies, made again)
    assert greedy_tokens(held, backend) != tokens


@pytest.mark.parametrize(
    "backend", ["auto", pytest.param("triton", marks=pytest.mark.slow if TEST_DEVICE == "cpu" else ())]
)
def test_an_act_order_checkpoint_is_held_with_its_inputs_sorted_by_group(tmp_path: Path, backend: str) -> None:
    """GPTQ's act-order (``desc_act``: input ``i`` in group ``g_idx[i]``, q's, k's and v's one order, as GPTQ makes
    them from one input): each matrix's inputs held sorted by group, the order beside them; dequantized and put back
    in the checkpoint's order they are its weights, and the engine gives the dequantized checkpoint's tokens (each
    product takes its input in the held order). A checkpoint whose q and k order their inputs otherwise is read again
    dequantized (refused where holding was asked)."""
    packed, reference = _write(tmp_path, "gptq", act_order=True)
    held = load_model(str(packed), device=TEST_DEVICE, quantized_dense=True)
    plain = load_model(str(reference), device=TEST_DEVICE)
    layer, want = held.model.layers[1], plain.model.layers[1]
    for name in ("qkv", "o", "gate_up", "down"):
        perm = getattr(layer, f"{name}_perm").long()
        assert not torch.equal(perm.cpu(), torch.arange(perm.numel()))
        dense = layer.held_stack(name).dequantized(0, torch.float32)
        restored = torch.empty_like(dense)
        restored[:, perm] = dense
        assert torch.allclose(restored, getattr(want, f"{name}_weight"), rtol=0, atol=1e-6), name
    if backend == "triton" and not triton_paged.available(held.device):
        pytest.skip("triton unavailable")
    assert greedy_tokens(held, backend) == greedy_tokens(plain, backend)
    tensors = load_file(str(packed / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    k_groups = tensors[name].numpy()
    tensors[name] = torch.from_numpy(np.sort(k_groups))  # (k's order no longer q's)
    save_file(tensors, str(packed / "model.safetensors"))
    with pytest.raises(ConfigError, match="orders its inputs otherwise"):
        load_model(str(packed), quantized_dense=True)


@pytest.mark.parametrize(("method", "bits", "v2"), [("awq", 4, False), ("gptq", 4, False), ("gptq", 8, True)])
def test_each_tensor_parallel_rank_holds_its_share_of_the_codes(
    tmp_path: Path, method: str, bits: int, v2: bool
) -> None:
    """Over two ranks each rank holds its share of every matrix in its bits, cut once held (q/k/v's and gate/up's
    rows, o's and down's inputs with their groups' scales and zero points): dequantized, a rank's matrices are the
    rank's share of the checkpoint's weights as the dequantized load cuts them, so its products are that rank's."""
    packed, reference = _write(tmp_path, method, bits, v2=v2, spec=TinySpec(weight_std=0.3, num_kv_heads=2))
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        held = load_model(str(packed), device=TEST_DEVICE, quantized_dense=True, tensor_parallel=tp)
        plain = load_model(str(reference), device=TEST_DEVICE, tensor_parallel=tp)
        for layer, want in zip(held.model.layers, plain.model.layers, strict=True):
            assert layer.int_form == (bits, 16)
            for name in ("qkv", "o", "gate_up", "down"):
                weight = getattr(want, f"{name}_weight")
                assert getattr(layer, f"{name}_weight").shape == (weight.shape[0], weight.shape[1] * bits // 8)
                dense = layer.held_stack(name).dequantized(0, torch.float32)
                assert torch.allclose(dense, weight, rtol=0, atol=1e-6), (rank, name)


def test_which_packed_checkpoints_are_held_over_ranks() -> None:
    """A rank's share of o's and down's inputs must be whole groups (and whole bytes of codes); act-order's input
    order spans the shares, so it loads dequantized over ranks."""
    arch = ModelArch(
        model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    assert quantized_dense_form(PackedIntCheckpoint("gptq", 4, 16), arch, ranks=2) == "int"  # (o: 32, down: 48)
    assert quantized_dense_form(PackedIntCheckpoint("gptq", 4, 32), arch, ranks=2) is None  # (down's 48 inputs)
    assert quantized_dense_form(PackedIntCheckpoint("gptq", 4, 32), arch) == "int"  # (one rank: 96)
    assert quantized_dense_form(PackedIntCheckpoint("gptq", 4, 16, act_order=True), arch, ranks=2) is None
    assert quantized_dense_form(PackedIntCheckpoint("gptq", 4, -1), arch, ranks=2) == "int"
    cuda = torch.device("cuda")  # (the rule only: nothing runs there)
    assert holds_quantized_dense(None, "int", cuda, 2, torch.bfloat16) == (triton_paged.triton is not None)
    assert not holds_quantized_dense(None, "rows", cuda, 2, torch.bfloat16)  # (FP8 blocks: test_quantized_checkpoint)


def test_2_bit_checkpoints_are_not_held_in_their_bits(tmp_path: Path) -> None:
    """2-bit ones load dequantized, as do groups that do not divide the inputs; on the CPU nothing is held by
    default; a mixture's experts are not held under act-order (each expert's inputs in an order of its own)."""
    assert not PackedIntCheckpoint("gptq", 4, 16, act_order=True).holds([64], experts=True)
    assert PackedIntCheckpoint("gptq", 4, 16, act_order=True).holds([64])
    plain, _ = _write(tmp_path / "plain", "gptq")
    assert load_model(str(plain)).model.layers[0].int_form is None
    assert not PackedIntCheckpoint("gptq", 2, 16).holds([64]) and not PackedIntCheckpoint("gptq", 4, 48).holds([64])
    assert PackedIntCheckpoint("awq", 4, -1).holds([64, 96]) and PackedIntCheckpoint("gptq", 8, 32).holds([64, 96])
    # (In 4 bits a byte's two inputs read one group's scale: groups of an odd size are not held.)
    assert not PackedIntCheckpoint("gptq", 4, 3).holds([96]) and PackedIntCheckpoint("gptq", 8, 3).holds([96])


def test_act_order_groups_of_other_sizes_are_a_mismatch_read_again_dequantized() -> None:
    """A g_idx whose groups are not ``group_size`` inputs each cannot be held sorted by group: the loader's mismatch
    (a default load reads the checkpoint again, dequantized), not a failed load."""
    gptq = PackedIntCheckpoint("gptq", 4, 16, act_order=True)
    parts = {
        ".qweight": torch.zeros(4, 8, dtype=torch.int32),  # (32 inputs, 8 outputs)
        ".qzeros": torch.zeros(2, 1, dtype=torch.int32),
        ".scales": torch.ones(2, 8),
        ".g_idx": torch.tensor([0] * 20 + [1] * 12, dtype=torch.int32),
    }
    with pytest.raises(HeldWeightMismatch, match="groups of other sizes"):
        gptq.held("w", parts)
    assert gptq.weight("w", parts).shape == (8, 32)  # (dequantized it loads)


def test_a_layer_is_held_on_the_device_its_parts_come_on() -> None:
    """Weights drawn on a GPU (``bench gpu``'s) are unpacked there: no table of shifts left on the CPU (the meta
    device stands in for CUDA)."""
    parts = {
        ".qweight": torch.empty(8, 64, dtype=torch.int32, device="meta"),
        ".qzeros": torch.empty(4, 8, dtype=torch.int32, device="meta"),
        ".scales": torch.empty(4, 64, dtype=torch.float16, device="meta"),
    }
    for method in ("gptq", "awq"):
        layer = (
            dict(parts)
            if method == "gptq"
            else {**parts, ".qweight": torch.empty(64, 8, dtype=torch.int32, device="meta")}
        )
        held, _ = PackedIntCheckpoint(method, 4, 16).held("w", layer)
        assert held.codes.device.type == "meta" and held.shape == (1, 64, 64)


@pytest.mark.parametrize(
    "backend", ["auto", pytest.param("triton", marks=pytest.mark.slow if TEST_DEVICE == "cpu" else ())]
)
def test_a_packed_mixtures_experts_are_held_in_their_bits(tmp_path: Path, backend: str) -> None:
    """A GPTQ Qwen3-MoE (``*-GPTQ-Int4``): its experts held in their bits too (``quantized_experts``: gate's and up's
    codes, scales and zero points stacked a row each), dequantized the checkpoint's weights, and the engine gives the
    dequantized checkpoint's tokens (the native path packs each expert dequantized; the fused kernels, its codes)."""
    spec = TinySpec(kind="qwen3_moe", weight_std=0.3, seed=4)
    packed, reference = _write(tmp_path, "gptq", spec=spec)
    held = load_model(str(packed), device=TEST_DEVICE, quantized_experts=True, quantized_dense=True)
    plain = load_model(str(reference), device=TEST_DEVICE)
    moe, want = held.model.layers[0].moe, plain.model.layers[0].moe
    assert moe is not None and want is not None and moe.held == "int"
    assert moe.gate_up.dtype == torch.uint8 and moe.gate_up.shape == (8, 64, 64 // 2)
    assert moe.down_scale.shape == (8, 64, 32 // 16)
    for e in range(8):
        gate_up, down = moe.expert(e, torch.float32)
        assert torch.allclose(gate_up, want.gate_up[e], rtol=0, atol=1e-6)
        assert torch.allclose(down, want.down[e], rtol=0, atol=1e-6)
    assert held.model.layers[0].int_form == (4, 16)  # (the attention's matrices too)
    if backend == "triton" and not triton_paged.available(held.device):
        pytest.skip("triton unavailable")
    assert greedy_tokens(held, backend) == greedy_tokens(plain, backend)
