"""DistributedMuon (muon_dist/optim.py) on ranks as threads (ThreadComm) with plain tensors, replicated on every
rank: the optimizer's own duties, each checked against muon_ref.Muon given the same params and gradients.

    its params and momentum buffers equal muon_ref.Muon's bitwise, step after step (and across a change of the
        group's hyperparameters, which the next step reads);
    state: exactly the params of its groups, each with "momentum_buffer" (zeros from construction on; a param
        removed from its group loses its state at the next step);
    last_report: (name, path) per param in param-group order (None: no gradient), and this rank's bytes by path
        as the plan's formulas give them (muon_dist.expected_bytes), beside the step's checks;
    step(closure) returns the closure's loss; a caller's mistake raises ValueError on every rank.
DTensor params need a process group: tests/dist/test_equivalence.py runs them on gloo.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import muon_ref
from muon_check.fixtures import same_bits, seeded
from muon_dist import DistributedMuon, ThreadComm, ThreadWorld, expected_bytes
from muon_dist.agreement import CHECKS
from muon_dist.comm import run_threads
from muon_dist.optim import UPDATE_LAYOUT
from muon_ref.presets import PRESETS
from tests.conftest import examples

from .checks import timeout_for

ITEMSIZES = {"torch.float32": 4, "torch.bfloat16": 2}


def groups_of(params: list[torch.Tensor], sizes: list[int], keys: list[dict]) -> list[dict]:
    out, start = [], 0
    for size, extra in zip(sizes, keys):
        out.append(
            {
                "params": params[start : start + size],
                "param_names": [f"w{start + i}" for i in range(size)],
                **extra,
            }
        )
        start += size
    return out


def on_threads(W: int, rank_main) -> list[object]:
    """rank_main(comm) on every rank of a world of W threads: each rank's result or the exception it raised."""
    world, results = ThreadWorld(W, timeout_s=10), [None] * W

    def guarded(rank: int) -> None:
        try:
            results[rank] = rank_main(ThreadComm(world, rank))
        except Exception as e:  # noqa: BLE001 - compared by the test
            results[rank] = e

    run_threads(W, guarded)
    return results


