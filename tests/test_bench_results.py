"""docs/bench keeps measured results, each read by a page: every file there is
named by README.md or a page under docs/, by its name or by a pattern the
page spells out (``scale_quiet_W_R.json``: a capital letter between
underscores stands for a number; ``accumulate_threads_quiet_{1,2,3}.json``: a
choice), so a result no page reads is removed rather than kept."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "bench"
#: a file name as a page writes it (the pattern's braces and capitals included)
CITED = re.compile(r"[A-Za-z0-9_{},.-]+\.(?:json|png)")
PLACEHOLDER = re.compile(r"((?<=_)[A-Z](?=[_.]))")


def as_pattern(cited: str) -> re.Pattern[str]:
    """The file names a citation covers."""
    out = ""
    for part in re.split(r"(\{[^}]*\})", cited):
        if part.startswith("{"):
            out += "(?:" + "|".join(map(re.escape, part[1:-1].split(","))) + ")"
            continue
        # split on a capturing group: the placeholders are the odd pieces
        out += "".join(r"\d+" if i % 2 else re.escape(bit) for i, bit in enumerate(PLACEHOLDER.split(part)))
    return re.compile(out)


def uncited(pages: list[str], names: list[str]) -> list[str]:
    """The names no page cites."""
    patterns = [as_pattern(c) for text in pages for c in CITED.findall(text)]
    return [n for n in names if not any(p.fullmatch(n) for p in patterns)]


def test_every_kept_result_is_cited_by_a_page() -> None:
    pages = [p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    names = sorted(p.name for p in RESULTS.iterdir())
    assert names and uncited(pages, names) == []


def test_the_check_reads_names_and_patterns() -> None:
    page = ("medians of 3 (`docs/bench/scale_quiet_W_R.json`); threads in "
            "`docs/bench/accumulate_threads_quiet_{1,2}.json`, the plot [here](bench/lock.png)")
    names = ["scale_quiet_64_1.json", "accumulate_threads_quiet_2.json", "accumulate_threads_quiet_3.json",
             "lock.png", "lock.json", "scale_quiet_x_1.json"]
    assert uncited([page], names) == ["accumulate_threads_quiet_3.json", "lock.json", "scale_quiet_x_1.json"]
