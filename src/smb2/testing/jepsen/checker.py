"""The checker: plain functions over a history, each returning its violations in words
(:func:`check` runs them all; :func:`report` says what a run did and found)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .history import FAIL, OK, UNKNOWN, Final, History, Op

# The checker: plain functions over a history, each returning its violations in words

def subset_sums(values: Sequence[int]) -> int:
    """A bitset (a Python int) whose bit s is set if some subset of ``values`` sums to s."""
    sums = 1
    for v in values:
        sums |= sums << v
    return sums


def check_counters(ops: Sequence[Op], final: Final) -> list[str]:
    """Each counter's final value == its acknowledged increments + a subset of its unknown ones."""
    if final.counters is None:
        return [f"the counters could not be read after the run: {final.error}"]
    out = []
    for k, got in enumerate(final.counters):
        incs = [op for op in ops if op.kind == "accumulate" and op.key == k]
        acked = sum(op.value for op in incs if op.outcome == OK)
        unknown = [op.value for op in incs if op.outcome == UNKNOWN]
        extra = got - acked
        if extra < 0:
            out.append(f"counter {k}: final {got}, but {acked} was acknowledged: "
                       f"{-extra} of acknowledged increments lost")
        elif not (subset_sums(unknown) >> extra) & 1:
            out.append(f"counter {k}: final {got} = acknowledged {acked} + {extra}, which no subset of the "
                       f"{len(unknown)} unknown increments (sum {sum(unknown)}) makes: applied twice or invented")
    return out


def check_reads(ops: Sequence[Op]) -> list[str]:
    """A read of a counter returns acknowledged data: at least every increment acknowledged before
    it began, at most every increment (not refused) begun before it ended."""
    out = []
    incs: dict[int, list[Op]] = {}
    for op in ops:
        if op.kind == "accumulate" and op.outcome != FAIL:
            incs.setdefault(op.key, []).append(op)
    for op in ops:
        if op.kind != "read" or op.outcome != OK:
            continue
        mine = incs.get(op.key, [])
        low = sum(i.value for i in mine if i.outcome == OK and i.complete < op.invoke)
        high = sum(i.value for i in mine if i.invoke < op.complete)
        if not low <= op.result <= high:
            what = "lost acknowledged increments" if op.result < low else "returned data never written"
            out.append(f"read of counter {op.key} by process {op.process} at {op.invoke:.3f}: {op.result}, "
                       f"outside [{low}, {high}]: {what}")
    return out


def check_fetch_adds(ops: Sequence[Op], final: Final) -> list[str]:
    """fetch_add results are unique; the final word counts every acknowledged one."""
    out = []
    adds = [op for op in ops if op.kind == "fetch_add"]
    results = Counter(op.result for op in adds if op.outcome == OK)
    dups = sorted(r for r, n in results.items() if n > 1)
    if dups:
        out.append(f"fetch_add returned the same old value more than once: {dups[:10]}"
                   f"{' ...' if len(dups) > 10 else ''} ({len(dups)} values)")
    acked = sum(results.values())
    unknown = sum(1 for op in adds if op.outcome == UNKNOWN)
    if final.fetch_add is None:
        out.append(f"the fetch_add word could not be read after the run: {final.error}")
    elif not acked <= final.fetch_add <= acked + unknown:
        out.append(f"fetch_add word: final {final.fetch_add}, outside [{acked}, {acked + unknown}] "
                   f"({acked} acknowledged, {unknown} unknown)")
    elif results and max(results) >= final.fetch_add:
        out.append(f"fetch_add returned {max(results)}, but the final word is {final.fetch_add}")
    return out


def check_lock(ops: Sequence[Op], final: Final) -> list[str]:
    """Holders whose fenced writes were acknowledged never overlap, their tokens grow with time,
    and each read under the lock saw every acknowledged write before it (no lost update)."""
    out = []
    sections = sorted((op for op in ops if op.kind == "lock_rmw" and op.held is not None),
                      key=lambda op: op.held[0])  # type: ignore[index]
    acked = [op for op in sections if op.outcome == OK]
    for a, b in zip(acked, acked[1:]):
        assert a.held is not None and b.held is not None
        if b.held[0] < a.held[1]:
            out.append(f"lock held by process {a.process} (token {a.token}) over [{a.held[0]:.3f}, "
                       f"{a.held[1]:.3f}] and by process {b.process} (token {b.token}) from {b.held[0]:.3f}: "
                       "overlapping critical sections")
        elif a.token is not None and b.token is not None and not a.token < b.token:
            out.append(f"fencing tokens went backwards: {a.token} then {b.token}")
    by_token = sorted((op for op in sections if op.token is not None), key=lambda op: op.token)  # type: ignore
    ok_before = unknown_before = 0
    # after one lost (or phantom) update every later read is off by it too: count each once
    shift = 0
    for op in by_token:
        low, high = ok_before + shift, ok_before + unknown_before + shift
        if op.result is not None and not low <= op.result <= high:
            out.append(f"process {op.process} (token {op.token}, held from {op.held[0]:.3f}) read {op.result} "  # type: ignore
                       f"under the lock, outside [{low}, {high}]: "
                       + ("an acknowledged update was lost" if op.result < low else "a phantom update"))
            shift += op.result - (low if op.result < low else high)
        ok_before += op.outcome == OK
        unknown_before += op.outcome == UNKNOWN
    if final.record is None:
        out.append(f"the lock-protected record could not be read after the run: {final.error}")
    elif not ok_before <= final.record <= ok_before + unknown_before:
        out.append(f"lock-protected record: final {final.record}, outside [{ok_before}, "
                   f"{ok_before + unknown_before}] ({ok_before} acknowledged read-modify-writes)")
    return out


def check(history: History) -> list[str]:
    """Every violation the history shows (empty: it is consistent)."""
    return (check_counters(history.ops, history.final) + check_reads(history.ops)
            + check_fetch_adds(history.ops, history.final) + check_lock(history.ops, history.final))


def summary(history: History) -> str:
    outcomes = Counter((op.kind, op.outcome) for op in history.ops)
    kinds = sorted({k for k, _ in outcomes})
    return "; ".join(f"{k}: " + ", ".join(f"{outcomes[k, o]} {o}" for o in (OK, FAIL, UNKNOWN) if outcomes[k, o])
                     for k in kinds)



def report(history: History, violations: list[str]) -> str:
    lines = [f"jepsen seed {history.seed}: {len(history.ops)} operations ({summary(history)}); "
             f"{sum(1 for _, w in history.nemesis if not w.startswith('healed'))} faults"]
    lines += [f"  nemesis {w}" for _, w in history.nemesis]
    errors = Counter(f"{op.kind} {op.outcome}: {op.error[:100]}" for op in history.ops if op.outcome != OK)
    lines += [f"  {n} x {what}" for what, n in errors.most_common(5)]
    if history.final.error:
        lines.append(f"  the final read first failed: {history.final.error.splitlines()[0]}")
    if violations:
        lines.append(f"{len(violations)} violation(s) (seed {history.seed}):")
        lines += [f"  {v}" for v in violations]
    else:
        lines.append("no violation")
    return "\n".join(lines)