@pytest.mark.timeout(timeout_for(60))
@example(
    W=1,
    shapes=[(1, 1)],
    split=0,
    preset="dion",
    dtype=torch.float32,
    no_grad={0},
    remainder="agrs",
    dispatch="batched",
    atomic=True,
)  # an atomic step in which no param has a gradient: no write group
@settings(max_examples=examples(0.5))
@given(
    W=st.integers(1, 4),
    shapes=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=6),
    split=st.integers(0, 6),
    preset=st.sampled_from(sorted(PRESETS)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    no_grad=st.sets(st.integers(0, 5), max_size=2),
    remainder=st.sampled_from(["agrs", "padded_all_to_all"]),
    dispatch=st.sampled_from(["batched", "global"]),
    atomic=st.booleans(),
)
def test_distributed_muon_on_replicated_params_equals_muon_ref_step_after_step(
    W, shapes, split, preset, dtype, no_grad, remainder, dispatch, atomic
) -> None:
    sizes = [min(split, len(shapes)), len(shapes) - min(split, len(shapes))]
    keys = [{}, {"lr": 0.05, "weight_decay": 0.0}]
    fulls = [seeded(s, i, dtype) for i, s in enumerate(shapes)]
    grads = [
        [seeded(s, 100 * step + i + 1, dtype) for i, s in enumerate(shapes)] for step in range(3)
    ]

    def steps(opt, params: list[torch.Tensor], report=None) -> None:
        for step in range(3):
            if step == 2:  # the group's new hyperparameters hold from the next step on
                opt.param_groups[0]["lr"] *= 3
            for i, p in enumerate(params):
                p.grad = None if step == 1 and i in no_grad else grads[step][i].clone()
            opt.step()
            if report is not None:
                report(step)

    ref_params = [f.clone() for f in fulls]
    ref = muon_ref.Muon(
        groups_of(ref_params, sizes, keys), preset=preset, update_layout=UPDATE_LAYOUT
    )
    steps(ref, ref_params)

    def rank_main(comm: ThreadComm) -> dict:
        params = [f.clone() for f in fulls]
        opt = DistributedMuon(
            groups_of(params, sizes, keys),
            preset=preset,
            comm=comm,
            remainder=remainder,
            dispatch=dispatch,
            atomic=atomic,
        )
        assert opt.last_report is None and opt.last_plan is None
        assert all(
            torch.equal(opt.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in params
        )
        reports = []
        steps(
            opt,
            params,
            lambda step: reports.append(
                (opt.last_report, expected_bytes(opt.last_plan, comm.rank, ITEMSIZES))
            ),
        )
        return {
            "params": params,
            "buffers": [opt.state[p]["momentum_buffer"] for p in params],
            "reports": reports,
            "state_keys": [sorted(opt.state[p]) for p in params],
            "num_states": len(opt.state),
        }

    for result in on_threads(W, rank_main):
        assert not isinstance(result, BaseException), result
        for got, want in zip(result["params"], ref_params):
            assert same_bits(got, want)
        for got, p in zip(result["buffers"], ref_params):
            assert same_bits(got, ref.state[p]["momentum_buffer"])
        assert result["state_keys"] == [["momentum_buffer"]] * len(shapes) and result[
            "num_states"
        ] == len(shapes)
        for step, (report, planned) in enumerate(result["reports"]):
            stepped = [not (step == 1 and i in no_grad) for i in range(len(shapes))]
            assert report.paths == tuple(
                (f"w{i}", "replicated" if s else None) for i, s in enumerate(stepped)
            )
            assert {k: v for k, v in report.bytes_by_path.items() if k not in CHECKS} == planned
            assert (
                set(report.bytes_by_path) - set(planned) <= set(CHECKS)
                and "plan_digest" in report.bytes_by_path
            )


@pytest.mark.timeout(60)
def test_a_param_removed_from_its_group_loses_its_state_at_the_next_step_and_an_added_one_starts_from_zeros() -> (
    None
):
    def rank_main(comm: ThreadComm) -> tuple:
        a, b, c = seeded((4, 3), 0), seeded((3, 5), 1), seeded((2, 2), 4)
        opt = DistributedMuon([a, b], comm=comm)
        a.grad, b.grad = seeded((4, 3), 2), seeded((3, 5), 3)
        opt.step()
        opt.param_groups[0]["params"] = [b]
        opt.step()
        opt.add_param_group({"params": [c]})
        return [p is b or p is c for p in opt.state], torch.equal(
            opt.state[c]["momentum_buffer"], torch.zeros(2, 2)
        )

    assert on_threads(2, rank_main) == [([True, True], True)] * 2


@pytest.mark.timeout(60)
def test_step_returns_the_loss_of_its_closure_computed_with_gradients_enabled() -> None:
    def rank_main(comm: ThreadComm) -> tuple:
        w = seeded((3, 3), 0).requires_grad_()
        opt = DistributedMuon([w], comm=comm)

        def closure() -> float:
            opt.zero_grad()
            loss = (w * w).sum()
            loss.backward()
            return loss.item()

        return opt.step(closure), w.grad is not None

    want = float((seeded((3, 3), 0) ** 2).sum())
    assert on_threads(2, rank_main) == [(want, True)] * 2


@pytest.mark.timeout(60)
def test_params_that_differ_across_ranks_raise_value_error_on_every_rank() -> None:
    def rank_main(comm: ThreadComm) -> None:
        w = seeded((3, 4) if comm.rank == 0 else (4, 3), 0)
        opt = DistributedMuon([w], comm=comm)
        w.grad = torch.ones_like(w)
        opt.step()

    errors = on_threads(2, rank_main)
    assert all(
        isinstance(e, ValueError) and "ranks [1] disagree with rank 0" in str(e) for e in errors
    ), errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", [None, float("nan")])
def test_a_step_agrees_in_one_control_all_gather_unless_a_gradient_is_non_finite(planted) -> None:
    """The plan digest carries whether a rank has a non-finite gradient: the flags are gathered only then
    (negative control: a NaN on rank 1 adds the flags' all-gather on every rank, and the param skips)."""

    def rank_main(comm: ThreadComm) -> tuple[list[str], bool]:
        w = seeded((4, 4), 0)
        opt = DistributedMuon([{"params": [w], "param_names": ["w"]}], comm=comm, nonfinite="skip")
        w.grad = seeded((4, 4), 1)
        if planted is not None and comm.rank == 1:
            w.grad[0, 0] = planted
        opt.step()
        before_data = [what for what, *_ in comm.calls][:2]
        return before_data, bool(torch.equal(w, seeded((4, 4), 0)))

    results = on_threads(2, rank_main)
    if planted is None:
        assert all(r[0][0] == "plan_digest" and r[0][1] != "nonfinite_check" for r in results), (
            results
        )
        assert not any(unchanged for _, unchanged in results), results
    else:
        assert all(r == (["plan_digest", "nonfinite_check"], True) for r in results), results


@pytest.mark.timeout(60)
def test_a_disagreement_beside_a_non_finite_gradient_names_the_disagreeing_rank_on_every_rank() -> (
    None
):
    """Rank 1's plan differs and rank 2's gradient is NaN (its tagged digest differs from rank 0's too): every
    rank names rank 1 only, from the untagged digests."""

    def rank_main(comm: ThreadComm) -> None:
        w = seeded((3, 4) if comm.rank == 1 else (4, 3), 0)
        opt = DistributedMuon([w], comm=comm, nonfinite="skip")
        w.grad = torch.full_like(w, float("nan") if comm.rank == 2 else 1.0)
        opt.step()

    errors = on_threads(3, rank_main)
    assert all(
        isinstance(e, ValueError) and "ranks [1] disagree with rank 0" in str(e) for e in errors
    ), errors


@pytest.mark.timeout(60)
def test_a_bad_gradient_on_one_rank_raises_there_and_stops_every_other_rank() -> None:
    def rank_main(comm: ThreadComm) -> None:
        w = seeded((3, 4), 0)
        opt = DistributedMuon([{"params": [w], "param_names": ["w"]}], comm=comm)
        w.grad = torch.ones(3, 4).to_sparse() if comm.rank == 1 else torch.ones(3, 4)
        opt.step()

    errors = on_threads(2, rank_main)
    assert isinstance(errors[1], ValueError) and "w of shape (3, 4): sparse gradients" in str(
        errors[1]
    ), errors
    assert isinstance(errors[0], ValueError) and "ranks [1] disagree with rank 0" in str(
        errors[0]
    ), errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "change", [{"split_dim": 1}, {"num_heads": 3}, {"num_heads": None, "split_dim": 0}]
)
def test_a_layout_key_changed_between_steps_is_read_at_the_next_step(change: dict) -> None:
    """The layout is cached per param while what it was read from stays the same (DistributedMuon.layout): a group's
    num_heads or split_dim changed after a step gives the next step the new heads, as muon_ref.Muon reads them."""
    shape, first = (6, 6), {"num_heads": 2, "split_dim": 0}
    grads = [seeded(shape, 10 + step) for step in range(2)]

    def two_steps(opt, w: torch.Tensor) -> torch.Tensor:
        for step in range(2):
            if step == 1:
                opt.param_groups[0].update(change)
            w.grad = grads[step].clone()
            opt.step()
        return w

    want = two_steps(
        muon_ref.Muon([{"params": [w := seeded(shape, 0)], **first}], update_layout=UPDATE_LAYOUT),
        w,
    )
    control = seeded(shape, 0)
    ref = muon_ref.Muon([{"params": [control], **first}], update_layout=UPDATE_LAYOUT)
    for step in range(2):
        control.grad = grads[step].clone()
        ref.step()
    assert not same_bits(
        control, want
    )  # the change matters: without it the second step gives other bits

    def rank_main(comm: ThreadComm) -> torch.Tensor:
        w = seeded(shape, 0)
        return two_steps(DistributedMuon([{"params": [w], **first}], comm=comm), w)

    for got in on_threads(2, rank_main):
        assert not isinstance(got, BaseException), got
        assert same_bits(got, want)


