"""Domains from clustering: label every document of an unlabelled corpus with a cluster, as c-BTM does
(tf-idf -> TruncatedSVD -> L2 normalise -> balanced k-means), so DEMix can train one expert per cluster.

    python -m data.cluster_domains --corpus DIR --k 8 --out DIR [--domains a,b] [--balance balanced|none]
        [--svd-dim 100] [--max-features 50000] [--fit-docs 20000] [--seed 0]

Input: `<corpus>/<domain>.jsonl` ({"id", "domain", "text"}, the ingest format); with a corpus manifest only its
`split_role: train` domains are read (novel domains stay held out). The domain labels are never used to fit;
when present they are only compared with the clusters afterwards (purity, NMI, in `cluster_report.json`).

Output (the per-domain JSONL format `data.prepare` reads):

    <out>/cluster00.jsonl ...       {"id", "domain": "cluster00", "text"} per document
    <out>/manifest.json             {"format", "corpus_dir", "domains": {name: {"split_role": "train", ...}},
                                     "train_domains", "novel_domains": [], "clustering": {...}}
    <out>/clusterer/                the fitted clusterer as plain data (safe to load: no pickle):
                                    arrays.npz (idf_V, components_SV, centres_KS) + meta.json (vocabulary, options)
    <out>/cluster_report.json       sizes, and purity / NMI against the hidden labels

Maths. A document's representation is z = normalise(tfidf(x) W^T) (W: the S x V SVD components). Balanced
k-means alternates (i) assignment under the capacity ceil(n/K) per cluster (greedy over (document, cluster) pairs
in order of distance, a standard approximation of the balanced assignment) and (ii) c_j = mean of its members. New
text gets its nearest centre j = argmin_j ||z - c_j|| (no capacity: that is what c-BTM does at inference), and the
mixing prior over clusters is

    p(j | x) = softmax_j( -||z - c_j||² / τ )        (c-BTM §2.3, τ the temperature)

The corpus written under <out> is labelled with the nearest centre as well, so training data and inference-time
routing agree; the balance constraint shapes the centres, not the final labels.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.argtypes import positive_int, random_seed
from data.atomic import staged_dir, write_json_atomic
from data.cli import check_output_dir, cli_main, exit_process, usage_error
from data.readers import read_json_object, utf8_lines

FORMAT = "demix-clusterer/1"


# ----------------------------------------------------------------------------------------------------
# The clusterer
# ----------------------------------------------------------------------------------------------------


def balanced_assign(dist_NK: np.ndarray, capacity: int) -> np.ndarray:
    """Assign each row to a column, at most `capacity` rows per column, greedily by increasing distance."""
    n, k = dist_NK.shape
    if capacity * k < n:
        raise ValueError(f"capacity {capacity} x {k} clusters < {n} documents")
    order = np.argsort(dist_NK, axis=None, kind="stable")
    labels = np.full(n, -1)
    load = np.zeros(k, dtype=np.int64)
    for flat in order:
        i, j = divmod(int(flat), k)
        if labels[i] < 0 and load[j] < capacity:
            labels[i], load[j] = j, load[j] + 1
    return labels


def _sq_dist(z_NS: np.ndarray, c_KS: np.ndarray) -> np.ndarray:
    return np.maximum((z_NS**2).sum(1)[:, None] - 2 * z_NS @ c_KS.T + (c_KS**2).sum(1)[None], 0.0)


def kmeans(z_NS: np.ndarray, k: int, seed: int = 0, balance: str = "balanced", iters: int = 30) -> np.ndarray:
    """K-means (k-means++ seeded by sklearn) with optional balanced assignment; returns the centres K x S."""
    from sklearn.cluster import KMeans

    centres = KMeans(n_clusters=k, n_init=3, random_state=seed).fit(z_NS).cluster_centers_
    if balance == "none":
        return centres
    capacity = int(np.ceil(len(z_NS) / k))
    labels = None
    for _ in range(iters):
        new = balanced_assign(_sq_dist(z_NS, centres), capacity)
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        centres = np.stack(
            [z_NS[labels == j].mean(0) if (labels == j).any() else centres[j] for j in range(k)]
        )
    return centres


@dataclass
class Clusterer:
    """tf-idf vocabulary and idf, SVD components, cluster centres: everything needed to place new text."""

    vocabulary: dict[str, int]
    idf_V: np.ndarray
    components_SV: np.ndarray
    centres_KS: np.ndarray
    options: dict

    @property
    def k(self) -> int:
        return int(self.centres_KS.shape[0])

    def names(self) -> list[str]:
        return [f"cluster{j:02d}" for j in range(self.k)]

    def _vectorizer(self):
        from sklearn.feature_extraction.text import TfidfVectorizer

        vec = TfidfVectorizer(vocabulary=self.vocabulary, **_tfidf_kwargs(self.options))
        vec.idf_ = self.idf_V
        return vec

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """z = normalise(tfidf(x) W^T), N x S."""
        z = np.asarray(self._vectorizer().transform(texts) @ self.components_SV.T)
        return z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)

    def distances(self, texts: Sequence[str]) -> np.ndarray:
        return _sq_dist(self.embed(texts), self.centres_KS)

    def assign(self, texts: Sequence[str]) -> np.ndarray:
        """Nearest centre per text."""
        return self.distances(texts).argmin(1)

    def prior(self, texts: Sequence[str], temperature: float = 0.1) -> np.ndarray:
        """p(j | x) = softmax_j(-||z - c_j||² / τ), N x K (rows sum to 1)."""
        logits = -self.distances(texts) / temperature
        logits -= logits.max(1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(1, keepdims=True)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        np.savez(
            path / "arrays.npz",
            idf_V=self.idf_V,
            components_SV=self.components_SV,
            centres_KS=self.centres_KS,
        )
        (path / "meta.json").write_text(
            json.dumps(
                {"format": FORMAT, "options": self.options, "vocabulary": self.vocabulary}, ensure_ascii=False
            )
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> Clusterer:
        path = Path(path)
        meta = read_json_object(
            path / "meta.json", {"format": str, "vocabulary": dict, "options": dict}, what="clusterer"
        )
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} clusterer (format {meta.get('format')!r})")
        with np.load(path / "arrays.npz", allow_pickle=False) as a:
            return cls(
                {k: int(v) for k, v in meta["vocabulary"].items()},
                a["idf_V"],
                a["components_SV"],
                a["centres_KS"],
                meta["options"],
            )


def _tfidf_kwargs(options: dict) -> dict:
    return {
        "sublinear_tf": True,
        "stop_words": "english",
        "lowercase": True,
        "dtype": np.float64,
        "token_pattern": r"(?u)\b\w\w+\b",
    } | ({"max_df": options["max_df"]} if "max_df" in options else {})


def fit_clusterer(
    texts: Sequence[str],
    k: int,
    seed: int = 0,
    balance: str = "balanced",
    svd_dim: int = 100,
    max_features: int = 50000,
    fit_docs: int = 20000,
) -> Clusterer:
    """Fit tf-idf, SVD and (balanced) k-means on at most `fit_docs` texts (a seeded sample)."""
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer

    if balance not in ("balanced", "none"):
        raise ValueError(f"balance={balance!r}: choose balanced or none")
    if not 1 <= k <= len(texts):
        raise ValueError(f"k={k} clusters for {len(texts)} documents")
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(texts))[:fit_docs] if len(texts) > fit_docs else np.arange(len(texts))
    sample = [texts[i] for i in idx]
    options = {
        "k": k,
        "seed": seed,
        "balance": balance,
        "svd_dim": svd_dim,
        "max_features": max_features,
        "fit_docs": len(sample),
        "min_df": 2,
        "max_df": 0.5,
    }
    vec = TfidfVectorizer(max_features=max_features, min_df=min(2, len(sample)), **_tfidf_kwargs(options))
    x = vec.fit_transform(sample)
    dim = max(1, min(svd_dim, x.shape[1] - 1, len(sample) - 1))
    svd = TruncatedSVD(n_components=dim, random_state=seed).fit(x)
    vocab = {t: int(i) for t, i in vec.vocabulary_.items()}
    c = Clusterer(vocab, vec.idf_, svd.components_, np.zeros((k, dim)), options)
    c.centres_KS = kmeans(c.embed(sample), k, seed, balance)
    return c


# ----------------------------------------------------------------------------------------------------
# Agreement with hidden labels
# ----------------------------------------------------------------------------------------------------


def agreement(true_labels: Sequence, clusters: Sequence[int]) -> dict[str, float]:
    """purity = (1/N) Σ_j max_d |cluster j ∩ domain d|, NMI (arithmetic), adjusted Rand index."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score
    from sklearn.metrics.cluster import contingency_matrix

    cm = contingency_matrix(np.asarray(true_labels), np.asarray(clusters))
    return {
        "purity": float(cm.max(0).sum() / cm.sum()),
        "nmi": float(normalized_mutual_info_score(true_labels, clusters)),
        "ari": float(adjusted_rand_score(true_labels, clusters)),
    }


