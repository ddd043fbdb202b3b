r"""Check any Muon against the oracle: `python -m muon_check --adapter MODULE:NAME`.

    python -m muon_check --adapter muon_check.adapters.shipped:TorchMuon
    python -m muon_check --adapter muon:SingleDeviceMuon --preset keller     # any optimizer class
    python -m muon_check --adapter path/to/dion_clone:dion.muon:Muon --preset dion \
        --hp-names '{"momentum": "mu"}' --distributed dtensor                         # a local checkout
    python -m muon_check --all --markdown                                    # the README table
    python -m muon_check --all --device cuda                                 # on a GPU node
    python -m muon_check --origins                                  # each preset vs its origin
    python -m muon_check --planted              # the planted bugs: what the check catches
    python -m muon_check --audit MODULE:SETUP   # a training setup's routing, per param
    python -m muon_check --invariance MODULE:SETUP   # the same training on every layout

Each case (muon_check/adapters/cases.py) runs the candidate on a pool of gloo ranks
(muon_check.launch.RankPool: spawned ranks, each with its own PYTHONHASHSEED from --seed; one rank without a
process group for the single-device cases of a candidate not declared distributed; with --device cuda the candidate,
its tensors and the reference are on CUDA, the ranks sharing the node's GPUs with gloo carrying CUDA tensors; a
checkpoint case saves on one pool and resumes on another) with a timeout (--timeout, default 300 s: first calls may
torch.compile), and muon_ref.Muon under the adapter's claim on the full tensors, with its elementwise stages on the
whole params or on the ranks' shards and the update in either memory layout; the contract is in
muon_check/adapters/oracle.py. First, the first case of each dtype and mode runs twice with torch's random
generators seeded otherwise (every case is seeded the same): a candidate that differs from itself is compared at
twice that difference. Per case: bitwise (naming a rounding where one was needed), close (within that tolerance),
differs (max |dP| and in units in the last place, the first step that differs and whether the difference grows,
the momentum after each recorded step; where ranks hold replicated params, whether they agree; the first stage that
departs: adapters/stages.py), routed (every param sent to another optimizer: adapters/routing.py), unsupported
(refused at construction), crash (the error) or hang (each rank's blocked collective). A failing case is shrunk
(fewer steps, params, smaller dims and world size, keeping the status, stage, dtype, mode and routing) and the run
diagnosed in findings with their words (adapters/diagnose.py: convention, bug, departs, rounding, not a Muon,
routing, unsupported input, non-deterministic, crashes, hangs); the verdict and what was not compared are
adapters/verdict.py's. Exit status (EXIT): 0 conforms (also within a stated tolerance), 1 departs or not a Muon,
2 usage error (also: a distributed-looking candidate without --distributed, momentum state not found, a candidate
that cannot be built on a plain matrix), 3 could not run. docs/conformance.md says how to read and cite a verdict.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from .adapters import HYPERPARAMETERS, Adapter, ImportPath, load_adapter
from .adapters.cases import (
    CHECKPOINT_FAMILIES,
    FAMILY_OPTIONS,
    STATE_ROUNDTRIP_FAMILIES,
    Case,
    default_cases,
    family_shapes,
    in_family,
    smaller,
)
from .adapters.diagnose import SEARCH_BUDGET_S, Context, diagnose, findings
from .adapters.oracle import (
    Outcome,
    View,
    candidate_hyperparameters,
    claim_of,
    judge,
    other_stack,
    reference_steps,
    resolved_hyperparameters,
)
from .adapters.oracle import (
    trial as judged_under,
)
from .adapters.routing import classify, parse_rule
from .adapters.stages import is_stack_mode, locate, update_vanishes
from .adapters.verdict import (
    EXIT,
    PRECEDENCE,
    TOLERANCE_FACTOR,
    failure_kind,
    first_of_each_failure,
    not_compared,
    self_difference,
    stop,
    verdict,
)
from .adapters.workers import candidate_resume, candidate_save, candidate_steps
from .launch import RankFailure, RankPool, device_unavailable

if TYPE_CHECKING:
    from .adapters.planted import Planted

_print = functools.partial(print, flush=True)  # progress shows while a long run goes on
PLANTED_TIMEOUT = 10.0  # s: a planted case answers within a second here (2 loaded cores)
IDLE_S = 2.0  # s without CPU time in any unanswered rank: a hang (CPU ranks; RankPool.idle_s)


def run_here(adapter: Adapter, case: Case) -> Outcome:
    """One single-device case in this process, no rank pool: the candidate and oracle code that the pool runs,
    judged as a pool's case is (Runner.judge), for tests that draw many cases (errors propagate instead of becoming
    a crash outcome)."""
    preset, overrides = claim_of(adapter)
    results = [candidate_steps(adapter, case, candidate_hyperparameters(adapter))]
    return Runner(adapter, 0.0).judge(
        case, [(1, results)], reference_steps(case, preset, overrides)
    )


def hash_seeds(seed: int, world_size: int) -> list[int]:
    """The PYTHONHASHSEED of each rank of a pool: distinct per rank (a candidate whose order of work depends on
    a set's or dict's order of strings differs across ranks, as in separate training processes), nonzero (0
    turns hashing randomisation off), and a function of --seed (a run is reproducible)."""
    return [1 + 1000 * seed + rank for rank in range(world_size)]


class Runner:
    """Runs cases of one adapter on pools of gloo ranks (one pool per world size, kept across cases). Ranks are
    spawned, each with its own PYTHONHASHSEED (hash_seeds); a non-distributed adapter's ranks have no process
    group, so a candidate that calls torch.distributed shows itself (LOOKS_DISTRIBUTED). Each case's outcome is
    judged with what the check knows of the candidate: the routing its claim states, the params it sends elsewhere
    (routing.py), where it keeps its momentum (momentum.py), a tolerance where it differs from itself (set by
    check's determinism probe), and, for a departure, the stage it departs at (stages.py)."""

    def __init__(
        self,
        adapter: Adapter,
        timeout: float,
        seed: int = 0,
        pools: dict[tuple, RankPool] | None = None,
    ) -> None:
        self.adapter, self.timeout, self.seed = adapter, timeout, seed
        self.preset, self.overrides = claim_of(adapter)
        self.shared = pools is not None  # pools of a suite of adapters, closed by the suite
        self.pools: dict[tuple, RankPool] = {} if pools is None else pools
        rule = getattr(adapter, "routing", None)
        self.stated_routing = parse_rule(rule) if rule else None
        self.search_state = adapter.state_key is not None or (
            type(adapter).momentum is not Adapter.momentum
        )
        # dtype -> tolerance, where the candidate differs from itself (check's determinism probe)
        self.tolerance: dict[str, float] = {}
        # (case, rng seed) -> (segments, reference) or a failed Outcome: a probe's run kept for the case
        self._runs: dict[tuple, Any] = {}
        # param shape -> why the candidate sends it elsewhere, as read on some case (routing is by shape)
        self.routed_shapes: dict[tuple, str] = {}
        self.kept_shapes: set[tuple] = set()  # param shapes read as kept (not routed) on some case

    def run(self, case: Case, timeout: float | None = None) -> Outcome:
        """The case's outcome (a checkpoint case runs its save on world_size ranks, its resume on
        resume_world_size ranks, through a fresh folder)."""
        got = self.segments(case, 0, timeout)
        if isinstance(got, Outcome):
            return got
        return self.judge(case, *got)

    def segments(self, case: Case, rng_seed: int = 0, timeout: float | None = None) -> Any:
        """(segments, reference) of the candidate's run with torch's generators seeded with rng_seed, or the
        failed Outcome (crash, hang, refused at construction); the rng_seed 0 run is kept for the case's own run."""
        key = (case, rng_seed)
        if key in self._runs:
            return self._runs.pop(key) if rng_seed == 0 else self._runs[key]
        hp = candidate_hyperparameters(self.adapter)
        if case.family not in CHECKPOINT_FAMILIES:
            got = self._phases(
                case,
                [(case.world_size, candidate_steps, (self.adapter, case, hp, rng_seed))],
                timeout,
            )
        else:
            with tempfile.TemporaryDirectory(prefix="muon_conformance_dcp_") as path:
                got = self._phases(
                    case,
                    [
                        (case.world_size, candidate_save, (self.adapter, case, hp, path)),
                        (case.resume_world_size, candidate_resume, (self.adapter, case, hp, path)),
                    ],
                    timeout,
                )
        return got

    def keep(self, case: Case, got: Any) -> None:
        """Keep a probe's rng_seed 0 run for the case's own run (Runner.segments)."""
        self._runs[(case, 0)] = got

    def _phases(
        self, case: Case, phases: list[tuple[int, Any, tuple]], timeout: float | None
    ) -> Any:
        """Each phase on its pool in turn (the reference computed while the first runs); a crash or hang ends it."""
        reference, segments = None, []
        for world, fn, args in phases:
            idle = IDLE_S if case.device == "cpu" else None
            grouped = self.adapter.distributed is not None
            key = (world, case.device, self.seed, grouped)
            if key not in self.pools:
                self.pools[key] = RankPool(
                    world,
                    case.device,
                    idle_s=idle,
                    hash_seed=hash_seeds(self.seed, world)[0],
                    process_group=grouped,
                )
            pool = self.pools[key]
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
        return segments, reference

    def judge(self, case: Case, segments: list, reference: dict) -> Outcome:
        """The outcome of a case that ran (class docstring): judged with the stated routing, then, where it differs,
        with the params the candidate sends elsewhere left out, and located where it still differs."""
        stated = {
            i: "the claim's stated routing"
            for i, shape in enumerate(case.shapes)
            if self.stated_routing and self.stated_routing(tuple(shape))
        }
        tolerance = self.tolerance.get(case.dtype)

        def judged(routed: dict[int, str]) -> Outcome:
            view = View.of(case, segments, reference, routed, tolerance, self.search_state)
            return judge(case, segments, self.preset, self.overrides, reference, view)

        outcome, updates = judged(stated), {}
        if outcome.status == "differs" and not outcome.replicas and not outcome.resumed:
            updates = self._read_updates(case, segments, reference)
            found = self._routed(case, updates, stated)
            if found:
                outcome = judged({**found, **stated})
        outcome.updates = updates
        if case.family == "tiny" and update_vanishes(case, self.preset, self.overrides):
            outcome.vacuous = (
                "the claim's Newton-Schulz maps the tiny gradients to zero (its input underflows): the family "
                "cannot show a scale bug under this claim"
            )
        if outcome.routed and len(outcome.routed) == len(case.shapes):
            outcome.status = "routed"
        if outcome.status == "differs":
            self._locate(outcome, updates)
        return outcome

    def _read_updates(self, case: Case, segments: list, reference: dict) -> dict:
        """routing.classify of the case's first step under the claim's lr and weight decay."""
        hp = resolved_hyperparameters(self.preset, {**self.overrides, **dict(case.options)})
        first = next(iter(reference.values())).params[0]
        lr, wd = float(hp["lr"]), float(hp["weight_decay"])
        return classify(case, segments, first, lr, wd, self.overrides)

    def _routed(self, case: Case, updates: dict, stated: dict[int, str]) -> dict[int, str]:
        """The params the candidate sends elsewhere, by what their updates say; routing goes by shape, so a shape
        decided where its update could be read (routed, or kept) holds where it cannot (bf16 params)."""
        found = {i: u.routed for i, u in updates.items() if u.routed and i not in stated}
        for i, shape in enumerate(map(tuple, case.shapes)):
            read = updates.get(i)
            if read is not None and read.read:  # its update was read on this case
                if i in found:
                    self.routed_shapes.setdefault(shape, found[i])
                else:
                    self.kept_shapes.add(shape)
            elif i in found and shape in self.kept_shapes:
                del found[i]  # not readable here, and kept where it was read
            elif i not in found and i not in stated and shape in self.routed_shapes:
                found[i] = f"{self.routed_shapes[shape]} (read on another case of this shape)"
        return found

    def _locate(self, outcome: Outcome, updates: dict) -> None:
        """The departing stage (stages.locate), with what the update's spread says where it is the direction. Where
        the first departing step is the other stack mode exactly (a rounding the check accepts: oracle.Rounding), the
        departure is located again under that mode, at the step and stage where the candidate leaves it."""
        located = locate(outcome, self.preset, self.overrides)
        if located is not None and is_stack_mode(located):
            options = {**self.overrides, **dict(outcome.case.options)}
            stack = other_stack(self.preset, options)
            under = {**self.overrides, "ns_stack": stack}
            again = locate(judged_under(outcome, self.preset, under), self.preset, under)
            if again is not None:
                located = replace(
                    again,
                    detail=f"{again.detail} (under ns_stack={stack!r}, the stack rounding of its first steps)",
                )
        if located is None:
            return
        outcome.stage, outcome.stage_detail = located.stage, located.describe()
        outcome.stage_exact = located.exact
        update = updates.get(located.param)
        if (
            located.stage == "orthogonalised direction"
            and update
            and update.orthogonalised is False
        ):
            outcome.stage_detail += f"; not orthogonalised: {update.describe()}"

    def close(self) -> None:
        if not self.shared:
            close_pools(self.pools)


def close_pools(pools: dict[tuple, RankPool]) -> None:
    for pool in pools.values():
        pool.close()
    pools.clear()


def _failed(case: Case, failure: RankFailure) -> Outcome:
    """crash or hang. A crash names the first rank's own error, before ranks that only saw a peer die (gloo:
    "Connection reset by peer"; a rank that gloo aborted, e.g. on a collective of mismatched sizes, just dies)."""
    raised = {r: _last_line(m) for r, m in failure.messages.items() if r not in failure.hung}
    refusal = next((m for m in raised.values() if m.startswith("ConstructionError: ")), None)
    if refusal is not None:  # the candidate's constructor refused the case's params (workers.build)
        return Outcome(case, "unsupported", error=refusal.removeprefix("ConstructionError: "))
    if not raised:
        whys = {r: failure.messages[r].split("no answer: ", 1)[-1] for r in sorted(failure.hung)}
        common = whys[min(whys)].split("; ", 1)[0]
        places = "; ".join(
            f"rank {r} {why.split('; ', 1)[1]}" for r, why in whys.items() if "; " in why
        )
        return Outcome(
            case,
            "hang",
            error=f"no answer from ranks {sorted(failure.hung)}: {common}"
            + (f"; {places}" if places else ""),
        )
    secondary = ("Connection reset by peer", "Connection closed by peer", "the rank died")
    own = {r: m for r, m in raised.items() if not any(s in m for s in secondary)}
    died = sorted(r for r, m in raised.items() if "the rank died" in m)
    if own:
        rank, line = min(own.items())
        return Outcome(case, "crash", error=f"rank {rank}: {line[:300]}")
    # a rank killed by a fatal signal other than gloo's abort (the peers of a dead rank abort): the signal and the
    # torch.distributed call it hit (RankPool: faulthandler's dump)
    killed = {
        r: m.splitlines()[0].partition("; killed: ")[2].partition("; its stderr: ")[0]
        for r, m in failure.messages.items()
        if r not in failure.hung and "; killed: " in m.splitlines()[0]
    }
    signalled = {r: k for r, k in killed.items() if not k.startswith("Aborted")}
    if signalled:
        rank = min(signalled)
        return Outcome(case, "crash", error=f"rank {rank}: killed by {signalled[rank][:300]}")
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


def shrink(runner: Runner, outcome: Outcome, budget_s: float) -> Outcome:
    """A minimal case with the same failure (_kind): greedy over smaller world sizes, then `smaller` moves."""
    deadline, best = time.monotonic() + budget_s, outcome
    kind, improved = failure_kind(outcome), True
    while improved and time.monotonic() < deadline:
        improved = False
        for case in _smaller_worlds(best.case) + smaller(best.case):
            if time.monotonic() >= deadline:
                break
            trial = runner.run(
                case, timeout=min(runner.timeout, 20.0) if kind[0] == "hang" else None
            )
            if failure_kind(trial) == kind:
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
    seed: int = 0,
    progress: Callable[[dict[str, Any]], None] | None = None,
    pools: dict[tuple, RankPool] | None = None,
    search_budget: float = SEARCH_BUDGET_S,
) -> dict[str, Any]:
    """Every case of the adapter (optionally only some families and dtypes); the report as a dict (--json).

    First the determinism probe (probe_determinism: the first case of each dtype and mode run twice, with other
    random states); then every case. progress(report so far) is called after every case (the CLI writes its JSON
    there: an interrupted run leaves the cases it finished, marked partial). The run stops early, without a verdict
    on the rest, when the candidate cannot be imported (could not run), cannot be built on a plain matrix (could not
    build, with a hint), or, not declared distributed, calls torch.distributed (refused). pools: rank pools shared
    with other checks of a suite (Runner), closed by the caller."""
    runner = Runner(adapter, timeout, seed, pools)
    run = _CheckRun(adapter, device, seed, Context(search_budget_s=search_budget))
    try:
        run.cases = selected_cases(adapter, world_sizes, steps, families, dtypes, device)
        if not run.cases:  # nothing selected is never a pass
            return _unselected(adapter, device, run.started)
        differences = probe_determinism(runner, run.cases)
        if differences:
            run.context = _tolerant(runner, differences, run.context)
        for case in run.cases:
            run.outcomes.append(runner.run(case))
            log(_line(run.outcomes[-1]))
            stopped = stop(adapter, run.outcomes[-1])
            if stopped:
                return run.report(False, stopped[1], stopped[0])
            if progress:
                progress(run.report(True, "partial: the run goes on", "partial"))
        run.context = replace(run.context, stated_routing=getattr(adapter, "routing", None))
        found = findings(run.outcomes, runner.preset, runner.overrides, run.context)
        result = verdict(run.outcomes, adapter, any(f.kind == "not a Muon" for f in found))
        diagnosis = _diagnosis_line(run.outcomes, found, run.context, adapter)
        if (
            result != "not a Muon"
        ):  # a smaller case of an optimizer that orthogonalises nothing tells nothing
            run.shrunk += _shrunk(runner, run.outcomes, shrink_budget)
    finally:
        runner.close()
    return run.report(False, diagnosis, result, found)


