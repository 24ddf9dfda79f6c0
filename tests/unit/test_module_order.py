"""The order in which the test lanes take modules (tests/conftest.py)."""

from __future__ import annotations

from tests.conftest import SLOWEST_FIRST, module_order


def test_end_to_end_modules_are_spread_among_the_others_slowest_first() -> None:
    e2e = ["tests/e2e/test_a.py", SLOWEST_FIRST[1], "tests/e2e/test_b.py", SLOWEST_FIRST[0]]
    rest = [f"tests/integration/test_{i}.py" for i in range(4)]
    rest += [f"tests/unit/test_{i}.py" for i in range(4)]
    order = module_order(e2e + rest)

    assert sorted(order) == sorted(e2e + rest)
    assert [m for m in order if m in e2e] == [
        SLOWEST_FIRST[0],
        SLOWEST_FIRST[1],
        "tests/e2e/test_a.py",
        "tests/e2e/test_b.py",
    ]
    assert [m for m in order if m in rest] == rest  # file order kept
    # Two of the others between consecutive end-to-end modules, none of them all at one end.
    positions = [order.index(m) for m in order if m in e2e]
    assert positions == [0, 3, 6, 9]


def test_one_kind_alone_keeps_its_order() -> None:
    units = ["tests/unit/test_x.py", "tests/unit/test_y.py"]
    assert module_order(units) == units
    assert module_order([SLOWEST_FIRST[2], SLOWEST_FIRST[0]]) == [
        SLOWEST_FIRST[0],
        SLOWEST_FIRST[2],
    ]