def composition(
    true_labels: Sequence[str], clusters: Sequence[int], names: Sequence[str]
) -> dict[str, dict[str, int]]:
    """Cluster name -> {true domain: documents}."""
    out: dict[str, dict[str, int]] = {n: {} for n in names}
    for d, j in zip(true_labels, clusters):
        out[names[int(j)]][d] = out[names[int(j)]].get(d, 0) + 1
    return out


# ----------------------------------------------------------------------------------------------------
# Corpus in, corpus out
# ----------------------------------------------------------------------------------------------------


def record_problem(record: object) -> str | None:
    """Why `record` (one line of a corpus file, parsed) cannot be clustered and written out, or None: it must be an
    object with an `id` (a string or an integer) and a `text` (a string), as data.ingest writes them."""
    if not isinstance(record, dict):
        return f"is {type(record).__name__}, not an object with 'id' and 'text'"
    if "id" not in record:
        return "has no 'id'"
    if isinstance(record["id"], bool) or not isinstance(record["id"], (str, int)):
        return f"has an 'id' of type {type(record['id']).__name__}, expected a string or an integer"
    if not isinstance(record.get("text"), str):
        return (
            "has no 'text' string"
            if "text" not in record
            else f"has a 'text' of type {type(record['text']).__name__}, expected a string"
        )
    return None


