"""Tokenizers for specfork models, from a Hugging Face folder or from GGUF metadata.

:class:`Tokenizer` wraps a fast ``tokenizers.Tokenizer`` plus what generation needs: the BOS id and
whether :meth:`Tokenizer.encode` prepends it, every id that ends a turn, and the chat template,
which is rendered exactly the way transformers renders it.

A GGUF file carries no ``tokenizer.json``. The first :meth:`Tokenizer.from_gguf` of a file has
transformers convert its metadata (slow: seconds, it imports transformers) and writes the result to
a cache folder; later loads of the same, unchanged file read only that cache with the
``tokenizers`` library, without importing transformers.

:class:`StreamDecoder` turns a stream of token ids into text the way vLLM's
``detokenize_incrementally`` does: it decodes a small window of recent tokens and emits the
difference, so byte-level tokens never show half a character and SentencePiece tokens keep the
spaces they only get in context.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tokenizers import Tokenizer as BackendTokenizer

from specfork.errors import ConfigError, ModelFormatError, PromptError

if TYPE_CHECKING:
    import jinja2

logger = logging.getLogger(__name__)

#: Bumped whenever the cache layout or the meaning of a sidecar field changes.
CACHE_FORMAT = 1
TOKENIZER_FILE = "tokenizer.json"
SIDECAR_FILE = "specfork_tokenizer.json"

#: The named special tokens transformers passes to a chat template (``special_tokens_map``).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
#: How many already-shown tokens a StreamDecoder keeps as decoding context (vLLM uses 5).
STREAM_CONTEXT = 5
REPLACEMENT_CHAR = "\ufffd"
_END_OF_TURN_PROBE = "SpecforkEndOfTurnProbe"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GGUF_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, chat template and streaming decode.

    Build one with :meth:`from_folder` or :meth:`from_gguf`.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_id: int | None,
        eos_ids: Iterable[int],
        chat_template: str | None,
        template_tokens: Mapping[str, str],
        source: str,
    ) -> None:
        """Wrap ``backend``; ``template_tokens`` are the named special tokens the template sees."""
        self._backend = backend
        self.source = source
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_ids: frozenset[int] = frozenset(int(i) for i in eos_ids)
        self.chat_template = chat_template
        self.template_tokens = dict(template_tokens)
        self.add_bos: bool = self._backend_adds_bos()

    # ----------------------------------------------------------------------------- construction

    @classmethod
    def from_folder(cls, path: Path) -> Tokenizer:
        """Load a Hugging Face tokenizer folder (``tokenizer.json`` and its config files)."""
        path = Path(path)
        if not path.is_dir():
            raise ModelFormatError(f"Tokenizer folder {path} does not exist or is not a folder.")
        backend = _load_backend(path / TOKENIZER_FILE)
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        template_tokens = _named_special_tokens(tokenizer_config)
        tokenizer = cls(
            backend,
            bos_id=_folder_bos_id(path, backend, template_tokens),
            eos_ids=_folder_eos_ids(path, backend, template_tokens),
            chat_template=_folder_chat_template(path, tokenizer_config),
            template_tokens=template_tokens,
            source=str(path),
        )
        tokenizer.eos_ids |= tokenizer.end_of_turn_ids()
        return tokenizer

    @classmethod
    def from_gguf(cls, path: Path, cache_dir: Path) -> Tokenizer:
        """Load the tokenizer a GGUF file describes, converting it once into ``cache_dir``.

        The cache entry is keyed by the file's real path, size and modification time, so an
        edited or replaced file is converted again. A cache hit does not import transformers.
        """
        path = Path(path)
        if not path.is_file():
            raise ModelFormatError(f"GGUF file {path} does not exist or is not a regular file.")
        entry = Path(cache_dir) / f"gguf-{gguf_cache_key(path)}"
        cached = _load_cache_entry(entry)
        if cached is not None:
            logger.debug("Loaded the tokenizer of %s from the cache %s", path, entry)
            return cached
        started = time.perf_counter()
        logger.info("Converting the tokenizer of %s (once; cached in %s)", path, entry)
        backend, sidecar = _convert_gguf(path)
        logger.info("Converted the tokenizer of %s in %.1f s", path, time.perf_counter() - started)
        try:
            _write_cache_entry(entry, backend, sidecar)
        except OSError as error:
            logger.warning("Cannot write the tokenizer cache %s (%s); not caching", entry, error)
            return _from_sidecar(backend, sidecar)
        # Read the entry back, so a first load behaves exactly like every cached one.
        return _load_cache_entry(entry) or _from_sidecar(backend, sidecar)

    # ----------------------------------------------------------------------------- encode/decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS (and EOS) as the model wants.

        A text that already starts with the BOS token, like a rendered chat template, does not
        get a second one.
        """
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and ids[:2] == [self.bos_id, self.bos_id]:
            del ids[0]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; special tokens are kept unless ``skip_special_tokens``."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream_decoder(
        self, context: Sequence[int] = (), skip_special_tokens: bool = False
    ) -> StreamDecoder:
        """A :class:`StreamDecoder` for generated ids.

        ``context`` are ids already shown (the prompt); its last few tokens are used only so the
        first generated token decodes as it would in context (a SentencePiece leading space).
        """

        def decode(ids: Sequence[int]) -> str:
            return self.decode(ids, skip_special_tokens=skip_special_tokens)

        return StreamDecoder(decode, context)

    # ----------------------------------------------------------------------------- chat template

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` with the model's chat template, as transformers' ``tokenize=False``.

        Raises :class:`ConfigError` if the model has no chat template and :class:`PromptError` if
        the template rejects the messages (``raise_exception`` in the template).
        """
        if self.chat_template is None:
            raise ConfigError(
                f"The model {self.source} has no chat template, so it cannot take chat messages; "
                "give it a plain text prompt instead."
            )
        import jinja2

        template = _compile_chat_template(self.chat_template, self.source)
        try:
            return template.render(
                messages=_template_messages(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.template_tokens,
            )
        except jinja2.TemplateError as error:
            raise PromptError(
                f"The chat template of {self.source} rejected the messages: {error}"
            ) from error

    def end_of_turn_ids(self) -> frozenset[int]:
        """The special token the chat template writes right after an assistant message, if any.

        ChatML's ``<|im_end|>``, Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``: generation
        must stop there even when the config names only the plain EOS.
        """
        if self.chat_template is None:
            return frozenset()
        messages = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": _END_OF_TURN_PROBE},
        ]
        try:
            rendered = self.apply_chat_template(messages, add_generation_prompt=False)
        except Exception as error:  # any template failure just means "no end-of-turn token found"
            logger.debug("Could not find the end-of-turn token of %s: %s", self.source, error)
            return frozenset()
        _, found, after = rendered.partition(_END_OF_TURN_PROBE)
        ids = self._backend.encode(after, add_special_tokens=False).ids if found else []
        special = self._backend.get_added_tokens_decoder()
        if ids and ids[0] in special and special[ids[0]].special:
            return frozenset({ids[0]})
        return frozenset()

    # ----------------------------------------------------------------------------- internals

    def _backend_adds_bos(self) -> bool:
        """Whether the backend's post-processor puts BOS in front of every encoded text."""
        if self.bos_id is None:
            return False
        return self._backend.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]

    def _sidecar(self) -> dict[str, Any]:
        """Everything besides ``tokenizer.json`` that a cached load needs."""
        return {
            "format": CACHE_FORMAT,
            "source": self.source,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_ids": sorted(self.eos_ids),
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
            "template_tokens": self.template_tokens,
        }

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id},"
            f" eos_ids={sorted(self.eos_ids)}, add_bos={self.add_bos},"
            f" chat_template={'yes' if self.chat_template else 'no'})"
        )


class StreamDecoder:
    """Incremental detokenizer: :meth:`feed` ids one by one and get the new text of each.

    It keeps a window of the ids since the last emitted text plus a few before it, decodes the
    window with and without the newest ids and emits the difference. Text that ends in U+FFFD (an
    incomplete UTF-8 character) is held back until the character is complete.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int] = ()) -> None:
        """``decode`` turns ids into text; ``context`` are ids already shown before the stream."""
        self._decode = decode
        self._ids: list[int] = [int(i) for i in context][-STREAM_CONTEXT:]
        self._read = len(self._ids)  # ids before this index have been emitted

    def feed(self, token_id: int) -> str:
        """Add one id; return the text it completes (may be empty)."""
        self._ids.append(int(token_id))
        shown, text = self._texts()
        if len(text) <= len(shown) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return text[len(shown) :]

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character becomes U+FFFD)."""
        shown, text = self._texts()
        self._advance()
        return text[len(shown) :] if len(text) > len(shown) else ""

    def _texts(self) -> tuple[str, str]:
        """The window decoded without and with the ids not yet emitted."""
        return self._decode(self._ids[: self._read]), self._decode(self._ids)

    def _advance(self) -> None:
        """Mark everything as emitted; the emitted part becomes the next window's context."""
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)


# ================================================================================= folder loading


def _load_backend(path: Path) -> BackendTokenizer:
    """Read a ``tokenizer.json``, or raise :class:`ModelFormatError` naming the file."""
    if not path.is_file():
        raise ModelFormatError(f"{path.parent} has no {path.name}; it is not a tokenizer folder.")
    try:
        return BackendTokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for malformed files
        raise ModelFormatError(f"{path} is not a valid tokenizers file: {error}") from error


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or ``{}`` if the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelFormatError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} must hold a JSON object, not {type(data).__name__}.")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _named_special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... (and named extra tokens) as the template sees them."""
    names = list(SPECIAL_TOKEN_NAMES)
    extra = tokenizer_config.get("extra_special_tokens")
    if isinstance(extra, dict):
        names += [name for name in extra if name not in names]
    merged = {**(extra if isinstance(extra, dict) else {}), **tokenizer_config}
    tokens = {name: _token_content(merged.get(name)) for name in names}
    return {name: token for name, token in tokens.items() if token is not None}


def _ids_of(value: Any) -> list[int]:
    """An ``*_token_id`` config value (an int, a list of ints or null) as a list."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
    return []


def _token_id(backend: BackendTokenizer, token: str | None, source: Path) -> int | None:
    """The id of a named special token, or ``None`` (with a warning) if it is not in the vocab."""
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        logger.warning("The special token %r of %s is not in its vocabulary", token, source)
    return token_id


def _folder_bos_id(
    path: Path, backend: BackendTokenizer, template_tokens: Mapping[str, str]
) -> int | None:
    """BOS from ``tokenizer_config.json``, else from ``generation_config.json``/``config.json``."""
    bos_id = _token_id(backend, template_tokens.get("bos_token"), path)
    if bos_id is not None:
        return bos_id
    for name in ("generation_config.json", "config.json"):
        ids = _ids_of(_read_json(path / name).get("bos_token_id"))
        if ids:
            return ids[0]
    return None


def _folder_eos_ids(
    path: Path, backend: BackendTokenizer, template_tokens: Mapping[str, str]
) -> set[int]:
    """The tokenizer's EOS plus the generation config's (or, lacking one, the model config's)."""
    eos = _token_id(backend, template_tokens.get("eos_token"), path)
    ids = set() if eos is None else {eos}
    for name in ("generation_config.json", "config.json"):
        config_ids = _ids_of(_read_json(path / name).get("eos_token_id"))
        if config_ids:
            return ids | set(config_ids)
    return ids


def _folder_chat_template(path: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` if present (it wins, as in transformers), else the config's."""
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = {item.get("name"): item.get("template") for item in template}
    if isinstance(template, dict):
        if "default" not in template:
            logger.warning("%s has several chat templates but no 'default'; using none", path)
        template = template.get("default")
    return template if isinstance(template, str) else None


