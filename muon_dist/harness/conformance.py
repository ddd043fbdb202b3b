r"""Check any Muon against the oracle: `python -m muon_dist.harness.conformance --adapter MODULE:NAME`.

    python -m muon_dist.harness.conformance --adapter muon_dist.harness.adapters.shipped:TorchMuon
    python -m muon_dist.harness.conformance --adapter muon:SingleDeviceMuon --preset keller     # any optimizer class
    python -m muon_dist.harness.conformance --adapter path/to/dion_clone:dion.muon:Muon --preset dion \
        --hp-names '{"momentum": "mu"}' --distributed dtensor                         # a local checkout
    python -m muon_dist.harness.conformance --all --markdown                                    # the README table
    python -m muon_dist.harness.conformance --all --device cuda                                 # on a GPU node
    python -m muon_dist.harness.conformance --origins                                  # each preset vs its origin
    python -m muon_dist.harness.conformance --planted              # the planted bugs: what the check catches

Each case (muon_dist/harness/adapters/cases.py) runs the candidate on a pool of gloo ranks
(muon_dist.harness.launch.RankPool; one rank for single-device cases; with --device cuda the candidate, its tensors
and the reference are on CUDA, the ranks sharing the node's GPUs with gloo carrying CUDA tensors; a checkpoint case
saves on one pool and resumes on another) with a timeout (--timeout, default 300 s: first calls may torch.compile),
and muon_ref.Muon under the adapter's claim on the full tensors; the contract is in
muon_dist/harness/adapters/oracle.py. Per case: bitwise, differs (max |dP|, the first step that differs and whether
the difference grows; where ranks hold replicated params, whether they agree), crash (the error) or hang. A failing
case is shrunk (fewer steps, params, smaller dims and world size, keeping the failure kind) and the departure
diagnosed (muon_dist/harness/adapters/diagnose.py). Exit status 1 on any departure from the claim, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

from .adapters import HYPERPARAMETERS, Adapter, load_adapter
from .adapters.cases import (
    CHECKPOINT_FAMILIES,
    FAMILY_OPTIONS,
    Case,
    default_cases,
    family_shapes,
    in_family,
    smaller,
)
from .adapters.diagnose import diagnose
from .adapters.oracle import Outcome, candidate_hyperparameters, claim_of, judge, reference_steps
from .adapters.workers import candidate_resume, candidate_save, candidate_steps
from .launch import RankFailure, RankPool

_print = functools.partial(print, flush=True)  # progress shows while a long run goes on
PLANTED_TIMEOUT = 10.0  # s: a planted case answers within a second here (2 loaded cores)
IDLE_S = 2.0  # s without CPU time in any unanswered rank: a hang (CPU ranks; RankPool.idle_s)


def run_here(adapter: Adapter, case: Case) -> Outcome:
    """One single-device case in this process, no rank pool: the candidate and oracle code that the pool runs,
    for tests that draw many cases (errors propagate instead of becoming a crash outcome)."""
    preset, overrides = claim_of(adapter)
    results = [candidate_steps(adapter, case, candidate_hyperparameters(adapter))]
    return judge(case, [(1, results)], preset, overrides)


class Runner:
    """Runs cases of one adapter on pools of gloo ranks (one pool per world size, kept across cases)."""

    def __init__(self, adapter: Adapter, timeout: float) -> None:
        self.adapter, self.timeout = adapter, timeout
        self.preset, self.overrides = claim_of(adapter)
        self.pools: dict[int, RankPool] = {}

    def run(self, case: Case, timeout: float | None = None) -> Outcome:
        """The case's outcome; a checkpoint case runs its save on world_size ranks, its resume on
        resume_world_size ranks, through a fresh folder."""
        hp = candidate_hyperparameters(self.adapter)
        if case.family not in CHECKPOINT_FAMILIES:
            return self._phases(
                case, [(case.world_size, candidate_steps, (self.adapter, case, hp))], timeout
            )
        with tempfile.TemporaryDirectory(prefix="muon_conformance_dcp_") as path:
            return self._phases(
                case,
                [
                    (case.world_size, candidate_save, (self.adapter, case, hp, path)),
                    (case.resume_world_size, candidate_resume, (self.adapter, case, hp, path)),
                ],
                timeout,
            )

    def _phases(
        self, case: Case, phases: list[tuple[int, Any, tuple]], timeout: float | None
    ) -> Outcome:
        """Each phase on its pool in turn (the reference computed while the first runs); a crash or hang ends it."""
        reference, segments = None, []
        for world, fn, args in phases:
            idle = IDLE_S if case.device == "cpu" else None
            pool = self.pools.setdefault(world, RankPool(world, case.device, idle_s=idle))
            pool.submit(fn, *args)
            if reference is None:
                try:
                    reference = reference_steps(case, self.preset, self.overrides)
                except BaseException:
                    pool.kill()  # its answers to this call would be read by the next one
                    raise
            try:
                segments.append((world, pool.collect(timeout or self.timeout)))
            except RankFailure as failure:
                return _failed(case, failure)
        return judge(case, segments, self.preset, self.overrides, reference)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


def _failed(case: Case, failure: RankFailure) -> Outcome:
    """crash or hang. A crash names the first rank's own error, before ranks that only saw a peer die (gloo:
    "Connection reset by peer"; a rank that gloo aborted, e.g. on a collective of mismatched sizes, just dies)."""
    raised = {r: _last_line(m) for r, m in failure.messages.items() if r not in failure.hung}
    if not raised:
        why = failure.messages[min(failure.hung)].split("no answer: ", 1)[-1]
        return Outcome(case, "hang", error=f"no answer from ranks {sorted(failure.hung)}: {why}")
    secondary = ("Connection reset by peer", "Connection closed by peer", "the rank died")
    own = {r: m for r, m in raised.items() if not any(s in m for s in secondary)}
    died = sorted(r for r, m in raised.items() if "the rank died" in m)
    if own:
        rank, line = min(own.items())
        return Outcome(case, "crash", error=f"rank {rank}: {line[:300]}")
    if died:
        note = "died in a collective (gloo aborted it; peers: connection reset)"
        return Outcome(case, "crash", error=f"rank {died[0]}: {note}")
    rank, line = min(raised.items())
    return Outcome(case, "crash", error=f"rank {rank}: {line[:300]}")


_EXCEPTION_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(Error|Exception|Unsupported|NotMet|Interrupt))(: .*)?$"
)


def _last_line(message: str) -> str:
    """The traceback's last exception line (short type name), and the first one when it differs (the cause
    that torch.compile or a wrapper re-raised as another type)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    found = [m for m in map(_EXCEPTION_LINE.match, lines) if m]
    if not found:
        return lines[-1]
    short = [f"{m.group(1).rsplit('.', 1)[-1]}{m.group(3) or ''}" for m in found]
    asserts = [line for line in lines if line.startswith("assert ")]
    cause = f"{short[0]}{': ' + asserts[-1] if asserts else ''}"
    return (
        short[-1]
        if found[0].group(1) == found[-1].group(1) and not asserts
        else f"{short[-1]} (from {cause})"
    )


