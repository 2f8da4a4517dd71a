"""MkDocs hook of the documentation site (mkdocs.yml, ``hooks:``).

The nav is written out in mkdocs.yml; a page that is being written on
another branch (the deployment guide) joins it where mkdocs.yml says, once
its file is in docs/, so that the strict build passes before and after.
Every other nav entry must exist: ``mkdocs build --strict`` fails otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# page -> (its title, the nav entry it follows)
OPTIONAL_PAGES = {"deployment.md": ("Deployment: Slurm and Kubernetes", "operations.md")}


def insert_after(nav: list[Any], after: str, entry: dict[str, str]) -> bool:
    """Put ``entry`` after the nav item whose page is ``after`` (at any depth)."""
    for i, item in enumerate(nav):
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if value == after:
            nav.insert(i + 1, entry)
            return True
        if isinstance(value, list) and insert_after(value, after, entry):
            return True
    return False


def on_config(config: Any) -> Any:
    docs = Path(config["docs_dir"])
    for page, (title, after) in OPTIONAL_PAGES.items():
        if (docs / page).exists() and not insert_after(config["nav"], after, {title: page}):
            raise ValueError(f"docs_hooks: {after} is not in mkdocs.yml's nav, so {page} has no place")
    return config
