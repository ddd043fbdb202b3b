"""The wheel stands alone: built from the checkout (`pip wheel .`), installed into a bare venv that holds only what
the wheel declares (its core requirements and theirs, taken from the running environment, nothing else), its two
commands run from a directory outside the checkout. Contracts: every distribution the installed commands import is
declared (numpy included: torch.distributed's object collectives need it and torch does not declare it); both
commands pass there; and a rank that dies makes `muon-verify` fail at once, never wait out its timeout (shown with
numpy left out of the venv: the resume run's checkpoint raises "Numpy is not available" on one rank while the
other waits in a broadcast)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _core_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist lines that hold without any extra."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(name).decode().splitlines()
    reqs = [
        Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")
    ]
    env = {**default_environment(), "extra": ""}
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def _closure(requirements: list[Requirement]) -> dict[str, metadata.Distribution]:
    """The running environment's distributions the requirements reach, transitively (no extras)."""
    env = {**default_environment(), "extra": ""}
    found: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        req = todo.pop()
        key = req.name.lower().replace("_", "-")
        if key in found:
            continue
        dist = metadata.distribution(req.name)
        found[key] = dist
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate(env):
                todo.append(sub)
    return found


def _link(dists: dict[str, metadata.Distribution], into: Path) -> None:
    """Symlink each distribution's top-level files and folders and its .dist-info into `into`."""
    into.mkdir()
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            target = into / top
            if not target.exists() and (base / top).exists():
                target.symlink_to(base / top)


def _clean_env() -> dict[str, str]:
    """The environment a user's shell gives the bare venv: no PYTHONPATH or other PYTHON* variables (a test run
    may have set one to the checkout, which would import it instead of the wheel)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


def _run(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_clean_env()
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The wheel, a bare venv with it and its declared closure linked in, and a directory outside the checkout."""
    top = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(top), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = top.glob("*.whl")
    env_dir = top / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
        env=_clean_env(),
    ).stdout.strip()
    # ensurepip's own setuptools would shadow the declared closure's (torch requires a newer one)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-q", "-y", "setuptools"],
        capture_output=True,
        timeout=120,
        env=_clean_env(),
    )
    linked = top / "linked"
    _link(_closure(_core_requirements(wheel)), linked)
    (Path(site) / "declared.pth").write_text(str(linked) + "\n")
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_clean_env(),
    )
    assert installed.returncode == 0, installed.stderr
    elsewhere = top / "elsewhere"
    elsewhere.mkdir()
    return {"wheel": wheel, "bin": env_dir / "bin", "linked": linked, "cwd": elsewhere}


def test_the_wheel_declares_numpy_and_its_requirements_are_met_in_the_bare_venv(bare) -> None:
    """numpy is a core requirement, and `pip check` in the bare venv (only the declared closure present) finds every
    requirement met."""
    names = {r.name.lower() for r in _core_requirements(bare["wheel"])}
    assert {"torch", "numpy"} <= names, names
    code, out, _ = _run([str(bare["bin"] / "pip"), "check"], bare["cwd"], 120)
    assert code == 0, out


@pytest.mark.timeout(600)
def test_both_installed_commands_pass_outside_the_checkout(bare) -> None:
    """`muon-conformance` (torch.optim.Muon against its preset on one family) and `muon-verify --world-sizes 2`
    (every path, the resume run included) exit 0 from a directory outside the checkout, importing the installed
    wheel, not the checkout."""
    code, out, _ = _run(
        [
            str(bare["bin"] / "muon-conformance"),
            "--adapter",
            "muon_check.adapters.shipped:TorchMuon",
            "--families",
            "tall",
            "--steps",
            "1",
        ],
        bare["cwd"],
        300,
    )
    assert code == 0, out
    code, out, _ = _run(
        [
            str(bare["bin"] / "muon-verify"),
            "--world-sizes",
            "2",
            "--presets",
            "torch",
            "--steps",
            "2",
        ],
        bare["cwd"],
        500,
    )
    assert code == 0, out
    assert "contract violations: 0" in out, out
    code, where, _ = _run(
        [str(bare["bin"] / "python"), "-c", "import muon_check; print(muon_check.__file__)"],
        bare["cwd"],
        60,
    )
    assert code == 0, where
    assert str(ROOT) not in where, where


@pytest.mark.timeout(600)
def test_a_rank_that_dies_fails_muon_verify_at_once(bare) -> None:
    """With numpy's links taken out of the bare venv, the resume run raises on one rank ("Numpy is not available")
    while the other waits in a broadcast: muon-verify reports the error and that rank as blocked with it, and
    exits non-zero well before its 120 s timeout."""
    hidden = [p for p in bare["linked"].iterdir() if p.name.lower().startswith("numpy")]
    assert hidden, "numpy is not in the declared closure"
    moved = bare["linked"].parent / "hidden"
    moved.mkdir(exist_ok=True)
    for p in hidden:
        os.rename(p, moved / p.name)
    try:
        code, out, seconds = _run(
            [str(bare["bin"] / "muon-verify"), "--world-sizes", "2", "--presets", "torch"],
            bare["cwd"],
            500,
        )
    finally:
        for p in hidden:
            os.rename(moved / p.name, p)
    assert code != 0, out
    assert "Numpy is not available" in out, out
    assert "of rank 0's error (blocked with it)" in out or "of rank 1's error" in out, out
    assert seconds < 100, seconds
