"""The documentation and the code cite each other correctly.

Code cites ``docs/<file>.md, "<section>"``; the docs cite ``NOTE [ name ]`` blocks of the
code (``NOTE [ name ] in `path` `` when they say where) and files of the repository by
path. Each citation must name something that exists.
"""

from __future__ import annotations

import pathlib
import re

import pytest

_REPO = pathlib.Path(__file__).resolve().parent.parent
_DOCS = _REPO / "docs"
# Where NOTE blocks and docs citations live: the package and the repository's other code.
_CODE_DIRS = ("memctl", "benchmarks", "deploy", "examples")
_OLD_DESIGN = "DESIGN" + ".md"  # split so that this file does not cite it itself

# A name may wrap onto the next line; "NOTE [ ... ]" speaks of NOTE blocks in general.
_NOTE = re.compile(r"NOTE \[\s([^\]]+?)\s\]")
_NOTE_AT = re.compile(r"NOTE \[\s([^\]]+?)\s\]\s+in\s+`([^`]+)`")
_GENERIC = "..."
# docs/design.md, "The budget"  (a comment may wrap the section onto a "# " line)
_CODE_CITE = re.compile(r'docs/([\w./-]+?\.md)(?:,\s*(?:#\s*)?"([^"]+)")?')
# design.md, "The budget"   or   [design.md](design.md), "The budget"
_DOCS_CITE = re.compile(r'(?<![\w/])(\w+\.md)(?:\]\([^)]*\))?, "([^"]+)"')
# `memctl/controller/oom.py`, `benchmarks/README.md`, ...
_PATH = re.compile(r"`((?:memctl|tests|benchmarks|deploy|examples|docs)/[\w./-]*)`")


def _code_files() -> list[pathlib.Path]:
    return sorted(p for d in _CODE_DIRS for p in (_REPO / d).rglob("*.py"))


def _doc_files() -> list[pathlib.Path]:
    return sorted(_DOCS.glob("*.md"))


def _headings(path: pathlib.Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.MULTILINE)}


def _notes_in(path: pathlib.Path) -> set[str]:
    return {" ".join(n.split()) for n in _NOTE.findall(path.read_text())}


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(_REPO))


def test_the_docs_exist() -> None:
    names = {p.name for p in _doc_files()}
    assert {"README.md", "design.md", "formats.md", "api.md"} <= names


def test_no_code_cites_the_old_design_file() -> None:
    citing = [_rel(p) for p in _code_files() if _OLD_DESIGN in p.read_text()]
    assert citing == [], f"cite docs/<file>.md, \"<section>\" instead of {_OLD_DESIGN} in {citing}"


def test_docs_cited_by_code_exist() -> None:
    missing = []
    for path in _code_files():
        for m in _CODE_CITE.finditer(path.read_text()):
            target = _DOCS / m.group(1)
            if not target.is_file():
                missing.append(f"{_rel(path)}: docs/{m.group(1)} does not exist")
                continue
            section = " ".join(m.group(2).replace("#", " ").split()) if m.group(2) else None
            if section is not None and section not in _headings(target):
                missing.append(f"{_rel(path)}: docs/{m.group(1)} has no section {section!r}")
    assert missing == []


def test_code_cites_the_docs() -> None:
    citing = [p for p in _code_files() if _CODE_CITE.search(p.read_text())]
    assert len(citing) >= 10


def test_sections_cited_in_the_docs_exist() -> None:
    missing = []
    for path in [*_doc_files(), _REPO / "README.md"]:
        for name, section in _DOCS_CITE.findall(path.read_text()):
            target = _DOCS / name
            if target.is_file() and " ".join(section.split()) not in _headings(target):
                missing.append(f"{_rel(path)}: {name} has no section {section!r}")
    assert missing == []


def test_notes_named_in_the_docs_exist_in_the_code() -> None:
    defined: set[str] = set()
    for path in _code_files():
        defined |= _notes_in(path)
    missing = []
    for path in _doc_files():
        text = path.read_text()
        for name in _NOTE.findall(text):
            if name != _GENERIC and " ".join(name.split()) not in defined:
                missing.append(f"{_rel(path)}: NOTE [ {name} ] is not in the code")
        for name, where in _NOTE_AT.findall(text):
            target = _REPO / where
            if not target.is_file() or " ".join(name.split()) not in _notes_in(target):
                missing.append(f"{_rel(path)}: NOTE [ {name} ] is not in {where}")
    assert missing == []


def test_paths_named_in_the_docs_exist() -> None:
    missing = [
        f"{_rel(path)}: {name}"
        for path in [*_doc_files(), _REPO / "README.md"]
        for name in _PATH.findall(path.read_text())
        if not (_REPO / name.rstrip("/")).exists()
    ]
    assert missing == []


@pytest.mark.parametrize("text, ok", [
    ('see docs/design.md, "The budget".', True),
    ('see docs/design.md, "No such section".', False),
    ("see docs/nothing.md.", False),
])
def test_the_citation_check_can_fail(text: str, ok: bool) -> None:
    m = _CODE_CITE.search(text)
    assert m is not None
    target = _DOCS / m.group(1)
    found = target.is_file() and (m.group(2) is None or m.group(2) in _headings(target))
    assert found is ok


# A block's own heading: a line that is only "NOTE [ name ]" (after a comment's "#").
_NOTE_HEADING = re.compile(r"^\s*(?:#\s*)?NOTE \[\s(.+?)\s\]\s*$", re.MULTILINE)


def test_every_note_block_of_the_package_is_listed_in_the_docs() -> None:
    listed = {(" ".join(name.split()), where)
              for name, where in _NOTE_AT.findall((_DOCS / "README.md").read_text())}
    unlisted = [
        f"NOTE [ {name} ] in `{_rel(path)}`"
        for path in sorted((_REPO / "memctl").rglob("*.py"))
        for name in _NOTE_HEADING.findall(path.read_text())
        if (" ".join(name.split()), _rel(path)) not in listed
    ]
    assert unlisted == [], "add a row to the NOTE table of docs/README.md for each of these"
