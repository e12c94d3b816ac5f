"""Mixing domain experts at inference time (DEMix §5): the domain posterior, its priors, and the mixtures.

Shape legend: E experts (= training domains), B sequence blocks (in stream order), T tokens per block, K top-k.

Everything here is pure maths on per-expert token log-likelihoods

    ll_EBT[j, b, t] = log p(x_t | x_<t, D = j)        (the DEMix LM with every layer routed to expert j)

and a mask `mask_BT` (1 where a token is scored; a prepended domain token is not), so it is testable on fixed
numbers. Computation is in float64 log space.

Posterior over a prefix of block b (eqs. 7-8): the block is the model's whole context, so the history is the
scored tokens of that block before t,

    log p(x_<t | D = j)     = sum_{s < t} mask_s * ll[j, b, s]
    log p(D = j | x_<t)     = log p(x_<t | D = j) + log p(D = j) - logsumexp_j' [ same for j' ]

Mixture (eq. 6):  log p(x_t | x_<t) = logsumexp_j [ ll[j, b, t] + log p(D = j | x_<t) ].

Priors p(D = j) (§5.1):
* uniform:  1/E.
* updating (eq. 9):  the prior of block k is an exponentially weighted average of the posteriors of earlier
  blocks, each taken at the end of its block (conditioning on all its scored tokens, under the prior that block
  used):  p_k(D = j) ∝ sum_{k' < k} λ^(k - k') π_k'(j),  π_k'(j) = p(D = j | x_block k'),  λ = 0.3.
  Recursively, with S_0 = 0:  S_{k+1} = λ (S_k + π_k),  p_{k+1} = S_{k+1} / sum_j S_{k+1}(j); block 0 (empty
  sum) uses the uniform prior.
* cached:  estimated on n = 100 development blocks (the "posterior estimated on 100 sequences of development
  data" that Figure 4 plots), then fixed for the whole test set. Estimators (`CACHED_ESTIMATORS`), each over the
  end-of-block posteriors π_b of the development blocks taken under the uniform prior:
    mean      (default, the paper's text):  p(D = j) = (1/n) sum_b π_b(j);
    ewm       (the reference implementation's exponentially weighted mean, α = 0.3):  s_0 = π_0,
              s_b = (1 - α) s_{b-1} + α π_b, p = s_{n-1};
    updating  the updating prior (eq. 9) after the n blocks (each π_b under the prior of the blocks before it):
              with λ = 0.3 the latest block weighs 0.7, so this is close to the last two or three blocks.

Posterior modes (`POSTERIORS`), the evidence the posterior at token t conditions on:
* prefix          (default, eqs. 7-8): every scored token of the block before t, as above;
* previous_token  (the reference implementation's `ensemble_weighted_average`): the previous token only,
                  log p(D = j | x_{t-1}) = mask_{t-1} ll[j, b, t-1] + log p(D = j) - logsumexp_j' [ same ];
                  at the first token of a block (no previous scored token) the prior itself. One token of
                  evidence keeps the weights soft where the whole-prefix posterior is one-hot after a few tokens.
The end-of-block posterior π_b (eq. 9, cached priors) conditions on the same evidence at the end of the block:
all scored tokens (prefix) or the last one (previous_token).

Baselines (§5.3): naive = one expert's likelihood (the known domain's expert in-domain; on a novel domain the
best single expert on that test set, an oracle choice); average = fixed uniform weights 1/E at every token,
log p = logsumexp_j ll[j] - log E (no posterior).

Router vectors (data-free mixing): a merged model whose experts were trained separately by data owners from
one frozen anchor (FlexOlmo, Shi et al. 2025, which builds each expert's router embedding from its owner's own
data) has no joint data to estimate a cached prior on, and the posterior starts uniform on every block. Each
owner ships instead a router vector r_j = the mean of f over its own training tokens, where f[b, t] (D) is the
input of the first expert layer's FFN at input position t (model/batched.py `shared_trunk_features`: the
embeddings and the layers before it only, shared weights every owner holds bit for bit, so an owner computes
locally the features the merged model computes at inference). Input position t is the last token of the
context of the target ll[., b, t], so averaging positions s <= t uses the whole context of that target and
nothing after it (causal):

    router eq. R1   q[b, t] = sum_{s <= t} mask_s f[b, s] / sum_{s <= t} mask_s       (prefix-level mean)
    router eq. R2   m = (1/E) sum_j r_j,   c_j[b, t] = cos(q[b, t] - m, r_j - m)       (centred cosine)
    router eq. R3   log w_j[b, t] = log_softmax_j ( c_j[b, t] / τ )                    (τ = temperature, 0.1)
    mixture "router":  eq. 6 with g_j = w_j[b, t].

m is taken over the E experts present (an opted-out expert's vector takes no part). Centring removes what all
domains share (the anchor's common direction, most of f): adding one vector to every r_j and every f changes
nothing, nor does scaling them all by a positive factor. A cosine with a zero vector is 0 (one expert: w = 1);
before the first counted token of a block (mask 0 so far) the weights are uniform. With E = 2, r_1 - m = -(r_2 - m),
so the router is a sign test of q - m along r_1 - r_2, sharpened by τ.

    router eq. R4   log p(D = j | x_<t) = log w_j[b, t] + log p(x_<t | D = j) - logsumexp_j' [ same for j' ]
    mixture "router_posterior":  eq. 6 with g_j = R4, i.e. eqs. 7-8 with the router weights as a per-token prior
    (`log_posterior` takes a prior of shape E B T; its evidence per `posterior`, prefix or previous_token).

Sparse top-k: keep the k experts with the highest posterior and renormalise. Restricting the posterior to a set
S and renormalising equals computing it with the prior restricted to S, so with experts chosen by the cached
prior (a posterior estimated on development data) only k experts need to run at all: cost k/E of the experts'
compute. Choosing them per token by the full posterior (`select="posterior"`) needs every expert's likelihood of
the prefix, so it evaluates all E.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from data.argtypes import in_range, nonneg_float
from data.readers import read_json_object

UPDATING_DECAY = (
    0.3  # λ in eq. 9 (the paper's grid {0.1, 0.3, 0.5, 1.0}; 0.3 "worked well for most settings")
)
CACHED_PRIOR_BLOCKS = 100  # development blocks used to estimate the cached prior
EWM_ALPHA = 0.3  # weight of the newest block in the reference implementation's exponentially weighted mean
POSTERIORS: tuple[str, ...] = ("prefix", "previous_token")
CACHED_ESTIMATORS: tuple[str, ...] = ("mean", "ewm", "updating")
CACHED_PRIOR_FORMAT = "demix-cached-prior/1"
ROUTER_TEMPERATURE = 0.1  # τ of router eq. R3


def _mask(ll_EBT: torch.Tensor, mask_BT: torch.Tensor | None) -> torch.Tensor:
    if mask_BT is None:
        return torch.ones(ll_EBT.shape[1:], dtype=torch.float64, device=ll_EBT.device)
    return mask_BT.to(torch.float64)


def _masked_ll(ll_EBT: torch.Tensor, mask_BT: torch.Tensor | None) -> torch.Tensor:
    """ll in float64 with unscored positions set to 0 (a masked -inf must not poison the sums)."""
    m_BT = _mask(ll_EBT, mask_BT)
    return torch.where(m_BT.bool(), ll_EBT.to(torch.float64), torch.zeros((), dtype=torch.float64))


def _log_prior_EB(log_prior: torch.Tensor, E: int, B: int) -> torch.Tensor:
    """Broadcast a prior given per expert (E) or per expert and block (E B) to E B."""
    lp = log_prior.to(torch.float64)
    if lp.dim() == 1:
        lp = lp[:, None]
    if lp.shape[0] != E:
        raise ValueError(f"prior over {lp.shape[0]} experts for log-likelihoods of {E} experts")
    return lp.expand(E, B)


def uniform_log_prior(num_experts: int) -> torch.Tensor:
    """log p(D = j) = -log E for every j (§5.1 "uniform")."""
    return torch.full((num_experts,), -math.log(num_experts), dtype=torch.float64)


def _check_posterior(posterior: str) -> None:
    if posterior not in POSTERIORS:
        raise ValueError(f"posterior={posterior!r}: choose one of {', '.join(POSTERIORS)}")


def prefix_log_likelihood(ll_EBT: torch.Tensor, mask_BT: torch.Tensor | None = None) -> torch.Tensor:
    """log p(x_<t | D = j) = sum_{s < t} mask_s ll[j, b, s] (exclusive cumulative sum over the block), E B T."""
    cum_EBT = torch.cumsum(_masked_ll(ll_EBT, mask_BT), dim=2)
    return torch.cat([torch.zeros_like(cum_EBT[..., :1]), cum_EBT[..., :-1]], dim=2)


def evidence_log_likelihood(
    ll_EBT: torch.Tensor, mask_BT: torch.Tensor | None = None, posterior: str = "prefix"
) -> torch.Tensor:
    """The log-likelihood the posterior at each position conditions on, E B T: the whole prefix (eqs. 7-8) or
    the previous token only (mask_{t-1} ll[j, b, t-1]; 0 at t = 0)."""
    _check_posterior(posterior)
    if posterior == "prefix":
        return prefix_log_likelihood(ll_EBT, mask_BT)
    prev_EBT = _masked_ll(ll_EBT, mask_BT)
    return torch.cat([torch.zeros_like(prev_EBT[..., :1]), prev_EBT[..., :-1]], dim=2)


def end_of_block_evidence(
    ll_EBT: torch.Tensor, mask_BT: torch.Tensor | None = None, posterior: str = "prefix"
) -> torch.Tensor:
    """The evidence after the last token of each block, E B: all its scored tokens (prefix) or the last scored
    one (previous_token)."""
    _check_posterior(posterior)
    masked_EBT = _masked_ll(ll_EBT, mask_BT)
    if posterior == "prefix":
        return masked_EBT.sum(dim=2)
    m_BT = _mask(ll_EBT, mask_BT).bool()
    pos_B = torch.arange(m_BT.shape[1], device=m_BT.device).expand_as(m_BT).masked_fill(~m_BT, -1).amax(dim=1)
    last_EB = masked_EBT.gather(2, pos_B.clamp(min=0)[None, :, None].expand(masked_EBT.shape[0], -1, 1))[
        ..., 0
    ]
    return torch.where(pos_B[None] >= 0, last_EB, torch.zeros_like(last_EB))


def log_posterior(
    ll_EBT: torch.Tensor,
    log_prior: torch.Tensor,
    mask_BT: torch.Tensor | None = None,
    posterior: str = "prefix",
) -> torch.Tensor:
    """log p(D = j | evidence before t) at every position, E B T: eqs. 7-8 over the whole prefix, or the previous
    token only (`posterior`, module docstring); `log_prior` is E, E B (one per block) or E B T (one per token:
    the router weights, router eq. R4)."""
    E, B, T = ll_EBT.shape
    if log_prior.dim() == 3:  # one prior per token (router eq. R4)
        if tuple(log_prior.shape) != (E, B, T):
            raise ValueError(
                f"per-token prior of shape {tuple(log_prior.shape)} for log-likelihoods {E, B, T}"
            )
        prior_EBT = log_prior.to(torch.float64)
    else:
        prior_EBT = _log_prior_EB(log_prior, E, B)[..., None]
    joint_EBT = evidence_log_likelihood(ll_EBT, mask_BT, posterior) + prior_EBT
    return torch.log_softmax(joint_EBT, dim=0)


def mixture_log_probs(ll_EBT: torch.Tensor, log_weights_EBT: torch.Tensor) -> torch.Tensor:
    """log p(x_t | x_<t) = logsumexp_j [ ll[j] + log g_j ] (eq. 6), B T. Weights must be normalised over E."""
    return torch.logsumexp(ll_EBT.to(torch.float64) + log_weights_EBT.to(torch.float64), dim=0)


def posterior_mixture_log_probs(
    ll_EBT: torch.Tensor,
    log_prior: torch.Tensor,
    mask_BT: torch.Tensor | None = None,
    posterior: str = "prefix",
) -> torch.Tensor:
    """Eq. 6 with g_j = the posterior (eqs. 7-8, or previous-token) under `log_prior` (E, E B or E B T), B T."""
    return mixture_log_probs(ll_EBT, log_posterior(ll_EBT, log_prior, mask_BT, posterior))


def router_log_weights(
    features_BTD: torch.Tensor,
    vectors_ED: torch.Tensor,
    temperature: float = ROUTER_TEMPERATURE,
    mask_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """log w_j[b, t] (router eqs. R1-R3), E B T in float64: the softmax over experts of the centred cosine between
    the prefix mean of the features (positions s <= t with mask_s = 1) and each expert's router vector, over
    temperature τ; the centre is the mean of `vectors_ED`, the experts present. Uniform before the first counted
    position of a block; 0 (w = 1) for one expert."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature τ={temperature!r}: must be a finite number > 0")
    if features_BTD.dim() != 3 or vectors_ED.dim() != 2 or features_BTD.shape[2] != vectors_ED.shape[1]:
        raise ValueError(
            f"features {tuple(features_BTD.shape)} (B T D) and router vectors {tuple(vectors_ED.shape)} (E D): "
            "need the same D"
        )
    if vectors_ED.shape[0] == 0:
        raise ValueError("router weights need at least one expert's vector")
    f_BTD = features_BTD.to(torch.float64)
    r_ED = vectors_ED.to(device=f_BTD.device, dtype=torch.float64)
    if mask_BT is None:
        m_BT = torch.ones(f_BTD.shape[:2], dtype=torch.float64, device=f_BTD.device)
    else:
        m_BT = mask_BT.to(device=f_BTD.device, dtype=torch.float64)
    n_BT = torch.cumsum(m_BT, dim=1)
    q_BTD = torch.cumsum(f_BTD * m_BT[..., None], dim=1) / n_BT.clamp(min=1.0)[..., None]  # R1
    centre_D = r_ED.mean(dim=0)  # R2
    a_BTD, b_ED = q_BTD - centre_D, r_ED - centre_D
    dot_EBT = torch.einsum("btd,ed->ebt", a_BTD, b_ED)
    norm_EBT = b_ED.norm(dim=1)[:, None, None] * a_BTD.norm(dim=2)[None]
    ok_EBT = (norm_EBT > 0) & (n_BT > 0)[None]
    cos_EBT = torch.where(ok_EBT, dot_EBT / torch.where(ok_EBT, norm_EBT, 1.0), 0.0)
    return torch.log_softmax(cos_EBT / temperature, dim=0)  # R3


