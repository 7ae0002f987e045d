"""Structured output: constraints (JSON schema, JSON object, regex) with every strategy.

Constrained plain decoding masks the target's logits to the grammar's allowed tokens at every
step. What is checked:

1. Constraints validate on construction (bad schema, bad regex → ConfigError; no model).
2. `GrammarState.constrain` on a tree: the masks of its rows equal those of a fresh matcher fed
   each row's prefix, and nodes the grammar forbids are cut (kept as leaves when sampled).
3. Greedy exactness on a tiny random model (fast): speculative n-gram, DSpark, SPORK and test
   drafters that propose forbidden tokens give constrained plain decoding's tokens exactly.
4. Sampling: constrained speculative sampling draws the constrained plain distribution
   (chi-square on the joint of the first two tokens), with sampled drafts that propose
   forbidden tokens; a broken variant (cutting sampled forbidden nodes) fails the same test.
5. The packaged model (slow): JSON outputs parse and every strategy equals constrained plain.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console

from distribution import goodness_of_fit
from specfork.bench.report import load_results
from specfork.cli import bench as bench_command
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.constraint import Constraint
from specfork.drafters.base import Draft, DraftShape, Feedback, chain_draft
from specfork.engine.generator import Generator
from specfork.engine.grammar import GrammarState, grammar_tokenizer
from specfork.engine.round import constrained
from specfork.errors import ConfigError, ConstraintError
from specfork.loading.loader import LoadedModel, load_model
from specfork.sampling import probabilities, sample
from specfork.tree import Tree
from specfork.verify import verify_sampling
from tiny_models import tiny_chat_llama

RECORD = r'\{"id": [0-9]{1,4}, "tag": "[a-z]{1,6}", "ok": (true|false)\}'
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "level": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "level", "kind"],
    "additionalProperties": False,
}
TINY_SPECS = {
    "ngram": SpecConfig("speculative", k=4, goodput=False),
    "dspark": SpecConfig("dspark", goodput=False),
    "spork": SpecConfig("spork", drafter="recycle+ngram"),
}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with a byte-level tokenizer (one token per byte); its config's
    EOS is <|im_end|> (258)."""
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-structured"), seed=3, eos_token_id=258)


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path) -> LoadedModel:
    return load_model(str(tiny_folder), dtype="float32", device="cpu", progress=False)


def _state(loaded: LoadedModel, constraint: Constraint) -> GrammarState:
    vocab = loaded.config.vocab_size
    return GrammarState(constraint, grammar_tokenizer(loaded.tokenizer, vocab), vocab)


def _ids(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- 1. validation


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Constraint.json_schema('{"type": "integr"}'), "Invalid type"),
        (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
        (lambda: Constraint.json_schema("[1, 2]"), "must be a JSON object"),
        (lambda: Constraint.regex("(unclosed"), "unclosed group"),
        (lambda: Constraint.regex(""), "non-empty pattern"),
        (lambda: Constraint("yaml", "x"), "unknown constraint kind"),
        (lambda: GenerationConfig(constraint={"type": "object"}), "must be a specfork.Constraint"),
    ],
)
def test_bad_constraints_are_config_errors(make, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as info:
        make()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Constraint.regex(r"[^\s\S]"),
        lambda: Constraint.regex("[a&&b]"),
        lambda: Constraint.json_schema({"$ref": "#"}),
        lambda: Constraint.json_schema(
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        ),
    ],
)
def test_a_constraint_that_matches_no_text_is_refused_before_decoding(
    tiny: LoadedModel, make
) -> None:
    """These compile, yet no text satisfies them: the request is refused when it opens (a
    ConstraintError naming the fix), not by a failed mask in the middle of a batch's step."""
    constraint = make()
    with pytest.raises(ConstraintError, match=r"matches no text at all.*fix the pattern"):
        _state(tiny, constraint)
    gen = Generator(tiny)
    with pytest.raises(ConstraintError, match="matches no text at all"):
        gen.generate("x", chat=False, config=GenerationConfig(constraint=constraint))
    ok = _state(tiny, Constraint.regex("[0-9]+"))
    assert ok.mask().sum() == 10 and ok.mask().sum() == 10  # the first mask, then recomputed


