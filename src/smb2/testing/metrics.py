"""``smb2-server --metrics`` from the outside: a server process that says
where its metrics are, a scrape parsed into samples, and a flood of scrapers."""

from __future__ import annotations

import asyncio
import urllib.request

from .launch import ServerProcess

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """One scrape of ``url``: every sample by (name, sorted labels)."""
    # prometheus-client is the metrics extra's, not the library's
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How far one sample moved between two scrapes."""
    return value(after, name, **labels) - value(before, name, **labels)


def bucket_counts(samples: Samples, name: str, **labels: str) -> dict[str, float]:
    """A histogram's cumulative bucket counts by ``le``."""
    want = set(labels.items())
    return {dict(k[1])["le"]: v for k, v in samples.items()
            if k[0] == f"{name}_bucket" and want <= set(k[1])}


class MetricsServer(ServerProcess):
    """An ``smb2-server --metrics 127.0.0.1:0``; ``url`` is where it serves them."""

    def __init__(self, *flags: str) -> None:
        super().__init__("--metrics", "127.0.0.1:0", *flags)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "metrics on http://" in line, line
        self.url = line.split()[-1]

    async def scrape(self) -> Samples:
        """One scrape, off the event loop."""
        return await asyncio.to_thread(scrape, self.url)


# N connections scraping URL over and over for SECONDS (raw HTTP/1.0, so the
# flooding process is not what limits the rate); prints how many got a 200,
# and how many readings of the server those were (a reading's uptime is its own)
FLOOD = """
import asyncio, sys, time, urllib.parse
url, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
host, port = urllib.parse.urlsplit(url).netloc.rsplit(":", 1)
async def scrape(end, ok):
    while time.monotonic() < end:
        try:
            r, w = await asyncio.open_connection(host, int(port))
            w.write(b"GET /metrics HTTP/1.0\\r\\n\\r\\n")
            body = await r.read()
            if body.startswith(b"HTTP/1.1 200"):
                ok.append(next(ln for ln in body.split(b"\\n") if ln.startswith(b"smb2_uptime_seconds ")))
            w.close()
        except OSError:
            pass
async def main():
    ok, end = [], time.monotonic() + seconds
    await asyncio.wait_for(asyncio.gather(*(scrape(end, ok) for _ in range(n))), seconds + 10)
    print(len(ok), len(set(ok)))
asyncio.run(main())
"""

