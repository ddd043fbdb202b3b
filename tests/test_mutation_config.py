"""The mutation targets (tests/mutation/*.toml, docs/mutation.md) stay runnable as the code moves: `make
mutation` runs every one, each mutates modules that exist, and names test files that exist. Read without cosmic-ray
(the `mutation` extra is not a dev dependency)."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib (Python 3.11+) reads the configs")

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "tests" / "mutation"
CONFIGS = sorted(HERE.glob("*.toml"))


def default_targets() -> tuple[str, ...]:
    tree = ast.parse((HERE / "run.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [
            t.id for t in node.targets if isinstance(t, ast.Name)
        ] == ["DEFAULT_TARGETS"]:
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("tests/mutation/run.py has no DEFAULT_TARGETS")


def test_make_mutation_runs_every_target() -> None:
    assert CONFIGS and sorted(default_targets()) == sorted(c.stem for c in CONFIGS)


def named_test_files(command: str) -> list[str]:
    """The test files of a test-command (its stages may sit inside `sh -c '...'`)."""
    words = shlex.split(command)
    inner = [w for w in words if "pytest" in w and " " in w]  # the sh -c script
    for script in inner:
        words += shlex.split(script.replace("&&", " "))
    return sorted({w.split("::")[0] for w in words if re.fullmatch(r"tests/\S+\.py(::\S+)?", w)})


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_each_target_mutates_modules_that_exist_and_runs_tests_that_exist(config: Path) -> None:
    cfg = tomllib.loads(config.read_text())["cosmic-ray"]
    paths = [cfg["module-path"]] if isinstance(cfg["module-path"], str) else cfg["module-path"]
    assert paths and all((ROOT / p).exists() for p in paths), paths
    files = named_test_files(cfg["test-command"])
    assert files and all((ROOT / f).is_file() for f in files), files
    assert cfg["filters"]["sample"]["per-module"] >= 1 and cfg["timeout"] > 0


def test_the_command_parser_finds_files_inside_sh_c_and_would_catch_a_missing_one() -> None:
    """Negative control for the check above: a stage naming a file that does not exist is reported."""
    missing = (
        "tests/" + "nope.py"
    )  # built, so that the repository's path check does not read it as a citation
    command = f"prlimit --as=1 sh -c 'python -m pytest -x tests/test_geometry.py && python -m pytest {missing} -k \"a b\"'"
    files = named_test_files(command)
    assert files == [missing, "tests/test_geometry.py"]
    assert not all((ROOT / f).is_file() for f in files)
