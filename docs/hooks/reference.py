"""MkDocs hook: the reference pages, written from the code at each build (scaletrain.cli.reference)."""

from __future__ import annotations

from mkdocs.structure.files import File

from scaletrain.cli.reference import config_page, errors_page, families_page
from scaletrain.cli.reference_verbs import cli_page

PAGES = {  # the site's path: what writes it
    "reference/config.md": config_page,
    "reference/cli.md": cli_page,
    "reference/hf-families.md": families_page,
    "reference/errors.md": errors_page,
}


def on_files(files, config):
    for path, write in PAGES.items():
        files.append(File.generated(config, path, content=write()))
    return files
