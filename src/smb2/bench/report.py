"""What every benchmark reports, written once: a run's JSON (with the machine
it ran on, the smb2 version and the 64-byte round trip of its servers, so a
figure is never read without its context), the text table, the PNG, and a
long run's progress lines.

    progress("lock", 2, 12, "contended, 4 procs, park", rate="41230/s")    # as a cell ends, on stderr
    rtt = await round_trip_us(servers)
    print(table(["servers", "GB/s", "x 1 srv"], rows, formats=[None, "{:.3f}", "{:.2f}x"]))
    write_json(args.json, result, round_trip_64B_us=rtt)
    plot(args.png, draw)           # draw(plt) -> figure; a sentence if matplotlib is missing

A benchmark's own code only picks what goes in (which columns, which rows,
what the figure draws); how it is laid out (widths, separators, number
formats, the files' shape) is here, so every benchmark reads alike.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from .common import describe_machine

#: what the PNG needs (the bench extra): said instead of drawing when it is missing
NO_MATPLOTLIB = "matplotlib is not installed: no plot (pip install 'smb2[bench]')"


async def round_trip_us(servers: Sequence[str | tuple[str, int]], n: int = 200, transport: str = "tcp") -> float:
    """The median round trip of a 64-byte read from the first server, in µs
    (the yardstick every figure of a run is read against)."""
    import smb2

    name = f"bench-rtt-{time.monotonic_ns()}"
    async with await smb2.connect(list(servers[:1]), transport=transport) as c:
        buf = await c.create(name, 4096)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await buf.read(0, 64)
            times.append(time.perf_counter() - t0)
        await c.destroy(name)
    return statistics.median(times) * 1e6


def write_json(path: str | Path, result: dict[str, Any], *, round_trip_64B_us: float | None,
               quiet: bool = False) -> Path:
    """Write a run's result where ``--json`` says, making the directory; the
    machine it ran on, the smb2 version and the run's 64-byte round trip (µs,
    the yardstick its figures are read against) are added.  Every benchmark
    states the round trip: None only where the run had no server to ask
    (written as null, so a reader sees it is missing, not zero)."""
    from ..version import __version__

    result.setdefault("machine", describe_machine())
    result.setdefault("smb2", __version__)
    result.setdefault("finished", time.time())
    result["round_trip_64B_us"] = None if round_trip_64B_us is None else round(round_trip_64B_us, 1)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if not quiet:
        print(f"wrote {out}", file=sys.stderr)
    return out


def median_round_trip(values: Sequence[float | None]) -> float | None:
    """The median of the round trips a run measured beside its figures (one
    per row, per scenario, per server count), None when it measured none."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def cell(value: Any, fmt: str | None = None) -> str:
    """One table cell: ``fmt`` a ``str.format`` template for a number
    ("{:.2f}x", "{:.1%}"), floats by default as ``:g``; None is "-"."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value) if fmt else f"{value:g}" if isinstance(value, float) else str(value)
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, formats: Sequence[str | None] | None = None,
          markdown: bool = False, indent: int = 0) -> str:
    """Rows as aligned text columns (numbers right-aligned), or as a markdown
    table.  ``formats``: one ``str.format`` template (or None) per column,
    used on that column's numbers; a missing value (None) shows as "-"."""
    fmts = list(formats or []) + [None] * (len(header) - len(formats or []))
    cells = [[str(c) for c in header]] + [[cell(c, f) for c, f in zip(r, fmts)] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + " --- |" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells[1:]])
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(r[i] is None or isinstance(r[i], (int, float)) for r in rows) for i in range(len(header))]
    pad = " " * indent
    return "\n".join(pad + "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric))
                     .rstrip() for r in cells)


def verdict(met: bool) -> str:
    """How a target reads in every benchmark's output."""
    return "met" if met else "NOT met"


def target(relation: str, bound: float, fmt: str, met: bool) -> str:
    """A target cell: ``target(">=", 1.5, "{:.2f}x", True)`` is ">= 1.50x met"."""
    return f"{relation} {fmt.format(bound)} {verdict(met)}"


def plot(path: str | Path, draw: Callable[[Any], Any], dpi: int = 110) -> str | None:
    """Draw a PNG: ``draw(plt)`` makes the figure (and returns it).  None when
    drawn, else why not (matplotlib is optional: the bench extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return NO_MATPLOTLIB
    fig = draw(plt)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return None


def style(ax: Any, *, title: str, xlabel: str, ylabel: str | None = None, xticks: Sequence[Any] | None = None,
          legend: bool = True) -> None:
    """Every benchmark's panel looks alike: its title, axis labels, ticks at
    the measured points, a light grid and a small legend."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if xticks is not None:
        ax.set_xticks(list(xticks), [str(x) for x in xticks])
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)


#: each benchmark's count of its progress lines: (when the count began, done
#: then, total, done at the last line)
_counts: dict[str, tuple[float, int, int, int]] = {}
#: the progress lines' clock (a test sets its own)
clock: Callable[[], float] = time.monotonic


def duration(seconds: float) -> str:
    """A span of time as a progress line says it: "42.0 s", "6m09s", "1h02m"."""
    s = round(seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress(bench: str, done: int, total: int, what: str, /, **figures: Any) -> str:
    """One line of a long run's progress on stderr, alike in every benchmark:
    ``[bench tta] 3/12 homogeneous run 2: ddp 61.8 s to target (2m03s elapsed,
    about 6m09s left)``.  ``done`` of ``total`` units (runs, cells, rounds)
    are finished; ``figures`` follow ``what`` as "name value", each value
    as a table cell.  The time elapsed runs from the first line of a count
    (a bench's first, or one with another total or fewer done: its next
    phase, or a run again in this process), so a loop says ``done`` 0 before
    its first unit; what is left extrapolates the pace of the units done
    since.  The line is returned too."""
    t = clock()
    began, done0, total0, last = _counts.get(bench, (t, done, total, done))
    if total != total0 or done < last:
        began, done0 = t, done
    _counts[bench] = (began, done0, total, done)
    elapsed = t - began
    timing = f"{duration(elapsed)} elapsed"
    if done0 < done < total:
        timing += f", about {duration(elapsed / (done - done0) * (total - done))} left"
    shown = ", ".join(f"{name} {cell(value)}" for name, value in figures.items())
    line = f"[bench {bench}] {done}/{total} {what}{': ' + shown if shown else ''} ({timing})"
    print(line, file=sys.stderr, flush=True)
    return line


def run_and_report(benchmark: Callable[[], Coroutine[Any, Any, dict[str, Any]]],
                   summarize: Callable[[dict[str, Any]], Any], format_table: Callable[[Any], str],
                   json_path: str, round_trip: Callable[[dict[str, Any]], float | None]) -> int:
    """Run ``benchmark`` on uvloop, store its summary in the result, print
    the table, write every sample to ``json_path`` ('' for none) with the
    round trip ``round_trip(result)`` picks: the exit
    status (1 when smb2 or the system failed it)."""
    import uvloop

    from ..errors import Smb2Error
    try:
        result = uvloop.run(benchmark())
    except (Smb2Error, OSError, RuntimeError) as exc:
        print(f"smb2 bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("smb2 bench: interrupted", file=sys.stderr)
        return 130
    summary = summarize(result)
    result["summary"] = summary
    print(format_table(summary))
    if json_path:
        write_json(json_path, result, round_trip_64B_us=round_trip(result))
    return 0
