"""The documentation's links: README.md, the other top-level pages and docs/*.md link only to files that
exist, and to headings that exist in them, as GitHub resolves anchors; mkdocs.yml's nav lists every page;
the README's map names every page. `mkdocs build --strict` (.ci/run) checks docs/ with mkdocs' own anchors;
this test also covers the top-level pages, which are outside the site, and runs with the test suite, where
mkdocs is not installed."""

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# README.md and the other top-level pages (ARCHITECTURE.md) are outside the site: mkdocs does not check them.
LINKED_FILES = [*sorted(ROOT.glob("*.md")), *PAGES]

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target): the text may wrap onto the next line; the target has no spaces (none of ours has a title).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The text outside fenced blocks, with code spans emptied: a `[x](y)` inside code is not a link."""
    return CODE_SPAN.sub("`code`", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, punctuation dropped (word characters,
    '-' and ' ' stay), each space a '-'. mkdocs collapses runs of '-' and spaces where GitHub does not,
    so an anchor both accept avoids headings such as 'Weights & Biases' (GitHub: weights--biases)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file, with GitHub's -1, -2 ... for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def relative_links(path: Path) -> list[str]:
    """Links to files of the repository (not URLs) in a Markdown file, in order."""
    return [
        t
        for t in LINK.findall(_prose(path.read_text()))
        if not re.match(r"[a-z][a-z0-9+.-]*:", t)
    ]


def test_github_slug_follows_github():
    assert (
        github_slug("Checkpoints, resume and preemption")
        == "checkpoints-resume-and-preemption"
    )
    assert github_slug("One `train` per run directory") == "one-train-per-run-directory"
    assert (
        github_slug("The prompt ledger: RUN_DIR/events.jsonl")
        == "the-prompt-ledger-run_direventsjsonl"
    )
    assert github_slug("Weights & Biases") == "weights--biases"


def test_there_are_pages_and_links():
    """Guards the tests below against a pattern that silently finds nothing."""
    assert len(PAGES) >= 10, PAGES
    assert len(relative_links(ROOT / "README.md")) >= len(PAGES)
    assert sum(len(anchors(p)) for p in PAGES) >= len(PAGES)


@pytest.mark.parametrize("path", LINKED_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(
                f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
            )
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(
                f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}"
            )
    assert not broken, f"{path.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def _nav_files(entries) -> list[str]:
    files = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        files.extend(_nav_files(value) if isinstance(value, list) else [value])
    return files


def test_mkdocs_nav_lists_every_page_once():
    nav = _nav_files(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = [p.name for p in PAGES]
    assert len(nav) == len(set(nav)), f"mkdocs.yml: a page is in the nav twice: {nav}"
    assert set(nav) == set(pages), (
        f"mkdocs.yml nav: pages missing from it {sorted(set(pages) - set(nav))}, "
        f"entries without a file {sorted(set(nav) - set(pages))}"
    )


def test_readme_map_links_every_page():
    linked = {
        (ROOT / t.partition("#")[0]).resolve()
        for t in relative_links(ROOT / "README.md")
    }
    missing = [p.name for p in PAGES if p.resolve() not in linked]
    assert not missing, f"README.md's map of the docs lacks: {missing}"


def test_docs_home_has_the_readme_quick_start_command():
    """docs/index.md repeats the README's quick-start command (the site has no README); they must not drift."""
    command = re.compile(
        r"^python3\.11 -m venv \.venv && \.venv/bin/pip install -e \. .*$", re.MULTILINE
    )
    readme = command.findall((ROOT / "README.md").read_text())
    assert len(readme) == 1
    assert command.findall((DOCS / "index.md").read_text()) == readme


# ARCHITECTURE.md names the tests that guard each invariant: `test_x.py::test_name`, then `::other_name` for
# more in the same module.
TEST_REFERENCE = re.compile(r"`(test_\w+\.py)?::(\w+)")


def test_every_test_architecture_names_exists():
    text, module, missing = (ROOT / "ARCHITECTURE.md").read_text(), None, []
    for file, name in TEST_REFERENCE.findall(text):
        module = file or module
        assert module, f"ARCHITECTURE.md: `::{name}` names no module before it"
        if not re.search(rf"^def {name}\(", (ROOT / "tests" / module).read_text(), re.MULTILINE):
            missing.append(f"{module}::{name}")
    assert not missing, f"ARCHITECTURE.md names tests that do not exist: {missing}"
