"""MkDocs hook: every name ``labkit`` exports has its entry in the API reference.

``labkit/__init__.py`` lists the public names (``_EXPORTS``: name -> module). Each must appear in a
``::: module.Name`` line of a page under ``docs/reference/``; a name with none is a warning, which fails
``mkdocs build --strict``, so a new public name cannot go undocumented. Read with ``ast``, nothing imported.
"""

from __future__ import annotations

import ast
import logging
import pathlib
import re

log = logging.getLogger("mkdocs.hooks.exports")
DIRECTIVE = re.compile(r"^::: (\S+)", re.M)


def exported_names(package_init: pathlib.Path) -> list[str]:
    for node in ast.parse(package_init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "_EXPORTS" for target in node.targets):
            return sorted(ast.literal_eval(node.value))
    log.warning(f"{package_init}: no _EXPORTS found: the reference cannot be checked against the public names")
    return []


def on_pre_build(config) -> None:
    root = pathlib.Path(config.config_file_path).parent
    documented = {target.rsplit(".", 1)[-1]
                  for page in (pathlib.Path(config.docs_dir) / "reference").rglob("*.md")
                  for target in DIRECTIVE.findall(page.read_text(encoding="utf-8"))}
    for name in exported_names(root / "labkit" / "__init__.py"):
        if name not in documented:
            log.warning(f"labkit exports {name}, and no page under docs/reference/ has its '::: module.{name}' "
                        f"line: add it (and a row in docs/reference/index.md)")
