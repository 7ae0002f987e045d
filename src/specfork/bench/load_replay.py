"""Workload replay for the load run (`benchmarks/serve_load.py --workload NAME`): the agent loop
and multi-turn chats as a server meets them, from concurrent clients.

A `Conversation` is a workload item (`specfork.bench.workloads`): its context (a system prompt
listing tools, say) and its user messages (follow-ups, tool results given as user messages).
`replay_level` hands whole conversations to client threads — conversation i mod their number for
the i-th — and each client sends a conversation's turns in order as streamed chat requests: turn
t's messages are the context, the earlier user messages with the server's own answers to them
as assistant messages, then the t-th user message. The history is what the server answered,
as in a real agent loop; under greedy decoding those answers are deterministic, so a turn's
request is the same in every configuration and at every concurrency, and the load run's
same-text check holds per (conversation, turn).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from itertools import zip_longest
from typing import Any, Protocol

from specfork.bench.load import LevelRunner, RequestSample
from specfork.bench.prompt_file import BenchPrompt, Message, Prompt
from specfork.bench.workloads import workload_names, workload_prompts


@dataclass(frozen=True)
class Conversation:
    """One conversation to replay: the messages before its first turn and its user messages."""

    name: str  # the workload item's question_id
    context: tuple[Message, ...]
    turns: tuple[str, ...]

    @classmethod
    def of(cls, prompt: BenchPrompt) -> Conversation:
        return cls(str(prompt.question_id), prompt.context, prompt.turns)

    def messages(self, answers: Sequence[str]) -> list[Message]:
        """The request of turn len(answers) + 1: the context, each earlier user message
        followed by the server's answer to it, then the next user message."""
        if len(answers) >= len(self.turns):
            raise ValueError(f"{self.name} has {len(self.turns)} turns, all answered")
        history: list[Message] = [dict(m) for m in self.context]
        for user, answer in zip(self.turns, answers, strict=False):
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return [*history, {"role": "user", "content": self.turns[len(answers)]}]

    def first_messages(self) -> list[Message]:
        """Turn 1's request (the library's decode check runs it)."""
        return self.messages(())

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "context": list(self.context), "turns": list(self.turns)}


def workload_conversations(name: str) -> list[Conversation]:
    """The conversations of workload `name` in file order; ``all``: every workload's, taken in
    turn (the first of each workload, then the second of each, ...), so that the first few
    conversations a level replays cover every workload."""
    each = [[Conversation.of(p) for p in workload_prompts(w)] for w in workload_names(name)]
    return [c for group in zip_longest(*each) for c in group if c is not None]


class ChatClient(Protocol):
    """What a replay needs of a client (`specfork.bench.load.LoadClient`)."""

    def request(
        self, prompt_index: int, prompt: Prompt, max_tokens: int | None = None, turn: int = 1
    ) -> RequestSample: ...


def replay(client: ChatClient, index: int, conversation: Conversation) -> list[RequestSample]:
    """Every turn of `conversation` in order, each after the server's earlier answers; a sample
    per turn (its `prompt` is `index`, its `turn` the turn number from 1)."""
    answers: list[str] = []
    samples = []
    for turn in range(1, len(conversation.turns) + 1):
        sample = client.request(index, conversation.messages(answers), turn=turn)
        answers.append(sample.text)
        samples.append(sample)
    return samples


def replay_level(
    conversations: Sequence[Conversation], client: ChatClient, n: int, concurrency: int
) -> tuple[float, list[RequestSample]]:
    """`n` conversations (the i-th is conversation i mod their number) from `concurrency` client
    threads, each thread replaying whole conversations; (wall seconds, samples in conversation
    order, turns in order)."""
    jobs = [i % len(conversations) for i in range(n)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency, thread_name_prefix="load-client") as pool:
        done = list(pool.map(lambda i: replay(client, i, conversations[i]), jobs))
    return time.perf_counter() - t0, [s for samples in done for s in samples]


def replay_runner(conversations: Sequence[Conversation]) -> LevelRunner:
    """`specfork.bench.load.sweep`'s runner for a replay of `conversations`."""
    if not conversations:
        raise ValueError("no conversations to replay")
    return partial(replay_level, conversations)
