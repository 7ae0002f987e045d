"""Tokenizers for specfork models, from a Hugging Face folder or from GGUF metadata.

:class:`Tokenizer` wraps a fast ``tokenizers.Tokenizer`` plus what generation needs: the BOS id and
whether :meth:`Tokenizer.encode` prepends it, every id that ends a turn, and the chat template
(rendered as transformers renders it: `chat_template`). A GGUF file's tokenizer is converted
once and cached (`gguf_tokenizer`); generated ids become text through `stream_decode`.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as BackendTokenizer

from specfork.checks import is_int
from specfork.errors import ConfigError, ModelFormatError, PromptError
from specfork.loading.chat_template import compile_chat_template, template_messages
from specfork.loading.gguf_tokenizer import (
    CACHE_FORMAT,
    convert_gguf,
    gguf_cache_key,
    read_cache_entry,
    write_cache_entry,
)
from specfork.loading.stream_decode import StreamDecoder

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
#: characters above which a text is tokenized by `encode_batch`, which releases the GIL: a
#: server's engine thread keeps decoding while a long prompt (even one about to be refused as
#: too long) is tokenized — `encode` holds the GIL throughout (1.6 s for 2.1 M characters)
LONG_TEXT = 4096

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
_END_OF_TURN_PROBE = "SpecforkEndOfTurnProbe"


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
        cached = cls._from_cache(entry)
        if cached is not None:
            logger.debug("Loaded the tokenizer of %s from the cache %s", path, entry)
            return cached
        started = time.perf_counter()
        logger.info("Converting the tokenizer of %s (once; cached in %s)", path, entry)
        backend, fields = convert_gguf(path)
        tokenizer = cls(backend, **fields)
        tokenizer.eos_ids |= tokenizer.end_of_turn_ids()
        logger.info("Converted the tokenizer of %s in %.1f s", path, time.perf_counter() - started)
        try:
            write_cache_entry(entry, backend, tokenizer._sidecar())
        except OSError as error:
            logger.warning("Cannot write the tokenizer cache %s (%s); not caching", entry, error)
            return tokenizer
        # Read the entry back, so a first load behaves exactly like every cached one.
        return cls._from_cache(entry) or tokenizer

    @classmethod
    def _from_cache(cls, entry: Path) -> Tokenizer | None:
        """The tokenizer cached in ``entry``, or ``None`` if it is missing, stale or damaged."""
        cached = read_cache_entry(entry)
        if cached is None:
            return None
        backend, sidecar = cached
        try:
            tokenizer = cls(
                backend,
                bos_id=sidecar["bos_id"],
                eos_ids=sidecar["eos_ids"],
                chat_template=sidecar["chat_template"],
                template_tokens=sidecar["template_tokens"],
                source=sidecar["source"],
            )
        except Exception as error:  # a damaged cache is rebuilt, never fatal
            logger.warning("Ignoring the damaged tokenizer cache %s: %s", entry, error)
            return None
        if (sidecar.get("vocab_size"), sidecar.get("add_bos")) != (
            tokenizer.vocab_size,
            tokenizer.add_bos,
        ):
            logger.warning("Ignoring the inconsistent tokenizer cache %s", entry)
            return None
        return tokenizer

    # ----------------------------------------------------------------------------- encode/decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS (and EOS) as the model wants.

        A text that already starts with the BOS token, like a rendered chat template, does not
        get a second one.
        """
        if len(text) > LONG_TEXT:  # the batch call lets other threads run while it works
            ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and ids[:2] == [self.bos_id, self.bos_id]:
            del ids[0]
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token's string (byte-level and byte-fallback spellings
        have at least one character per byte): no token stands for more text than this."""
        return max(len(t) for t in self._backend.get_vocab(with_added_tokens=True))

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

    def token_id(self, token: str) -> int | None:
        """The id of a token's string (special tokens included), or None."""
        return self._backend.token_to_id(token)

    def save(self, path: Path) -> None:
        """Write the backend as a ``tokenizer.json`` file (what transformers and vLLM read)."""
        self._backend.save(str(path))

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

        template = compile_chat_template(self.chat_template, self.source)
        try:
            return template.render(
                messages=template_messages(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.template_tokens,
            )
        except jinja2.TemplateError as error:
            raise PromptError(
                f"The chat template of {self.source} rejected the messages: {error}"
            ) from error
        except (TypeError, ValueError) as error:  # e.g. a number where the template adds text
            raise PromptError(
                f"The chat template of {self.source} cannot render the messages ({error}); "
                "give each message a string role and string content"
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
        return [item for item in value if is_int(item)]
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


def folder_chat_template(path: Path) -> str | None:
    """The chat template of a tokenizer folder, read without building its tokenizer."""
    return _folder_chat_template(path, _read_json(path / "tokenizer_config.json"))


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
