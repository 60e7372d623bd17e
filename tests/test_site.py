"""The web edition: both sites built from the stored notebooks, then read as files and in a real browser.

Static checks: every chapter page in both editions, titles from the notebooks' first
headings, nothing loaded from the network, every figure numbered with a caption and alt
text, no nbval marker, and the student site without solutions or ``verify`` verdicts.

The browser test (headless Chromium from the distribution, driven by Selenium; skipped
with the reason when ``chromium`` / ``chromedriver`` are missing, ``.ci/run`` installs
them) opens every teacher page: no console error, every image decoded, every internal
link and anchor resolving, every figure captioned with alt text; at 400 px nothing
overflows sideways except inside a box that scrolls (math, code, tables); the search
page finds a chapter by a word that only its body contains; the theme button switches
to dark mode. Screenshots land in ``_build/``: ``site-index.png``, ``site-dark.png``,
``site-phone.png``.

Building both sites takes about a minute of Sphinx on two cores, so these tests are marked ``site``
and run by ``make site`` (``.ci/run`` runs it), not by ``make test``; the API page's and the
glossary's checks, which need no build, stay in ``make test``.
"""

from __future__ import annotations

import html
import re
import shutil
import time
from collections import Counter
from pathlib import Path
from urllib.parse import unquote, urlparse

import nbformat
import pytest

from kimilab import site
from kimilab.site.prepare import title_of

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
NOTEBOOKS = site.chapter_notebooks()


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    out = tmp_path_factory.mktemp("sites")
    start = time.perf_counter()
    built = {edition: site.build_site(out / edition, edition=edition, strict=True).parent
             for edition in site.EDITIONS}
    print(f"both sites built in {time.perf_counter() - start:.1f} s")
    return built


def _page(folder: Path, stem: str) -> str:
    return (folder / f"{stem}.html").read_text(encoding="utf-8")


@pytest.mark.site
def test_both_editions_have_every_chapter_titled_by_its_first_heading(sites):
    for edition, folder in sites.items():
        for path in NOTEBOOKS:
            title = title_of(nbformat.read(path, as_version=4))
            shown = html.unescape(re.search(r"<title>(.*?)</title>", _page(folder, path.stem), re.S).group(1))
            assert shown.strip().startswith(title), f"{edition}/{path.stem}: page title {shown!r}, H1 {title!r}"
        assert (folder / "index.html").exists() and (folder / "search.html").exists()
    assert (sites["teacher"] / "TEACHING.html").exists() and not (sites["student"] / "TEACHING.html").exists()


@pytest.mark.site
def test_nothing_loads_from_the_network_and_no_test_marker_shows(sites):
    for folder in sites.values():
        for page in folder.glob("*.html"):
            text = page.read_text(encoding="utf-8")
            remote = re.findall(r'<(?:script|link|img|iframe)\b[^>]*(?:src|href)="(?:https?:)?//[^"]+"', text)
            assert not remote, f"{page.name}: loads {remote[:2]}"
            if re.match(r"\d\d_", page.name):  # the API page may quote the marker from a docstring
                assert "NBVAL_" not in text, f"{page.name}: an nbval marker shows"


