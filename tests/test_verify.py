"""Verification: greedy unit tests and statistical tests that speculative sampling is lossless.

Distribution tests (ARCHITECTURE.md, "Testing"). For each configuration the target's p_j
(j = 0..K) and the drafter's q_j (j = 0..K-1) are fixed per position and independent of the
prefix, so whenever a round emits at least j + 1 tokens, its j-th emitted token must be
distributed exactly as p_j. Every round draws the K draft tokens from q, runs `verify_sampling`
with a seeded generator and records the emitted tokens. Per position the test requires:

- a chi-square goodness-of-fit test against p_j (bins with expected count < 5 merged) with
  p-value >= 1e-3, and no token ever emitted where p_j is 0 (a masked token);
- at position 0 a total-variation distance <= 0.01 from p_0;
- acceptance rate of draft token j (given the first j were accepted) equal to
  sum_x min(p_j(x), q_j(x)) within 5 binomial sigma.

Rounds. `verify_sampling` verifies one chain per call (data-dependent control flow, so it
cannot be batched or vmapped without changing the library) and one call costs 100-170 µs on
this shared 2-core machine, so 100 000 rounds would take 10-17 s per configuration. The
library is therefore run for ROUNDS = 25 000 rounds per configuration (~3-4 s each; draft
tokens for all rounds are drawn from q at once, only the verifier runs in a Python loop).
That still has ample power: the chi-square test at this size rejects distortions of a few
0.01 in total variation (the broken verifiers below distort position 0 by 0.1-0.3 and get
p-values that underflow to 0), the acceptance tolerance is 5 sigma of the same N, and for
every configuration whose TV is checked the expected sampling noise of the position-0 TV at
this N is asserted to be < 0.0045 (its standard deviation is ~0.002), so that the 0.01 bound
is meaningful rather than a coin flip. The negative controls are test code and are written
batched, so they (and a correct batched reference) run the full 100 000 rounds.

The TV bound needs a p_0 whose mass is on a modest number of tokens: for a broad p over 1000
tokens, sampling noise alone gives a TV of ~0.03 even at 100 000 rounds. The broad
1000-token configuration ("v1000-k1-t0.5-broad") is therefore checked with the chi-square
test (up to 1000 bins) and the acceptance rate only; the test asserts that its TV noise is
indeed above the bound, documenting why.

Configurations (each factor covered at least once, not the full cross product):
  v10-k1-t0.5                     vocab 10,   K=1, T=0.5, no mask
  v10-k5-t1.5-topk6               vocab 10,   K=5, T=1.5, top-k 6
  v1000-k3-t1-topp0.9             vocab 1000, K=3, T=1.0, top-p 0.9
  v1000-k5-t1.5-topk20-topp0.95   vocab 1000, K=5, T=1.5, top-k 20 + top-p 0.95
  v1000-k1-t0.5-broad             vocab 1000, K=1, T=0.5, no mask (no TV check)
  one-hot q: vocab 1000, K=3, T=1.0, top-k 10, 20 000 rounds
  controls (batched, 100 000 rounds): vocab 10, K=3, T=1.0, no mask; vocab 1000, K=3, T=1.0,
  top-k 50
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from distribution import (
    chi2_sf,
    clamped_residual,
    goodness_of_fit,
    p_itself,
    tv_noise,
    unclamped_residual,
)
from specfork.config import SamplingParams
from specfork.sampling import make_generator, probabilities, sample
from specfork.verify import Verdict, one_hot_q, verify_greedy, verify_sampling

ALPHA = 1e-3  # chi-square p-value below which a distribution test fails
TV_MAX = 0.01  # total-variation bound at position 0
SIGMAS = 5.0  # tolerance of the acceptance rates, in binomial standard deviations
ROUNDS = 25_000  # rounds per distribution configuration (see the module docstring)
CONTROL_ROUNDS = 100_000  # rounds per negative control (batched, see below)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Large elementwise ops over 100 000 rounds are 10-40x slower with 2 OpenMP threads on a
    shared, busy 2-core machine; one thread for this module, restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


Verifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], Verdict]


# ------------------------------------------------------------------------------ greedy


def logits_with_argmax(argmax: list[int], vocab: int = 8, seed: int = 0) -> torch.Tensor:
    """Random logits [len(argmax), vocab] whose row i has its maximum at argmax[i]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(argmax), vocab, generator=g)  # [N, V]
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


