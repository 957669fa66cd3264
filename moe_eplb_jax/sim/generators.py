"""Synthetic expert-load generators (numpy, seeded, deterministic).

* :func:`zipf_popularity` -- expert popularity ``[E]`` following a Zipf law over
  a random expert order, with the exponent chosen so that the home placement
  (expert ``e`` on rank ``e // (E / G)``) has a given rank imbalance;
* :func:`zipf_counts` -- per-source-rank token counts ``[G, E]`` drawn from it
  (``tokens_per_rank * top_k`` assignments per rank);
* :func:`zipf_topk` -- the token-level top-k expert ids ``[G, T, k]`` (distinct
  experts per token) when a real router output is needed;
* :func:`lognormal_load` -- per-layer loads ``[L, E]`` with log-normal weights;
* :func:`drifting_load` -- a ``[steps, L, E]`` trace whose popularity drifts
  between "datasets" (different hot experts), the periodic policies' weak spot.
"""

from __future__ import annotations

import numpy as np

from moe_eplb_jax._checks import check_int, check_real

__all__ = ["zipf_popularity", "zipf_counts", "zipf_topk", "lognormal_load", "drifting_load", "home_rank_imbalance"]


def _check_positive(**kw):
    for name, value in kw.items():
        check_int(name, value, minimum=1)


def home_rank_imbalance(popularity, num_ranks: int) -> float:
    """``max / mean`` of per-rank sums of ``popularity [E]`` with contiguous home experts."""
    num_ranks = check_int("num_ranks", num_ranks, minimum=1)
    popularity = np.asarray(popularity)
    if popularity.ndim != 1 or popularity.dtype.kind not in "iuf" or popularity.size % num_ranks:
        raise ValueError(
            f"popularity must be numbers of shape [E] with E a multiple of num_ranks={num_ranks}, "
            f"got {popularity.dtype} {popularity.shape}"
        )
    popularity = popularity.astype(np.float64)
    if not np.all(np.isfinite(popularity)) or np.any(popularity < 0) or popularity.sum() <= 0:
        raise ValueError("popularity must be finite, non-negative and not all zero")
    per_rank = popularity.reshape(num_ranks, -1).sum(1)
    return float(per_rank.max() / per_rank.mean())


def zipf_popularity(num_experts: int, num_ranks: int, imbalance: float, *, seed: int = 0) -> np.ndarray:
    """Expert popularity ``[E]`` (sums to 1): Zipf over a random expert order, home rank imbalance ``imbalance``.

    The exponent is found by bisection; ``imbalance`` must lie in
    ``[1, num_ranks]``. An imbalance of 1 gives uniform popularity.
    """
    _check_positive(num_experts=num_experts, num_ranks=num_ranks)
    check_int("seed", seed, minimum=0)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_ranks ({num_ranks})")
    imbalance = check_real("imbalance", imbalance)
    if not 1.0 <= imbalance <= num_ranks:
        raise ValueError(f"imbalance must lie in [1, num_ranks={num_ranks}], got {imbalance}")
    order = np.random.default_rng(seed).permutation(num_experts)
    ranks = np.empty(num_experts)
    ranks[order] = np.arange(1, num_experts + 1)

    def popularity(s):
        w = ranks**-s
        return w / w.sum()

    lo, hi = 0.0, 1.0
    while home_rank_imbalance(popularity(hi), num_ranks) < imbalance and hi < 64:
        hi *= 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if home_rank_imbalance(popularity(mid), num_ranks) < imbalance:
            lo = mid
        else:
            hi = mid
    return popularity(hi)


