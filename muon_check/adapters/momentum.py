"""Where a candidate keeps its momentum: read from the adapter, or found by value in its optimizer state.

A candidate's momentum is compared with the reference's after every recorded step and at the end
(oracle.compare). The adapter names it (Adapter.momentum: the state key `state_key`, "momentum_buffer" by default,
or its own method); where the adapter's momentum() gives nothing on every rank, it is looked for by value among the
param-sized tensors of the param's state that the ranks recorded after the first step (workers.state_tensors:
nested dicts, lists and tuples, any key):

    found(path)  iff  on every rank holding a box, state[p]{path} after step 1 has the bits of the reference's
                      momentum after step 1, or (no path has them) is proportional to the step's gradient
                      (cosine >= PROPORTIONAL; after one step from zero every momentum form is a multiple of G)

One path found: compared there (a momentum of another form then departs at the momentum stage, located). None
found among param-sized state: "unmapped", and the run is a usage error naming the state keys seen. No
param-sized state: the momentum is not kept in the optimizer state, listed as not compared. A routed param's state
belongs to another optimizer and is not read.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..fixtures import same_bits
from .cases import Case, local_box, oracle_gradients

# cosine between a state tensor and the first step's gradient above which the tensor is taken for a momentum of
# another form (an EMA's (1 - mu) G, a sum's G, an fp32 copy of a bf16 one)
PROPORTIONAL = 0.999


def momentum_sources(
    case: Case, segments: list, reference: dict, routed: dict[int, str], search: bool = True
) -> tuple[tuple[str, Any], ...]:
    """Per param, where its momentum is read (oracle.View.sources). search False: the adapter said not to compare
    a momentum it does not expose (--state-map none)."""
    return tuple(
        _source(case, segments, reference, i, routed, search) for i in range(len(case.shapes))
    )


def _source(
    case: Case, segments: list, reference: dict, i: int, routed: dict[int, str], search: bool
) -> tuple[str, Any]:
    if i in routed:
        return ("none", f"routed to another optimizer ({routed[i]})")
    results = [r for _, rs in segments for r in rs]
    if any(r["momentum"][i] is not None for r in results):
        return ("adapter", None)
    if not search:
        return ("none", "left out (--state-map none)")
    paths = state_paths(segments, i)
    if not paths:
        return ("none", "the candidate keeps no param-sized state for it")
    path = find(case, segments, reference, i)
    if path is not None:
        return ("state", path)
    return ("unmapped", tuple(paths))


def state_paths(segments: list, i: int) -> list[str]:
    """Every path of a param-sized tensor in param i's state, on any rank after any recorded step."""
    return sorted(
        {
            path
            for _, results in segments
            for r in results
            for rec in r.get("recorded", {}).values()
            for path in rec["state"][i]
        }
    )


def find(case: Case, segments: list, reference: dict, i: int) -> str | None:
    """The path of param i's momentum among the state recorded after the first step, or None (module docstring)."""
    world, results = segments[0]
    run = next(iter(reference.values()))
    exact: set[str] | None = None
    proportional: set[str] | None = None
    grad = _first_gradient(case, i)
    for rank, r in enumerate(results):
        states = r.get("recorded", {}).get(0, {}).get("state")
        if states is None:
            return None
        want = local_box(run.momenta[0][i], case, rank, world)
        g = local_box(grad, case, rank, world) if grad is not None else None
        if want.numel() == 0:
            continue  # an empty box holds nothing to match
        found = {p for p, t in states[i].items() if t.shape == want.shape and same_bits(t, want)}
        close = {p for p, t in states[i].items() if g is not None and _proportional(t, g)}
        exact = found if exact is None else exact & found
        proportional = close if proportional is None else proportional & close
    for paths in (exact, proportional):
        if paths:
            return _preferred(sorted(paths))
    return None


def _first_gradient(case: Case, i: int) -> Tensor | None:
    """The gradient param i steps on at step 1 (the reference's: the mean over ranks in unreduced mode)."""
    grads = oracle_gradients(case, 0)
    return None if grads[i] is None else grads[i].cpu()


def _proportional(t: Tensor, g: Tensor) -> bool:
    if t.shape != g.shape or t.numel() < 2:
        return False
    a, b = t.double().reshape(-1), g.double().reshape(-1)
    norms = a.norm() * b.norm()
    return bool(norms > 0) and float(a @ b / norms) >= PROPORTIONAL


def _preferred(paths: list[str]) -> str:
    """One path of several that match: the one named like a momentum, else the first."""
    named = [p for p in paths if any(w in p.lower() for w in ("mom", "buf", "exp_avg'"))]
    return (named or paths)[0]


def second_moment(case: Case, segments: list, i: int) -> str | None:
    """The path of an Adam-style second moment of param i (a state tensor after the first step that is >= 0 and
    proportional to G * G), or None: such a param is stepped by an Adam-family optimizer."""
    grad = _first_gradient(case, i)
    if grad is None:
        return None
    world, results = segments[0]
    common: set[str] | None = None
    for rank, r in enumerate(results):
        states = r.get("recorded", {}).get(0, {}).get("state")
        if states is None:
            return None
        g = local_box(grad, case, rank, world)
        if g.numel() == 0:
            continue
        found = {
            p
            for p, t in states[i].items()
            if t.shape == g.shape and bool((t >= 0).all()) and _proportional(t, g.double() ** 2)
        }
        common = found if common is None else common & found
    return sorted(common)[0] if common else None


__all__ = ["PROPORTIONAL", "find", "momentum_sources", "second_moment", "state_paths"]
