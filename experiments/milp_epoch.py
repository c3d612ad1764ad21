"""Does the MILP solve a plan problem posed at unix times as well as the same problem at time 0?

Production plans at wall-clock times (unix seconds, ~1.8e9); simulations start their virtual clock
at 0. The plan problem is the same up to a shift of every ready time and deadline, so any
difference in what the solver finds is numerical. For ``--seeds`` seeded problems
(``random_problem(queues, groups)``), the MILP is solved cold under ``--limit-s`` seconds at both
origins and the plans are scored on the unshifted problem (``score_plan``).

Reproduce: .venv/bin/python experiments/milp_epoch.py [--queues 3 --groups 12 --seeds 20
--limit-s 1 --solver highs]. Before the MILP posed times relative to the earliest ready time
(commit c79ffc2 and earlier), run it on that checkout to see the difference.
"""

from __future__ import annotations

import argparse
import sys

from qlm.planner.milp import solve_milp
from qlm.planner.program import score_plan
from qlm.planner.synthetic import random_problem, shifted

UNIX_NOW = 1.8e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queues", type=int, default=3)
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--scenarios", type=int, default=8)
    parser.add_argument("--load", type=float, default=1.5)
    parser.add_argument("--limit-s", type=float, default=1.0)
    parser.add_argument("--solver", default="highs")
    args = parser.parse_args()
    found = {0.0: 0, UNIX_NOW: 0}
    better = {0.0: 0, UNIX_NOW: 0}
    print(f"{'seed':>4} {'at 0':>12} {'at 1.8e9':>12}")
    for seed in range(args.seeds):
        base = random_problem(
            args.queues, args.groups, seed=seed, scenarios=args.scenarios, load=args.load
        )
        cost: dict[float, float] = {}
        for origin in found:
            result = solve_milp(
                shifted(base, origin), time_limit_s=args.limit_s, solver=args.solver
            )
            cost[origin] = score_plan(base, result[0]) if result else float("inf")
            found[origin] += result is not None
        if cost[0.0] < cost[UNIX_NOW] * (1 - 1e-3):
            better[0.0] += 1
        elif cost[UNIX_NOW] < cost[0.0] * (1 - 1e-3):
            better[UNIX_NOW] += 1
        print(f"{seed:>4} {cost[0.0]:>12.0f} {cost[UNIX_NOW]:>12.0f}")
    print(
        f"plans found: {found[0.0]} of {args.seeds} at 0, {found[UNIX_NOW]} at 1.8e9; "
        f"better by > 0.1 %: {better[0.0]} at 0, {better[UNIX_NOW]} at 1.8e9"
    )
    print("command: .venv/bin/python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