def average_log_probs(ll_EBT: torch.Tensor) -> torch.Tensor:
    """The "average" baseline: log (1/E) sum_j p(x_t | x_<t, D = j), fixed uniform weights, B T."""
    return torch.logsumexp(ll_EBT.to(torch.float64), dim=0) - math.log(ll_EBT.shape[0])


@dataclass
class UpdatingPriors:
    """Result of running the eq. 9 recursion over a stream of blocks."""

    log_prior_EB: torch.Tensor  # the prior each block used
    log_posterior_EB: torch.Tensor  # π_b: the posterior at the end of each block, under its prior
    final_log_prior_E: torch.Tensor  # the prior the next block would use (the cached prior after B blocks)


class UpdatingPrior:
    """Streaming state of the updating prior (eq. 9): S_{k+1} = λ (S_k + π_k), kept as log S in float64 so that an
    expert whose posterior underflows in probability space can still recover."""

    def __init__(self, num_experts: int, decay: float = UPDATING_DECAY) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay λ={decay}: must be in (0, 1]")
        self.num_experts, self.decay = num_experts, decay
        self.log_s_E: torch.Tensor | None = None  # None: no block seen yet (empty sum)
        self.blocks = 0

    def log_prior(self) -> torch.Tensor:
        """log p_k(D = j): uniform before the first block, else S_k normalised."""
        if self.log_s_E is None:
            return uniform_log_prior(self.num_experts)
        return self.log_s_E - torch.logsumexp(self.log_s_E, dim=0)

    def update(self, log_posterior_E: torch.Tensor) -> None:
        """Fold in π_k, the posterior at the end of block k."""
        lp = log_posterior_E.to(torch.float64)
        s = lp if self.log_s_E is None else torch.logaddexp(self.log_s_E, lp)
        self.log_s_E = s + math.log(self.decay)
        self.blocks += 1


