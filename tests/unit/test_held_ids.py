"""A consumer's held entry ids, packed (broker rule 41): a set of ids whatever their form."""

from __future__ import annotations

from broker.heldids import HeldIds


def test_held_ids_behave_as_a_set_of_the_ids_added() -> None:
    ids = ["1765108800123-0", "1765108800123-7", "5-262144", "007-1", "1-01", "x", "9-²"]
    held = HeldIds(reversed(ids))
    assert len(held) == len(ids) and sorted(held) == sorted(ids)
    assert all(entry_id in held for entry_id in ids)
    assert "1765108800123-1" not in held and "7-1" not in held and 7 not in held
    held.add("1765108800123-0")  # again: still one
    held.add("1765108800124-0")  # after the last: appended
    held.add("1765108800122-5")  # before: inserted in order
    assert len(held) == len(ids) + 2
    assert list(held)[:3] == ["1765108800122-5", "1765108800123-0", "1765108800123-7"]
    for entry_id in [*ids, "3-3"]:
        held.discard(entry_id)
    assert sorted(held) == ["1765108800122-5", "1765108800124-0"]


def test_held_ids_come_a_chunk_at_a_time_and_a_copy_is_a_snapshot() -> None:
    ids = [f"1765108800123-{seq}" for seq in range(7)] + ["x"]
    held = HeldIds(ids)
    copied = held.copy()
    held.discard(ids[0])
    assert [len(chunk) for chunk in copied.chunks(3)] == [3, 3, 1, 1]
    assert [i for chunk in copied.chunks(3) for i in chunk] == ids == copied.ids()
    assert ids[0] not in held and len(copied) == 8
