"""Cluster-guided sparse experts (CSE paper, Algorithm 1): a sequence-level FFN layer routed by distance to
cluster centres, plain PyTorch.

Shape legend: B batch (sequences), T tokens per sequence, D model dim, P projection dim, E expert slots
(`cfg.ffn.num_experts`, else `cse.max_clusters`), K active clusters (K <= E), N routed rows.

The layer holds E copies of the dense MLP from the start, so the parameter set never changes after the optimizer
is built; "copying the FFN per cluster" at the warm-up boundary is an in-place copy of expert 0 into experts
1..K-1 done from outside (parallel/cse.py). Cluster state lives in buffers (saved with the model's state dict):

    num_active   ()      K; 0 = not clustered yet: every sequence uses expert 0, i.e. the layer *is* the dense FFN.
                         Mirrored on the host (`active`) so that a forward never reads it back
    centres_EP   (E, P)  c_j, rows >= K unused
    radii_E      (E,)    r_j = mean distance of cluster j's members to c_j
    projection_DP (D, P) M, the fixed Gaussian (Johnson-Lindenstrauss) matrix, entries N(0, 1/P), seeded by the
                         layer index so every replica and every rebuild has the same one

Sequence embedding (CSE §3 "Dispatch Embeddings"): the mean over the sequence's tokens of the states this layer's
FFN receives, i.e. ln2(x) of the block (post-LayerNorm residual stream), then projected:

    v_b  = (1/T) Σ_t x_{b,t}          v'_b = v_b M  (P dims)
    j_b  = argmin_{j<K} ||v'_b - c_j|| / r_j       (Algorithm 1, line 5)
    h_{b,t} = FFN_{j_b}(x_{b,t})

The mean runs over the whole sequence, so in a causal LM the expert chosen for token t depends on later tokens
of the same sequence (at most log2 K bits per sequence); this follows the paper, which routes on the full sequence.

Centre update (Algorithm 1, line 7: c_j <- α c_j + (1-α) v' per sequence). Applying it sequence by sequence inside
forward would make replicas diverge (each data-parallel rank sees other sequences) and depend on order. The layer
instead accumulates, while training, the per-cluster sum and count of the routed v' in non-persistent buffers;
`apply_centre_update` then applies the order-free batch form of the rule for n_j sequences of mean m_j:

    c_j <- α^{n_j} c_j + (1 - α^{n_j}) m_j

(exactly the sequential rule when the n_j embeddings are equal; α^{n_j} is the weight the old centre keeps after n_j
sequential updates either way). parallel/cse.py all-reduces the sums and counts over the data-parallel group first,
so every replica applies the same update once per optimizer step. Without it (one process) it applies the local ones.

Host reads (a synchronisation each on a GPU). K is known on the host (`active`): it changes only in `set_clusters`, or
when the buffer is written from outside (a loaded state dict or training state, read back once on the next use).
Before clustering and with one cluster every sequence goes to
expert 0, so the routing is known on the host too and a forward reads nothing. With K >= 2 the cluster of each
sequence is computed on the device from this layer's own input (after the block's attention), and the experts run
on slices of host-known sizes (`model.demix.run_grouped`): the per-cluster counts are read once per layer and
micro-batch (`routed_counts`), the one read the routing needs. No earlier point knows them (layer l's embedding
depends on layers < l), and routing without them would run every active expert on every sequence (K x the FFN
FLOPs) or gather a weight copy per sequence. (DEMix reads nothing: its ids come from the sampler, on the host.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from model.config import ModelConfig
from model.demix import run_grouped
from model.mlp import MLP, FFNOutput

PROJECTION_SEED = 0xC5E  # fixed: the projection is a pure function of (layer, D, P)


def num_expert_slots(cfg: ModelConfig) -> int:
    """E: experts built per CSE layer (the resolved `ffn.num_experts`, else `cse.max_clusters`)."""
    return cfg.ffn.num_experts if cfg.ffn.num_experts > 0 else cfg.ffn.cse.max_clusters


def gaussian_projection(d_model: int, dim: int, seed: int) -> torch.Tensor:
    """M (D x P) with entries N(0, 1/P): E||vM||² = ||v||² (Johnson-Lindenstrauss), on CPU, deterministic."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(d_model, dim, generator=gen, device="cpu") / dim**0.5


