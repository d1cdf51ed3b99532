"""Shared fixtures: models loaded once per session (loading is the slow part of most tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter (set before anything imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Where the shared models load: BOUNDLESS_TEST_DEVICE=cuda runs the reference tests on a GPU.
TEST_DEVICE = os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu")

from boundless.model.loader import LoadedModel, load_model  # noqa: E402 (after TRITON_INTERPRET)
from boundless.model.random_model import TinySpec, write_random_model  # noqa: E402

# `make test` runs the tests in two processes (pytest-xdist's workers): each takes its share of the cores, and so do
# the servers and engines its tests start in processes of their own (OMP_NUM_THREADS, inherited; a Ray cluster's
# instances size themselves). Two OpenMP pools of every core each on the same cores spin against each other: the fast
# set took 400 s that way, against 250 s with a core each.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # (usable)
    _THREADS = max(1, _CORES // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)
else:
    torch.set_num_threads(max(1, torch.get_num_threads()))

TINY_SPECS = {
    # GQA and llama3 rope scaling (factor 8 over an original 64 positions, so the scaling bites).
    "tiny-llama": TinySpec(
        kind="llama",
        num_heads=4,
        num_kv_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # q/k/v biases, untied embeddings, no GQA.
    "tiny-qwen2": TinySpec(kind="qwen2", num_heads=4, num_kv_heads=4, seed=1),
    # Qwen3: a norm over each q and k head before RoPE, no biases, heads wider than hidden / heads, GQA.
    "tiny-qwen3": TinySpec(kind="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, seed=2),
    # Qwen3-MoE: 8 experts, 2 a token, layers 0 and 2 sparse and layer 1 dense (mlp_only_layers).
    "tiny-qwen3-moe": TinySpec(
        kind="qwen3_moe", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, seed=3, mlp_only_layers=(1,)
    ),
    # Mixtral: Mistral with 8 experts (2 a token) in every layer, under their own names (w1, w3, w2).
    "tiny-mixtral": TinySpec(kind="mixtral", num_heads=4, num_kv_heads=2, seed=4),
    # Phi-3 (Phi-4): q/k/v and gate/up fused in the checkpoint itself.
    "tiny-phi3": TinySpec(kind="phi3", num_heads=4, num_kv_heads=2, seed=6),
    # Sliding windows (attention/backend.py): a Mistral's over every layer, 12 keys (most prompts run past it, and a
    # window ends inside a block); a Qwen2's from its second layer on (max_window_layers), 7 keys, GQA.
    "tiny-mistral-window": TinySpec(kind="mistral", num_heads=4, num_kv_heads=2, seed=8, sliding_window=12),
    "tiny-qwen2-window": TinySpec(
        kind="qwen2", num_layers=3, num_heads=4, num_kv_heads=2, seed=10, sliding_window=7, max_window_layers=1
    ),
    # Gemma 3: its four norms a layer (weights saved less one), GELU, scaled embeddings, one key/value head (as the 1B),
    # its softmax scale from query_pre_attn_scalar (24, not head_dim's 32, as the 27B's differs), a window of 10 keys
    # on layers 0 and 2 rotated on their own base (100), and layer 1 over the whole context on the global base with
    # linear scaling (the 4B's and larger's).
    "tiny-gemma3": TinySpec(
        kind="gemma3_text",
        num_layers=3,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        seed=11,
        tie_word_embeddings=True,
        sliding_window=10,
        sliding_window_pattern=2,
        local_rope_theta=100.0,
        query_pre_attn_scalar=24,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    ),
    # Gemma 2: Gemma 3's layer without its head norms, attention's scores capped at 20 and the logits at 5 (caps that
    # bite at these weights), a window of 9 on every other layer, one RoPE, a softmax scale not its head size's.
    "tiny-gemma2": TinySpec(
        kind="gemma2",
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        seed=12,
        tie_word_embeddings=True,
        sliding_window=9,
        query_pre_attn_scalar=24,
        attn_logit_softcap=20.0,
        final_logit_softcap=5.0,
    ),
    # Phi-4-mini: RoPE on the leading 3/4 of each head (partial_rotary_factor: 24 of 32 dimensions), LongRoPE's short
    # and long factors (one per rotated pair) over an original context of 48 positions (an engine whose context is
    # within it rotates by the short ones, a longer one by the long ones), tied embeddings, GQA.
    "tiny-phi4-mini": TinySpec(
        kind="phi3",
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        seed=14,
        tie_word_embeddings=True,
        partial_rotary_factor=0.75,
        max_position_embeddings=512,
        original_max_position_embeddings=48,
        rope_scaling={
            "type": "longrope",
            "short_factor": [round(1.0 + 0.08 * i, 2) for i in range(12)],
            "long_factor": [round(1.0 + 1.7 * i, 2) for i in range(12)],
        },
    ),
    # Granite 3: a Llama with µP's multipliers of the embeddings (12), of each product joining the residual stream
    # (0.22), the softmax scale itself (1/64, not head_dim's 1/4) and the logits' divisor (8); GQA. (Its embeddings
    # untied: tied, at these random weights, each answer would repeat the token before it.)
    "tiny-granite": TinySpec(
        kind="granite",
        num_heads=4,
        num_kv_heads=2,
        seed=15,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
    ),
    # GLM-4 (0414): q/k/v biases, gate/up fused in the checkpoint, four norms a layer (GLM-4's names) and RoPE on half
    # of each head rotating adjacent pairs (its q and k rows reordered as they load), GQA.
    "tiny-glm4": TinySpec(kind="glm4", num_heads=4, num_kv_heads=2, head_dim=32, seed=16, partial_rotary_factor=0.5),
    # gpt-oss: a sink logit per head, biases on q/k/v and o, every other layer a window of 8 (the first too), YaRN
    # (factor 32 over an original 64 positions, untruncated), 8 experts with biases, 2 a token, interleaved gate and up
    # clamped at 2 (transformers' 7 would rarely bite at these weights), GQA; and its experts as MXFP4 blocks.
    "tiny-gpt-oss": TinySpec(
        kind="gpt_oss", num_heads=4, num_kv_heads=2, head_dim=16, seed=17, sliding_window=8, swiglu_limit=2.0
    ),
    "tiny-gpt-oss-mxfp4": TinySpec(
        kind="gpt_oss",
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        seed=18,
        sliding_window=8,
        swiglu_limit=2.0,
        mxfp4=True,
    ),
    # SmolLM3: a Llama whose every 2nd layer has no RoPE (its 3 layers: the middle one), tied embeddings, GQA.
    "tiny-smollm3": TinySpec(
        kind="smollm3",
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        seed=19,
        tie_word_embeddings=True,
        no_rope_layer_interval=2,
    ),
    # GLM-4.5: its first layer dense, then 8 experts in 4 groups (2 chosen), 2 a token by sigmoid scores corrected for
    # the choice, weights scaled by 2.5, a shared expert beside them; q/k/v biases, head norms, RoPE on half of each
    # head (rotate half); its multi-token prediction layer saved after the decoder's, read by neither model.
    "tiny-glm4-moe": TinySpec(
        kind="glm4_moe",
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        partial_rotary_factor=0.5,
        moe_intermediate_size=32,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        seed=21,
    ),
    # Qwen3 with YaRN (factor 4 over an original 32 positions: most prompts run past it, where it interpolates).
    "tiny-qwen3-yarn": TinySpec(
        kind="qwen3",
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        seed=7,
        max_position_embeddings=128,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ),
}


@pytest.fixture
def parallel_native_kernels() -> Iterator[None]:
    """At least two threads for the test, whatever the process's share of the cores: the native CPU kernels' parallel
    loops (``omp parallel for``) run only with more than one, and a worker of ``make test`` has one core."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: write_random_model(root / name, spec) for name, spec in TINY_SPECS.items()}


