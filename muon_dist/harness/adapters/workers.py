"""The rank side of the conformance run: module-level functions that muon_dist.harness.launch.RankPool runs on every
rank (picklable arguments, small picklable results)."""

from __future__ import annotations

from typing import Any

import torch

from ..fixtures import distribute, local
from . import Adapter
from .cases import Case, gradients, initial_params, placement


def _on_rank(full: torch.Tensor, case: Case) -> torch.Tensor:
    """This rank's view of a full tensor: a DTensor Shard(0) with its torch.chunk box, or a plain copy."""
    return distribute(full, placement(case), "fsdp", case.device)


def candidate_steps(adapter: Adapter, case: Case, hp: dict[str, Any]) -> dict[str, Any]:
    """case.steps steps of the candidate, built with the check's hyperparameters `hp` and the case's options; this
    rank's params after every step and its final momentum (CPU copies: results travel to the parent by a pipe)."""
    params = [torch.nn.Parameter(_on_rank(p, case)) for p in initial_params(case)]
    opt = adapter.build(params, **{**hp, **dict(case.options)})
    per_step = []
    for step in range(case.steps):
        for p, g in zip(params, gradients(case, step)):
            p.grad = _on_rank(g, case)
        opt.step()
        per_step.append([local(p.detach()).cpu().clone() for p in params])
    momenta = [adapter.momentum(opt, p) for p in params]
    return {"params": per_step, "momentum": [None if m is None else m.detach().cpu().clone() for m in momenta]}
