"""Runs peers' own Muon test suites against the repo, from checkouts given on the command line.

    python -m tests.peers.run_peer_suites --emerging PATH [--python PY] [--nproc N]
                                          [--xtuner PATH] [--dion PATH]

NVIDIA Emerging-Optimizers (https://github.com/NVIDIA-NeMo/Emerging-Optimizers): its Newton-Schulz
tests (tests/test_muon_utils.py), its Muon optimizer tests (tests/test_orthogonalized_optimizer.py)
and its CPU tensor-parallel tests (tests/test_distributed_muon_utils_cpu.py, under torchrun with N
ranks, as its CI runs them) run as shipped, with its `newton_schulz` served by muon_ref where
muon_ref expresses the call (tests/peers/emerging_run.py); each file's absltest verdict and the
count of calls the repo served are printed. The peer needs Python 3.12 (PEP 695 syntax): pass an
interpreter with torch, absl-py and numpy as --python.

InternLM xtuner (https://github.com/InternLM/xtuner) and microsoft/dion
(https://github.com/microsoft/dion): their Muon tests need CUDA (xtuner: a CUDA process group in
every test case; Dion: `skipif(not CUDA_AVAILABLE)` on every Muon step test) and are reported, not
run, on a machine without CUDA.

Nothing here runs in `make test`: pytest does not collect this file, and it needs the checkouts.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("emerging_run.py")
EMERGING_FILES = ("tests/test_muon_utils.py", "tests/test_orthogonalized_optimizer.py")
EMERGING_DISTRIBUTED = "tests/test_distributed_muon_utils_cpu.py"


def run(command: list[str], checkout: Path, timeout_s: float) -> tuple[str, str]:
    """(verdict, counts) of one absltest program: its last 'Ran'/'OK'/'FAILED' lines and the served
    counts (the first rank's, under torchrun)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(checkout), str(checkout / "tests")]),
        "TORCH_COMPILE_DISABLE": "1",
    }
    try:
        done = subprocess.run(
            command, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s", ""
    out = done.stdout + done.stderr
    ran = re.findall(r"^Ran \d+ tests? in [\d.]+s", out, re.M)
    verdict = re.findall(r"^(OK.*|FAILED.*)$", out, re.M)
    served = re.findall(r"^newton_schulz calls served by muon_ref.*$", out, re.M)
    if not ran:
        return f"did not run (exit {done.returncode}): {out.strip().splitlines()[-1:]}", ""
    return f"{ran[0]}: {verdict[0] if verdict else 'exit ' + str(done.returncode)}", served[
        0
    ] if served else ""


def emerging(checkout: Path, python: str, nproc: int, timeout_s: float) -> None:
    for name in EMERGING_FILES:
        verdict, served = run([python, str(RUNNER), name, "--device=cpu"], checkout, timeout_s)
        print(f"emerging {name}: {verdict}; {served}")
    command = [
        python,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        str(RUNNER),
        EMERGING_DISTRIBUTED,
    ]
    verdict, served = run(command, checkout, timeout_s)
    print(f"emerging {EMERGING_DISTRIBUTED} (torchrun, {nproc} ranks): {verdict}; rank 0: {served}")


def needs_cuda(name: str, checkout: Path, files: tuple[str, ...], python: str) -> None:
    has_cuda = (
        subprocess.run(
            [python, "-c", "import torch; print(torch.cuda.is_available())"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        == "True"
    )
    present = [f for f in files if (checkout / f).exists()]
    state = "CUDA is available: not adapted yet" if has_cuda else "no CUDA here: not run"
    print(f"{name} {', '.join(present)}: its Muon tests need CUDA; {state}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emerging", type=Path, help="checkout of NVIDIA-NeMo/Emerging-Optimizers")
    parser.add_argument("--xtuner", type=Path, help="checkout of InternLM/xtuner")
    parser.add_argument("--dion", type=Path, help="checkout of microsoft/dion")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the peers' tests")
    parser.add_argument("--nproc", type=int, default=4, help="ranks of the torchrun CPU tests")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test program")
    args = parser.parse_args(argv)
    if not (args.emerging or args.xtuner or args.dion):
        parser.error("give at least one checkout (--emerging, --xtuner, --dion)")
    if args.emerging:
        emerging(args.emerging.resolve(), args.python, args.nproc, args.timeout)
    if args.xtuner:
        needs_cuda("xtuner", args.xtuner, ("tests/optim/test_muon.py",), args.python)
    if args.dion:
        needs_cuda(
            "dion",
            args.dion,
            ("tests/test_optimizers.py", "tests/test_state_prepopulation.py"),
            args.python,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
