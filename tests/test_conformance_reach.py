"""What the conformance check reaches and how it answers: per-rank hash seeds, state it cannot map, scale bugs that
Newton-Schulz hides at powers of two, candidates that look distributed, candidates that cannot run, hangs named by
rank and collective, and reports written case by case. Each capability comes with its negative control: the same
candidate passing where the check does not look."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import muon_ref
from muon_check import conformance
from muon_check.adapters import Adapter
from muon_check.adapters.cases import Case, family_shapes
from muon_check.adapters.controls import GatherControl, GatherEngine
from muon_check.adapters.oracle import candidate_hyperparameters, judge
from muon_check.adapters.planted import PLANTED
from muon_check.adapters.workers import candidate_steps
from muon_check.conformance import check, main
from muon_check.launch import RankPool, blocked_frame
from tests.conftest import quiet
from tests.conftest import run_conformance as run_main

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------- per-rank hash seeds


class HashOrderEngine(GatherEngine):
    """Gathers the params in the order of a set of their names: the order depends on the process's hash seed, so
    ranks with different seeds gather different params into each other's (same-shaped) slots."""

    def orthogonalized(self, work):
        order = [int(name[1:]) for name in {f"p{i}" for i in range(len(work))}]
        done = dict(zip(order, super().orthogonalized([work[i] for i in order])))
        return [done[i] for i in range(len(work))]


class HashOrderControl(GatherControl):
    name, engine = "gathers in set order", HashOrderEngine
    families = frozenset({"even"})
    dtypes = ("float32",)


def verdict_only(adapter, world_sizes: tuple[int, ...], steps: int) -> dict:
    """check's report without the configuration search (search_budget 0): the search names a diagnosis, the
    verdict is a function of the cases' outcomes alone (muon_check.adapters.verdict.verdict)."""
    return check(adapter, world_sizes, steps, 60.0, 0.0, log=quiet, search_budget=0.0)


def test_a_candidate_ordered_by_a_hash_seed_is_caught_on_spawned_ranks():
    report = verdict_only(HashOrderControl(), (4,), 1)
    assert report["verdict"] == "departs", report["diagnosis"]


def test_negative_control_forked_ranks_share_the_seed_and_miss_it():
    adapter = HashOrderControl()
    case = Case("even", "dtensor", 4, family_shapes("even", "dtensor", 4), steps=1)
    pool = RankPool(4)  # forked from this process: one hash seed for all ranks
    try:
        results = pool.run(
            candidate_steps, adapter, case, candidate_hyperparameters(adapter), timeout=60
        )
    finally:
        pool.close()
    assert judge(case, [(4, results)], "torch", candidate_hyperparameters(adapter)).status == (
        "bitwise"
    )


def test_ranks_get_distinct_recorded_hash_seeds():
    assert conformance.hash_seeds(0, 3) == [1, 2, 3] and conformance.hash_seeds(2, 2) == [
        2001,
        2002,
    ]


# ---------------------------------------------------------------- momentum wherever it is kept


class KeyedMuon(muon_ref.Muon):
    """muon_ref.Muon whose momentum lives under the state key "mom"."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if "mom" in self.state[p]:
                    self.state[p]["momentum_buffer"] = self.state[p].pop("mom")
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if "momentum_buffer" in self.state[p]:
                    self.state[p]["mom"] = self.state[p].pop("momentum_buffer")


class NestedMuon(muon_ref.Muon):
    """muon_ref.Muon whose momentum lives in nested state: state[p][0]["buf"] (a list holding a dict), beside a
    step counter; `scale` multiplies what it keeps there (1: its true momentum)."""

    scale = 1.0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if 0 in self.state[p]:
                    kept = self.state[p].pop(0)[0]["buf"]
                    self.state[p]["momentum_buffer"] = kept / self.scale
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if "momentum_buffer" in self.state[p]:
                    buf = self.state[p].pop("momentum_buffer")
                    self.state[p][0] = [{"buf": buf * self.scale, "step": 1}]


class DoubledNestedMuon(NestedMuon):
    """Keeps twice its momentum (and steps on it halved: its params are muon_ref's)."""

    scale = 2.0


class HiddenMomentumMuon(muon_ref.Muon):
    """Keeps its momentum outside the optimizer state and a param-sized tensor that is not a momentum in it."""

    @torch.no_grad()
    def step(self, closure=None):
        hidden = self.__dict__.setdefault("hidden", {})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].pop("noise", None)
                if p in hidden:
                    self.state[p]["momentum_buffer"] = hidden[p]
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if "momentum_buffer" in self.state[p]:
                    hidden[p] = self.state[p].pop("momentum_buffer")
                    self.state[p]["noise"] = torch.rand(
                        p.shape, generator=torch.Generator().manual_seed(1)
                    )


