"""The replica placement (smb2.placement): pure arithmetic shared by client
and server, checked against the unreplicated planner and its own invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smb2 import _core
from smb2.errors import InvalidArgumentError
from smb2.placement import Placement, check_replicas, first_server

geometry = st.tuples(st.integers(1, 9), st.integers(1, 2000), st.sampled_from([8, 16, 24, 64]),
                     st.integers(0, 2**64 - 1))


@settings(max_examples=100, deadline=None)
@given(geometry)
def test_one_replica_is_the_unreplicated_placement(g: tuple[int, int, int, int]) -> None:
    n, nbytes, stripe, h = g
    p = Placement(n, nbytes, stripe, h, 1)
    assert p.segment_size() == _core.segment_size(nbytes, stripe, n)
    for i in range(p.nstripes):
        # the planner's answer for the stripe's first byte: (server, segment offset)
        requests, _ = _core.plan(nbytes, stripe, n, h % n, i * stripe, 1, 1 << 20)
        server, seg_off = requests[0], requests[1]
        assert p.replicas_of(i) == (server,)
        assert p.offset_on(server, i) == seg_off
        assert p.stripe_at(server, seg_off) == (i, 0)


zones_st = st.one_of(st.none(), st.lists(st.sampled_from("abc"), min_size=9, max_size=9))


@settings(max_examples=100, deadline=None)
@given(geometry, st.integers(1, 9), zones_st)
def test_replicas_are_distinct_dense_and_inside_the_segment(g: tuple[int, int, int, int], r: int,
                                                            zones: list[str] | None) -> None:
    n, nbytes, stripe, h = g
    r = min(r, n)
    p = Placement(n, nbytes, stripe, h, r, None if zones is None else zones[:n])
    size = p.segment_size()
    used: dict[int, set[int]] = {s: set() for s in range(n)}
    for i in range(p.nstripes):
        group = p.replicas_of(i)
        assert len(group) == r and len(set(group)) == r
        assert group[0] == (h + i) % n
        for j, s in enumerate(group):
            off = p.offset_on(s, i)
            assert off % stripe == 0 and off + stripe <= size
            assert off not in used[s]
            used[s].add(off)
            assert p.stripe_at(s, off + stripe - 1) == (i, j)
        for s in set(range(n)) - set(group):
            with pytest.raises(ValueError):
                p.offset_on(s, i)
    for s in range(n):
        # dense: a server's stripes fill its segment from 0 without holes, in stripe order
        assert used[s] == set(range(0, len(used[s]) * stripe, stripe))
        assert p.stripes_on(s) == len(used[s])
        order = [p.stripe_at(s, off)[0] for off in sorted(used[s])]
        assert order == sorted(order)
    assert size == max(len(v) for v in used.values()) * stripe


def test_zones_put_replicas_in_different_zones_while_they_allow() -> None:
    zones = ["a", "a", "b", "b", "c"]
    p = Placement(5, 40 * 8, 8, 0, 3, zones)
    for i in range(p.nstripes):
        group = p.replicas_of(i)
        assert len({zones[s] for s in group}) == 3, (i, group)
    # two zones, three replicas: two zones used, then ring order for the third
    two = Placement(4, 40 * 8, 8, 1, 3, ["x", "x", "y", "y"])
    for i in range(two.nstripes):
        group = two.replicas_of(i)
        assert {("x", "y")[s // 2] for s in group} == {"x", "y"}
        assert len(set(group)) == 3
    # stripe 0 starts at server 1 (zone x): the next server of another zone is 2
    assert two.replicas_of(0) == (1, 2, 3)
    # a server without a zone: ring order for all
    assert Placement(4, 32, 8, 0, 2, ["x", "x", None, "y"]).replicas_of(0) == (0, 1)


def test_replicas_are_checked_against_the_servers() -> None:
    assert check_replicas(3, 3) == 3
    for bad in (0, 4, -1):
        with pytest.raises(InvalidArgumentError, match="replicas"):
            check_replicas(bad, 3)
    with pytest.raises(InvalidArgumentError):
        check_replicas(True, 3)
    with pytest.raises(InvalidArgumentError):
        Placement(2, 64, 8, 0, 3)
    with pytest.raises(ValueError):
        Placement(2, 64, 8, 0, 1).stripe_at(0, 64)


def test_one_placement_object_locates_every_byte_of_an_unreplicated_buffer() -> None:
    # every buffer carries a Placement now: for replicas=1 it must answer the striping arithmetic of
    # docs/design.md exactly (stripe i on server (h + i) mod N, at (i div N) stripes into its segment)
    rng = np.random.default_rng(7)
    for _ in range(300):
        n, stripe = int(rng.integers(1, 17)), int(rng.choice([1, 8, 4096, 1 << 20]))
        nbytes = int(rng.integers(1, 64)) * stripe - int(rng.integers(0, stripe))
        name = f"buf-{int(rng.integers(1 << 30))}"
        p = Placement.of(name, n, nbytes, stripe)
        h = first_server(name, n)
        assert p.first == h
        for offset in rng.integers(0, nbytes, 20):
            i = int(offset) // stripe
            assert p.server_of(i) == (h + i) % n
            assert p.locate(int(offset)) == ((h + i) % n, (i // n) * stripe + int(offset) % stripe)
