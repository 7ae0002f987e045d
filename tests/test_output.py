"""Tests of :class:`specfork.engine.output.OutputBuilder`: stops applied token by token, streaming.

The tokenizer is a tiny real one built here with the ``tokenizers`` library: a word-level vocabulary
of hand-picked pieces (whole words, halves of a stop string, a stop string inside a longer token,
the two UTF-8 bytes of "é") written in GPT-2's byte-level alphabet and decoded with the byte-level
decoder, so that every piece decodes to exactly its bytes and a lone byte of a multi-byte character
decodes to U+FFFD, as with real byte-level BPE models. It is saved as a Hugging Face folder and
loaded with :meth:`Tokenizer.from_folder`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from specfork.config import GenerationConfig
from specfork.engine.output import OutputBuilder
from specfork.errors import ConfigError
from specfork.loading.tokenizer import TOKENIZER_FILE, Tokenizer

REPLACEMENT = "\ufffd"
SPECIALS = ["<unk>", "<s>", "</s>", "<|end|>"]
# Plain pieces; each is one token. " ST" + "OP" spell " STOP"; "xSTOPy" holds "STOP" inside.
PIECES: list[bytes] = [
    b"Hello",
    b" world",
    b"!",
    b" ST",
    b"OP",
    b" STOP",
    b"xSTOPy",
    b"x",
    b"S",
    b"T",
    b"O",
    b"P",
    b"\n",
    b"\n\n",
    b" and",
    b" more",
    b"\xc3",  # first byte of "é"
    b"\xa9",  # second byte of "é"
    "é".encode(),
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to the printable characters byte-level BPE vocabularies use."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


BYTE_CHARS = _bytes_to_unicode()


def _token(piece: bytes) -> str:
    return "".join(BYTE_CHARS[b] for b in piece)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("wordlevel")
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for piece in PIECES:
        vocab[_token(piece)] = len(vocab)
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.add_special_tokens(SPECIALS)
    backend.decoder = decoders.ByteLevel()
    backend.save(str(folder / TOKENIZER_FILE))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def ids(tok: Tokenizer):
    """ids("Hello", " world") -> their token ids; "</s>" etc. name the special tokens."""

    def lookup(*pieces: str | bytes) -> list[int]:
        out = []
        for piece in pieces:
            if piece in SPECIALS:
                token = piece
            else:
                token = _token(piece if isinstance(piece, bytes) else piece.encode())
            token_id = tok._backend.token_to_id(token)
            assert token_id is not None, piece
            out.append(token_id)
        return out

    return lookup


def _builder(tok: Tokenizer, max_tokens: int = 1000, **config: object) -> OutputBuilder:
    return OutputBuilder(tok, GenerationConfig(**config), max_tokens=max_tokens)


def _run(builder: OutputBuilder, blocks: Sequence[Sequence[int]]) -> tuple[list[int], list[str]]:
    """Feed blocks, collecting add()'s counts and new_text() after each block."""
    used, deltas = [], []
    for block in blocks:
        used.append(builder.add(block))
        deltas.append(builder.new_text())
    return used, deltas


def test_tokenizer_fixture(tok: Tokenizer, ids) -> None:
    assert tok.eos_ids == {ids("</s>")[0]}
    assert tok.decode(ids("Hello", " world", "!")) == "Hello world!"
    assert tok.decode(ids("</s>", "Hello"), skip_special_tokens=True) == "Hello"
    assert tok.decode(ids(b"\xc3")) == REPLACEMENT
    assert tok.decode(ids(b"\xc3", b"\xa9")) == "é"


# ----------------------------------------------------------------------------- no stop


def test_plain_text_is_streamed_at_once(tok: Tokenizer, ids) -> None:
    b = _builder(tok)
    assert b.add(ids("Hello", " world", "!")) == 3
    assert not b.done and b.finish_reason is None
    assert b.new_text() == "Hello world!"  # no stop strings: nothing held back
    assert b.new_text() == ""
    assert b.token_ids == ids("Hello", " world", "!")