@pytest.fixture(scope="session")
def load(model_dirs: dict[str, Path]) -> Callable[[str], LoadedModel]:
    """Load a model once per session by name: ``smollm2-135m`` or one of :data:`TINY_SPECS`."""
    loaded: dict[str, LoadedModel] = {}

    def get(name: str) -> LoadedModel:
        if name not in loaded:
            loaded[name] = load_model(name if name == "smollm2-135m" else str(model_dirs[name]), device=TEST_DEVICE)
        return loaded[name]

    return get


_GGUF_READERS: dict[tuple[str, str], Any] = {}


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within it, transformers' GGUF loading parses each file once and builds each tensor-name map once.

    transformers parses a GGUF file for the config and again for the weights (SmolLM2's 49,152-token vocabulary
    took 8.6 s each time here) and rebuilds ``gguf``'s tensor-name map for every module (397 times, 11.5 s);
    its tokenizer parses the file a third time. Both are pure functions of their arguments, and transformers
    imports them from ``gguf`` at call time, so sharing them changes nothing it makes (the weights are equal to
    the bit) and takes a third of the time. Without ``gguf`` (a GPU machine may lack it) there is no GGUF file to
    load, and nothing to share.
    """
    try:
        import gguf
    except ModuleNotFoundError:
        yield
        return

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = reader(path, mode)
        return _GGUF_READERS[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


@pytest.fixture(scope="session")
def gguf_parsed_once() -> Callable[[], AbstractContextManager[None]]:
    """:func:`_gguf_parsed_once`, for the tests that load transformers' side of a GGUF file themselves."""
    return _gguf_parsed_once


