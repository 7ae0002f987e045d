"""Statistics shared by the sampling distribution tests (no scipy: torch's gammaincc).

`chi2_stat` pools bins with expected counts below MIN_COUNT; `chi2_sf` is the chi-square
survival function; the residual functions are the correct rejection-sampling residual and the
broken variants the negative controls plug in.
"""

from __future__ import annotations

import math

import torch

MIN_COUNT = 5.0  # minimum expected count per chi-square bin


def chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-square distribution, Q(df / 2, stat / 2)."""
    if df <= 0:
        return 1.0
    if not math.isfinite(stat):
        return 0.0
    a = torch.tensor(df / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_stat(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of counts [V] against p [V].

    Bins with expected count < MIN_COUNT are pooled (and the pool merged with the smallest
    other bin if still too small). A token with p = 0 that was observed gives an infinite
    statistic; a single bin gives (0, 0).
    """
    p = p.double() / p.double().sum()
    expected = p * float(counts.sum())  # [V]
    impossible = expected == 0
    if counts[impossible].sum() > 0:
        return math.inf, 1
    obs, exp = counts[~impossible].double(), expected[~impossible]
    order = exp.argsort()
    obs, exp = obs[order], exp[order]
    small = exp < MIN_COUNT
    if small.any():
        pool_obs, pool_exp = obs[small].sum(), exp[small].sum()
        obs, exp = obs[~small], exp[~small]
        if pool_exp < MIN_COUNT and exp.numel() > 0:
            pool_obs, pool_exp = pool_obs + obs[0], pool_exp + exp[0]
            obs, exp = obs[1:], exp[1:]
        obs, exp = torch.cat([pool_obs.view(1), obs]), torch.cat([pool_exp.view(1), exp])
    if exp.numel() < 2:
        return 0.0, 0
    return float(((obs - exp) ** 2 / exp).sum()), exp.numel() - 1


def goodness_of_fit(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square p-value of observed counts [V] against probabilities p [V]."""
    return chi2_sf(*chi2_stat(counts, p))


def tv_noise(p: torch.Tensor, n: int) -> float:
    """Expected TV between p and an n-sample empirical distribution (normal approximation)."""
    p = p.double()
    return 0.5 * math.sqrt(2 / (math.pi * n)) * float((p * (1 - p)).sqrt().sum())


def clamped_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Correct: normalise(max(0, p - q)); for a one-hot q this zeroes the rejected token."""
    r = (p - q).clamp_min(0)
    return r / r.sum()


def p_itself(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Broken: after a rejection resample from p (a rejected fixed token not zeroed)."""
    return p


def unclamped_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Broken: |p - q| keeps the negative part as mass where q > p (a valid distribution, so
    sampling works, but the wrong one)."""
    r = (p - q).abs()
    return r / r.sum()