def updating_priors(
    ll_EBT: torch.Tensor,
    mask_BT: torch.Tensor | None = None,
    decay: float = UPDATING_DECAY,
    state: UpdatingPrior | None = None,
    posterior: str = "prefix",
) -> UpdatingPriors:
    """Run eq. 9 over the blocks b = 0..B-1 in order (each block's posterior uses the prior from the blocks
    before it; its evidence per `posterior`). `state` continues an earlier stream (it is updated in place)."""
    E, B, _ = ll_EBT.shape
    state = state or UpdatingPrior(E, decay)
    block_ll_EB = end_of_block_evidence(ll_EBT, mask_BT, posterior)
    priors, posts = [], []
    for b in range(B):
        lp_E = state.log_prior()
        post_E = torch.log_softmax(block_ll_EB[:, b] + lp_E, dim=0)
        priors.append(lp_E)
        posts.append(post_E)
        state.update(post_E)
    empty = torch.empty(E, 0, dtype=torch.float64)
    return UpdatingPriors(
        log_prior_EB=torch.stack(priors, dim=1) if priors else empty,
        log_posterior_EB=torch.stack(posts, dim=1) if posts else empty,
        final_log_prior_E=state.log_prior(),
    )


@dataclass
class CachedPrior:
    """A prior estimated on development data (§5.1 "cached"), with the expert (domain) names it is over."""

    domains: list[str]
    probs: list[float]
    blocks: int = 0  # development blocks it was estimated on
    decay: float = UPDATING_DECAY  # λ (estimator "updating") or α (estimator "ewm"); unused by "mean"
    estimator: str = "updating"  # how it was estimated (CACHED_ESTIMATORS); files without it were "updating"
    posterior: str = "prefix"  # the posterior mode of the end-of-block posteriors (POSTERIORS)

    def log_prior(self, domains: Sequence[str] | None = None) -> torch.Tensor:
        """log p(D = j), E; in the order of `domains` if given (names must match)."""
        order = list(domains) if domains is not None else self.domains
        if sorted(order) != sorted(self.domains):
            raise ValueError(f"cached prior over {self.domains}, asked for {order}")
        by_name = dict(zip(self.domains, self.probs))
        return torch.log(torch.tensor([by_name[d] for d in order], dtype=torch.float64))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "format": CACHED_PRIOR_FORMAT,
                    "domains": self.domains,
                    "probs": self.probs,
                    "blocks": self.blocks,
                    "decay": self.decay,
                    "estimator": self.estimator,
                    "posterior": self.posterior,
                },
                indent=2,
            )
            + "\n"
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> CachedPrior:
        """Read a prior `save` wrote; ValueError naming the file when it is not one, or its probabilities are not
        finite, non-negative with a positive sum (`mixture_weights`)."""
        data = read_json_object(
            path,
            {"format": str, "domains": list, "probs": list, "blocks": int, "decay": float},
            what="cached prior",
        )
        if data.get("format") != CACHED_PRIOR_FORMAT:
            raise ValueError(f"{path}: format {data.get('format')!r}, expected {CACHED_PRIOR_FORMAT!r}")
        if len(data["domains"]) != len(data["probs"]):
            raise ValueError(f"{path}: {len(data['domains'])} domains but {len(data['probs'])} probabilities")
        data["probs"] = mixture_weights(data["probs"], f"{path}: probs")
        estimator, posterior = data.get("estimator", "updating"), data.get("posterior", "prefix")
        if estimator not in CACHED_ESTIMATORS or posterior not in POSTERIORS:
            raise ValueError(
                f"{path}: estimator {estimator!r} / posterior {posterior!r}: expected one of "
                f"{', '.join(CACHED_ESTIMATORS)} / {', '.join(POSTERIORS)}"
            )
        return cls(
            list(data["domains"]),
            [float(p) for p in data["probs"]],
            int(data["blocks"]),
            float(data["decay"]),
            estimator,
            posterior,
        )


