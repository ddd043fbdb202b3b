"""tests/gpu/run_all.py (`make gpu-report`) without a GPU: every command it would run parses under its own parser,
a command's status, wall time and last line reach the summary (a failure, a timeout and a missing program included),
the tests' JSON reports are kept, and a machine without CUDA is refused in one line before anything runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu as bench_gpu
from muon_check import conformance

RUN_ALL = Path(__file__).resolve().parent / "gpu" / "run_all.py"


@pytest.fixture(scope="module")
def run_all():
    spec = importlib.util.spec_from_file_location("gpu_run_all", RUN_ALL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_harness_and_benchmark_command_parses_under_its_own_parser(run_all, tmp_path) -> None:
    """Every command the GPU report runs parses under the parser of the module it calls (the commands name flags of
    other modules: one renamed there must fail here, not on a GPU node)."""
    from muon_check.adapters import load_adapter
    from muon_check.adapters.shipped import SHIPPED

    conformance_argvs = run_all.commands("conformance", tmp_path, None)
    (planted_argv,) = run_all.commands("planted", tmp_path, None)
    (bench_argv,) = run_all.commands("bench", tmp_path, "/some/dion")
    for argv in (*conformance_argvs, planted_argv):
        args = conformance._parser().parse_args(argv[3:])
        assert args.device == "cuda" and args.json.startswith(str(tmp_path))
    # --all as one command per shipped adapter, each loading the class --all builds, each with its own report
    loaded = [
        type(load_adapter(conformance._parser().parse_args(a[3:]).adapter[0]))
        for a in conformance_argvs
    ]
    assert loaded == list(SHIPPED.values())
    logs = {run_all.log_path(tmp_path, "conformance", a) for a in conformance_argvs}
    assert len(logs) == len(SHIPPED) and tmp_path / "conformance_torch.log" in logs
    planted = conformance._parser().parse_args(planted_argv[3:])
    assert planted.planted and planted.verbose
    args = bench_gpu.parse_args(bench_argv[4:])
    assert args.dion == "/some/dion" and args.json == str(tmp_path / "bench.json")
    (tests_argv,) = run_all.commands("tests", tmp_path, None)
    assert tests_argv[1:6] == ["-m", "pytest", "-m", "gpu", "-v"] and "-n" not in tests_argv
    (tests_argv,) = run_all.commands("tests", tmp_path, None, jobs=4)
    assert tests_argv[tests_argv.index("-n") + 1] == "4"
    with pytest.raises(ValueError, match="part must be one of"):
        run_all.commands("notebooks", tmp_path, None)


def test_a_commands_status_wall_time_and_last_line_reach_the_summary(run_all, tmp_path) -> None:
    log = tmp_path / "part.log"
    ok = run_all.run([sys.executable, "-c", "print('first'); print('last one')"], log, 60)
    failed = run_all.run([sys.executable, "-c", "raise SystemExit(3)"], log, 60)
    slow = run_all.run([sys.executable, "-c", "import time; time.sleep(30)"], log, 0.5)
    missing = run_all.run(["no-such-program-here"], log, 60)
    assert (ok["status"], ok["last"]) == ("0", "last one")
    assert failed["status"] == "3"
    assert slow["status"] == "timed out after 0.5 s" and slow["wall_s"] < 20
    assert missing["status"].startswith("could not start")
    assert log.read_text().count("$ ") == 4  # each command's line, then its output, in one log
    run_all.write_summary([("env", ok), ("env", slow)], tmp_path / "summary.md")
    rows = (tmp_path / "summary.md").read_text().splitlines()
    assert len(rows) == 4 and "| env |" in rows[2] and "| 0 |" in rows[2]
    assert "timed out after 0.5 s" in rows[3]


def test_the_tests_json_reports_are_kept_and_their_temporary_folders_removed(
    run_all, tmp_path
) -> None:
    nested = tmp_path / "tests_tmp" / "test_every_path_on_gloo_ran0"
    nested.mkdir(parents=True)
    (nested / "verify_cuda.json").write_text("{}")
    (nested / "checkpoint.bin").write_bytes(b"\0")
    kept = run_all.keep_reports(tmp_path)
    assert kept == [tmp_path / "tests_verify_cuda.json"] and kept[0].read_text() == "{}"
    assert not (tmp_path / "tests_tmp").exists()


def test_a_run_writes_one_summary_row_per_command_and_fails_when_one_fails(
    run_all, tmp_path, monkeypatch, capsys
) -> None:
    """summary.md holds one row per command with its output's last line, each part's log is kept, and the exit
    code is 1 while a command fails, 0 once none does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake = {
        "env": [[sys.executable, "-c", "print('gpu: none')"]],
        "tests": [[sys.executable, "-c", "print('1 failed'); raise SystemExit(1)"]],
    }
    monkeypatch.setattr(run_all, "commands", lambda part, out, dion, jobs=1: fake[part])
    assert run_all.main(["--out", str(tmp_path), "--parts", "env", "tests"]) == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "| env |" in summary and "gpu: none" in summary and "1 failed" in summary
    assert (tmp_path / "env.log").exists() and (tmp_path / "tests.log").exists()
    assert "tests: 1 in" in capsys.readouterr().out
    fake["tests"] = [[sys.executable, "-c", "print('3 passed')"]]
    assert run_all.main(["--out", str(tmp_path), "--parts", "env", "tests"]) == 0


