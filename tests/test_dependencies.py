"""pyproject.toml declares what the code imports beyond the standard library, at versions that work together."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {r.name: r for r in map(Requirement, project["dependencies"])}


def test_protobuf_is_declared_at_a_version_sentencepieces_generated_code_accepts():
    """launcher/modular/hf_tokenizer.py imports sentencepiece's `sentencepiece_model_pb2`, which needs protobuf, a
    runtime no older than the protoc that generated it; the declared range admits no such older runtime."""
    import sentencepiece

    pb2 = (Path(sentencepiece.__file__).parent / "sentencepiece_model_pb2.py").read_text()
    match = re.search(r"Protobuf Python Version: (\S+)", pb2)
    assert match, "sentencepiece_model_pb2 does not say which protobuf generated it"
    gencode = match.group(1)
    spec = _declared()["protobuf"].specifier
    assert spec.contains(version("protobuf")) and spec.contains(gencode)
    floors = [Version(s.version) for s in spec if s.operator in (">=", "==", "~=")]
    assert floors and max(floors) >= Version(gencode), spec
