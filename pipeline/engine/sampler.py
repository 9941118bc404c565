"""Next-token choice: greedy, or temperature + top-p sampling driven by a counter-based random stream.

Sampled tokens come back to the host once per step, the step's one host-device sync.

Each sequence's random numbers are a pure function of (run seed, sequence key, token index): splitmix64
of the three, so a sequence samples the same tokens whichever worker, batch or step it lands in (given
the same logits) and no generator state has to be carried or checkpointed.
"""
from __future__ import annotations

import numpy as np
import torch

from ..models.transfers import to_device

_M64 = (1 << 64) - 1


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = (z + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seed: int, keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """float64 in [0, 1), one per (key, step), for the run `seed`."""
    with np.errstate(over="ignore"):
        z = _splitmix64(np.full(len(keys), seed & _M64, np.uint64))
        z = _splitmix64(z ^ np.asarray(keys, np.uint64))
        z = _splitmix64(z ^ np.asarray(steps, np.uint64))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


# Candidates the nucleus is first looked for among (the most probable tokens, by torch.topk); a row whose
# nucleus is not provably inside them is redone with a sort of its whole vocabulary.
CANDIDATES = 256
# Slack on "every token past the candidates is outside the nucleus": the mass ranked above the last
# candidate must reach top_p by this much, so float32 rounding of later prefix sums cannot bring one back.
NUCLEUS_SLACK = 1e-5


class Sampler:
    """Next tokens for the rows of a step, brought to the host in one transfer (the step's one sync).

    Greedy is an argmax. With a temperature, the tempered distribution restricted to its top-p nucleus
    (the smallest prefix of tokens by decreasing probability, ties by id, whose mass reaches top_p) is
    sampled by the inverse CDF at u; with top_p < 1 the nucleus is found among the `candidates` most
    probable tokens instead of by sorting the vocabulary, which gives the same tokens as the full sort (see
    _nucleus). The candidate count adapts: a row whose nucleus does not fit is redone with the full sort
    (a second transfer) and the next steps take enough candidates for it.
    """

    def __init__(self, temperature: float, top_p: float, candidates: int = CANDIDATES):
        self.temperature, self.top_p, self.candidates = temperature, top_p, candidates

    def __call__(self, logits: torch.Tensor, u: np.ndarray) -> list[int]:
        if self.temperature == 0:
            return logits.argmax(dim=-1).tolist()
        probs = tempered(logits, self.temperature)
        u_dev = to_device([u], probs.device)[0]   # pinned: a pageable copy would wait for the step
        V = probs.shape[1]
        if self.top_p >= 1.0 or self.candidates >= V:
            return _sample_sorted(*probs.sort(dim=-1, descending=True, stable=True), self.top_p, u_dev).tolist()
        vals, order = _stable_top(probs, self.candidates)
        tokens, fits = _nucleus(vals, order, self.top_p, u_dev)
        host = torch.stack([tokens, fits.long()]).tolist()      # tokens and fit flags: one transfer
        tokens, misfits = host[0], [i for i, ok in enumerate(host[1]) if not ok]
        if misfits:
            rows = torch.tensor(misfits, device=probs.device)
            vals, order = probs[rows].sort(dim=-1, descending=True, stable=True)
            redone = _sample_sorted(vals, order, self.top_p, u_dev[rows])
            before = vals.cumsum(dim=-1) - vals
            need = int((before < self.top_p).sum(dim=-1).max())
            self.candidates = min(V, max(2 * self.candidates, 1 << need.bit_length()))
            for i, token in zip(misfits, redone.tolist()):
                tokens[i] = token
        return tokens


# Temperatures whose plain division keeps float32 logits finite (|logit| < 3e34): every temperature in use.
PLAIN_TEMPERATURES = (1e-4, 1e4)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) per row, without NaN for any temperature above 0. Within
    PLAIN_TEMPERATURES the division as it always was (the same bits, so a run continued from an earlier version
    samples the same tokens). Beyond, each row's largest logit is taken off first (the same distribution, but
    logits / 1e-38 overflowed float32 to inf - inf) and the temperature, which the division takes as a float32,
    is held within float32's normal range (1e-300 was 0, 1e300 inf, and -inf / inf of a masked padded row
    NaN): a NaN row's draw was its last id, a padded vocabulary row that is no token, at every step. A tiny
    temperature gives the most likely token (ties shared), as the limit does; a huge one the uniform draw."""
    logits = logits.float()
    if PLAIN_TEMPERATURES[0] <= temperature <= PLAIN_TEMPERATURES[1]:
        return torch.softmax(logits / temperature, dim=-1)
    f32 = torch.finfo(torch.float32)
    return torch.softmax((logits - logits.amax(dim=-1, keepdim=True)) / min(max(temperature, f32.tiny), f32.max),
                         dim=-1)


def sample(logits: torch.Tensor, temperature: float, top_p: float, u: np.ndarray) -> list[int]:
    """Token ids for logits [S, V]: one row each (see Sampler)."""
    return Sampler(temperature, top_p)(logits, u)


def _stable_top(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most probable tokens of each row by decreasing probability, equal ones by increasing id (the
    order of a stable descending sort; topk's own order of ties is unspecified): values and ids [S, k]."""
    _, ids = probs.topk(k, dim=-1, sorted=False)
    ids = ids.sort(dim=-1).values
    vals, pos = probs.gather(1, ids).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, pos)


def _sample_sorted(sorted_probs: torch.Tensor, order: torch.Tensor, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw at u from probabilities sorted descending (all of a row's tokens, or a prefix of
    them holding its nucleus), restricted to the top-p nucleus: token ids [S]."""
    if top_p < 1.0:
        before = sorted_probs.cumsum(dim=-1) - sorted_probs       # mass of the tokens ranked above
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    cdf = sorted_probs.double().cumsum(dim=-1)
    target = u * cdf[:, -1]
    pick = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=cdf.shape[1] - 1)
    return order.gather(1, pick).squeeze(1)


def _nucleus(vals: torch.Tensor, order: torch.Tensor, top_p: float, u: torch.Tensor):
    """Draws from the nucleus found among candidates (from _stable_top): (token ids [S], fits [S] bool).

    A row fits when its nucleus provably lies inside its candidates, so the draw equals the full sort's:
    the mass ranked above the last candidate reaches top_p (+ NUCLEUS_SLACK), so every later token is
    outside; and the last candidate is less probable than the last kept token, so no token left out ties
    with a kept one (which the full sort could rank first by id). The prefix sums, the masking and the
    float64 CDF are then the full sort's on its first k positions, and its tokens past them add zeros."""
    before = vals.cumsum(dim=-1) - vals
    kept = before < top_p
    last_kept = vals.gather(1, (kept.sum(dim=-1, keepdim=True) - 1).clamp_(min=0))
    fits = (before[:, -1] >= top_p + NUCLEUS_SLACK) & (vals[:, -1] < last_kept[:, 0])
    return _sample_sorted(vals, order, top_p, u), fits
