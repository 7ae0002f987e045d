"""A multi-turn chat on one `Generator`: the conversation as messages, each turn one request.

Every turn's prompt is the whole conversation so far through the model's chat template, so the
model sees what a chat server would send it. The turns run on one scheduler with a prefix
cache (on batch-invariant models, where a cache hit cannot change the output): a later turn
reuses the keys and values of the earlier turns and prefills only what is new — the latest
user message and the template's markers. When the conversation no longer fits the context
with room for a reply, its oldest exchanges are dropped (and counted in `dropped`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.engine.batch import Scheduler
from specfork.engine.generator import Generator, TextStream
from specfork.engine.lifecycle import GenerationResult
from specfork.engine.request import Request
from specfork.errors import ConfigError, PromptError

log = logging.getLogger(__name__)

PREFIX_CACHE_BYTES = 256 * 2**20  # KV of earlier turns kept (batch-invariant models)
MIN_REPLY_TOKENS = 64  # room a turn keeps for its reply when old exchanges must go


@dataclass(frozen=True, slots=True)
class Turn:
    """One exchange: what the user said, the reply, and the request's result."""

    user: str
    reply: str
    result: GenerationResult


class ChatSession:
    """A conversation with a chat model (see the module doc). `send(text)` streams the reply;
    the exchange joins the history once the reply is complete (an interrupted reply is
    dropped with its message). `reset()` forgets the conversation; `system` is its system
    message (kept across resets)."""

    def __init__(
        self,
        generator: Generator,
        *,
        system: str | None = None,
        config: GenerationConfig | None = None,
        sampling: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        if not isinstance(generator, Generator):
            raise ConfigError(f"a chat runs on a Generator, not a {type(generator).__name__}")
        if generator.tokenizer.chat_template is None:
            raise ConfigError(
                "this model has no chat template, so it cannot chat; use an instruct model "
                "(e.g. the default SmolLM2-135M-Instruct) or `specfork generate --no-chat`"
            )
        if system is not None and (not isinstance(system, str) or not system.strip()):
            raise ConfigError("system must be a non-empty string or None")
        self.generator = generator
        self.system = system
        self.config = config or GenerationConfig()
        self.sampling = sampling or SamplingParams()
        self.spec = spec
        if prefix_cache_bytes is None:
            prefix_cache_bytes = PREFIX_CACHE_BYTES if generator.model.batch_invariant else 0
        self._scheduler = Scheduler.alone(generator, prefix_cache_bytes)
        self.turns: list[Turn] = []
        self.dropped = 0  # earliest exchanges left out of the prompt (the context was full)

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.turns.clear()
        self.dropped = 0

    def messages(self, user: str | None = None) -> list[dict[str, str]]:
        """The conversation as chat messages (the exchanges that still fit), then `user`."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for turn in self.turns[self.dropped :]:
            out.append({"role": "user", "content": turn.user})
            out.append({"role": "assistant", "content": turn.reply})
        if user is not None:
            out.append({"role": "user", "content": user})
        return out

    def send(self, text: str) -> TextStream:
        """Stream the reply to `text` (the exchange is kept once the stream is exhausted)."""
        if not isinstance(text, str) or not text.strip():
            raise PromptError("a chat message needs some text")
        ids = self._fitting_prompt(text)
        req = self.generator.open_request(
            ids, config=self.config, sampling=self.sampling, spec=self.spec
        )
        return TextStream(self._events(text, req), req.logprobs)

    def _fitting_prompt(self, text: str) -> list[int]:
        """The prompt ids of the conversation and `text`, its oldest exchanges dropped while
        it leaves less than a reply's room in the context."""
        context = self.generator.context
        room = min(self.config.max_new_tokens, MIN_REPLY_TOKENS, context // 4)
        while True:
            ids = self.generator.prompt_ids(self.messages(text), chat=True, config=self.config)
            if len(ids) + room <= context or self.dropped == len(self.turns):
                return ids  # (a lone message too long for the context is refused by open)
            self.dropped += 1
            log.warning(
                "the conversation no longer fits the context of %d tokens: left out the "
                "oldest exchange (%d left out so far)",
                context,
                self.dropped,
            )

    def _events(self, text: str, req: Request) -> Iterator[str | GenerationResult]:
        scheduler = self._scheduler
        running = scheduler.admit(req)
        try:
            while not running.finished:
                for update in scheduler.step():
                    yield update.text
                    if update.result is not None:
                        self.turns.append(Turn(text, update.result.text, update.result))
                        yield update.result
        finally:
            scheduler.cancel(running)