@pytest.mark.parametrize(
    "argv, error",
    [
        ([], "error: no CUDA device is available"),
        (["--parts", "tests", "bnech"], "error: --parts bnech unknown; valid: env, tests"),
    ],
)
def test_no_cuda_or_an_unknown_part_is_refused_in_one_line(
    run_all, tmp_path, monkeypatch, capsys, argv, error
) -> None:
    """No CUDA device, or an unknown --parts name: exit 2, one line naming what is wrong, nothing written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_all.main(["--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(error) and err.count("\n") == 0
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("serial", [False, True])
def test_the_correctness_parts_run_side_by_side_and_the_bench_alone_after_them(
    run_all, tmp_path, monkeypatch, serial
) -> None:
    """Phases: env, then tests, conformance and planted at once (each command sleeps 1 s: they overlap; the two
    conformance commands with each other too), then bench, which starts after every one of them ended; with
    --serial no two commands overlap."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    stamp = (
        "import sys, time; start = time.time(); time.sleep(1); "
        "open(sys.argv[1], 'w').write(f'{start} {time.time()}')"
    )

    def fake(part, out, dion, jobs=1):
        names = [f"{part}{i}" for i in range(2)] if part == "conformance" else [part]
        return [[sys.executable, "-c", stamp, str(tmp_path / f"{n}.span")] for n in names]

    monkeypatch.setattr(run_all, "commands", fake)
    parts = [
        "bench",
        "planted",
        "tests",
        "env",
        "conformance",
    ]  # run in the phases' order, not this one
    argv = ["--out", str(tmp_path / "out"), "--parts", *parts, *(["--serial"] if serial else [])]
    assert run_all.main(argv) == 0
    spans = {f.stem: tuple(map(float, f.read_text().split())) for f in tmp_path.glob("*.span")}
    assert len(spans) == 6
    correctness = [spans[p] for p in ("tests", "conformance0", "conformance1", "planted")]
    assert spans["env"][1] <= min(start for start, _ in correctness)
    assert spans["bench"][0] >= max(end for _, end in correctness)
    overlap = max(start for start, _ in correctness) < min(end for _, end in correctness)
    assert overlap != serial
    (a0, a1), (b0, b1) = spans["conformance0"], spans["conformance1"]
    assert (max(a0, b0) < min(a1, b1)) != serial


def test_a_failed_tests_report_reaches_the_failure_log_as_it_happens(tmp_path) -> None:
    """tests/failure_log.py: with MUON_TEST_FAILURES set, a failing test's name and its assertion are in the file
    once (a passing one adds nothing), under pytest-xdist too, where only the controller writes; without it nothing
    is written. The pytest here runs inside this one's environment, an xdist worker's when the suite runs under
    xdist, and is not a worker itself."""
    import importlib.util
    import os
    import subprocess

    (tmp_path / "test_two.py").write_text(
        "def test_passes():\n    assert True\n\n\ndef test_fails():\n    assert 1 == 2, 'planted'\n"
    )
    log = tmp_path / "failures.log"
    root = str(RUN_ALL.parents[2])
    runs = [({"MUON_TEST_FAILURES": str(log)}, ()), ({}, ())]
    if importlib.util.find_spec("xdist") is not None:
        runs.append(({"MUON_TEST_FAILURES": str(log)}, ("-n", "2")))
    for env, args in runs:
        if env:
            log.unlink(missing_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "tests.failure_log",
                "-p",
                "no:cacheprovider",
                *args,
                str(tmp_path / "test_two.py"),
            ],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": root, "MUON_TEST_FAILURES": "", **env},
            capture_output=True,
            timeout=120,
        )
        text = log.read_text() if log.exists() else ""
        assert text.count("=== FAILED") == 1 and "test_two.py::test_fails (call)" in text, (
            args,
            text,
        )
        assert "planted" in text and "test_passes" not in text


def test_a_part_whose_commands_cannot_be_listed_is_a_failed_row_and_the_others_run(
    run_all, tmp_path, monkeypatch
) -> None:
    """A part whose command list raises (an import error) gets one "not listed" row naming the error; the other
    parts still run and the exit status is 1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def fake(part, out, dion, jobs=1):
        if part == "conformance":
            raise ModuleNotFoundError("No module named 'muon_check'")
        return [[sys.executable, "-c", f"print('{part} ran')"]]

    monkeypatch.setattr(run_all, "commands", fake)
    argv = ["--out", str(tmp_path), "--parts", "tests", "conformance", "bench"]
    assert run_all.main(argv) == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "| conformance | `(the conformance part's commands)` | not listed |" in summary
    assert "No module named 'muon_check'" in summary
    assert "tests ran" in summary and "bench ran" in summary


def test_the_script_lists_the_conformance_commands_without_the_repository_on_the_path(
    tmp_path,
) -> None:
    """Run as a script (`python3 tests/gpu/run_all.py`, no PYTHONPATH), the conformance part still names every
    shipped adapter: the script puts the repository root on sys.path. The child runs without site (so without this
    environment's editable install) and first asserts that muon_check is not importable there, so the check can
    fail."""
    import os
    import subprocess

    site_packages = str(Path(torch.__file__).resolve().parents[1])
    code = (
        "import importlib.util, runpy, sys\n"
        f"sys.path.append({site_packages!r})\n"
        "assert importlib.util.find_spec('muon_check') is None, 'muon_check importable without the script'\n"
        f"g = runpy.run_path({str(RUN_ALL)!r}, run_name='listed')\n"
        "from pathlib import Path\n"
        "print(len(g['commands']('conformance', Path('.'), None)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    from muon_check.adapters.shipped import SHIPPED

    assert int(done.stdout.split()[-1]) == len(SHIPPED)
