"""Architecture hyperparameters of a Llama-family decoder, read from the weights' own metadata."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "granite", "glm4",
    "gpt_oss", "smollm3", "glm4_moe",
)  # fmt: skip
# The architectures that norm each query and key head before RoPE (ModelArch.qk_norm), whatever the file format.
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe", "gemma3_text")
# Gemma's: its norms' weights are saved less one (the norm multiplies by 1 + weight), its attention's and MLP's
# outputs are normed too before they join the residual stream, and its embeddings are scaled by sqrt(hidden_size).
GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")
# Gemma's config defaults (transformers' Gemma2Config and Gemma3TextConfig): what a config that leaves a field out
# means (a multimodal Gemma 3's text_config leaves out most: google/gemma-3-4b-it's names 6 fields).
_GEMMA_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "bos_token_id": 2,
    "eos_token_id": 1,
}
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        **_GEMMA_DEFAULTS,
        "max_position_embeddings": 8192,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    # (Phi3Config's: a LongRoPE scaling's original context, where a config has none.)
    "phi3": {"original_max_position_embeddings": 4096},
    # (Glm4Config's: RoPE on half of each head, q/k/v biases, its head size, key/value heads and norms' epsilon.)
    "glm4": {
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "head_dim": 128,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1.5625e-07,
    },
    # (Glm4MoeConfig's: RoPE on half of each head, a shared expert beside 128 routed ones, 8 a token chosen by sigmoid
    # scores in one group, the first layer dense.)
    "glm4_moe": {
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "moe_intermediate_size": 1408,
        "num_experts_per_tok": 8,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
    },
    # (GptOssConfig's: YaRN over a 4,096-token original context to 131,072, every other layer a 128-token window from
    # the first, biases on every projection of attention.)
    "gpt_oss": {
        "torch_dtype": "bfloat16",  # (not GptOssConfig's: the Hub's configs name none, and its tensors are bfloat16)
        "num_local_experts": 128,
        "head_dim": 64,
        "num_key_value_heads": 8,
        "sliding_window": 128,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "max_position_embeddings": 131072,
        "num_experts_per_tok": 4,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
    # (SmolLM3Config's: tied embeddings.)
    "smollm3": {"tie_word_embeddings": True},
    "gemma3_text": {
        **_GEMMA_DEFAULTS,
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
    },
}
# Those whose activations overflow float16 (transformers' issue 36822 for Gemma 3; vLLM refuses float16 for them).
FLOAT16_UNSTABLE = GEMMA_ARCHITECTURES
# The MLPs' gate activations (a config's hidden_act, or Gemma's hidden_activation).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


ROPE_SCALINGS = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is ``default``, ``linear``, ``llama3`` or ``yarn``.

    YaRN (Qwen2.5's and Qwen3's long contexts): frequencies that turn fewer than ``beta_slow`` times over the original
    context are interpolated by ``factor``, those that turn more than ``beta_fast`` times are kept, and a ramp blends
    the band between; cos and sin are scaled by ``attention_factor`` (:func:`yarn_scaling` resolves it).

    LongRoPE (Phi-3's and Phi-4-mini's 128k contexts, :func:`longrope_scaling`): each frequency divided by its own
    factor, ``short_factor``'s or ``long_factor``'s (one per rotated pair), cos and sin scaled by ``attention_factor``.
    Which list an engine uses is vLLM's rule, ``rope.uses_long_factors``: the long one when its context is longer than
    ``original_max_position_embeddings``."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


# RopeScaling's fields of one kind: left out of a fingerprint unless the scaling is of that kind (models before them
# keep their blocks' names).
_KIND_FIELDS = {
    "yarn": ("beta_fast", "beta_slow", "attention_factor", "truncate"),
    "longrope": ("attention_factor", "short_factor", "long_factor"),
}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context ``factor`` times longer (the paper's Eq. 21, as transformers has it)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaling(
    factor: float | None,
    original_max_position_embeddings: int,
    max_position_embeddings: int,
    attention_factor: float | None = None,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    beta_fast: float | None = None,
    beta_slow: float | None = None,
    truncate: bool = True,
) -> RopeScaling:
    """A YaRN scaling from a config's values, as transformers reads them: without ``factor`` the ratio of the two
    context lengths, without ``attention_factor`` the mscale of the factor (or the ratio of the mscales of
    ``mscale`` and ``mscale_all_dim`` when both are given), betas 32 and 1 by default."""
    if factor is None:
        factor = max_position_embeddings / original_max_position_embeddings
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return RopeScaling(
        kind="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(original_max_position_embeddings),
        beta_fast=float(beta_fast or 32),
        beta_slow=float(beta_slow or 1),
        attention_factor=float(attention_factor),
        truncate=bool(truncate),
    )


def longrope_scaling(
    rope: dict[str, Any], original_max_position_embeddings: int | None, max_position_embeddings: int, pairs: int
) -> RopeScaling:
    """A LongRoPE scaling from a config's values, as transformers reads them: its ``short_factor`` and
    ``long_factor`` (``pairs`` each, one per rotated pair); the original context the config's own
    ``original_max_position_embeddings`` (else the model's); without ``factor`` the ratio of the two contexts, and
    without ``attention_factor`` ``sqrt(1 + ln(factor) / ln(original))`` (1 for a factor of 1 or less)."""
    original = int(original_max_position_embeddings or max_position_embeddings)

    def factors(name: str) -> tuple[float, ...]:
        values = rope.get(name)
        if not isinstance(values, list | tuple) or len(values) != pairs:
            raise ValueError(f"longrope's {name} must list {pairs} factors (one per rotated pair), not {values!r}")
        return tuple(float(v) for v in values)

    factor = float(rope.get("factor") or max_position_embeddings / original)
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        kind="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        short_factor=factors("short_factor"),
        long_factor=factors("long_factor"),
    )


@dataclass(frozen=True)
class ModelArch:
    """What the network looks like: enough to build it and to name its KV blocks.

    ``model_type`` is one of :data:`SUPPORTED_ARCHITECTURES`; Qwen2 differs from Llama only by
    q/k/v biases, Mistral only by its name (and an optional sliding window, see ``layer_window``), Qwen3 by an
    RMSNorm over each query and key head before RoPE (``qk_norm``) and no biases, Qwen3-MoE from Qwen3 by a sparse
    mixture of experts in place of the MLP of its ``sparse_layers`` (``num_experts``, each token's
    ``num_experts_per_tok``, each expert's ``moe_intermediate_size``; ``model/moe.py``), and Mixtral from Mistral the
    same way in every layer. Phi-3 (Phi-4) is a Llama whose checkpoint fuses q/k/v and gate/up as this model does.

    ``sliding_window``: the window of every layer but ``full_attention_layers`` (dense Qwen2's and Qwen3's first
    ``max_window_layers``, or those a config's ``layer_types`` names ``full_attention``), as transformers reads them.

    Gemma 2 and 3 (``gemma2``, ``gemma3_text``, :data:`GEMMA_ARCHITECTURES`): a GELU-gated MLP (``hidden_act``),
    norms after attention and after the MLP too (``sandwich_norms``), embeddings scaled by ``embedding_scale``, its
    sliding-window layers' RoPE on another base (``local_rope_theta``, unscaled), and its softmax scale
    ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5`` (``attention_scale``). Gemma 3 has Qwen3's
    head norms; Gemma 2 none, but caps attention's scaled scores and the logits, ``cap * tanh(x / cap)``
    (``attn_logit_softcap``, ``final_logit_softcap``), and every layer has one RoPE.

    Granite (IBM's Granite 3): a Llama with four multipliers, µP's: of the embeddings (``embedding_multiplier``), of
    attention's and the MLP's outputs before they join the residual stream (``residual_multiplier``), attention's
    softmax scale itself (``attention_multiplier``), and the logits divided by ``logits_scaling``.

    GLM-4 (``glm4``, the 0414 models): q/k/v biases, gate/up fused in its checkpoint (as Phi-3's), attention's and the
    MLP's outputs normed before they join the stream (``sandwich_norms``, plain RMSNorms), and RoPE on half of each
    head, rotating adjacent pairs (``rope_interleaved``: its q and k rows are reordered as they load so that the
    rotate-half kernels serve it).

    gpt-oss (``gpt_oss``, OpenAI's): biases on q/k/v and on o (``o_bias``), a learned logit per query head that takes
    its share of each softmax and adds nothing to the output (``attention_sinks``), every other layer a sliding
    window, and in every layer a mixture of experts whose router and experts have biases and whose activation is a
    clamped SwiGLU (``(clamp(up, ±limit) + 1) * g * sigmoid(alpha g)`` for ``g = min(gate, limit)``,
    ``swiglu_limit`` and ``swiglu_alpha``); its norms keep their weights in fp32 and round after them, as Gemma's.

    SmolLM3 (``smollm3``): a Llama whose ``nope_layers`` rotate nothing (no positional encoding there: every 4th
    layer, or as its config's ``no_rope_layers`` says).

    GLM-4.5 and 4.6 (``glm4_moe``): a mixture of experts after its first dense layers, DeepSeek-V3's: each expert's
    score a sigmoid (``expert_score``), chosen by the score plus a learned correction (the router's
    ``e_score_correction_bias``) among the best ``expert_groups_chosen`` of ``expert_groups`` groups, weighted by the
    scores alone, renormalized, times ``routed_scaling_factor``; ``num_shared_experts`` experts' worth of a dense MLP
    that every token takes beside them; q/k/v biases, perhaps Qwen3's head norms, RoPE on half of each head (rotate
    half, as Phi-3's).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    full_attention_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    partial_rotary_factor: float = 1.0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    o_bias: bool = False
    attention_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    nope_layers: tuple[int, ...] = ()
    num_shared_experts: int = 0
    expert_score: str = "softmax"
    expert_groups: int = 1
    expert_groups_chosen: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        sizes = {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for name, size in sizes.items():  # (0 or less was a weight's shape error, or a context of 0 tokens, later)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} must be a positive integer, not {size!r}")
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, not {self.num_experts_per_tok}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer, not {self.sliding_window!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        if self.expert_score not in ("softmax", "sigmoid"):
            raise ValueError(f"expert_score must be softmax or sigmoid, not {self.expert_score!r}")
        if self.num_experts and (
            self.num_experts % self.expert_groups or not 0 < self.expert_groups_chosen <= self.expert_groups
        ):
            raise ValueError(
                f"{self.num_experts} experts in {self.expert_groups} groups, {self.expert_groups_chosen} of them "
                "chosen: the groups must split the experts evenly, and at least one be chosen"
            )
        if (self.swiglu_limit is None) != (self.swiglu_alpha is None):
            raise ValueError("swiglu_limit and swiglu_alpha go together (gpt-oss's clamped SwiGLU): both or neither")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} rotates {self.rotary_dim} of {self.head_dim} "
                "dimensions of each head: an even number, at least 2, is needed"
            )

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each query and key head RoPE rotates (rotate-half within them): the whole
        head, or Phi-4-mini's share (``partial_rotary_factor``), as transformers truncates it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def sandwich_norms(self) -> bool:
        """Whether each layer norms its attention's and its MLP's outputs before adding them (Gemma's and GLM-4's
        four norms)."""
        return self.model_type in (*GEMMA_ARCHITECTURES, "glm4")

    @property
    def rope_interleaved(self) -> bool:
        """Whether the checkpoint's RoPE rotates adjacent pairs of each head's rotated dimensions (GPT-J's layout,
        GLM-4's) rather than its two halves: its q and k rows are put in the halves' order as they load
        (``rope.interleaved_to_halves``), which leaves q.k as it was."""
        return self.model_type == "glm4"

    @property
    def fused_projections(self) -> tuple[str, ...]:
        """The projections the checkpoint holds fused, as this model holds them, by the checkpoint's names (so an
        adapter's): Phi-3's ``qkv_proj`` and ``gate_up_proj``, GLM-4's ``gate_up_proj``; none for the others."""
        return {"phi3": ("qkv_proj", "gate_up_proj"), "glm4": ("gate_up_proj",)}.get(self.model_type, ())

    @property
    def embedding_scale(self) -> float:
        """What the embeddings are multiplied by: Gemma's sqrt(hidden_size) (rounded to the model's dtype first, as
        transformers' Gemma rounds it), Granite's ``embedding_multiplier``, else 1."""
        return self.hidden_size**0.5 if self.model_type in GEMMA_ARCHITECTURES else self.embedding_multiplier

    @property
    def fp32_norms(self) -> bool:
        """Whether the RMSNorms hold their weights in fp32 whatever the model's dtype and round once, after the weight
        (transformers' Gemma3RMSNorm and GptOssRMSNorm; ``RMSNorm.fp32_weight``), rather than round the normed row
        before it (Llama's)."""
        return self.model_type in (*GEMMA_ARCHITECTURES, "gpt_oss")

    @property
    def expert_biases(self) -> bool:
        """Whether a mixture's router and experts have biases (gpt-oss's), as its checkpoint holds them."""
        return self.model_type == "gpt_oss"

    @property
    def norm_weight_offset(self) -> float:
        """What a checkpoint's RMSNorm weights lack: Gemma saves ``w`` for a norm that multiplies by ``1 + w``."""
        return 1.0 if self.model_type in GEMMA_ARCHITECTURES else 0.0

    @property
    def attention_scale(self) -> float:
        """The softmax scale of attention's scores: ``head_dim ** -0.5``, Gemma's ``query_pre_attn_scalar ** -0.5`` or
        Granite's ``attention_multiplier`` (every attention backend takes it)."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (``attention/backend.py``'s rule), or None: it attends the whole
        context."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of the model's layers (none, or one)."""
        found = {self.layer_window(i) for i in range(self.num_layers)}
        return tuple(sorted(w for w in found if w is not None))

    @property
    def context_length(self) -> int:
        """The longest context the model is made for: ``max_position_embeddings``, or with YaRN the original context
        times the factor when that is longer (vLLM's derived maximum: Qwen3's 32,768 x 4)."""
        if self.rope_scaling.kind == "yarn":
            scaled = int(self.rope_scaling.original_max_position_embeddings * self.rope_scaling.factor)
            return max(self.max_position_embeddings, scaled)
        return self.max_position_embeddings

    def fingerprint(self) -> str:
        """A stable digest of the architecture, part of every KV block's name."""
        fields = asdict(self)
        # (Fields added later, at their defaults, are left out: the models before them keep their blocks' names, on
        # disk too.)
        if not self.qk_norm:
            del fields["qk_norm"]
        if not self.full_attention_layers:
            del fields["full_attention_layers"]
        if not self.nope_layers:
            del fields["nope_layers"]
        later = (
            "local_rope_theta", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
            "attention_multiplier", "swiglu_limit", "swiglu_alpha",
        )  # fmt: skip
        ones = (
            "partial_rotary_factor", "embedding_multiplier", "residual_multiplier", "logits_scaling",
            "routed_scaling_factor", "expert_groups", "expert_groups_chosen",
        )  # fmt: skip
        for name in ("o_bias", "attention_sinks"):
            if not fields[name]:
                del fields[name]
        named = (("hidden_act", "silu"), ("expert_score", "softmax"), ("num_shared_experts", 0))
        for name, default in (*named, *((n, 1.0) for n in ones), *((n, None) for n in later)):
            if fields[name] == default:
                del fields[name]
        if not self.num_experts:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
                del fields[name]
            del fields["sparse_layers"]
        kept = _KIND_FIELDS.get(self.rope_scaling.kind, ())
        for name in {n for names in _KIND_FIELDS.values() for n in names} - set(kept):
            del fields["rope_scaling"][name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """Read a Hugging Face ``config.json`` (transformers 4 or 5 field names), with its type's defaults
        (:func:`with_defaults`: Gemma 3's multimodal checkpoints read as their text model)."""
        cfg = with_defaults(cfg)
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        gemma = model_type in GEMMA_ARCHITECTURES
        # transformers 5 moved rope_theta and rope_scaling into rope_parameters (Gemma 3's: one per kind of layer).
        rope = dict(cfg.get("rope_parameters") or {})
        local_theta: float | None = None
        if model_type == "gemma3_text":
            local = dict(rope.get("sliding_attention") or {})
            if local.get("rope_type", "default") != "default":
                raise ValueError("RoPE scaling on the sliding-window layers is not supported")
            local_theta = float(local.get("rope_theta", cfg["rope_local_base_freq"]))
            rope = dict(rope.get("full_attention") or {})
        legacy = cfg.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default")) or "default"
        if model_type == "phi3" and kind in ("su", "yarn"):  # (transformers reads Phi-3's older names so)
            kind = "longrope"
        if kind not in ROPE_SCALINGS:
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_SCALINGS)})")
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
        if partial != 1.0 and model_type not in ("phi3", "glm4", "glm4_moe"):  # (the others rotate whole heads)
            raise ValueError(f"RoPE on part of each head (partial_rotary_factor) is not supported for {model_type}")
        if kind == "longrope" and model_type != "phi3":
            raise ValueError(f"longrope RoPE scaling is Phi-3's; not supported for {model_type}")
        # (The MLPs here are SiLU- or GELU-gated; transformers builds whatever activation the config names.)
        # (transformers' Gemma reads hidden_activation, the others hidden_act.)
        act = (cfg.get("hidden_activation") if gemma else None) or cfg.get("hidden_act") or "silu"
        act = "silu" if act == "swish" else act
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        if gemma and cfg.get("use_bidirectional_attention"):  # (EmbeddingGemma's attention both ways)
            raise ValueError("use_bidirectional_attention is not supported")
        # Soft caps of attention's scores and of the logits: transformers' Gemma 2 has both; its Gemma 3 text model caps
        # the logits alone if a config sets it (its attention never passes the score cap on), and its multimodal model
        # neither (with_defaults leaves it out).
        attn_cap = cfg.get("attn_logit_softcapping") if model_type == "gemma2" else None
        final_cap = cfg.get("final_logit_softcapping") if gemma else None
        # transformers' Llama and Qwen3 put attention_bias on o_proj too, and Llama's mlp_bias on the MLP: biases this
        # model has not (Mistral, Mixtral and Phi-3 read neither field; Qwen2 has q/k/v biases whatever it says).
        biased = ("llama", "qwen3", "qwen3_moe", "granite", "smollm3", *GEMMA_ARCHITECTURES)
        if cfg.get("attention_bias") and model_type in biased:
            raise ValueError("attention_bias is not supported: it biases o_proj too, which this model cannot")
        if cfg.get("mlp_bias") and model_type in ("llama", "granite", "smollm3"):
            raise ValueError("mlp_bias is not supported: this model's MLPs have no biases")
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        if kind == "yarn":
            # (transformers: the config's own original_max_position_embeddings first, else the model's context.)
            original = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
            scaling = yarn_scaling(
                rope.get("factor"),
                int(original or max_positions),
                max_positions,
                rope.get("attention_factor"),
                rope.get("mscale"),
                rope.get("mscale_all_dim"),
                rope.get("beta_fast"),
                rope.get("beta_slow"),
                rope.get("truncate", True),
            )
        elif kind == "longrope":
            scaling = longrope_scaling(
                rope,
                cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings"),
                max_positions,
                int(head_dim * partial) // 2,
            )
        else:
            scaling = RopeScaling(
                kind=kind,
                factor=float(rope.get("factor", 1.0)),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        use_window = cfg.get(
            "use_sliding_window", model_type in ("mistral", "mixtral", "phi3", "gpt_oss", *GEMMA_ARCHITECTURES)
        )
        num_layers = cfg["num_hidden_layers"]
        nope: tuple[int, ...] = ()
        if model_type == "smollm3":  # (SmolLM3Config's: a layer without RoPE every no_rope_layer_interval-th)
            interval = int(cfg.get("no_rope_layer_interval") or 4)
            uses = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
            nope = tuple(i for i in range(num_layers) if not uses[i])
        window = cfg.get("sliding_window") if use_window else None
        full_layers: tuple[int, ...] = ()
        if window is not None:
            # (As transformers: a saved config's layer_types, else Qwen's first max_window_layers attend it all, and
            # Gemma's every sliding_window_pattern-th layer.)
            types = cfg.get("layer_types")
            # (Qwen3-MoE's every layer slides, whatever its layer_types say.)
            if types and model_type in ("qwen2", "qwen3", "gpt_oss", "smollm3", *GEMMA_ARCHITECTURES):
                full_layers = tuple(i for i, kind in enumerate(types) if kind != "sliding_attention")
            elif model_type in ("qwen2", "qwen3"):
                full_layers = tuple(range(min(num_layers, int(cfg.get("max_window_layers", 28)))))
            elif model_type == "smollm3":  # (SmolLM3Config's: its layers without RoPE slide)
                full_layers = tuple(i for i in range(num_layers) if i not in nope)
            elif model_type == "gpt_oss":  # (GptOssConfig's: the even layers slide, the odd ones see it all)
                full_layers = tuple(range(1, num_layers, 2))
            elif gemma:  # (Gemma 2's every other layer, Gemma 3's every 6th)
                pattern = int(cfg.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6))
                full_layers = tuple(i for i in range(num_layers) if (i + 1) % pattern == 0)
            if len(full_layers) == num_layers:
                window, full_layers = None, ()
        # (transformers 5 saves Qwen3-MoE's num_experts as num_local_experts, Mixtral's name, which it maps it to.)
        qwen3_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        local_experts = int(cfg.get("num_local_experts") or 0)
        glm_experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
        experts_by_type = {
            "qwen3_moe": int(qwen3_experts or 0), "mixtral": local_experts, "gpt_oss": local_experts,
            "glm4_moe": glm_experts,
        }  # fmt: skip
        if model_type == "gpt_oss" and cfg.get("num_experts"):  # (GptOssConfig's alias of num_local_experts)
            experts_by_type["gpt_oss"] = int(cfg["num_experts"])
        experts = experts_by_type.get(model_type, 0)
        glm = model_type == "glm4_moe"
        expert_key = "moe_intermediate_size" if model_type in ("qwen3_moe", "glm4_moe") else "intermediate_size"
        expert_size = cfg.get(expert_key)
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        if glm:  # (Glm4MoeConfig's: the first first_k_dense_replace layers dense, the rest sparse)
            dense = set(range(int(cfg["first_k_dense_replace"] or 0)))
        sparse = tuple(i for i in range(num_layers) if experts and i not in dense and (i + 1) % step == 0)
        routing: dict[str, Any] = {
            "num_shared_experts": int(cfg["n_shared_experts"] or 0), "expert_score": "sigmoid",
            "expert_groups": int(cfg["n_group"] or 1), "expert_groups_chosen": int(cfg["topk_group"] or 1),
            "routed_scaling_factor": float(cfg["routed_scaling_factor"] or 1.0),
        } if glm and experts else {}  # fmt: skip
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2"
            or (model_type in ("glm4", "gpt_oss", "glm4_moe") and bool(cfg.get("attention_bias"))),
            o_bias=model_type == "gpt_oss" and bool(cfg.get("attention_bias")),
            attention_sinks=model_type == "gpt_oss",
            swiglu_limit=float(cfg["swiglu_limit"]) if model_type == "gpt_oss" else None,
            swiglu_alpha=float(cfg["swiglu_alpha"]) if model_type == "gpt_oss" else None,
            nope_layers=nope,
            qk_norm=model_type in QK_NORM_ARCHITECTURES or (glm and bool(cfg.get("use_qk_norm"))),
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=int(expert_size or 0) if experts else 0,
            # (Mixtral always renormalizes its chosen experts' weights; gpt-oss takes the softmax of their logits alone,
            # the same weights.)
            norm_topk_prob=bool(experts) and (model_type in ("mixtral", "gpt_oss") or bool(cfg.get("norm_topk_prob"))),
            sparse_layers=sparse,
            rope_scaling=scaling,
            sliding_window=window,
            full_attention_layers=full_layers,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=act,
            local_rope_theta=local_theta,
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
            attn_logit_softcap=float(attn_cap) if attn_cap else None,
            final_logit_softcap=float(final_cap) if final_cap else None,
            partial_rotary_factor=partial,
            **routing,
            **(_granite_multipliers(cfg) if model_type == "granite" else {}),
        )


def _granite_multipliers(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers from its config (GraniteConfig's defaults: 1, none changing the Llama)."""
    attention = cfg.get("attention_multiplier")
    return {
        "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "attention_multiplier": float(attention if attention is not None else 1.0),
        "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
    }


# Multimodal checkpoints served as their language model (images are not served): their type -> their text model's, when
# the text_config names none (Gemma3ForConditionalGeneration's, Mistral3ForConditionalGeneration's: Mistral Small 3.1
# and 3.2, Magistral Small 1.1 on, a Pixtral vision tower beside a Mistral).
MULTIMODAL_TEXT_MODELS = {"gemma3": "gemma3_text", "mistral3": "mistral"}
# A multimodal checkpoint's tensors its text model does not read (Gemma 3's vision tower and its projector, under
# transformers 4's names and 5's), and so neither an adapter's of them.
NOT_TEXT_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def with_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config with the defaults transformers' config class fills in for its type (:data:`CONFIG_DEFAULTS`: Gemma's,
    Phi-3's, GLM-4's);
    a multimodal checkpoint's (:data:`MULTIMODAL_TEXT_MODELS`: Gemma 3's 4B, 12B and 27B, Mistral Small 3.1's and
    3.2's, Magistral's) as its text model's: its ``text_config``, its top level's token ids where the text config has
    none. Any other config as it is. The vision tower is not served: its weights are left
    unread (``loader._causal_lm_name``)."""
    model_type = cfg.get("model_type")
    if model_type in MULTIMODAL_TEXT_MODELS and isinstance(cfg.get("text_config"), dict):
        ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        text_type = cfg["text_config"].get("model_type") or MULTIMODAL_TEXT_MODELS[model_type]
        text = {**CONFIG_DEFAULTS.get(text_type, {}), **ids, **cfg["text_config"], "model_type": text_type}
        text.pop("final_logit_softcapping", None)  # (Gemma3ForConditionalGeneration caps no logits)
        return text
    return {**CONFIG_DEFAULTS.get(model_type or "", {}), **cfg}
