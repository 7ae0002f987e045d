"""NgramDrafter (prompt lookup): matching rules, budget, validation, short histories."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfork.config import SamplingParams
from specfork.drafters.base import Draft, DraftShape, Feedback
from specfork.drafters.ngram import NgramDrafter
from specfork.errors import ConfigError

SAMPLING = SamplingParams()  # n-gram proposals ignore sampling parameters and the rng


def propose(drafter: NgramDrafter, history: list[int], budget: int = 10) -> list[int]:
    draft = drafter.propose(history, DraftShape(budget), SAMPLING, torch.Generator().manual_seed(0))
    assert isinstance(draft, Draft)
    assert draft.q is None  # deterministic proposal: verified as one-hot q
    assert draft.is_chain
    assert draft.forwards == 0  # no model runs
    assert draft.tokens.dtype == torch.long
    assert draft.tokens.dim() == 1
    return draft.tokens.tolist()


def test_no_match_gives_empty_draft():
    drafter = NgramDrafter(max_ngram=3, min_ngram=1)
    assert propose(drafter, [1, 2, 3, 4, 5]) == []  # last token 5 never occurred before
    assert len(drafter.propose([1, 2, 3], DraftShape(4), SAMPLING, torch.Generator())) == 0


def test_empty_and_single_token_history_give_empty_draft():
    drafter = NgramDrafter()
    assert propose(drafter, []) == []
    assert propose(drafter, [7]) == []


def test_unigram_match_proposes_what_followed():
    drafter = NgramDrafter(max_ngram=3, min_ngram=1)
    assert propose(drafter, [5, 6, 7, 8, 9, 5]) == [6, 7, 8, 9, 5]


def test_longest_match_wins_over_a_more_recent_shorter_one():
    # Suffix [1, 2, 3]: the trigram occurs at index 0 (followed by 10, 11); the unigram 3 occurs
    # later at index 6 (followed by 20, 21), which is more recent but only an n=1 match.
    history = [1, 2, 3, 10, 11, 9, 3, 20, 21, 1, 2, 3]
    assert propose(NgramDrafter(max_ngram=3, min_ngram=1), history, budget=2) == [10, 11]
    # With n limited to 1 the most recent unigram match (index 6) is used instead.
    assert propose(NgramDrafter(max_ngram=1, min_ngram=1), history, budget=2) == [20, 21]
    # Suffix bigram [2, 3] also first occurs at index 1, but the trigram is still preferred.
    assert propose(NgramDrafter(max_ngram=2, min_ngram=2), history, budget=2) == [10, 11]


def test_min_ngram_excludes_shorter_matches():
    history = [4, 3, 8, 9, 1, 2, 3]  # only the unigram 3 matches (at index 1)
    assert propose(NgramDrafter(max_ngram=3, min_ngram=1), history, budget=2) == [8, 9]
    assert propose(NgramDrafter(max_ngram=3, min_ngram=2), history, budget=2) == []


def test_most_recent_occurrence_wins():
    # The bigram [1, 2] occurs at 0 (followed by 3) and at 4 (followed by 4); the latest wins.
    history = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2]
    assert propose(NgramDrafter(max_ngram=2, min_ngram=2), history, budget=1) == [4]
    history = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    assert propose(NgramDrafter(max_ngram=2, min_ngram=1), history, budget=3) == [4, 8, 1]


def test_suffix_itself_is_not_a_match():
    # The only occurrence of the suffix is the suffix: no successor exists, so nothing to propose.
    assert propose(NgramDrafter(max_ngram=3, min_ngram=3), [1, 2, 3, 4, 5, 6]) == []


def test_proposal_is_cut_to_the_budget():
    drafter = NgramDrafter(max_ngram=2, min_ngram=1)
    history = [1, 2, 10, 11, 12, 13, 14, 15, 1, 2]
    assert propose(drafter, history, budget=3) == [10, 11, 12]
    assert propose(drafter, history, budget=1) == [10]
    assert propose(drafter, history, budget=0) == []


def test_proposal_shorter_than_budget_when_history_ends():
    drafter = NgramDrafter(max_ngram=2, min_ngram=1)
    # The match [1, 2] at index 2 is followed by only 3 tokens before the history ends
    # (the proposal runs into the suffix itself, as prompt lookup does).
    history = [9, 9, 1, 2, 7, 1, 2]
    assert propose(drafter, history, budget=10) == [7, 1, 2]
    # Repetition: the latest earlier unigram match is one token before the end.
    assert propose(drafter, [5, 5, 5], budget=4) == [5]


def test_history_shorter_than_max_ngram():
    drafter = NgramDrafter(max_ngram=5, min_ngram=1)
    assert propose(drafter, [7, 7], budget=4) == [7]
    assert propose(drafter, [3, 4, 3], budget=4) == [4, 3]
    assert propose(NgramDrafter(max_ngram=5, min_ngram=3), [3, 4, 3], budget=4) == []


def test_does_not_mutate_history_and_returns_a_copy():
    history = [1, 2, 3, 1, 2]
    tokens = NgramDrafter().propose(history, DraftShape(4), SAMPLING, torch.Generator()).tokens
    tokens[0] = 99
    assert history == [1, 2, 3, 1, 2]
    assert propose(NgramDrafter(), history, budget=4) == [3, 1, 2]


def test_begin_and_observe_are_harmless():
    drafter = NgramDrafter()
    drafter.begin([1, 2, 3])
    drafter.observe(Feedback(2, torch.tensor([2, 3])))
    assert propose(drafter, [1, 2, 3, 1, 2], budget=2) == [3, 1]


@pytest.mark.parametrize(
    ("max_ngram", "min_ngram"),
    [(3, 0), (0, 0), (2, 3), (1, -1), (3.0, 1), (3, "1")],
)
def test_invalid_ngram_sizes_raise_config_error(max_ngram, min_ngram):
    with pytest.raises(ConfigError):
        NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)


def test_valid_ngram_sizes():
    drafter = NgramDrafter(max_ngram=4, min_ngram=4)
    assert (drafter.max_ngram, drafter.min_ngram) == (4, 4)
    assert drafter.name == "ngram"


def _reference(history: list[int], depth: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The rule by brute force: the longest suffix n-gram's latest earlier occurrence with a
    successor, and what followed it."""
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        starts = [s for s in range(len(history) - n) if history[s : s + n] == history[-n:]]
        if starts:
            return history[starts[-1] + n : starts[-1] + n + depth]
    return []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), min_size=1, max_size=12),
    st.integers(1, 3),
    st.integers(1, 2),
)
def test_a_growing_history_proposes_what_a_fresh_scan_finds(chunks, max_ngram, min_gap) -> None:
    """The drafter's index follows a history growing round by round (and a history that does
    not continue it, like another conversation's) and proposes what scanning all of it does."""
    min_ngram = max(1, max_ngram - min_gap)
    drafter = NgramDrafter(max_ngram, min_ngram).begin([])
    history: list[int] = []
    for i, chunk in enumerate(chunks):
        history = [*history, *chunk] if i % 5 != 4 else list(chunk)  # every fifth: a new one
        assert propose(drafter, history, budget=4) == _reference(history, 4, max_ngram, min_ngram)