@dataclass
class _CheckRun:
    """One adapter's check as it goes: its cases, outcomes, minimal failing cases and diagnosis context."""

    adapter: Adapter
    device: str
    seed: int
    context: Context
    cases: list[Case] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    shrunk: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def report(self, partial: bool, diagnosis: str, result: str, found: list | None = None) -> dict:
        """The report as a dict (--json): the cases so far, the verdict and its diagnosis."""
        adapter, outcomes = self.adapter, self.outcomes
        return {
            "adapter": adapter.name,
            "version": adapter.version(),
            "claim": adapter.describe(),
            "device": self.device,
            "distributed": adapter.distributed,
            "seed": self.seed,
            "hash_seeds": "PYTHONHASHSEED of rank r = 1 + 1000 * seed + r",
            "outcomes": [o.summary() for o in outcomes],
            "verdict": result,
            "conforms": result in ("conforms", "conforms within tolerance"),
            "diagnosis": diagnosis,
            "findings": [{"kind": f.kind, "text": f.text} for f in found or []],
            "not_compared": not_compared(outcomes, adapter),
            "momentum_read_from": sorted(
                {
                    label
                    for o in outcomes
                    for label in o.momentum_sources
                    if "not compared" not in label
                }
            ),
            "self_differences": self.context.self_differences or {},
            "tolerance": self.context.tolerance,
            "minimal_failing_cases": self.shrunk,
            "partial": partial,
            "cases_planned": len(self.cases),
            "wall_s": round(time.monotonic() - self.started, 1),
        }


