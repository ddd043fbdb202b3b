"""`python -m benchmarks one-rank` (benchmarks/one_rank.py): one rank's step beside torch.optim.Muon's, contract by
contract. The contract of the command: every method computes torch.optim.Muon's bits, and the table says so per
method; a method whose params differ is printed DIFFERS and the command exits 1. Each run is a child process: the
command makes a gloo group of one, which the test process must not keep."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ["--sets", "tiny_dense", "--warmup", "1", "--steps", "3"]


def _one_rank(prelude: str = "") -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        "import benchmarks.one_rank as one_rank\n"
        f"{prelude}\n"
        f"sys.exit(one_rank.main({COMMAND!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240
    )


def _rows(stdout: str) -> dict[str, str]:
    methods = ("torch_muon", "held", "checked", "recomputed", "distributed")
    return {
        line.split()[0]: line.split()[-1]
        for line in stdout.splitlines()
        if line.startswith(methods)
    }


def test_every_method_computes_torch_muons_bits_and_the_table_says_so() -> None:
    """Each method's row ends with "bitwise" (its params after the run equal torch.optim.Muon's bit for bit), and
    the command exits 0."""
    child = _one_rank()
    assert child.returncode == 0, child.stdout + child.stderr
    rows = _rows(child.stdout)
    assert rows == dict.fromkeys(rows, "bitwise") and len(rows) == 5, child.stdout


def test_a_method_that_departs_is_printed_differs_and_fails_the_command() -> None:
    """Negative control: a staged order that never writes its new buffer (momentum stays zero) departs from the
    second step on; its row says DIFFERS and the command exits 1, while the others stay bitwise."""
    planted = (
        "def forgetful(self, grads, step=one_rank.Staged.step):\n"
        "    saved = [b.clone() for b in self.bufs]\n"
        "    step(self, grads)\n"
        "    if not self.check:\n"
        "        for b, s in zip(self.bufs, saved):\n"
        "            b.copy_(s)\n"
        "one_rank.Staged.step = forgetful"
    )
    child = _one_rank(planted)
    assert child.returncode == 1, child.stdout + child.stderr
    rows = _rows(child.stdout)
    assert rows.pop("held") == "DIFFERS", child.stdout
    assert set(rows.values()) == {"bitwise"}, child.stdout
