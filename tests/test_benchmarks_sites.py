"""`python -m benchmarks sites` (benchmarks/sites.py, benchmarks.memory.peak_sites): a step's memory peak as the
blocks alive at that moment, by the site that allocated them. The contract: a reading's lines sum to the peak that
benchmarks.memory.peak_extra_bytes reads for the same pattern; a block freed before the peak is in no line; a block
from before the run that the run frees, and a block whose free the profiler did not see, are lines of their own;
each line is named by the op and the Python functions that allocated it, torch's own machinery left out."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

from benchmarks import memory, sites

_kept: list[torch.Tensor] = []


def _keep() -> None:
    _kept.append(torch.empty(1000))  # 4,000 B, held past the run


def _use_and_free() -> None:
    torch.empty(500)  # 2,000 B, freed at once


def _pattern() -> None:
    """Relative to its start: -4,000 (the previous run's block), +2,000 -2,000 (_use_and_free), +4,000 (_keep),
    +3,000 (the peak: 3,000 B over the start), -3,000."""
    _kept.clear()
    _use_and_free()
    _keep()
    x = torch.empty(750)
    del x


def test_the_sites_of_a_run_sum_to_its_peak_and_leave_out_what_was_freed_before_it() -> None:
    """At the peak _keep's block and the pattern's own are alive, and the previous run's block was freed:
    4,000 + 3,000 - 4,000 = 3,000 B, peak_extra_bytes' reading. Control: _use_and_free's block, allocated and freed
    before the peak, is in no line (a sum of every allocation of the run would count it)."""
    _kept.clear()
    peak, found = memory.peak_sites(_pattern, lambda k: None)
    assert peak == 3_000 == memory.peak_extra_bytes(_pattern, lambda k: None, 1)[0]
    assert sum(found.values()) == peak
    named = {re.search(r"\((\w+)\) <", n).group(1) if "@" in n else n: v for n, v in found.items()}
    assert named == {"_keep": 4_000, "_pattern": 3_000, memory.EARLIER: -4_000}, found
    assert not any("_use_and_free" in n for n in found)


def test_the_known_pattern_of_the_memory_method_reads_alike_by_site() -> None:
    """benchmarks.memory's own known pattern (peak 6,000 B): its two live blocks and the previous run's, freed."""
    memory._held.append(torch.empty(1000))
    try:
        peak, found = memory.peak_sites(memory._known_pattern, lambda k: None)
    finally:
        memory._held.clear()
    assert (peak, sorted(found.values())) == (6_000, [-4_000, 10_000]), found


def test_the_replay_counts_blocks_from_before_the_run_and_blocks_freed_unseen_apart() -> None:
    """replay on events made up to hold each case: an address allocated again before its free was seen (freed on
    another thread) keeps its first block in UNSEEN, as the running sum does; a free of an address the run never
    allocated is EARLIER; what comes after the peak is in no line. Control: a replay that took the second
    allocation at an address as replacing the first (no UNSEEN line) would not sum to the peak."""
    events = [
        (1, 100, "a"),
        (2, 50, "b"),
        (9, -30, None),  # allocated before the run
        (2, -50, None),
        (1, 70, "c"),  # address 1 again, its free of 100 B never seen
        (3, 20, "d"),  # the peak: 100 + 50 - 30 - 50 + 70 + 20 = 160
        (3, -20, None),
    ]
    peak, found = memory.replay(events)
    assert peak == 160 and sum(found.values()) == peak
    assert found == {memory.UNSEEN: 100, memory.EARLIER: -30, "c": 70, "d": 20}
    replaced = {k: v for k, v in found.items() if k != memory.UNSEEN}
    assert sum(replaced.values()) != peak
    assert memory.replay([(1, 10, "a"), (1, -10, None)]) == (10, {"a": 10})
    assert memory.replay([(1, -10, None)]) == (0, {})  # never above the start: no peak, no lines


def test_a_site_is_named_by_its_op_and_functions_without_torch_machinery() -> None:
    """The frames as the profiler names them, innermost first: torch's own machinery (DTensor's dispatch, the
    ops' wrappers) is left out, torch.optim's optimizers are kept, at most `depth` frames."""
    frames = [
        "torch/_ops.py(874): __call__",
        "torch/distributed/tensor/_dispatch.py(293): _dispatch_get_local_results_slow_path",
        "torch/optim/_muon.py(31): _zeropower_via_newtonschulz",
        "muon_ref/newton_schulz.py(70): _step",
        "benchmarks/run.py(10): step",
        "outer.py(1): <module>",
    ]
    assert memory.site_label("aten::addmm", frames) == (
        "aten::addmm @ torch/optim/_muon.py:31 (_zeropower_via_newtonschulz) < "
        "muon_ref/newton_schulz.py:70 (_step) < benchmarks/run.py:10 (step)"
    )
    assert memory.site_label(None, frames[:2], depth=1) == "? @ ?"


def test_lines_keep_the_largest_sites_and_still_sum_to_the_peak() -> None:
    found = {"a": 50, "b": 30, "c": 20, "d": 0, memory.UNSEEN: 10, memory.EARLIER: -10}
    out = sites.lines(100, found, top=2)
    assert out == [
        ("a", 50),
        ("b", 30),
        ("(1 more sites)", 20),
        (memory.UNSEEN, 10),
        (memory.EARLIER, -10),
    ]
    with pytest.raises(AssertionError):
        sites.lines(99, found, top=2)  # lines that do not sum to the peak are refused


def _kib(line: str) -> float:
    """A printed site line's amount in KiB (printed in KiB, or in bytes as "N B")."""
    amount, unit = line.split()[:2]
    value = float(amount.replace(",", ""))
    return value / 1024 if unit == "B" else value


def test_the_command_prints_each_ranks_peak_and_its_sites() -> None:
    """tiny_dense at W = 1 and 2: every method's line of per-rank peaks, and under it the sites of the largest,
    which sum to it (to the printed rounding); at W = 2 DistributedMuon's exchange buffers are among them."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = sites.main(
            [
                "--sets",
                "tiny_dense",
                "--world-sizes",
                "1",
                "2",
                "--methods",
                "distributed",
                "torch_muon",
            ]
            + ["--warmup", "1", "--timeout", "120"]
        )
    text = printed.getvalue()
    assert code == 0, text
    blocks = re.findall(
        r"\n(tiny_dense, W = (\d), (\w+): peak KiB per rank ([\d.,\s]+);.*)\n((?:  .*\n?)*)", text
    )
    assert [(w, m) for _, w, m, _, _ in blocks] == [
        ("1", "distributed"),
        ("1", "torch_muon"),
        ("2", "distributed"),
        ("2", "torch_muon"),
    ], text
    for _, w, _, peaks, body in blocks:
        values = [float(p.replace(",", "")) for p in peaks.split(", ")]
        assert len(values) == int(w)
        lines = [_kib(line) for line in body.strip().splitlines()]
        assert abs(sum(lines) - max(values)) <= 0.1 * len(lines), (peaks, body)
    (distributed_w2,) = [body for _, w, m, _, body in blocks if (w, m) == ("2", "distributed")]
    assert "muon_dist/comm.py" in distributed_w2 and "(_all_to_all_start)" in distributed_w2


_held_new_buffer: list[torch.Tensor] = []


def _dense_one_rank_sites(planted: bool) -> tuple[int, dict[str, int]]:
    """sites.rank_sites of DistributedMuon on the dense set at W = 1 (a gloo world of one, fp32 DTensors: the
    directions are cast to bf16 in the momentum stage), on a rank forked from here; with `planted`, a momentum
    stage that holds each param's new buffer until the stage returns, as a throwaway name in its loop did."""
    from benchmarks.run import Bench
    from muon_check.launch import RankPool
    from muon_dist import elementwise
    from muon_dist.step import StepRun

    on_box, stage = elementwise.momentum_on_box, StepRun.momentum

    def holding(*args, **kwargs):
        out = on_box(*args, **kwargs)
        _held_new_buffer[:] = [out[0]]
        return out

    def momentum(self, batch):
        try:
            return stage(self, batch)
        finally:
            _held_new_buffer.clear()

    with pytest.MonkeyPatch.context() as mp:
        if planted:
            mp.setattr(elementwise, "momentum_on_box", holding)
            mp.setattr(StepRun, "momentum", momentum)
        pool = RankPool(1)  # forked: the rank runs the patched stage
        try:
            (result,) = pool.run(
                sites.rank_sites, Bench("dense", 1, 1, 0), ("distributed",), timeout=300
            )
        finally:
            pool.close()
    return result["distributed"]


def _innermost(site: str) -> str:
    """The innermost Python function of a site label (memory.site_label): "op @ file:line (function) < ..."."""
    found = re.match(r"[^@]*@ [^ ]+ \(([^)]*)\)", site)
    return found.group(1) if found else "?"


def _holds_new_buffer_past_its_op(found: dict[str, int]) -> bool:
    """Whether a new momentum buffer (a block muon_ref's momentum_buffer allocated) is alive at the peak beside
    anything but the op that computes the direction from it (momentum_direction's own block): the two blocks
    that any out-of-place momentum stage holds at once, on every torch."""
    sites = {_innermost(name) for name in found}
    return "momentum_buffer" in sites and not sites <= {"momentum_buffer", "momentum_direction"}


def test_the_momentum_stage_holds_no_new_buffer_at_the_steps_peak() -> None:
    """muon_dist.step.StepRun.momentum keeps each param's direction, never its new momentum buffer (the write stage
    computes it again): on the dense set at W = 1, at the step's peak, a block from muon_ref's momentum_buffer is
    alive only beside the direction computed from it (the momentum op itself, where that sets the peak), never
    beside the direction's bf16 cast or anything later. Which stage sets the peak depends on the torch: with torch
    2.13 Newton-Schulz's working set does (no new buffer alive then), with torch 2.9.1 the momentum op's two
    blocks do (its addmm allocates less), so the test asserts what holds on both. Control: a momentum stage that
    holds each new buffer until it returns shows it beside the cast, at a higher peak."""
    peak, found = _dense_one_rank_sites(planted=False)
    assert sum(found.values()) == peak
    assert not _holds_new_buffer_past_its_op(found), found
    planted_peak, planted = _dense_one_rank_sites(planted=True)
    assert _holds_new_buffer_past_its_op(planted), planted
    assert planted_peak > peak