@pytest.fixture(scope="session")
def hf_model(load: Callable[[str], LoadedModel]) -> Callable[[str], Any]:
    """transformers' model of the same weights as ``load(name)``, made once a session (SmolLM2's dequantizes its GGUF
    file, ~12 s here with the file parsed once; the GGUF loader's test and the reference tests both compare with
    it)."""
    from boundless.bench.offline import load_hf_reference

    models: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in models:
            with _gguf_parsed_once():
                models[name] = load_hf_reference(load(name))
        return models[name]

    return get


@pytest.fixture(scope="session")
def smollm2(load: Callable[[str], LoadedModel]) -> LoadedModel:
    return load("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_llama(load: Callable[[str], LoadedModel]) -> LoadedModel:
    return load("tiny-llama")


class DictStore:
    """A KV store that keeps blocks by name in a dict: the disk store's interface (``kv.tiers.BlockStore``), in
    memory. It stands in where a test needs a disk tier until the persistent store (``kv/disk_store.py``, built
    on its own branch) lands; that store plugs in behind the same interface."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, torch.Tensor] = {}
        self.reads = 0
        self.aged: list[bytes] = []  # keys the engine asked to age (program-aware eviction), in order

    def contains(self, key: bytes) -> bool:
        return key in self.blocks

    def read(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        self.reads += 1
        return [self.blocks[k].clone() if k in self.blocks else None for k in keys]

    def write(self, keys: Sequence[bytes], blocks: torch.Tensor) -> int:
        for i, key in enumerate(keys):
            self.blocks[key] = blocks[:, :, :, i].clone()
        return len(keys)

    def age(self, keys: Sequence[bytes], seconds: float) -> int:
        self.aged.extend(keys)
        return sum(key in self.blocks for key in keys)

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.blocks)}


@pytest.fixture
def dict_store() -> type[DictStore]:
    """The class of :class:`DictStore` (a fixture, since test modules do not import conftest)."""
    return DictStore


class GatedStore:
    """A store (wrapping another) whose reads and writes wait until ``release`` is set: storage slower than the
    engine, for tests of what must not wait for it."""

    def __init__(self, base: DictStore) -> None:
        self.base = base
        self.release = threading.Event()

    def contains(self, key: bytes) -> bool:
        return self.base.contains(key)

    def read(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        self.release.wait(timeout=60)
        return self.base.read(keys)

    def write(self, keys: Sequence[bytes], blocks: torch.Tensor) -> int:
        self.release.wait(timeout=60)
        return self.base.write(keys, blocks)

    def age(self, keys: Sequence[bytes], seconds: float) -> int:
        return self.base.age(keys, seconds)

    def stats(self) -> dict[str, int]:
        return self.base.stats()


@pytest.fixture
def gated_store() -> type[GatedStore]:
    """The class of :class:`GatedStore`."""
    return GatedStore


def _make_unwritable(root: Path) -> Callable[[], None] | None:
    """Make ``root``'s tree unwritable (immutable as root, read-only otherwise); the undo, or None if we cannot."""
    tree = [root, *root.rglob("*")]
    if os.geteuid() == 0:
        if not shutil.which("chattr") or subprocess.run(["chattr", "-R", "+i", str(root)]).returncode:
            return None
    else:
        for p in tree:
            p.chmod(p.stat().st_mode & ~0o222)

    def undo() -> None:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-R", "-i", str(root)], check=True)
        else:
            for p in tree:
                p.chmod(p.stat().st_mode | 0o200)

    return undo


@pytest.fixture
def make_unwritable() -> Callable[[Path], Callable[[], None] | None]:
    """``make_unwritable(root)``: makes a directory tree unwritable; returns the undo, or None where it cannot."""
    return _make_unwritable


class HeldLink:
    """A storage link the test drives: reads cost nothing, and the parts of a layerwise load cross only when
    the test lets them (:meth:`let_through`), so what runs before the load has arrived is deterministic."""

    def __init__(self) -> None:
        self._allowed = 0
        self._changed = threading.Condition()
        self.parts_carried = 0

    def transfer(self, nbytes: int) -> None:
        pass

    def transfer_parts(self, sizes: Sequence[int], on_part: Callable[[int], None]) -> None:
        for i in range(len(sizes)):
            with self._changed:
                self._changed.wait_for(lambda: self._allowed > self.parts_carried, timeout=60)
                self.parts_carried += 1
            on_part(i)

    def let_through(self, parts: int) -> None:
        with self._changed:
            self._allowed += parts
            self._changed.notify_all()


@pytest.fixture
def held_link() -> type[HeldLink]:
    """The class of :class:`HeldLink`."""
    return HeldLink
