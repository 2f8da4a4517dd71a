"""README's "Layout", the first map a newcomer meets, against src/smb2: every
module is named in it and every name in it is a module, so the map cannot
drift from the code.

The map's rules (README.md, the block under ``src/smb2/``): an entry is a
line indented two spaces whose first word is a path below src/smb2 -- a
module (``lock.py``, ``_core.pyx``) or a package (``server/``,
``train/example/``); lines indented further continue the entry above; lines
starting ``#`` are headings.  A package's modules are the ``*.py`` names in
its entry (its ``__init__.py`` and ``__main__.py`` are the package itself).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "smb2"
MODULE = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\.pyx?\b")
PACKAGE_ITSELF = {"__init__.py", "__main__.py"}


def readme_map() -> dict[str, str]:
    """Each entry of the map: its path below src/smb2 -> its text."""
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("\n## Layout\n"):]
    block = layout[layout.index("```\nsrc/smb2/\n") + len("```\nsrc/smb2/\n"):]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        if not line.startswith(" "):        # docs/, tools/, the block's end: past src/smb2
            break
        if line.startswith("  #"):
            current = None
        elif not line.startswith("   "):
            path, _, words = line.strip().partition(" ")
            assert path not in entries, f"README's Layout lists {path} twice"
            entries[path] = words
            current = path
        else:
            assert current is not None, f"README's Layout: a continuation line under a heading: {line!r}"
            entries[current] += " " + line.strip()
    return entries


def modules() -> tuple[set[str], dict[str, set[str]]]:
    """The modules at the top of src/smb2, and each package's (by its path, ``server/``)."""
    top = {p.name for p in SRC.iterdir() if p.suffix in (".py", ".pyx")}
    packages = {}
    for init in SRC.rglob("__init__.py"):
        if init.parent == SRC or "__pycache__" in init.parts:
            continue
        package = init.parent.relative_to(SRC).as_posix() + "/"
        packages[package] = {p.name for p in init.parent.iterdir() if p.suffix in (".py", ".pyx")}
    return top, packages


def disagreements(entries: dict[str, str], top: set[str], packages: dict[str, set[str]]) -> list[str]:
    """Where the map and the modules disagree, one line each (none: they agree)."""
    listed_top = {p for p in entries if not p.endswith("/")}
    listed = {p for p in entries if p.endswith("/")}
    out = [f"{m} is in src/smb2 but not in README's Layout" for m in sorted(top - listed_top)]
    out += [f"README's Layout lists {m}, which src/smb2 does not have" for m in sorted(listed_top - top)]
    out += [f"package {p} is in src/smb2 but not in README's Layout" for p in sorted(set(packages) - listed)]
    out += [f"README's Layout lists package {p}, which src/smb2 does not have" for p in sorted(listed - set(packages))]
    for package in sorted(listed & set(packages)):
        named = set(MODULE.findall(entries[package]))
        have = packages[package]
        out += [f"{package}{m} is not named in README's Layout entry {package}"
                for m in sorted(have - named - PACKAGE_ITSELF)]
        out += [f"README's Layout names {package}{m}, which is not a module of {package}"
                for m in sorted(named - have)]
    return out


def test_readme_layout_names_every_module_and_only_modules() -> None:
    problems = disagreements(readme_map(), *modules())
    assert not problems, "README.md's Layout and src/smb2 disagree (fix the map):\n" + "\n".join(problems)


def test_the_check_sees_a_missing_and_a_gone_module() -> None:
    """A module left out, one that is gone, a package's module left out of its
    entry and a package left out are each reported."""
    entries = readme_map()
    top, packages = modules()
    damaged = {p: words for p, words in entries.items() if p not in ("lock.py", "testing/netns/")}
    damaged["torch.py"] = "the PyTorch adapter"
    damaged["server/"] = entries["server/"].replace("peers.py", "peers")
    assert {
        "lock.py is in src/smb2 but not in README's Layout",
        "README's Layout lists torch.py, which src/smb2 does not have",
        "package testing/netns/ is in src/smb2 but not in README's Layout",
        "server/peers.py is not named in README's Layout entry server/",
    } <= set(disagreements(damaged, top, packages))