def read_corpus(corpus: str | Path, domains: Sequence[str] | None = None) -> list[dict]:
    """Every record of the corpus's training domains (manifest `split_role: train`; all when no manifest). Each is
    checked (`record_problem`) as it is read, so a bad record is refused before the clustering is fitted."""
    corpus = Path(corpus)
    files = {p.stem: p for p in sorted(corpus.glob("*.jsonl"))}
    if domains is None and (corpus / "manifest.json").is_file():
        roles = read_json_object(corpus / "manifest.json", {"domains?": dict}, what="corpus manifest").get(
            "domains"
        )
        roles = {d: r for d, r in (roles or {}).items() if isinstance(r, dict)}
        domains = [d for d in files if roles.get(d, {}).get("split_role", "train") == "train"]
    missing = [d for d in (domains or []) if d not in files]
    if missing or not files:
        raise FileNotFoundError(f"{corpus}: no JSONL for {missing or 'any domain'}")
    out = []
    for d in domains or list(files):
        for i, line in utf8_lines(files[d]):  # a non-UTF-8 line is named with its byte offset
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(
                    f"{files[d]}:{i}: not a JSON record ({e}); run data.ingest on the corpus"
                ) from None
            if (why := record_problem(record)) is not None:
                raise ValueError(f"{files[d]}:{i}: the record {why}; run data.ingest on the corpus")
            out.append(record)
    return out


def write_clustered_corpus(
    records: Sequence[dict],
    labels: np.ndarray,
    clusterer: Clusterer,
    out: str | Path,
    source: str | None = None,
    report: dict | None = None,
) -> dict:
    """`<out>/<cluster>.jsonl` + manifest.json (split_role train), the clusterer under `<out>/clusterer` and, given,
    `report` as `<out>/cluster_report.json`. All of it is staged and published together (data/atomic.py
    `staged_dir`): a failure (a bad record, a full disk) leaves no cluster file without its manifest."""
    out = Path(out)
    bad = next(((i, why) for i, r in enumerate(records) if (why := record_problem(r)) is not None), None)
    if bad is not None:
        raise ValueError(f"record {bad[0]} {bad[1]}: nothing was written to {out}")
    names = clusterer.names()
    with staged_dir(out, manifest="manifest.json") as tmp:
        handles = {n: open(tmp / f"{n}.jsonl", "w", encoding="utf-8") for n in names}
        try:
            for r, j in zip(records, labels):
                handles[names[int(j)]].write(
                    json.dumps(
                        {"id": r["id"], "domain": names[int(j)], "text": r["text"]}, ensure_ascii=False
                    )
                    + "\n"
                )
        finally:
            for h in handles.values():
                h.close()
        counts = np.bincount(labels, minlength=clusterer.k)
        manifest = {
            "format": 1,
            "corpus_dir": str(out),
            "source_corpus": source,
            "domains": {
                n: {
                    "split_role": "train",
                    "file": f"{n}.jsonl",
                    "documents": int(counts[j]),
                    "what": f"k-means cluster {j} of {source or 'the corpus'} (labels hidden)",
                }
                for j, n in enumerate(names)
            },
            "train_domains": names,
            "novel_domains": [],
            "clustering": clusterer.options,
        }
        clusterer.save(tmp / "clusterer")
        if report is not None:
            (tmp / "cluster_report.json").write_text(json.dumps(report, indent=2) + "\n")
        write_json_atomic(tmp / "manifest.json", manifest)
    return manifest


