"""Incremental detokenization: token ids in, text out, never half a character.

:class:`StreamDecoder` turns a stream of token ids into text the way vLLM's
``detokenize_incrementally`` does: it decodes a small window of recent tokens and emits the
difference, so byte-level tokens never show half a character and SentencePiece tokens keep the
spaces they only get in context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: How many already-shown tokens a StreamDecoder keeps as decoding context (vLLM uses 5).
STREAM_CONTEXT = 5
REPLACEMENT_CHAR = "\ufffd"


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