def dispatch(v_BP: torch.Tensor, centres_KP: torch.Tensor, radii_K: torch.Tensor) -> torch.Tensor:
    """j_b = argmin_j ||v'_b - c_j|| / r_j (ties to the lower index); radii are clamped away from 0."""
    dist_BK = torch.cdist(v_BP.float(), centres_KP.float())
    return (dist_BK / radii_K.float().clamp_min(1e-6)).argmin(dim=1)


def ema_centres(
    centres_KP: torch.Tensor, sums_KP: torch.Tensor, counts_K: torch.Tensor, alpha: float
) -> torch.Tensor:
    """c_j <- α^{n_j} c_j + (1 - α^{n_j}) m_j with m_j = sums_j / n_j; clusters with n_j = 0 keep their centre."""
    keep_K = torch.pow(torch.full_like(counts_K, alpha, dtype=torch.float64), counts_K.double())
    mean_KP = sums_KP.double() / counts_K.double().clamp_min(1.0)[:, None]
    new = keep_K[:, None] * centres_KP.double() + (1.0 - keep_K[:, None]) * mean_KP
    return torch.where((counts_K > 0)[:, None], new, centres_KP.double()).to(centres_KP.dtype)


class CSEFFN(nn.Module):
    """A CSE expert layer: E MLP copies, sequence routing by normalised distance to cluster centres."""

    # buffers (register_buffer in __init__), declared for the type checker
    num_active: torch.Tensor
    centres_EP: torch.Tensor
    radii_E: torch.Tensor
    projection_DP: torch.Tensor
    pending_sum_EP: torch.Tensor
    pending_count_E: torch.Tensor

    def __init__(self, cfg: ModelConfig, layer_idx: int, num_slots: int | None = None) -> None:
        super().__init__()
        c = cfg.ffn.cse
        self.alpha = float(c.centre_momentum)
        self.layer_idx = layer_idx
        self.num_slots = int(num_slots or num_expert_slots(cfg))
        self.experts = nn.ModuleDict(
            {str(e): MLP(cfg.d_model, cfg.d_ffn, cfg.dropout) for e in range(self.num_slots)}
        )
        E, P = self.num_slots, c.projection_dim
        self.register_buffer("num_active", torch.zeros((), dtype=torch.long))
        # K on the host, and the buffer it mirrors
        self._active, self._active_stamp = (
            0,
            self._num_active_stamp(),
        )
        self.register_buffer("centres_EP", torch.zeros(E, P))
        self.register_buffer("radii_E", torch.ones(E))
        self.register_buffer(
            "projection_DP", gaussian_projection(cfg.d_model, P, PROJECTION_SEED + layer_idx)
        )
        # per-step accumulators for the centre update (not part of the checkpoint: consumed every step)
        self.register_buffer("pending_sum_EP", torch.zeros(E, P, dtype=torch.float64), persistent=False)
        self.register_buffer("pending_count_E", torch.zeros(E, dtype=torch.float64), persistent=False)

    @property
    def expert_ids(self) -> list[int]:
        return list(range(self.num_slots))

    @property
    def active(self) -> int:
        """K, the number of active clusters, as a host int. The `num_active` buffer is read back once after anything
        but `set_clusters` wrote it (a loaded state dict, a restored training state) or replaced it (a move to another
        device), as its identity and version counter (a host-side count of in-place writes) tell; so once per run at
        most in training, never per step."""
        stamp = self._num_active_stamp()
        if stamp is None or stamp != self._active_stamp:
            self._active, self._active_stamp = int(self.num_active), stamp
        return self._active

    def _num_active_stamp(self) -> tuple[int, int] | None:
        """(identity, in-place writes) of the `num_active` buffer, both known on the host; None for a tensor made in
        `torch.inference_mode`, which counts no writes (then `active` reads the buffer every time)."""
        try:
            return id(self.num_active), self.num_active._version
        except RuntimeError:
            return None

    def embed(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """v'_B P = mean_t(x) M, detached (routing is not differentiable)."""
        return x_BTD.detach().float().mean(dim=1) @ self.projection_DP.float()

    def assign(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert id per sequence, v'); all zeros before clustering."""
        v_BP = self.embed(x_BTD)
        k = self.active
        if k == 0:
            return torch.zeros(x_BTD.shape[0], dtype=torch.long, device=x_BTD.device), v_BP
        return dispatch(v_BP, self.centres_EP[:k], self.radii_E[:k]), v_BP

    @torch.no_grad()
    def set_clusters(self, centres_KP: torch.Tensor, radii_K: torch.Tensor) -> None:
        """Activate K clusters (K <= E) with these centres and radii (same call on every replica)."""
        k = centres_KP.shape[0]
        if not 1 <= k <= self.num_slots:
            raise ValueError(f"{k} clusters for {self.num_slots} expert slots")
        self.centres_EP.zero_()
        self.radii_E.fill_(1.0)
        self.centres_EP[:k] = centres_KP.to(self.centres_EP)
        self.radii_E[:k] = radii_K.to(self.radii_E).clamp_min(1e-6)
        self.num_active.fill_(k)
        self._active, self._active_stamp = k, self._num_active_stamp()
        self.pending_sum_EP.zero_()
        self.pending_count_E.zero_()

    @torch.no_grad()
    def apply_centre_update(self) -> None:
        """Apply the accumulated batch EMA update (see the module docstring) and clear the accumulators."""
        k = self.active
        if k:
            self.centres_EP[:k] = ema_centres(
                self.centres_EP[:k], self.pending_sum_EP[:k], self.pending_count_E[:k], self.alpha
            )
        self.pending_sum_EP.zero_()
        self.pending_count_E.zero_()

    def forward(self, x_BTD: torch.Tensor, domain_ids_B: torch.Tensor | None = None) -> FFNOutput:
        ids_B, v_BP = self.assign(x_BTD)
        k = self.active
        if self.training and k and torch.is_grad_enabled():
            with torch.no_grad():
                self.pending_sum_EP.index_add_(0, ids_B, v_BP.double())
                self.pending_count_E.index_add_(0, ids_B, torch.ones_like(ids_B, dtype=torch.float64))
        # One permutation for all experts (model.demix.run_grouped): sequences sorted by cluster, each expert on its
        # contiguous slice, one scatter back; experts with no sequence get a zero gradient (uniform reduction
        # across replicas).
        counts_E = routed_load(ids_B, self.num_slots)
        if k <= 1:  # every sequence to expert 0, known on the host: nothing to read, nothing to permute
            counts, order_B = [x_BTD.shape[0]] + [0] * (self.num_slots - 1), None
        else:
            counts = routed_counts(counts_E)  # the routing's one host read (module docstring)
            # A stable sort of one cluster's ids is the identity: no gather/scatter.
            order_B = None if sum(n > 0 for n in counts) == 1 else torch.argsort(ids_B, stable=True)
        out_BTD = run_grouped(x_BTD, [self.experts[str(e)] for e in range(self.num_slots)], counts, order_B)
        load_E = counts_E.to(x_BTD.dtype)
        stats = {"cluster_load_E": load_E.detach(), "num_clusters": self.num_active.detach().float()}
        return FFNOutput(hidden=out_BTD, stats=stats)


def routed_load(ids_B: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Sequences per expert slot (E, int64) on the ids' device, by a scatter-add: `torch.bincount` would read the
    device on a GPU (CUDA's kernel sizes its output from `ids.max()`, a hidden synchronisation)."""
    return torch.zeros(num_slots, dtype=torch.long, device=ids_B.device).index_add_(
        0, ids_B, torch.ones_like(ids_B)
    )


def routed_counts(counts_E: torch.Tensor) -> list[int]:
    """Sequences routed to each expert slot, on the host: the one device-to-host read of a clustered CSE layer's
    forward (a synchronisation on a GPU; see the module docstring for why it stays)."""
    return counts_E.tolist()


def cse_layers(model: nn.Module) -> list[CSEFFN]:
    """The CSE layers of a model, in order."""
    return [m for m in model.modules() if isinstance(m, CSEFFN)]


def build_cse(cfg: ModelConfig, layer_idx: int, expert_ids: Sequence[int]) -> CSEFFN:
    """The seam's builder: every replica holds every expert slot (`expert_ids` is ignored: CSE is data-parallel)."""
    return CSEFFN(cfg, layer_idx)
