"""What the documents name exists: every backticked file path and dotted module path in the docs
pages, the README and each package's DECISIONS.md, and every link between them, anchors
included (a README section or a docs page's heading that was renamed away). mkdocs checks the
docs site's own links when it builds; this also covers the README, the DECISIONS files, links
out of the site (``../README.md#...``) and the paths written as code."""

from __future__ import annotations

import re
import subprocess
import unicodedata
from functools import cache
from pathlib import Path

import pytest

from tests.unit.test_layers import PROJECT

REPO = Path(__file__).resolve().parents[2]

# A backticked dotted name under one of the repository's packages is a module path.
PACKAGES = tuple(sorted(PROJECT))
# What a backticked file name ends with.
FILE_SUFFIXES = (
    ".py",
    ".md",
    ".toml",
    ".yaml",
    ".yml",
    ".txt",
    ".ini",
    ".cfg",
    ".json",
    ".jsonl",
    ".lua",
    ".html",
    ".css",
    ".js",
    ".png",
    ".mako",
)
# Pages the docs build writes (docs/hooks/reference.py): links to them are mkdocs' to check.
GENERATED = ("reference/",)
# Files the documents name that are not in the repository, by design.
NOT_IN_THE_TREE = frozenset(
    {
        "deferral.toml",  # the settings file a deployment writes (deferral.runtime.config)
        "requirements.txt",  # a deployment's own, for docker/Dockerfile.extend
        "docker-compose.yaml",  # Airflow's, which compose.yaml replaces
        "dags/my_first_dag.py",  # the file getting-started.md has the reader write
        "docs/reference/",  # written by the docs build (docs/hooks/reference.py)
        "webui-screenshots/",  # written by benchmarks/webui_screenshots.py, never committed
    }
)

CODE = re.compile(r"``?([^`\n]+?)``?")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def documents() -> list[Path]:
    """The docs pages, the READMEs, CONTRIBUTING and every DECISIONS.md (tracked or not)."""
    pages = sorted((REPO / "docs").glob("*.md"))
    decisions = sorted(
        path for package in PACKAGES if (path := REPO / package / "DECISIONS.md").exists()
    )
    named = ("README.md", "CONTRIBUTING.md", "benchmarks/README.md")
    extra = [REPO / name for name in named if (REPO / name).exists()]
    return [*pages, *extra, *decisions]


@cache
def repository_files() -> frozenset[str]:
    """Every file and folder of the work tree (tracked or new), as paths from its root."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    paths = {path for path in listed if (REPO / path).exists()}
    folders = {str(Path(path).parent) + "/" for path in paths}
    return frozenset(paths | folders)


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (their contents are programs, not references)."""
    return FENCE.sub("", text)


def looks_like_file(code: str) -> bool:
    if any(c in code for c in " <>*{}$|=,;()[]'\"") or "://" in code:
        return False
    if code.startswith(("/", "~", "...")):  # URL paths, home folders, elisions
        return False
    if ":" in code:  # stream keys, `module:attribute`, `host:port`
        return False
    name = code.rstrip("/").rsplit("/", 1)[-1]
    return "/" in code or (name.endswith(FILE_SUFFIXES) and not name.startswith("."))


def file_exists(code: str, folder: Path) -> bool:
    """A path is read from the repository's root, from the document's ``folder`` or, for a bare
    file name, anywhere in the repository."""
    files = repository_files()
    wanted = code.removeprefix("./")
    here = folder.relative_to(REPO)
    for candidate in {wanted, str(here / wanted) + ("/" if wanted.endswith("/") else "")}:
        if candidate in files or candidate + "/" in files:
            return True
    if "/" not in wanted.rstrip("/"):  # a bare name: a file or folder of that name anywhere
        return any(path.rstrip("/").rsplit("/", 1)[-1] == wanted.rstrip("/") for path in files)
    return False


@cache
def table_columns() -> dict[str, str]:
    """Each table's name -> the source of its class in deferral/store/tables.py."""
    source = (REPO / "deferral" / "store" / "tables.py").read_text()
    classes = re.split(r"^class ", source, flags=re.MULTILINE)[1:]
    found = (re.search(r'__tablename__ = "(\w+)"', body) for body in classes)
    return {match.group(1): body for match, body in zip(found, classes, strict=True) if match}


def column_exists(code: str) -> bool:
    """Whether ``table.column`` names a column of the store's tables."""
    table, _, column = code.partition(".")
    body = table_columns().get(table)
    return body is not None and re.search(rf"^    {re.escape(column)}\b", body, re.M) is not None


