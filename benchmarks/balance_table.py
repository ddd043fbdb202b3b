"""The planner's load balance on the large shape tables: max over ranks of assigned NS FLOPs / mean, for
round-robin by count, per-shape batches (xtuner / Dion, what DistributedMuon's planner does today), LPT, and
the bound no assignment of whole matrices beats (muon_check.rules.imbalance_by_rule; its docstring has the rules)."""

from __future__ import annotations

from muon_check.rules import imbalance_by_rule
from muon_check.shapes import dense_7b, moe_30b_a3b

TABLES = {"dense_7b": dense_7b, "moe_30b_a3b": moe_30b_a3b}
RULES = ("round_robin", "per_shape", "lpt", "bound")


def rows(world_sizes: list[int]) -> list[dict]:
    out = []
    for name, table in TABLES.items():
        specs = table()
        for W in world_sizes:
            out.append({"table": name, "world_size": W, **imbalance_by_rule(specs, W)})
    return out


def print_rows(table_rows: list[dict]) -> None:
    print("\nLoad balance: max over ranks of assigned NS FLOPs / mean (1.00 = perfect), 5 NS steps")
    head = f"{'table':<12} {'W':>5} " + " ".join(f"{r:>11}" for r in RULES)
    print(head)
    print("-" * len(head))
    for row in table_rows:
        print(
            f"{row['table']:<12} {row['world_size']:>5} "
            + " ".join(f"{row[r]:>11.2f}" for r in RULES)
        )
