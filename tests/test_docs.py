"""The README is a front door and docs/ cannot rot silently.

Pinned: the README's first code block is exactly the two set-up commands, each a real Makefile
target; the README stays short; every relative link (and ``#anchor``) in README.md and docs/*.md
resolves; every ``kvbatch.<module>`` dotted path and every ``engine/...py``-style file path they
name exists in the tree, and so does every module docs/layout.md's tables list (so a move like the
engine's into sub-packages breaks this test, not the reader); docs/correctness.md keeps the claim
markers the lead fills in. The checks read files only (no imports): they take milliseconds.

Each checker returns a list of problems instead of asserting, so the last test can run it on a
deliberately broken copy and show that it fails.
"""

from __future__ import annotations

import functools
import re
import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
SETUP_COMMANDS = ["make demo", "make test"]
# Markers the lead replaces with re-measured figures; they must not be lost in an edit.
CLAIM_MARKERS = ("smollm2-greedy", "smollm2-logits", "batch-invariance")

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
DOTTED = re.compile(r"(?<![\w./-])kvbatch(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"from[ \t]+(kvbatch(?:\.\w+)+)[ \t]+import[ \t]+(\([^)]*\)|[\w \t,]+)")
SOURCE_DIRS = ("engine", "ops", "io", "kernels", "cli", "pipelines", "resources", "serve", "scripts", "tests",
               "benchmarks")
FILE_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(SOURCE_DIRS) + r")/[\w/.*-]*?\.py)(?![\w/])")


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def split_code(text: str) -> tuple[list[str], list[list[str]]]:
    """(prose lines with fenced blocks blanked, the fenced blocks' lines) of a markdown text."""
    prose, blocks, block = [], [], None
    for line in text.splitlines():
        if FENCE.match(line):
            if block is None:
                block = []
            else:
                blocks.append(block)
                block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercased, punctuation removed, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    prose, _ = split_code(path.read_text(encoding="utf-8"))
    for line in prose:
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


# -- the checkers ---------------------------------------------------------------------------


def makefile_targets(makefile: Path) -> set[str]:
    targets = set()
    for line in makefile.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_./-]+(?:\s+[A-Za-z0-9_./-]+)*)\s*:(?![=:])", line)
        if m and not line.startswith("\t"):
            targets.update(m.group(1).split())
    return targets


def setup_block_problems(root: Path) -> list[str]:
    _, blocks = split_code((root / "README.md").read_text(encoding="utf-8"))
    if not blocks:
        return ["README.md has no code block"]
    commands = [line.split("#", 1)[0].strip() for line in blocks[0]]
    commands = [c for c in commands if c]
    problems = []
    if commands != SETUP_COMMANDS:
        problems.append(f"README's first code block holds {commands}, expected exactly {SETUP_COMMANDS}")
    targets = makefile_targets(root / "Makefile")
    for command in commands:
        words = command.split()
        if len(words) != 2 or words[0] != "make" or words[1] not in targets:
            problems.append(f"{command!r} is not `make <target>` for a target of the Makefile ({sorted(targets)})")
    return problems


def length_problems(root: Path) -> list[str]:
    n = len((root / "README.md").read_text(encoding="utf-8").splitlines())
    return [f"README.md has {n} lines, at most {README_MAX_LINES}"] if n > README_MAX_LINES else []


def link_problems(root: Path) -> list[str]:
    problems = []
    for doc in doc_files(root):
        prose, _ = split_code(doc.read_text(encoding="utf-8"))
        for no, line in enumerate(prose, 1):
            line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
                    continue
                path, _, anchor = target.partition("#")
                dest = (doc.parent / path).resolve() if path else doc
                where = f"{doc.relative_to(root)}:{no}: ({target})"
                if not dest.exists():
                    problems.append(f"{where} points at a missing file")
                elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                    problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
    return problems


