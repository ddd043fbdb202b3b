"""A smoke run of the benchmark code at a tiny size (tiny_moe, W = 2): the benchmarks themselves
(`python -m benchmarks`) never run in `make test`. It can fail: every method must equal muon_ref bitwise, the
baselines' byte counts must be exactly the bytes of the tensors their collectives send, and the memory
method must read a known allocation pattern."""

from __future__ import annotations

import gc
import math
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch

from benchmarks import balance_table, memory, peers
from benchmarks.run import (
    METHODS,
    PEAK_SETTLED,
    Bench,
    equals_reference,
    main,
    muon_specs,
    rank_bench,
    reference,
    summarise,
    unsettled_peaks,
)
from muon_check.launch import RankPool
from muon_dist.geometry import chunk_bounds

BENCH = Bench("tiny_moe", world_size=2, warmup=1, steps=1)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    pool = RankPool(BENCH.world_size)
    try:
        return pool.run(rank_bench, BENCH, timeout=60)
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_every_method_equals_muon_ref_bitwise(results):
    want = reference(BENCH)
    assert [m for m in METHODS if not equals_reference(results, m, want)] == []


@pytest.mark.timeout(30)
def test_a_one_bit_difference_in_a_baseline_is_caught(results):
    want = reference(BENCH)
    broken = [dict(r, shards=dict(r["shards"])) for r in results]
    shard = broken[1]["shards"]["gather_scatter"][0].clone()
    shard.view(torch.int32).view(-1)[0] ^= 1  # the last mantissa bit of one element
    broken[1]["shards"]["gather_scatter"] = [shard] + broken[1]["shards"]["gather_scatter"][1:]
    assert not equals_reference(broken, "gather_scatter", want)


def padded_box_elements(shape: tuple[int, ...], world_size: int) -> int:
    """Elements of one rank's box padded to the largest box (torch.chunk over dim 0)."""
    return chunk_bounds(shape[0], world_size, 0)[1] * math.prod(shape[1:])


@pytest.mark.timeout(30)
def test_baseline_bytes_are_the_bytes_their_collectives_send(results):
    W, fp32, bf16 = BENCH.world_size, 4, 2
    shapes = [s.shape for s in muon_specs(BENCH.table)]
    full_tensor = sum((W - 1) * padded_box_elements(s, W) * fp32 for s in shapes)
    for rank, r in enumerate(results):
        assert r["bytes"]["full_tensor"] == (
            full_tensor,
            0,
            len(shapes),
        )  # (data, control, collectives)
        # owner i mod W scatters W - 1 padded bf16 boxes; every other rank sends it one padded fp32 box
        gather_scatter = sum(
            padded_box_elements(s, W) * ((W - 1) * bf16 if i % W == rank else fp32)
            for i, s in enumerate(shapes)
        )
        assert r["bytes"]["gather_scatter"] == (
            gather_scatter,
            0,
            2 * len(shapes),
        )  # a gather and a scatter each


@pytest.mark.timeout(30)
def test_memory_method_reads_a_known_allocation_pattern(results):
    assert memory.validate() == 6_000
    assert all(r["peak_bytes"][m] > 0 for r in results for m in METHODS)


@pytest.mark.timeout(30)
def test_memory_method_reads_the_same_when_a_collection_would_free_garbage_inside_a_run():
    """benchmarks.memory settles garbage: a run starts after a collection and runs with the cyclic collector off,
    so a block that a reference cycle kept from before the run is never freed inside it (the reading is what the
    call holds, not when the collector ran). Negative control: with settle_garbage=False the known pattern after
    12,000 B of garbage and a collection reads 0 B, not 6,000 B."""
    assert memory.validate() == 6_000
    with pytest.raises(RuntimeError, match=r"read \[6000, 6000, 0, 0\] B"):
        memory.validate(settle_garbage=False)
    assert gc.isenabled()  # as it was before


