"""Text to token ids and back, and chat templates, on the Rust ``tokenizers`` library.

transformers is not imported at run time (it takes seconds to import); a :class:`Tokenizer` is built either
from a Hugging Face model directory (``tokenizer.json`` and friends) or from a GGUF file's metadata: for byte-level
BPE, the pre-tokenizer is rebuilt the way llama.cpp runs it for the file's ``tokenizer.ggml.pre`` type; for
SentencePiece, the pipeline is transformers' GGUF tokenizer's for the file's architecture.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

__all__ = ["SUPPORTED_GGUF_PRE_TOKENIZERS", "Tokenizer", "load_tokenizer"]

# --------------------------------------------------------------------------------------------------
# GGUF vocabularies

# llama.cpp's ``llama_token_type``, stored per token in ``tokenizer.ggml.token_type``.
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4

# Pre-tokenizer regexes, as llama.cpp's ``llm_tokenizer_bpe`` applies them (llama-vocab.cpp). Each regex of a
# list splits every piece the previous one left, keeping both the matches and the text between them, which is
# exactly a chain of ``tokenizers`` ``Split(..., behavior="isolated")`` steps.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# o200k's (GPT-4o's and gpt-oss's tokenizer.json; llama.cpp's "gpt-4o"): cased words kept apart from what precedes them.
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How llama.cpp pre-tokenizes one ``tokenizer.ggml.pre`` type."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is not split by BPE (Llama 3)
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token


_LLAMA3_PRE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = _PreTokenizer((_QWEN2,))
# Individual digits first, then the GPT-2 regex: SmolLM's tokenizer.json (Digits + ByteLevel) and StarCoder's.
_DIGITS_GPT2_PRE = _PreTokenizer((r"\p{N}", _GPT2))
_GPT2_PRE = _PreTokenizer((_GPT2,))
# What llama.cpp falls back to for files converted before tokenizer.ggml.pre existed.
_DEFAULT_PRE = _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))

_GGUF_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "llama-bpe": _LLAMA3_PRE,
    "qwen2": _QWEN2_PRE,
    "deepseek-r1-qwen": _QWEN2_PRE,
    "smollm": _DIGITS_GPT2_PRE,
    "starcoder": _DIGITS_GPT2_PRE,
    "refact": _DIGITS_GPT2_PRE,
    "gpt-2": _GPT2_PRE,
    "gpt2": _GPT2_PRE,
    "gpt-4o": _PreTokenizer((_GPT4O,)),
    # (llama.cpp's CHATGLM4: GLM-4's and GLM-4.5's, Llama 3's regex, whole-word tokens merged as any, no BOS.)
    "glm4": _PreTokenizer((_LLAMA3,)),
    "chatglm-bpe": _PreTokenizer((_LLAMA3,)),
    "default": _DEFAULT_PRE,
}
SUPPORTED_GGUF_PRE_TOKENIZERS = tuple(sorted(_GGUF_PRE_TOKENIZERS))

# Tokens llama.cpp treats as end of generation by their text, whatever the metadata says (llama-vocab.cpp).
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "<｜end▁of▁sentence｜>",
        "<end_of_utterance>",
        "<|return|>",
        "<|call|>",
    }
)
# gpt-oss's harmony format ends each message with <|end|> and the answer with <|return|> (or a tool call with
# <|call|>): a vocabulary that has both of these does not end at <|end|>, as llama.cpp rules it.
_HARMONY_ENDS = ("<|return|>", "<|call|>")

# The named special tokens Hugging Face passes to chat templates (``SPECIAL_TOKENS_ATTRIBUTES``).
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GGUF_NAMED_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "sep_token": "tokenizer.ggml.seperator_token_id",  # sic: llama.cpp's spelling
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _split_merge(merge: str) -> tuple[str, str]:
    # Split at the first space after the first character, as llama.cpp does.
    cut = merge.index(" ", 1)
    return merge[:cut], merge[cut + 1 :]


def _gguf_backend(meta: Mapping[str, Any], pre: _PreTokenizer) -> RustTokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [_split_merge(m) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = RustTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges)
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    # llama.cpp matches control and user-defined tokens whole before pre-tokenizing, as ``tokenizers`` does
    # for added tokens; only control ones are dropped when decoding without special tokens.
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(token_types)
        if kind in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)
    ]
    plain = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, kind in enumerate(token_types)
        if kind == _TOKEN_USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(plain)
    return backend


# SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``: Llama 2, Mistral, Phi-3, Gemma). The file holds
# the pieces (``▁`` for a space, ``<0xNN>`` for a byte no piece holds) and their scores, but no merges. As
# transformers' GGUF loader does, we run them as a byte-fallback BPE whose merges are derived from the scores, and
# take the rest of the pipeline from the tokenizer class transformers picks by ``general.architecture``.
_SpmStyle = Literal["llama", "phi3", "gemma"]
_SPM_STYLES: dict[str, _SpmStyle] = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}
_SPACE = "\u2581"  # SentencePiece's spelling of a space


def _gemma_spelling(token: str) -> str:
    """Gemma's pieces of only blanks are stored with real spaces (``"  "``), where its normalizer writes ``▁▁``."""
    return _SPACE * len(token) if " " in token and not token.strip() else token


