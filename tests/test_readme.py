"""The documentation's claims cite their tests, and its links resolve.

- Every bullet of the "What is better" and "What differs" lists (README.md, section "Migrating
  from torch FSDP1") is backed by at least one test named by its pytest node id
  (`tests/test_x.py::Class::test_y`, `tests/test_x.py::test_z` or `tests/test_x.py::Class`): in
  the bullet itself, or in the section of a guide the bullet links to (docs/migrating.md has one
  `###` section per claim, ending with its tests). Every claim section of docs/migrating.md's two
  lists is linked from the README's list of the same name, so a claim cannot lose its test or its
  place in the README unnoticed.
- Every test file or node id that README.md or docs/*.md names exists: the file, and the class /
  function / method in it.
- Every relative Markdown link (`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`) in
  README.md, docs/*.md and the Markdown files they link to (ARCHITECTURE.md, bench/RESULTS.md)
  resolves to an existing file, and its anchor to a heading of that file (GitHub's slugs).
- The files of the "Layout" table (docs/internals.md) exist.
"""

import ast
import pathlib
import re
from typing import Dict, List, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLAIMS = DOCS / "migrating.md"  # the README's "What is better" / "What differs" claims, each with its tests
INTERNALS = DOCS / "internals.md"  # the "Layout" table
LISTS = ("What is better", "What differs")
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)((?:::\w+)*)`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^()\s]+)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def _documents() -> List[pathlib.Path]:
    """README.md and the guides under docs/."""
    return [README] + sorted(DOCS.glob("*.md"))


# -- sections and bullets ---------------------------------------------------------------------


def _section(text: str, heading: str) -> List[str]:
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _bullets(lines: List[str], label: str) -> List[str]:
    """The bullets of the list introduced by the line that starts with ``label`` (a bullet
    goes on over the lines indented under it)."""
    start = next(i for i, line in enumerate(lines) if line.startswith(label)) + 1
    bullets: List[str] = []
    for line in lines[start:]:
        if line.startswith("- "):
            bullets.append(line)
        elif line.startswith("  ") and bullets:
            bullets[-1] += " " + line.strip()
        elif line.strip() or bullets:
            break
    return bullets


def _migrating_lists() -> Dict[str, List[str]]:
    section = _section(README.read_text(), "## Migrating from torch FSDP1")
    return {label: _bullets(section, label) for label in LISTS}


# -- test references --------------------------------------------------------------------------


def _defined(path: pathlib.Path) -> Dict[str, Set[str]]:
    """Top-level functions (no members) and classes (their methods) of a Python file."""
    tree = ast.parse(path.read_text())
    names: Dict[str, Set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def _missing(path: str, node: str) -> str:
    """Why the reference does not resolve ("" if it does)."""
    file = ROOT / path
    if not file.is_file():
        return f"{path}: no such file"
    parts = [p for p in node.split("::") if p]
    names = _defined(file)
    if parts and parts[0] not in names:
        return f"{path}: no function or class {parts[0]!r}"
    if len(parts) == 2 and parts[1] not in names[parts[0]]:
        return f"{path}: class {parts[0]!r} has no method {parts[1]!r}"
    if len(parts) > 2:
        return f"{path}{node}: too deep"
    return ""


def _nodes(text: str) -> List[Tuple[str, str]]:
    """The test node ids (not bare files) that ``text`` names."""
    return [(path, node) for path, node in REFERENCE.findall(text) if node]


# -- Markdown: headings, anchors, links -------------------------------------------------------


def _prose_lines(text: str) -> List[str]:
    """The lines of ``text`` with fenced code blocks blanked out (line numbers kept)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def _slug(title: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, every character other than a letter,
    digit, '_', '-' or space removed, and each space made a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link counts by its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _headings(text: str) -> List[Tuple[int, str, int]]:
    """``(level, anchor, line index)`` of every heading outside code blocks; a repeated anchor
    gets GitHub's ``-1``, ``-2``, ... suffixes."""
    found, seen = [], {}  # type: List[Tuple[int, str, int]], Dict[str, int]
    for index, line in enumerate(_prose_lines(text)):
        match = HEADING.match(line)
        if not match:
            continue
        anchor = _slug(match.group(2))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.append((len(match.group(1)), anchor if count == 0 else f"{anchor}-{count}", index))
    return found


def _anchor_section(path: pathlib.Path, anchor: str) -> List[str]:
    """The lines under the heading of ``path`` whose anchor is ``anchor``, up to the next heading
    of the same or a higher level (``[]`` if there is no such heading)."""
    lines = path.read_text().splitlines()
    headings = _headings("\n".join(lines))
    for position, (level, name, start) in enumerate(headings):
        if name == anchor:
            end = next((i for lvl, _, i in headings[position + 1 :] if lvl <= level), len(lines))
            return lines[start + 1 : end]
    return []


def _links(text: str) -> List[str]:
    """The targets of the relative links in ``text`` (not in code blocks or code spans)."""
    prose = "\n".join(re.sub(r"`[^`\n]*`", "", line) for line in _prose_lines(text))
    return [target for target in LINK.findall(prose) if not SCHEME.match(target)]


def _resolve(source: pathlib.Path, target: str) -> Tuple[pathlib.Path, str]:
    """The file a link of ``source`` points to, and its anchor ("" if none)."""
    path, _, anchor = target.partition("#")
    return (source if not path else (source.parent / path).resolve()), anchor


def _link_problem(source: pathlib.Path, target: str) -> str:
    """Why the link ``target`` of the file ``source`` does not resolve ("" if it does)."""
    file, anchor = _resolve(source, target)
    if not file.exists():
        return f"{target}: no such file"
    if not anchor:
        return ""
    if file.suffix != ".md" or not file.is_file():
        return f"{target}: an anchor into a file that is not Markdown"
    if anchor not in {name for _, name, _ in _headings(file.read_text())}:
        return f"{target}: {file.name} has no heading with the anchor #{anchor}"
    return ""


def _linked_markdown() -> List[pathlib.Path]:
    """README.md, docs/*.md and the Markdown files of this repository they link to."""
    files = _documents()
    for source in list(files):
        for target in _links(source.read_text()):
            file, _ = _resolve(source, target)
            if file.suffix == ".md" and file.is_file() and ROOT in file.parents and file not in files:
                files.append(file)
    return files


def _tests_behind(bullet: str, source: pathlib.Path) -> List[Tuple[str, str]]:
    """The test node ids backing a bullet of ``source``: those it names, and those of every guide
    section it links to (a broken link or anchor backs nothing)."""
    nodes = _nodes(bullet)
    for target in _links(bullet):
        file, anchor = _resolve(source, target)
        if anchor and file.suffix == ".md" and file.is_file():
            nodes += _nodes("\n".join(_anchor_section(file, anchor)))
    return nodes


def _claims(label: str) -> List[str]:
    """The anchors of the ``###`` claim sections under ``## {label}`` in docs/migrating.md."""
    headings = _headings(CLAIMS.read_text())
    start = next(i for i, (level, name, _) in enumerate(headings) if level == 2 and name == _slug(label))
    claims = []
    for level, name, _ in headings[start + 1 :]:
        if level <= 2:
            break
        if level == 3:
            claims.append(name)
    return claims


# -- the checks -------------------------------------------------------------------------------


def test_every_bullet_of_what_is_better_and_what_differs_is_backed_by_a_test():
    for label, bullets in _migrating_lists().items():
        assert bullets, f"README: no bullets found under {label!r}"
        for bullet in bullets:
            assert _tests_behind(bullet, README), (
                f"README, {label}: this bullet names no test (`tests/test_x.py::name`) and links to no "
                f"section of a guide that names one: {bullet[:100]}..."
            )


def test_every_claim_of_the_migration_guide_is_linked_from_the_readmes_list():
    for label, bullets in _migrating_lists().items():
        linked = {anchor for bullet in bullets for target in _links(bullet) for file, anchor in [_resolve(README, target)] if file == CLAIMS}
        claims = _claims(label)
        assert claims, f"docs/migrating.md: no claims under '## {label}'"
        assert sorted(set(claims) - linked) == [], f"docs/migrating.md: claims under '## {label}' that the README's list does not link to"
        for claim in claims:
            assert _nodes("\n".join(_anchor_section(CLAIMS, claim))), f"docs/migrating.md#{claim} names no test"


def test_every_test_the_docs_name_exists():
    references = [(doc, path, node) for doc in _documents() for path, node in REFERENCE.findall(doc.read_text())]
    assert len(references) > 20
    problems = sorted({f"{doc.relative_to(ROOT)}: {_missing(path, node)}" for doc, path, node in references if _missing(path, node)})
    assert not problems, "the documentation names tests that do not exist:\n" + "\n".join(problems)


def test_every_relative_link_resolves():
    files = _linked_markdown()
    assert README in files and CLAIMS in files and len(files) > 8
    problems = [f"{source.relative_to(ROOT)}: {_link_problem(source, target)}" for source in files for target in _links(source.read_text()) if _link_problem(source, target)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_file_of_the_layout_table_exists():
    rows = [line for line in _section(INTERNALS.read_text(), "## Layout") if line.startswith("| `")]
    paths = [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]
    assert len(paths) > 20
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_the_check_finds_what_does_not_exist():
    assert _missing("tests/test_readme.py", "::test_every_test_the_docs_name_exists") == ""
    assert _missing("tests/test_readme.py", "::NoSuchTest") == "tests/test_readme.py: no function or class 'NoSuchTest'"
    assert _missing("tests/test_parity.py", "::test_parity_with_single_process::x") != ""
    assert _missing("tests/test_errors.py", "::ErrorTest::test_no_such_thing") != ""
    assert _missing("tests/no_such_file.py", "") == "tests/no_such_file.py: no such file"


def test_slugs_are_githubs():
    assert _slug("Set-up") == "set-up"
    assert _slug("torch's state-dict API") == "torchs-state-dict-api"
    assert _slug("Gradients inside `no_sync()`") == "gradients-inside-no_sync"
    assert _slug("Original parameters (`use_orig_params=True`)") == "original-parameters-use_orig_paramstrue"
    assert _slug("A — B: [the link](x.md)") == "a--b-the-link"
    assert [name for _, name, _ in _headings("# A\n```\n# not a heading\n```\n## A\n### B #")] == ["a", "a-1", "b"]


def test_the_link_check_finds_broken_links_and_anchors(tmp_path):
    guide = tmp_path / "docs" / "guide.md"
    guide.parent.mkdir()
    guide.write_text("# Guide\n\n## Which API to use\n\n```\n## Not a heading\n```\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    readme = tmp_path / "README.md"
    assert _link_problem(readme, "docs/guide.md") == ""
    assert _link_problem(readme, "docs/guide.md#which-api-to-use") == ""
    assert _link_problem(guide, "#guide") == ""
    assert _link_problem(guide, "../code.py") == ""
    assert _link_problem(readme, "docs/missing.md") == "docs/missing.md: no such file"
    assert _link_problem(readme, "docs/guide.md#which-api") == "docs/guide.md#which-api: guide.md has no heading with the anchor #which-api"
    assert _link_problem(readme, "docs/guide.md#not-a-heading") != ""
    assert _link_problem(guide, "code.py") == "code.py: no such file"  # relative to docs/
    assert _link_problem(readme, "code.py#L1") != ""
    text = "[a](docs/guide.md) `[b](nowhere.md)` [c](https://example.com) ![d](img.png)\n```\n[e](nowhere.md)\n```\n"
    assert _links(text) == ["docs/guide.md", "img.png"]


def test_a_claim_that_lost_its_test_is_found(tmp_path):
    guide = tmp_path / "claims.md"
    guide.write_text(
        "## What is better\n\n### Tested\n\nTests: `tests/test_readme.py::test_slugs_are_githubs`.\n\n"
        "### Untested\n\nNo test here.\n\n### Next\n\nTests: `tests/test_readme.py::test_slugs_are_githubs`.\n"
    )
    source = tmp_path / "README.md"
    assert _tests_behind("- a claim ([tests](claims.md#tested))", source) == [("tests/test_readme.py", "::test_slugs_are_githubs")]
    assert _tests_behind("- a claim ([tests](claims.md#untested))", source) == []  # the next section's test does not count
    assert _tests_behind("- a claim ([tests](claims.md#no-such-claim))", source) == []
    assert _tests_behind("- a claim ([tests](missing.md#tested))", source) == []
    assert _tests_behind("- a claim (`tests/test_readme.py::test_slugs_are_githubs`)", source) != []
    assert _tests_behind("- a claim (`tests/test_readme.py`)", source) == []  # a file is not a test
