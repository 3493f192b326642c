"""The docs site builds strictly and renders as a person sees it (issue 54): `mkdocs build --strict` (no
broken link, no page left out of the navigation, the reference written from the code), then the built site
served on loopback and opened in headless Chromium, whose home page, a guide and the configuration reference
show their navigation and search box, whose search finds a page; screenshots go to docs/screenshots/.

Skipped, with the reason, where the docs extra (`make docs`) or Chromium is missing; `.ci/run` installs both."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import scaletrain

from conftest import REPO

pytestmark = pytest.mark.slow  # a build of the whole site; a browser

SCREENSHOTS = REPO / "docs" / "screenshots"
CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


def nav_pages() -> list[str]:
    """The pages mkdocs.yml's navigation names."""
    return re.findall(r"^\s+- [^:]+: ([\w/.-]+\.md)$", (REPO / "mkdocs.yml").read_text(), re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    for module in ("mkdocs", "material"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: `make docs` installs the docs extra (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(scaletrain.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


def test_the_site_builds_strictly_with_every_page_in_its_navigation(site):
    pages = nav_pages()
    on_disk = sorted(p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")
                     if "hooks" not in p.parts)
    generated = ["reference/cli.md", "reference/config.md", "reference/errors.md", "reference/hf-families.md"]
    assert sorted(pages) == sorted(on_disk + generated) and len(pages) == len(set(pages))
    for page in pages:
        html = site / page.removesuffix(".md").removesuffix("index") / "index.html"
        assert html.is_file(), page
    config = (site / "reference" / "config" / "index.html").read_text()
    assert "parallel.sync.every" in config and "precision.mode" in config
    # the search index holds every page, the generated ones too
    index = (site / "search" / "search_index.json").read_text()
    assert "reference/cli/" in index and "guides/adapters/" in index


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def served(site):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    thread.join(10)


def chromium() -> str:
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed: `make docs` installs the docs extra")
    found = next((c for c in CHROMIUM if os.access(c, os.X_OK)), shutil.which("chromium"))
    if not found:
        pytest.skip("Chromium is not installed: `apt-get install chromium` (.ci/run installs it)")
    return found


def save(page, name: str) -> None:
    """A screenshot in docs/screenshots/, in 256 colours where Pillow is here (a third of the bytes)."""
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path))
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(256)
    small.save(path, optimize=True)


def test_a_browser_shows_the_pages_with_navigation_and_search(served):
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            for path, title, shot in (("", "scaletrain", "home"),
                                      ("guides/data-parallel/", "Data parallelism", "guide-data-parallel"),
                                      ("reference/config/", "Configuration options", "reference-config")):
                page.goto(served + path)
                assert page.locator("h1").first.inner_text().startswith(title), path
                nav = page.locator("nav.md-nav--primary")
                assert nav.get_by_text("Getting started").first.is_visible(), path
                assert nav.get_by_text("Configuration options").count() >= 1, path
                assert page.locator("input[data-md-component=search-query]").count() == 1, path
                save(page, shot)
            # the search box finds a generated page's text
            page.goto(served)
            search = page.locator("input[data-md-component=search-query]")
            search.click()
            # the index is built in a web worker: slow on a busy machine ("Initializing search" until then)
            meta = page.locator(".md-search-result__meta")
            page.wait_for_function("() => !/Initializing/.test(document.querySelector('.md-search-result__meta')"
                                   ".textContent)", timeout=180_000)
            search.press_sequentially("dp_replicate", delay=20)  # key by key, as a person types
            results = page.locator(".md-search-result__item")
            try:
                results.first.wait_for(timeout=60_000)
            except Exception:
                save(page, "search-failed")
                raise AssertionError(f"no search result: {meta.inner_text()!r}") from None
            assert "matching" in meta.inner_text()
            assert results.count() >= 1
            save(page, "search")
        finally:
            browser.close()