def probe_determinism(runner: Runner, cases: list[Case]) -> dict[str, float]:
    """dtype -> the largest difference of the candidate's params between two runs of the same case on the same
    inputs, with torch's generators seeded differently (the first case of each dtype and mode); only the dtypes
    where it is not 0. The first run is kept as the case's own."""
    firsts: dict[tuple, Case] = {}
    for case in cases:
        firsts.setdefault((case.dtype, case.mode), case)
    out: dict[str, float] = {}
    for case in firsts.values():
        first, second = runner.segments(case, 0), runner.segments(case, 1)
        runner.keep(case, first)
        if isinstance(first, Outcome) or isinstance(second, Outcome):
            continue
        d = self_difference(first[0], second[0])
        if d:
            out[case.dtype] = max(out.get(case.dtype, 0.0), d)
    return out


def _tolerant(runner: Runner, differences: dict[str, float], context: Context) -> Context:
    """Set the runner's per-dtype tolerance (TOLERANCE_FACTOR times the run-to-run difference) and say it."""
    runner.tolerance = {dt: TOLERANCE_FACTOR * d for dt, d in differences.items()}
    return replace(context, self_differences=differences, tolerance=max(runner.tolerance.values()))


def _diagnosis_line(
    outcomes: list[Outcome], found: list, context: Context, adapter: Adapter
) -> str:
    """diagnose's line from the findings already made, with unmapped momentum said first."""
    diagnosis = diagnose(outcomes, None, {}, context, found=found)
    unmapped = sorted({k for o in outcomes for k in o.unmapped})
    if unmapped and adapter.state_key is not None:
        diagnosis = (
            f"momentum not found: param-sized state {unmapped}, none of it the momentum by value after the "
            f"first step (the check looked for {adapter.state_key!r}, then by value); name the momentum's key "
            f"with --state-map KEY, or --state-map none to leave it out; params: {diagnosis}"
        )
    return diagnosis