@pytest.mark.timeout(30)
def test_a_rows_peak_is_the_largest_rank_median_and_moved_readings_are_reported(results):
    """summarise: a method's peak is the largest over ranks of each rank's median reading, between the least and
    the most reading of any rank and step; unsettled_peaks names exactly the rows whose readings lie more than
    PEAK_SETTLED apart. Negative control: one reading of one rank raised by a tenth makes its row reported."""
    rows = summarise(BENCH, results, reference(BENCH))
    for row in rows:
        per_rank = [r["peak_readings"][row["method"]] for r in results]
        assert row["peak_bytes"] == max(int(statistics.median(p)) for p in per_rank)
        assert row["peak_min_bytes"] <= row["peak_bytes"] <= row["peak_max_bytes"]
    moved = {
        r["method"] for r in rows if r["peak_max_bytes"] > (1 + PEAK_SETTLED) * r["peak_min_bytes"]
    }
    assert [m.split()[0] for m in unsettled_peaks(rows)] == [
        r["method"] for r in rows if r["method"] in moved
    ]
    bumped = [dict(r, peak_readings=dict(r["peak_readings"])) for r in results]
    readings = list(bumped[1]["peak_readings"]["distributed"])
    bumped[1]["peak_readings"]["distributed"] = [max(readings) * 11 // 10 + 1, *readings[1:]]
    reported = unsettled_peaks(summarise(BENCH, bumped, reference(BENCH)))
    assert {m.split()[0] for m in reported} == moved | {"distributed"}


RESIDENT_CHECK = """
from benchmarks import memory
print(memory.resident_unavailable())
print(memory.validate_resident())
try:
    memory.threaded_readings(memory.peak_extra_bytes)
except RuntimeError as error:
    print("control:", error)
"""


@pytest.mark.timeout(60)
def test_resident_peaks_see_a_second_threads_block_which_the_profiler_does_not():
    """memory.resident_peak_extra_bytes, in a process started with RESIDENT_ENV on Linux with glibc: the threaded
    pattern (4 MiB held while a second thread fills and frees 2 MiB, then 1 MiB) reads 6 MiB within
    RESIDENT_TOLERANCE_BYTES. Negative control: the profiler's peak_extra_bytes reads exactly 5 MiB there and fails
    the same check. Without RESIDENT_ENV (this test process) the method says why it cannot run; elsewhere than
    Linux the child says why instead of reading."""
    assert "MALLOC_MMAP_THRESHOLD_" in (memory.resident_unavailable() or "")
    child = subprocess.run(
        [sys.executable, "-c", RESIDENT_CHECK],
        env={**os.environ, **memory.RESIDENT_ENV},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    why_not, validated, control = child.stdout.strip().splitlines()[-3:]
    if sys.platform.startswith("linux"):
        assert why_not == "None"
        assert abs(int(validated) - memory.THREADED_PEAK) <= memory.RESIDENT_TOLERANCE_BYTES
        assert control == (
            f"control: read {[5 << 20] * 3} B on a pattern whose peak is {memory.THREADED_PEAK} B, 2 MiB of "
            "it on a second thread"
        )
    else:
        assert "Linux" in why_not


@pytest.mark.timeout(30)
def test_a_rows_resident_peak_is_the_largest_rank_median(results):
    """summarise with resident_results' per-rank readings: the row's resident_peak_bytes is the largest over ranks
    of each rank's median reading; NaN when given the reason there are none (the ranks' own readings are read by
    the quick command's test). Control: one rank's readings raised above the others' move the row's figure to
    that rank's median."""
    resident = [
        {
            "validated": memory.THREADED_PEAK,
            "readings": {m: [4096 * (r + 1), 1024, 8192 * (r + 1)] for m in BENCH.methods},
        }
        for r in range(BENCH.world_size)
    ]
    rows = summarise(BENCH, results, reference(BENCH), resident)
    assert [row["resident_peak_bytes"] for row in rows] == [4096 * BENCH.world_size] * len(rows)
    resident[0]["readings"]["distributed"] = [1 << 30] * 3
    raised = {
        x["method"]: x["resident_peak_bytes"]
        for x in summarise(BENCH, results, reference(BENCH), resident)
    }
    assert raised["distributed"] == 1 << 30 and raised["batched"] == 4096 * BENCH.world_size
    nan = summarise(BENCH, results, reference(BENCH), "no resident peaks here")
    assert all(math.isnan(x["resident_peak_bytes"]) for x in nan)


@pytest.mark.timeout(30)
def test_no_assignment_beats_the_bound_in_the_load_balance_table():
    for row in balance_table.rows([8, 64]):
        assert all(
            row[rule] >= row["bound"] - 1e-12 for rule in ("round_robin", "per_shape", "lpt")
        )


@pytest.mark.timeout(120)
def test_torch_optim_muon_on_one_rank_equals_muon_ref_and_the_peers_are_timed_beside():
    """At W = 1 torch.optim.Muon runs on the whole tensors and is compared bit for bit; without a dion package
    or --dion the run has no dion row (the benchmark never needs Dion)."""
    bench = Bench("tiny_dense", world_size=1, warmup=0, steps=1, dion=peers.installed_dion())
    pool = RankPool(1)
    try:
        results = pool.run(rank_bench, bench, timeout=120)
    finally:
        pool.close()
    rows = {r["method"]: r for r in summarise(bench, results, reference(bench))}
    assert rows["torch_muon"]["equal_muon_ref"] is True
    assert all(rows[m]["equal_muon_ref"] is True for m in METHODS)
    assert ("dion" in rows) == (bench.dion is not None)
    assert rows["torch_muon"]["peak_bytes"] > 0
    # each step's process CPU time, read on the rank
    assert all(row["cpu_ms"] > 0 for row in rows.values())


@pytest.mark.timeout(120)
def test_the_quick_command_runs_and_finds_no_difference(capsys):
    """`python -m benchmarks --quick`: exit 0, every compared method equal to muon_ref, the load-balance table; on
    Linux with glibc every method's resident peak, read on fresh ranks whose threaded-pattern check lay within
    RESIDENT_TOLERANCE_BYTES of its 6,144 KiB (elsewhere the reason there is none)."""
    assert main(["--quick", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "results differing from muon_ref: none" in out and "Load balance" in out
    line = next(x for x in out.splitlines() if x.startswith("resident peak"))
    if not sys.platform.startswith("linux"):
        assert line.startswith("resident peaks: "), line
        return
    read = re.search(r"the method read ([0-9,]+) KiB", line)
    assert (
        read
        and abs(int(read[1].replace(",", "")) * 1024 - memory.THREADED_PEAK)
        <= memory.RESIDENT_TOLERANCE_BYTES
    )
    peaks = dict(re.findall(r"([a-z_]+) ([0-9,]+)(?:,|$)", line.split("thread): ")[1]))
    assert sorted(peaks) == sorted(
        Bench("tiny_moe", 2, 1, 2, dion=peers.installed_dion()).methods
    ), line


def test_ns_backend_reaches_distributed_muons_methods_and_only_theirs() -> None:
    """--ns-backend NAME: each of DistributedMuon's methods is built with that backend (default "torch", bitwise);
    the other methods do not take one."""
    from benchmarks.run import DISTRIBUTED_METHODS, make

    params = [torch.nn.Parameter(torch.randn(8, 4))]
    for name in ("torch", "gram"):
        b = Bench("tiny_moe", world_size=1, warmup=1, steps=1, ns_backend=name)
        assert {make(m, params, ["w"], b).backend.name for m in DISTRIBUTED_METHODS} == {name}
    assert Bench("tiny_moe", world_size=1, warmup=1, steps=1).ns_backend == "torch"
    assert set(DISTRIBUTED_METHODS) < set(METHODS)


def test_rounds_and_pipeline_depth_reach_distributed_muons_methods() -> None:
    """--rounds N and --pipeline-depth N: each of DistributedMuon's methods is built with them; without them it
    gets DistributedMuon's defaults (rounds None, depth muon_dist.plan.PIPELINE_DEPTH). --memory-budget B reaches
    the global-dispatch method (distributed), the one whose rounds it sets, and no batched one."""
    from benchmarks.run import DISTRIBUTED_METHODS, make
    from muon_dist.plan import PIPELINE_DEPTH

    params = [torch.nn.Parameter(torch.randn(8, 4))]
    given = Bench("tiny_moe", world_size=1, warmup=1, steps=1, rounds=2, pipeline_depth=1)
    default = Bench("tiny_moe", world_size=1, warmup=1, steps=1)
    for b, want in ((given, (2, 1)), (default, (None, PIPELINE_DEPTH))):
        options = [make(m, params, ["w"], b).options for m in DISTRIBUTED_METHODS]
        assert {(o.rounds, o.pipeline_depth) for o in options} == {want}
    budget = Bench("tiny_moe", world_size=1, warmup=1, steps=1, memory_budget=4096)
    budgets = {m: make(m, params, ["w"], budget).options.memory_budget for m in DISTRIBUTED_METHODS}
    assert budgets == {m: 4096 if m == "distributed" else None for m in DISTRIBUTED_METHODS}


def test_python_m_benchmarks_stacking_orthogonalises_every_matrix_once_in_its_place(capsys) -> None:
    """benchmarks/stacking.py: every matrix of a set (a 3-D stack as its matrices) once per way; the stacked way's
    result for matrix i is matrix i's (within bf16 rounding of the loop's: a result put at another matrix's place
    differs by O(1)), and the table prints one row per set."""
    from benchmarks import stacking

    matrices = stacking.matrices_of("tiny_moe")
    specs = muon_specs("tiny_moe")
    assert len(matrices) == sum(s.shape[0] if len(s.shape) == 3 else 1 for s in specs)
    cfg = stacking.group_config(stacking.preset_defaults(stacking.PRESET, {}))
    want, got = stacking.loop(matrices, cfg), stacking.stacked(matrices, cfg)
    assert all((a.float() - b.float()).abs().max() < 0.05 for a, b in zip(want, got))
    first, second = next(ix for ix in stacking.by_shape(matrices).values() if len(ix) > 1)[:2]
    assert (want[first].float() - got[second].float()).abs().max() > 0.05  # it tells places apart
    assert stacking.main(["--sets", "tiny_moe", "--warmup", "0", "--reps", "1"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("tiny_moe")]
    assert line.split()[1:3] == [str(len(matrices)), str(len(stacking.by_shape(matrices)))]


def _shapes_account_for_the_set(rows: list[dict], matrices: list) -> bool:
    """Whether per-shape rows hold every matrix of the set once: counts and shapes as by_shape gives them, FLOPs as
    the planner's ns_flops, and both shares summing to 1."""
    from benchmarks import stacking
    from muon_dist.balance import ns_flops

    groups = stacking.by_shape(matrices)
    return (
        [(r["shape"], r["count"]) for r in rows] == [(k, len(v)) for k, v in groups.items()]
        and all(r["flops"] == ns_flops(*r["shape"]) and r["us"] > 0 for r in rows)
        and abs(sum(r["flops_share"] for r in rows) - 1) < 1e-9
        and abs(sum(r["time_share"] for r in rows) - 1) < 1e-9
    )


def test_python_m_benchmarks_stacking_per_shape_prices_every_shape_of_the_set(capsys) -> None:
    """benchmarks/stacking.py --per-shape: one row per shape of the set, every matrix counted once, the planner's
    FLOPs of one matrix (balance.ns_flops) beside a timed call, and the shares of the set's FLOPs and time summing
    to 1; printed under the stacking table. Control: rows missing a shape (a planted bug) fail the same check."""
    from benchmarks import stacking

    matrices = stacking.matrices_of("tiny_moe")
    rows = stacking.shape_rows("tiny_moe", 0, 1)
    assert len(rows) == 6 and _shapes_account_for_the_set(rows, matrices)
    assert not _shapes_account_for_the_set(rows[1:], matrices)
    assert stacking.main(["--sets", "tiny_moe", "--warmup", "0", "--reps", "1", "--per-shape"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index(
        "tiny_moe: one matrix of each shape, the loop's call beside the planner's FLOP count"
    )
    printed = [line.split()[0] for line in out[start + 2 : start + 2 + len(rows)]]
    assert printed == ["x".join(map(str, r["shape"])) for r in rows]


def test_the_stage_profile_times_a_backend_without_changing_it(capsys) -> None:
    """benchmarks/stages.py: timed_backend wraps the backend's orthogonalize and stack kernel and keeps every other
    field (a backend rebuilt from its name, function and bitwise flag alone would lose its stack kernel and its
    cast flag, and the profile would time another step than the one users run); `--sets`, `--ns-backend` reach
    the profiled optimizers, whose stacked Newton-Schulz shows in the NS row."""
    import dataclasses
    import types

    from benchmarks import stages
    from muon_dist.kernels import backend

    for name in ("torch", "batched"):
        original = backend(name)
        opt = types.SimpleNamespace(backend=original)
        stages.timed_backend(opt, stages.StageClock())
        for f in dataclasses.fields(original):
            kept = getattr(opt.backend, f.name) is getattr(original, f.name)
            assert kept == (
                f.name not in ("orthogonalize", "stack")
                or original.stack is None
                and f.name == "stack"
            )
        assert (opt.backend.stack is None) == (original.stack is None)
    argv = [
        "--sets",
        "tiny_moe",
        "--ns-backend",
        "batched",
        "--world-sizes",
        "1",
        "--warmup",
        "0",
        "--steps",
        "1",
    ]
    assert stages.main(argv) == 0
    out = capsys.readouterr().out
    assert "tiny_moe, W = 1" in out
    (ns,) = [line.split() for line in out.splitlines() if line.startswith("NS ")]
    assert len(ns) == 3 and all(float(v) > 0 for v in ns[1:])


def test_the_stage_profile_per_rank_keeps_each_rank_apart_and_averages_to_the_table(capsys) -> None:
    """benchmarks/stages.py --per-rank: rank_table gives each rank's own medians over steps (host: its step outside
    every stage), and over one step the mean of the ranks' cells is the averaged table's cell. Control: a per-rank
    table that reads rank 0 for every rank (a planted bug) shows equal columns where the ranks differ."""
    from benchmarks import stages

    def rows(ns: list[float], wait: list[float]) -> list[dict[str, float]]:
        return [{"total": n + w + 1.0, "NS": n, "COLL all_to_all[x]": w} for n, w in zip(ns, wait)]

    results = [
        {"global": rows([10.0, 12.0, 11.0], [4.0, 3.0, 5.0])},
        {"global": rows([14.0, 13.0, 15.0], [1.0, 0.5, 0.7])},
    ]
    ranks = stages.rank_table(results, "global")
    assert [r["NS"] for r in ranks] == [11.0, 14.0]
    assert [r["COLL all_to_all[x]"] for r in ranks] == [4.0, 0.7]
    assert [r["host"] for r in ranks] == [1.0, 1.0]
    assert [r["total"] for r in ranks] == [16.0, 16.0]
    one = [{"global": r["global"][:1]} for r in results]
    averaged = stages.table(one, "global")
    for name in ("NS", "COLL all_to_all[x]", "host"):
        cells = [r[name] for r in stages.rank_table(one, "global")]
        assert sum(cells) / len(cells) == pytest.approx(averaged[name])
    planted = stages.rank_table([results[0], results[0]], "global")
    assert planted[0]["NS"] == planted[1]["NS"] != ranks[1]["NS"]
    stages.print_rank_tables(results, "tiny_moe")
    out = capsys.readouterr().out.splitlines()
    assert "tiny_moe, W = 2, global: stage ms per rank (median over steps)" in out
    assert [line.split()[1:] for line in out if line.startswith("NS ")] == [["11.00", "14.00"]]


def stand_in_dion(root, with_ns_function: bool) -> str:
    """A stand-in for a microsoft/dion checkout at `root` (the real one is never needed by the tests): dion.Muon
    with the constructor benchmarks.peers calls, whose step passes each gradient's local tensor through its
    `_newton_schulz_func` where it has one (else through a function of its module)."""
    package = root / "dion"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import torch\n"
        "def zeropower(G, epsilon=1e-7):\n"
        "    return G.bfloat16()\n"
        "class Muon(torch.optim.Optimizer):\n"
        "    def __init__(self, params, distributed_mesh, lr, mu, weight_decay, nesterov, use_polar_express):\n"
        "        super().__init__(params, dict(lr=lr))\n"
        + (
            "        self._newton_schulz_func = zeropower\n"
            if with_ns_function
            else "        self.ns = zeropower\n"
        )
        + "    @torch.no_grad()\n"
        "    def step(self):\n"
        "        ns = getattr(self, '_newton_schulz_func', zeropower)\n"
        "        for group in self.param_groups:\n"
        "            for p in group['params']:\n"
        "                p.to_local().sub_(group['lr'] * ns(p.grad.to_local()).float())\n"
    )
    return str(root)


@pytest.mark.timeout(120)
def test_the_stage_profile_times_dions_newton_schulz_and_divides_by_its_step(
    capsys, tmp_path
) -> None:
    """benchmarks/stages.py with --dion: dion.Muon's Newton-Schulz function (its `_newton_schulz_func`) is timed as
    its NS stage and the rest of its step as host, and a line divides each DistributedMuon method's NS by
    dion.Muon's step; a Dion without that attribute (control) shows its total alone and no such line."""
    from benchmarks import stages

    argv = ["--sets", "tiny_moe", "--world-sizes", "1", "--warmup", "0", "--steps", "1", "--dion"]
    for with_ns in (True, False):
        checkout = stand_in_dion(tmp_path / str(with_ns), with_ns)
        assert stages.main([*argv, checkout]) == 0
        out = capsys.readouterr().out
        rows = {
            line.split()[0]: line.split()[1:]
            for line in out.splitlines()
            if line[:1].isalpha() and not line.startswith("NS alone")
        }
        assert rows["stage"] == ["batched", "global", "dion"]
        assert len(rows["total"]) == 3 and len(rows["host"]) == (3 if with_ns else 2)
        assert len(rows["NS"]) == (3 if with_ns else 2) and all(float(v) > 0 for v in rows["NS"])
        floors = [line for line in out.splitlines() if line.startswith("NS alone / dion's step: ")]
        assert len(floors) == (1 if with_ns else 0)
        if with_ns:
            values = dict(part.split() for part in floors[0].split(": ")[1].split(", "))
            ns, total = rows["NS"], rows["total"]
            for i, method in enumerate(("batched", "global")):
                assert float(values[method]) == pytest.approx(
                    float(ns[i]) / float(total[2]), rel=0.05, abs=0.01
                )  # the table's cells are rounded to 0.01 ms


def test_python_m_benchmarks_collectives_times_both_all_gather_routes(capsys) -> None:
    """benchmarks/collectives.py: on W = 2 gloo ranks, each route's median latency for each size (the routes'
    results compared equal inside the run)."""
    from benchmarks import collectives

    assert collectives.main(["--world-sizes", "2", "--sizes", "8", "64", "--reps", "3"]) == 0
    rows = [
        line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  2 ")
    ]
    assert [r[1] for r in rows] == ["8", "64"] and all(
        len(r) == 2 + len(collectives.ROUTES) for r in rows
    )


def test_python_m_benchmarks_elementwise_prints_its_table_and_exits_0(capsys) -> None:
    """benchmarks/elementwise.py: the header names the CPU's capability and the torch, a row per preset and dtype,
    the count of violations (0), exit status 0."""
    from benchmarks import elementwise
    from muon_ref.presets import PRESETS

    assert elementwise.main(["--cases", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert torch.backends.cpu.get_cpu_capability() in out[0] and torch.__version__ in out[0]
    assert sum(1 for line in out if line.split()[0] in PRESETS) == 3 * len(PRESETS)
    assert out[-1] == "stages taken as position-free that differed: 0"
