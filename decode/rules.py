"""Acceptance rules of speculative decoding, each written once and shared by every method.

All rules are plain functions over distributions ``p`` (the backbone's, the
target) and ``q`` (the drafter's, the proposal), shaped ``(..., V)``, and draft
tokens ``(...)``. Which rule a method uses:

- exact speculative sampling (Leviathan et al., 2023; Chen et al., 2023):
  accept a draft ``x ~ q`` with probability ``min(1, p(x) / q(x))``
  (`accept_drafts`); at an image's first rejection (`first_true`) draw the
  token from the residual ``norm(max(0, p - q))`` (`residual_distribution`) and
  drop what follows. SSD exact, MuLo-SD exact (point proposals, ``q = one_hot(x)``),
  SJD (random and Jacobi drafts), and EAGLE to come.
- multi-candidate (token-tree) acceptance: siblings at one position are
  tested in turn, the target replaced by its residual after each rejection
  (`accept_among_siblings`; deterministic candidates: `point_proposals`).
- SSD's parallel auto-correction (Xiang et al., 2026): every rejected position
  of a row is resampled in the same pass (`autocorrect_distributions`).
- relaxed acceptance (LANTERN, Jang et al., ICLR 2025): a draft also counts the
  target mass of its nearest codebook neighbours, up to a budget ``delta``
  (`latent_neighbours`, `pooled_neighbour_mass`, `relaxed_accept`). SSD's
  ``relax_*`` settings, MuLo-SD. Not lossless for ``delta > 0``.
- MuLo-SD's local rejection (Peruzzo et al., CVPR 2026): rejected tokens grow
  into 8-connected islands that are resampled together (`islands`).
- grouped acceptance (GSD, So et al., ICCV 2025): the test's ratio pooled over
  a group of tokens similar to the draft (`token_group`, `grouped_accept`).
  Not lossless for groups larger than the draft itself.
- continuous speculative decoding (CSpD, Wang et al., 2026): for diffusion-head
  tokens, ``p`` and ``q`` are the final reverse step's Gaussians of the
  backbone and of the drafter on trajectories that share their noise; the
  ratio is `gaussian_acceptance` (its ``tau`` is the reference code's relaxed
  test, not lossless for ``tau != 1``) and the residual is drawn by
  acceptance-rejection (`gaussian_residual_sample`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from scipy import ndimage


def probability_of(distribution: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """distribution (..., V), tokens (...) -> the probability of each token (...)."""
    return distribution.gather(-1, tokens[..., None])[..., 0]


def accept_drafts(p_of_draft: torch.Tensor, q_of_draft: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's test: accept each draft with probability ``min(1, p(x) / q(x))``.

    p_of_draft, q_of_draft, uniform in [0, 1): (...) -> bool (...). Written as
    ``u * q(x) < p(x)`` so that ``q(x) = 0`` needs no division. `p_of_draft` may
    include LANTERN's pooled mass (then the test is the relaxed one).
    """
    return uniform * q_of_draft < p_of_draft