@pytest.mark.site
def test_every_figure_is_numbered_captioned_and_described(sites):
    folder = sites["teacher"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        images = sum(any("image/png" in o.get("data", {}) for o in c.get("outputs", [])) for c in nb.cells)
        page = _page(folder, path.stem)
        figures = re.findall(r'<figure class="kimilab-figure[^"]*" id="fig-(\d+)-(\d+)">(.*?)</figure>', page, re.S)
        assert len(figures) == images, f"{path.stem}: {len(figures)} captioned figures of {images}"
        for chapter, k, body in figures:
            assert re.search(r'<img alt="Figure \d+\.\d+, a plot\. [^"]{10,}"', body), f"{path.stem} fig {k}: alt"
            caption = re.sub(r"<[^>]+>", "", re.search(r"<figcaption>(.*?)</figcaption>", body, re.S).group(1))
            assert caption.strip().startswith(f"Figure {chapter}.{k}.") and len(caption) > 30, caption


@pytest.mark.site
def test_the_student_site_shows_no_solution_and_no_verdict(sites):
    solutions = set()
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        solutions |= {ln.strip() for c in nb.cells if "solution" in c.metadata.get("tags", [])
                      for ln in c.source.splitlines() if re.match(r"\s*answer\s*=\s*\S", ln) and len(ln) > 20}
    teacher = "".join(_page(sites["teacher"], p.stem) for p in NOTEBOOKS)
    student = "".join(_page(sites["student"], p.stem) for p in NOTEBOOKS)
    assert "] correct." in teacher and "] correct." not in student

    def code(text):
        return re.sub(r"<[^>]+>", "", text).replace("&gt;", ">").replace("&lt;", "<").replace("&quot;", '"')

    plain = code(student)
    assert not [ln for ln in solutions if ln in plain]
    assert sum(ln in code(teacher) for ln in solutions) > len(solutions) // 2  # the check can see them at all


@pytest.mark.site
def test_every_chapter_page_launches_in_binder_and_colab_and_downloads_its_notebook(sites):
    """The launch menu's addresses come from kimilab.site.launch; the download is the page's own notebook
    (the student edition's without solutions); the setup cell runs on Colab but is not shown. The student
    edition has no launch menu: it would open the repository's chapters, solutions and all."""
    from kimilab.site import launch

    for edition, folder in sites.items():
        for path in NOTEBOOKS:
            page = html.unescape(_page(folder, path.stem))
            for url in (launch.binder_url(path.stem), launch.colab_url(path.stem)):
                assert (f'href="{url}"' in page) == (edition == "teacher"), f"{edition}/{path.stem}: launch {url}"
            assert f'href="_sources/{path.stem}.ipynb"' in page, f"{edition}/{path.stem}: no download button"
            assert "google.colab" not in page, f"{edition}/{path.stem}: the setup cell shows"
            nb = nbformat.read(folder / "_sources" / f"{path.stem}.ipynb", as_version=4)
            tags = [t for c in nb.cells for t in c.metadata.get("tags", [])]
            assert "setup" in tags and (("solution" in tags) == (edition == "teacher")), f"{edition}/{path.stem}"


def _a_word_only_one_chapter_has() -> tuple[str, str]:
    words = {}
    for path in NOTEBOOKS:
        text = " ".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
        words[path.stem] = Counter(w.lower() for w in re.findall(r"\b[a-z]{8,}\b", text))
    for stem in sorted(words, reverse=True):
        for word, n in words[stem].most_common():
            if n >= 3 and not any(word in words[other] for other in words if other != stem):
                return word, stem
    raise AssertionError("no word is specific to one chapter")


_OVERFLOW_JS = """
const w = window.innerWidth, bad = [];
const scrolls = el => { for (let e = el.parentElement; e; e = e.parentElement) {
  const s = getComputedStyle(e); if ((s.overflowX === 'auto' || s.overflowX === 'scroll') && e.clientWidth <= w)
  return true; } return false; };
for (const el of document.querySelectorAll('.bd-article *')) {
  const r = el.getBoundingClientRect();
  if (r.width && r.right > w + 1 && !scrolls(el)) bad.push(el.tagName + '.' + el.className + ' ' + Math.round(r.right));
}
return [document.documentElement.scrollWidth, w, bad.slice(0, 5)];
"""


# At 1280 px nothing in a chapter's core path scrolls sideways: no box outside a deep dive whose content
# is wider than the box (code, output, tables, math), and every "Deep dive" section is folded shut.
_CORE_SCROLL_JS = """
const bad = [];
for (const el of document.querySelectorAll('.bd-article *')) {
  if (el.closest('details.deep-dive') || el.closest('mjx-container')) continue;
  const s = getComputedStyle(el);
  if ((s.overflowX === 'auto' || s.overflowX === 'scroll') && el.scrollWidth > el.clientWidth + 1)
    bad.push(el.tagName + '.' + el.className + ' ' + el.scrollWidth + '>' + el.clientWidth + ' '
             + (el.textContent || '').trim().slice(0, 60));
}
const deep = Array.from(document.querySelectorAll('.bd-article section')).filter(sec => {
  const h = sec.querySelector(':scope > h2, :scope > h3, :scope > h4');
  return h && /deep dive/i.test(h.textContent); });
const folds = Array.from(document.querySelectorAll('details.deep-dive'));
return [bad.slice(0, 5), deep.length, folds.length, folds.filter(d => d.open).length,
        document.querySelectorAll('.bd-article details.deep-dive summary :is(h2, h3, h4)').length];
"""


def _wait(driver, seconds: float = 60) -> None:
    deadline = time.perf_counter() + seconds
    while driver.execute_script("return document.readyState") != "complete":
        assert time.perf_counter() < deadline, f"{driver.current_url}: still loading after {seconds} s"
        time.sleep(0.05)


def _ids(path: Path) -> set:
    return set(re.findall(r'\bid="([^"]+)"', path.read_text(encoding="utf-8")))


@pytest.mark.site
@pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="no chromium/chromedriver on this machine "
                    "(apt-get install chromium chromium-driver)")