FAST = ["--steps", "2", "--shrink-budget", "0", "--families", "square", "tall"]


def test_momentum_under_another_key_is_found_by_value_and_compared(tmp_path):
    spec = f"{__name__}:KeyedMuon"
    code, out, _ = run_main(["--adapter", spec, *FAST, "--json", str(tmp_path / "r.json")])
    assert code == 0 and "verdict: conforms" in out, out
    outcome = json.loads((tmp_path / "r.json").read_text())["reports"][0]["outcomes"][0]
    assert outcome["momentum_read_from"] == [
        "state[p]['mom'] (found by value after the first step)"
    ]
    code, out, _ = run_main(["--adapter", spec, *FAST, "--state-map", "mom"])
    assert code == 0 and "verdict: conforms" in out, out


def test_momentum_in_nested_state_is_found_and_a_wrong_one_departs_at_the_momentum_stage():
    code, out, _ = run_main(["--adapter", f"{__name__}:NestedMuon", *FAST])
    assert code == 0 and "verdict: conforms" in out, out
    # negative control: the same nesting with twice the momentum is found (proportional) and departs there
    code, out, _ = run_main(["--adapter", f"{__name__}:DoubledNestedMuon", *FAST])
    assert code == 1 and "momentum departs on" in out, out


def test_param_sized_state_that_is_not_the_momentum_is_a_usage_error_until_mapped(tmp_path):
    spec = f"{__name__}:HiddenMomentumMuon"
    code, out, _ = run_main(["--adapter", spec, *FAST])
    assert code == 2, out
    assert (
        "momentum not found: param-sized state [\"['noise']\"]" in out and "--state-map" in out
    ), out
    json_path = tmp_path / "r.json"
    code, out, _ = run_main(
        ["--adapter", spec, *FAST, "--state-map", "none", "--json", str(json_path)]
    )
    assert code == 0, out
    not_compared = json.loads(json_path.read_text())["reports"][0]["not_compared"]
    assert any(item.startswith("momentum: left out (--state-map none)") for item in not_compared)
    assert any(
        item.startswith("state[p]['noise'] (param-sized, not the momentum)")
        for item in not_compared
    )


def test_negative_control_a_known_key_is_compared_without_a_map():
    code, out, _ = run_main(["--adapter", "muon_ref:Muon", *FAST])
    assert code == 0 and "momentum not found" not in out, out


# ---------------------------------------------------------------- scale bugs Newton-Schulz hides