def test_verify_greedy_all_accepted_adds_the_bonus_token():
    target = logits_with_argmax([3, 1, 4, 6])  # [K + 1 = 4, V]
    verdict = verify_greedy(torch.tensor([3, 1, 4]), target)
    assert verdict == Verdict(path=list(range(3)), tokens=[3, 1, 4, 6])


def test_verify_greedy_first_rejected_emits_only_the_target_token():
    target = logits_with_argmax([3, 1, 4, 6])
    verdict = verify_greedy(torch.tensor([2, 1, 4]), target)
    assert verdict == Verdict(path=list(range(0)), tokens=[3])


def test_verify_greedy_rejection_in_the_middle():
    target = logits_with_argmax([3, 1, 4, 6, 0, 2])
    verdict = verify_greedy(torch.tensor([3, 1, 5, 6, 0]), target)
    assert verdict == Verdict(path=list(range(2)), tokens=[3, 1, 4])
    # later agreement after a mismatch does not count
    verdict = verify_greedy(torch.tensor([3, 7, 4, 6, 0]), target)
    assert verdict == Verdict(path=list(range(1)), tokens=[3, 1])


def test_verify_greedy_empty_draft_emits_the_target_token():
    target = logits_with_argmax([5])  # [1, V]
    verdict = verify_greedy(torch.empty(0, dtype=torch.long), target)
    assert verdict == Verdict(path=list(range(0)), tokens=[5])
    assert all(isinstance(t, int) for t in verdict.tokens)


def test_verify_sampling_empty_draft_emits_one_token_from_p():
    p = torch.zeros(1, 6)
    p[0, 4] = 1.0
    q = torch.empty(0, 6)
    verdict = verify_sampling(torch.empty(0, dtype=torch.long), p, q, torch.Generator())
    assert verdict == Verdict(path=list(range(0)), tokens=[4])


def test_an_empty_draft_draws_what_sample_draws_from_the_same_stream():
    """Plain decoding's round: one draw from p[0], the generator left where `sample` leaves it
    (no uniform for the empty draft)."""
    p = torch.rand(1, 500, generator=torch.Generator().manual_seed(1))
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    empty = torch.empty(0, dtype=torch.long)
    got = [verify_sampling(empty, p, None, a).tokens[0] for _ in range(50)]
    assert got == [int(sample(p[0], b)) for _ in range(50)]
    assert torch.equal(a.get_state(), b.get_state())


def test_verify_sampling_is_reproducible_with_a_seed():
    cfg = CONFIGS[1]
    p, q = cfg.distributions()
    drafts = torch.multinomial(q, 200, replacement=True, generator=torch.Generator().manual_seed(1))

    def run(seed: int) -> list[Verdict]:
        g = torch.Generator().manual_seed(seed)
        return [verify_sampling(d, p, q, g) for d in drafts.T]

    assert run(7) == run(7)
    assert run(7) != run(8)


# ------------------------------------------------------------------- statistical checks


def test_chi2_sf_matches_tables():
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(10.827566, 1) == pytest.approx(1e-3, rel=1e-5)
    assert chi2_sf(0.0, 4) == 1.0


def test_goodness_of_fit_detects_and_accepts():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, generator=g), -1)
    p[7] = 0.0
    p /= p.sum()
    good = torch.bincount(torch.multinomial(p, 20_000, True, generator=g), minlength=50)
    assert goodness_of_fit(good, p) > ALPHA
    skewed = p.clone()
    skewed[p.argmax()] *= 1.1
    skewed /= skewed.sum()
    bad = torch.bincount(torch.multinomial(skewed, 20_000, True, generator=g), minlength=50)
    assert goodness_of_fit(bad, p) < ALPHA
    bad = good.clone()
    bad[7] = 1  # one masked token observed
    assert goodness_of_fit(bad, p) == 0.0


