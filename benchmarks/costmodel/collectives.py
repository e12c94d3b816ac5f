"""Collectives in the alpha-beta model: ring and hierarchical all-reduce, pairwise-exchange all-to-all, and the
bytes each node pushes through its NICs for them. docs/costmodel.md."""

from __future__ import annotations

import math

from benchmarks.costmodel.cluster import ClusterSpec


def ring_allreduce_seconds(
    nbytes: float, p: int, bytes_per_s: float, latency_s: float, messages: int = 1
) -> float:
    """Ring all-reduce of `nbytes` over p ranks (reduce-scatter + all-gather, Patarasuk & Yuan 2009):

        t = 2·(p-1)/p · S / bw + m · 2·(p-1) · α

    bw: per-rank link bandwidth (one direction); α: per-step latency; m: messages (gradient buckets),
    each paying the latency once. Zero for p = 1.
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (p - 1) / p * nbytes / bytes_per_s + messages * 2 * (p - 1) * latency_s


def allreduce_seconds(nbytes: float, p: int, cluster: ClusterSpec, bucket_bytes: float) -> float:
    """All-reduce of `nbytes` per rank over a group of p consecutive ranks, in buckets of `bucket_bytes`.

    p <= g (one node, g = gpus_per_node): a ring on NVLink, `ring_allreduce_seconds(S, p, B_nvl, α_nvl)`.
    p = N·g (whole nodes): hierarchical — reduce-scatter in the node, all-reduce of each GPU's S/g shard
    across the N nodes (the g shards share the node's NICs, B_node in total), all-gather in the node:

        t = 2·(g-1)/g · S/B_nvl + 2·(N-1)/N · S/B_node + m·(2·(g-1)·α_nvl + 2·(N-1)·α_ib)

    otherwise (groups straddling nodes unevenly): a flat ring whose slowest link is a GPU's share of
    the NICs, 2(p-1)/p · S/(B_node/g) + m·2(p-1)·α_ib (pessimistic).
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    g, m = cluster.gpus_per_node, max(1, math.ceil(nbytes / bucket_bytes))
    a_nvl, a_ib = cluster.nvlink_latency_us * 1e-6, cluster.internode_latency_us * 1e-6
    if p <= g:
        return ring_allreduce_seconds(nbytes, p, cluster.nvlink_bytes_per_s, a_nvl, m)
    if p % g == 0:
        n_nodes = p // g
        intra = 2 * (g - 1) / g * nbytes / cluster.nvlink_bytes_per_s
        inter = 2 * (n_nodes - 1) / n_nodes * nbytes / cluster.node_bytes_per_s
        return intra + inter + m * (2 * (g - 1) * a_nvl + 2 * (n_nodes - 1) * a_ib)
    return ring_allreduce_seconds(nbytes, p, cluster.node_bytes_per_s / g, a_ib, m)


def allreduce_internode_bytes(nbytes: float, p: int, gpus_per_node: int) -> float:
    """Bytes one node pushes through its NICs for the all-reduce `allreduce_seconds` models:
    0 inside a node, 2·(N-1)/N·S for whole nodes (hierarchical), 2·(p-1)/p·S·g for the flat fallback."""
    g = gpus_per_node
    if p <= g or nbytes <= 0:
        return 0.0
    if p % g == 0:
        return 2 * (p // g - 1) / (p // g) * nbytes
    return 2 * (p - 1) / p * nbytes * g


def alltoall_internode_bytes(nbytes: float, p: int, gpus_per_node: int) -> float:
    """Bytes one node sends off-node in one all-to-all: g·(p-g)/p·S (0 when p <= g)."""
    g = gpus_per_node
    return 0.0 if p <= g else g * (p - g) / p * nbytes


def alltoall_seconds(nbytes: float, p: int, cluster: ClusterSpec) -> float:
    """All-to-all where each of p consecutive ranks holds `nbytes`, 1/p of it for every rank (itself
    included). Pairwise exchange (Thakur, Rabenseifner & Gropp 2005), NVLink and NICs working at once:

        p <= g:  t = (p-1)/p · S / B_nvl + (p-1)·α_nvl
        p > g:   t = max((g-1)/p · S / B_nvl,  g·(p-g)/p · S / B_node) + (g-1)·α_nvl + (p-g)·α_ib

    (g·(p-g)/p·S is what the node's g GPUs send off-node through its shared NICs.)
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    g = cluster.gpus_per_node
    a_nvl, a_ib = cluster.nvlink_latency_us * 1e-6, cluster.internode_latency_us * 1e-6
    if p <= g:
        return (p - 1) / p * nbytes / cluster.nvlink_bytes_per_s + (p - 1) * a_nvl
    intra = (g - 1) / p * nbytes / cluster.nvlink_bytes_per_s
    inter = g * (p - g) / p * nbytes / cluster.node_bytes_per_s
    return max(intra, inter) + (g - 1) * a_nvl + (p - g) * a_ib
