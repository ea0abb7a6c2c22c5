"""The exact McNemar p of `refiner compare` on held-out sets with thousands of changed prompts: the binomial tail
built term by term (refiner_core.eval.stats.binomial_tail) against summing math.comb(n, i) anew for every i, as it
was, side by side in this process. Both are exact fractions; the script checks they are equal.

    .venv/bin/python bench/mcnemar_tail.py [--pairs 5000 10000]   # discordant pairs each way
"""

from __future__ import annotations

import argparse
import sys
import time
from fractions import Fraction
from math import comb
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refiner_core.eval.stats import binomial_tail  # noqa: E402


def comb_per_term(n: int, k: int) -> Fraction:
    return Fraction(sum(comb(n, i) for i in range(min(k, n) + 1)), 2**n)


def timed(fn, n: int, k: int) -> tuple[Fraction, float]:
    start = time.perf_counter()
    value = fn(n, k)
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[2500, 5000, 10000])
    args = parser.parse_args()
    print(f"{'pairs each way':>15} {'comb per term':>14} {'term by term':>13} {'ratio':>7}")
    for each in args.pairs:
        n, k = 2 * each, each
        old, old_s = timed(comb_per_term, n, k)
        new, new_s = timed(binomial_tail, n, k)
        if old != new:
            raise SystemExit(f"the tails differ at n={n}, k={k}")
        print(f"{each:>15} {old_s:>13.3f}s {new_s:>12.4f}s {old_s / new_s:>6.0f}x")


if __name__ == "__main__":
    main()
