"""launcher/evaluation/stats.py: bootstrap intervals over blocks, paired ratios and seed spread, against direct
computations and known cases."""

import math

import numpy as np
import pytest
import torch

from launcher.evaluation import stats


def test_block_sums_skip_unscored_tokens():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    nll, tokens = stats.block_sums(lp, mask)
    assert nll == pytest.approx([6.0, 1.0]) and tokens == [3, 2]


def test_bootstrap_interval_contains_the_point_and_shrinks_with_more_blocks():
    rng = np.random.default_rng(1)
    widths = []
    for B in (16, 256):
        tokens = [100] * B
        nll = list(100 * (3.0 + 0.3 * rng.standard_normal(B)))
        ppl, lo, hi = stats.bootstrap_ppl(nll, tokens)
        assert ppl == pytest.approx(math.exp(sum(nll) / sum(tokens)))
        assert lo < ppl < hi
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2.5  # ~ 1/sqrt(B): 4x fewer with 16x the blocks
    # identical blocks: no uncertainty; reproducible for a fixed seed
    assert stats.bootstrap_ppl([30.0] * 8, [10] * 8)[1:] == pytest.approx((math.exp(3), math.exp(3)))
    assert stats.bootstrap_ppl(nll, tokens) == stats.bootstrap_ppl(nll, tokens)


def test_paired_ratio_removes_shared_block_variation():
    """B is A plus a constant 0.05 nats per token on every block; the blocks themselves vary a lot. The paired
    interval is exactly exp(-0.05), while unpaired intervals of A and B overlap."""
    rng = np.random.default_rng(2)
    tokens = [50] * 64
    a = list(50 * (2.0 + rng.standard_normal(64)).clip(0.5))
    b = [x + 0.05 * 50 for x in a]
    ratio, lo, hi = stats.paired_ratio(a, b, tokens)
    assert (
        ratio == pytest.approx(math.exp(-0.05)) and lo == pytest.approx(ratio) and hi == pytest.approx(ratio)
    )
    _, a_lo, a_hi = stats.bootstrap_ppl(a, tokens)
    _, b_lo, _ = stats.bootstrap_ppl(b, tokens)
    assert b_lo < a_hi  # unpaired: not separable


def test_mean_of_domains_and_seed_spread():
    d1, d2 = ([20.0] * 4, [10] * 4), ([30.0] * 4, [10] * 4)
    mean, lo, hi = stats.bootstrap_mean_ppl([d1, d2])
    assert mean == pytest.approx((math.exp(2) + math.exp(3)) / 2) and lo == pytest.approx(mean) == hi
    s = stats.seed_spread([10.0, 12.0, 14.0])
    assert s == {"mean": 12.0, "sd": 2.0, "min": 10.0, "max": 14.0, "n": 3}
    assert stats.seed_spread([5.0])["sd"] == 0.0
    with pytest.raises(ValueError, match="one NLL sum and one token count per block"):
        stats.bootstrap_ppl([1.0, 2.0], [1])
    with pytest.raises(ValueError, match="at least one scored token"):
        stats.bootstrap_ppl([1.0], [0])