@functools.cache
def package_dirs(code_root: Path) -> dict[str, Path]:
    """``kvbatch.<name>`` -> folder, from pyproject's setuptools package-dir."""
    with open(code_root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {pkg: code_root / folder for pkg, folder in mapping.items()}


@functools.cache
def defines(module: Path, name: str) -> bool:
    text = module.read_text(encoding="utf-8")  # code is not edited while the tests run
    pattern = (rf"^\s*(?:async\s+)?def\s+{name}\b|^\s*class\s+{name}\b|^{name}\s*[:=]"
               rf"|^\s*(?:from\s+\S+\s+)?import\s+.*\b{name}\b|[\"']{name}[\"']")
    return re.search(pattern, text, re.MULTILINE) is not None


def resolve(dotted: str, code_root: Path) -> str | None:
    """None when ``dotted`` names a package, a module or a name defined in one; else why not."""
    dirs = package_dirs(code_root)
    parts = dotted.split(".")
    # kvbatch.BatchInference: a name the package root defines (lazily, kvbatch/__init__.py).
    if len(parts) == 2 and parts[0] in dirs and defines(dirs[parts[0]] / "__init__.py", parts[1]):
        return None
    if len(parts) < 2 or ".".join(parts[:2]) not in dirs:
        return f"{dotted}: no package {'.'.join(parts[:2])} in pyproject's package-dir"
    here: Path = dirs[".".join(parts[:2])]
    rest = parts[2:]
    while rest and (here / rest[0] / "__init__.py").exists():
        here = here / rest.pop(0)
    module = here / "__init__.py"
    if rest and (here / f"{rest[0]}.py").exists():
        module = here / f"{rest.pop(0)}.py"
    if rest and not defines(module, rest[0]):
        return f"{dotted}: {module.relative_to(code_root)} defines no {rest[0]!r}"
    return None


def path_problems(root: Path, code_root: Path) -> list[str]:
    problems = []
    for doc in doc_files(root):
        text = doc.read_text(encoding="utf-8")
        where = doc.relative_to(root)
        for dotted in sorted(set(DOTTED.findall(text))):
            why = resolve(dotted, code_root)
            if why:
                problems.append(f"{where}: {why}")
        for module, names in FROM_IMPORT.findall(text):
            for name in (n.split()[0] for n in names.strip("()").split(",") if n.strip()):  # "X as Y": X
                if name:
                    why = resolve(f"{module}.{name}", code_root)
                    if why:
                        problems.append(f"{where}: from {module} import {name}: {why}")
        for path in sorted(set(FILE_PATH.findall(text))):
            if not list(code_root.glob(path)):
                problems.append(f"{where}: {path} does not exist")
    return problems


def layout_problems(root: Path, code_root: Path) -> list[str]:
    """docs/layout.md's module tables name modules that exist: in the engine table, the modules
    of each row's sub-package (second column); in the ops/, io/ and kernels/cpu/ tables, the first
    column's (`kvstore.store` is io/kvstore/store.py)."""
    dirs = package_dirs(code_root)
    problems, section, package = [], "", ""
    prose, _ = split_code((root / "docs" / "layout.md").read_text(encoding="utf-8"))
    for line in prose:
        if m := HEADING.match(line):
            section = m.group(2).strip().rstrip("/")
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 2 or re.fullmatch(r":?-+:?", cells[0]):  # not a table row, or its |---| line
            continue
        if section == "engine":
            package = cells[0].strip("`") or package
            if not package.startswith("kvbatch."):
                continue  # the header row
            folder, names = dirs["kvbatch.engine"] / package.split(".")[-1], re.findall(r"`(\w+)`", cells[1])
        elif section in ("ops", "io", "kernels/cpu"):
            top, _, sub = section.partition("/")
            folder, names = dirs[f"kvbatch.{top}"] / sub, re.findall(r"`(\w+(?:\.\w+)*)`", cells[0])
        else:
            continue
        paths = [n.replace(".", "/") + ".py" for n in names]
        problems += [f"docs/layout.md: {section}: {folder.relative_to(code_root)}/{path} does not exist"
                     for path in paths if not (folder / path).exists()]
    return problems


def claim_problems(root: Path) -> list[str]:
    text = (root / "docs" / "correctness.md").read_text(encoding="utf-8")
    return [f"docs/correctness.md lost the marker <!-- claim: {c} -->" for c in CLAIM_MARKERS
            if f"<!-- claim: {c} -->" not in text]


# -- the tree as it is ----------------------------------------------------------------------


def test_readme_opens_with_the_two_setup_commands() -> None:
    assert setup_block_problems(ROOT) == []


def test_readme_is_a_front_door() -> None:
    assert length_problems(ROOT) == []


def test_every_relative_link_and_anchor_resolves() -> None:
    assert link_problems(ROOT) == []


def test_every_module_and_file_path_named_in_the_docs_exists() -> None:
    assert path_problems(ROOT, ROOT) == []


def test_layout_tables_name_modules_that_exist() -> None:
    assert layout_problems(ROOT, ROOT) == []


def test_correctness_claims_keep_their_markers() -> None:
    assert claim_problems(ROOT) == []


def test_docs_exist_one_page_per_subject() -> None:
    pages = {"cli", "pipeline", "kv-store", "speculative-decoding", "expert-parallelism", "metrics",
             "performance", "correctness", "layout", "python-api", "development"}
    assert pages <= {p.stem for p in (ROOT / "docs").glob("*.md")}


# -- each checker fails on a broken copy ----------------------------------------------------


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, f"mutation anchor {old!r} not in {path.name}"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")


MUTATIONS = {
    "third setup command": (setup_block_problems, lambda c: _edit(c / "README.md", "make test ", "make test\nmake bench ")),
    "setup target missing from the Makefile": (
        setup_block_problems, lambda c: _edit(c / "Makefile", "\ndemo: install", "\ndemo-all: install")),
    "setup block not first": (setup_block_problems, lambda c: _edit(c / "README.md", "```bash\nmake demo",
                                                                     "```\nls\n```\n\n```bash\nmake demo")),
    "README too long": (length_problems, lambda c: _append(c / "README.md", "\n" * README_MAX_LINES)),
    "link to a missing page": (link_problems, lambda c: _append(c / "README.md", "\n[x](docs/nowhere.md)\n")),
    "link to a missing anchor": (link_problems, lambda c: _append(c / "docs" / "cli.md", "\n[x](metrics.md#nope)\n")),
    "renamed heading": (link_problems, lambda c: _edit(c / "docs" / "correctness.md", "## Deterministic mode",
                                                       "## Batch-invariant mode")),
    "module path from before the move": (
        path_problems, lambda c: _append(c / "docs" / "layout.md", "\nSee `kvbatch.engine.llm`.\n")),
    "name the module does not define": (
        path_problems, lambda c: _append(c / "docs" / "layout.md", "\n`kvbatch.kernels.dispatch.no_such_kernel`\n")),
    "import of a name the API lacks": (
        path_problems, lambda c: _append(c / "docs" / "python-api.md", "\nfrom kvbatch.engine import Engine\n")),
    "file path from before the move": (
        path_problems, lambda c: _append(c / "docs" / "performance.md", "\nIn `engine/linear.py`.\n")),
    "layout names a module that moved": (
        layout_problems, lambda c: _edit(c / "docs" / "layout.md", "| | `sequence` |", "| | `sequence`, `engine` |")),
    "layout names an ops module that is gone": (
        layout_problems, lambda c: _edit(c / "docs" / "layout.md", "| `results.cost` |", "| `results.costs` |")),
    "layout names a CPU backend module that is gone": (
        layout_problems, lambda c: _edit(c / "docs" / "layout.md", "| `mkl_packed` |", "| `mkl_pack` |")),
    "layout names a kvstore module that is gone": (
        layout_problems, lambda c: _edit(c / "docs" / "layout.md", "| `kvstore.gc` |", "| `kvstore.gcs` |")),
    "claim marker dropped": (claim_problems, lambda c: _edit(c / "docs" / "correctness.md",
                                                             "<!-- claim: batch-invariance -->", "")),
}


@pytest.fixture
def docs_copy(tmp_path: Path) -> Iterator[Path]:
    for name in ("README.md", "Makefile"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    yield tmp_path


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_check_fails_on_a_broken_copy(docs_copy: Path, name: str) -> None:
    check, mutate = MUTATIONS[name]

    def run() -> list[str]:
        return check(docs_copy, ROOT) if check in (path_problems, layout_problems) else check(docs_copy)

    assert run() == []  # the unbroken copy passes, so the failure below is the mutation's
    mutate(docs_copy)
    assert run(), f"{check.__name__} did not notice: {name}"
