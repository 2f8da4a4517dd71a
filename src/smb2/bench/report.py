"""What every benchmark reports, written once: a run's JSON (with the machine
it ran on, the smb2 version and the 64-byte round trip of its servers, so a
figure is never read without its context), the text table, and the PNG.

    result["round_trip_64B_us"] = await round_trip_us(servers)
    print(table(["servers", "GB/s"], rows))
    write_json(args.json, result)
    plot(args.png, draw)           # draw(plt) -> figure; a sentence if matplotlib is missing
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


async def round_trip_us(servers: Sequence[str], n: int = 200, transport: str = "tcp") -> float:
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


def write_json(path: str | Path, result: dict[str, Any], *, quiet: bool = False) -> Path:
    """Write a run's result where ``--json`` says, making the directory; the
    machine it ran on and the smb2 version are added unless the run says them."""
    from ..version import __version__

    result.setdefault("machine", describe_machine())
    result.setdefault("smb2", __version__)
    result.setdefault("finished", time.time())
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if not quiet:
        print(f"wrote {out}", file=sys.stderr)
    return out


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, markdown: bool = False) -> str:
    """Rows as aligned text columns (numbers right-aligned), or as a markdown table."""
    cells = [[str(c) for c in header]] + [[f"{c:g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + " --- |" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells[1:]])
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(isinstance(r[i], (int, float)) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip()
                     for r in cells)


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


def run_and_report(benchmark: Callable[[], Coroutine[Any, Any, dict[str, Any]]],
                   summarize: Callable[[dict[str, Any]], Any], format_table: Callable[[Any], str],
                   json_path: str) -> int:
    """Run ``benchmark`` on uvloop, store its summary in the result, print
    the table, write every sample to ``json_path`` ('' for none): the exit
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
        write_json(json_path, result)
    return 0
