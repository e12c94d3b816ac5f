"""Experts from owners who share no data (FlexOlmo, Shi et al. 2025, on DEMix's modularity): every owner starts from
one public anchor checkpoint, trains its own expert on its own data with every shared parameter frozen, and ships
only that expert as a package; the packages are merged into one DEMix checkpoint, which routes without joint data
and from which any owner can opt out with proof. docs/modular.md, "Experts from owners who share no data".

fingerprint.py (what "the same anchor" means, bit for bit), package.py (the expert package: write, verify, read),
merge.py (anchor + packages -> a DEMix checkpoint), verify.py (the opt-out proof), train_owner.py (an owner's run),
router.py (router vectors: routing without joint data).
"""
