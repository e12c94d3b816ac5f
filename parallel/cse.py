"""CSE from outside the model: the warm-up boundary (sample, gather, cluster, copy experts) and the per-step
centre update, identical on every data-parallel replica.

Shape legend: N sampled sequences (all ranks), L CSE layers, P projection dim, E expert slots, K clusters.

The trainer calls one object (`CSEController`) twice per step-loop iteration at most:

    # after build_engine:
    cse = CSEController(bundle.engine.module, cfg.model.ffn.cse, cfg.train.steps, bundle.groups,
                        optimizer=bundle.engine.optimizer, domain_names=plan.catalog.train_domains)
    ...
    rec = cse.after_step(done, lambda i: to_model_batch(sampler.batch(done + i // ga, i % ga), device, plan))
    if rec is not None and rank == 0: log.log({"kind": "cse", "step": done, **rec})

What happens (CSE paper, Algorithm 1):
1. Warm-up (`done < boundary`, boundary = max(1, round(warmup_fraction x steps))): nothing. A CSE layer with no
   active cluster sends every sequence to expert 0, so the model is the dense model.
2. At the boundary (the first `after_step` with `done >= boundary` while no layer is clustered - so a resumed run
   whose checkpoint is past the boundary, whose cluster state came back in the model's buffers, does nothing):
   each data-parallel rank embeds ceil(num_samples / dp) sequences from `batch_fn` (forward in eval mode, no grad;
   the CSE layers' inputs are captured by forward hooks, so the model needs no recording mode); the embeddings
   are all-gathered over the data-parallel group; global rank 0 runs DBSCAN per layer (`cluster_embeddings`) and
   broadcasts centres, radii and K to every rank; every rank copies expert 0 into experts 1..K-1 of each layer,
   and activates the K clusters.
3. After the boundary, every step: the routed embeddings' per-cluster sums and counts that the layers accumulated
   during the step's forward passes are all-reduced over the data-parallel group and the batch EMA centre update
   is applied (model/cse.py), so the centres stay identical on all replicas.

Optimizer state of the copies (our choice): a copy continues expert 0's trajectory, i.e. it gets expert 0's fp32
master weights and Adam moments (exp_avg, exp_avg_sq) as well as its weights - "copy the module" taken literally,
so the first update after the boundary is the same for all K copies given the same gradient (no re-warm-up of
Adam on fresh zero moments, which would make the copies take lr-sized sign steps). ZeRO 1/2 and DeepSpeed's bf16
optimizer hold the fp32 copies in flat partitions; each rank's fragment is read, all-reduced into the full tensor
and written into the copy's fragment (a collective over the data-parallel group, in the same order on every rank).
ZeRO 0 uses the torch optimizer's per-parameter state; with fp16 at ZeRO 0 that state is keyed by the fp32 masters of
DeepSpeed's FP16_UnfusedOptimizer, which are copied too (each step writes the masters back into the fp16 module).
Experts K..E-1 stay unused (their gradient is exactly zero; AdamW weight decay still shrinks them, which is harmless:
they are never read).

`dbscan_eps <= 0` selects eps from the data (`dbscan_auto`), since the scale of the projected embeddings depends on
the model. All three read the k-distances d_i (distance of sample i to its `dbscan_min_samples`-th nearest neighbour):
* median  2 x median_i d_i (a density heuristic; on embeddings that have not separated yet it joins everything
          into one cluster);
* knee    the knee of the sorted k-distance curve (Ester et al. 1996's "valley"; found as the point farthest below
          the chord from the smallest to the largest d, both axes scaled to [0, 1]);
* target  DBSCAN at eps = each of 49 quantiles (2 %..98 %) of d; of the eps giving at least min_clusters
          clusters, the one with the most clusters (counted up to max_clusters: only the largest max_clusters are
          kept) and, among those, the fewest samples left as noise (ties: the smaller eps); if no eps reaches
          min_clusters, the count closest to it. Every candidate's (eps, clusters, noise) is recorded.
          Why most clusters before least noise: as eps grows DBSCAN first absorbs noise into clusters and then
          merges clusters; "least noise within the range" picks the eps just before everything merges into
          min_clusters lopsided clusters. Measured on the layer-3 sequence embeddings of `make reproduce`'s
          Dense model (256 train blocks of 8 domains; experiments/results/cse_eps.md): least noise chose 4
          clusters of 161/32/32/28 with routed purity 0.44, most clusters 8 clusters with purity 0.84.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from model.config import CSEConfig
from model.cse import CSEFFN, cse_layers
from parallel import ds_private

BatchFn = Callable[[int], dict]


# ----------------------------------------------------------------------------------------------------
# Clustering (pure)
# ----------------------------------------------------------------------------------------------------


@dataclass
class ClusterResult:
    centres_KP: torch.Tensor
    radii_K: torch.Tensor
    dbscan_labels_N: np.ndarray  # DBSCAN's label per sample after re-indexing by size (-1: noise or dropped)
    eps: float
    eps_method: str = "fixed"  # fixed (configured) or the automatic method that chose it
    eps_scan: list[dict[str, float]] | None = (
        None  # dbscan_auto=target: every candidate's eps, clusters, noise
    )

    @property
    def num_clusters(self) -> int:
        return int(self.centres_KP.shape[0])


AUTO_METHODS: tuple[str, ...] = ("median", "knee", "target")


def k_distances(v_NP: np.ndarray, min_samples: int) -> np.ndarray:
    """Distance of every sample to its `min_samples`-th nearest neighbour (itself excluded), N."""
    from sklearn.neighbors import NearestNeighbors

    k = max(1, min(min_samples, len(v_NP) - 1))
    dist_NK, _ = NearestNeighbors(n_neighbors=k + 1).fit(v_NP).kneighbors(v_NP)
    return dist_NK[:, k]


def auto_eps(v_NP: np.ndarray, min_samples: int) -> float:
    """Twice the median distance to the `min_samples`-th nearest neighbour (k-distance heuristic for DBSCAN's eps;
    the factor 2 lets small long-tail clusters, whose k-distances are larger than the big ones', still form)."""
    return 2.0 * float(np.median(k_distances(v_NP, min_samples))) or 1e-6


def knee_eps(v_NP: np.ndarray, min_samples: int) -> float:
    """The knee of the ascending k-distance curve: the point farthest below its chord (axes scaled to [0, 1])."""
    d = np.sort(k_distances(v_NP, min_samples))
    if len(d) < 3 or d[-1] <= d[0]:
        return float(d[-1]) or 1e-6
    x, y = np.linspace(0.0, 1.0, len(d)), (d - d[0]) / (d[-1] - d[0])
    return float(d[int(np.argmax(x - y))]) or 1e-6


def _count(labels: np.ndarray) -> tuple[int, int]:
    return int(len(np.unique(labels[labels >= 0]))), int((labels < 0).sum())


def target_eps(v_NP: np.ndarray, min_samples: int, lo: int, hi: int) -> tuple[float, list[dict[str, float]]]:
    """The eps (among 49 quantiles of the k-distances) whose DBSCAN gives the most clusters (at least lo, counted up
    to hi) and, among those, the least noise; else the count closest to lo. Returns it and every candidate's
    {eps, clusters, noise}."""
    from sklearn.cluster import DBSCAN

    d = k_distances(v_NP, min_samples)
    cands = np.unique(np.quantile(d, np.linspace(0.02, 0.98, 49)))
    scan = []
    for eps in cands[cands > 0]:
        k, noise = _count(DBSCAN(eps=float(eps), min_samples=min_samples).fit(v_NP).labels_)
        scan.append({"eps": float(eps), "clusters": k, "noise": noise})
    if not scan:
        return 1e-6, scan
    best = min(scan, key=lambda r: _target_key(r, lo, hi))
    return best["eps"], scan


def _target_key(r: dict[str, float], lo: int, hi: int) -> tuple[float, ...]:
    """Sort key of a `target` candidate (smallest wins): reaching `lo` clusters first, then the most clusters
    counted up to `hi` (DBSCAN keeps the `hi` largest), then the least noise, then the smaller eps."""
    return (max(lo - r["clusters"], 0), -min(r["clusters"], hi), r["noise"], r["eps"])


def cluster_embeddings(
    v_NP: torch.Tensor,
    eps: float,
    min_samples: int,
    max_clusters: int,
    auto: str = "median",
    min_clusters: int = 2,
) -> ClusterResult:
    """DBSCAN on the projected embeddings; clusters sorted by size (largest first), at most `max_clusters` kept.
    `eps <= 0`: chosen from the data by `auto` (module docstring; `min_clusters`..`max_clusters` for "target").

        c_j = mean of cluster j's members,   r_j = mean_i ||v'_i - c_j|| over its members   (CSE §3 "Initialization")

    Noise points (and members of dropped clusters) belong to no cluster at initialisation; they are dispatched by
    the same rule as every other sequence afterwards. No cluster at all (everything noise) gives one cluster of
    all the samples, i.e. CSE degenerates to the dense model.
    """
    from sklearn.cluster import DBSCAN

    if auto not in AUTO_METHODS:
        raise ValueError(f"dbscan_auto={auto!r}: choose one of {', '.join(AUTO_METHODS)}")
    x = v_NP.detach().double().cpu().numpy()
    scan: list[dict[str, float]] = []
    method = "fixed" if eps > 0 else auto
    if eps > 0:
        eps = float(eps)
    elif auto == "median":
        eps = auto_eps(x, min_samples)
    elif auto == "knee":
        eps = knee_eps(x, min_samples)
    else:
        eps, scan = target_eps(x, min_samples, min_clusters, max_clusters)
    raw = DBSCAN(eps=eps, min_samples=min_samples).fit(x).labels_
    ids, sizes = np.unique(raw[raw >= 0], return_counts=True)
    order = ids[np.argsort(-sizes, kind="stable")][:max_clusters]
    labels = np.full(len(x), -1)
    for new, old in enumerate(order):
        labels[raw == old] = new
    if not len(order):
        labels[:] = 0
    k = max(1, len(order))
    centres = np.stack([x[labels == j].mean(0) for j in range(k)])
    radii = np.array([np.linalg.norm(x[labels == j] - centres[j], axis=1).mean() for j in range(k)])
    return ClusterResult(
        torch.tensor(centres, dtype=torch.float32),
        torch.tensor(radii, dtype=torch.float32).clamp_min(1e-6),
        labels,
        eps,
        method,
        scan,
    )


def purity(clusters_N: np.ndarray, domains_N: np.ndarray) -> float:
    """Cluster purity against the true domains: (1/N) sum_j max_d |{i : cluster_i = j, domain_i = d}|
    (1.0 = every cluster holds one domain; one cluster of everything scores the largest domain's share)."""
    clusters_N, domains_N = np.asarray(clusters_N), np.asarray(domains_N)
    if not len(clusters_N):
        return 0.0
    total = 0
    for j in np.unique(clusters_N):
        _, cnt = np.unique(domains_N[clusters_N == j], return_counts=True)
        total += int(cnt.max())
    return total / len(clusters_N)


def cluster_record(
    res: ClusterResult, v_NP: torch.Tensor, domains_N: np.ndarray | None, domain_names: Sequence[str] = ()
) -> dict[str, Any]:
    """What a practitioner reads about one layer's clustering: sizes, radii, inter-centre distances, domain shares."""
    from model.cse import dispatch

    routed = dispatch(v_NP.float(), res.centres_KP, res.radii_K).numpy()
    k = res.num_clusters
    rec: dict[str, Any] = {
        "num_clusters": k,
        "eps": res.eps,
        "eps_method": res.eps_method,
        "noise": int((res.dbscan_labels_N < 0).sum()),
        "dbscan_sizes": [int((res.dbscan_labels_N == j).sum()) for j in range(k)],
        "dispatch_sizes": [int((routed == j).sum()) for j in range(k)],
        "radii": res.radii_K.tolist(),
        "centre_distances": torch.cdist(res.centres_KP, res.centres_KP).tolist(),
    }
    if domains_N is not None:
        name = (lambda d: domain_names[d]) if domain_names else str
        share = {}
        for j in range(k):
            members = domains_N[routed == j]
            vals, cnt = np.unique(members, return_counts=True)
            share[str(j)] = {
                name(int(d)): round(float(c) / max(1, len(members)), 4) for d, c in zip(vals, cnt)
            }
        rec["domain_share"] = share
        rec["purity"] = purity(routed, domains_N)
    if res.eps_scan:
        rec["eps_scan"] = res.eps_scan
    return rec


# ----------------------------------------------------------------------------------------------------
# Copying expert 0 (weights and optimizer state)
# ----------------------------------------------------------------------------------------------------


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    opt = optimizer
    while opt is not None and not isinstance(opt, torch.optim.Optimizer):
        opt = getattr(opt, "optimizer", None)
    return opt


def _flat_state(p: torch.Tensor, opt: torch.optim.Optimizer, key: str) -> torch.Tensor | None:
    """The slice of the flat fp32 optimizer state `key` that holds this rank's fragment of `p` (None if no fragment).

    Found through the storage of the fp32 master fragment, which is a view into the same flat partition that the
    torch optimizer's state is keyed by. (deepspeed.utils.safe_get_full_optimizer_state misses the state of some
    groups in DeepSpeed 0.19 - e.g. the no-decay biases - whose fragments are linked with no optimizer keys.)"""
    m = ds_private.hp_mapping(p)
    if m is None or m.hp_fragment.numel() == 0:
        return None
    storage = m.hp_fragment.untyped_storage().data_ptr()
    for flat, st in opt.state.items():
        if flat.untyped_storage().data_ptr() == storage and key in st:
            return st[key].narrow(0, m.hp_fragment_address.start, m.hp_fragment_address.numel)
    return None


def _full_state(p: torch.Tensor, opt: torch.optim.Optimizer | None, key: str | None) -> torch.Tensor:
    """The whole fp32 value (master weight when key is None) of a ZeRO-partitioned parameter (collective).
    Optimizer state (a key) needs the torch optimizer that holds it."""
    buf = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
    if key is None:
        frag = ds_private.hp_mapping(p).hp_fragment if ds_private.hp_mapping(p) is not None else None
    elif opt is None:
        raise ValueError(
            f"optimizer state {key!r} of a ZeRO-partitioned parameter: no torch optimizer holds it"
        )
    else:
        frag = _flat_state(p, opt, key)
    if frag is not None:
        a = ds_private.hp_mapping(p).lp_fragment_address
        buf.narrow(0, a.start, a.numel).copy_(frag.flatten())
    dist.all_reduce(buf, group=ds_private.param_dp_group(p))
    return buf


def _set_state(p: torch.Tensor, opt: torch.optim.Optimizer, key: str | None, value: torch.Tensor) -> None:
    frag = (
        (ds_private.hp_mapping(p).hp_fragment if ds_private.hp_mapping(p) is not None else None)
        if key is None
        else _flat_state(p, opt, key)
    )
    if frag is not None:
        a = ds_private.hp_mapping(p).lp_fragment_address
        frag.copy_(value.narrow(0, a.start, a.numel).view_as(frag))


@dataclass
class _Master:
    """Where a model parameter's fp32 master lives: `numel` elements from `start` of `key`, the tensor the torch
    optimizer's state is keyed by (the parameter itself, its own fp32 copy, or a flat group holding several)."""

    key: torch.Tensor
    start: int
    numel: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This parameter's slice of `key` or of a state tensor shaped like it."""
        return t.view(-1).narrow(0, self.start, self.numel)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.numel == self.key.numel()


def _fp16_masters(optimizer: Any) -> dict[int, _Master]:
    """id(model parameter) -> its fp32 master under DeepSpeed's ZeRO-0 fp16 wrappers (empty for any other optimizer).

    FP16_UnfusedOptimizer (what the engine wraps our AdamW in at ZeRO 0 fp16) keeps one fp32 copy per parameter
    (`fp32_groups`); FP16_Optimizer (picked for a FusedAdam client optimizer) one flat fp32 tensor per group
    (`fp32_groups_flat`, parameters concatenated in `fp16_groups` order). Each step writes the masters back into
    the module, so a copy that skips them is undone."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return {}  # a plain torch optimizer (ZeRO 0 fp32, bf16 autocast): no deepspeed import needed
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    masters: dict[int, _Master] = {}
    opt = optimizer
    while opt is not None and not isinstance(opt, torch.optim.Optimizer):
        if isinstance(opt, FP16_UnfusedOptimizer):
            for lp_group, hp_group in zip(opt.fp16_groups, opt.fp32_groups):
                masters.update((id(lp), _Master(hp, 0, hp.numel())) for lp, hp in zip(lp_group, hp_group))
        elif isinstance(opt, FP16_Optimizer):
            for lp_group, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
                start = 0
                for lp in lp_group:
                    masters[id(lp)] = _Master(flat, start, lp.numel())
                    start += lp.numel()
        opt = getattr(opt, "optimizer", None)
    return masters


def _copy_master(src: _Master, dst: _Master, opt: torch.optim.Optimizer) -> None:
    """dst's fp32 master and optimizer state <- src's (per-parameter state is cloned whole, step count included;
    in a flat group only the parameter's slices of the element-wise state tensors are copied)."""
    dst.of(dst.key).copy_(src.of(src.key))
    state = opt.state.get(src.key)
    if src.whole and dst.whole:
        if state:
            opt.state[dst.key] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
        else:
            opt.state.pop(dst.key, None)
        return
    into = opt.state.get(dst.key, {})
    for k, v in (state or {}).items():
        if torch.is_tensor(v) and v.shape == src.key.shape and k in into:
            dst.of(into[k]).copy_(src.of(v))


@torch.no_grad()
def copy_expert(src: nn.Module, dst: nn.Module, optimizer: Any = None) -> None:
    """dst <- src: weights, fp32 master weights and Adam moments (see the module docstring), under every optimizer
    the engine builds: ZeRO 1/2 partitions, DeepSpeed's ZeRO-0 fp16 masters, or the torch optimizer's own state."""
    opt = _torch_optimizer(optimizer)
    masters = _fp16_masters(optimizer)
    for p_src, p_dst in zip(src.parameters(), dst.parameters()):
        p_dst.data.copy_(p_src.data)
        if opt is None:
            continue
        if ds_private.has_hp_mapping(p_src):  # ZeRO 1/2, bf16 optimizer: flat fp32 partitions
            for key in (None, "exp_avg", "exp_avg_sq"):
                _set_state(p_dst, opt, key, _full_state(p_src, opt, key))
        else:  # the parameter is its own master, unless a ZeRO-0 fp16 wrapper holds one
            _copy_master(
                masters.get(id(p_src), _Master(p_src, 0, p_src.numel())),
                masters.get(id(p_dst), _Master(p_dst, 0, p_dst.numel())),
                opt,
            )


# ----------------------------------------------------------------------------------------------------
# The controller
# ----------------------------------------------------------------------------------------------------


class CSEController:
    """Drives the CSE layers of `model` (the plain module, e.g. `bundle.engine.module`) during training."""

    def __init__(
        self,
        model: nn.Module,
        cse: CSEConfig,
        steps: int,
        groups: Any = None,
        optimizer: Any = None,
        domain_names: Sequence[str] = (),
    ) -> None:
        self.model = model
        self.cse = cse
        self.layers: list[CSEFFN] = cse_layers(model)
        self.groups = groups
        self.optimizer = optimizer
        self.domain_names = list(domain_names)
        self.boundary = max(1, int(round(self.cse.warmup_fraction * steps)))  # of the run's `steps`
        self.clustered_at: int | None = None
        # Read the layers' buffers once (a host sync); afterwards the flag changes only in `initialise`, so the
        # per-step check costs no device round trip.
        self._clustered = bool(self.layers) and all(int(layer.num_active) > 0 for layer in self.layers)

    # -- distributed helpers ------------------------------------------------------------------------
    def _dp(self) -> tuple[Any | None, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1
        group = self.groups.dp_group if self.groups is not None else None
        return group, dist.get_world_size(group)

    @property
    def is_clustered(self) -> bool:
        return self._clustered

    # -- the hook -----------------------------------------------------------------------------------
    def after_step(self, step: int, batch_fn: BatchFn) -> dict[str, Any] | None:
        """Call after optimizer step `step` (1-based count of steps done). Returns a record when it clustered."""
        if not self.layers:
            return None
        if self.is_clustered:
            self.update_centres()
            return None
        if step < self.boundary:
            return None
        rec = self.initialise(batch_fn)
        self.clustered_at = step
        return rec

    @torch.no_grad()
    def update_centres(self) -> None:
        """All-reduce the step's per-cluster sums and counts over data-parallel replicas, then apply the EMA."""
        group, size = self._dp()
        for layer in self.layers:
            if size > 1:
                buf = torch.cat([layer.pending_sum_EP.flatten(), layer.pending_count_E])
                dist.all_reduce(buf, group=group)
                n = layer.pending_sum_EP.numel()
                layer.pending_sum_EP.copy_(buf[:n].view_as(layer.pending_sum_EP))
                layer.pending_count_E.copy_(buf[n:])
            layer.apply_centre_update()

    @torch.no_grad()
    def sample_embeddings(self, batch_fn: BatchFn, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(v'_{n_local, L, P}, domain ids) of this rank's first n_local sequences of `batch_fn`."""
        captured: list[list[torch.Tensor]] = [[] for _ in self.layers]
        # Kept on the training device: the embeddings are all-gathered next (NCCL reduces nothing on the host).
        hooks = [
            layer.register_forward_hook(
                lambda mod, args, out, i=i: captured[i].append(mod.embed(args[0]).detach())
            )
            for i, layer in enumerate(self.layers)
        ]
        was_training = self.model.training
        self.model.eval()
        domains, got, i = [], 0, 0
        try:
            while got < n_local:
                b = batch_fn(i)
                # A CSE layer routes by its clusters, never by the batch's ids: none are passed.
                self.model(b["tokens"], return_logits=False)
                dev = b["tokens"].device
                domains.append(
                    b.get("domain_ids", torch.full((b["tokens"].shape[0],), -1, device=dev)).to(dev)
                )
                got, i = got + b["tokens"].shape[0], i + 1
        finally:
            for h in hooks:
                h.remove()
            self.model.train(was_training)
        v = torch.stack([torch.cat(c)[:n_local] for c in captured], dim=1)
        return v, torch.cat(domains)[:n_local].long().to(v.device)

    @torch.no_grad()
    def initialise(self, batch_fn: BatchFn) -> dict[str, Any]:
        """The warm-up boundary: sample, gather, cluster on rank 0, broadcast, copy experts, activate."""
        group, dp = self._dp()
        n_local = math.ceil(self.cse.num_samples / dp)
        v_nLP, dom_n = self.sample_embeddings(batch_fn, n_local)
        if dp > 1:
            vs = [torch.empty_like(v_nLP) for _ in range(dp)]
            ds = [torch.empty_like(dom_n) for _ in range(dp)]
            dist.all_gather(vs, v_nLP.contiguous(), group=group)
            dist.all_gather(ds, dom_n.contiguous(), group=group)
            v_nLP, dom_n = torch.cat(vs), torch.cat(ds)
        device = v_nLP.device
        v_nLP, dom_n = v_nLP.cpu(), dom_n.cpu()  # clustering runs on the host (scikit-learn)
        L, E, P = len(self.layers), self.layers[0].num_slots, v_nLP.shape[-1]
        # per layer: centres (E*P), radii (E), K; broadcast
        state = torch.zeros(L, E * P + E + 1, device=device)
        layer_recs: dict[str, Any] = {}
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed or dist.get_rank() == 0:
            labels = dom_n.numpy() if bool((dom_n >= 0).all()) else None
            for li, layer in enumerate(self.layers):
                res = cluster_embeddings(
                    v_nLP[:, li],
                    self.cse.dbscan_eps,
                    self.cse.dbscan_min_samples,
                    min(self.cse.max_clusters, layer.num_slots),
                    self.cse.dbscan_auto,
                    min(self.cse.min_clusters, layer.num_slots),
                )
                k = res.num_clusters
                state[li, : k * P] = res.centres_KP.flatten()
                state[li, E * P : E * P + k] = res.radii_K
                state[li, -1] = k
                layer_recs[str(layer.layer_idx)] = cluster_record(
                    res, v_nLP[:, li], labels, self.domain_names
                )
        if distributed:
            dist.broadcast(state, src=0)
        state = state.cpu()
        for li, layer in enumerate(self.layers):
            k = int(state[li, -1])
            for j in range(1, k):
                copy_expert(layer.experts["0"], layer.experts[str(j)], self.optimizer)
            layer.set_clusters(state[li, : k * P].view(k, P), state[li, E * P : E * P + k])
        self._clustered = True
        return {
            "samples": int(v_nLP.shape[0]),
            "num_clusters": [int(state[li, -1]) for li in range(L)],
            "layers": layer_recs,
        }

    # -- checkpoints (the cluster state itself is in the model's buffers) ---------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"boundary": self.boundary, "clustered_at": self.clustered_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clustered_at = state.get("clustered_at")
