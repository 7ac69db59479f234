"""MkDocs hook: the module-by-module page, written from the modules' own docstrings at build time.

``docs/reference/modules.md`` holds one marker per part of the package, ``<!-- modules: labkit/wire -->``;
each becomes a table of that folder's modules (sub-folders included), every one with the first paragraph
of its docstring. So the page follows the code: a new module appears, a renamed one moves. A module no
marker covers, or a marker whose folder is gone, is a warning, which fails ``mkdocs build --strict``.
Nothing is imported: the docstrings are read from the source with ``ast``, as a reader would.
"""

from __future__ import annotations

import ast
import logging
import pathlib
import re

PAGE = "reference/modules.md"
MARKER = re.compile(r"<!-- modules: (\S+) -->")
log = logging.getLogger("mkdocs.hooks.modules")


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _summary(path: pathlib.Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(docstring.split("\n\n")[0].split())
    # A docstring's [a] [b] would read as a Markdown reference; | would end a table cell.
    return first.replace("[", "\\[").replace("]", "\\]").replace("|", "\\|") or "(no docstring)"


def _covered(target: pathlib.Path) -> list[pathlib.Path]:
    if target.suffix == ".py":
        return [target]
    found = [path for path in target.rglob("*.py") if "__pycache__" not in path.parts]
    # The package first, then its modules, then sub-packages with theirs.
    return sorted(found, key=lambda path: (len(path.relative_to(target).parts), path.name != "__init__.py",
                                          str(path)))


def _table(paths: list[pathlib.Path], root: pathlib.Path) -> str:
    rows = [f"| `{_module_name(path, root)}` | {_summary(path)} |" for path in paths]
    return "\n".join(["| module | what it is for |", "|---|---|", *rows])


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    root = pathlib.Path(config.config_file_path).parent
    seen: set[pathlib.Path] = set()

    def expand(match: re.Match) -> str:
        target = root / match.group(1)
        if not target.exists() and target.with_suffix(".py").exists():
            target = target.with_suffix(".py")
        if not target.exists():
            log.warning(f"{PAGE}: {match.group(1)} does not exist: remove its marker or correct it")
            return ""
        paths = [path for path in _covered(target) if path not in seen]
        seen.update(paths)
        return _table(paths, root)

    markdown = MARKER.sub(expand, markdown)
    every = {path for path in (root / "labkit").rglob("*.py") if "__pycache__" not in path.parts}
    for path in sorted(every - seen):
        log.warning(f"{PAGE}: no marker covers {path.relative_to(root)}: add one for its part")
    return markdown
