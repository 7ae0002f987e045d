"""Presence/frequency penalties and logit biases (specfork/penalties.py): each verified row gets
exactly plain decoding's penalised logits, so every strategy's output equals plain decoding's
with the same settings — greedy, and seeded sampling token for token."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.engine.generator import Generator
from specfork.errors import ConfigError
from specfork.kernels import load_kernels
from specfork.loading.loader import LoadedModel, load_model
from specfork.models.cost import CostCurve
from specfork.penalties import penalized, row_paths
from specfork.strategies.rate_memory import RateBook
from tiny_models import tiny_chat_llama

KERNELS = load_kernels() is not None
CURVE = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.25, 1.5, 2.3, 3.9, 6.8))
PROMPTS = ["the cat sat on the mat and the cat sat on the mat", "abc abc abc abc", "x"]
STRATEGIES = {
    "ngram": SpecConfig("speculative", "ngram", k=4),
    "dspark": SpecConfig("dspark", "ngram"),
    "spork": SpecConfig("spork", "recycle+ngram"),
}
# a negative frequency penalty favours repeats: drafts get accepted, and their paths count
PENALTIES = {"presence_penalty": 0.3, "frequency_penalty": -0.6, "logit_bias": ((65, 3.0),)}


def _reference(logits, params, output, paths) -> torch.Tensor:
    """Plain decoding's penalised logits, row by row, from the whole text before the row."""
    out = logits.clone()
    for row, path in enumerate(paths):
        for token, count in Counter([*output, *path]).items():
            out[row, token] -= params.frequency_penalty * count + params.presence_penalty
        for token, bias in params.logit_bias:
            out[row, token] += bias
    return out


def test_row_paths_of_a_chain_and_a_tree() -> None:
    assert row_paths([7, 8, 9], None) == [[], [7], [7, 8], [7, 8, 9]]
    tree = row_paths([5, 6, 7, 8], [-1, -1, 0, 2])  # 5 and 6 under the root, 7 under 5, 8 under 7
    assert tree == [[], [5], [6], [5, 7], [5, 7, 8]]


@pytest.mark.parametrize("seed", range(5))
def test_every_row_gets_the_penalties_of_its_own_path(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = 12
    output = torch.randint(0, vocab, (9,), generator=gen).tolist()
    tokens = torch.randint(0, vocab, (6,), generator=gen).tolist()
    parents = [-1, 0, 0, 1, -1, 3]
    paths = row_paths(tokens, parents)
    logits = torch.randn(len(paths), vocab, generator=gen)
    params = SamplingParams(
        presence_penalty=0.5, frequency_penalty=-0.25, logit_bias=((3, -100.0), (4, 2.5))
    )
    got = penalized(logits, params, output, paths)
    torch.testing.assert_close(got, _reference(logits, params, output, paths))
    assert torch.equal(logits, logits.clone())  # the input is left as it was
    assert penalized(logits, SamplingParams(), output, paths) is logits  # none: untouched


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be"),
        ({"logit_bias": ((1, 101.0),)}, "bias in [-100, 100]"),
        ({"logit_bias": ((-1, 1.0),)}, "token id >= 0"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "names a token id twice"),
        ({"logit_bias": ((True, 1.0),)}, "token id >= 0"),
    ],
)
def test_bad_settings(fields: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**fields)


def test_logit_bias_as_a_mapping() -> None:
    assert SamplingParams(logit_bias={7: 1.0, 3: -2.0}).logit_bias == ((3, -2.0), (7, 1.0))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, one_thread) -> LoadedModel:
    folder = tiny_chat_llama(tmp_path_factory.mktemp("tiny-pen"), chat=False, seed=3)
    return load_model(str(folder), dtype="float32", kernels=KERNELS, progress=False)


def _results(loaded: LoadedModel, spec: SpecConfig | None, sampling: SamplingParams) -> list:
    """Every prompt drafts from the gate's prior (no rates handed on): the tests need rows that
    verification decides."""
    gen = Generator(loaded, spec=spec, cost_curve=CURVE, rates=RateBook(shared=False))
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    return [gen.generate(p, config=config, sampling=sampling) for p in PROMPTS]


def _run(loaded: LoadedModel, spec: SpecConfig | None, sampling: SamplingParams) -> list:
    return [r.token_ids for r in _results(loaded, spec, sampling)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_speculation_with_penalties_equals_plain_decoding(
    loaded: LoadedModel, name: str, temperature: float
) -> None:
    """Greedy, and seeded sampling (a token's draw depends on the seed and its position only,
    so a correct p at every row gives plain decoding's tokens exactly)."""
    sampling = SamplingParams(temperature=temperature, seed=11, **PENALTIES)
    plain = _run(loaded, None, sampling)
    speculative = _results(loaded, STRATEGIES[name], sampling)
    assert [r.token_ids for r in speculative] == plain
    assert sum(r.stats.accepted for r in speculative) > 0  # drafted rows decided some tokens
    unpenalized = _run(loaded, None, SamplingParams(temperature=temperature, seed=11))
    assert plain != unpenalized  # the settings change the output


def test_a_bias_of_100_takes_over_and_minus_100_bans(loaded: LoadedModel) -> None:
    plain = _run(loaded, None, SamplingParams())
    banned = plain[0][0]
    without = _run(loaded, STRATEGIES["spork"], SamplingParams(logit_bias=((banned, -100.0),)))
    assert all(banned not in ids for ids in without)
    forced = _run(loaded, STRATEGIES["ngram"], SamplingParams(logit_bias=((42, 100.0),)))
    assert all(set(ids) == {42} for ids in forced)


def test_a_bias_outside_the_vocabulary_is_refused(loaded: LoadedModel) -> None:
    gen = Generator(loaded)
    vocab = loaded.model.config.vocab_size
    with pytest.raises(ConfigError, match=f"token id {vocab}, outside the vocabulary"):
        gen.generate("hi", sampling=SamplingParams(logit_bias=((vocab, 1.0),)))


def test_the_cli_flags(capsys: pytest.CaptureFixture[str], loaded: LoadedModel) -> None:
    from cli_run import run_cli

    folder = str(loaded.path)
    base = ["generate", "-m", folder, "--dtype", "float32", "--no-chat", "-q", "-n", "6"]
    code, out, err = run_cli(capsys, [*base, "--logit-bias", "42=100", "--strategy", "spork", "x"])
    assert code == 0, err
    assert out == loaded.tokenizer.decode([42] * 6) + "\n"
    for bad, words in (("42", "TOKEN_ID=BIAS"), ("a=1", "TOKEN_ID=BIAS"), ("1=500", "[-100, 100]")):
        code, out, err = run_cli(capsys, [*base, "--logit-bias", bad, "x"])
        assert code == 2 and out == "" and words in err
    code, out, err = run_cli(capsys, [*base, "--presence-penalty", "3", "x"])
    assert code == 2 and "presence_penalty must be a number in [-2, 2]" in err