def test_the_sites_in_a_real_browser(sites):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--hide-scrollbars"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    folder = sites["teacher"]
    shots = ROOT / "_build"
    shots.mkdir(exist_ok=True)
    start = time.perf_counter()
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        ids = {p.name: _ids(p) for p in folder.glob("*.html")}
        pages = sorted(folder.glob("*.html"))
        for page in pages + [sites["student"] / "index.html"]:
            driver.get(page.as_uri())
            _wait(driver)
            errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, f"{page.name}: console errors {errors[:3]}"
            images = driver.execute_script("return Array.from(document.images).map(i => "
                                           "[i.currentSrc.slice(-40), i.naturalWidth, i.alt])")
            assert all(width for _, width, _ in images), f"{page.name}: an image did not decode"
            figures = driver.execute_script(
                "return Array.from(document.querySelectorAll('figure.kimilab-figure')).map(f => "
                "[f.querySelector('img').alt, (f.querySelector('figcaption') || {}).textContent || ''])")
            assert all(alt and caption.strip().startswith("Figure") for alt, caption in figures), page.name
            if page.parent != folder:
                continue
            if re.match(r"\d\d_", page.name):
                bad, loose, folds, opened, titled = driver.execute_script(_CORE_SCROLL_JS)
                assert not bad, f"{page.name} at 1280 px: core content scrolls sideways: {bad}"
                assert folds and not loose and not opened and titled == folds, \
                    f"{page.name}: {folds} deep dives folded ({opened} open, {loose} not folded, {titled} titled)"
                hrefs = driver.execute_script("return Array.from(document.querySelectorAll('.bd-article a'))"
                                              ".map(a => a.getAttribute('href'))")
                for ref in site.REFERENCE_PAGES:
                    assert f"{ref}.html" in hrefs, f"{page.name}: no link to the {ref} page"
            for href in driver.execute_script("return Array.from(document.links).map(a => a.getAttribute('href'))"):
                url = urlparse(href or "")
                if url.scheme or not href or href.startswith("#") and not url.fragment:
                    continue  # external links are not ours to check offline
                target = url.path or page.name
                if not target.endswith(".html") and not url.fragment and (folder / target).is_file():
                    continue  # a file to download (the page's notebook)
                assert target in ids, f"{page.name}: link {href!r} to a page that does not exist"
                if url.fragment:
                    assert unquote(url.fragment) in ids[target], f"{page.name}: link {href!r}: no such anchor"
        driver.get((folder / "index.html").as_uri())
        _wait(driver)
        assert driver.save_screenshot(str(shots / "site-index.png"))

        word, stem = _a_word_only_one_chapter_has()
        driver.get((folder / "search.html").as_uri() + f"?q={word}")
        deadline = time.perf_counter() + 20
        while not driver.find_elements(By.CSS_SELECTOR, "#search-results li"):
            assert time.perf_counter() < deadline, f"search for {word!r} found nothing"
            time.sleep(0.1)
        found = [a.get_attribute("href") for a in driver.find_elements(By.CSS_SELECTOR, "#search-results li a")]
        assert any(f"{stem}.html" in h for h in found), f"search for {word!r}: {found[:5]}, not {stem}"

        driver.get((folder / NOTEBOOKS[1].with_suffix(".html").name).as_uri())
        _wait(driver)
        theme = lambda: driver.execute_script("return document.documentElement.dataset.theme")  # noqa: E731
        background = lambda: driver.execute_script(  # noqa: E731
            "return getComputedStyle(document.body).backgroundColor")
        before = (theme(), background())
        switch = [b for b in driver.find_elements(By.CSS_SELECTOR, ".theme-switch-button") if b.is_displayed()]
        assert switch, "no theme button on the page"
        switch[0].click()  # opens the menu: system settings, light, dark
        time.sleep(0.2)
        dark = [b for b in driver.find_elements(By.CSS_SELECTOR, ".theme-change-button[data-mode=dark]")
                if b.is_displayed()]
        assert dark, "the theme menu has no visible dark choice"
        dark[0].click()
        time.sleep(0.3)
        assert theme() == "dark" and background() != before[1], f"dark mode did not switch: {before}"
        assert driver.save_screenshot(str(shots / "site-dark.png"))
        driver.execute_script("localStorage.clear()")

        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": 400, "height": 860, "deviceScaleFactor": 1, "mobile": True})
        for page in pages:
            driver.get(page.as_uri())
            _wait(driver)
            width, viewport, bad = driver.execute_script(_OVERFLOW_JS)
            assert width <= viewport + 1 and not bad, f"{page.name} at 400 px: page {width} px wide, {bad}"
        driver.get((folder / NOTEBOOKS[1].with_suffix(".html").name).as_uri())
        _wait(driver)
        assert driver.save_screenshot(str(shots / "site-phone.png"))
    finally:
        driver.quit()
    print(f"browser test: {len(pages)} pages at 1280 and 400 px in {time.perf_counter() - start:.1f} s")