def cluster_corpus(
    corpus: str | Path,
    k: int,
    out: str | Path,
    domains: Sequence[str] | None = None,
    **fit_kwargs,
) -> dict:
    """The CLI's work: read, fit with labels hidden, label by nearest centre, write, report agreement."""
    out_dir = Path(out)
    existing = [p.name for p in out_dir.glob("*.jsonl")] if out_dir.is_dir() else []
    check_output_dir(
        out_dir, (1,), ["manifest.json", "clusterer", "cluster_report.json", *existing], inputs=[Path(corpus)]
    )
    records = read_corpus(corpus, domains)
    texts = [r["text"] for r in records]
    clusterer = fit_clusterer(texts, k, **fit_kwargs)
    labels = clusterer.assign(texts)
    report = {"documents": len(records), "k": k, "sizes": np.bincount(labels, minlength=k).tolist()}
    truth = [r.get("domain") for r in records]
    if all(truth):
        report.update(agreement(truth, labels))
        report["composition"] = composition(truth, labels, clusterer.names())
    write_clustered_corpus(records, labels, clusterer, out, str(corpus), report)
    return report


# ----------------------------------------------------------------------------------------------------
# Relabel an already-prepared token directory (same tokenizer: perplexities stay comparable)
# ----------------------------------------------------------------------------------------------------


def relabel_prepared(
    tokens_root: str | Path,
    tokenizer: str,
    out_root: str | Path,
    k: int,
    domains: Sequence[str] | None = None,
    splits: Iterable[str] = ("train", "valid", "test"),
    **fit_kwargs,
) -> dict:
    """Cluster the documents of a prepared dataset's training domains (labels hidden) and write a prepared dataset
    whose domains are the clusters, re-using the token ids and the tokenizer untouched.

    `data.prepare` on the clustered JSONL would train a new sentencepiece model, and perplexities under different
    tokenizers are not comparable; here every document keeps its tokens and its split. The clusterer is fitted on
    the decoded training documents and every split is labelled by nearest centre. Returns the agreement report."""
    import shutil

    from data.catalog import load_catalog
    from data.tokenizer import load_prepared_tokenizer

    cat = load_catalog(tokens_root, tokenizer, domains)
    src = Path(tokens_root) / tokenizer
    m = read_json_object(src / "manifest.json", {"format": str, "dtype": str}, what="token manifest")
    dst = Path(out_root) / tokenizer
    check_output_dir(dst, (m["format"],), ["manifest.json", "clusterer", "cluster_report.json"], inputs=[src])
    tok = load_prepared_tokenizer(tokens_root, tokenizer)
    dtype = np.dtype(m["dtype"]).type
    docs = _prepared_documents(tokens_root, tokenizer, cat.train_domains, m["counts"], splits)
    text = {s: [tok.decode(a[1:].tolist()) for _, a in docs[s]] for s in splits}  # [bos] + ids
    clusterer = fit_clusterer(text["train"], k, **fit_kwargs)
    names = clusterer.names()
    check_output_dir(dst, (m["format"],), names)
    # staged and published together (data/atomic.py `staged_dir`): a failure leaves no domain without a manifest
    with staged_dir(dst, manifest="manifest.json") as work:
        if "model_file" in m["tokenizer"]:
            shutil.copy(src / m["tokenizer"]["model_file"], work / m["tokenizer"]["model_file"])
        counts: dict[str, dict] = {n: {} for n in names}
        report: dict = {"k": k, "source": str(src), "splits": {}}
        for s in splits:
            labels = clusterer.assign(text[s]) if docs[s] else np.zeros(0, dtype=int)
            truth = [d for d, _ in docs[s]]
            report["splits"][s] = {
                "documents": len(truth),
                "sizes": np.bincount(labels, minlength=k).tolist(),
                **(agreement(truth, labels) if len(truth) else {}),
                "composition": composition(truth, labels, names),
            }
            for n, info in _write_clusters(work, s, docs[s], labels, names, dtype).items():
                counts[n][s] = info
        manifest = {
            "format": m["format"],
            "inputs_sha256": None,
            "tokenizer": m["tokenizer"],
            "dtype": m["dtype"],
            "bos_in_bin": m.get("bos_in_bin", True),
            "domains": names,
            "roles": {n: "train" for n in names},
            "corpus": {"dir": None},
            "split": m.get("split"),
            "counts": counts,
            "clustered_from": {
                "tokens": str(src),
                "domains": list(cat.train_domains),
                "options": clusterer.options,
            },
        }
        write_json_atomic(work / "manifest.json", manifest)
        clusterer.save(work / "clusterer")
        (work / "cluster_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _prepared_documents(
    tokens_root: str | Path, tokenizer: str, domains: Sequence[str], counts: dict, splits: Iterable[str]
) -> dict[str, list[tuple[str, np.ndarray]]]:
    """Per split, every document of `domains` in a prepared dataset with its domain: ([bos] + token ids)."""
    from data.blocks import open_indexed, split_prefix

    docs: dict[str, list[tuple[str, np.ndarray]]] = {s: [] for s in splits}
    for d in domains:
        for s in splits:
            if counts[d][s]["documents"]:
                ds = open_indexed(split_prefix(tokens_root, tokenizer, d, s))
                # copies: the mmap closes
                docs[s] += [(d, np.array(ds.get(i), copy=True)) for i in range(len(ds))]
    return docs


