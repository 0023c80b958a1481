"""The documents' links cannot rot: every relative link of README.md, docs/*.md and bench/README.md
names a file or folder of the repository, and every ``#anchor`` (into the same document or another
markdown file) names a heading of it, by GitHub's rules for heading anchors. Links to the web are
left alone. Fast: it reads files only (``make test-quick`` runs it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Set

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "bench" / "README.md"]

#: An inline link or image, ``[text](target)`` or ``[text](target "title")``.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
#: What GitHub drops from a heading's text to make its anchor: all but letters, digits, ``_``,
#: ``-`` and spaces (``\w`` is letters, digits and ``_``, in any script).
NOT_IN_ANCHOR = re.compile(r"[^\w\- ]")


def prose_lines(text: str) -> List[str]:
    """The lines of ``text`` outside fenced code blocks, with code spans blanked out (a link in code
    is not a link)."""
    lines, fence = [], None
    for line in text.splitlines():
        stripped = line.lstrip()
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            lines.append("")
        elif stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            lines.append("")
        else:
            lines.append(CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line))
    return lines


def heading_text(heading: str) -> str:
    """A heading's text as GitHub renders it: links reduced to their text, code spans and emphasis
    to their content."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[`*]", "", text).strip()


def anchors(text: str) -> Set[str]:
    """The anchors GitHub gives the headings of ``text``: the heading's text in lower case, without
    punctuation, spaces turned into hyphens; a repeated one gets ``-1``, ``-2``, ..."""
    seen: Dict[str, int] = {}
    result = set()
    fence = None
    for line in text.splitlines():
        stripped = line.lstrip()
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = NOT_IN_ANCHOR.sub("", heading_text(match.group(1)).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def link_targets(text: str) -> List[tuple]:
    """``(line, target)`` of every link of ``text`` outside code (a link's text may wrap)."""
    prose = "\n".join(prose_lines(text))
    return [(prose.count("\n", 0, match.start()) + 1, match.group(1)) for match in LINK.finditer(prose)]


def broken_links(path: Path, root: Path = REPO_ROOT) -> List[str]:
    """``line: target (why)`` for each relative link of the document at ``path`` that does not
    resolve inside the repository at ``root``."""
    broken = []
    for number, target in link_targets(path.read_text()):
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        where = (path.parent / file_part).resolve() if file_part else path
        if not where.exists():
            broken.append(f"{number}: {target} (no such file)")
        elif root.resolve() not in where.parents and where != root.resolve():
            broken.append(f"{number}: {target} (outside the repository)")
        elif anchor:
            if where.suffix != ".md":
                broken.append(f"{number}: {target} (an anchor into a file that is not markdown)")
            elif anchor not in anchors(where.read_text()):
                broken.append(f"{number}: {target} (no heading of {where.name} has that anchor)")
    return broken


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_relative_link_resolves(path):
    assert path.is_file(), path
    broken = broken_links(path)
    assert not broken, f"{path.relative_to(REPO_ROOT)} has links that do not resolve:\n" + "\n".join(broken)


def test_the_readme_links_every_document():
    """Guards the extraction too: the README's links reach every document of docs/ and bench/README.md."""
    readme = REPO_ROOT / "README.md"
    linked = {(REPO_ROOT / target.partition("#")[0]).resolve() for _, target in link_targets(readme.read_text())
              if target and not re.match(r"^([a-z][a-z0-9+.-]*:|#)", target, re.I)}
    assert set(DOCUMENTS[1:]) <= linked, sorted(p.name for p in set(DOCUMENTS[1:]) - linked)


def test_anchors_follow_githubs_rules():
    text = "\n".join(["# Links and data planes", "## The nixl plane: across hosts over RDMA",
                      "## `cuda_ipc`: who gets this process's GPU memory", "## The sweep: `python -m x bench`",
                      "## Two-sided links: `link`, `unlink`", "## Notes", "## Notes", "```", "## not a heading", "```",
                      "### 4 KiB over `tcp`: the receive spin (`latency_tcp.py`)", "## C++ API (as [Python](x.md))"])
    assert anchors(text) == {"links-and-data-planes", "the-nixl-plane-across-hosts-over-rdma",
                             "cuda_ipc-who-gets-this-processs-gpu-memory", "the-sweep-python--m-x-bench",
                             "two-sided-links-link-unlink", "notes", "notes-1",
                             "4-kib-over-tcp-the-receive-spin-latency_tcppy", "c-api-as-python"}


def test_the_check_catches_what_it_is_for(tmp_path):
    """A missing file, a missing anchor, an anchor into a file that is not markdown and a file outside
    the repository are caught; links in code, and links to the web, are not links to check."""
    root = tmp_path / "repo"
    root.mkdir()
    (tmp_path / "outside.md").write_text("# Outside\n")
    (root / "other.md").write_text("# Other\n\n## A section\n")
    (root / "data.txt").write_text("x\n")
    doc = root / "doc.md"
    doc.write_text("# Doc\n\n[ok](other.md#a-section) [self](#doc) [web](https://example.invalid/x#y)\n"
                   "`[code](nowhere.md)` [a link whose text\nwraps](other.md)\n```\n[fenced](nowhere.md)\n```\n"
                   "[gone](nowhere.md) [anchor](other.md#no-such) [text](data.txt#x) [up](../outside.md)\n")
    assert broken_links(doc, root) == [
        "9: nowhere.md (no such file)", "9: other.md#no-such (no heading of other.md has that anchor)",
        "9: data.txt#x (an anchor into a file that is not markdown)", "9: ../outside.md (outside the repository)"]