@dataclass(frozen=True)
class Config:
    """One distribution-test setting: vocabulary, draft length, sampling transforms."""

    name: str
    vocab: int
    k: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    logit_scale: float = 1.0  # std of the target logits (larger = more concentrated p)
    drift: float = 1.0  # std of the noise added to get the draft logits (p != q)
    check_tv: bool = True
    seed: int = 0

    def distributions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """p [K + 1, V] and q [K, V], both through `probabilities` with the same params."""
        g = torch.Generator().manual_seed(self.seed)
        target_logits = torch.randn(self.k + 1, self.vocab, generator=g) * self.logit_scale
        noise = torch.randn(self.k, self.vocab, generator=g) * self.drift
        draft_logits = target_logits[: self.k] + noise  # [K, V]
        params = SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        return probabilities(target_logits, params), probabilities(draft_logits, params)


@dataclass
class Outcome:
    """What `rounds` verifications emitted."""

    tokens: torch.Tensor  # [R, K + 1] emitted tokens, -1 after the end of each round
    accepted: torch.Tensor  # [R]
    drafts: torch.Tensor  # [R, K]


def run_rounds(
    verifier: Verifier,
    p: torch.Tensor,
    q: torch.Tensor,
    rounds: int,
    seed: int,
    drafts: torch.Tensor | None = None,
) -> Outcome:
    """Draw drafts from q (unless given) and verify each round with a seeded generator."""
    k = q.shape[0]
    if drafts is None:
        draft_gen = torch.Generator().manual_seed(seed)
        drafts = torch.multinomial(q, rounds, replacement=True, generator=draft_gen).T  # [R, K]
    drafts = drafts.contiguous()
    gen = torch.Generator().manual_seed(seed + 1)
    emitted, accepted = [], []
    with torch.inference_mode():  # a little less per-call overhead; no autograd here anyway
        for draft in drafts.unbind(0):
            verdict = verifier(draft, p, q, gen)
            emitted.append(verdict.tokens + [-1] * (k + 1 - len(verdict.tokens)))
            accepted.append(verdict.accepted)
    return Outcome(torch.tensor(emitted), torch.tensor(accepted), drafts)


@dataclass
class Report:
    """The statistical test's measurements; `failures()` lists what is out of bounds."""

    pvalues: list[float]  # chi-square per output position reached by enough rounds
    tv0: float
    accept_z: list[float]  # (measured - expected) / sigma per draft position

    def failures(self, check_tv: bool = True) -> list[str]:
        out = [
            f"position {j}: chi-square p = {pv:.2e}"
            for j, pv in enumerate(self.pvalues)
            if pv < ALPHA
        ]
        if check_tv and self.tv0 > TV_MAX:
            out.append(f"position 0: TV {self.tv0:.4f} > {TV_MAX}")
        out += [
            f"draft {j}: acceptance off by {z:.1f} sigma"
            for j, z in enumerate(self.accept_z)
            if abs(z) > SIGMAS
        ]
        return out


def check(outcome: Outcome, p: torch.Tensor, q: torch.Tensor, min_rounds: int = 1) -> Report:
    """The distribution test: chi-square per position, TV at 0, acceptance rates."""
    vocab = p.shape[-1]
    tokens, accepted = outcome.tokens, outcome.accepted
    k = outcome.drafts.shape[1]
    emitted = torch.arange(k + 1) <= accepted[:, None]  # [R, K + 1]
    assert torch.equal(tokens >= 0, emitted)  # every round emits accepted + 1 tokens
    for j in range(k):  # accepted tokens are the draft's own
        reached = accepted > j
        assert torch.equal(tokens[reached, j], outcome.drafts[reached, j])
    pvalues = []
    for j in range(k + 1):
        col = tokens[:, j]
        col = col[col >= 0]
        if col.numel() < min_rounds:
            break
        pvalues.append(goodness_of_fit(torch.bincount(col, minlength=vocab), p[j]))
    freq0 = torch.bincount(tokens[:, 0], minlength=vocab).double() / tokens.shape[0]
    tv0 = 0.5 * float((freq0 - p[0].double()).abs().sum())
    accept_z = []
    for j in range(k):
        n = int((accepted >= j).sum())  # rounds that verified draft token j
        if n < min_rounds:
            break
        beta = float(torch.minimum(p[j], q[j]).double().sum())
        rate = int((accepted > j).sum()) / n
        sigma = math.sqrt(max(beta * (1 - beta), 1e-12) / n)
        accept_z.append((rate - beta) / sigma)
    return Report(pvalues, tv0, accept_z)