def test_finish_length(tok: Tokenizer, ids) -> None:
    b = _builder(tok)
    b.add(ids("Hello", " world"))
    b.finish("length")
    assert b.finish_reason == "length" and b.done
    assert b.text == "Hello world"
    assert b.add(ids("!")) == 0  # nothing is taken after the end
    assert b.token_ids == ids("Hello", " world")
    b.finish("stop")  # a second finish does not change the reason
    assert b.finish_reason == "length"


def test_finish_releases_held_back_text(tok: Tokenizer, ids) -> None:
    b = _builder(tok, stop=("STOP",))
    b.add(ids("Hello", " ST"))
    assert b.new_text() == "Hello "  # "ST" could become "STOP"
    b.finish("length")
    assert b.new_text() == "ST"
    assert b.text == "Hello ST"


def test_finish_drops_an_incomplete_character(tok: Tokenizer, ids) -> None:
    b = _builder(tok)
    b.add(ids("Hello", b"\xc3"))
    assert b.new_text() == "Hello"  # half a character is never shown
    b.finish("length")
    assert b.text == "Hello"  # ... not even at the end, where it would be U+FFFD
    assert REPLACEMENT not in b.new_text()


# ----------------------------------------------------------------------------- EOS / stop ids


def test_eos_first_in_the_first_block(tok: Tokenizer, ids) -> None:
    b = _builder(tok)
    used, deltas = _run(b, [ids("</s>", "Hello", " world")])
    assert used == [1]  # the EOS itself is consumed, nothing after it
    assert (b.finish_reason, b.text, b.token_ids, deltas) == ("stop", "", [], [""])


def test_eos_first_in_a_later_block(tok: Tokenizer, ids) -> None:
    b = _builder(tok)
    used, deltas = _run(b, [ids("Hello", " world"), ids("</s>", "!")])
    assert used == [2, 1]
    assert (b.finish_reason, b.text) == ("stop", "Hello world")
    assert b.token_ids == ids("Hello", " world")
    assert "".join(deltas) == b.text


@pytest.mark.parametrize("position", [1, 2, 3])
def test_eos_in_the_middle_of_a_block(tok: Tokenizer, ids, position: int) -> None:
    block = ids("Hello", " world", "!", " and")
    block.insert(position, ids("</s>")[0])
    b = _builder(tok)
    assert b.add(block) == position + 1
    assert b.finish_reason == "stop"
    assert b.token_ids == block[:position]
    assert b.text == tok.decode(block[:position])
    assert b.add(ids(" more")) == 0


def test_eos_flushes_held_back_partial_stop(tok: Tokenizer, ids) -> None:
    b = _builder(tok, stop=("STOP",))
    used, deltas = _run(b, [ids("Hello", " ST"), ids("</s>")])
    assert used == [2, 1]
    assert deltas == ["Hello ", "ST"]
    assert (b.text, b.finish_reason) == ("Hello ST", "stop")


def test_extra_stop_token_ids(tok: Tokenizer, ids) -> None:
    end, bang = ids("<|end|>", "!")
    b = _builder(tok, stop_token_ids=(end, bang))
    assert b.add(ids("Hello", " world", "!", " and")) == 3
    assert (b.finish_reason, b.text, b.token_ids) == ("stop", "Hello world", ids("Hello", " world"))

    b = _builder(tok, stop_token_ids=(end,))
    assert b.add([*ids("Hello"), end, *ids(" world")]) == 2
    assert (b.finish_reason, b.text) == ("stop", "Hello")

    b = _builder(tok, stop_token_ids=(end,))  # EOS still stops when extra ids are given
    assert b.add(ids("Hello", "</s>", " world")) == 2
    assert b.finish_reason == "stop"