def _spm_merges(vocab: Mapping[str, int], ranking: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges that rebuild SentencePiece's pieces, as transformers' ``generate_merges`` derives them: every cut of
    a piece into two pieces of ``vocab`` is a merge, ranked by the piece's ``ranking`` (highest first), then longer
    left part first, then longer right part; merges that tie on all three keep ``ranking``'s order.

    Ties are common: llama.cpp's converter writes -1000 for every score of a vocabulary it read from a tokenizer.json.
    """
    found: list[tuple[str, str, float]] = []
    for piece, rank in ranking.items():
        found.extend(
            (piece[:i], piece[i:], rank) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        )
    found.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)  # stable
    return [(left, right) for left, right, _ in found]


def _spm_decoder(strip_prefix: bool) -> decoders.Decoder:
    """``▁`` back to a space and byte tokens back to bytes; ``strip_prefix`` drops the space the encoder put first."""
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip_prefix else []))


def _gguf_spm_backend(meta: Mapping[str, Any], style: _SpmStyle) -> RustTokenizer:
    """The SentencePiece vocabulary of a GGUF file as transformers builds it (``sentencepiece_tokenizer``,
    ``phi3_tokenizer``, ``gemma_tokenizer``), control and user-defined tokens included.

    Like transformers, this ignores ``tokenizer.ggml.add_space_prefix``: the ``▁`` prefix is the style's, put
    before the text's start only for Llama (not again after a special token), before every stretch between special
    tokens for Phi-3 (its tokenizer.json's normalizer), and never for Gemma.
    """
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    spelled = [_gemma_spelling(t) for t in tokens] if style == "gemma" else list(tokens)
    vocab = {token: i for i, token in enumerate(spelled)}
    if "tokenizer.ggml.merges" in meta:
        merges = [_split_merge(m) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        # Gemma's scores do not follow its merge order, its pieces' order in the file does (transformers found).
        if style == "gemma" or scores is None:
            ranking = {token: -float(i) for i, token in enumerate(spelled)}
        else:
            ranking = dict(zip(tokens, scores, strict=False))
        merges = _spm_merges(vocab, ranking)
    # (GemmaTokenizer names an unknown token; LlamaTokenizer's model has none, bytes standing in for it.)
    unk = "<unk>" if style == "gemma" and "<unk>" in vocab else None
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    if style == "llama":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first", split=False)
    elif style == "phi3":
        # A normalizer runs on each stretch of text between special tokens, so each one gets the prefix.
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
    else:
        backend.normalizer = normalizers.Replace(" ", _SPACE)  # (GemmaTokenizer's Split on " " then has none to cut)
    backend.decoder = _spm_decoder(strip_prefix=style != "gemma")

    token_types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _TOKEN_CONTROL
        ]
    )
    # Only those the vocabulary spells as the file does: Gemma's blanks, respelled above, stay BPE pieces.
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _TOKEN_USER_DEFINED and tokens[i] in vocab
        ]
    )
    return backend


def _gguf_chat_templates(meta: Mapping[str, Any]) -> dict[str, str]:
    templates = {}
    if "tokenizer.chat_template" in meta:
        templates["default"] = meta["tokenizer.chat_template"]
    for name in meta.get("tokenizer.chat_templates", []):
        if f"tokenizer.chat_template.{name}" in meta:
            templates[name] = meta[f"tokenizer.chat_template.{name}"]
    return templates


# --------------------------------------------------------------------------------------------------
# Hugging Face directories


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an ``AddedToken`` dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _hf_chat_templates(root: Path, config: Mapping[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    configured = config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):  # [{"name": ..., "template": ...}, ...]
        templates.update({t["name"]: t["template"] for t in configured})
    legacy = _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(legacy, str):
        templates["default"] = legacy
    # transformers 5 saves templates as files, which take precedence over the config.
    for extra in sorted((root / "additional_chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text(encoding="utf-8")
    if (root / "chat_template.jinja").is_file():
        templates["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    return templates


# The tokenizer classes whose pipeline transformers 5 builds itself, as its LlamaTokenizer does, taking only the
# vocabulary, merges and post-processor from tokenizer.json (Llama 2's, Mistral's, Phi-3's tokenizer_class).
_LLAMA_TOKENIZER_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")


def _as_transformers_llama_tokenizer(backend: RustTokenizer, config: Mapping[str, Any]) -> None:
    """Give ``backend`` the pipeline transformers 5's LlamaTokenizer builds, in place of tokenizer.json's: no
    normalizer (the file's prefixes every piece with ``▁``, after each special token too, and doubles a leading
    space's), a Metaspace pre-tokenizer that prefixes the first piece only (every piece with ``legacy: true``, none
    without ``add_prefix_space``), and a decoder that strips the prefix's space."""
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    scheme = ("always" if config.get("legacy", False) else "first") if add_prefix_space else "never"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme=scheme, split=False)
    backend.decoder = _spm_decoder(strip_prefix=add_prefix_space)


def _added_token(content: str, spec: Mapping[str, Any]) -> AddedToken:
    return AddedToken(
        content,
        single_word=spec.get("single_word", False),
        lstrip=spec.get("lstrip", False),
        rstrip=spec.get("rstrip", False),
        normalized=spec.get("normalized", not spec.get("special", False)),
        special=spec.get("special", False),
    )


# --------------------------------------------------------------------------------------------------
# Chat templates


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (used by HF to mark assistant tokens) and renders the body."""

    tags: set[str] = {"generation"}  # noqa: RUF012 (an instance variable's default, as jinja2's Extension declares it)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, as transformers' does, to keep templates off internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # No named self, as in jinja's Namespace, so that namespace(self=...) still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Hugging Face's replacement for jinja's tojson, which HTML-escapes and sorts keys.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=64)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in an environment that matches transformers' ``_compile_jinja_template``."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def load_chat_template(value: str) -> str:
    """A chat template given as a Jinja file's path or as the template itself, checked to compile; raises
    ``ValueError``. vLLM's ``--chat-template`` rule: a value that names no file is the template if it holds ``{`` or a
    line break, its escapes (``\\n``) decoded, and a mistyped path otherwise (an error, not a template that prints the
    path)."""
    try:
        is_file = Path(value).expanduser().is_file()
    except OSError:  # a template too long to be a file's name
        is_file = False
    if is_file:
        try:
            source = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {value}: {e}") from e
    elif "{" in value or "\n" in value:
        # vLLM decodes a template given as text: a one-line template from the shell writes its line breaks as \n.
        # (Python's unicode_escape over the text's own characters: vLLM's decode garbles any beyond ASCII, é as Ã©.)
        source = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    else:
        raise ValueError(f"{value!r} is no file, nor a template (it has no '{{')")
    try:
        _compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"not a valid Jinja template: {e.message} (line {e.lineno})") from e
    return source


def _names(node: jinja2.nodes.Node, names: set[str]) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names


def _reads(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether ``node`` reads one of the variables ``names`` (with ``key``: its ``key``, ``m.content`` or
    ``m['content']``), whole or through filters, tests and slices (``messages[1:]``, ``messages | selectattr(...)``)."""
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test | jinja2.nodes.Getitem):
        inner = node.node
        if inner is None or (isinstance(node, jinja2.nodes.Getitem) and not isinstance(node.arg, jinja2.nodes.Slice)):
            break
        node = inner
    if key is None:
        return _names(node, names)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _names(node.node, names)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        return node.arg.value == key and _names(node.node, names)
    return False