def first_true(mask: torch.Tensor, none: int) -> torch.Tensor:
    """The first True position along the last axis of `mask` (B, n), or `none` where a row has none: (B,)."""
    return torch.where(mask.any(-1), mask.float().argmax(-1), none)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The correction after a rejection: ``norm(max(0, p - q))`` over the last axis.

    Drawing from it after rejecting ``x ~ q`` makes the kept token exactly
    ``p``-distributed. Where ``p <= q`` everywhere (only by rounding, or a point
    proposal that held all of p's mass) it is ``p`` itself.
    """
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)


def judge_chains(accept, p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, inside: torch.Tensor, uniforms):
    """Speculative sampling's verdict on every image's chain of drafts, tested left to right with `accept`
    (``accept(p, q, drafts, uniforms)``, e.g. decode.sjd.speculative_accept) up to each image's first rejection.

    p (B, n + 1, V): the target at each draft's position and at the one after the chain; q (B, n, V) what each
    draft was drawn from; drafts, inside, uniforms (B, n): the drafts, which of them count (a prefix per image:
    inside the image, an active slot), their test's uniforms. Returns (kept (B,) drafts accepted, rejected (B,)
    whether a draft was rejected, reached (B, n) the drafts the test reached, correction (B, V) the distribution
    of the token after the kept drafts: the residual ``norm(max(0, p - q))`` at a rejection, the target
    otherwise). Shared by the ragged chain generators (decode/eagle_ragged.py, decode/sjd_ragged.py).
    """
    n = drafts.shape[1]
    passed = accept(p[:, :n], q, drafts, uniforms)
    rejected_at = first_true(inside & ~passed, none=n)
    inside_count = inside.sum(1)
    kept = torch.minimum(rejected_at, inside_count)
    rejected = rejected_at < inside_count
    images = torch.arange(drafts.shape[0], device=drafts.device)
    target = p[images, kept]  # predicts the position after the kept drafts
    draft_q = q[images, kept.clamp(max=n - 1)]
    correction = torch.where(rejected[:, None], residual_distribution(target, draft_q), target)
    reached = inside & (torch.arange(n, device=drafts.device) <= rejected_at[:, None])
    return kept, rejected, reached, correction


def accept_among_siblings(
    p: torch.Tensor,
    sibling_tokens: torch.Tensor,
    sibling_q: torch.Tensor,
    uniform: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-candidate speculative sampling at one position: test the siblings of a token tree in turn.

    Recursive rejection sampling (SpecInfer, Miao et al. 2024; multi-draft speculative sampling): sibling
    ``i`` is accepted with probability ``min(1, r(x_i) / q_i(x_i))`` against the current target ``r``
    (``p`` at first); after its rejection ``r`` becomes the residual ``norm(max(0, r - q_i))`` before the
    next sibling is tested, each sibling with its own uniform. Lossless whenever ``x_i ~ q_i`` given the
    siblings before it: ``q_i = q`` for siblings drawn independently from ``q``, ``q`` without the earlier
    siblings (renormalised) when drawn without replacement, ``one_hot(x_i)`` for deterministic top-k
    candidates (`point_proposals`).

    p (..., V); sibling_tokens (..., K); sibling_q (..., K, V); uniform (..., K) in [0, 1); `valid` (..., K)
    bool marks the siblings that exist where positions have fewer than K (padding: never accepted, and the
    target does not move for it). Returns (the accepted sibling's index (...) long, K where every sibling
    was rejected; the target left after the rejections (..., V): where none was accepted the token is
    drawn from it).
    """
    target = p
    accepted = torch.full(sibling_tokens.shape[:-1], sibling_tokens.shape[-1], dtype=torch.long, device=p.device)
    for i in range(sibling_tokens.shape[-1]):
        q_i = sibling_q[..., i, :]
        token = sibling_tokens[..., i]
        passes = accept_drafts(probability_of(target, token), probability_of(q_i, token), uniform[..., i])
        undecided = accepted == sibling_tokens.shape[-1]
        if valid is not None:
            undecided = undecided & valid[..., i]
        accepted = torch.where(undecided & passes, i, accepted)
        # Only the still-undecided positions move on to the residual; decided ones keep theirs (unused).
        target = torch.where((undecided & ~passes)[..., None], residual_distribution(target, q_i), target)
    return accepted, target


