"""Exercise 01's checks by mutation: the reference PASSes, every known wrong answer FAILs."""

import math

import pytest

from minipaged.checks import FAIL, PASS, ch01

pytestmark = pytest.mark.ch01


def fit(budget, layers, kv_heads, head_dim, dtype_bytes, block_size):
    return budget // (2 * layers * kv_heads * head_dim * dtype_bytes * block_size)


FIT_MUTANTS = {
    "no K and V factor": lambda b, L, h, d, s, B: b // (L * h * d * s * B),
    "float division": lambda b, L, h, d, s, B: int(b / (2 * L * h * d * s * B)),
    "rounds up": lambda b, L, h, d, s, B: -(-b // (2 * L * h * d * s * B)),
    "tokens, not blocks": lambda b, L, h, d, s, B: b // (2 * L * h * d * s),
}


def new_blocks(n, k, b):
    return -(-(n + k) // b) - -(-n // b)


NEW_MUTANTS = {
    "math.ceil": lambda n, k, b: math.ceil((n + k) / b) - math.ceil(n / b),
    "ignores the partly filled block": lambda n, k, b: -(-k // b),
    "blocks after, not new": lambda n, k, b: -(-(n + k) // b),
    "floor": lambda n, k, b: (n + k) // b - n // b,
}


def best(lengths, candidates):
    return min(candidates, key=lambda b: (sum(b * -(-n // b) for n in lengths), -b))


BEST_MUTANTS = {
    "tie to the smaller": lambda ls, cs: min(cs, key=lambda b: (sum(b * -(-n // b) for n in ls), b)),
    "rounds the total": lambda ls, cs: min(cs, key=lambda b: (b * -(-sum(ls) // b), -b)),
    "largest always": lambda ls, cs: max(cs),
    "the first candidate on a tie": lambda ls, cs: min(cs, key=lambda b: sum(b * -(-n // b) for n in ls)),
}


@pytest.mark.parametrize(
    "check, reference, mutants",
    [(ch01.check_blocks_that_fit, fit, FIT_MUTANTS), (ch01.check_new_blocks, new_blocks, NEW_MUTANTS),
     (ch01.check_best_block_size, best, BEST_MUTANTS)],
    ids=["blocks_that_fit", "new_blocks", "best_block_size"],
)
def test_reference_passes_and_mutants_fail(check, reference, mutants, capsys):
    assert check(reference).status == PASS
    for name, mutant in mutants.items():
        assert check(mutant).status == FAIL, name
    assert "Traceback" not in capsys.readouterr().out


def test_a_partly_filled_block_is_named(capsys):
    result = ch01.check_new_blocks(NEW_MUTANTS["ignores the partly filled block"])
    assert "already has room for" in result.message
