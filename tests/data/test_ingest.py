"""Ingestion: bad lines reported with file:line, skip vs fail, nothing valid lost."""

import json

import pytest

from data.ingest import CorpusError, Problem, ingest, read_jsonl

GOOD = [
    {"doc": "a1", "txt": "The council met on Tuesday to discuss the budget.", "dom": "news"},
    {"doc": "a2", "txt": "def add(a, b):\n    return a + b\n", "dom": "code"},
    {"txt": "Patients were randomised to two arms.", "dom": "biomed"},  # no id: becomes file:line
    {"doc": "a4", "txt": "Héllo wörld — UTF-8 is fine 😀", "dom": "news"},
]


def _write_messy(path):
    lines = [json.dumps(GOOD[0]).encode()]
    lines.append(b'{"doc": "b1", "txt": "unterminated')  # line 2: invalid json
    lines.append(json.dumps(GOOD[1]).encode())
    lines.append(b'{"doc": "b2", "dom": "news"}')  # line 4: missing text
    lines.append(b'{"doc": "b3", "txt": "   ", "dom": "news"}')  # line 5: empty text
    lines.append(b'{"doc": "b4", "txt": "caf\xe9 au lait", "dom": "news"}')  # line 6: latin-1 byte
    lines.append(b"")  # line 7: blank, ignored
    lines.append(json.dumps(GOOD[2]).encode())
    lines.append(b'{"doc": "b5", "txt": "Some legal text.", "dom": "legal"}')  # line 9: unknown domain
    lines.append(b'["a", "list"]')  # line 10: not an object
    lines.append(b'{"doc": "b6", "txt": "lone \\ud83d surrogate", "dom": "news"}')  # line 11: bad escape
    lines.append(json.dumps(GOOD[3], ensure_ascii=False).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")


FIELDS = dict(text_field="txt", domain_field="dom", id_field="doc", domains=["news", "code", "biomed"])
EXPECTED = {
    2: "invalid_json",
    4: "missing_text",
    5: "empty_text",
    6: "non_utf8",
    9: "unknown_domain",
    10: "not_an_object",
    11: "non_utf8",
}


def test_every_bad_line_is_reported_with_its_line_number(tmp_path):
    src = tmp_path / "in.jsonl"
    _write_messy(src)
    problems = [r for r in read_jsonl(src, **FIELDS) if isinstance(r, Problem)]
    assert {p.line: p.reason for p in problems} == EXPECTED
    assert all(str(p).startswith(f"{src}:{p.line}: ") for p in problems)


def test_skip_keeps_every_valid_document_and_records_counts(tmp_path):
    src = tmp_path / "in.jsonl"
    _write_messy(src)
    report = ingest(src, tmp_path / "out", on_error="skip", **FIELDS)
    out = {}
    for f in (tmp_path / "out").glob("*.jsonl"):
        for line in f.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            assert set(rec) == {"id", "domain", "text"} and f.stem == rec["domain"]
            out[rec["text"]] = rec
    assert sorted(out) == sorted(g["txt"] for g in GOOD)  # valid in == valid out, text exact
    assert out[GOOD[2]["txt"]]["id"] == "in.jsonl:8"
    assert report.documents == {"biomed": 1, "code": 1, "news": 2}
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["problems"]["total"] == len(EXPECTED)
    assert manifest["problems"]["counts"] == {
        "empty_text": 1,
        "invalid_json": 1,
        "missing_text": 1,
        "non_utf8": 2,
        "not_an_object": 1,
        "unknown_domain": 1,
    }
    assert any(":6: non_utf8" in p for p in manifest["problems"]["first"])


def test_fail_raises_one_error_listing_file_and_line_and_writes_nothing(tmp_path):
    src = tmp_path / "in.jsonl"
    _write_messy(src)
    with pytest.raises(CorpusError) as e:
        ingest(src, tmp_path / "out", on_error="fail", max_report=3, **FIELDS)
    msg = str(e.value)
    assert (
        f"{src}:2: invalid_json" in msg and f"{src}:4: missing_text" in msg and f"{src}:5: empty_text" in msg
    )
    assert "7 bad line(s)" in msg and "and 4 more" in msg
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.jsonl"))


def test_directory_of_domain_folders_of_txt_files(tmp_path):
    root = tmp_path / "corpus"
    (root / "legal" / "sub").mkdir(parents=True)
    (root / "code").mkdir()
    (root / "legal" / "mit.txt").write_text("Permission is hereby granted, free of charge...\n")
    (root / "legal" / "sub" / "bsd.txt").write_text("Redistribution and use in source and binary forms...\n")
    (root / "code" / "x.txt").write_bytes(b"ok line\nbad \xff byte\n")
    (root / "code" / "empty.txt").write_text("\n\n")
    with pytest.raises(CorpusError, match=r"x\.txt:2: non_utf8"):
        ingest(root, tmp_path / "out", on_error="fail")
    report = ingest(root, tmp_path / "out", on_error="skip")
    assert report.documents == {"legal": 2}
    assert dict(report.problems.counts) == {"non_utf8": 1, "empty_text": 1}
    ids = sorted(json.loads(l)["id"] for l in (tmp_path / "out" / "legal.jsonl").read_text().splitlines())
    assert ids == ["mit.txt", "sub/bsd.txt"]


def test_unknown_on_error_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="on_error"):
        ingest(tmp_path, tmp_path / "out", on_error="ignore")