class ScaledGradientEngine(GatherEngine):
    """Uses W times the gradient (a sum over ranks taken for their mean); its momentum is not exposed."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    W = p.device_mesh.size() if hasattr(p, "device_mesh") else 1
                    p.grad.mul_(W)
        super().step(closure)


class ScaledGradientControl(GatherControl):
    name, engine, state_key = "gradient times W", ScaledGradientEngine, None
    dtypes = ("float32",)


def _verdict(families: set[str], world_sizes: tuple[int, ...]) -> str:
    adapter = ScaledGradientControl()
    adapter.families = frozenset(families)
    return verdict_only(adapter, world_sizes, 2)["verdict"]


def test_a_scale_bug_hidden_at_two_ranks_is_caught_at_three_and_by_tiny_gradients():
    # negative control: at W = 2 on ordinary gradients, Newton-Schulz cancels the exact factor 2
    assert _verdict({"even", "uneven"}, (2,)) == "conforms"
    assert _verdict({"even", "uneven"}, (3,)) == "departs"
    assert _verdict({"badly_scaled"}, (2,)) == "departs"


# ---------------------------------------------------------------- candidates that look distributed


class CountsRanks(muon_ref.Muon):
    """A correct single-device Muon that asks for the world size (a distributed candidate in disguise)."""

    @torch.no_grad()
    def step(self, closure=None):
        dist.get_world_size()
        return super().step(closure)


class TakesAGroup(muon_ref.Muon):
    def __init__(
        self, params, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, process_group=None
    ):
        super().__init__(
            params, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov
        )


def test_a_candidate_that_uses_torch_distributed_without_distributed_is_refused():
    code, out, _ = run_main(["--adapter", f"{__name__}:CountsRanks", *FAST])
    assert code == 2 and "refused" in out and "--distributed" in out, out
    code, _, err = run_main(["--adapter", f"{__name__}:TakesAGroup", *FAST])
    assert code == 2 and "process_group" in err and "--distributed" in err, err
    # negative control: declared distributed, the same candidate runs (replicated: every rank the same)
    code, out, _ = run_main(
        [
            "--adapter",
            f"{__name__}:CountsRanks",
            *FAST,
            "--distributed",
            "replicated",
            "--world-sizes",
            "2",
            "--families",
            "even",
        ]
    )
    assert code == 0, out


# ---------------------------------------------------------------- could not run


class Missing(Adapter):
    name = "needs a package that is not there"

    def build(self, params, **hp):
        import a_package_that_does_not_exist  # noqa: F401


def test_a_candidate_that_cannot_import_exits_3():
    code, out, _ = run_main(["--adapter", f"{__name__}:Missing", *FAST])
    assert code == 3 and "could not run: " in out and "ModuleNotFoundError" in out, out
    code, _, err = run_main(["--adapter", "a_module_that_does_not_exist:Muon"])
    assert code == 3 and "could not import" in err, err


def test_an_adapter_that_cannot_be_pickled_is_a_usage_error():
    class Local(Adapter):  # defined in a function: the ranks cannot import it
        name = "local"

    globals()["LocalAdapter"] = Local
    try:
        code, _, err = run_main(["--adapter", f"{__name__}:LocalAdapter", *FAST])
    finally:
        del globals()["LocalAdapter"]
    assert code == 2 and "cannot be sent to the ranks" in err and "\n" not in err.strip(), err


# ---------------------------------------------------------------- hangs named by rank and collective


def test_a_hang_names_each_rank_and_the_collective_it_is_blocked_in():
    planted = PLANTED[0]  # an empty box skips its param: the other rank waits in its gather
    report = check(  # in empty alone: row_sharded's empty boxes hang it too
        planted.adapter, planted.world_sizes, 2, 10.0, 0.0, families=("empty",), log=quiet
    )
    (hang,) = [o for o in report["outcomes"] if o["status"] == "hang"]
    assert "rank 0 blocked in torch.distributed full_tensor" in hang["error"], hang["error"]
    assert "called from planted.py:" in hang["error"], hang["error"]


def test_blocked_frame_reads_a_faulthandler_dump():
    dump = (
        "Thread 0x1 (most recent call first):\n"
        '  File "/x/torch/distributed/distributed_c10d.py", line 10 in all_reduce\n'
        '  File "/x/torch/distributed/c10d_logger.py", line 5 in wrapper\n'
        '  File "/y/mine.py", line 7 in step\n'
    )
    assert blocked_frame(dump) == (
        "blocked in torch.distributed all_reduce (distributed_c10d.py), called from mine.py:7 in step"
    )
    assert blocked_frame(dump.replace("torch/distributed", "torch/optim")) is None  # no collective


# ---------------------------------------------------------------- reports written case by case


def test_the_json_is_written_after_every_case_and_marked_partial_until_the_end(
    tmp_path, monkeypatch
):
    out = tmp_path / "report.json"
    real = conformance.check

    def interrupted(*args, progress=None, **kwargs):
        calls = []

        def after_case(report):
            progress(report)
            calls.append(report)
            if len(calls) == 2:
                raise KeyboardInterrupt

        return real(*args, progress=after_case, **kwargs)

    monkeypatch.setattr(conformance, "check", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_main(["--adapter", "muon_ref:Muon", *FAST, "--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["partial"] is True and payload["provenance"]["seed"] == 0
    (report,) = payload["reports"]
    assert report["partial"] is True and len(report["outcomes"]) == 2 < report["cases_planned"]


def test_help_lists_presets_families_world_sizes_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for needle in (
        "presets: ",
        "families: ",
        "badly_scaled",
        "world sizes: ",
        "(default: [1, 2, 3, 4])",
        "exit codes: 0 conforms",
        "3 could not run",
        "--state-map",
    ):
        assert needle in text, needle
