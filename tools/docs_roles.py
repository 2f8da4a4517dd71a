"""Griffe extension of the documentation site: the docstrings' reST roles
become checked cross-references (mkdocs.yml, mkdocstrings' ``extensions:``).

smb2's docstrings name other objects the Sphinx way, ``:class:`Buffer` ``,
``:func:`smb2.connect` ``, ``:mod:`.tcp` ``, ``:meth:`~Client.close` ``.
Once the package is loaded, each such name is looked up in smb2's sources as
Python would from where the docstring stands (the object's own scope, its
class, its module and what that imports, then the name as a full path), and
the role becomes a link to the API reference (an "optional" autorefs link:
plain code where the object has no page, being internal).  A name that
resolves to nothing in smb2, and is neither a builtin nor rooted in another
package (``torch.optim.Optimizer``), is a warning, so ``mkdocs build
--strict`` fails on a docstring that names something smb2 does not have.

reST's literal-block marker (a paragraph ending in ``::``) becomes a colon:
the indented block after it is a Markdown code block already.
"""

from __future__ import annotations

import builtins
import html
import logging
import re
from collections.abc import Iterator
from typing import Any

import griffe

# a warning under "mkdocs." counts for mkdocs build --strict
log = logging.getLogger("mkdocs.plugins.smb2.docs_roles")

ROLE = re.compile(r":(?:py:)?(?P<role>func|class|meth|attr|mod|data|exc|obj|const):`(?P<target>[^`]+)`")
LITERAL_MARKER = re.compile(r"(?m)^(?P<text> {0,3}\S.*?)\s*::$|^ {0,3}::$")


def walk(obj: Any) -> Iterator[Any]:
    """``obj`` and every object defined under it (aliases are not walked)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from walk(member)


def defined(collection: Any, path: str) -> bool:
    """Whether ``path`` names an object of the loaded packages."""
    try:
        collection[path]
    except Exception:       # KeyError, or an alias that leads outside
        return False
    return True


class Resolver:
    def __init__(self, package: Any) -> None:
        self.package = package
        self.collection = package.modules_collection

    def relative(self, obj: Any, target: str) -> str:
        """``.x`` / ``..x`` as a relative import in obj's module would read it."""
        module = obj.module
        base = module.path if module.is_init_module else module.parent.path
        dots = len(target) - len(target.lstrip("."))
        for _ in range(dots - 1):
            base = base.rpartition(".")[0]
        return f"{base}.{target.lstrip('.')}"

    def resolve(self, obj: Any, target: str) -> tuple[str | None, bool]:
        """(the full path of ``target`` or None, whether it is an smb2 object)."""
        root = self.package.name
        if target.startswith("."):
            path = self.relative(obj, target)
            return (path, True) if defined(self.collection, path) else (None, False)
        first, _, rest = target.partition(".")
        # Python's lookup from where the docstring stands
        scope = obj
        while scope is not None:
            try:
                found = scope.resolve(first)
            except Exception:       # NameResolutionError: not in this scope
                scope = scope.parent
                continue
            path = f"{found}.{rest}" if rest else found
            if path.split(".")[0] != root:
                return path, False          # imported from elsewhere (typing.Any)
            if defined(self.collection, path):
                return path, True
            break
        # a full path: smb2.client.Buffer, or a sibling class's member (Client.close)
        for path in (target, f"{obj.module.path}.{target}"):
            if path.split(".")[0] == root and defined(self.collection, path):
                return path, True
        if first != root and ("." in target or hasattr(builtins, first)):
            return target, False            # torch.optim.Optimizer, ValueError
        return None, False


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        """griffe >= 2: the package and everything under it are loaded."""
        self.rewrite(pkg)

    def on_package_loaded(self, *, pkg: Any, **kwargs: Any) -> None:
        """griffe 1."""
        self.rewrite(pkg)

    def rewrite(self, pkg: Any) -> None:
        resolver = Resolver(pkg)
        for obj in walk(pkg):
            if obj.docstring is None:
                continue
            obj.docstring.value = self.convert(resolver, obj, obj.docstring.value)

    @staticmethod
    def convert(resolver: Resolver, obj: Any, text: str) -> str:
        def link(m: re.Match[str]) -> str:
            target = m["target"].strip()
            short = target.startswith("~")
            target = target.lstrip("~").removesuffix("()")
            shown = target.rsplit(".", 1)[-1] if short else target
            code = f"<code>{html.escape(shown)}</code>"
            path, ours = resolver.resolve(obj, target)
            if path is None:
                log.warning("%s: the docstring of %s names %s, which is not in smb2 "
                            "(fix the name, or write it as ``%s`` if it is not code)",
                            obj.relative_filepath if obj.module else "?", obj.path, m[0], target)
                return code
            if not ours:
                return code
            return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

        text = ROLE.sub(link, text)
        return LITERAL_MARKER.sub(lambda m: f"{m['text']}:" if m["text"] else "", text)