def _shrunk(runner: Runner, outcomes: list[Outcome], budget: float) -> list[dict[str, Any]]:
    """A minimal case per failure (shrink), within `budget` seconds in all."""
    firsts = first_of_each_failure(outcomes) if budget > 0 else []
    out = []
    for o in firsts:
        small = shrink(runner, o, budget / len(firsts))
        out.append(
            {
                "from": o.case.label(),
                "to": small.case.label(),
                "status": small.status,
                "stage": small.stage,
                "error": small.error,
                "max_diff": small.max_diff,
                "state_diff": small.state_diff,
            }
        )
    return out


def selected_cases(
    adapter: Adapter,
    world_sizes: tuple[int, ...],
    steps: int,
    families: tuple[str, ...] | None,
    dtypes: tuple[str, ...] | None,
    device: str,
) -> list[Case]:
    """The cases check() runs for the adapter under these selections."""
    chosen = adapter.families & frozenset(families) if families else adapter.families
    chosen = frozenset(f for f in chosen if _runs_for(adapter, f))
    dtypes = tuple(d for d in adapter.dtypes if d in dtypes) if dtypes else adapter.dtypes
    return default_cases(
        chosen, adapter.distributed, world_sizes, dtypes, steps, device, adapter.variants
    )


def _unselected(adapter: Adapter, device: str, started: float) -> dict[str, Any]:
    """The report of an adapter that none of the selected cases applies to: not a verdict (conforms None)."""
    return {
        "adapter": adapter.name,
        "version": adapter.version(),
        "claim": adapter.describe(),
        "device": device,
        "distributed": adapter.distributed,
        "outcomes": [],
        "verdict": "not checked",
        "conforms": None,
        "diagnosis": "not checked: no case of the selected families, dtypes and world sizes applies",
        "minimal_failing_cases": [],
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


def _line(o: Outcome) -> str:
    """One case as the run prints it: status, then the difference, the stage, the routing and the notes."""
    if o.error:
        detail = o.error
    elif o.status == "bitwise":
        detail = ""
    elif o.status == "routed":
        detail = "every param sent to another optimizer"
    elif o.max_diff:
        detail = (
            f"max|dP| {o.max_diff:.3g} ({o.max_ulps:.3g} ulp), first differs at step {o.first_step}, "
            f"{'grows' if o.grows else 'does not grow'}; max|dM| {o.state_diff}"
        )
    else:
        detail = (
            f"params equal; momentum differs (max|dM| {o.state_diff}), first at step {o.first_step}"
        )
    notes = [
        n
        for n in (
            o.stage and f"{o.stage} departs ({o.stage_detail})",
            o.routed and o.status != "routed" and f"routed: params {sorted(o.routed)}",
            o.policy and f"None grads: {o.policy}",
            o.replicas and f"replicas: {o.replicas}",
            o.elementwise and f"rounding: {o.elementwise}",
            o.resumed and f"resume: {o.resumed}",
        )
        if n
    ]
    return f"  {o.case.label():<58} {o.status:<8} {detail}{'; ' if detail and notes else ''}{'; '.join(notes)}"


def print_report(report: dict[str, Any], log=_print) -> None:
    log(f"verdict: {report['verdict']}")
    log(f"diagnosis: {report['diagnosis']}")
    for s in report["minimal_failing_cases"]:
        if s["error"]:
            why = s["error"]
        elif s.get("max_diff"):
            why = f"max|dP| {s['max_diff']:.3g}" + (f"; {s['stage']}" if s.get("stage") else "")
        else:
            why = f"params equal, momentum differs (max|dM| {s.get('state_diff')})"
        log(f"  minimal {s['status']}: {s['to']} ({why})")
    for label in report.get("momentum_read_from", []):
        log(f"  momentum read from: {label}")
    for item in report.get("not_compared", []):
        log(f"  not compared: {item}")
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
        # the checkout's own changes (tracked files, and files git would add), which the commit does not name
        changed = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=normal"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        if commit and changed:
            commit += " with uncommitted changes"
    except (OSError, subprocess.SubprocessError):
        commit = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    from .adapters import package_version

    return {
        "project": f"muon-ref {package_version('muon-ref')}",
        "commit": commit,
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": gpu,
        "python": platform.python_version(),
        "command": " ".join(
            [
                "python -m muon_check",
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
    """The command line: what to check, how to run it, what to report, and an import-path class's claim."""
    from muon_ref import PRESETS

    epilog = (
        f"presets: {', '.join(sorted(PRESETS))}\n"
        f"families: {', '.join(sorted(_known_families()))}\n"
        "world sizes: any positive ints (default 1 2 3 4; the unreduced families run at powers of two only)\n"
        "exit codes: 0 conforms; 1 departs from the claim (a bug, or a convention the diagnosis names);\n"
        "  2 usage error (an unknown name, an empty selection, a distributed-looking candidate without\n"
        "  --distributed, momentum state the check could not map); 3 could not run (import error, or every\n"
        "  case crashed or hung)"
    )

    p = argparse.ArgumentParser(description=__doc__, epilog=epilog, formatter_class=_Formatter)
    _what_to_check(p)
    _how_to_run(p)
    _what_to_report(p)
    _import_path_claim(p)
    return p


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Each option's default, where it has one worth saying (not None, False or empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, [], {}, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _what_to_check(p: argparse.ArgumentParser) -> None:
    """The adapters, suites and setup modes."""
    p.add_argument(
        "--adapter", action="append", default=[], help="MODULE:NAME or CHECKOUT_DIR:MODULE:CLASS"
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="every shipped adapter (muon_check.adapters.shipped)",
    )
    p.add_argument(
        "--origins",
        action="store_true",
        help="each muon_ref preset against its origin "
        "(muon_check.adapters.origins; what make verify runs)",
    )
    p.add_argument(
        "--planted",
        action="store_true",
        help="the planted-bug suite (muon_check.adapters."
        "planted): a small Muon per reachable class of field bug; prints caught K/N",
    )
    p.add_argument(
        "--audit",
        metavar="MODULE:SETUP",
        help="audit a training setup (muon_check.audit.Setup) on a small real model: per param its "
        "optimizer, the blocks Newton-Schulz saw, calls per step, path and findings (--world-sizes, default 4)",
    )
    p.add_argument(
        "--invariance",
        metavar="MODULE:SETUP",
        help="train a setup under every world size, layout and gradient accumulation; each must give the "
        "reference's params bit for bit (muon_check.invariance)",
    )
    p.add_argument(
        "--micro-batches", type=int, default=2, help="micro-batches for --audit and --invariance"
    )
    p.add_argument(
        "--sharding",
        help="for --audit: one of the setup's layouts (its `shardings`: fsdp2, hsdp, ddp, an engine's zero0..zero3); "
        "default: the setup's own",
    )


def _how_to_run(p: argparse.ArgumentParser) -> None:
    """World sizes, steps, families, dtypes, timeouts, device, seed."""
    p.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=[1, 2, 3, 4],
        help="ranks of the distributed cases (3: a scale bug that a power of two hides shows)",
    )
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per case")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="--planted: each case's line too, as it ends (as an --adapter run prints them)",
    )
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
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the ranks' PYTHONHASHSEED (1 + 1000 * seed + rank), recorded in the report (default: 0)",
    )


def _what_to_report(p: argparse.ArgumentParser) -> None:
    """The momentum key, the JSON and markdown outputs, the stated routing, the diagnosis budget."""
    p.add_argument(
        "--state-map",
        metavar="KEY",
        help="the optimizer-state key of the candidate's momentum (momentum_buffer=KEY or KEY); "
        "none: do not compare momentum. Default: the adapter's (momentum_buffer)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="the report: provenance and every adapter's cases, rewritten after every case "
        '("partial": true until the run ends)',
    )
    p.add_argument("--markdown", action="store_true", help="print the README's conformance table")
    p.add_argument(
        "--routing",
        metavar="RULE",
        help="the params the candidate states it sends to another optimizer, by shape: terms joined by ' or ', "
        "each ndim|min_side|max_side|aspect|numel, then !=, ==, > or <, then a number (e.g. 'ndim != 2 or "
        "min_side < 2'); those params are not compared. Default: the adapter's (none)",
    )
    p.add_argument(
        "--search-budget",
        type=float,
        default=SEARCH_BUDGET_S,
        help="seconds of configuration search per adapter's diagnosis (pairs of options, the nearest)",
    )


def _import_path_claim(p: argparse.ArgumentParser) -> None:
    """The options of an optimizer class given by import path (no adapter class)."""
    g = p.add_argument_group("for an optimizer class given by import path")
    g.add_argument("--preset", default="torch")
    g.add_argument("--overrides", type=json.loads, default={}, help="muon_ref options, JSON")
    g.add_argument(
        "--hp-names", type=json.loads, default={}, help='e.g. {"momentum": "mu", "nesterov": null}'
    )
    g.add_argument("--kwargs", type=json.loads, default={}, help="constructor keywords, JSON")
    g.add_argument(
        "--group",
        type=json.loads,
        default={},
        help='param-group keys the class needs, JSON (e.g. {"use_muon": true}): the params go in as one group',
    )
    g.add_argument("--distributed", choices=["dtensor", "replicated", "unreduced"], default=None)


def _planted_families(planted: Planted) -> tuple[str, ...]:
    """The families a planted bug runs: its adapter's, less the long ones (STATE_ROUNDTRIP_FAMILIES: 258
    steps a case) unless the bug's answer names them, in caught_by or bitwise_on (the correct controls run
    every family)."""
    named = planted.caught_by | planted.bitwise_on
    return tuple(
        sorted(
            f for f in planted.adapter.families if f not in STATE_ROUNDTRIP_FAMILIES or f in named
        )
    )


def planted_suite(
    timeout: float,
    steps: int,
    log=_print,
    device: str = "cpu",
    case_log: Callable[..., None] | None = None,
) -> dict[str, Any]:
    """The check measured on candidates it has not seen: the correct controls (muon_check.adapters.controls:
    each must conform) and every planted bug (its families, dtypes and world sizes, no shrinking; judged by
    muon_check.adapters.planted.planted_verdict: a bug absent with this torch counts as a control), every
    case on `device`; one line each, then both figures: false positives (controls not conforming) and misses
    (planted bugs not caught, or caught with the wrong diagnosis). case_log: where each case's line goes as it
    ends (--planted --verbose; by default nowhere), so that a slow or stuck candidate shows which case it is in."""
    pools: dict[tuple, RankPool] = {}  # the suite's own code: its adapters share rank pools
    try:
        return _planted_suite(timeout, steps, log, pools, device, case_log or _silent)
    finally:
        close_pools(pools)


def _planted_suite(
    timeout: float,
    steps: int,
    log: Callable[..., None],
    pools: dict[tuple, RankPool],
    device: str,
    case_log: Callable[..., None],
) -> dict[str, Any]:
    """The correct controls, the planted bugs, the unreachable classes and the setup suite; their tally."""
    from .adapters.controls import CONTROLS
    from .adapters.planted import PLANTED, UNREACHABLE
    from .setup_checks import setup_suite

    started = time.monotonic()
    log(f"planted suite on {device}: {len(CONTROLS)} correct controls, {len(PLANTED)} planted bugs")
    suite = _Suite(timeout, steps, log, pools, device, case_log)
    controls = _run_controls(CONTROLS, suite)
    verdicts, absent = _run_plants(PLANTED, suite)
    for number, reason in UNREACHABLE.items():
        log(f"#{number:<3} not reachable: {reason}")
    setups = setup_suite(log)
    caught, right = (
        sum(v["caught"] for v in verdicts) + setups["caught"],
        sum(v["caught"] and v["right"] for v in verdicts) + setups["right"],
    )
    false_positives = sum(not c["conforms"] for c in controls + absent) + setups["false_positives"]
    total = len(verdicts) + setups["total"]
    wall = round(time.monotonic() - started, 1)
    log(
        f"caught {caught}/{total} planted bugs ({setups['total']} of them setup bugs), diagnosis right for "
        f"{right}; {len(UNREACHABLE)} {'class' if len(UNREACHABLE) == 1 else 'classes'} not reachable ({wall} s)"
    )
    also = f" ({len(absent)} of them a planted bug absent with this torch)" if absent else ""
    n_controls = len(controls) + len(absent) + len(setups["controls"])
    log(
        f"verdict accuracy: false positives {false_positives}/{n_controls} correct controls{also}, misses "
        f"{total - right}/{total} planted bugs (not caught or wrong diagnosis)"
    )
    return {
        "device": device,
        "controls": controls,
        "false_positives": false_positives,
        "planted": verdicts,
        "absent": absent,
        "setups": setups,
        "caught": caught,
        "right": right,
        "misses": total - right,
        "total": total,
        "wall_s": wall,
    }


def _silent(*_: Any) -> None:
    """A log that prints nothing."""


@dataclass(frozen=True)
class _Suite:
    """What every candidate of the planted suite runs with: a case's timeout and steps, the suite's log (a line per
    candidate), the shared rank pools, the device and the case log (a line per case)."""

    timeout: float
    steps: int
    log: Callable[..., None]
    pools: dict
    device: str
    case_log: Callable[..., None] = _silent


def _run_controls(controls: Any, suite: _Suite) -> list[dict[str, Any]]:
    """Each correct control at W = 2 and 3: it must conform (else a false positive)."""
    rows, log = [], suite.log
    for control in controls:
        report = check(
            control(),
            (2, 3),
            suite.steps,
            suite.timeout,
            0.0,
            device=suite.device,
            log=suite.case_log,
            pools=suite.pools,
        )
        rows.append(
            {
                "control": report["adapter"],
                "conforms": report["conforms"],
                "cases": len(report["outcomes"]),
                "diagnosis": report["diagnosis"],
            }
        )
        log(
            f"control {report['adapter']:<40} {'conforms' if report['conforms'] else 'FALSE POSITIVE'} "
            f"({len(report['outcomes'])} cases, {report['wall_s']} s)"
        )
        if not report["conforms"]:
            log(f"     {report['diagnosis']}")
    return rows


def _run_plants(plants: Any, suite: _Suite) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each planted bug on its families: (the verdicts, the plants this torch lacks the cause of: those must
    conform as correct Muons)."""
    from .adapters.planted import planted_verdict

    verdicts, absent, log = [], [], suite.log
    for planted in plants:
        missing = _trigger_missing(planted, suite.device)
        report = check(
            planted.adapter,
            planted.world_sizes,
            suite.steps,
            suite.timeout,
            0.0,
            families=_planted_families(planted),
            device=suite.device,
            log=suite.case_log,
            pools=suite.pools,
        )
        v = planted_verdict(planted, report, missing)
        if missing:
            absent.append(v)
            right = "conforms, as a correct Muon must" if v["right"] else "FALSE POSITIVE"
            log(
                f"#{v['field_bug']:<3} {v['source']:<34} {v['optimizer']:<24} absent with this torch ({missing}): "
                f"{right} ({report['wall_s']} s)"
            )
            continue
        verdicts.append(v)
        caught = ", ".join(f"{f} ({'/'.join(s)})" for f, s in v["by"].items()) or "nothing"
        right = "right" if v["right"] else f"WRONG ({'; '.join(v['wrong'])})"
        log(
            f"#{v['field_bug']:<3} {v['source']:<34} {v['optimizer']:<24} caught by {caught}; diagnosis {right} "
            f"({report['wall_s']} s)"
        )
        log(f"     {v['diagnosis']}")
    return verdicts, absent


def _trigger_missing(planted: Planted, device: str) -> str | None:
    """Why this torch lacks the planted bug's cause (its trigger, run on a pool of its first world size on
    `device`), or None where the bug can occur (and for every bug without a trigger)."""
    if planted.trigger is None:
        return None
    pool = RankPool(planted.world_sizes[0], device)
    try:
        answers = pool.run(planted.trigger, device, timeout=120.0)
    finally:
        pool.close()
    assert len(set(answers)) == 1, (
        f"the ranks disagree on bug {planted.field_bug}'s trigger: {answers}"
    )
    return answers[0]


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


def _distributed_arguments(adapter: Adapter) -> list[str]:
    """The constructor arguments of an ImportPath candidate that name a process group or a mesh (a candidate
    that declares itself distributed); [] for other adapters."""
    if not isinstance(adapter, ImportPath):
        return []
    import inspect

    try:
        params = inspect.signature(adapter._class()).parameters
    except (TypeError, ValueError):
        return []
    return [name for name in params if name in DISTRIBUTED_ARGUMENTS]


DISTRIBUTED_ARGUMENTS = frozenset(
    {"process_group", "device_mesh", "distributed_mesh", "mesh", "group", "dp_group", "pg"}
)


def _state_map(value: str | None) -> str | None | bool:
    """--state-map: KEY or momentum_buffer=KEY (the state key of the candidate's momentum), or none (leave the
    momentum out); False when not given."""
    if value is None:
        return False
    key = value.split("=", 1)[1] if value.startswith("momentum_buffer=") else value
    return None if key.lower() in ("none", "") else key


def _setup_mode(args: argparse.Namespace, argv: list[str] | None) -> int:
    """--audit / --invariance: a training setup rather than an optimizer."""
    from .setup_checks import run_audit, run_invariance

    if args.adapter or args.all or args.origins or args.planted or (args.audit and args.invariance):
        print("error: --audit and --invariance each run alone", file=sys.stderr)
        return 2
    if args.micro_batches < 1:
        print(f"error: --micro-batches must be >= 1, got {args.micro_batches}", file=sys.stderr)
        return 2
    explicit = argv is not None and "--world-sizes" in argv or "--world-sizes" in sys.argv
    try:
        if args.audit:
            sizes = args.world_sizes if explicit else [4]
            return run_audit(args.audit, sizes, args.micro_batches, sharding=args.sharding)
        sizes = args.world_sizes if explicit else [1, 2, 4]
        steps = args.steps if argv is not None and "--steps" in argv else 2
        return run_invariance(args.invariance, sizes, args.micro_batches, steps)
    except (ImportError, AttributeError) as e:
        print(f"error: could not import the setup: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _write_json(path: str, payload: Any) -> None:
    """Written to a temporary file and renamed: a reader (or an interrupt) never sees half a report."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