def zipf_counts(
    num_ranks: int, num_experts: int, tokens_per_rank: int, top_k: int, imbalance: float, *, seed: int = 0
) -> np.ndarray:
    """Token counts ``[G, E]`` int32: each rank's ``tokens_per_rank * top_k`` assignments drawn from Zipf popularity.

    Draws are multinomial per rank (expert choices of one token are not forced
    distinct; use :func:`zipf_topk` for token-level ids).
    """
    _check_positive(tokens_per_rank=tokens_per_rank, top_k=top_k)
    if tokens_per_rank * top_k > np.iinfo(np.int32).max:
        raise ValueError(f"tokens_per_rank * top_k = {tokens_per_rank * top_k} does not fit the int32 counts")
    p = zipf_popularity(num_experts, num_ranks, imbalance, seed=seed)
    rng = np.random.default_rng(seed + 1)
    return rng.multinomial(tokens_per_rank * top_k, p, size=num_ranks).astype(np.int32)


def zipf_topk(
    num_ranks: int, num_experts: int, tokens_per_rank: int, top_k: int, imbalance: float, *, seed: int = 0
) -> np.ndarray:
    """Top-k expert ids ``[G, T, k]`` int32 (distinct per token) drawn by Gumbel top-k from Zipf popularity."""
    _check_positive(tokens_per_rank=tokens_per_rank, top_k=top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) exceeds num_experts ({num_experts})")
    logp = np.log(zipf_popularity(num_experts, num_ranks, imbalance, seed=seed)).astype(np.float32)
    rng = np.random.default_rng(seed + 2)
    out = np.empty((num_ranks, tokens_per_rank, top_k), np.int32)
    for g in range(num_ranks):
        keys = logp[None, :] + rng.gumbel(size=(tokens_per_rank, num_experts)).astype(np.float32)
        out[g] = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
    return out


def lognormal_load(
    num_layers: int, num_experts: int, *, sigma: float = 1.0, tokens: int = 65536, seed: int = 0
) -> np.ndarray:
    """Per-layer expert loads ``[L, E]`` int64: ``tokens`` assignments per layer, log-normal(σ) popularity."""
    _check_positive(num_layers=num_layers, num_experts=num_experts, tokens=tokens)
    check_real("sigma", sigma, minimum=0.0)
    check_int("seed", seed, minimum=0)
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, sigma, size=(num_layers, num_experts))
    w /= w.sum(1, keepdims=True)
    return np.stack([rng.multinomial(tokens, w[i]) for i in range(num_layers)]).astype(np.int64)


def drifting_load(
    num_steps: int,
    num_layers: int,
    num_experts: int,
    num_ranks: int,
    *,
    imbalance: float = 2.0,
    num_datasets: int = 2,
    tokens: int = 65536,
    seed: int = 0,
) -> np.ndarray:
    """A load trace ``[steps, L, E]`` int64 that drifts between ``num_datasets`` popularity profiles.

    Each "dataset" is a Zipf profile (home rank imbalance ``imbalance``) over its
    own random expert order, per layer. The trace moves linearly from one
    dataset to the next over the run, so a placement fitted at the start is
    served on a different distribution at the end.
    """
    _check_positive(num_steps=num_steps, num_layers=num_layers, num_datasets=num_datasets, tokens=tokens)
    check_int("seed", seed, minimum=0)
    profiles = np.stack(
        [
            np.stack(
                [
                    zipf_popularity(num_experts, num_ranks, imbalance, seed=seed + 1000 * d + layer)
                    for layer in range(num_layers)
                ]
            )
            for d in range(num_datasets)
        ]
    )  # [D, L, E]
    rng = np.random.default_rng(seed + 7)
    out = np.empty((num_steps, num_layers, num_experts), np.int64)
    for step in range(num_steps):
        pos = (num_datasets - 1) * step / max(num_steps - 1, 1)
        d = min(int(pos), num_datasets - 2) if num_datasets > 1 else 0
        frac = pos - d if num_datasets > 1 else 0.0
        p = profiles[d] * (1 - frac) + profiles[min(d + 1, num_datasets - 1)] * frac
        for layer in range(num_layers):
            out[step, layer] = rng.multinomial(tokens, p[layer])
    return out