def test_a_constraint_dearer_than_its_mask_budget_is_refused_or_ended(tiny: LoadedModel) -> None:
    """`max_mask_ms`: a grammar whose first mask costs more is refused when the request opens;
    one that grows dear later (here: the budget lowered mid-run, as a stand-in for a pattern
    whose later masks cost more) ends with a ConstraintError at the next mask. Without a
    budget the same constraint runs to the end."""
    constraint = Constraint.regex("[a-z]{1,40}")
    gen = Generator(tiny)
    tight = GenerationConfig(max_new_tokens=8, constraint=constraint, max_mask_ms=1e-9)
    with pytest.raises(ConstraintError, match=r"ms to enforce per token, over the limit.*bounds"):
        gen.generate("x", chat=False, config=tight)
    roomy = GenerationConfig(
        max_new_tokens=8, ignore_eos=True, constraint=constraint, max_mask_ms=1e6
    )
    within = gen.generate("x", chat=False, config=roomy)
    unlimited = gen.generate("x", chat=False, config=replace(roomy, max_mask_ms=None))
    assert within.text == unlimited.text and re.fullmatch("[a-z]{1,8}", within.text)
    state = _state(tiny, constraint)
    state.mask()
    state.mask_budget = 1e-12  # every mask from now on is over it
    with pytest.raises(ConstraintError, match="over the limit"):
        state.mask()
    with pytest.raises(ConfigError, match="max_mask_ms must be a number > 0"):
        GenerationConfig(max_mask_ms=0)


def test_constraints_compare_by_source() -> None:
    assert Constraint.json_schema(SCHEMA) == Constraint.json_schema(json.dumps(SCHEMA))
    assert Constraint.json_object().describe() == "json_object"
    assert Constraint.json_object().matches('{"a": 1}') and not Constraint.json_object().matches(
        "[1]"
    )
    assert not Constraint.json_schema(SCHEMA).matches('{"a": ')


# ----------------------------------------------------------------------------- 2. tree masks


def test_tree_masks_follow_each_prefix(tiny: LoadedModel) -> None:
    constraint = Constraint.regex(r"ab(c|d)e|b[0-9]+")
    a, b, c, d, e, z, one = (_ids(tiny, ch)[0] for ch in "abcdez1")
    # root ─ a ─ b ─ c ─ e        (all allowed)
    #      │     └ z              (forbidden: cut with its subtree)
    #      │         └ e
    #      ├ b ─ 1                (allowed)
    #      └ z                    (forbidden)
    tree = Tree([a, b, c, e, z, e, b, one, z], [-1, 0, 1, 2, 1, 4, -1, 6, -1])
    state = _state(tiny, constraint)
    draft, allowed = state.constrain(Draft(tree))
    assert draft.tokens.tolist() == [a, b, c, e, b, one]
    assert draft.tree.parents.tolist() == [-1, 0, 1, 2, -1, 4]
    paths = [[], [a], [a, b], [a, b, c], [a, b, c, e], [b], [b, one]]
    for row, prefix in enumerate(paths):
        fresh = _state(tiny, constraint)
        fresh.advance(prefix)
        assert torch.equal(allowed[row], fresh.mask()), f"row {row} (prefix {prefix})"
    assert bool(allowed[0, a]) and not bool(allowed[0, z])
    assert state.matcher.validate_tokens([a, b, d, e]) == 4  # rolled back to the root
    sampled, allowed = state.constrain(Draft(tree, q=torch.ones(len(tree), 260) / 260))
    assert sampled.tokens.tolist() == [a, b, c, e, z, b, one, z]  # forbidden ones as leaves
    assert sampled.q is not None and sampled.q.shape == (8, 260) and allowed.shape == (9, 260)