class _Stop(Exception):
    """A usage or import error of the command line: its message (printed after "error: ") and exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def main(argv: list[str] | None = None) -> int:
    """The command line: the setup modes, the planted suite, or the adapters' check (exit codes: EXIT)."""
    args = _parser().parse_args(argv)
    import torch

    torch.set_num_threads(1)
    try:
        unavailable = device_unavailable(args.device)
        if unavailable:
            raise _Stop(2, f"--device {unavailable}")
        if args.audit or args.invariance:
            return _setup_mode(args, argv)
        if args.planted:
            return _planted_mode(args)
        adapters = _adapters(args)
        _prepare(adapters, args)
        reports = _run_adapters(adapters, args, argv)
        return _exit_code(reports, args)
    except _Stop as stop:
        print(f"error: {stop}", file=sys.stderr)
        return stop.code


def _planted_mode(args: argparse.Namespace) -> int:
    """--planted: the planted suite alone; 0 when every plant is caught and diagnosed right, no false positive."""
    if args.adapter or args.all or args.origins:
        raise _Stop(2, "--planted runs the planted suite alone")
    suite = planted_suite(
        args.timeout or PLANTED_TIMEOUT,
        args.steps,
        device=args.device,
        case_log=_print if args.verbose else None,
    )
    if args.json:
        _write_json(args.json, suite)
    return 0 if suite["right"] == suite["total"] and not suite["false_positives"] else 1