def _kind(o: Outcome) -> tuple[str, str | None]:
    """The failure kind a shrunk case must keep: status, and the exception type of a crash."""
    return o.status, (o.error.split(":")[1].strip() if o.status == "crash" and o.error else None)


def shrink(runner: Runner, outcome: Outcome, budget_s: float) -> Outcome:
    """A minimal case with the same failure kind: greedy over smaller world sizes, then `smaller` moves."""
    deadline, best = time.monotonic() + budget_s, outcome
    kind, improved = _kind(outcome), True
    while improved and time.monotonic() < deadline:
        improved = False
        for case in _smaller_worlds(best.case) + smaller(best.case):
            if time.monotonic() >= deadline:
                break
            trial = runner.run(
                case, timeout=min(runner.timeout, 20.0) if kind[0] == "hang" else None
            )
            if _kind(trial) == kind:
                best, improved = trial, True
                break
    return best


def _smaller_worlds(case: Case) -> list[Case]:
    """The case's family at each smaller world size (a checkpoint case keeps its resume world size)."""
    out = []
    for W in range(1, case.world_size):
        shapes = family_shapes(case.family, case.mode, W) if case.mode != "single" else None
        if shapes is not None:
            trial = replace(case, world_size=W, shapes=shapes)
            out += [trial] if in_family(trial) else []
    return out


