"""The presence filter (kvtier.presence): the daemon's counting Bloom filter of index keys
and a client's read-only view of it, on real files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import UntrustedArena
from kvtier.index import BlockIndex, BlockMeta
from kvtier.presence import HEADER_BYTES, PresenceFilter, PresenceView

LOG2 = 12   # small filters: collisions are easy to provoke


def keys(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(n)]


def view_of(f: PresenceFilter, exact: bool = True) -> PresenceView:
    return PresenceView(f.open_for_client(), f.announce(exact), os.getuid())


def maybe(f: PresenceFilter, key: bytes) -> bool:
    """Whether a client reading ``f`` could find ``key`` (no "absent" from the filter)."""
    view = view_of(f)
    try:
        return view.leading_bound([key]) == 1
    finally:
        view.close()


def test_bound_follows_adds_and_removes(tmp_path: Path) -> None:
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600
    view = view_of(f)
    chain = keys(8)
    assert view.leading_bound(chain) == 0
    for k in chain[:5]:
        f.add(k)
    assert view.leading_bound(chain) == 5          # the client sees the daemon's writes
    assert view.leading_bound(chain[:3]) == 3
    assert view.leading_bound([]) == 0
    f.remove(chain[2])
    assert view.leading_bound(chain) == 2
    f.add(chain[2])
    f.add(chain[2])                                # counted twice: one remove leaves it
    f.remove(chain[2])
    assert view.leading_bound(chain) == 5
    view.close()
    f.close()
    assert not (tmp_path / "p").exists()


def test_never_a_false_absent_under_churn(tmp_path: Path) -> None:
    """Whatever was added and not removed is always 'maybe' (collisions only add maybes)."""
    f = PresenceFilter.create(tmp_path / "p", counters_log2=10)   # 1024 counters: crowded
    view = view_of(f)
    rng = np.random.default_rng(1)
    pool = keys(3000, seed=2)
    live: set[bytes] = set()
    for step in range(6000):
        k = pool[int(rng.integers(len(pool)))]
        if k in live and step % 3:
            f.remove(k)
            live.discard(k)
        elif k not in live:
            f.add(k)
            live.add(k)
        if step % 500 == 0:
            assert all(view.leading_bound([key]) == 1 for key in live)
    assert all(maybe(f, key) for key in live)


def test_saturated_counters_stay_set(tmp_path: Path) -> None:
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    k = keys(1)[0]
    for _ in range(300):
        f.add(k)
    for _ in range(300):
        f.remove(k)
    assert maybe(f, k)     # 255 is sticky: a false 'maybe', never a false 'absent'


def test_a_stale_file_is_reset(tmp_path: Path) -> None:
    path = tmp_path / "p"
    old = PresenceFilter.create(path, counters_log2=LOG2)
    k = keys(1)[0]
    old.add(k)
    old._mm.flush()
    fresh = PresenceFilter.create(path, counters_log2=LOG2)   # a crashed daemon's file
    assert not maybe(fresh, k)


def test_index_tells_the_filter_of_every_key(tmp_path: Path) -> None:
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    index = BlockIndex()
    index.presence = f
    ks = keys(3)
    metas = [BlockMeta(k, b"n" * 16, 1, 64, None, 0) for k in ks]
    index[ks[0]] = metas[0]
    index[ks[1]] = metas[1]
    index[ks[1]] = metas[1]                         # re-assignment counts once
    assert maybe(f, ks[0]) and maybe(f, ks[1]) and not maybe(f, ks[2])
    del index[ks[1]]
    assert not maybe(f, ks[1]) and maybe(f, ks[0])


@pytest.mark.parametrize("problem", ["mode", "size", "header", "announce"])
def test_view_refuses_what_the_daemon_did_not_announce(tmp_path: Path, problem: str) -> None:
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    announced = f.announce(True)
    if problem == "mode":
        os.chmod(f.path, 0o644)
    elif problem == "size":
        os.truncate(f.path, HEADER_BYTES + 10)
    elif problem == "header":
        f._mm[:8] = b"NOTAFILT"
    else:
        announced = {**announced, "counters_log2": LOG2 + 1}
    fd = os.open(f.path, os.O_RDONLY)
    with pytest.raises(UntrustedArena):
        PresenceView(fd, announced, os.getuid())
    with pytest.raises(OSError):
        os.fstat(fd)                                # the view took the descriptor over


def test_a_read_only_view_cannot_write(tmp_path: Path) -> None:
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    view = view_of(f)
    with pytest.raises(TypeError):
        view._mm[HEADER_BYTES] = 1                  # mapped PROT_READ from an O_RDONLY fd
    assert not view._counts.flags.writeable


def test_malformed_announcements_are_value_errors(tmp_path: Path) -> None:
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    for bad in ({"counters_log2": 40, "hashes": 3}, {"counters_log2": LOG2, "hashes": 9},
                {"hashes": 3}):
        with pytest.raises((ValueError, KeyError)):
            PresenceView(f.open_for_client(), bad, os.getuid())


def test_add_many_counts_as_adds_one_at_a_time(tmp_path: Path) -> None:
    """Repeats count, counters saturate at 255 as single adds leave them, and a batch's
    keys are then found and removable as any."""
    one = PresenceFilter.create(tmp_path / "one", counters_log2=10)
    many = PresenceFilter.create(tmp_path / "many", counters_log2=10)
    batch = keys(300, seed=5) + keys(40, seed=5)          # repeats, and collisions galore
    hot = keys(1, seed=9) * 300                           # one key past saturation
    for k in batch + hot:
        one.add(k)
    many.add_many(batch)
    many.add_many(hot)
    many.add_many(keys(3, seed=11))                       # a small batch: the plain loop
    for k in keys(3, seed=11):
        one.add(k)
    counts = lambda f: np.frombuffer(f._mm, np.uint8, offset=HEADER_BYTES).copy()  # noqa: E731
    assert np.array_equal(counts(one), counts(many)) and counts(many).max() == 255
    assert all(maybe(many, k) for k in batch)
    one.close()
    many.close()
    assert many._mm.closed                                # no numpy view kept it mapped


def test_index_add_new_tells_the_filter(tmp_path: Path) -> None:
    f = PresenceFilter.create(tmp_path / "p", counters_log2=LOG2)
    index = BlockIndex()
    index.presence = f
    new = keys(20, seed=2)
    index.add_new([BlockMeta(k, b"n" * 16, 1, 4096, None, 0) for k in new])
    assert set(index) == set(new) and all(maybe(f, k) for k in new)
    for k in new:
        del index[k]
    assert not any(maybe(f, k) for k in new)
    f.close()