def _adapters(args: argparse.Namespace) -> list[Adapter]:
    """The adapters the command names: --adapter (each loaded with the command's options), --all, --origins."""
    bad = _unknown_names(args)
    if bad:
        raise _Stop(2, bad)
    try:
        adapters = [
            load_adapter(
                spec,
                preset=args.preset,
                overrides=args.overrides,
                hp_names=args.hp_names,
                kwargs=args.kwargs,
                distributed=args.distributed,
                group=args.group,
            )
            for spec in args.adapter
        ]
    except ImportError as e:
        raise _Stop(3, f"could not import the adapter: {e}") from e
    except ValueError as e:
        raise _Stop(2, str(e)) from e
    if args.all:
        from .adapters.shipped import SHIPPED

        adapters += [cls() for cls in SHIPPED.values()]
    if args.origins:
        from .adapters.origins import ORIGINS

        adapters += [cls() for cls in ORIGINS.values()]
    if not adapters:
        raise _Stop(2, "give --adapter MODULE:NAME (repeatable), --all or --origins")
    return adapters


def _prepare(adapters: list[Adapter], args: argparse.Namespace) -> None:
    """The command's --state-map and --routing on every adapter, then the usage checks before any rank starts: a
    plain adapter whose class takes distributed arguments, an adapter that cannot be pickled to the ranks, and
    --families that select no case."""
    state_key = _state_map(args.state_map)
    if args.routing:
        try:
            parse_rule(args.routing)
        except ValueError as e:
            raise _Stop(2, f"--routing {args.routing!r}: {e}") from e
    for adapter in adapters:
        if state_key is not False:
            adapter.state_key = state_key
        if args.routing:
            adapter.routing = args.routing
        _check_sendable(adapter)
    supported = frozenset().union(*(a.families for a in adapters))
    if args.families and not supported & frozenset(args.families):
        raise _Stop(
            2,
            f"--families {' '.join(args.families)} selects no case of these adapters; "
            f"valid: {', '.join(sorted(supported))}",
        )