def test_ignore_eos(tok: Tokenizer, ids) -> None:
    eos = ids("</s>")[0]
    b = _builder(tok, ignore_eos=True)
    block = ids("Hello", "</s>", " world")
    assert b.add(block) == 3
    assert not b.done
    assert b.token_ids == block  # the EOS is an ordinary token now...
    assert b.text == "Hello world"  # ...but its text (a special token) is not shown
    assert eos in b.token_ids

    b = _builder(tok, ignore_eos=True, stop_token_ids=(ids("!")[0],))
    assert b.add(ids("Hello", "</s>", "!", " more")) == 3  # stop ids still apply
    assert b.finish_reason == "stop"
    assert b.token_ids == ids("Hello", "</s>")


# ----------------------------------------------------------------------------- max tokens


@pytest.mark.parametrize("limit", [1, 2, 3, 4])
def test_max_new_tokens_mid_block(tok: Tokenizer, ids, limit: int) -> None:
    block = ids("Hello", " world", "!", " and", " more")
    b = _builder(tok, max_new_tokens=limit)
    assert b.add(block) == limit
    assert b.finish_reason == "length"
    assert b.token_ids == block[:limit]
    assert b.text == tok.decode(block[:limit])
    assert b.new_text() == b.text


def test_max_new_tokens_across_blocks(tok: Tokenizer, ids) -> None:
    b = _builder(tok, max_new_tokens=3)
    used, deltas = _run(b, [ids("Hello", " world"), ids("!", " and"), ids(" more")])
    assert used == [2, 1, 0]
    assert len(b.token_ids) == 3 and b.finish_reason == "length"
    assert "".join(deltas) == b.text == "Hello world!"


def test_context_room_limits_tokens(tok: Tokenizer, ids) -> None:
    b = _builder(tok, max_tokens=2, max_new_tokens=10)
    assert b.max_tokens == 2
    assert b.add(ids("Hello", " world", "!")) == 2
    assert b.finish_reason == "length"


def test_max_tokens_releases_held_back_text(tok: Tokenizer, ids) -> None:
    b = _builder(tok, max_new_tokens=2, stop=("STOP",))
    assert b.add(ids("Hello", " ST")) == 2
    assert b.finish_reason == "length"
    assert b.new_text() == "Hello ST"


def test_stop_string_on_the_last_allowed_token_wins(tok: Tokenizer, ids) -> None:
    b = _builder(tok, max_new_tokens=3, stop=("STOP",))
    assert b.add(ids("Hello", " ST", "OP", "!")) == 3
    assert (b.finish_reason, b.text) == ("stop", "Hello ")


def test_eos_right_after_the_limit_is_not_seen(tok: Tokenizer, ids) -> None:
    b = _builder(tok, max_new_tokens=2)
    assert b.add(ids("Hello", " world", "</s>")) == 2
    assert b.finish_reason == "length"


# ----------------------------------------------------------------------------- stop strings


def test_stop_string_inside_one_token(tok: Tokenizer, ids) -> None:
    b = _builder(tok, stop=("STOP",))
    used, deltas = _run(b, [ids("Hello", " world", "xSTOPy", "!")])
    assert used == [3]  # the token holding the stop string is consumed
    assert (b.finish_reason, b.text) == ("stop", "Hello worldx")
    assert b.token_ids == ids("Hello", " world", "xSTOPy")
    assert deltas == ["Hello worldx"]


def test_stop_string_is_a_whole_token(tok: Tokenizer, ids) -> None:
    b = _builder(tok, stop=(" STOP",))
    assert b.add(ids("Hello", " STOP", " more")) == 2
    assert b.text == "Hello"


def test_stop_string_spanning_two_tokens(tok: Tokenizer, ids) -> None:
    b = _builder(tok, stop=("STOP",))
    assert b.add(ids("Hello", " ST", "OP", " more")) == 3
    assert (b.finish_reason, b.text) == ("stop", "Hello ")
    assert b.new_text() == "Hello "


