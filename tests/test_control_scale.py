"""The control words of a parameter store at many workers: the start barrier
counts ranks with ``fetch_add`` on one word, so a waiting rank reads 64 bytes
per poll whatever the number of workers; heartbeats read the others' rows a
chunk at a time and still find a dead rank; the words lie spread over the
servers; a store of the older format is refused in words, never misread.

Real servers (LocalCluster); the workers are many ``ParameterStore`` opens
over a few clients in one process.  What is read is counted by the servers
(``stat``'s ``bytes_out``, counted over TCP: the test's clients use TCP)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import pytest

import smb2
from smb2.train import ParameterStore
from smb2.train import lifecycle as lc
from smb2.train import store as store_mod


def _params() -> dict[str, np.ndarray]:
    return {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.zeros(8, np.float32)}


async def _clients(cluster: smb2.LocalCluster, n: int) -> list[smb2.Client]:
    return [await cluster.connect(transport="tcp") for _ in range(n)]


async def _bytes_out(client: smb2.Client) -> int:
    return sum(s["bytes_out"] for s in await client.stat())


async def _stat_reply(client: smb2.Client) -> int:
    """The bytes of one ``stat`` reply (the servers count it as sent, at the
    next stat), measured while nothing else runs."""
    await _bytes_out(client)
    first = await _bytes_out(client)
    return await _bytes_out(client) - first


#: how much one stat reply may differ from the next (its figures' digits)
STAT_JITTER = 64


async def _open_job(cluster: smb2.LocalCluster, name: str, workers: int, **kw: Any) -> list[ParameterStore]:
    """Rank 0 opens first, then every other rank at once (8 TCP clients)."""
    clients = await _clients(cluster, 8)
    first = await ParameterStore.open(clients[0], name, _params(), workers=workers, rank=0, timeout=60, **kw)
    rest = await asyncio.gather(*(ParameterStore.open(clients[r % len(clients)], name, _params(), workers=workers,
                                                      rank=r, timeout=60, **kw) for r in range(1, workers)))
    return [first, *rest]


async def _polls_until(store: ParameterStore, n: int) -> None:
    for _ in range(60_000):         # (a hang guard of ten minutes)
        if store.stats["barrier_polls"] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the barrier polled {store.stats['barrier_polls']} times, not {n}")


def test_the_words_lie_on_other_servers_than_the_header() -> None:
    """1,000 workers over 64 servers, 1 MiB stripes: the version's line on the
    first stripe, the run's head line and eight pages of rows on eight other
    stripes (servers), every rank's row once, nothing overlapping."""
    stripe = 1 << 20
    cmap = lc.ControlMap(4096, 1000, stripe, 64)
    assert cmap.pages == 8 and cmap.start // stripe == 0
    stripes = [cmap.page_offset(p) // stripe for p in range(cmap.pages)]
    assert stripes == list(range(1, 9)) and cmap.head // stripe == 1
    rows = sorted(cmap.row_offset(r) for r in range(1000))
    assert len(set(rows)) == 1000 and all(b - a >= lc.ROW_BYTES for a, b in zip(rows, rows[1:]))
    assert all(cmap.head + lc.LINE <= off for off in rows)
    assert {cmap.row_offset(r) // stripe for r in range(1000)} == set(stripes)
    # what a checkpoint holds reads back as the logical words
    words = np.arange(lc.slots_for(1000), dtype=np.int64) + 7
    raw = np.zeros(cmap.slots, np.int64)
    for w in [lc.VERSION, *range(lc.GENERATION, lc.RANK_BASE), *range(lc.RANK_BASE, lc.slots_for(1000))]:
        raw[cmap.slot(w)] = words[w]
    assert np.array_equal(cmap.gather(raw), words)
    # every rank's row is in exactly one heartbeat chunk
    chunks = cmap.chunks(100)
    seen = [r for chunk in chunks for piece in chunk for r in cmap.ranks_of(*piece)]
    assert sorted(seen) == list(range(1000)) and len(chunks) <= 2 * 10 + 1
    assert all(sum(rows for _p, _f, rows in chunk) <= 100 for chunk in chunks)
    # 10,000 ranks on 79 pages of 127: two pages a chunk, 40 chunks (not 79)
    assert len(lc.ControlMap(4096, 10_000, stripe, 256).chunks(256)) == 40
    # one server: everything together after the table, no stripes reserved
    one = lc.ControlMap(4096, 1000, stripe, 1)
    assert one.pages == 1 and one.end == 4096 + 2 * lc.LINE + 1000 * lc.ROW_BYTES


async def _read_per_poll(store: ParameterStore, polls: int) -> tuple[int, int]:
    """(bytes the servers sent, polls) over ``polls`` polls of the barrier
    ``store`` waits at (nothing else reads meanwhile)."""
    stat = await _stat_reply(store.client)
    start = store.stats["barrier_polls"]
    await _polls_until(store, start + 3)
    done, before = store.stats["barrier_polls"], await _bytes_out(store.client)
    await _polls_until(store, done + polls)
    return await _bytes_out(store.client) - before - stat, store.stats["barrier_polls"] - done


@pytest.mark.parametrize("workers", [16, 256])
async def test_the_barriers_read_one_line_per_poll(cluster: smb2.LocalCluster, workers: int) -> None:
    """Rank 0 waits at the start barrier while the others have not joined:
    each of its polls reads 64 bytes from the servers, at 16 workers as at
    256 (the whole table was 8 * (8 + 4 * workers) bytes a poll).  Then the
    others join at once and everybody passes on the count alone.  The end
    barrier (``await_finished``) polls the same line, and reads the rows
    once, when the count says all finished."""
    stores = await _open_job(cluster, f"cs-join-{workers}", workers)
    rank0 = asyncio.ensure_future(stores[0].join(timeout=120))
    read, polls = await _read_per_poll(stores[0], 20)
    # (one poll may land between the counter and the servers' count)
    assert abs(read - lc.LINE * polls) <= lc.LINE + STAT_JITTER, (read, polls)
    await asyncio.gather(rank0, *(s.join(timeout=120) for s in stores[1:]))
    assert lc.joins_counted((await stores[1].refresh()).words, 1) == workers
    assert all(s.stats["barrier_full_reads"] == 0 for s in stores)
    assert (await stores[0].refresh()).missing() == []

    await asyncio.gather(*(s.finish() for s in stores[:-1]))
    end = asyncio.ensure_future(stores[0].await_finished(timeout=120))
    read, polls = await _read_per_poll(stores[0], 10)
    assert abs(read - lc.LINE * polls) <= lc.LINE + STAT_JITTER, (read, polls)
    await stores[-1].finish()
    assert (await end).complete and stores[0].stats["barrier_full_reads"] == 1


async def test_the_defaults_end_barrier_reads_the_table_once_to_give_up_on_a_silent_rank(
        cluster: smb2.LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under rule allreduce every live rank beats until it finishes, so the
    end barrier stops waiting for ranks silent for ``dead_after``: at 256
    workers, one of them silent (its client closed before it finished), rank
    0 gives up on it within the wait, and to see it reads every row once,
    then at each look only that rank's row (and the head line), not the
    table; and once more every row for its report."""
    name, workers = "cs-end-silent", 256
    clients = await _clients(cluster, 8)
    lone = await cluster.connect(transport="tcp")
    kw: dict[str, Any] = dict(workers=workers, timeout=60, rule="allreduce", dead_after=3.0)
    first = await ParameterStore.open(clients[0], name, _params(), rank=0, **kw)
    rest = await asyncio.gather(*(ParameterStore.open(lone if r == workers - 1 else clients[r % len(clients)], name,
                                                      _params(), rank=r, **kw) for r in range(1, workers)))
    stores = [first, *rest]
    await asyncio.gather(*(s.join(timeout=120) for s in stores))
    await lone.close()              # the last rank's heartbeat stops, unfinished
    await asyncio.gather(*(s.finish() for s in stores[:-1]))
    reads: list[tuple[int, ...] | None] = []
    real = store_mod._read_control

    async def counted(buf: Any, cmap: Any, ranks: tuple[int, ...] | None = None) -> Any:
        reads.append(None if ranks is None else tuple(ranks))
        return await real(buf, cmap, ranks)

    monkeypatch.setattr(store_mod, "_read_control", counted)
    end = await first.await_finished(timeout=120)
    assert [m[0] for m in end.missing] == [workers - 1], str(end)
    assert "takes it for dead, so this rank stopped waiting for it" in str(end) and end.waited < 120
    # (dead_after=3 s of silence, looked at once a second: three looks at least after the first)
    assert reads[0] is None and reads[-1] is None and len(reads) >= 5, reads
    assert all(r == (workers - 1,) for r in reads[1:-1]), reads


async def test_a_dead_rank_among_256_is_found_by_the_rotating_heartbeat(cluster: smb2.LocalCluster,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat reads the head line and one chunk of 32 rows: a rank that
    stopped is reported stalled at the latest once rank 0's heartbeats went
    round every chunk, and each heartbeat read a chunk, not the table."""
    monkeypatch.setattr(lc, "ROTATION", 32)
    stores = await _open_job(cluster, "cs-dead", 256)
    await asyncio.gather(*(s.join(timeout=120) for s in stores))
    dead, rank0 = 9, stores[0]
    await asyncio.gather(*(s.heartbeat(1, force=True) for s in stores))
    await rank0.refresh()           # rank 0 saw every row, rank 9's fresh
    await asyncio.sleep(1.2)        # ... then rank 9 stays silent
    await asyncio.gather(*(s.heartbeat(2, force=True) for r, s in enumerate(stores) if r != dead))
    assert dead not in [r for r, _step, _age in rank0.stalled(1.0)]       # (as last seen)
    chunks = len(rank0.cmap.chunks(lc.ROTATION))
    assert chunks == 8          # 256 rows in chunks of 32, on 2 pages
    stat = await _stat_reply(rank0.client)
    before = await _bytes_out(rank0.client)
    beats = 0
    while dead not in [r for r, _step, _age in rank0.stalled(1.0)]:
        assert beats < chunks, "the rotation went round every rank without finding the silent one"
        await rank0.heartbeat(3, force=True)
        beats += 1
    read = await _bytes_out(rank0.client) - before - stat
    assert read <= beats * (lc.LINE + 32 * lc.ROW_BYTES) + STAT_JITTER, (read, beats)
    assert read < beats * 256 * lc.ROW_BYTES
    step, age = next((s, a) for r, s, a in rank0.stalled(1.0) if r == dead)
    assert step == 1 and age >= 1.0
    # a full read (as every heartbeat made before) says the same at once
    assert dead in [r for r, _s, _a in (await rank0.refresh()).stalled(1.0)]


async def test_a_store_of_the_older_format_is_refused_with_what_to_do(cluster: smb2.LocalCluster) -> None:
    """A store as smb2 wrote it before the counted barrier (format 2: every
    control word in one block after the table) is neither opened, attached
    nor listed as if it were of this format: each says so in words, with the
    way out, and nothing of it is written."""
    client = await cluster.connect()
    workers = 4
    params = _params()
    table = msgpack.packb({"tensors": [["w", "float32", [8, 8], 0], ["b", "float32", [8], 256]],
                           "workers": workers, "rule": {"name": "accumulate"}})
    note_off = (64 + len(table) + 7) // 8 * 8
    slots = 8 + 4 * workers
    data_off = (note_off + 8 * slots + 4095) // 4096 * 4096
    buf = await client.create("cs-old", data_off + 288, stripe=4096)
    await buf.write(64, table)
    await buf.write(note_off, np.array([5, 1, 0, 0, 0, 0, 0, 0] + [1, 7, 1, 0] * workers, np.int64))
    await buf.write(0, np.array([store_mod.MAGIC, 2, store_mod.READY, len(table), data_off, 288, note_off, slots],
                                np.int64))
    image = (await buf.read(0, buf.nbytes)).tobytes()
    for rank in (0, 1):
        with pytest.raises(smb2.InterfaceError, match=r"store 'cs-old' was written by an older smb2 .* in store "
                                                      r"format 2; this smb2 reads format 3") as err:
            await ParameterStore.open(client, "cs-old", params, workers=workers, rank=rank, timeout=5)
        assert "smb2 rm cs-old" in (err.value.hint or "") and "the smb2 that wrote it" in (err.value.hint or "")
    with pytest.raises(smb2.InterfaceError, match="format 2"):
        await ParameterStore.attach(client, "cs-old", timeout=5)
    row = await store_mod.describe(client, "cs-old")
    assert row["store"] and row["format"] == 2 and "smb2 rm cs-old" in row["note"] and "run" not in row
    assert (await buf.read(0, buf.nbytes)).tobytes() == image


async def test_a_count_for_another_run_is_taken_back(cluster: smb2.LocalCluster) -> None:
    """A rank that chose run 1 and counts itself in after run 1's counter
    word was taken over by a later run (tagged 3: run 3 reuses run 1's word)
    takes its count back, so run 3's barrier never passes on it; its next
    poll finds the newer run."""
    client = await cluster.connect()
    first = await ParameterStore.open(client, "cs-tag", _params(), workers=2, rank=0, timeout=20)
    late = await ParameterStore.open(client, "cs-tag", _params(), workers=2, rank=1, timeout=20)
    assert late.generation == 1
    word = late.cmap.offset(lc.joins_word(1))
    assert lc.joins_word(3) == lc.joins_word(1)
    await first.buf.write(word, np.array([3 << 32 | 1], np.int64))
    await late._count_in()
    assert int((await first.buf.read(word, 8)).view(np.int64)[0]) == 3 << 32 | 1
    # counted in run 1, it would have made it 1 << 32 | 2: run 1's barrier is not passed by it either
    assert lc.tagged_count(3 << 32 | 1, 1) == 0 and lc.tagged_count(3 << 32 | 1, 3) == 1


async def test_a_rank_in_the_rows_but_not_in_the_count_is_found_by_the_rows(cluster: smb2.LocalCluster,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that wrote its row and died before its count (then came back
    into the run, which does not count again) leaves the counter one short:
    after RECONCILE_POLLS polls without progress the waiting rank reads the
    rows, finds everybody, and passes."""
    monkeypatch.setattr(store_mod, "RECONCILE_POLLS", 3)
    client = await cluster.connect()
    first = await ParameterStore.open(client, "cs-short", _params(), workers=2, rank=0, timeout=20)
    late = await ParameterStore.open(client, "cs-short", _params(), workers=2, rank=1, timeout=20)
    await late._write_own(joined=late.generation)       # its row, and no count
    await first.join(timeout=60)
    assert lc.joins_counted((await first.refresh()).words, 1) == 1
    assert first.stats["barrier_full_reads"] == 1 and first.stats["barrier_polls"] >= 4
