"""Every GPU check of docs/gpu.md in one run on one node, each command's output and result kept in a folder
(`make gpu-report`).

    PYTHONPATH=. python3 tests/gpu/run_all.py [--out gpu-report] [--parts env tests conformance planted bench]
                                             [--dion PATH] [--timeout S] [--jobs N] [--serial]

Each part runs its commands as subprocesses from the repository root (PYTHONPATH set to it, Python unbuffered),
their stdout and stderr in OUT/PART.log, each command under its own wall-clock limit (--timeout, default 900 s):
  env          nvidia-smi; the Python, torch (and its CUDA), triton and numpy versions and the GPU's name; the date
               (UTC); the commit, where the checkout has its git folder
  tests        python -m pytest -m gpu -v --durations=25 [-n N]: the GPU suite, with verify --device cuda at
               W = 1, 2, 3, 4, 8 and DistributedMuon's conformance on CUDA among its tests (their JSON reports are
               copied to OUT/tests_NAME.json); -n N (pytest-xdist's workers, --jobs) where xdist is importable;
               each failure's report is appended to OUT/tests_failures.log as it happens (tests/failure_log.py), so a
               run cut short still says what failed and why
  conformance  python -m muon_check --all --device cuda, as one command per shipped adapter (--adapter
               muon_check.adapters.shipped:CLASS --json OUT/conformance_NAME.json, its log conformance_NAME.log),
               a quarter of the cores' number of them at once: --all runs the adapters one after the other
  planted      python -m muon_check --planted --device cuda --verbose --json OUT/planted.json (each case's line)
  bench        python -m benchmarks gpu [--dion PATH] --json OUT/bench.json
In three phases: env; then tests, conformance and planted side by side (correctness only: they share the GPU and
the node's cores); then bench alone, so that nothing else runs on the GPU while it times (--serial: every part in
turn). OUT/summary.md has one row per command (the part, the command, its exit status or "timed out", its wall
seconds, its last line of output), rewritten after each command, so a run stopped midway keeps what it finished.
A part whose commands cannot be listed (the conformance part imports muon_check to name the shipped adapters) gets
one row, "not listed", with the error, and the other parts still run. The script puts the repository root on
sys.path itself, so `python3 tests/gpu/run_all.py` needs no PYTHONPATH for that.
Exit status: 0 when every command exited 0, 1 otherwise, 2 for a usage error or when torch sees no CUDA device
(nothing runs then).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if (
    str(ROOT) not in sys.path
):  # run as a script: sys.path[0] is tests/gpu; the conformance part imports muon_check
    sys.path.insert(0, str(ROOT))
PARTS = ("env", "tests", "conformance", "planted", "bench")
# run in turn; the parts of a phase side by side (module docstring)
PHASES = (("env",), ("tests", "conformance", "planted"), ("bench",))
# parts whose commands run side by side, each with its own log (OUT/STEM.log, STEM its --json file's)
SIDE_BY_SIDE = ("conformance",)
# tests/failure_log.py appends each failed test's report to the file this variable names
FAILURES_ENV = "MUON_TEST_FAILURES"
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


def default_jobs() -> int:
    """pytest-xdist workers for the tests part: half the node's cores, at most 6 (the GPU suite's long tests spawn
    up to 8 ranks each), 1 where xdist is not importable."""
    if importlib.util.find_spec("xdist") is None:
        return 1
    return max(1, min(6, (os.cpu_count() or 2) // 2))


def commands(part: str, out: Path, dion: str | None, jobs: int = 1) -> list[list[str]]:
    """The argv of every command of `part`, in order."""
    py = [sys.executable]
    if part == "env":
        commit = [["git", "-C", str(ROOT), "rev-parse", "HEAD"]] if (ROOT / ".git").exists() else []
        return [["nvidia-smi"], [*py, "-c", VERSIONS], *commit]
    if part == "tests":
        basetemp = str(out / "tests_tmp")
        workers = ["-n", str(jobs)] if jobs > 1 else []
        return [
            [
                *py,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-v",
                "--durations=25",
                *workers,
                "--basetemp",
                basetemp,
            ]
        ]
    harness = [*py, "-m", "muon_check.conformance"]
    # conformance: --all as one command per shipped adapter (run side by side: SIDE_BY_SIDE)
    if part == "conformance":
        from muon_check.adapters.shipped import SHIPPED

        return [
            [
                *harness,
                "--adapter",
                f"muon_check.adapters.shipped:{cls.__name__}",
                "--device",
                "cuda",
            ]
            + ["--json", str(out / f"conformance_{name}.json")]
            for name, cls in SHIPPED.items()
        ]
    if part == "planted":
        return [
            [
                *harness,
                "--planted",
                "--verbose",
                "--device",
                "cuda",
                "--json",
                str(out / "planted.json"),
            ]
        ]
    if part == "bench":
        return [
            [*py, "-m", "benchmarks", "gpu", *(["--dion", dion] if dion else [])]
            + ["--json", str(out / "bench.json")]
        ]
    raise ValueError(f"part must be one of {PARTS}, got {part!r}")


def side_by_side_width() -> int:
    """How many commands of a side-by-side part run at once: a quarter of the node's cores (each conformance
    command starts up to 4 ranks), at least 2."""
    return max(2, (os.cpu_count() or 2) // 4)


def log_path(out: Path, part: str, argv: list[str]) -> Path:
    """OUT/PART.log; a side-by-side part's command logs to OUT/STEM.log, STEM its --json file's."""
    if part in SIDE_BY_SIDE and "--json" in argv:
        return out / (Path(argv[argv.index("--json") + 1]).stem + ".log")
    return out / f"{part}.log"


def run(argv: list[str], log: Path, timeout: float, extra_env: dict | None = None) -> dict:
    """Run argv from the repository root with its output appended to `log`; its row of the summary."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
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
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="pytest-xdist workers of the tests part (default: half the cores, at most 6; 1 without xdist)",
    )
    parser.add_argument(
        "--serial", action="store_true", help="every part in turn, none side by side"
    )
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
    jobs = default_jobs() if args.jobs is None else args.jobs
    rows: list[tuple[str, dict]] = []
    lock = threading.Lock()

    def run_part(part: str) -> None:
        extra = {}
        if part == "tests":
            failures = args.out.resolve() / "tests_failures.log"
            failures.unlink(missing_ok=True)
            extra[FAILURES_ENV] = str(failures)

        def record(row: dict) -> None:
            with lock:
                rows.append((part, row))
                print(f"{part}: {row['status']} in {row['wall_s']} s: {row['last']}", flush=True)
                write_summary(rows, args.out / "summary.md")

        try:
            argvs = commands(part, args.out.resolve(), args.dion, jobs)
        except Exception as e:  # a failed row; the other parts still run
            error = f"{type(e).__name__}: {e}"
            record(
                {
                    "command": f"(the {part} part's commands)",
                    "status": "not listed",
                    "wall_s": 0.0,
                    "last": error,
                }
            )
            return
        logs = [log_path(args.out, part, argv) for argv in argvs]
        for log in set(logs):
            log.unlink(missing_ok=True)

        def one(i: int) -> None:
            record(run(argvs[i], logs[i], args.timeout, extra))

        side_by_side = part in SIDE_BY_SIDE and not args.serial
        with ThreadPoolExecutor(max_workers=side_by_side_width() if side_by_side else 1) as pool:
            list(pool.map(one, range(len(argvs))))
        if part == "tests":
            for report in keep_reports(args.out):
                print(f"tests: kept {report.name}", flush=True)

    phases: list[list[str]] = []
    for phase in PHASES:
        chosen = [p for p in args.parts if p in phase]
        phases += [[p] for p in chosen] if args.serial else [chosen] if chosen else []
    for chosen in phases:
        with ThreadPoolExecutor(max_workers=len(chosen)) as pool:
            list(pool.map(run_part, chosen))  # re-raises a part's own error
    return 0 if all(r["status"] == "0" for _, r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