@functools.lru_cache(maxsize=64)
def template_content_format(source: str) -> Literal["string", "openai"]:
    """How a chat template reads a message's content, as vLLM's ``--chat-template-content-format auto`` finds it:
    ``"openai"`` (a list of ``{"type": "text", "text": ...}`` parts) when the template loops over the content of a
    message it takes from ``messages`` (``{% for part in message['content'] %}``), else ``"string"``."""
    try:
        tree = _compile_template(source).environment.parse(source)
    except jinja2.TemplateError:
        return "string"
    # The names that hold the conversation: ``messages`` and what is set from it (``loop_messages = messages[1:]``).
    conversation = {"messages"}
    assigns = [
        (a.target.name, a.node) for a in tree.find_all(jinja2.nodes.Assign) if isinstance(a.target, jinja2.nodes.Name)
    ]
    while grown := {name for name, value in assigns if _reads(value, conversation)} - conversation:
        conversation |= grown
    loops = list(tree.find_all(jinja2.nodes.For))
    message_names = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, jinja2.nodes.Name) and _reads(loop.iter, conversation)
    }
    return "openai" if any(_reads(loop.iter, message_names, "content") for loop in loops) else "string"


class TemplateConversation(list[dict[str, Any]]):
    """A conversation in both of vLLM's content formats: its messages (this list) with each one's content as one
    text, which most templates read, and :attr:`as_parts`, the same messages with each content as a list of text
    parts. :meth:`Tokenizer.apply_chat_template` renders the one its template reads (:func:`template_content_format`),
    as vLLM picks; a plain list of messages is rendered as given, as transformers renders it."""

    def __init__(self, as_text: Iterable[dict[str, Any]], as_parts: Iterable[dict[str, Any]]) -> None:
        super().__init__(as_text)
        self.as_parts = list(as_parts)


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to templates: keys set to None dropped, reasoning under every alias."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