def test_the_api_page_is_generated_from_the_package():
    from kimilab.site.api import api_for_sphinx, api_markdown, public_modules

    assert (ROOT / "chapters" / "api.md").read_text(encoding="utf-8") == api_markdown(), \
        "chapters/api.md is stale: `python -m kimilab html` rewrites it"
    names = [name for name, _ in public_modules()]
    assert "kimilab.kda.recurrent" in names and "kimilab.prefix.hybrid" in names
    assert api_for_sphinx(api_markdown()).count(".. automodule:: ") == len(names)


def test_every_glossary_term_links_to_its_definition_and_every_chapter_to_the_reference_pages():
    glossary = (ROOT / "chapters" / "glossary.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((\d\d_[a-z0-9_]+)\.ipynb#(term-[a-z0-9-]+)\)", glossary)
    assert len(links) >= 20, f"the glossary links {len(links)} terms"
    anchors = {}
    for path in NOTEBOOKS:
        text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
        anchors[path.stem] = set(re.findall(r'<a id="(term-[a-z0-9-]+)"></a>', text))
        for ref in site.REFERENCE_PAGES:
            assert f"]({ref}.md)" in text, f"{path.name}: no link to {ref}.md"
    for stem, anchor in links:
        assert anchor in anchors.get(stem, ()), f"glossary: {stem} has no <a id=\"{anchor}\">"
    for stem, found in anchors.items():  # the first definition: no earlier chapter defines it too
        earlier = [s for s in anchors if s < stem and found & anchors[s]]
        assert not earlier, f"{stem} defines {sorted(found & anchors[earlier[0]])} again (first in {earlier[0]})"
        for anchor in found:
            assert (stem, anchor) in links, f"{stem}: {anchor} is defined but not in the glossary"