# ----------------------------------------------------------------------------- 3. greedy, tiny


class ForbiddenDrafter:
    """Proposes a known continuation with a forbidden token at draft position `bad` (a chain),
    or as a tree: a forbidden first child, then the continuation as its sibling."""

    name = "forbidden"
    cost = 0.0
    wants_logits = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, continuation: list[int], bad_token: int, bad: int, tree: bool) -> None:
        self.continuation, self.bad_token, self.bad, self.tree = continuation, bad_token, bad, tree
        self.prompt_len = 0

    def begin(self, prompt_ids: list[int]) -> None:
        self.prompt_len = len(prompt_ids)

    def propose(self, history, shape: DraftShape, sampling, rng) -> Draft:
        m = len(history) - self.prompt_len
        tokens = self.continuation[m : m + 4]
        if not tokens:
            return chain_draft([])
        if not self.tree:
            if self.bad < len(tokens):
                tokens[self.bad] = self.bad_token
            return chain_draft(tokens)
        parents = [-1, -1, *range(1, len(tokens))]  # the bad root child, then the chain
        return Draft(Tree([self.bad_token, *tokens], parents))

    def observe(self, feedback: Feedback) -> None:
        pass


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kind", ["regex", "schema"])
def test_tiny_greedy_speculation_equals_constrained_plain(tiny: LoadedModel, kind: str) -> None:
    constraint = Constraint.regex(RECORD) if kind == "regex" else Constraint.json_schema(SCHEMA)
    config = GenerationConfig(max_new_tokens=80, constraint=constraint)
    prompt = "Give a record."
    plain = Generator(tiny).generate(prompt, config=config)
    assert plain.finish_reason == "stop", plain.text  # the grammar's end ends the output
    if kind == "regex":
        assert re.fullmatch(RECORD, plain.text), plain.text
    else:
        value = json.loads(plain.text)
        assert (
            set(value) == {"name", "level", "kind"}
            and value["kind"] in SCHEMA["properties"]["kind"]["enum"]
        )
    unconstrained = Generator(tiny).generate(prompt, config=GenerationConfig(max_new_tokens=20))
    assert unconstrained.text != plain.text[: len(unconstrained.text)]  # the mask mattered
    for name, spec in TINY_SPECS.items():
        got = Generator(tiny, spec=spec).generate(prompt, config=config)
        assert got.token_ids == plain.token_ids, name
        assert got.finish_reason == "stop" and got.stats.grammar_seconds > 0, name
    bad = _ids(tiny, "~")[0]  # no record has a "~"
    for tree in (False, True):
        for position in (0, 2):
            drafter = ForbiddenDrafter(plain.token_ids, bad, position, tree)
            spec = SpecConfig("speculative", k=4, goodput=False)
            gen = Generator(tiny, spec=spec, drafter=drafter)
            got = gen.generate(prompt, config=config)
            assert got.token_ids == plain.token_ids, (tree, position)
            assert got.stats.accepted >= (len(plain.token_ids) // 2 if tree or position else 0)


@pytest.mark.usefixtures("one_thread")
def test_ignore_eos_still_ends_with_the_grammar(tiny: LoadedModel) -> None:
    config = GenerationConfig(
        max_new_tokens=80, ignore_eos=True, constraint=Constraint.regex(RECORD)
    )
    got = Generator(tiny, spec=TINY_SPECS["spork"]).generate("Go.", config=config)
    assert got.finish_reason == "stop" and re.fullmatch(RECORD, got.text)


def test_unusable_tokenizer_is_a_config_error(tiny: LoadedModel) -> None:
    class NoBackend:
        eos_ids = frozenset({1})

    with pytest.raises(ConfigError, match="drop the JSON schema"):
        grammar_tokenizer(NoBackend(), 260)  # type: ignore[arg-type]


@pytest.mark.usefixtures("one_thread")
def test_bench_runs_constrained(tiny_folder: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Go."]}) + "\n")
    out = tmp_path / "out"
    argv = [
        "bench",
        "--model",
        str(tiny_folder),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--prompts",
        str(prompts),
        "-n",
        "80",
        "--repeats",
        "1",
        "--out",
        str(out),
        "--quiet",
        "--no-plots",
        "--regex",
        RECORD,
        "--prompt-suffix",
        " As a record.",
        "--strategies",
        "ar,speculative:ngram?k=4,dspark:ngram,spork:recycle+ngram",
    ]
    parser = argparse.ArgumentParser(prog="specfork")
    bench_command.add_parser(parser.add_subparsers(dest="command"))
    assert bench_command.run(parser.parse_args(argv), Console(stderr=True)) == 0
    doc = load_results(out)
    assert doc["settings"]["constraint"] == {"kind": "regex", "source": RECORD}
    for label, by_cat in doc["summary"].items():
        assert by_cat["overall"]["valid_rate"] == 1.0, label
        assert by_cat["overall"]["exact_match_rate"] == 1.0, label
    assert "output valid" in (out / "report.md").read_text()
    with pytest.raises(ConfigError, match="cannot run constrained"):
        bench_command.run(parser.parse_args([*argv[:-1], "ar,hf:ar"]), Console(stderr=True))


# ----------------------------------------------------------------------------- 4. sampling

REGEX = "[a-d][0-3]"  # two tokens: 4 × 4 joint outcomes
SAMPLES = 12_000


class CuttingState(GrammarState):
    """BROKEN: cuts sampled forbidden nodes too (their rejection then skips the residual)."""

    @staticmethod
    def _keeps_forbidden(draft: Draft) -> bool:
        return False


def _drafter_q(allowed: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random q [V] with half its mass on forbidden tokens and half on allowed ones."""
    raw = torch.rand(allowed.shape[0], generator=gen) ** 2  # [V]
    inside, outside = raw * allowed, raw * ~allowed
    return 0.5 * inside / inside.sum() + 0.5 * outside / outside.sum()


def _joint_counts(tiny: LoadedModel, state_cls: type[GrammarState], seed: int) -> tuple:
    """Joint counts of the first two tokens of constrained speculative sampling with a drafter
    that samples chains of 2 tokens from its q (half its mass on forbidden tokens), and the
    exact joint of constrained plain sampling."""
    vocab = tiny.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)
    state = state_cls(Constraint.regex(REGEX), grammar_tokenizer(tiny.tokenizer, vocab), vocab)
    m0 = state.mask()  # [V] the first position's allowed tokens
    state.advance([int(m0.nonzero()[0])])
    m1 = state.mask()  # [V] the second's (the same after any first token)
    logits = {0: 2 * torch.randn(vocab, generator=gen)}  # the target at each output position
    logits[1] = 2 * torch.randn(vocab, vocab, generator=gen)  # [V, V] after token t
    q = {0: _drafter_q(m0, gen), 1: torch.stack([_drafter_q(m1, gen) for _ in range(vocab)])}

    def target(prefix: list[int]) -> torch.Tensor:  # the target's logits after `prefix`
        return logits[0] if not prefix else logits[1][prefix[0]]

    def drafter(prefix: list[int]) -> torch.Tensor:
        return q[0] if not prefix else q[1][prefix[0]]

    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for _ in range(SAMPLES):
        state.matcher.reset()
        emitted: list[int] = []
        while len(emitted) < 2:
            tokens, qs = [], []
            for _ in range(2 - len(emitted)):  # the drafter samples up to the second token
                qs.append(drafter(emitted + tokens))
                tokens.append(int(sample(qs[-1], gen)))
            draft, allowed = state.constrain(chain_draft(tokens, torch.stack(qs)))
            path = emitted + draft.tokens.tolist()
            rows = torch.stack([target(path[:i]) for i in range(len(emitted), len(path) + 1)])
            p = probabilities(constrained(rows, allowed), params)  # [N + 1, V]
            if len(draft):
                out = verify_sampling(draft.tokens, p, draft.q, gen).tokens
            else:
                out = [int(sample(p[0], gen))]
            emitted += state.advance(out)
        counts[emitted[0], emitted[1]] += 1
    p0 = probabilities(constrained(logits[0], m0), params).double()  # [V]
    p1 = probabilities(constrained(logits[1], m1.expand(vocab, -1)), params).double()  # [V, V]
    return counts.flatten(), (p0[:, None] * p1).flatten()


@pytest.mark.usefixtures("one_thread")
def test_constrained_speculative_sampling_is_exact(tiny: LoadedModel) -> None:
    counts, exact = _joint_counts(tiny, GrammarState, seed=0)
    assert goodness_of_fit(counts, exact) > 1e-3
    tv = 0.5 * float((counts / counts.sum() - exact).abs().sum())
    assert tv < 0.05, tv


@pytest.mark.usefixtures("one_thread")
def test_cutting_sampled_forbidden_drafts_fails_the_same_test(tiny: LoadedModel) -> None:
    counts, exact = _joint_counts(tiny, CuttingState, seed=0)
    assert goodness_of_fit(counts, exact) < 1e-3


# ----------------------------------------------------------------------------- 5. packaged model

JSON_PROMPTS = [
    "Describe a cat as a JSON object with its name, age and color.",
    "Give me a JSON object for a book: title, author, year.",
]
SLOW_SPECS = {
    "ngram": SpecConfig("speculative", k=4),
    "dspark": SpecConfig("dspark"),
    "spork": SpecConfig("spork", drafter="recycle+ngram"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["json_object", "schema"])
def test_packaged_model_json_parses_and_speculation_is_exact(
    smollm_f32: LoadedModel, kind: str
) -> None:
    constraint = (
        Constraint.json_object() if kind == "json_object" else Constraint.json_schema(SCHEMA)
    )
    config = GenerationConfig(max_new_tokens=96, constraint=constraint)
    plain = Generator(smollm_f32)
    gens = {name: Generator(smollm_f32, spec=spec) for name, spec in SLOW_SPECS.items()}
    for prompt in JSON_PROMPTS:
        ref = plain.generate(prompt, config=config)
        assert ref.finish_reason == "stop", ref.text
        value = json.loads(ref.text)
        assert isinstance(value, dict) and (
            kind == "json_object" or set(value) == set(SCHEMA["required"])
        )
        for name, gen in gens.items():
            got = gen.generate(prompt, config=config)
            assert got.token_ids == ref.token_ids, (name, prompt, got.text, ref.text)


def test_the_schema_flag_takes_a_file_or_inline_json(tmp_path: Path) -> None:
    from specfork.cli.common import constraint_from_args

    def flags(text: str) -> argparse.Namespace:
        return argparse.Namespace(json=False, regex=None, json_schema=text)

    assert constraint_from_args(flags(json.dumps(SCHEMA))) == Constraint.json_schema(SCHEMA)
    file = tmp_path / "schema.json"
    file.write_text(json.dumps(SCHEMA), encoding="utf-8")
    assert constraint_from_args(flags(str(file))) == Constraint.json_schema(SCHEMA)
    # inline JSON that is not an object is judged as a schema, not looked up as a file name
    for inline in ("[1, 2]", json.dumps(list(range(200)))):  # the long one is no file name
        with pytest.raises(ConfigError, match="must be a JSON object"):
            constraint_from_args(flags(inline))
    with pytest.raises(ConfigError, match="cannot read the schema file"):
        constraint_from_args(flags("y" * 300))
    with pytest.raises(ConfigError, match="cannot read the schema file"):
        constraint_from_args(flags(str(tmp_path / "missing.json")))
