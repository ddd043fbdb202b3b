"""A cosmic-ray filter: keep a fixed, seeded sample of each module's pending mutants and mark the rest skipped.

    python tests/mutation/sample.py SESSION CONFIG

CONFIG's [cosmic-ray.filters.sample] gives `per-module` (how many mutants each module keeps) and `seed`. The sample
is a function of the mutants alone: they are ordered by (operator, its arguments, occurrence), which `cosmic-ray
init` derives from the source, never by their random job ids; so the same source, seed and size test the same
mutants in every run (a re-run after new tests re-tests the same sample), and a larger `per-module` only adds
mutants. Built on cosmic-ray's own filter base (cosmic_ray.tools.filters.filter_app), as its operators filter is.
"""

from __future__ import annotations

import random
import sys
from argparse import ArgumentParser, Namespace
from collections import defaultdict

from cosmic_ray.config import load_config
from cosmic_ray.tools.filters.filter_app import FilterApp
from cosmic_ray.work_db import WorkDB
from cosmic_ray.work_item import WorkerOutcome, WorkItem, WorkResult


def sample_key(item: WorkItem) -> tuple[str, str, int]:
    (mutation,) = item.mutations
    return mutation.operator_name, repr(sorted(mutation.operator_args.items())), mutation.occurrence


class SampleFilter(FilterApp):
    """Skips all but a seeded sample of `per-module` pending mutants in each module."""

    def description(self) -> str:
        return __doc__

    def add_args(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "config", help="the target's cosmic-ray config, with [cosmic-ray.filters.sample]"
        )

    def filter(self, work_db: WorkDB, args: Namespace) -> None:
        options = load_config(args.config).sub("filters", "sample")
        per_module, seed = int(options["per-module"]), int(options["seed"])
        by_module: dict[str, list[WorkItem]] = defaultdict(list)
        for item in work_db.pending_work_items:
            by_module[str(item.mutations[0].module_path)].append(item)
        skipped = []
        for module, items in sorted(by_module.items()):
            items.sort(key=sample_key)
            # a str seed is hashed with SHA-512 by random.seed: the same on every machine and PYTHONHASHSEED;
            # a prefix of one seeded shuffle, so a larger sample contains the smaller one
            random.Random(f"{seed}:{module}").shuffle(items)
            skipped += [item.job_id for item in items[per_module:]]
        if skipped:
            work_db.set_multiple_results(
                skipped,
                WorkResult(output="Filtered by sample", worker_outcome=WorkerOutcome.SKIPPED),
            )


if __name__ == "__main__":
    sys.exit(SampleFilter().main())