def test_stop_string_spanning_two_blocks(tok: Tokenizer, ids) -> None:
    b = _builder(tok, stop=("STOP",))
    used, deltas = _run(b, [ids("Hello", " ST"), ids("OP", " and", " more")])
    assert used == [2, 1]
    assert deltas == ["Hello ", ""]  # " ST"'s "ST" was held back, then dropped
    assert (b.finish_reason, b.text) == ("stop", "Hello ")


def test_stop_string_spanning_many_single_char_blocks(tok: Tokenizer, ids) -> None:
    b = _builder(tok, stop=("STOP",))
    blocks = [ids(p) for p in ("Hello", "x", "S", "T", "O", "P", "!")]
    used, deltas = _run(b, blocks)
    assert used == [1, 1, 1, 1, 1, 1, 0]
    assert deltas == ["Hello", "x", "", "", "", "", ""]
    assert (b.finish_reason, b.text) == ("stop", "Hellox")


def test_held_back_text_is_released_when_it_is_no_stop(tok: Tokenizer, ids) -> None:
    b = _builder(tok, stop=("STOP",))
    used, deltas = _run(b, [ids("Hello", " ST"), ids("x"), ids("S", "T", "O"), ids("!")])
    assert used == [2, 1, 3, 1]
    assert deltas == ["Hello ", "STx", "", "STO!"]
    assert not b.done
    assert b.text == "Hello STxSTO!"


def test_only_a_real_prefix_is_held_back(tok: Tokenizer, ids) -> None:
    b = _builder(tok, stop=("\n\n", "STOP"))
    b.add(ids("Hello", "\n"))
    assert b.new_text() == "Hello"  # "\n" may start "\n\n"
    b.add(ids("O"))
    assert b.new_text() == "\nO"  # "O" alone is not a prefix of "STOP"
    b.add(ids("\n\n"))
    assert (b.finish_reason, b.text) == ("stop", "Hello\nO")


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer, ids) -> None:
    # Both complete with the same token; the one that starts first cuts the text.
    b = _builder(tok, stop=("world", "o w"))
    assert b.add(ids("Hello", " world", "!")) == 2
    assert b.text == "Hell"
    # One stop string completes before a longer one that started earlier could.
    b = _builder(tok, stop=("Hello world!", "world"))
    assert b.add(ids("Hello", " world", "!")) == 2
    assert b.text == "Hello "


def test_stop_string_across_a_split_character(tok: Tokenizer, ids) -> None:
    b = _builder(tok, stop=("é!",))
    used, deltas = _run(b, [ids("Hello", b"\xc3"), ids(b"\xa9"), ids("!", " more")])
    assert used == [2, 1, 1]
    assert deltas == ["Hello", "", ""]  # "é" is held back: it may start "é!"
    assert (b.finish_reason, b.text) == ("stop", "Hello")


def test_split_character_is_never_shown_half(tok: Tokenizer, ids) -> None:
    b = _builder(tok)
    used, deltas = _run(b, [ids("Hello", b"\xc3"), ids(b"\xa9", "!"), ids(b"\xc3"), ids(b"\xa9")])
    assert used == [2, 2, 1, 1]
    assert deltas == ["Hello", "é!", "", "é"]
    assert not any(REPLACEMENT in d for d in deltas)
    assert b.text == "Helloé!é"


def test_stop_string_config_validation() -> None:
    with pytest.raises(ConfigError, match="stop strings"):
        GenerationConfig(stop=("",))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)


def test_stop_given_as_a_bare_string(tok: Tokenizer, ids) -> None:
    try:
        config = GenerationConfig(stop="STOP")  # type: ignore[arg-type]
    except ConfigError:
        return  # rejecting it is fine too
    b = OutputBuilder(tok, config, max_tokens=100)
    b.add(ids("Hello", "S", "x"))
    assert b.text == "HelloSx" and not b.done


# ----------------------------------------------------------------------------- property test

STOP_CHOICES = ["STOP", "\n\n", "lo w", "x", "ST", "OPx", "é!", "d!"]
TEXT_PIECES = [p for p in PIECES if p not in (b"\xc3", b"\xa9")]


