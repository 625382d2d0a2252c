"""The announcement journal (tier/journal.py): what it keeps, what a torn tail costs, the order it announces in,
and compaction."""

from __future__ import annotations

from pathlib import Path

from cache_service.core.events import TierEntry
from cache_service.tier import journal as journal_module
from cache_service.tier.journal import JOURNAL_NAME, MAGIC, TierJournal, decode, encode, parents_first


def entry(n: int, parent: int | None, salt: str = "") -> TierEntry:
    return TierEntry(bytes([n]) * 32, salt, parent, 1000 + n, bytes(range(n, n + 16)))


def test_stored_and_removed_records_replay_to_what_is_still_held(tmp_path: Path) -> None:
    j = TierJournal(tmp_path)
    assert j.load() == []  # no journal yet
    j.rewrite([])
    a, b, c = entry(1, None, "tenant-é"), entry(2, 1001), entry(3, 1002)
    j.stored([a, b])
    j.removed([a.key, bytes(32)])  # a key never stored is ignored
    j.stored([c, a])  # stored again: after its child now
    j.close()
    assert TierJournal(tmp_path).load() == [b, c, a]
    assert (tmp_path / JOURNAL_NAME).read_bytes().startswith(MAGIC)


def test_a_torn_tail_ends_the_journal_and_a_foreign_file_holds_nothing(tmp_path: Path) -> None:
    a, b = entry(1, None), entry(2, 1001)
    whole = MAGIC + encode(a) + encode(b)
    for cut in range(1, len(encode(b))):
        assert decode(whole[:-cut]) == ([a], len(MAGIC) + len(encode(a)))
    j = TierJournal(tmp_path)
    (tmp_path / JOURNAL_NAME).write_bytes(whole[:-3])
    assert (j.load(), j.torn_bytes) == ([a], len(encode(b)) - 3)
    (tmp_path / JOURNAL_NAME).write_bytes(b"something else" + encode(a))
    assert (j.load(), j.torn_bytes) == ([], 14 + len(encode(a)))


def test_parents_come_first_and_a_page_whose_chain_is_broken_is_not_announced() -> None:
    root, child, grandchild = entry(1, None), entry(2, 1001), entry(3, 1002)
    other_root, orphan, orphans_child = entry(4, None, "t"), entry(5, 1099), entry(6, 1005)
    entries = [grandchild, orphans_child, child, orphan, root, other_root]
    assert parents_first(entries, [True] * 6) == [root, child, grandchild, other_root]
    assert parents_first(entries, [True, True, False, True, True, True]) == [root, other_root]  # child gone
    assert parents_first(entries, [False] * 6) == []


def test_the_journal_compacts_itself_when_it_is_mostly_removals(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(journal_module, "COMPACT_MIN", 4)
    j = TierJournal(tmp_path)
    j.rewrite([entry(1, None)])
    path = tmp_path / JOURNAL_NAME
    for n in range(2, 10):
        j.stored([entry(n, None)])
        j.removed([entry(n, None).key])
    # 17 records for 1 live entry: compacted when the records passed 4 x max(live, 4) = 16
    assert path.read_bytes() == MAGIC + encode(entry(1, None))
    j.stored([entry(20, None)])
    j.close()
    assert TierJournal(tmp_path).load() == [entry(1, None), entry(20, None)]
