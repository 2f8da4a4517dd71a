"""The documentation site's two helpers (mkdocs.yml; ``make docs`` builds the
site itself, strictly).  tools/docs_roles.py checks the docstrings' reST
roles: a name smb2 has becomes a link, one it does not have fails the strict
build (a warning under ``mkdocs.``), a name of another package is left as
code.  tools/docs_hooks.py puts a page still being written on another branch
into the nav once its file is there."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest

griffe = pytest.importorskip("griffe", reason="the docs extra is not installed: pip install -e '.[docs]'")

ROOT = Path(__file__).resolve().parent.parent


def tool(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def roles() -> Any:
    return tool("docs_roles")


@pytest.fixture(scope="module")
def package() -> Any:
    # in a thread of its own: Python 3.11's AST validator compares its
    # recursion count with the stack depth the parse began at, and deep in a
    # long pytest run griffe's parse of smb2 raised "AST constructor recursion
    # depth mismatch"; a fresh thread's stack is as shallow as mkdocs' own
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(griffe.load, "smb2", search_paths=[str(ROOT / "src")]).result()


def convert(roles: Any, package: Any, where: str, text: str) -> str:
    obj = package[where.removeprefix("smb2.")] if where != "smb2" else package
    return str(roles.SphinxRoles.convert(roles.Resolver(package), obj, text))


def test_names_smb2_has_become_links(roles: Any, package: Any) -> None:
    # a method of the class the docstring is in, as Python's scopes find it
    assert 'identifier="smb2.client.Buffer.write"' in convert(roles, package, "smb2.client.Buffer.read",
                                                               "see :meth:`write`")
    # a name the module imports, a full path, a relative module, ~ shortens
    assert 'identifier="smb2.errors.StaleFence"' in convert(roles, package, "smb2.client", ":class:`StaleFence`")
    out = convert(roles, package, "smb2", ":func:`~smb2.client.connect`")
    assert 'identifier="smb2.client.connect"' in out and "<code>connect</code>" in out
    assert 'identifier="smb2.transport.tcp"' in convert(roles, package, "smb2.transport", ":mod:`.tcp`")


def test_a_name_smb2_lacks_fails_the_build(roles: Any, package: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mkdocs"):
        out = convert(roles, package, "smb2.client.Buffer", "see :meth:`no_such_method` and :class:`NoSuchThing`")
    warned = [r for r in caplog.records if r.name.startswith("mkdocs.") and r.levelno == logging.WARNING]
    assert len(warned) == 2 and "no_such_method" in warned[0].getMessage(), caplog.text
    assert "<autoref" not in out and "<code>NoSuchThing</code>" in out


def test_other_packages_and_literal_blocks(roles: Any, package: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mkdocs"):
        out = convert(roles, package, "smb2.torch", ":class:`torch.optim.Optimizer` or :exc:`ValueError`")
    assert out == "<code>torch.optim.Optimizer</code> or <code>ValueError</code>" and not caplog.records
    assert convert(roles, package, "smb2", "An example::\n\n    x = 1\n") == "An example:\n\n    x = 1\n"


def test_an_optional_page_joins_the_nav_once_it_is_there(tmp_path: Path) -> None:
    hooks = tool("docs_hooks")

    def nav() -> list[Any]:
        return [{"Home": "index.md"}, {"Guides": [{"Running memory servers": "operations.md"},
                                                   {"Training": "training.md"}]}]

    config = {"docs_dir": str(tmp_path), "nav": nav()}
    assert hooks.on_config(config)["nav"] == nav()
    (tmp_path / "deployment.md").write_text("# Deployment\n")
    guides = hooks.on_config(config)["nav"][1]["Guides"]
    assert [next(iter(item.values())) for item in guides] == ["operations.md", "deployment.md", "training.md"]
