"""The suffix trie's nodes as integer ids into flat arrays, not one Python object each.

A shared index holds up to `max_tokens · depth` nodes (~270k after a few long prompts, ~800k
at the default budget). As objects, every full garbage collection walked all of them: ~100 ms,
twice in four 3.4k-token requests, paid by whichever request's round it fell in. Here a node
is a row of three `array`s (its count, and its one child inline: token and id); a node with
several children keeps them in a dict of ints. Neither arrays nor dicts of ints are tracked by
the collector, so the index costs it nothing.
"""

from __future__ import annotations

from array import array

ROOT = 0  # the root's id
NONE = -1  # no node


class Nodes:
    """The nodes of one trie. Ids of removed subtrees are reused."""

    __slots__ = ("_free", "count", "more", "only", "token")

    def __init__(self) -> None:
        self.count = array("q", [0])  # how often the node's substring occurs
        self.token = array("q", [NONE])  # the inline child's token
        self.only = array("q", [NONE])  # the one child, when there is exactly one
        self.more: dict[int, dict[int, int]] = {}  # node -> {token: child}, from two children
        self._free: list[int] = []

    def __len__(self) -> int:
        """Live nodes, the root included."""
        return len(self.count) - len(self._free)

    def get(self, node: int, token: int) -> int:
        """The child of `node` for `token`, or NONE."""
        only = self.only[node]
        if only != NONE:
            return only if self.token[node] == token else NONE
        more = self.more.get(node)
        return NONE if more is None else more.get(token, NONE)

    def child(self, node: int, token: int) -> int:
        """The child of `node` for `token`, made (count 0) if missing."""
        found = self.get(node, token)
        return found if found != NONE else self.add(node, token)

    def add(self, node: int, token: int) -> int:
        """A new child of `node` for `token` (count 0), which has none yet."""
        made = self._new()
        more = self.more.get(node)
        if more is not None:
            more[token] = made
        elif self.only[node] == NONE:
            self.token[node], self.only[node] = token, made
        else:
            self.more[node] = {self.token[node]: self.only[node], token: made}
            self.token[node], self.only[node] = NONE, NONE
        return made

    def remove(self, node: int, token: int) -> None:
        """Drop `node`'s child for `token` and its whole subtree."""
        more = self.more.get(node)
        if more is None:
            gone = self.only[node]
            self.token[node], self.only[node] = NONE, NONE
        else:
            gone = more.pop(token)
            if len(more) == 1:
                ((self.token[node], self.only[node]),) = more.items()
                del self.more[node]
        stack = [gone]
        while stack:
            dropped = stack.pop()
            stack.extend(kid for _, kid in self.items(dropped))
            self.count[dropped], self.token[dropped], self.only[dropped] = 0, NONE, NONE
            self.more.pop(dropped, None)
            self._free.append(dropped)

    def items(self, node: int) -> list[tuple[int, int]]:
        """(token, child) of every child of `node`."""
        only = self.only[node]
        if only != NONE:
            return [(self.token[node], only)]
        more = self.more.get(node)
        return [] if more is None else list(more.items())

    def continued(self, node: int) -> bool:
        """Whether `node` has children (its substring occurred followed by something)."""
        return self.only[node] != NONE or node in self.more

    def _new(self) -> int:
        if self._free:
            return self._free.pop()
        self.count.append(0)
        self.token.append(NONE)
        self.only.append(NONE)
        return len(self.count) - 1