def check(
    adapter: Adapter,
    world_sizes: tuple[int, ...],
    steps: int,
    timeout: float,
    shrink_budget: float,
    families: tuple[str, ...] | None = None,
    dtypes: tuple[str, ...] | None = None,
    log=_print,
    device: str = "cpu",
) -> dict[str, Any]:
    """Every case of the adapter (optionally only some families and dtypes); the report as a dict (--json)."""
    runner = Runner(adapter, timeout)
    started = time.monotonic()
    chosen = adapter.families & frozenset(families) if families else adapter.families
    chosen = frozenset(f for f in chosen if _runs_for(adapter, f))
    dtypes = tuple(d for d in adapter.dtypes if d in dtypes) if dtypes else adapter.dtypes
    try:
        cases = default_cases(
            chosen, adapter.distributed, world_sizes, dtypes, steps, device, adapter.variants
        )
        outcomes = []
        for case in cases:
            outcomes.append(runner.run(case))
            log(_line(outcomes[-1]))
        diagnosis = diagnose(outcomes, runner.preset, runner.overrides)
        shrunk, firsts = [], _first_of_each_failure(outcomes)
        for o in firsts:
            if shrink_budget > 0:
                small = shrink(runner, o, shrink_budget / len(firsts))
                shrunk.append(
                    {
                        "from": o.case.label(),
                        "to": small.case.label(),
                        "status": small.status,
                        "error": small.error,
                        "max_diff": small.max_diff,
                    }
                )
    finally:
        runner.close()
    return {
        "adapter": adapter.name,
        "version": adapter.version(),
        "claim": adapter.describe(),
        "device": device,
        "distributed": adapter.distributed,
        "outcomes": [o.summary() for o in outcomes],
        "conforms": all(o.status == "bitwise" for o in outcomes),
        "diagnosis": diagnosis,
        "minimal_failing_cases": shrunk,
        "wall_s": round(time.monotonic() - started, 1),
    }


def _runs_for(adapter: Adapter, family: str) -> bool:
    """False for a family that sets a hyperparameter the adapter does not take (nesterov_off for an optimizer
    without a nesterov argument: its claim fixes Nesterov)."""
    return all(
        k in adapter.hyperparameters
        for k, _ in FAMILY_OPTIONS.get(family, ())
        if k in HYPERPARAMETERS
    )


def _first_of_each_failure(outcomes: list[Outcome]) -> list[Outcome]:
    """One failing case per failure kind and mode (and family, off a single device), for the shrinker."""
    firsts: dict[tuple, Outcome] = {}
    for o in outcomes:
        if o.status != "bitwise":
            firsts.setdefault(
                (o.case.mode, _kind(o), o.case.family if o.case.mode != "single" else ""), o
            )
    return list(firsts.values())


def _line(o: Outcome) -> str:
    detail = o.error or (
        ""
        if o.status == "bitwise"
        else f"max|dP| {o.max_diff:.3g}, first differs at step {o.first_step}, "
        f"{'grows' if o.grows else 'does not grow'}; max|dM| {o.state_diff}"
    )
    notes = [
        n
        for n in (
            o.policy and f"None grads: {o.policy}",
            o.replicas and f"replicas: {o.replicas}",
            o.elementwise and f"elementwise: {o.elementwise}",
        )
        if n
    ]
    return f"  {o.case.label():<58} {o.status:<8} {detail}{'; ' if detail and notes else ''}{'; '.join(notes)}"


def print_report(report: dict[str, Any], log=_print) -> None:
    log(f"diagnosis: {report['diagnosis']}")
    for s in report["minimal_failing_cases"]:
        log(
            f"  minimal {s['status']}: {s['to']}"
            + (f" ({s['error']})" if s["error"] else f" (max|dP| {s['max_diff']:.3g})")
        )
    bitwise = sum(o["status"] == "bitwise" for o in report["outcomes"])
    log(
        f"{bitwise}/{len(report['outcomes'])} cases bitwise equal to the claim ({report['wall_s']} s)"
    )