def _check_sendable(adapter: Adapter) -> None:
    """A plain adapter must not take distributed arguments, and every adapter must pickle (the ranks get it)."""
    if adapter.distributed is None:
        try:
            declared = _distributed_arguments(adapter)
        except ImportError as e:
            raise _Stop(3, f"could not import {adapter.name}: {e}") from e
        if declared:
            raise _Stop(
                2,
                f"{adapter.name} takes {', '.join(declared)}: it looks distributed; rerun "
                "with --distributed dtensor, replicated or unreduced",
            )
    try:
        pickle.dumps(adapter)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the same usage error
        raise _Stop(
            2,
            f"adapter {adapter.name!r} cannot be sent to the ranks ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); define it at module level, under the name "
            "--adapter gives",
        ) from e


def _run_adapters(
    adapters: list[Adapter], args: argparse.Namespace, argv: list[str] | None
) -> list[dict[str, Any]]:
    """The provenance lines, then each adapter's check and report in turn (the JSON rewritten as they go)."""
    origin = {**provenance(argv), "seed": args.seed}
    for key in ("project", "commit", "torch", "cpu_capability", "gpu", "python", "date", "command"):
        _print(f"{key + ':':<16}{origin.get(key)}")
    _print(
        f"{'world sizes:':<16}{' '.join(map(str, args.world_sizes))}; "
        f"ranks spawned, PYTHONHASHSEED 1 + 1000 * {args.seed} + rank"
    )
    reports: list[dict[str, Any]] = []

    def save(current: dict[str, Any] | None = None) -> None:
        if args.json:
            done = reports + ([current] if current else [])
            partial = current is not None or len(done) < len(adapters)
            _write_json(args.json, {"provenance": origin, "partial": partial, "reports": done})

    planned = [
        len(
            selected_cases(
                a, tuple(args.world_sizes), args.steps, args.families, args.dtypes, args.device
            )
        )
        for a in adapters
    ]
    if len(adapters) > 1:
        _print(f"{len(adapters)} adapters, {sum(planned)} cases")
    run_started = time.monotonic()
    for i, adapter in enumerate(adapters):
        if len(adapters) > 1 and i:
            done, elapsed = sum(planned[:i]), time.monotonic() - run_started
            left = elapsed / max(done, 1) * sum(planned[i:])
            _print(
                f"[{done}/{sum(planned)} cases in {elapsed:.0f} s; about {left:.0f} s left at this pace]"
            )
        _print(f"{adapter.describe()}: {planned[i]} cases")
        reports.append(_check_one(adapter, args, save))
        print_report(reports[-1])
        save()
    return reports