# Each factor is covered at least once (not the full 2 x 3 x 3 x 4 cross product, which would
# take minutes): vocab {10, 1000}, K {1, 3, 5}, temperature {0.5, 1, 1.5}, masks {none, top-k,
# top-p, both}. Logit scales are chosen so that p_0 is concentrated enough for the TV bound
# (see the module docstring) and drift so that acceptance is 0.3-0.9 (p and q clearly differ).
CONFIGS = [
    Config("v10-k1-t0.5", vocab=10, k=1, temperature=0.5, seed=6),
    Config("v10-k5-t1.5-topk6", vocab=10, k=5, temperature=1.5, top_k=6, logit_scale=2.0, seed=5),
    Config(
        "v1000-k3-t1-topp0.9", vocab=1000, k=3, temperature=1.0, top_p=0.9, logit_scale=3.0, seed=19
    ),
    Config(
        "v1000-k5-t1.5-topk20-topp0.95",
        vocab=1000,
        k=5,
        temperature=1.5,
        top_k=20,
        top_p=0.95,
        logit_scale=5.0,
        seed=0,
    ),
    Config("v1000-k1-t0.5-broad", vocab=1000, k=1, temperature=0.5, check_tv=False, seed=7),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_verify_sampling_output_is_distributed_as_p(cfg: Config):
    p, q = cfg.distributions()
    assert p.shape == (cfg.k + 1, cfg.vocab) and q.shape == (cfg.k, cfg.vocab)
    if cfg.check_tv:  # the TV bound is meaningful only if sampling noise is well below it
        assert tv_noise(p[0], ROUNDS) < 0.0045
    else:
        assert tv_noise(p[0], ROUNDS) > TV_MAX
    outcome = run_rounds(verify_sampling, p, q, ROUNDS, seed=100 + cfg.seed)
    report = check(outcome, p, q, min_rounds=1000)
    assert len(report.pvalues) == cfg.k + 1  # every position, the bonus included, was tested
    assert len(report.accept_z) == cfg.k
    assert report.failures(check_tv=cfg.check_tv) == []


# ------------------------------------------------------------------------ one-hot q


def test_verify_sampling_with_one_hot_q_is_distributed_as_p():
    """Deterministic drafts (n-gram lookup): q is one-hot, the output is still p."""
    cfg = Config(
        "onehot-v1000-k3-topk10",
        vocab=1000,
        k=3,
        temperature=1.0,
        top_k=10,
        logit_scale=3.0,
        seed=18,
    )
    p, _ = cfg.distributions()
    order = p.argsort(-1, descending=True)  # [K + 1, V]
    # a likely token, the 3rd most likely one, then a token masked out of p_2
    draft = torch.stack([order[0, 0], order[1, 2], order[2, -1]])  # [K]
    assert p[2, draft[2]] == 0
    q = one_hot_q(draft, cfg.vocab)  # [K, V]
    rounds = 20_000
    assert tv_noise(p[0], rounds) < 0.0045
    drafts = draft.expand(rounds, cfg.k)
    outcome = run_rounds(verify_sampling, p, q, rounds, seed=200, drafts=drafts)
    report = check(outcome, p, q, min_rounds=1000)
    assert len(report.pvalues) == 3  # positions 0, 1, 2; the masked draft is never accepted
    assert int((outcome.accepted == cfg.k).sum()) == 0
    # includes: acceptance of draft token j is sum(min(p_j, q_j)) = p_j(draft_j) within 5 sigma
    assert report.failures() == []


def test_verify_sampling_without_q_is_the_one_hot_verdict() -> None:
    """q None (deterministic drafts) gives bitwise the verdicts of the one-hot q it stands for,
    seed by seed: the same uniforms, the same residual, the same draw."""
    cfg = Config(
        "none-v500-k4", vocab=500, k=4, temperature=1.0, top_k=20, logit_scale=3.0, seed=21
    )
    p, _ = cfg.distributions()
    order = p.argsort(-1, descending=True)  # [K + 1, V]
    for seed in range(300):
        ranks = torch.tensor([seed % 3, (seed // 3) % 4, 0, (seed // 12) % 25])  # [K]
        draft = order[torch.arange(cfg.k), ranks]  # [K] likely and unlikely tokens
        with_q = verify_sampling(draft, p, one_hot_q(draft, cfg.vocab), make_generator(seed))
        without = verify_sampling(draft, p, None, make_generator(seed))
        assert without == with_q


# ---------------------------------------------------------------------- negative controls
# The broken verifiers are test code, so they are written batched over rounds (one call
# verifies every round at once; identical algorithm to `verify_sampling` except for the
# deliberate bug) and run the full 100 000 rounds of the specification in well under a second.
# The same `check` must pass the correct batched reference and fail each broken variant.

Residual = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def batched_verify(
    drafts: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    generator: torch.Generator,
    residual_of: Residual = clamped_residual,
    accept_all: bool = False,
) -> Outcome:
    """Speculative sampling of drafts [R, K] in one go; `accept_all` is the always-accept bug."""
    rounds, k = drafts.shape
    idx = torch.arange(k)
    p_x, q_x = p[idx, drafts], q[idx, drafts]  # [R, K]
    u = torch.rand(rounds, k, generator=generator)  # [R, K]
    reject = u * q_x >= p_x  # [R, K]
    if accept_all:
        reject = torch.zeros_like(reject)
    accepted = torch.where(reject.any(1), reject.int().argmax(1), k)  # [R] first rejection
    final = torch.empty(rounds, dtype=torch.long)  # [R] the token drawn at position `accepted`
    for j in range(k + 1):
        rows = (accepted == j).nonzero().flatten()
        if rows.numel():
            dist = p[k] if j == k else residual_of(p[j], q[j])  # [V]
            final[rows] = torch.multinomial(dist, rows.numel(), True, generator=generator)
    tokens = torch.full((rounds, k + 1), -1, dtype=torch.long)  # [R, K + 1]
    tokens[:, :k] = torch.where(idx < accepted[:, None], drafts, -1)
    tokens[torch.arange(rounds), accepted] = final
    return Outcome(tokens, accepted, drafts)


CONTROL_CONFIGS = [
    Config("control-v10-k3-t1", vocab=10, k=3, temperature=1.0, seed=0),
    Config(
        "control-v1000-k3-t1-topk50",
        vocab=1000,
        k=3,
        temperature=1.0,
        top_k=50,
        logit_scale=3.0,
        seed=0,
    ),
]
CONTROLS = {
    "always-accept": {"accept_all": True},
    "resample-from-p": {"residual_of": p_itself},
    "residual-unclamped": {"residual_of": unclamped_residual},
}


def control_outcome(cfg: Config, **bug) -> tuple[Outcome, torch.Tensor, torch.Tensor]:
    p, q = cfg.distributions()
    assert tv_noise(p[0], CONTROL_ROUNDS) < 0.0045  # the TV bound is meaningful here
    gen = torch.Generator().manual_seed(300 + cfg.seed)
    drafts = torch.multinomial(q, CONTROL_ROUNDS, replacement=True, generator=gen).T  # [R, K]
    return batched_verify(drafts, p, q, gen, **bug), p, q


@pytest.mark.parametrize("cfg", CONTROL_CONFIGS, ids=lambda c: c.name)
def test_batched_reference_passes_the_distribution_test(cfg: Config):
    outcome, p, q = control_outcome(cfg)
    report = check(outcome, p, q, min_rounds=1000)
    assert len(report.pvalues) == cfg.k + 1
    assert report.failures() == []


@pytest.mark.parametrize("cfg", CONTROL_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("bug", list(CONTROLS))
def test_negative_controls_fail_the_distribution_test(cfg: Config, bug: str):
    outcome, p, q = control_outcome(cfg, **CONTROLS[bug])
    report = check(outcome, p, q, min_rounds=1000)
    assert report.failures() != []
    assert min(report.pvalues) < ALPHA  # the chi-square test detects it...
    assert report.tv0 > TV_MAX  # ...and so does the TV bound at position 0


def test_loop_harness_detects_a_broken_per_call_verifier():
    """The per-call path used for the library (`run_rounds`) detects a bug too, at 5 000 rounds."""

    def broken(draft, p, q, generator) -> Verdict:
        out = batched_verify(draft[None], p, q, generator, residual_of=p_itself)
        n = int(out.accepted[0])
        return Verdict(list(range(n)), out.tokens[0, : n + 1].tolist())

    cfg = CONTROL_CONFIGS[0]
    p, q = cfg.distributions()
    report = check(run_rounds(broken, p, q, 5_000, seed=400), p, q, min_rounds=1000)
    assert report.pvalues[0] < ALPHA
    assert report.tv0 > TV_MAX
