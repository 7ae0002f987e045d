"""`benchmarks/drafter_replay.py`: replaying plain decoding's greedy output through a drafter
counts the target forwards a chain drafter would need (no model); through a goodput gate, it
models the speed a cost curve gives (a curve file read as the engine reads it)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

from specfork.drafters.ngram import NgramDrafter
from specfork.drafters.suffix import SuffixDrafter
from specfork.drafters.suffix_index import SuffixIndex
from specfork.models.cost import ROWS, CostCurve, lower_hull

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


def test_a_curve_file_round_trips_and_is_read_as_its_hull(replay_script, tmp_path) -> None:
    spiky = (1.0, 1.0, 1.54, 1.54, 1.54, 1.61, 2.30, 2.66, 4.03, 5.46)
    far = CostCurve(ROWS, tuple(1.0 + 0.25 * (r - 1) for r in ROWS), 1024)
    path = tmp_path / "curve.json"
    replay_script.write_curve(CostCurve(ROWS, spiky, 192, far, 1.4), path)
    os.utime(path, (0, 0))  # older than the cost cache keeps a curve: a file to judge with
    assert replay_script.read_curve(path) is None
    curve = replay_script.read_curve(path, max_age_days=None)
    assert curve.cost == lower_hull(ROWS, spiky) and curve.far == far
    assert curve.context == 192 and curve.far_step == 1.4


def test_a_gated_replay_models_the_speed_by_the_curve(replay_script) -> None:
    cases = [("copy", 1, PROMPT, OUTPUT)] * 3
    cheap = CostCurve((1, 2, 4, 8, 16), (1.0, 1.0, 1.0, 1.0, 1.0))
    dear = CostCurve((1, 2, 4, 8, 16), (1.0, 2.0, 4.0, 8.0, 16.0))
    free = replay_script.replay_gated("ngram", cases, cheap, 16)[("copy", False)]
    plain, cost, tokens, forwards = free
    assert tokens == 3 * (len(OUTPUT) - 1) and forwards < tokens  # copied spans verified
    assert plain / cost == pytest.approx(tokens / forwards)  # rows free: speed = tokens/forward
    paid = replay_script.replay_gated("ngram", cases, dear, 16)[("copy", False)]
    assert paid[3] == paid[2] and paid[0] / paid[1] == pytest.approx(1.0)  # no row ever pays