def test_unigram_fit_by_hand_and_k_chosen_on_dev():
    from launcher.evaluation.unigram import ADD_K_GRID, fit_unigram, unigram_log_probs

    train = np.array([0, 0, 0, 1, 2, 2])
    log_p, k = fit_unigram(train, 4, dev_targets=np.array([0, 2, 2, 0]))
    assert k in ADD_K_GRID and np.exp(log_p).sum() == pytest.approx(1.0)
    expect = np.log((np.bincount(train, minlength=4) + k) / (6 + 4 * k))
    assert log_p == pytest.approx(expect)
    assert k == min(ADD_K_GRID)  # the dev set has no unseen token: as little smoothing as the grid allows
    _, k_unseen = fit_unigram(train, 4, dev_targets=np.array([3, 3, 3, 0]))
    assert k_unseen > k  # a dev set full of an unseen token asks for more
    lp = unigram_log_probs(log_p, torch.tensor([[0, 3]]))
    assert lp[0, 1] == pytest.approx(np.log(k / (6 + 4 * k)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fit_unigram(np.array([5]), 4)


# ---------------------------------------------------------------- the unigram from token counts ---------------


def _fit_from_arrays(train, vocab_size, dev=None):
    """The array-based fit as it was before counts (reference): bincount, k by the mean NLL of the dev tokens."""
    t = np.asarray(train, dtype=np.int64).ravel()
    counts = np.bincount(t, minlength=vocab_size).astype(np.float64)

    def nll(k):
        logp = np.log(counts[dev] + k) - math.log(counts.sum() + k * len(counts))
        return float(-logp.mean())

    from launcher.evaluation.unigram import ADD_K_GRID

    k = min(ADD_K_GRID, key=nll) if dev is not None and len(dev) else 0.1
    return np.log(counts + k) - math.log(counts.sum() + k * vocab_size), k


def test_unigram_from_counts_equals_the_array_fit():
    from launcher.evaluation.unigram import fit_unigram, fit_unigram_counts

    V = 300
    rng = np.random.default_rng(7)
    ks = set()
    for _trial in range(12):
        # a Zipf-like training split over part of the vocabulary; dev with more or fewer unseen ids
        train = np.minimum(rng.zipf(1.3, size=int(rng.integers(50, 5000))), 200) - 1
        unseen = rng.integers(200, V, size=int(rng.integers(0, 400)))
        dev = np.concatenate([np.minimum(rng.zipf(1.3, size=2000), 200) - 1, unseen])
        for d in (dev, None):
            ref_lp, ref_k = _fit_from_arrays(train, V, d)
            lp, k = fit_unigram(train, V, d)
            assert k == ref_k and np.abs(lp - ref_lp).max() < 1e-12
            dc = None if d is None else np.bincount(d, minlength=V)
            lp_c, k_c = fit_unigram_counts(np.bincount(train), V, dc)  # shorter than V: zero-padded
            assert k_c == ref_k and np.abs(lp_c - ref_lp).max() < 1e-12
            ks.add(k)
    assert len(ks) > 2  # the dev splits asked for different smoothing
    # counts longer than the vocabulary: zeros past it are fine, a nonzero count is an id outside it
    c = np.bincount(train, minlength=V + 5)
    assert np.array_equal(fit_unigram_counts(c, V)[0], fit_unigram(train, V)[0])
    c[V + 2] = 1
    with pytest.raises(ValueError, match="outside the vocabulary of 300"):
        fit_unigram_counts(c, V)
    with pytest.raises(ValueError, match="outside the vocabulary of 300"):
        fit_unigram_counts(np.bincount(train), V, c)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fit_unigram(train, V, dev_targets=np.array([V]))


def _write_bin(prefix, docs, dtype):
    """A megatron-core indexed dataset (.bin/.idx) of `docs`, one sequence and document each, as data.prepare."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for d in docs:
        builder.add_item(torch.from_numpy(np.asarray(d, dtype=dtype)))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return prefix.with_suffix(".bin")


def test_streaming_bincount_over_an_indexed_dataset_equals_the_whole_file(tmp_path):
    from launcher.evaluation.unigram import bin_token_counts

    rng = np.random.default_rng(3)
    for dtype, V in ((np.uint16, 1000), (np.int32, 70000)):
        docs = [np.concatenate([[0], rng.integers(1, V, size=int(rng.integers(1, 400)))]) for _ in range(60)]
        path = _write_bin(tmp_path / np.dtype(dtype).name / "train", docs, dtype)
        whole = np.fromfile(path, dtype=dtype)
        assert np.array_equal(whole, np.concatenate(docs))  # the .bin is the tokens back to back
        expect = np.bincount(whole.astype(np.int64), minlength=V)
        for block in (1, 97, 1000, len(whole), 10 * len(whole)):  # many blocks, a ragged tail, one block
            assert np.array_equal(bin_token_counts(path, dtype, V, block_tokens=block), expect)
        with pytest.raises(ValueError, match="outside the vocabulary of 50"):
            bin_token_counts(path, dtype, 50, block_tokens=97)


def _token_dir(root, splits, dtype=np.uint16, V=500, token_counts=None):
    """A minimal prepared token dir: <root>/tok/news/<split>.bin/.idx for `splits` (split -> docs) and a token
    manifest; with `token_counts` (an array), also news/token_counts.npy named in manifest["token_counts"], as
    data.prepare writes it."""
    import json

    tok = root / "tok"
    counts = {}
    for s, docs in splits.items():
        _write_bin(tok / "news" / s, docs, dtype)
        counts[s] = {
            "documents": len(docs),
            "tokens": int(sum(len(d) for d in docs)),
            "bin": f"news/{s}.bin",
            "idx": f"news/{s}.idx",
        }
    if token_counts is not None:
        np.save(tok / "news" / "token_counts.npy", token_counts)
    manifest = {
        "domains": ["news"],
        "counts": {"news": counts},
        "dtype": np.dtype(dtype).name,
        "tokenizer": {"name": "test", "vocab_size": V, "bos_id": 0},
    }
    if token_counts is not None:
        manifest["token_counts"] = {"news": "news/token_counts.npy"}
    (tok / "manifest.json").write_text(json.dumps(manifest))
    return tok


def _random_splits(rng, V=500, sizes=(40, 8, 8)):
    from data.blocks import SPLITS

    return {
        s: [
            np.concatenate([[0], np.minimum(rng.zipf(1.4, size=int(rng.integers(5, 300))), V - 50)])
            for _ in range(n)
        ]
        for s, n in zip(SPLITS, sizes)
    }


def test_token_counts_file_is_used_instead_of_the_bin_and_checked(tmp_path):
    import pickle

    from data.blocks import SPLITS
    from launcher.evaluation.unigram import _fitted

    V = 500
    splits = _random_splits(np.random.default_rng(11), V)
    all_tokens = {s: np.concatenate(d) for s, d in splits.items()}
    ref_lp, ref_k = _fit_from_arrays(all_tokens["train"], V, all_tokens["valid"])
    streamed = _token_dir(tmp_path / "streamed", splits, V=V)  # no token_counts: counted from the .bin
    lp, k, n = _fitted(str(streamed.parent), "tok", "news", 32, V, "valid")
    assert k == ref_k and np.abs(lp - ref_lp).max() < 1e-12 and n == len(all_tokens["train"])

    # the recorded counts (shorter than the vocabulary: zero-padded); the .bin files become garbage that reading
    # would reject (ids 65535 >= V) or count differently, and unreadable
    V_file = int(max(t.max() for t in all_tokens.values())) + 1
    recorded = np.stack([np.bincount(all_tokens[s], minlength=V_file) for s in SPLITS]).astype(np.int64)
    assert recorded.shape[1] < V
    tok = _token_dir(tmp_path / "counted", splits, V=V, token_counts=recorded)
    for s in SPLITS:
        b = tok / "news" / f"{s}.bin"
        size = b.stat().st_size
        b.write_bytes(b"\xff" * size)
        b.chmod(0)
    for dev_split in ("valid", "test"):
        lp, k, n = _fitted(str(tok.parent), "tok", "news", 32, V, dev_split)
        ref_lp, ref_k = _fit_from_arrays(all_tokens["train"], V, all_tokens[dev_split])
        assert k == ref_k and np.abs(lp - ref_lp).max() < 1e-12 and n == len(all_tokens["train"])
    # a domain_unigram from the counts alone
    from launcher.evaluation.unigram import domain_unigram

    test = torch.from_numpy(all_tokens["test"][1:65].astype(np.int64)).reshape(2, 32)
    r = domain_unigram(tok.parent, "tok", "news", 32, V, test, torch.ones(2, 32), "valid")
    assert (
        r["train_tokens"] == len(all_tokens["train"])
        and r["k"] == _fit_from_arrays(all_tokens["train"], V, all_tokens["valid"])[1]
    )

    # damaged counts files: a clear ValueError naming the file
    path = tok / "news" / "token_counts.npy"
    damaged = [
        (lambda: np.save(path, recorded[:2]), "shape"),  # two splits only
        (lambda: np.save(path, recorded[0]), "shape"),  # one row
        (lambda: np.save(path, recorded.astype(np.float64)), "dtype"),
        (lambda: np.save(path, np.array([{"train": 1}], dtype=object), allow_pickle=True), "readable"),
        (lambda: path.write_bytes(pickle.dumps(recorded.tolist())), "readable"),
        (lambda: path.write_bytes(b"garbage" * 10), "readable"),
        (lambda: path.write_bytes(b""), "readable"),
        (lambda: np.save(path, recorded * 2), "manifest records"),  # not the counts of these files
        (lambda: np.save(path, -recorded), "negative"),
        (lambda: path.unlink(), "readable"),
    ]
    for i, (damage, what) in enumerate(damaged):
        damage()
        with pytest.raises(ValueError, match=f"token_counts.npy.*{what}|{what}.*token_counts.npy") as e:
            # another seq_len: not the cached fit
            _fitted(str(tok.parent), "tok", "news", 100 + i, V, "valid")
        assert str(path) in str(e.value)


def test_counting_from_the_bin_does_not_hold_the_split_in_memory(tmp_path):
    import tracemalloc

    from launcher.evaluation.unigram import _fitted

    V, n_train = 50257, 6_000_000
    rng = np.random.default_rng(5)
    train = [np.concatenate([[0], rng.integers(1, V, size=n_train // 4 - 1)]) for _ in range(4)]
    dev = [np.concatenate([[0], rng.integers(1, V, size=20_000)])]
    tok = _token_dir(tmp_path, {"train": train, "valid": dev}, V=V)  # no token_counts
    tracemalloc.start()
    try:
        log_p, k, n = _fitted(str(tok.parent), "tok", "news", 1024, V, "valid")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == n_train and np.isfinite(log_p).all()
    # the old way held the split as int64 (48 MB here, plus its uint16 read); counting in blocks stays well below
    assert peak < n_train * 8 / 3, f"peak {peak / 1e6:.1f} MB"
