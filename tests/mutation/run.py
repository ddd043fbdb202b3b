"""Mutation testing of the project's own tests with cosmic-ray (`make mutation`; docs/mutation.md).

    python tests/mutation/run.py [TARGET ...]        default: the targets in DEFAULT_TARGETS

A target is tests/mutation/TARGET.toml, a plain cosmic-ray config: the modules it mutates (module-path), the tests
that can kill their mutants (test-command) and its sample ([cosmic-ray.filters.sample]). For each target, in a
fresh copy of the working tree under .mutation/ (cosmic-ray writes each mutant into the module file itself, so the
checkout is never touched), the tool's own commands run in this order:
    cosmic-ray init            every mutant of the modules (paths that do not exist yet are left out, and named)
    cr-filter-operators        skips the operators the config excludes (`|` in annotations: see the configs)
    tests/mutation/sample.py   skips all but a seeded sample of each module's mutants
    cosmic-ray baseline        the selected tests pass on the unmutated copy, or the target stops here
    cosmic-ray exec            one mutant at a time, the target's tests on each
and one line per module: killed / tested. Each survivor's diff goes to .mutation/TARGET.survivors.txt; the session
stays in .mutation/TARGET.sqlite for cr-report and cr-html.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from cosmic_ray.config import load_config, serialize_config
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WORK = ROOT / ".mutation"
# every target: muon_ref's core, muon_dist's, then the check's decisions (docs/mutation.md: about an hour on 2 cores)
DEFAULT_TARGETS = (
    "ref_functional",
    "ref_config",
    "ref_newton_schulz",
    "dist_paths",
    "dist_plan",
    "dist_step",
    "dist_elementwise",
    "dist_layout",
    "dist_comm",
    "check_decisions",
)


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored) copied to dest."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    shutil.rmtree(dest, ignore_errors=True)
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def present_config(target: str, tree: Path) -> tuple[Path, list[str]]:
    """The target's config with the module paths that exist in tree, written beside the session; and the missing."""
    cfg = load_config(str(HERE / f"{target}.toml"))
    paths = (
        [cfg["module-path"]] if isinstance(cfg["module-path"], str) else list(cfg["module-path"])
    )
    cfg["module-path"] = [p for p in paths if (tree / p).exists()]
    (WORK / f"{target}.toml").write_text(serialize_config(cfg))
    return WORK / f"{target}.toml", [p for p in paths if not (tree / p).exists()]


def cosmic_ray(*args: str, tree: Path, env: dict[str, str]) -> None:
    subprocess.run(list(args), cwd=tree, env=env, check=True)


def check_imports_copy(tree: Path, env: dict[str, str]) -> None:
    """The packages that the tests import, in the environment of their command, are the copy's (where the mutants
    are written), never the checkout's that an editable install points at."""
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "import muon_dist, muon_ref; print(muon_dist.__file__); print(muon_ref.__file__)",
        ],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    for path in found.stdout.split():
        if not Path(path).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(
                f"the tests would import {path}, not the copy under {tree}: mutants would not reach them"
            )


def summarize(session: Path) -> tuple[list[str], list[str]]:
    """One line per module (killed / tested, sampled of available) and each survivor with its diff."""
    counts: dict[str, Counter] = defaultdict(Counter)
    survivors = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            (m,) = item.mutations
            c = counts[str(m.module_path)]
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                c["annotation" if result.output == "Filtered operator" else "unsampled"] += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                c["survived"] += 1
                survivors.append(
                    f"{m.module_path}:{m.start_pos[0]} {m.operator_name} #{m.occurrence}\n{result.diff}"
                )
            elif result.test_outcome == TestOutcome.KILLED:
                c["killed"] += 1
                out = result.output or ""
                c["timeout"] += out == "timeout"
                c["at import"] += (
                    "ERROR collecting" in out or "ImportError while loading conftest" in out
                )
            else:
                c["incompetent"] += 1
    lines = []
    for module, c in sorted(counts.items()):
        tested = c["killed"] + c["survived"] + c["incompetent"]
        lines.append(
            f"{module}: {c['killed']}/{tested} killed ({100 * c['killed'] / max(tested, 1):.1f}%), "
            f"{c['survived']} survived, {c['incompetent']} incompetent; of the killed {c['at import']} at "
            f"import, {c['timeout']} by timeout; sample {tested} of {tested + c['unsampled']} mutants "
            f"({c['annotation']} in annotations skipped)"
        )
    return lines, survivors


def run_target(target: str, env: dict[str, str]) -> list[str]:
    start, load = time.monotonic(), f"{os.getloadavg()[0]:.1f}"
    tree = WORK / "tree"
    copy_tree(tree)
    config, missing = present_config(target, tree)
    if missing:
        print(f"[{target}] not present yet, left out: {', '.join(missing)}", flush=True)
    check_imports_copy(tree, env)
    session = WORK / f"{target}.sqlite"
    session.unlink(missing_ok=True)
    cosmic_ray("cosmic-ray", "init", str(config), str(session), tree=tree, env=env)
    cosmic_ray("cr-filter-operators", str(session), str(config), tree=tree, env=env)
    cosmic_ray(
        sys.executable, str(HERE / "sample.py"), str(session), str(config), tree=tree, env=env
    )
    cosmic_ray("cosmic-ray", "baseline", str(config), tree=tree, env=env)
    cosmic_ray("cosmic-ray", "exec", str(config), str(session), tree=tree, env=env)
    lines, survivors = summarize(session)
    (WORK / f"{target}.survivors.txt").write_text("\n".join(survivors))
    wall = (
        f"[{target}] wall time {time.monotonic() - start:.0f} s, load average {load} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end; survivors in .mutation/{target}.survivors.txt"
    )
    return [f"[{target}] {line}" for line in lines] + [wall]


def main(targets: list[str]) -> int:
    unknown = [t for t in targets if not (HERE / f"{t}.toml").exists()]
    if unknown:
        known = sorted(p.stem for p in HERE.glob("*.toml"))
        raise SystemExit(f"unknown mutation targets {unknown}; known: {known}")
    WORK.mkdir(exist_ok=True)
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        HYPOTHESIS_PROFILE="mutation",
        PYTHONPATH=str(WORK / "tree"),
    )
    start = time.monotonic()
    for target in targets:
        print("\n".join(run_target(target, env)), flush=True)
    print(f"all targets: wall time {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(DEFAULT_TARGETS)))