def _reference(
    pieces: list[bytes], stops: list[str], eos_at: int | None, limit: int
) -> tuple[str, str | None, int]:
    """Plain token-by-token semantics: (text, finish reason, tokens consumed)."""
    text = ""
    for k, piece in enumerate(pieces):
        if k == eos_at:
            return text, "stop", k + 1
        text += piece.decode()
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return text[: min(hits)], "stop", k + 1
        if k + 1 == limit:
            return text, "length", k + 1
    return text, None, len(pieces)


def _longest_held(text: str, stops: list[str]) -> int:
    return max(
        (n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])),
        default=0,
    )


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(TEXT_PIECES), min_size=1, max_size=14),
    stops=st.lists(st.sampled_from(STOP_CHOICES), max_size=3, unique=True),
    cuts=st.lists(st.integers(1, 4), min_size=14, max_size=14),
    eos_at=st.one_of(st.none(), st.integers(0, 13)),
    limit=st.integers(1, 16),
)
def test_blocks_match_token_by_token_semantics(
    tok: Tokenizer,
    ids,
    pieces: list[bytes],
    stops: list[str],
    cuts: list[int],
    eos_at: int | None,
    limit: int,
) -> None:
    tokens = ids(*pieces)
    if eos_at is not None and eos_at < len(tokens):
        tokens.insert(eos_at, ids("</s>")[0])
        pieces = [*pieces[:eos_at], b"", *pieces[eos_at:]]
    else:
        eos_at = None
    expected_text, expected_reason, expected_used = _reference(pieces, stops, eos_at, limit)

    b = _builder(tok, max_new_tokens=limit, stop=tuple(stops))
    blocks, start = [], 0
    for size in cuts:
        if start >= len(tokens):
            break
        blocks.append(tokens[start : start + size])
        start += size
    if start < len(tokens):
        blocks.append(tokens[start:])

    shown, consumed = "", 0
    for block in blocks:
        used = b.add(block)
        assert used == len(block) or b.done
        consumed += used
        shown += b.new_text()
        assert b.text.startswith(shown)  # nothing shown is ever taken back
        if not b.done:  # and nothing is held back that could not become a stop string
            assert len(shown) == len(b.text) - _longest_held(b.text, stops)
    if not b.done:
        b.finish("length")
        shown += b.new_text()
    assert shown == b.text == expected_text
    assert b.finish_reason == (expected_reason or "length")
    assert consumed == expected_used
    eos_consumed = eos_at is not None and eos_at < consumed
    assert len(b.token_ids) == expected_used - int(eos_consumed)


def _held_back_by_brute_force(text: str, stops: Sequence[str]) -> int:
    """The longest suffix of `text` that is a proper prefix of a stop string, by trying all."""
    return max(
        (n for s in stops for n in range(len(s)) if n <= len(text) and text.endswith(s[:n])),
        default=0,
    )


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=8), min_size=1, max_size=3),
)
def test_held_back_text_is_the_longest_stop_prefix(text: str, stops: list[str]) -> None:
    """The linear-time hold-back (a KMP automaton over the text's tail) agrees with trying
    every prefix of every stop string, on small alphabets where borders abound."""
    from specfork.engine.output import _failure, _prefix_suffix

    got = max(
        _prefix_suffix(s, _failure(s), text[len(text) - min(len(text), len(s) - 1) :])
        for s in stops
    )
    assert got == _held_back_by_brute_force(text, stops)


def test_a_long_stop_string_of_one_letter_holds_back_everything(tok: Tokenizer, ids) -> None:
    """A 100 000-character stop string of one repeated letter: every emitted character could
    still begin it, so nothing is shown until the output ends."""
    stop = "x" * 100_000
    out = OutputBuilder(tok, GenerationConfig(max_new_tokens=500, stop=(stop,)), max_tokens=500)
    for _ in range(200):
        out.add(ids("x"))
        assert out.new_text() == ""  # all of it could still become the stop string
    out.finish("length")
    assert out.new_text() == "x" * 200