def point_proposals(sibling_tokens: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """The proposals of deterministic candidates (top-k of a draft): ``one_hot(x_i)``, (..., K) -> (..., K, V).

    With them `accept_among_siblings` accepts sibling ``i`` with the probability the residual left by the
    earlier ones gives it (p without the earlier siblings, renormalised).
    """
    return F.one_hot(sibling_tokens, vocabulary).float()


def point_residual(p: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The residual of a rejected point proposal ``q = one_hot(x)``: p without x, renormalised."""
    return residual_distribution(p, F.one_hot(tokens, p.shape[-1]).to(p.dtype))


def autocorrect_distributions(
    p: torch.Tensor, q: torch.Tensor, resample: torch.Tensor, first_rejected: torch.Tensor, everywhere_residual: bool
) -> torch.Tensor:
    """SSD's parallel auto-correction: what each rejected position of a row is redrawn from, in the same pass.

    p, q (B, C, V); resample (B, C) the positions to redraw; first_rejected (B,)
    each image's first rejection. At the first rejection the context is final,
    so the residual ``norm(max(0, p - q))`` is the exact correction. Further
    right the context holds rejected drafts: there the correction is ``p``
    itself, or, as the paper words it, the residual too (`everywhere_residual`),
    which excludes the draft's mass and, with weak drafts, turns rejections into
    anti-correlated noise. Returns the distributions of the resampled positions (k, V).
    """
    columns = torch.arange(p.shape[1], device=p.device)[None]
    use_residual = resample & ((columns == first_rejected[:, None]) | everywhere_residual)
    correction = p.clone()
    correction[use_residual] = residual_distribution(p[use_residual], q[use_residual])
    return correction[resample]


def latent_neighbours(latents: torch.Tensor, k: int) -> torch.Tensor:
    """(V, D) codebook latents -> (V, k) indices of each entry's k nearest other entries, nearest first."""
    distances = torch.cdist(latents.float(), latents.float())  # (V, V)
    distances.fill_diagonal_(float("inf"))
    k = min(k, latents.shape[0] - 1)
    return distances.topk(k, dim=-1, largest=False).indices


def pooled_neighbour_mass(
    p: torch.Tensor, tokens: torch.Tensor, neighbours: torch.Tensor, delta: float
) -> torch.Tensor:
    """LANTERN's ``c_m``: the largest prefix sum of p over x's nearest neighbours that stays <= delta.

    Image tokens whose codebook latents are close look alike, so a draft may
    count their target mass as its own. p (..., V), tokens (...) -> (...);
    zero for ``delta = 0`` (standard acceptance).
    """
    if neighbours.shape[-1] == 0 or delta <= 0:
        return torch.zeros(tokens.shape, dtype=p.dtype, device=p.device)
    neighbour_mass = p.gather(-1, neighbours[tokens])  # (..., k), nearest first
    prefix = neighbour_mass.cumsum(-1)
    return torch.where(prefix <= delta, prefix, torch.zeros_like(prefix)).amax(-1)


def relaxed_accept(
    p: torch.Tensor,
    tokens: torch.Tensor,
    neighbours: torch.Tensor,
    delta: float,
    greedy: bool,
    uniform: torch.Tensor,
    q_of_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which drafts pass LANTERN's relaxed test: p (..., V), tokens (...), uniform (...) -> bool (...).

    Accepts with probability ``min(1, (p(x) + c_m) / q(x))``; `q_of_tokens` (...)
    is q(x), None for point proposals (q(x) = 1). Greedy decoding accepts when
    the pooled mass reaches the argmax's probability.
    """
    mass = probability_of(p, tokens) + pooled_neighbour_mass(p, tokens, neighbours, delta)
    if greedy:
        return mass >= p.amax(-1)
    if q_of_tokens is None:
        return uniform < mass
    return accept_drafts(mass, q_of_tokens, uniform)


def islands(rejected: torch.Tensor, radius: int) -> torch.Tensor:
    """MuLo-SD's local rejection: rejected cells (B, H, W) grown by `radius` (Chebyshev), the islands' mask.

    All islands are resampled in the same pass, so decoding needs the mask, not the labels.
    """
    grown = rejected.float()
    if radius > 0:
        grown = F.max_pool2d(grown[:, None], 2 * radius + 1, stride=1, padding=radius)[:, 0]
    return grown > 0


def island_redraw_distributions(
    p: torch.Tensor, q: torch.Tensor | None, passed: torch.Tensor, redrawn: torch.Tensor
) -> torch.Tensor:
    """What MuLo-SD redraws each island cell from: p (B, L, V), q (B, L, V) or None (point proposals),
    passed / redrawn (B, L) -> (k, V) for the k redrawn cells.

    A rejected draft is redrawn from the residual ``norm(max(0, p - q))``; an
    accepted cell that its neighbourhood pulled into an island, and every cell
    of a point proposal, from ``p`` itself.
    """
    redraw = p[redrawn]
    if q is not None:
        rejected = ~passed[redrawn]
        redraw[rejected] = residual_distribution(redraw[rejected], q[redrawn][rejected])
    return redraw


def count_islands(mask: torch.Tensor) -> list[int]:
    """The number of 8-connected islands in each image of a mask (B, H, W) (for reports and tests)."""
    return [int(ndimage.label(image, structure=np.ones((3, 3)))[1]) for image in mask.cpu().numpy()]


def token_group(
    p: torch.Tensor,
    tokens: torch.Tensor,
    embeddings: torch.Tensor,
    rank_radius: int,
    probability_gap: float,
    max_distance: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSD's group of each draft: p (..., V), tokens (...), embeddings (V, H) -> members (..., 2r), mask (..., 2r).

    Candidates are the tokens ranked within ``[-r, r)`` of the draft in the
    ordering of p (the reference code's ``sort()[cur - 7 : cur + 7]``, r = 7);
    members are those whose probability is within `probability_gap` of the
    draft's and whose input embedding lies within squared L2 distance
    `max_distance` of the draft's. The draft itself is always a member. Ranks
    past either end of the vocabulary are left out (the reference code's slice
    comes out empty there and rejects the draft).
    """
    order = p.argsort(-1)  # ascending, as the reference code sorts
    rank = order.argsort(-1).gather(-1, tokens[..., None])  # (..., 1)
    offsets = (
        torch.arange(-rank_radius, rank_radius, device=p.device) if rank_radius else torch.zeros(1, device=p.device)
    )
    ranks = rank + offsets.long()  # (..., 2r)
    inside = (ranks >= 0) & (ranks < p.shape[-1])
    members = order.gather(-1, ranks.clamp(0, p.shape[-1] - 1))
    close_in_p = (p.gather(-1, members) - probability_of(p, tokens)[..., None]).abs() < probability_gap
    distance = (embeddings[members] - embeddings[tokens][..., None, :]).float().pow(2).sum(-1)
    return members, inside & close_in_p & (distance < max_distance)


def grouped_accept(
    p: torch.Tensor, q: torch.Tensor, members: torch.Tensor, in_group: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """GSD's test: accept with probability ``min(1, sum_G p / sum_G q)`` over each draft's group G.

    p, q (..., V); members, in_group (..., m) from `token_group`; uniform (...) -> bool (...).
    A group of the draft alone is speculative sampling's test.
    """
    weight = in_group.to(p.dtype)
    return accept_drafts((p.gather(-1, members) * weight).sum(-1), (q.gather(-1, members) * weight).sum(-1), uniform)


def gaussian_log_density(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, diag(std^2)) summed over the last dimension: (..., D) -> (...), in float64."""
    x, mean, std = x.double(), mean.double(), std.double()
    return (-0.5 * ((x - mean) / std) ** 2 - std.log() - 0.5 * np.log(2 * np.pi)).sum(-1)


def gaussian_acceptance(
    x: torch.Tensor,
    target: tuple[torch.Tensor, torch.Tensor],
    draft: tuple[torch.Tensor, torch.Tensor],
    tau: float = 1.0,
    log_correction: torch.Tensor | None = None,
) -> torch.Tensor:
    """CSpD's acceptance probability of drafts x (..., D): ``min(1, p(x) / q(x))`` for diagonal Gaussians
    p = N(target mean, target std^2) and q = N(draft mean, draft std^2); (...) in [0, 1].

    ``tau = 1`` and no correction: exact speculative sampling. The reference code's relaxed test
    (MarkXCloud/CSpD, ``DistributionProcessor.judge_accept``) widens both kernels by ``tau`` in the
    exponent, keeping the normalisers' ratio of the true stds, and multiplies by ``exp(log_correction)``
    (the trajectories' summed log-std difference, target minus draft); not lossless.
    """
    (p_mean, p_std), (q_mean, q_std) = target, draft
    # With both kernels widened by tau, their normalisers' ratio is still the true stds' ratio (as the reference).
    log_ratio = gaussian_log_density(x, p_mean, p_std * tau) - gaussian_log_density(x, q_mean, q_std * tau)
    if log_correction is not None:
        if log_correction.shape != log_ratio.shape:  # a per-channel correction would broadcast silently
            raise ValueError(
                f"log_correction must be shaped {tuple(log_ratio.shape)}, got {tuple(log_correction.shape)}"
            )
        log_ratio = log_ratio + log_correction.double()
    return log_ratio.clamp(max=0).exp().to(x.dtype)


def gaussian_verdicts(
    x: torch.Tensor,
    target: tuple[torch.Tensor, torch.Tensor],
    draft: tuple[torch.Tensor, torch.Tensor],
    generator: torch.Generator | None,
    tau: float = 1.0,
    log_correction: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which drafts x (..., D) CSpD keeps: ``u < gaussian_acceptance(...)`` with one uniform each; (...) bool."""
    ratio = gaussian_acceptance(x, target, draft, tau, log_correction)
    return torch.rand(ratio.shape, generator=generator, device=ratio.device) < ratio


def resample_rejected(
    drafts: torch.Tensor,
    rejected: torch.Tensor,
    target: tuple[torch.Tensor, torch.Tensor],
    draft: tuple[torch.Tensor, torch.Tensor],
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, int]:
    """`drafts` (..., D) with each `rejected` (...) one replaced by a draw from its residual
    (`gaussian_residual_sample`); returns them and how many draws fell back to p (its `settled` False)."""
    tokens = drafts.clone()
    if not rejected.any():
        return tokens, 0
    residual, settled = gaussian_residual_sample(
        (target[0][rejected], target[1][rejected]), (draft[0][rejected], draft[1][rejected]), generator
    )
    tokens[rejected] = residual.to(tokens.dtype)
    return tokens, int((~settled).sum())


def gaussian_residual_sample(
    target: tuple[torch.Tensor, torch.Tensor],
    draft: tuple[torch.Tensor, torch.Tensor],
    generator: torch.Generator | None = None,
    proposals_per_round: int = 64,
    max_rounds: int = 1000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw from the residual ``norm(max(0, p - q))`` of diagonal Gaussians by acceptance-rejection.

    Proposals y ~ p are kept with probability ``max(0, 1 - q(y) / p(y))``: the envelope is p itself
    (bound 1, since the residual's unnormalised density ``max(0, p - q) <= p``), so a kept proposal is an
    exact draw from the residual. The expected number of proposals is ``1 / TV(p, q)``; they are drawn
    `proposals_per_round` at a time for every token still waiting, until each has one.

    target, draft: (mean, std), each (..., D). Returns (tokens (..., D), settled (...) bool). A token
    that found no kept proposal in ``proposals_per_round * max_rounds`` tries (p and q almost equal,
    where a rejection has probability ``TV(p, q)`` itself) gets a draw from p and `settled` False: the
    caller counts these, never zeros as the reference code leaves them.
    """
    (p_mean, p_std), (q_mean, q_std) = target, draft
    shape = p_mean.shape
    p_mean, p_std, q_mean, q_std = (t.reshape(-1, shape[-1]) for t in (p_mean, p_std, q_mean, q_std))
    count = p_mean.shape[0]
    tokens = torch.empty_like(p_mean)
    settled = torch.zeros(count, dtype=torch.bool, device=p_mean.device)
    for _ in range(max_rounds):
        waiting = (~settled).nonzero()[:, 0]
        if len(waiting) == 0:
            break
        mean, std = p_mean[waiting, None], p_std[waiting, None]  # (W, 1, D)
        noise = torch.randn(
            (len(waiting), proposals_per_round, shape[-1]), generator=generator, device=mean.device, dtype=mean.dtype
        )
        proposals = mean + std * noise  # (W, K, D)
        log_q_over_p = gaussian_log_density(proposals, q_mean[waiting, None], q_std[waiting, None]) - (
            gaussian_log_density(proposals, mean, std)
        )
        keep_probability = (1 - log_q_over_p.clamp(max=0).exp()).clamp(min=0)
        uniform = torch.rand(keep_probability.shape, generator=generator, device=mean.device, dtype=torch.float64)
        kept = uniform < keep_probability  # (W, K)
        found = kept.any(-1)
        first = kept.float().argmax(-1)
        rows = waiting[found]
        tokens[rows] = proposals[found, first[found]]
        settled[rows] = True
    waiting = (~settled).nonzero()[:, 0]
    if len(waiting):
        noise = torch.randn((len(waiting), shape[-1]), generator=generator, device=p_mean.device, dtype=p_mean.dtype)
        tokens[waiting] = p_mean[waiting] + p_std[waiting] * noise
    return tokens.reshape(shape), settled.reshape(shape[:-1])
