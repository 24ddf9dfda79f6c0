"""The ids of the entries a consumer holds, packed in a sorted array (:class:`HeldIds`): a
triggerer holds a hundred thousand timers' entries, and an id string and a dict slot each were a
fifth of its memory per timer, the strings left scattered among the garbage of the reads that
brought them (broker rule 41)."""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator

# An id "<ms>-<seq>" packs as ms << _SEQ_BITS | seq while both fit in 63 bits (ms for a thousand
# years, a quarter of a million entries a millisecond); any other id is kept as it is.
_SEQ_BITS = 18
_MS_LIMIT = 1 << (63 - _SEQ_BITS)


def _packed(entry_id: str) -> int | None:
    ms, dash, seq = entry_id.partition("-")
    if not (dash and _canonical(ms) and _canonical(seq)):
        return None
    m, s = int(ms), int(seq)
    if m >= _MS_LIMIT or s >> _SEQ_BITS:
        return None
    return m << _SEQ_BITS | s


def _canonical(number: str) -> bool:
    """Digits that print back the same (no sign, no leading zero, ASCII)."""
    return number.isascii() and number.isdigit() and (number == "0" or number[0] != "0")


class HeldIds:
    """A set of stream entry ids. Entries are mostly read in id order, so an id added lands at
    the end of the array (no move)."""

    def __init__(self, ids: Iterable[str] = ()) -> None:
        self._keys = array("q")
        self._others: set[str] = set()
        for entry_id in ids:
            self.add(entry_id)

    def __len__(self) -> int:
        return len(self._keys) + len(self._others)

    def __contains__(self, entry_id: object) -> bool:
        if not isinstance(entry_id, str):
            return False
        key = _packed(entry_id)
        if key is None:
            return entry_id in self._others
        i = bisect_left(self._keys, key)
        return i < len(self._keys) and self._keys[i] == key

    def __iter__(self) -> Iterator[str]:
        return iter(self.ids())

    def ids(self) -> list[str]:
        """The ids (new strings), in id order, then any kept as they are."""
        return [entry_id for chunk in self.chunks(len(self) or 1) for entry_id in chunk]

    def chunks(self, size: int) -> Iterator[list[str]]:
        """The ids as :meth:`ids` lists them, ``size`` at a time: only a chunk's strings exist
        at once."""
        mask = (1 << _SEQ_BITS) - 1
        for start in range(0, len(self._keys), size):
            keys = self._keys[start : start + size]
            yield [f"{key >> _SEQ_BITS}-{key & mask}" for key in keys]
        if self._others:
            yield list(self._others)

    def copy(self) -> HeldIds:
        """A snapshot (the packed array copied at once, no string built)."""
        copied = HeldIds()
        copied._keys = array("q", self._keys)
        copied._others = set(self._others)
        return copied

    def add(self, entry_id: str) -> None:
        key = _packed(entry_id)
        if key is None:
            self._others.add(entry_id)
            return
        if not self._keys or key > self._keys[-1]:
            self._keys.append(key)
            return
        i = bisect_left(self._keys, key)
        if i == len(self._keys) or self._keys[i] != key:
            self._keys.insert(i, key)

    def discard(self, entry_id: str) -> None:
        key = _packed(entry_id)
        if key is None:
            self._others.discard(entry_id)
            return
        i = bisect_left(self._keys, key)
        if i < len(self._keys) and self._keys[i] == key:
            del self._keys[i]