def markdown(reports: list[dict[str, Any]]) -> str:
    lines = [
        "| adapter | version | claim | bitwise | diagnosis | minimal failing cases |",
        "|---|---|---|---|---|---|",
    ]
    for r in reports:
        claim = r["claim"].split("(claims ", 1)[-1].rstrip(")")
        n = sum(o["status"] == "bitwise" for o in r["outcomes"])
        small = "; ".join(f"{s['status']}: {s['to']}" for s in r["minimal_failing_cases"]) or "-"
        lines.append(
            f"| `{r['adapter']}` | {r['version']} | {claim} | {n}/{len(r['outcomes'])} | "
            f"{r['diagnosis'].replace('|', '/')} | {small.replace('|', '/')} |"
        )
    return "\n".join(lines)


def provenance(argv: list[str] | None) -> dict[str, Any]:
    """What a cited verdict needs to be rerun: versions, build, CPU capability or GPU, command, date."""
    import platform
    import subprocess
    from datetime import datetime, timezone

    import torch

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = (
            subprocess.run(
                ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "commit": commit,
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": gpu,
        "python": platform.python_version(),
        "command": " ".join(
            [
                "python -m muon_dist.harness.conformance",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _known_families() -> frozenset[str]:
    """Every case family name, in any mode (--families accepts these)."""
    from .adapters.cases import FUSED_FAMILIES, MODE_FAMILIES, SINGLE_FAMILIES

    return SINGLE_FAMILIES.union(FUSED_FAMILIES, *MODE_FAMILIES.values())


def _parser() -> argparse.ArgumentParser:
    from muon_ref import PRESETS

    epilog = (
        f"presets: {', '.join(sorted(PRESETS))}\n"
        f"families: {', '.join(sorted(_known_families()))}\n"
        "exit codes: 0 conforms, 1 bug found, 2 usage error"
    )
    p = argparse.ArgumentParser(
        description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--adapter", action="append", default=[], help="MODULE:NAME or CHECKOUT_DIR:MODULE:CLASS"
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="every shipped adapter (muon_dist.harness.adapters.shipped)",
    )
    p.add_argument(
        "--origins",
        action="store_true",
        help="each muon_ref preset against its origin "
        "(muon_dist.harness.adapters.origins; what make verify runs)",
    )
    p.add_argument(
        "--planted",
        action="store_true",
        help="the planted-bug suite (muon_dist.harness.adapters."
        "planted): a small Muon per reachable class of field bug; prints caught K/N",
    )
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--families", nargs="+", help="only these case families (default: all the adapter supports)"
    )
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], help="only these dtypes")
    p.add_argument(
        "--timeout",
        type=float,
        help="seconds per case before it counts as a hang (default 300: first "
        f"calls may torch.compile; {PLANTED_TIMEOUT:g} for --planted, whose cases are tiny)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the candidate and the reference "
        "run (cuda: the ranks share the node's GPUs, gloo carrying CUDA tensors)",
    )
    p.add_argument(
        "--shrink-budget", type=float, default=60.0, help="seconds of shrinking per adapter, in all"
    )
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--markdown", action="store_true", help="print the README's conformance table")
    g = p.add_argument_group("for an optimizer class given by import path")
    g.add_argument("--preset", default="torch")
    g.add_argument("--overrides", type=json.loads, default={}, help="muon_ref options, JSON")
    g.add_argument(
        "--hp-names", type=json.loads, default={}, help='e.g. {"momentum": "mu", "nesterov": null}'
    )
    g.add_argument("--kwargs", type=json.loads, default={}, help="constructor keywords, JSON")
    g.add_argument("--distributed", choices=["dtensor", "replicated", "unreduced"], default=None)
    return p


def planted_suite(timeout: float, steps: int, log=_print) -> dict[str, Any]:
    """Every planted bug through the check (its families, dtypes and world sizes, no shrinking), judged
    (muon_dist.harness.adapters.planted.judge); one line per bug and the figure."""
    from .adapters.planted import PLANTED, UNREACHABLE, judge

    started, verdicts = time.monotonic(), []
    for planted in PLANTED:
        report = check(
            planted.adapter, planted.world_sizes, steps, timeout, 0.0, log=lambda *_: None
        )
        verdicts.append(judge(planted, report))
        v = verdicts[-1]
        caught = ", ".join(f"{f} ({'/'.join(s)})" for f, s in v["by"].items()) or "nothing"
        right = "right" if v["right"] else f"WRONG ({'; '.join(v['wrong'])})"
        log(
            f"#{v['field_bug']:<3} {v['source']:<34} {v['optimizer']:<24} caught by {caught}; diagnosis {right} "
            f"({report['wall_s']} s)"
        )
        log(f"     {v['diagnosis']}")
    for number, reason in UNREACHABLE.items():
        log(f"#{number:<3} not reachable: {reason}")
    caught, right = (
        sum(v["caught"] for v in verdicts),
        sum(v["caught"] and v["right"] for v in verdicts),
    )
    wall = round(time.monotonic() - started, 1)
    log(
        f"caught {caught}/{len(verdicts)} planted bugs, diagnosis right for {right}; "
        f"{len(UNREACHABLE)} class not reachable ({wall} s)"
    )
    return {
        "planted": verdicts,
        "caught": caught,
        "right": right,
        "total": len(verdicts),
        "wall_s": wall,
    }


def _unknown_names(args: argparse.Namespace) -> str | None:
    """A one-line usage error for an unknown --preset or --families name (nothing vacuous), else None."""
    from muon_ref import PRESETS

    if args.preset not in PRESETS:
        return f"--preset {args.preset!r} is unknown; valid: {', '.join(sorted(PRESETS))}"
    known = _known_families()
    unknown = sorted(set(args.families or ()) - known)
    if unknown:
        return f"--families {' '.join(unknown)} unknown; valid: {', '.join(sorted(known))}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.planted:
        if args.adapter or args.all or args.origins:
            print("error: --planted runs the planted suite alone", file=sys.stderr)
            return 2
        suite = planted_suite(args.timeout or PLANTED_TIMEOUT, args.steps)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(suite, f, indent=1, default=str)
        return 0 if suite["right"] == suite["total"] else 1
    bad = _unknown_names(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    try:
        adapters = [
            load_adapter(
                spec,
                preset=args.preset,
                overrides=args.overrides,
                hp_names=args.hp_names,
                kwargs=args.kwargs,
                distributed=args.distributed,
            )
            for spec in args.adapter
        ]
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.all:
        from .adapters.shipped import SHIPPED

        adapters += [cls() for cls in SHIPPED.values()]
    if args.origins:
        from .adapters.origins import ORIGINS

        adapters += [cls() for cls in ORIGINS.values()]
    if not adapters:
        print("error: give --adapter MODULE:NAME (repeatable), --all or --origins", file=sys.stderr)
        return 2
    supported = frozenset().union(*(a.families for a in adapters))
    if args.families and not supported & frozenset(args.families):
        print(
            f"error: --families {' '.join(args.families)} selects no case of these adapters; "
            f"valid: {', '.join(sorted(supported))}",
            file=sys.stderr,
        )
        return 2
    reports = []
    origin = provenance(argv)
    _print(f"provenance: {json.dumps(origin)}")
    for i, adapter in enumerate(adapters):
        _print(adapter.describe())
        reports.append(
            check(
                adapter,
                tuple(args.world_sizes),
                args.steps,
                args.timeout or 300.0,
                args.shrink_budget,
                args.families,
                args.dtypes,
                device=args.device,
            )
        )
        reports[-1]["provenance"] = origin
        reports[-1]["partial"] = i + 1 < len(adapters)  # later adapters not yet checked
        print_report(reports[-1])
        if args.json:  # written adapter by adapter: an interrupted run leaves what it finished
            with open(args.json, "w") as f:
                json.dump(reports, f, indent=1, default=str)
    if args.markdown:
        print(markdown(reports))
    if len(reports) > 1:
        cases = [o for r in reports for o in r["outcomes"]]
        _print(
            f"{sum(r['conforms'] for r in reports)}/{len(reports)} adapters conform to their claims; "
            f"{sum(o['status'] == 'bitwise' for o in cases)}/{len(cases)} cases bitwise equal"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1, default=str)
    return 0 if all(r["conforms"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