def mixture_weights(weights: Sequence[float], what: str) -> list[float]:
    """`weights` over experts normalised to sum 1, after the rule every prior and merge weight obeys: each one a
    finite number >= 0 (data/argtypes.py `check_range`), their sum > 0. An all-zero prior would make every
    posterior 0/0 = NaN (eq. 7), a NaN weight every merged tensor NaN; ValueError naming `what` instead."""
    values = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ValueError(f"{what}[{i}]={w!r}: must be a number")
        values.append(float(in_range(w, nonneg_float, f"{what}[{i}]")))
    total = sum(values)
    if not values or not (math.isfinite(total) and total > 0):
        raise ValueError(
            f"{what}={list(weights)}: need at least one weight > 0 (their sum is the normaliser)"
        )
    return [v / total for v in values]


def estimate_cached_prior(
    dev_ll_EBT: torch.Tensor,
    domains: Sequence[str],
    mask_BT: torch.Tensor | None = None,
    max_blocks: int = CACHED_PRIOR_BLOCKS,
    decay: float | None = None,
    estimator: str = "mean",
    posterior: str = "prefix",
) -> CachedPrior:
    """The cached prior from the first `max_blocks` development blocks (module docstring): the mean of their
    end-of-block posteriors under the uniform prior (estimator "mean", the paper's text), their exponentially
    weighted mean with α = `decay` (default EWM_ALPHA; "ewm", the reference implementation), or the updating
    prior (eq. 9, λ = `decay`, default UPDATING_DECAY) after them ("updating")."""
    if dev_ll_EBT.shape[0] != len(domains):
        raise ValueError(f"{len(domains)} domain names for {dev_ll_EBT.shape[0]} experts")
    if estimator not in CACHED_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}: choose one of {', '.join(CACHED_ESTIMATORS)}")
    _check_posterior(posterior)
    E, n = dev_ll_EBT.shape[0], min(max_blocks, dev_ll_EBT.shape[1])
    mask = None if mask_BT is None else mask_BT[:n]
    if estimator == "updating":
        decay = UPDATING_DECAY if decay is None else decay
        final_E = updating_priors(dev_ll_EBT[:, :n], mask, decay, posterior=posterior).final_log_prior_E.exp()
    else:
        decay = (EWM_ALPHA if decay is None else decay) if estimator == "ewm" else 0.0
        if estimator == "ewm" and not 0.0 < decay <= 1.0:
            raise ValueError(f"α={decay}: must be in (0, 1]")
        post_EB = torch.softmax(end_of_block_evidence(dev_ll_EBT[:, :n], mask, posterior), dim=0)
        if n == 0:
            final_E = uniform_log_prior(E).exp()
        elif estimator == "mean":
            final_E = post_EB.mean(dim=1)
        else:
            final_E = post_EB[:, 0]
            for b in range(1, n):
                final_E = (1 - decay) * final_E + decay * post_EB[:, b]
    final_E = final_E / final_E.sum()
    return CachedPrior(
        list(domains),
        [float(p) for p in final_E],
        blocks=n,
        decay=decay,
        estimator=estimator,
        posterior=posterior,
    )