def _write_clusters(
    work: Path,
    split: str,
    docs: list[tuple[str, np.ndarray]],
    labels: np.ndarray,
    names: list[str],
    dtype: type,
) -> dict[str, dict]:
    """Write the documents of `split` labelled `j` into `<work>/<names[j]>/<split>.bin/.idx`; each cluster's manifest
    counts (no files for a cluster without documents)."""
    from data.indexed import write_indexed as _write_indexed

    out = {}
    for j, n in enumerate(names):
        chosen = [a for (_, a), lab in zip(docs, labels) if lab == j]
        info = {"documents": 0, "tokens": 0, "bin": None, "idx": None}
        if chosen:
            nd, nt = _write_indexed(work / n / split, chosen, dtype)
            info = {
                "documents": nd,
                "tokens": nt,
                "bin": f"{n}/{split}.bin",
                "idx": f"{n}/{split}.idx",
                "bin_bytes": (work / n / f"{split}.bin").stat().st_size,
                "idx_bytes": (work / n / f"{split}.idx").stat().st_size,
            }
        out[n] = info
    return out


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="directory of <domain>.jsonl (+ manifest.json)")
    p.add_argument("--k", type=positive_int, required=True, help="number of clusters")
    p.add_argument("--out", required=True, help="output corpus directory")
    p.add_argument(
        "--domains", help="comma-separated domains to read (default: the manifest's training domains)"
    )
    p.add_argument("--balance", default="balanced", choices=("balanced", "none"))
    p.add_argument("--svd-dim", type=positive_int, default=100)
    p.add_argument("--max-features", type=positive_int, default=50000)
    p.add_argument("--fit-docs", type=positive_int, default=20000)
    p.add_argument("--seed", type=random_seed, default=0)
    a = p.parse_args(argv)
    try:
        report = cluster_corpus(
            a.corpus,
            a.k,
            a.out,
            a.domains.split(",") if a.domains else None,
            seed=a.seed,
            balance=a.balance,
            svd_dim=a.svd_dim,
            max_features=a.max_features,
            fit_docs=a.fit_docs,
        )
    except (FileNotFoundError, ValueError) as e:
        return usage_error(e)
    print(json.dumps({k: v for k, v in report.items() if k != "composition"}))
    return 0


if __name__ == "__main__":
    exit_process(main())
