"""MkDocs hook: the workshop notebooks in ``notebooks/`` become pages under ``notebooks/`` of the site.

The notebooks live in one place, ``notebooks/`` at the repository's root (nbval runs them there); this hook
adds them to the site's files as they are, so no copy exists under ``docs/`` for a test or an editor to
find. mkdocs-jupyter then renders each with its stored outputs (never executed), because it runs after
this hook: the hook's ``on_files`` has a higher priority than every plugin's.
"""

from __future__ import annotations

import pathlib

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

FOLDER = "notebooks"


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into pages
def on_files(files: Files, config) -> Files:
    root = pathlib.Path(config.config_file_path).parent
    for path in sorted((root / FOLDER).glob("*.ipynb")):
        files.append(
            File(
                f"{FOLDER}/{path.name}",
                src_dir=str(root),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files
