"""`benchmarks/drafter_replay.py`: replaying plain decoding's greedy output through a drafter
counts the target forwards a chain drafter would need (no model, no gate)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from specfork.drafters.ngram import NgramDrafter
from specfork.drafters.suffix import SuffixDrafter
from specfork.drafters.suffix_index import SuffixIndex

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 1, 2, 3, 4, 5, 6, 7, 8]
OUTPUT = [9, 1, 2, 3, 4, 5, 6, 7, 8, 0]  # copies the prompt after "1", then leaves it


@pytest.fixture(scope="module")
def replay_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "drafter_replay", ROOT / "benchmarks" / "drafter_replay.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_replay_counts_the_forwards_of_a_chain_drafter(replay_script) -> None:
    # after 9 (nowhere before): a plain step; after "1": 2…8 copied and accepted, 0 from the target
    assert replay_script.replay(NgramDrafter(), PROMPT, OUTPUT, 16) == (2, 9)
    # four at a time: 2 3 4 5, then after "4 5 6": 7 8 accepted and 9 rejected
    assert replay_script.replay(NgramDrafter(), PROMPT, OUTPUT, 4) == (3, 9)


def test_a_replay_indexes_each_answer_for_the_next_request(replay_script) -> None:
    source = SuffixDrafter(SuffixIndex())
    replay_script.replay(source, PROMPT, OUTPUT, 16)
    assert source.index.sequences() == [PROMPT + OUTPUT]
    # a later request whose answer repeats the first one's ending drafts it from the index:
    # "1 2 3" (3 tokens) drafts 4 5 6; "1 2 3 4 5 6" drafts 7 8 and then 0, the earlier answer's
    # ending (as frequent as the prompt's 9, and the lower id); two forwards, both fully accepted
    assert replay_script.replay(source, [3, 9, 1, 2], [3, 4, 5, 6, 7, 8, 0], 16) == (2, 6)


def test_drafter_names_are_read_or_refused(replay_script) -> None:
    assert replay_script.drafter("ngram:max=5").max_ngram == 5
    assert replay_script.drafter("suffix:factor=4,prob=0.2").settings.spec_factor == 4.0
    assert not replay_script.drafter("suffix:own=0").settings.own
    with pytest.raises(SystemExit, match="unknown drafter"):
        replay_script.drafter("medusa")
