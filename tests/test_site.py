"""The web edition, driven in a real headless browser (Chromium from the distribution, via Selenium).

Every page loads without a console message of level SEVERE, every image has a
non-zero natural size, every internal link resolves to a page and anchor that exist,
and a screenshot of the index is saved as ``_build/site-index.png``. Skips with the
reason when no Chromium / chromedriver is installed (``apt-get install chromium
chromium-driver``; ``.ci/run`` installs them). Nothing is downloaded: Selenium is
pointed at the system chromedriver.
"""

import re
import shutil
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from kimilab import site

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("html")
    site.build_site(out)
    return out


def test_the_site_has_every_chapter_and_an_index(built):
    pages = {p.name for p in built.glob("*.html")}
    chapters = {p.stem + ".html" for p in site.chapter_notebooks()}
    assert chapters <= pages and "index.html" in pages and "references.html" in pages
    index = (built / "index.html").read_text()
    for stem in (p.stem for p in site.chapter_notebooks()):
        assert f'href="{stem}.html"' in index
    assert "Index of sections" in index and "cdnjs" not in "".join(p.read_text() for p in built.glob("*.html"))


def _ids(path: Path) -> set:
    return set(re.findall(r'\bid="([^"]+)"', path.read_text(encoding="utf-8")))


@pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="no chromium/chromedriver on this machine "
                    "(apt-get install chromium chromium-driver)")
def test_every_page_in_a_real_browser(built):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1600"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    start = time.perf_counter()
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        ids = {p.name: _ids(p) for p in built.glob("*.html")}
        for page in sorted(built.glob("*.html")):
            driver.get(page.as_uri())
            deadline = time.perf_counter() + 60  # a chapter page embeds its figures: large pages parse slowly
            while driver.execute_script("return document.readyState") != "complete":
                assert time.perf_counter() < deadline, f"{page.name}: still loading after 60 s"
                time.sleep(0.1)
            errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, f"{page.name}: console errors {errors[:3]}"
            sizes = driver.execute_script(
                "return Array.from(document.images).map(i => [i.currentSrc.slice(0, 60), i.naturalWidth])")
            broken = [src for src, width in sizes if not width]
            assert not broken, f"{page.name}: images with no natural size: {broken[:3]}"
            hrefs = driver.execute_script("return Array.from(document.links).map(a => a.getAttribute('href'))")
            for href in hrefs:
                url = urlparse(href or "")
                if url.scheme or not href:
                    continue  # external links are not ours to check offline
                target = url.path or page.name
                assert target in ids, f"{page.name}: link {href!r} to a page that does not exist"
                if url.fragment:
                    assert unquote(url.fragment) in ids[target], f"{page.name}: link {href!r}: no such anchor"
        driver.get((built / "index.html").as_uri())
        shot = ROOT / "_build" / "site-index.png"
        shot.parent.mkdir(exist_ok=True)
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        driver.quit()
    print(f"browser test: {len(ids)} pages in {time.perf_counter() - start:.1f} s")