def _check_one(adapter: Adapter, args: argparse.Namespace, save: Callable[..., None]) -> dict:
    return check(
        adapter,
        tuple(args.world_sizes),
        args.steps,
        args.timeout or 300.0,
        args.shrink_budget,
        args.families,
        args.dtypes,
        device=args.device,
        seed=args.seed,
        progress=lambda r: save(r),
        search_budget=args.search_budget,
    )


def _exit_code(reports: list[dict[str, Any]], args: argparse.Namespace) -> int:
    """The markdown table if asked, the summary line of several adapters, and the worst verdict's exit code."""
    if args.markdown:
        print(markdown([r for r in reports if r["conforms"] is not None]))
    judged = [r for r in reports if r["conforms"] is not None]
    if not judged:
        raise _Stop(
            2, "no case of the selected families, dtypes and world sizes applies to these adapters"
        )
    if len(reports) > 1:
        cases = [o for r in reports for o in r["outcomes"]]
        _print(
            f"{sum(r['conforms'] for r in judged)}/{len(judged)} adapters conform to their claims; "
            f"{sum(o['status'] == 'bitwise' for o in cases)}/{len(cases)} cases bitwise equal"
        )
    worst = min((r["verdict"] for r in judged), key=PRECEDENCE.index)
    return EXIT[worst]


if __name__ == "__main__":
    sys.exit(main())