def test_domain_names_that_would_escape_or_break_the_output_are_problems(tmp_path):
    """A domain becomes a file name: "../x" would write outside --out, "a/b" would crash; both are reported with
    file:line, nothing is written outside the output folder."""
    from data.ingest import ingest

    src = tmp_path / "in.jsonl"
    rows = [
        {"text": "fine", "domain": "news"},
        {"text": "t", "domain": "../escape"},
        {"text": "t", "domain": "a/b"},
        {"text": "t", "domain": ".hidden"},
        {"text": "t", "domain": "x" * 65},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = ingest(src, tmp_path / "out")
    assert report.documents == {"news": 1}
    assert report.problems.counts["invalid_domain_name"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]  # nothing landed beside --out
    assert "in.jsonl:2: invalid_domain_name ('../escape'" in str(report.problems.first[0])


def test_ingest_is_a_cli(tmp_path):
    import subprocess
    import sys

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "hello", "domain": "news"}) + "\n" + "not json\n")
    ok = subprocess.run(
        [sys.executable, "-m", "data.ingest", str(src), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and json.loads(ok.stdout)["documents"] == {"news": 1}
    bad = subprocess.run(
        [sys.executable, "-m", "data.ingest", str(src), "--out", str(tmp_path / "o2"), "--on-error", "fail"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "invalid_json" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "o2").exists()
    missing = subprocess.run(
        [sys.executable, "-m", "data.ingest", str(tmp_path / "nope"), "--out", str(tmp_path / "o3")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr


def test_a_domain_that_is_not_a_string_is_a_problem_not_a_domain(tmp_path):
    """`"domain": true` would have become a domain named "True"; numbers, lists and objects
    likewise: each is reported with file:line and nothing of it is written."""
    src = tmp_path / "in.jsonl"
    rows = [
        {"text": "fine", "domain": "news"},
        {"text": "t", "domain": True},
        {"text": "t", "domain": 3},
        {"text": "t", "domain": ["a"]},
        {"text": "t", "domain": {"a": 1}},
        {"text": "t", "domain": False},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = ingest(src, tmp_path / "out")
    assert report.documents == {"news": 1}
    assert report.problems.counts["domain_not_string"] == 5
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.suffix == ".jsonl") == ["news.jsonl"]
    assert "in.jsonl:2: domain_not_string ('domain' is true)" in str(report.problems.first[0])


def test_a_second_ingest_into_the_same_folder_leaves_only_what_its_manifest_lists(tmp_path):
    """Ingest is published whole (data/atomic.py `staged_dir`): the domains of an earlier ingest into the same --out
    are gone, so prepare never tokenises them (prepare also refuses a .jsonl its manifest does not list)."""
    first, second, out = tmp_path / "first.jsonl", tmp_path / "second.jsonl", tmp_path / "out"
    first.write_text("".join(json.dumps(r) + "\n" for r in GOOD))
    second.write_text(json.dumps(GOOD[0]) + "\n")
    ingest(first, out, **FIELDS)
    assert sorted(p.name for p in out.iterdir()) == [
        "biomed.jsonl",
        "code.jsonl",
        "manifest.json",
        "news.jsonl",
    ]
    ingest(second, out, **FIELDS)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "news.jsonl"]
    assert list(json.loads((out / "manifest.json").read_text())["domains"]) == ["news"]


def test_unreadable_domain_folders_and_files_are_problems_not_silence(tmp_path):
    root = tmp_path / "corpus"
    (root / "news").mkdir(parents=True)
    (root / "news" / "a.txt").write_text("A readable document.")
    (root / "news" / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    (root / "sport").symlink_to(tmp_path / "no-such-folder")
    report = ingest(root, tmp_path / "out", on_error="skip")
    assert report.documents == {"news": 1}
    assert dict(report.problems.counts) == {"unreadable_domain": 1, "unreadable_file": 1}
    assert "dangling symbolic link" in str(report.problems.first[0]) or "dangling symbolic link" in str(
        report.problems.first[1]
    )
