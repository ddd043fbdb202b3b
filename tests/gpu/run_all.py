"""Every GPU check of docs/gpu.md in one run on one node, each command's output and result kept in a folder
(`make gpu-report`).

    PYTHONPATH=. python3 tests/gpu/run_all.py [--out gpu-report] [--parts env tests conformance planted bench]
                                             [--dion PATH] [--timeout S]

Each part runs its commands as subprocesses from the repository root (PYTHONPATH set to it, Python unbuffered),
their stdout and stderr in OUT/PART.log, each command under its own wall-clock limit (--timeout, default 900 s):
  env          nvidia-smi; the Python, torch (and its CUDA), triton and numpy versions and the GPU's name; the date
               (UTC); the commit, where the checkout has its git folder
  tests        python -m pytest -m gpu -q --durations=25: the GPU suite, with verify --device cuda at W = 1-4 and
               DistributedMuon's conformance on CUDA among its tests (their JSON reports are copied to
               OUT/tests_NAME.json)
  conformance  python -m muon_check --all --device cuda --json OUT/conformance.json
  planted      python -m muon_check --planted --device cuda --json OUT/planted.json
  bench        python -m benchmarks gpu [--dion PATH] --json OUT/bench.json
OUT/summary.md has one row per command (the part, the command, its exit status or "timed out", its wall seconds,
its last line of output), rewritten after each command, so a run stopped midway keeps what it finished. Exit
status: 0 when every command exited 0, 1 otherwise, 2 for a usage error or when torch sees no CUDA device (nothing
runs then).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("env", "tests", "conformance", "planted", "bench")
VERSIONS = (
    "import datetime, platform, torch\n"
    "print('date (UTC):', datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M'))\n"
    "print('python:', platform.python_version())\n"
    "print('torch:', torch.__version__, 'CUDA', torch.version.cuda, 'git', torch.version.git_version)\n"
    "print('gpu:', torch.cuda.get_device_name() if torch.cuda.is_available() else None)\n"
    "for name in ('triton', 'numpy', 'hypothesis'):\n"
    "    try:\n"
    "        print(name + ':', __import__(name).__version__)\n"
    "    except ImportError as e:\n"
    "        print(name + ':', 'not importable:', e)\n"
)


def commands(part: str, out: Path, dion: str | None) -> list[list[str]]:
    """The argv of every command of `part`, in order."""
    py = [sys.executable]
    if part == "env":
        commit = [["git", "-C", str(ROOT), "rev-parse", "HEAD"]] if (ROOT / ".git").exists() else []
        return [["nvidia-smi"], [*py, "-c", VERSIONS], *commit]
    if part == "tests":
        basetemp = str(out / "tests_tmp")
        return [[*py, "-m", "pytest", "-m", "gpu", "-q", "--durations=25", "--basetemp", basetemp]]
    if part in ("conformance", "planted"):
        chosen = "--all" if part == "conformance" else "--planted"
        harness = [*py, "-m", "muon_check.conformance"]
        return [[*harness, chosen, "--device", "cuda", "--json", str(out / f"{part}.json")]]
    if part == "bench":
        return [
            [*py, "-m", "benchmarks", "gpu", *(["--dion", dion] if dion else [])]
            + ["--json", str(out / "bench.json")]
        ]
    raise ValueError(f"part must be one of {PARTS}, got {part!r}")


def run(argv: list[str], log: Path, timeout: float) -> dict:
    """Run argv from the repository root with its output appended to `log`; its row of the summary."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    started = time.monotonic()
    with log.open("a") as f:
        f.write(f"$ {shlex.join(argv)}\n")
        f.flush()
        try:
            status = str(
                subprocess.run(
                    argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
                ).returncode
            )
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:g} s"
        except OSError as e:
            status = f"could not start: {e.strerror}"
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return {
        "command": shlex.join(argv),
        "status": status,
        "wall_s": round(time.monotonic() - started, 1),
        "last": lines[-1] if lines else "",
    }


def keep_reports(out: Path) -> list[Path]:
    """The JSON reports the tests wrote under their temporary folders, copied to OUT/tests_NAME.json; the
    temporary folders (checkpoints among them) removed."""
    tmp = out / "tests_tmp"
    kept = []
    for report in sorted(tmp.rglob("*.json")) if tmp.exists() else []:
        kept.append(out / f"tests_{report.name}")
        shutil.copyfile(report, kept[-1])
    shutil.rmtree(tmp, ignore_errors=True)
    return kept


def write_summary(rows: list[tuple[str, dict]], path: Path) -> None:
    """OUT/summary.md: a markdown table, one row per command run so far."""
    head = ["| part | command | status | wall s | last line of output |", "|---|---|---|---|---|"]
    body = [
        f"| {part} | `{r['command'].replace(chr(10), ' ')}` | {r['status']} | {r['wall_s']} | "
        f"{r['last'].replace('|', '/')[:160]} |"
        for part, r in rows
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(head + body) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tests/gpu/run_all.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-report")
    parser.add_argument(
        "--parts", nargs="+", default=list(PARTS), help=f"default: {' '.join(PARTS)}"
    )
    parser.add_argument("--dion", help="a microsoft/dion checkout, for the bench part's Dion rows")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per command")
    args = parser.parse_args(argv)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        print(
            f"error: --parts {' '.join(unknown)} unknown; valid: {', '.join(PARTS)}",
            file=sys.stderr,
        )
        return 2
    import torch

    if not torch.cuda.is_available():
        print(
            f"error: no CUDA device is available (torch {torch.__version__}): the GPU checks need one",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, dict]] = []
    for part in args.parts:
        log = args.out / f"{part}.log"
        log.unlink(missing_ok=True)
        for command in commands(part, args.out.resolve(), args.dion):
            row = run(command, log, args.timeout)
            rows.append((part, row))
            print(f"{part}: {row['status']} in {row['wall_s']} s: {row['last']}")
            write_summary(rows, args.out / "summary.md")
        if part == "tests":
            for report in keep_reports(args.out):
                print(f"tests: kept {report.name}")
    return 0 if all(r["status"] == "0" for _, r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