# --------------------------------------------------------------------------------------------------
# The tokenizer


class Encoding(dict[str, list]):
    """What :meth:`Tokenizer.__call__` gives, as far as code written for transformers' ``BatchEncoding`` reads it:
    ``input_ids`` and ``attention_mask``, as keys and as attributes."""

    @property
    def input_ids(self) -> list:
        return self["input_ids"]

    @property
    def attention_mask(self) -> list:
        return self["attention_mask"]


class Tokenizer:
    """A BPE tokenizer (byte-level, or SentencePiece's with a byte fallback) with its special tokens and chat
    templates.

    Build one with :meth:`from_hf_dir`, :meth:`from_gguf` or :func:`load_tokenizer` (cached). Instances are not
    modified after construction, so one can be shared between threads and requests.
    """

    def __init__(
        self,
        backend: RustTokenizer,
        *,
        named_tokens: Mapping[str, str],
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        chat_templates: Mapping[str, str],
        prefix_ids: Sequence[int] = (),
        suffix_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self._named_tokens = dict(named_tokens)
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._chat_templates = dict(chat_templates)
        # Tokens added around every encoded text (BOS/EOS) when the backend's post-processor does not.
        self._prefix_ids = list(prefix_ids)
        self._suffix_ids = list(suffix_ids)
        special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        named_ids = (backend.token_to_id(token) for token in self._named_tokens.values())
        self._all_special_ids = tuple(sorted(special | {i for i in named_ids if i is not None}))
        decoder = backend.decoder
        self._byte_fallback = decoder is not None and b'"ByteFallback"' in decoder.__getstate__()
        # Past the largest id, not the count of pieces: a GGUF vocabulary may hold one piece twice (the later id is
        # the one text encodes to), which leaves the count short of the ids (vLLM bounds ids by the largest so).
        ids = backend.get_vocab(with_added_tokens=True).values()
        self._vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes, from its metadata as plain Python values.

        Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) with the pre-tokenizers in
        :data:`SUPPORTED_GGUF_PRE_TOKENIZERS`, and SentencePiece ones (``"llama"``), built as transformers' GGUF
        loader builds them for the file's ``general.architecture`` (Gemma's and Phi-3's differ from Llama's);
        anything else raises ``ValueError``.
        """
        model = metadata.get("tokenizer.ggml.model")
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        named = {
            name: tokens[metadata[key]]
            for name, key in _GGUF_NAMED_TOKEN_KEYS.items()
            if isinstance(metadata.get(key), int) and 0 <= metadata[key] < len(tokens)
        }
        if model == "gpt2":
            pre_name = metadata.get("tokenizer.ggml.pre") or "default"
            pre = _GGUF_PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise ValueError(
                    f"unsupported GGUF pre-tokenizer {pre_name!r}; "
                    f"supported: {', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}"
                )
            backend = _gguf_backend(metadata, pre)
            add_bos_default = pre.add_bos
        elif model == "llama":
            style = _SPM_STYLES.get(metadata.get("general.architecture", ""), "llama")
            backend = _gguf_spm_backend(metadata, style)
            if style == "gemma" and backend.token_to_id("<mask>") is not None:
                named["mask_token"] = "<mask>"  # GemmaTokenizer's default, which no GGUF key overrides
            # transformers makes the named tokens special too (a file marks <unk> unknown, not control). One added
            # already as user-defined keeps its entry, but ``tokenizers`` then skips it in decoding too.
            backend.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(named.values())]
            )
            add_bos_default = True  # llama.cpp's default for SentencePiece, and transformers'
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {model!r}: only byte-level BPE ('gpt2') and SentencePiece BPE "
                "('llama') vocabularies are supported"
            )

        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        declared = [metadata.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
        by_text = [i for i, token in enumerate(tokens) if token in _EOG_TEXTS]
        if set(_HARMONY_ENDS) <= {tokens[i] for i in by_text}:
            not_ends = {i for i in (*declared, *by_text) if i is not None and tokens[i] == "<|end|>"}
            declared = [i for i in declared if i not in not_ends]
            by_text = [i for i in by_text if i not in not_ends]
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        return cls(
            backend,
            named_tokens=named,
            bos_token_id=bos_id,
            eos_token_ids=[i for i in declared if i is not None] + by_text,
            chat_templates=_gguf_chat_templates(metadata),
            prefix_ids=[bos_id] if add_bos and bos_id is not None else [],
            suffix_ids=[eos_id] if add_eos and eos_id is not None else [],
        )

    @classmethod
    def from_gguf_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer embedded in a GGUF file (reads only its metadata)."""
        from boundless.model.gguf import read_gguf_metadata  # gguf imports this module

        return cls.from_gguf(read_gguf_metadata(path))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer of a Hugging Face model directory, as ``AutoTokenizer`` (fast) would.

        Reads ``tokenizer.json`` (required; its post-processor decides BOS/EOS), ``tokenizer_config.json``
        (special tokens, added tokens, chat template), ``special_tokens_map.json``, ``chat_template.jinja`` and,
        for the end-of-sequence ids, ``generation_config.json`` and ``config.json``.
        """
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(f"{root} has no tokenizer.json (only fast tokenizers are supported)")
        backend = RustTokenizer.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        if config.get("tokenizer_class") in _LLAMA_TOKENIZER_CLASSES and isinstance(backend.model, models.BPE):
            _as_transformers_llama_tokenizer(backend, config)
        special_map = _read_json(root / "special_tokens_map.json")
        generation = _read_json(root / "generation_config.json")
        model_config = _read_json(root / "config.json")

        present = {token.content for token in backend.get_added_tokens_decoder().values()}
        # Added tokens only the config lists get the next free ids, in the config's order, as in transformers.
        for _, spec in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0])):
            if spec["content"] not in present:
                token = _added_token(spec["content"], spec)
                (backend.add_special_tokens if token.special else backend.add_tokens)([token])
                present.add(token.content)

        named: dict[str, str] = {}
        for name in _NAMED_TOKENS:
            content = _token_content(config[name] if name in config else special_map.get(name))
            if content is not None:
                named[name] = content
        # Like transformers, a named special token that is not an added token yet becomes one.
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(named.values()) if t not in present]
        )
        bos_id = backend.token_to_id(named["bos_token"]) if "bos_token" in named else None
        if bos_id is None:
            bos_id = generation.get("bos_token_id", model_config.get("bos_token_id"))
        eos_ids = [backend.token_to_id(named["eos_token"])] if "eos_token" in named else []
        eos_ids += _as_ids(generation.get("eos_token_id")) + _as_ids(model_config.get("eos_token_id"))

        # BOS/EOS come from tokenizer.json's post-processor alone: transformers 5 drops tokenizer_config's
        # add_bos_token / add_eos_token whenever a tokenizer.json exists.
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        return cls(
            backend,
            named_tokens=named,
            bos_token_id=bos_id,
            eos_token_ids=[i for i in eos_ids if i is not None],
            chat_templates=_hf_chat_templates(root, config),
        )

    # -- properties --------------------------------------------------------------------------------

    @property
    def backend(self) -> RustTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (do not modify it: instances are shared)."""
        return self._backend

    @property
    def byte_fallback(self) -> bool:
        """Whether the decoder falls back to bytes (SentencePiece's, Llama-2's and Mistral's): a run of byte tokens
        with one that is no UTF-8 decodes as a replacement character a byte, the valid characters before it included
        (byte-level BPE's decodes only the bad bytes so)."""
        return self._byte_fallback

    @property
    def vocab_size(self) -> int:
        """The ids' bound: one past the largest token id, added tokens included."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The EOS token's id (transformers' name): the first of :attr:`eos_token_ids`."""
        return self._eos_token_ids[0] if self._eos_token_ids else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the EOS token first, then end-of-turn tokens the model declares."""
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        """The default chat template, if the model has one."""
        return self._chat_templates.get("default")

    @property
    def chat_templates(self) -> dict[str, str]:
        """All named chat templates (``default``, and e.g. ``tool_use``)."""
        return dict(self._chat_templates)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens (``bos_token``, ``eos_token``...), as chat templates see them."""
        return dict(self._named_tokens)

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        """Ids of every special token: the named ones and all added tokens marked special."""
        return self._all_special_ids

    # -- encoding ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; special tokens written in the text are recognised.

        With ``add_special_tokens`` the model's BOS (and EOS) are added when its configuration asks for them.
        """
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and (self._prefix_ids or self._suffix_ids):
            return self._prefix_ids + ids + self._suffix_ids
        return ids

    def encode_pair(self, text: str, pair: str, max_length: int | None = None) -> list[int]:
        """Token ids for two texts as one input (a cross-encoder's query and document), joined as the tokenizer joins
        a pair (its post-processor's special tokens between and around them); past ``max_length``, the longer text's
        last tokens go first, one at a time (transformers' ``longest_first`` truncation), the special tokens stay."""
        encoding = self._backend.encode(text, pair, add_special_tokens=True)
        ids, sequences = list(encoding.ids), list(encoding.sequence_ids)
        prefix, suffix = self._prefix_ids, self._suffix_ids
        excess = len(ids) + len(prefix) + len(suffix) - max_length if max_length is not None else 0
        if excess > 0:
            positions = {
                0: [i for i, s in enumerate(sequences) if s == 0],
                1: [i for i, s in enumerate(sequences) if s == 1],
            }
            dropped: set[int] = set()
            for _ in range(excess):
                longer = 1 if len(positions[1]) >= len(positions[0]) else 0
                if not positions[longer]:
                    break
                dropped.add(positions[longer].pop())
            ids = [t for i, t in enumerate(ids) if i not in dropped]
        return prefix + ids + suffix

    def token_to_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary, as written there (``▁yes``, ``Ġyes``), else None."""
        return self._backend.token_to_id(token)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """:meth:`encode` for many texts, in parallel in Rust."""
        encodings = self._backend.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        if add_special_tokens and (self._prefix_ids or self._suffix_ids):
            return [self._prefix_ids + e.ids + self._suffix_ids for e in encodings]
        return [e.ids for e in encodings]

    def __call__(self, text: str | Sequence[str], *, add_special_tokens: bool = True) -> Encoding:
        """transformers' call: ``input_ids`` (and an ``attention_mask`` of ones) of a text, or of each of a list."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        batch = self.encode_batch(text, add_special_tokens)
        return Encoding(input_ids=batch, attention_mask=[[1] * len(ids) for ids in batch])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; incomplete UTF-8 sequences come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """:meth:`decode` for many sequences, in one call (in parallel in Rust)."""
        # (Sequences as they are: the binding reads any sequence of ints, and a copy of each was 2% of a decode step.)
        return self._backend.decode_batch(seqs, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary strings of ``ids`` (byte-level spelling, e.g. ``Ġworld``; SentencePiece's, ``▁world``)."""
        tokens = []
        for i in ids:
            token = self._backend.id_to_token(i)
            if token is None:
                raise ValueError(f"token id {i} is not in the vocabulary")
            tokens.append(token)
        return tokens

    # -- chat --------------------------------------------------------------------------------------

    def _select_template(self, chat_template: str | None, tools: Sequence[Mapping[str, Any]] | None) -> str:
        if chat_template is not None:
            return self._chat_templates.get(chat_template, chat_template)
        if tools and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" not in self._chat_templates:
            raise ValueError("this model has no chat template; pass chat_template= or format the prompt yourself")
        return self._chat_templates["default"]

    @overload
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, tokenize: Literal[False] = False, **kwargs: Any
    ) -> str: ...

    @overload
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, tokenize: Literal[True], **kwargs: Any
    ) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation to a prompt string, as transformers' ``apply_chat_template(tokenize=False)``; with
        ``tokenize``, its token ids (encoded without adding special tokens: the template writes them).

        ``tools`` are JSON schemas. ``chat_template`` is the name of one of :attr:`chat_templates` or a template
        source; by default the ``tool_use`` template is used when tools are given and the model has one. A
        :class:`TemplateConversation` (the API's conversion of OpenAI messages) is rendered with its content as the
        template reads it, one text or a list of text parts (:func:`template_content_format`), as vLLM renders.
        ``continue_final_message`` (transformers'): the prompt ends where the last message's text does, without what
        closes its turn, so that the model goes on writing it (a prefilled answer); not with ``add_generation_prompt``.
        Extra keyword arguments (``documents``, ``enable_thinking``...) are passed to the template, overriding
        the special-token variables (``bos_token``, ``eos_token``...). Note that the rendered text often already
        starts with BOS: encode it with ``add_special_tokens=False``.
        """
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        source = self._select_template(chat_template, tools)
        template = _compile_template(source)
        if isinstance(messages, TemplateConversation) and template_content_format(source) == "openai":
            messages = messages.as_parts
        variables = {**self._named_tokens, "documents": None, **kwargs}
        final_text = ""
        if continue_final_message:
            messages, final_text = _tag_final_message(messages)
        rendered = template.render(
            messages=[_template_message(m) for m in messages],
            tools=list(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        text = _cut_at_tag(rendered, final_text) if continue_final_message else rendered
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={self.eos_token_ids}, chat_template={'yes' if self.chat_template else 'no'})"
        )


# Put after the final message's text for continue_final_message, then cut at (transformers' tag, to the character).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], str]:
    """The conversation with :data:`_CONTINUE_TAG` after its final message's text (its last text part's), and that
    text, as transformers marks where ``continue_final_message`` cuts."""
    final = dict(messages[-1])
    content = final.get("content")
    if isinstance(content, list | tuple):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        at = next((i for i in reversed(range(len(parts))) if isinstance(parts[i], dict) and "text" in parts[i]), None)
        if at is None:
            raise ValueError("continue_final_message is set but the final message has no text to continue")
        text = parts[at]["text"]
        parts[at]["text"] = text + _CONTINUE_TAG
        final["content"] = parts
    elif isinstance(content, str):
        text = content
        final["content"] = content + _CONTINUE_TAG
    else:
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    return [*messages[:-1], final], text


def _cut_at_tag(rendered: str, text: str) -> str:
    """``rendered`` (with :data:`_CONTINUE_TAG`) up to the final message's end: at the tag, or before the blanks a
    template that strips the message left before it."""
    tag = _CONTINUE_TAG.strip()
    if text.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message is set but the chat template does not write the final message")
    at = rendered.rindex(tag)
    return rendered[:at] if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else rendered[:at].rstrip()


@functools.lru_cache(maxsize=16)
def _load_cached(source: str) -> Tokenizer:
    path = Path(source)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if path.suffix == ".gguf" and path.is_file():
        return Tokenizer.from_gguf_file(path)
    raise ValueError(f"{source} is neither a Hugging Face model directory nor a .gguf file")


def load_tokenizer(source: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a model directory or GGUF file, built once per path and then shared."""
    return _load_cached(str(Path(source).resolve()))