def module_path_exists(code: str) -> bool | None:
    """Whether a dotted name under one of ``PACKAGES`` names a module, or an attribute a module
    defines (its name appears in the module's source); None if ``code`` is not such a name."""
    name = code.removesuffix("()")
    parts = name.split(".")
    if parts[0] not in PACKAGES or len(parts) < 2:
        return None
    if not all(IDENTIFIER.fullmatch(part) for part in parts):
        return None
    folder = REPO
    for position, part in enumerate(parts):
        if (folder / part / "__init__.py").exists():
            folder = folder / part
            continue
        module = folder / f"{part}.py"
        if module.exists():
            rest = parts[position + 1 :]
        elif position > 0:
            module, rest = folder / "__init__.py", parts[position:]
        else:
            return False
        return not rest or re.search(rf"\b{re.escape(rest[0])}\b", module.read_text()) is not None
    return True


def bad_code_paths(text: str, folder: Path) -> list[str]:
    """The backticked paths of ``text`` (a document in ``folder``) that do not exist."""
    text = prose(text)
    bad = []
    for code in dict.fromkeys(match.strip() for match in CODE.findall(text)):
        if code in NOT_IN_THE_TREE:
            continue
        if looks_like_file(code) and ("/" in code or code.endswith(FILE_SUFFIXES)):
            if not file_exists(code, folder):
                bad.append(code)
        elif module_path_exists(code) is False and not column_exists(code):
            bad.append(code)
    return bad


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading of a Markdown file (the README, DECISIONS files)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (the docs site)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(text: str, folder: Path) -> set[str]:
    """The anchors of the headings of ``text``, a document in ``folder``."""
    slug = mkdocs_slug if folder == REPO / "docs" else github_slug
    headings = [title for _, title in HEADING.findall(prose(text))]
    plain = [re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", title) for title in headings]
    return {slug(title) for title in plain}


def has_anchor(document: Path, anchor: str) -> bool:
    if not anchor or document.suffix != ".md":
        return True
    return anchor in anchors(document.read_text(), document.parent)


def bad_links(text: str, folder: Path) -> list[str]:
    """The links of ``text`` (a document in ``folder``) to a file or heading that is not
    there."""
    bad = []
    for target in dict.fromkeys(LINK.findall(prose(text))):
        if re.match(r"[a-z]+:", target) or target.startswith(GENERATED):  # http:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors(text, folder):
                bad.append(target)
            continue
        linked = (folder / path).resolve()
        if not linked.exists() or not has_anchor(linked, anchor):
            bad.append(target)
    return bad


@pytest.mark.parametrize("document", documents(), ids=lambda path: str(path.relative_to(REPO)))
def test_every_path_and_link_a_document_names_exists(document: Path) -> None:
    text = document.read_text()
    assert bad_code_paths(text, document.parent) == [], "backticked paths that do not exist"
    assert bad_links(text, document.parent) == [], "links to a file or heading not there"


def test_a_made_up_path_module_or_anchor_is_found() -> None:
    page = (
        "# Title\n\nSee `deferral/store/no_such_file.py`, `deferral.store.no_such_module`,"
        " `deferral.store.transitions.no_such_function`, `no_such_file.py`,"
        " [a section](../README.md#no-such-section), [a page](no-such-page.md),"
        " [this one](#title) and [no such one](#no-title).\n\n"
        "```sh\n`not/checked/in/a/fence.py`\n```\n"
        "Exists: `deferral/store/`, `deferral.store.seam`, `pyproject.toml`, `triggerer.queues`,"
        " [quick start](../README.md#quick-start).\n"
    )
    docs = REPO / "docs"
    assert bad_code_paths(page, docs) == [
        "deferral/store/no_such_file.py",
        "deferral.store.no_such_module",
        "deferral.store.transitions.no_such_function",
        "no_such_file.py",
    ]
    assert bad_links(page, docs) == [
        "../README.md#no-such-section",
        "no-such-page.md",
        "#no-title",
    ]


@pytest.mark.parametrize(
    ("heading", "github", "mkdocs"),
    [
        ("Quick start", "quick-start", "quick-start"),
        ("Shared triggers, start and end", "shared-triggers-start-and-end", None),
        ("Where the time goes (py-spy, EXPLAIN)", "where-the-time-goes-py-spy-explain", None),
        ("A -- B", "a----b", "a-b"),
    ],
)
def test_anchors_are_spelled_as_github_and_mkdocs_spell_them(
    heading: str, github: str, mkdocs: str | None
) -> None:
    assert github_slug(heading) == github
    assert mkdocs_slug(heading) == (mkdocs or github)
