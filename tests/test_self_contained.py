"""The repository stands alone: a clone has nothing outside it, so no tracked file may cite a path outside
the repository, every in-repo path a file cites must exist, and no text may speak of an unnamed machine instead of
naming the CPU, the torch version and the command.

Scanned: every tracked text file (git ls-files; a walk of the tree where git is absent). Checked per file:
- outside paths: a parent-directory climb into a sibling folder, or an absolute home / work / temp path;
- in-repo paths: a path under one of the repository's top-level folders (muon_ref/, muon_dist/, tests/,
  proofs/, notebooks/, benchmarks/, docs/) and every relative Markdown link target must exist;
- phrases that place a figure on an unnamed machine or session.
The negative controls feed planted text to the same checker.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("muon_ref", "muon_dist", "muon_check", "tests", "proofs", "notebooks", "benchmarks", "docs")
TEXT = (".py", ".md", ".toml", ".ipynb", ".cff", ".txt", ".json", ".cfg", ".yml", ".yaml")
SIBLING = "../" + "shared"  # written in two pieces so that this file does not cite it
OUTSIDE = re.compile(r"(?:\.\./)+(?:shared|peers)\b|(?<![\w.])/(?:work|home|root|tmp|Users)/[\w.-]")
THIS = "this"  # the phrases are assembled, so that this file itself does not contain them
PHRASES = re.compile(
    rf"\b(?:{THIS} (?:machine|CPU|session)|an earlier (?:run|session)|the last{' '}session)\b"
)
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:" + "|".join(TOP) + r")/[\w./-]*\w\.(?:py|md|ipynb|toml|json))(?:#[\w-]+)?"
)
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"/[A-Z][A-Z_]*\.")


def tracked_files() -> list[Path]:
    try:
        names = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        names = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and ".git" not in p.parts
        ]
    return [ROOT / n for n in names if n.endswith(TEXT) and (ROOT / n).is_file()]


def problems(relative: str, text: str, exists=lambda p: (ROOT / p).exists()) -> list[str]:
    """Every violation of the module docstring's rules in one file's text, as 'file:line: what'."""
    found = []
    here = Path(relative).parent
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{relative}:{number}"
        if OUTSIDE.search(line):
            found.append(f"{where}: cites a path outside the repository: {line.strip()[:120]}")
        if PHRASES.search(line):
            found.append(f"{where}: names no machine: {PHRASES.search(line).group(0)!r}")
        for match in REPO_PATH.finditer(line):
            if PLACEHOLDER.search(
                match.group(1)
            ):  # tests/mutation/TARGET.toml: a pattern, not a file
                continue
            if not exists(match.group(1)):
                found.append(f"{where}: cites {match.group(1)}, which does not exist")
        if relative.endswith(".md"):
            for target in MD_LINK.findall(line):
                path = target.split("#")[0]
                if not path or "://" in target or target.startswith(("mailto:", "#")):
                    continue
                resolved = (here / path).as_posix()
                if not exists(resolved):
                    found.append(f"{where}: links {target}, which does not exist")
    return found


def test_no_tracked_file_cites_outside_paths_missing_paths_or_an_unnamed_machine():
    files = tracked_files()
    assert len(files) > 50, f"scanned only {len(files)} files: the scan is broken"
    found = []
    for path in files:
        if path.resolve() == Path(__file__).resolve():
            continue
        relative = path.relative_to(ROOT).as_posix()
        found += [
            p
            for p in problems(relative, path.read_text(errors="replace"))
            # tests/peers/ drives peers' own suites: its tests/... paths are files of their checkouts
            if not (relative.startswith("tests/peers/") and "which does not exist" in p)
        ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "planted",
    [
        f"facts from {SIBLING}/reference/gpu.md",
        "the checkout in /" + "work/peers/dion",
        "see /home/alice/muon/notes.md",
        f"measured on {THIS} machine in 3 s",
        f"as {THIS} CPU rounds it",
        "see muon_dist/no_such_module.py for the rule",
        "[the guide](no-such-page.md)",
    ],
)
def test_negative_control_each_kind_of_violation_is_caught(planted):
    assert problems("docs/page.md", f"a line\n{planted}\n"), planted


def test_negative_control_clean_text_passes():
    text = (
        "see muon_ref/config.py and [design](design.md), https://github.com/pytorch/pytorch (a/b/c)"
    )
    assert problems("docs/page.md", text) == []
