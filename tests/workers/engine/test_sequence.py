"""The slot table keeps running sequences packed and reports the cache moves it needs."""

from __future__ import annotations

import pytest
from syshax.shared.sampling import SamplingParams
from syshax.workers.engine.errors import CapacityError
from syshax.workers.engine.sequence import Sequence, SlotTable


def _seq(name: str, cached: int = 0) -> Sequence:
    s = Sequence(name, [1, 2], SamplingParams())
    s.num_cached = cached
    return s


def test_remove_from_middle_moves_last_into_hole():
    table = SlotTable(3)
    a, b, c = _seq("a", 5), _seq("b", 6), _seq("c", 7)
    for s in (a, b, c):
        table.add(s)
    assert table.remove(a) == (2, 0, 7)  # c moves from slot 2 to 0, 7 positions
    assert [s.request_id for s in table.running] == ["c", "b"] and c.slot == 0 and a.slot == -1
    assert table.remove(b) is None  # last one: nothing to move
    assert table.running == [c]


def test_capacity_and_unknown_sequence():
    table = SlotTable(1)
    table.add(_seq("a"))
    with pytest.raises(CapacityError):
        table.add(_seq("b"))
    with pytest.raises(KeyError):
        table.remove(_seq("c"))