def topk_experts(log_prior_E: torch.Tensor, k: int) -> list[int]:
    """Indices of the k experts with the highest prior (ties broken by index), sorted."""
    if not 1 <= k <= log_prior_E.shape[0]:
        raise ValueError(f"k={k}: need 1 <= k <= {log_prior_E.shape[0]} experts")
    order = sorted(range(log_prior_E.shape[0]), key=lambda j: (-float(log_prior_E[j]), j))
    return sorted(order[:k])


@dataclass
class TopKResult:
    log_probs_BT: torch.Tensor
    experts: list[int] | None  # the experts kept for the whole stream (select="prior"); None per token
    experts_evaluated: int  # experts whose forward pass is needed per token


def topk_mixture_log_probs(
    ll_EBT: torch.Tensor,
    log_prior_E: torch.Tensor,
    k: int,
    mask_BT: torch.Tensor | None = None,
    select: str = "prior",
    posterior: str = "prefix",
) -> TopKResult:
    """Sparse eq. 6: keep the k experts with the highest posterior and renormalise their weights.

    select="prior": the experts with the k highest (cached) prior, fixed for the stream; the posterior restricted
    to them is eqs. 7-8 with the prior restricted to them, so only k experts run (experts_evaluated = k).
    select="posterior": per token, the k highest of the full posterior (every expert must run: E).
    """
    E = ll_EBT.shape[0]
    if select == "prior":
        keep = topk_experts(log_prior_E, k)
        lp_K = log_prior_E.to(torch.float64)[keep]
        lp = posterior_mixture_log_probs(ll_EBT[keep], lp_K - torch.logsumexp(lp_K, 0), mask_BT, posterior)
        return TopKResult(lp, keep, k)
    if select == "posterior":
        if not 1 <= k <= E:
            raise ValueError(f"k={k}: need 1 <= k <= {E} experts")
        post_EBT = log_posterior(ll_EBT, log_prior_E, mask_BT, posterior)
        kth_BT = torch.topk(post_EBT, k, dim=0).values[-1]
        kept_EBT = torch.where(post_EBT >= kth_BT, post_EBT, torch.full_like(post_EBT, -math.inf))
        return TopKResult(mixture_log_probs(ll_EBT, torch.log_softmax(kept_EBT, dim=0)), None, E)
    raise ValueError(f"select={select!r}: choose prior or posterior")


def perplexity(log_probs_BT: torch.Tensor, mask_BT: torch.Tensor | None = None) -> float:
    """exp(- sum mask * log p / sum mask)."""
    m = _mask(log_probs_BT[None], mask_BT)
    lp = torch.where(m.bool(), log_probs_BT.to(torch.float64), torch.zeros((), dtype=torch.float64))
    return math.exp(-float(lp.sum()) / max(float(m.sum()), 1.0))


def expert_perplexities(ll_EBT: torch.Tensor, mask_BT: torch.Tensor | None = None) -> list[float]:
    """Perplexity of each expert alone, E (the naive baseline's candidates; Figure 2's cells)."""
    return [perplexity(ll_EBT[j], mask_BT) for j in range(ll_EBT.shape[0])]


def naive_expert(ll_EBT: torch.Tensor, known: int | None = None, mask_BT: torch.Tensor | None = None) -> int:
    """The naive baseline's expert: the known domain's expert if given, else the best single expert on this data."""
    if known is not None:
        return known
    ppl = expert_perplexities(ll_EBT, mask_BT)
    return min(range(len(ppl)), key=lambda j: (ppl[j], j))
