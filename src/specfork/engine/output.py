"""Turns accepted tokens into output text, deciding exactly where the output stops.

Tokens arrive in blocks (one per decoding round; a speculative round accepts several). They are
taken one at a time so that a stop inside a block ends the output where plain decoding would:
EOS and stop ids end it before that token; a stop string ends the text exactly before the
string; `max_new_tokens` ends it after that many tokens. Streaming holds back any tail of the
text that could still become a stop string, so nothing shown is ever taken back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from specfork.config import GenerationConfig
from specfork.loading.tokenizer import Tokenizer


class OutputBuilder:
    """Accumulates tokens and text of one request and applies its stop rules."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: GenerationConfig,
        max_tokens: int,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self.config = config
        self.max_tokens = min(config.max_new_tokens, max_tokens)
        self.stop_ids = set(config.stop_token_ids)
        if not config.ignore_eos:
            self.stop_ids |= set(tokenizer.eos_ids)
        self.decoder = tokenizer.stream_decoder(context=prompt_ids[-8:], skip_special_tokens=True)
        self.token_ids: list[int] = []
        self.pieces: list[str] = []  # each kept token's text, decoded in context
        self.text = ""
        self.finish_reason: str | None = None
        self._emitted = 0  # characters of self.text already handed to the caller
        self._longest_stop = max((len(s) for s in config.stop), default=0)
        self._failures = [_failure(s) for s in config.stop]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, tokens: Iterable[int]) -> int:
        """Take a block of accepted tokens; returns how many were used before a stop."""
        used = 0
        for tok in tokens:
            if self.done:
                break
            used += 1
            self._add_one(int(tok))
        return used

    def _add_one(self, tok: int) -> None:
        if tok in self.stop_ids:
            self.finish("stop")
            return
        self.token_ids.append(tok)
        before = len(self.text)
        self.pieces.append(self.decoder.feed(tok))
        self.text += self.pieces[-1]
        if self.config.stop and self._cut_at_stop_string(before):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_tokens:
            self.finish("length")

    def _cut_at_stop_string(self, before: int) -> bool:
        start = max(0, before - self._longest_stop + 1)
        hits = [i for s in self.config.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def finish(self, reason: str) -> None:
        """End the output for a reason found outside the tokens (context full, cancelled)."""
        if not self.done:
            # a character cut in half by the limit is dropped, not shown as U+FFFD
            self.text += self.decoder.flush().rstrip("\ufffd")
            self._cut_at_stop_string(0)
            self.finish_reason = reason

    def new_text(self) -> str:
        """Text not yet handed out that no later stop string can take back."""
        end = len(self.text)
        if not self.done:
            end -= self._held_back()
        delta = self.text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string
        (linear in the stop strings' lengths: a KMP automaton run over the text's tail)."""
        held = 0
        for stop, fail in zip(self.config.stop, self._failures, strict=True):
            tail = self.text[len(self.text) - min(len(self.text), len(stop) - 1) :]
            held = max(held, _prefix_suffix(stop, fail, tail))
        return held


def _failure(pattern: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of pattern[:i+1]."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


def _prefix_suffix(pattern: str, fail: list[int], text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `pattern`."""
    k = 0
    for ch in text:
        if k == len(pattern):
            k = fail[k - 1]
        while k and ch != pattern[k]:
            k = fail[k - 1]
        if ch == pattern[k]:
            k += 1
    return fail[k - 1] if k == len(pattern) else k