@pytest.mark.timeout(60)
def test_an_added_param_group_is_checked_when_it_is_added_naming_its_param() -> None:
    """add_param_group checks the group it adds (its config and each param's layout), not the first group."""

    def rank_main(comm: ThreadComm) -> None:
        opt = DistributedMuon([seeded((4, 4), 0)], comm=comm)
        opt.add_param_group({"params": [seeded((6, 4), 1)], "num_heads": 4})

    errors = on_threads(2, rank_main)
    assert all(isinstance(e, ValueError) and "of shape (6, 4)" in str(e) for e in errors), errors


@pytest.mark.parametrize("preset,sent", [("torch", "torch.bfloat16"), ("emerging", None)])
def test_directions_travel_in_the_kernels_input_cast_only_where_the_kernel_casts_first(
    preset, sent
) -> None:
    """ "torch" casts the fp32 direction to bf16 before normalising (muon_ref.newton_schulz.input_cast), so
    DistributedMuon's entries send bf16 directions; "emerging" normalises in fp32 first, so they travel in fp32.
    Only batches whose path moves directions use it (a replicated one keeps the param's dtype); the bits equal
    muon_ref.Muon's either way (tests/dist/test_step_threads.py, tests/dist/test_equivalence.py)."""
    from muon_dist import Entry, Options, ParamLayout
    from muon_dist.kernels import backend, send_dtype
    from muon_dist.plan import plan
    from muon_ref.optim import group_config
    from muon_ref.presets import preset_defaults

    cfg = group_config(preset_defaults(preset, {}))
    chosen = send_dtype(backend("torch"), cfg, torch.float32)
    assert (None if chosen is None else str(chosen)) == sent
    assert (
        send_dtype(backend("gram"), cfg, torch.float32) is None
    )  # a backend that does not read through it
    layouts = [
        ParamLayout(f"p{i}", (4, 4), "torch.float32", (0, 1), (code,))
        for i, code in enumerate(("S0", "S0", "R"))
    ]
    step_plan = plan(
        tuple(Entry(lay, 0, "torch.bfloat16", True, sent) for lay in layouts), Options()
    )
    assert {b.path: b.direction_dtype for b in step_plan.batches} == {
        "all_to_all": sent or "torch.float32",
        "replicated": "torch.float32",
    }
