"""_core against plain-Python references (hypothesis)."""

from __future__ import annotations

import os
import signal
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smb2 import _core
from smb2.protocol import DTYPE_CODES, WIRE_CODES
from smb2.testing.floats import NARROW, float32_arrays, same_floats, widen

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)


@given(st.integers(0, 255), st.integers(0, 255), st.integers(0, 65535), st.integers(0, 65535),
       U32, U32, U64, U64)
def test_header_roundtrip(version: int, op: int, flags: int, status: int, rid: int, seg: int,
                          off: int, length: int) -> None:
    raw = _core.encode_header(version, op, flags, status, rid, seg, off, length)
    assert raw == struct.pack("<HBBHHIIQQ", 0x3253, version, op, flags, status, rid, seg, off, length)
    assert _core.decode_header(raw) == (0x3253, version, op, flags, status, rid, seg, off, length)
    # at an offset inside a larger buffer, and with a payload behind it
    framed = _core.encode_header_with(version, op, flags, status, rid, seg, off, length, b"xyz")
    assert framed == raw + b"xyz"
    assert _core.decode_header(b"\0" * 5 + raw, 5)[5:] == (rid, seg, off, length)


def test_header_rejects_short_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        _core.decode_header(b"\0" * 31)
    with pytest.raises(ValueError):
        _core.decode_header(b"\0" * 40, 9)
    with pytest.raises(ValueError):
        _core.encode_header(256, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(OverflowError):
        _core.encode_header(1, 0, 0, 0, 2**32, 0, 0, 0)


@given(U64, U64)
def test_u64_codecs(a: int, b: int) -> None:
    assert _core.pack_u64(a) == struct.pack("<Q", a)
    assert _core.pack_u64x2(a, b) == struct.pack("<QQ", a, b)
    assert _core.unpack_u64(struct.pack("<QQ", a, b), 8) == b


def _fnv1a(name: str) -> int:
    h = 0xCBF29CE484222325
    for byte in name.encode():
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


@given(st.text(max_size=40))
def test_name_hash_is_fnv1a(name: str) -> None:
    assert _core.name_hash(name) == _fnv1a(name)


def test_name_hash_is_stable() -> None:
    # placement depends on it: it must never change between versions
    assert _core.name_hash("params") == 0x454186d7df024a93
    assert _core.name_hash("") == 0xCBF29CE484222325


def _reference_plan(nbytes: int, stripe: int, n: int, first: int, offset: int, length: int,
                    max_request: int) -> dict[int, list[tuple[int, int, int]]]:
    """byte-by-stripe reference: per server, the list of (segment offset,
    buffer offset relative to the range, length) runs, in segment order."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    pos = offset
    while pos < offset + length:
        i = pos // stripe
        end = min((i + 1) * stripe, offset + length)
        server = (first + i) % n
        seg = (i // n) * stripe + pos % stripe
        out.setdefault(server, []).append((seg, pos - offset, end - pos))
        pos = end
    for runs in out.values():
        runs.sort()
    return out


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_plan_matches_reference(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 9), label="servers")
    # byte maps below are per byte: keep buffers small (the planner only
    # sees ratios; the big-stripe cases are the examples after this test)
    stripe = data.draw(st.sampled_from([8, 16, 64, 1000]), label="stripe")
    nbytes = data.draw(st.integers(1, 40 * stripe), label="nbytes")
    offset = data.draw(st.integers(0, nbytes), label="offset")
    length = data.draw(st.integers(0, nbytes - offset), label="length")
    first = data.draw(st.integers(0, n - 1), label="first")
    max_request = data.draw(st.sampled_from([8, 24, 100, stripe, 3 * stripe, 1 << 30]), label="max")
    max_request = max(max_request, length // 2000 + 1)
    reqs, pieces = _core.plan(nbytes, stripe, n, first, offset, length, max_request)
    ref = _reference_plan(nbytes, stripe, n, first, offset, length, max_request)
    size = _core.segment_size(nbytes, stripe, n)

    got: dict[int, list[tuple[int, int, int]]] = {}
    covered = np.zeros(length, dtype=np.int32)
    for r in range(0, len(reqs), 5):
        server, seg_off, ln, p0, np_ = reqs[r:r + 5]
        assert 0 < ln <= max_request
        assert seg_off + ln <= size
        assert np_ >= 1
        total = 0
        for p in range(p0, p0 + np_):
            boff, plen = pieces[2 * p], pieces[2 * p + 1]
            assert plen > 0
            got.setdefault(server, []).append((seg_off + total, boff, plen))
            covered[boff:boff + plen] += 1
            total += plen
        assert total == ln
    # every byte exactly once
    assert (covered == 1).all()
    # same bytes to the same segment offsets as the reference (runs may be cut
    # differently: compare byte maps)
    for server in set(ref) | set(got):
        def bytemap(runs: list[tuple[int, int, int]]) -> dict[int, int]:
            m: dict[int, int] = {}
            for seg, boff, ln in runs:
                for k in range(ln):
                    m[boff + k] = seg + k
            return m
        assert bytemap(got.get(server, [])) == bytemap(ref.get(server, []))
    # one contiguous segment range per server: requests of a server abut
    for runs in got.values():
        runs.sort()
        for (s0, _, l0), (s1, _, _) in zip(runs, runs[1:]):
            assert s0 + l0 == s1


def test_plan_one_request_per_server_when_small() -> None:
    # 4 servers, range covering all of them twice: still one request each
    reqs, pieces = _core.plan(64 << 20, 1 << 20, 4, 1, 0, 8 << 20, 64 << 20)
    servers = [reqs[r] for r in range(0, len(reqs), 5)]
    assert sorted(servers) == [0, 1, 2, 3]
    assert all(reqs[r + 4] == 2 for r in range(0, len(reqs), 5))   # two stripes each


def test_plan_merges_contiguous_pieces_on_one_server() -> None:
    reqs, pieces = _core.plan(64 << 20, 1 << 20, 1, 0, 5, 10 << 20, 64 << 20)
    assert list(reqs) == [0, 5, 10 << 20, 0, 1]
    assert list(pieces) == [0, 10 << 20]


def test_plan_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError):
        _core.plan(100, 8, 2, 0, 90, 11, 64)
    with pytest.raises(ValueError):
        _core.plan(100, 0, 2, 0, 0, 1, 64)


@settings(max_examples=200)        # no deadline (the suite's hypothesis profile): nothing here is timed
@given(st.sampled_from(sorted(DTYPE_CODES)), st.integers(0, 300), st.integers(0, 2**32 - 1))
def test_accumulate_matches_numpy(dtype: str, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    if dtype.startswith("float"):
        a = rng.standard_normal(n).astype(dtype)
        b = rng.standard_normal(n).astype(dtype)
    else:
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        b = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    expect = a + b            # numpy wraps integers around, as the kernel must
    dst = a.copy()
    _core.accumulate(dst.view(np.uint8), b.view(np.uint8), DTYPE_CODES[dtype])
    assert np.array_equal(dst, expect)


def test_accumulate_unaligned_views() -> None:
    # the kernel must not assume aligned memory (payload views in the inbox)
    raw = np.zeros(8 * 10 + 3, dtype=np.uint8)
    dst = raw[3:3 + 80]
    src = np.arange(10, dtype=np.float64)
    srcraw = np.zeros(80 + 1, dtype=np.uint8)
    srcraw[1:] = src.view(np.uint8)
    _core.accumulate(dst, srcraw[1:], DTYPE_CODES["float64"])
    _core.accumulate(dst, srcraw[1:], DTYPE_CODES["float64"])
    assert np.array_equal(dst.copy().view(np.float64), src * 2)


@settings(max_examples=100)
@given(st.sampled_from(sorted(DTYPE_CODES.items()) + sorted(WIRE_CODES.items())), st.integers(0, 5000),
       st.integers(1, 9), st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_accumulate_cut_among_threads_is_bit_for_bit_one_thread(kind: tuple[str, int], n: int, threads: int,
                                                                offset: int, seed: int) -> None:
    # every item added once, by its own part: the same bits as one thread,
    # for every kind (the widening ones too), length and cut, and unaligned
    name, code = kind
    item, src_item = _core.dtype_sizes(code)
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, offset + n * item, dtype=np.uint8)[offset:]
    src = rng.integers(0, 256, offset + n * src_item, dtype=np.uint8)[offset:]
    one, cut = base.copy(), base.copy()
    assert _core.accumulate(one, src, code) == 1
    # parts of at least 64 bytes: up to ``threads`` of them over this length
    parts = _core.accumulate(cut, src, code, threads, 64)
    assert parts == max(1, min(threads, n * item // 64)), (name, n, threads)
    assert one.tobytes() == cut.tobytes(), (name, n, threads)


def test_accumulates_cut_from_many_threads_at_once_each_add_every_part_once() -> None:
    # one batch runs on the pool at a time; the others do their parts on
    # their own thread: every call's every item added once, whichever ran it
    rounds, n = 40, 1 << 16
    arrays = [np.zeros(n, np.float32) for _ in range(4)]
    ones = np.ones(n, np.float32)

    def pusher(dst: np.ndarray) -> int:
        return sum(_core.accumulate(dst.view(np.uint8), ones.view(np.uint8), 1, 4, 4096) for _ in range(rounds))

    with ThreadPoolExecutor(4) as pool:
        parts = list(pool.map(pusher, arrays))
    assert parts == [4 * rounds] * 4
    for dst in arrays:
        assert (dst == rounds).all()


def test_a_forked_child_cuts_accumulates_among_threads_of_its_own() -> None:
    # the parent's pool is started; the child has none of its threads and
    # must neither wait for them nor find the pool's locks held
    # (the parked workers' condition variable, copied into the child, hung about one child in eight of
    # the code before in a loop like this one: forty children, each with an alarm as its hang guard)
    dst, ones = np.zeros(1 << 16, np.float32), np.ones(1 << 16, np.float32)
    for turn in range(1, 41):
        assert _core.accumulate(dst.view(np.uint8), ones.view(np.uint8), 1, 4, 4096) == 4
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)
            ok = _core.accumulate(dst.view(np.uint8), ones.view(np.uint8), 1, 4, 4096) == 4 and \
                (dst == turn + 1).all()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, (turn, status)
        assert (dst == turn).all()


def test_accumulate_rejects_bad_input() -> None:
    a = np.zeros(16, dtype=np.uint8)
    with pytest.raises(ValueError):
        _core.accumulate(a, np.zeros(8, dtype=np.uint8), 1)
    with pytest.raises(ValueError):
        _core.accumulate(a, a.copy(), 99)
    with pytest.raises(ValueError):
        _core.accumulate(a[:6], a[:6].copy(), 1)
    with pytest.raises(ValueError):
        _core.accumulate(a, a.copy(), 1, 0)


# -- half-width floats: bf16 and fp16 pushes (accumulate(wire=...)) ---------

_TO = {"bfloat16": _core.to_bfloat16, "float16": _core.to_float16}
_FROM = {"bfloat16": _core.from_bfloat16, "float16": _core.from_float16}


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(WIRE_CODES)), float32_arrays())
def test_narrowing_matches_reference(wire: str, x: np.ndarray) -> None:
    out = np.empty(x.size, np.uint16)
    _TO[wire](x, out)
    ref = NARROW[wire](x)
    nan = np.isnan(x)
    assert np.array_equal(out[~nan], ref[~nan])
    # NaN stays NaN, with its sign
    assert np.isnan(widen(out[nan], wire)).all()
    assert np.array_equal(out[nan] >> 15, x[nan].view(np.uint32) >> 31)


@pytest.mark.parametrize("wire", sorted(WIRE_CODES))
def test_widening_is_exact_for_every_pattern(wire: str) -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.size, np.float32)
    _FROM[wire](bits, out)
    assert same_floats(out, widen(bits, wire))
    # and narrowing a widened value gives the pattern back (NaNs aside)
    back = np.empty(bits.size, np.uint16)
    _TO[wire](out, back)
    keep = ~np.isnan(out)
    assert np.array_equal(back[keep], bits[keep])


def test_bfloat16_agrees_with_torch() -> None:
    # a second, independent reference: torch's own float32 -> bfloat16 cast
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    x = rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32)
    out = np.empty(x.size, np.uint16)
    _core.to_bfloat16(x, out)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    keep = ~np.isnan(x)
    assert np.array_equal(out[keep], ref[keep])


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(WIRE_CODES)), st.data())
def test_widening_accumulate_matches_reference(wire: str, data: st.DataObject) -> None:
    delta = data.draw(float32_arrays(), label="delta")
    dst = data.draw(float32_arrays(), label="dst")
    dst = np.resize(dst, delta.size) if dst.size else np.zeros(delta.size, np.float32)
    narrow = NARROW[wire](delta)
    with np.errstate(invalid="ignore", over="ignore"):
        expect = dst + widen(narrow, wire)
    got = dst.copy()
    _core.accumulate(got.view(np.uint8), narrow.view(np.uint8), WIRE_CODES[wire])
    assert same_floats(got, expect)


def test_widening_accumulate_unaligned_views() -> None:
    dst_raw = np.zeros(4 * 100 + 1, np.uint8)
    dst = dst_raw[1:]
    src_raw = np.zeros(2 * 100 + 3, np.uint8)
    src_raw[3:] = _bf16_of(np.arange(100, dtype=np.float32)).view(np.uint8)
    for _ in range(2):
        _core.accumulate(dst, src_raw[3:], WIRE_CODES["bfloat16"])
    assert np.array_equal(dst.copy().view(np.float32), np.arange(100, dtype=np.float32) * 2)


def _bf16_of(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.size, np.uint16)
    _core.to_bfloat16(x, out)
    return out


def test_widening_accumulate_rejects_bad_lengths() -> None:
    code = WIRE_CODES["bfloat16"]
    dst = np.zeros(16, np.uint8)                    # 4 float32 words
    with pytest.raises(ValueError, match="need 8"):
        _core.accumulate(dst, np.zeros(16, np.uint8), code)      # same length: not half
    with pytest.raises(ValueError, match="need 8"):
        _core.accumulate(dst, np.zeros(7, np.uint8), code)
    with pytest.raises(ValueError, match="multiple of the item size"):
        _core.accumulate(dst[:6], np.zeros(3, np.uint8), code)
    assert _core.dtype_sizes(code) == (4, 2)
    assert _core.dtype_sizes(DTYPE_CODES["float64"]) == (8, 8)
    with pytest.raises(ValueError, match="unknown dtype code 7"):
        _core.dtype_sizes(7)
    assert not dst.any()


def test_conversions_reject_bad_buffers() -> None:
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="need 4-byte items in src and as many 2-byte"):
        _core.to_bfloat16(x, np.empty(7, np.uint16))
    with pytest.raises(ValueError, match="need 4-byte items"):
        _core.to_float16(x.view(np.uint8)[:6], np.empty(3, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        _core.to_bfloat16(x, bytes(16))
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.to_bfloat16(np.ones(16, np.float32)[::2], np.empty(8, np.uint16))
    with pytest.raises(ValueError, match="need 2-byte items in src and as many 4-byte"):
        _core.from_bfloat16(np.zeros(8, np.uint16), np.empty(7, np.float32))
    out = np.empty(8, np.float32)
    _core.from_float16(np.full(8, 0x3C00, np.uint16), out)      # 1.0 in float16
    assert (out == 1).all()


@given(st.integers(1, 10**9), st.sampled_from([8, 4096, 1 << 20]), st.integers(1, 16))
def test_segment_size_holds_every_stripe(nbytes: int, stripe: int, n: int) -> None:
    size = _core.segment_size(nbytes, stripe, n)
    nstripes = -(-nbytes // stripe)
    # the server holding the most stripes still fits them
    assert size == -(-nstripes // n) * stripe
    assert size * n >= nbytes


def test_no_hypothesis_check_is_tied_to_wall_time() -> None:
    """conftest's profile: no deadline, no "too slow" health check; and no
    test of the suite sets either back (a loaded machine failed
    test_header_roundtrip with FailedHealthCheck)."""
    import pathlib
    import re

    from hypothesis import HealthCheck
    assert settings.default.deadline is None
    assert HealthCheck.too_slow in settings.default.suppress_health_check
    for path in pathlib.Path(__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"(?:settings|profile|dict)\([^)]*\bdeadline\s*=\s*(?!None)", text), \
            f"{path.name} sets a hypothesis deadline"
        for m in re.finditer(r"suppress_health_check\s*=\s*\[([^\]]*)\]", text):
            assert "too_slow" in m.group(1), f"{path.name} turns the too_slow health check back on"