# ================================================================================= chat templates


@lru_cache(maxsize=16)
def _compile_chat_template(source: str, origin: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_tag_extension(), jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _template_namespace()
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ModelFormatError(
            f"The chat template of {origin} is not valid Jinja: {error}"
        ) from error


def _raise_exception(message: str) -> None:
    """``raise_exception(...)`` in a template: the template rejects the messages."""
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps``, without Jinja's HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """``strftime_now("%d %b %Y")`` in a template: the current local time."""
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` in a template, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _template_namespace() -> type:
    """Jinja's ``namespace`` that refuses underscore names, as transformers' does."""
    import jinja2.exceptions
    import jinja2.utils

    def check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes, got {name!r}."
            )

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as Namespace
            self, rest = args[0], args[1:]
            attributes = dict(*rest, **kwargs)
            for name in attributes:
                check(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _generation_tag_extension() -> type:
    """``{% generation %}...{% endgeneration %}``, which only marks text, rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    return GenerationTag


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: no ``None`` values, reasoning aliased."""
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise PromptError(f"A chat message must be a dict, not {type(message).__name__}.")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


# ================================================================================= GGUF and cache


def gguf_cache_key(path: Path) -> str:
    """A cheap key that changes when the file changes: real path, size, mtime, tool versions."""
    stat = path.stat()
    parts = [
        str(CACHE_FORMAT),
        os.path.realpath(path),
        str(stat.st_size),
        str(stat.st_mtime_ns),
        _package_version("tokenizers"),
        _package_version("transformers"),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _package_version(name: str) -> str:
    """An installed package's version, read from its metadata (no import)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _load_cache_entry(entry: Path) -> Tokenizer | None:
    """The tokenizer cached in ``entry``, or ``None`` if it is missing, stale or damaged."""
    sidecar_file = entry / SIDECAR_FILE
    if not sidecar_file.is_file():
        return None
    try:
        sidecar = json.loads(sidecar_file.read_text(encoding="utf-8"))
        tokenizer = _from_sidecar(BackendTokenizer.from_file(str(entry / TOKENIZER_FILE)), sidecar)
    except Exception as error:  # a damaged cache is rebuilt, never fatal
        logger.warning("Ignoring the damaged tokenizer cache %s: %s", entry, error)
        return None
    expected = (CACHE_FORMAT, tokenizer.vocab_size, tokenizer.add_bos)
    if (sidecar.get("format"), sidecar.get("vocab_size"), sidecar.get("add_bos")) != expected:
        logger.warning("Ignoring the inconsistent tokenizer cache %s", entry)
        return None
    return tokenizer


def _from_sidecar(backend: BackendTokenizer, sidecar: Mapping[str, Any]) -> Tokenizer:
    """A :class:`Tokenizer` from a backend and the sidecar fields written with it."""
    return Tokenizer(
        backend,
        bos_id=sidecar["bos_id"],
        eos_ids=sidecar["eos_ids"],
        chat_template=sidecar["chat_template"],
        template_tokens=sidecar["template_tokens"],
        source=sidecar["source"],
    )


def _write_cache_entry(entry: Path, backend: BackendTokenizer, sidecar: Mapping[str, Any]) -> None:
    """Write ``tokenizer.json`` then the sidecar, each atomically; the sidecar marks completion."""
    entry.mkdir(parents=True, exist_ok=True)
    _write_atomic(entry / TOKENIZER_FILE, backend.to_str())
    _write_atomic(entry / SIDECAR_FILE, json.dumps(sidecar, ensure_ascii=False, indent=1))


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file next to ``path`` and rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is not secret
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _convert_gguf(path: Path) -> tuple[BackendTokenizer, dict[str, Any]]:
    """Build the tokenizer of a GGUF file with transformers; return it and its cache sidecar."""
    metadata = read_gguf_metadata(path)
    _require_tokenizer_metadata(path, metadata)
    hf_tokenizer = _transformers_gguf_tokenizer(path, metadata)
    backend = hf_tokenizer.backend_tokenizer
    if backend.get_vocab_size(with_added_tokens=True) != metadata["tokenizer.ggml.tokens"]:
        logger.warning("transformers' tokenizer of %s has a different vocabulary size", path)
    eos_ids = [metadata[key] for key in _GGUF_EOS_KEYS if isinstance(metadata.get(key), int)]
    tokenizer = Tokenizer(
        backend,
        bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_ids=eos_ids,
        chat_template=metadata.get("tokenizer.chat_template"),
        template_tokens={k: str(v) for k, v in hf_tokenizer.special_tokens_map.items()},
        source=os.path.realpath(path),
    )
    tokenizer.eos_ids |= tokenizer.end_of_turn_ids()
    return backend, tokenizer._sidecar()


def _require_tokenizer_metadata(path: Path, metadata: Mapping[str, Any]) -> None:
    """Raise :class:`ModelFormatError` unless the file describes a tokenizer."""
    missing = [
        key for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if key not in metadata
    ]
    if missing:
        raise ModelFormatError(
            f"GGUF file {path} has no tokenizer: its metadata lacks {', '.join(missing)}."
        )


def _transformers_gguf_tokenizer(path: Path, metadata: Mapping[str, Any]) -> Any:
    """transformers' fast tokenizer for the file, loaded from a folder holding only the file.

    The file is linked into an empty temporary folder so that tokenizer files lying next to it
    (a Hugging Face snapshot, say) cannot mix into the conversion.
    """
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="specfork-gguf-") as folder:
        link = Path(folder) / path.name
        try:
            link.symlink_to(path.resolve())
        except OSError:  # no symlinks here (some Windows setups): use the file's own folder
            folder, link = str(path.parent), path
        try:
            return AutoTokenizer.from_pretrained(folder, gguf_file=link.name)
        except Exception as error:  # transformers raises many types for files it cannot convert
            kind = metadata.get("tokenizer.ggml.model")
            raise ModelFormatError(
                f"transformers cannot build the tokenizer (tokenizer.ggml.model={kind!r}) of "
                f"GGUF file {path}: {error}"
            ) from error


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """A GGUF file's metadata; string arrays (the vocabulary, the merges) appear as their length.

    Uses transformers' header reader, which skips the big arrays, when it exists; otherwise
    ``gguf.GGUFReader`` (much slower on large vocabularies).
    """
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata as fast_reader
    except ImportError:
        fast_reader = None
    try:
        if fast_reader is not None:
            return fast_reader(str(path))[0]
        return _read_metadata_with_gguf(path)
    except (OSError, ValueError, KeyError, IndexError, struct.error, UnicodeDecodeError) as error:
        raise ModelFormatError(f"Cannot read the GGUF metadata of {path}: {error}") from error


def _read_metadata_with_gguf(path: Path) -> dict[str, Any]:
    """Metadata via ``gguf.GGUFReader``: scalars as values, string arrays as their length."""
    from gguf import GGUFReader, GGUFValueType

    metadata: dict[str, Any] = {}
    for key, field in GGUFReader(path).fields.items():
        if field.types[:1] == [GGUFValueType.ARRAY] and field.types[-1] == GGUFValueType.STRING:
            metadata[key] = len(field.data)
        else:
            metadata[key] = field.contents()
    return metadata
