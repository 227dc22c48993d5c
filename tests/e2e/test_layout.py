"""Pages for people (issue 52, defect 8), in Chromium on the system `make run` starts: every main page fits a phone
(390 px), a laptop (1280 px) and a wide screen (1920 px) without scrolling sideways, and from 1280 px up no table
scrolls inside its own box either; the first thing the keyboard reaches is a skip link to the content; every chart
says what it shows (role="img" and an aria-label); in dark mode the page is dark and the charts' text is the page's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import CHROMIUM, log_in, watched
from tests.e2e.test_recovery import ended, planned

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no chromium (make test installs Debian's)")

WIDTHS = (390, 1280, 1920)

# What spills: the page wider than the window, and any box inside <main> that scrolls sideways (a table's).
SPILLS = """() => {
  const name = (el) => el.id ? '#' + el.id : el.tagName.toLowerCase() + (el.className ? '.' + el.className : '');
  const boxes = [];
  for (const el of document.querySelectorAll('main *')) {
    const x = getComputedStyle(el).overflowX;
    if ((x === 'auto' || x === 'scroll') && el.scrollWidth > el.clientWidth + 1)
      boxes.push(name(el) + ' ' + el.scrollWidth + ' > ' + el.clientWidth);
  }
  const root = document.documentElement;
  return {page: root.scrollWidth > window.innerWidth ? root.scrollWidth : 0, boxes};
}"""

CHARTS = """() => Array.from(document.querySelectorAll('div.plotly-figure, div.chart')).map(
  (div) => [div.dataset.figureId || div.id, div.getAttribute('role'), div.getAttribute('aria-label') || ''])"""


@pytest.fixture(scope="module")
def finished_job(system):
    job = planned(system, {"iterations": 3})
    system.api(f"/api/jobs/{job['id']}/launch/", {})
    final = ended(system, job["id"])
    assert final["status"] == "completed", final["message"] + "\n" + system.tail()
    return final


def pages(job_id: int) -> dict[str, str]:
    return {
        "home": "/",
        "devices": "/devices/",
        "models": "/models/",
        "jobs": "/jobs/",
        "new job": "/jobs/new/",
        "plan": f"/jobs/{job_id}/",
        "live": f"/jobs/{job_id}/live/",
        "users": "/users/",
        "profile": "/profile/",
    }


def drawn(page, name: str) -> None:
    """Wait until the page's charts are drawn (their size, and so the page's width, is final then)."""
    from playwright.sync_api import expect

    if name == "plan":
        expect(page.locator('[data-figure-id="fig-timeline"] .main-svg').first).to_be_attached()
    elif name == "live":
        expect(page.locator("#throughput-chart .main-svg").first).to_be_attached()
        expect(page.locator("#timeline-chart .main-svg").first).to_be_attached()


def test_every_page_fits_a_phone_a_laptop_and_a_wide_screen(system, browser, finished_job):
    spilled = []
    for width in WIDTHS:
        page = watched(browser.new_context(viewport={"width": width, "height": 900}).new_page())
        log_in(page, system)
        for name, path in pages(finished_job["id"]).items():
            page.goto(system.url + path)
            drawn(page, name)
            spill = page.evaluate(SPILLS)
            if spill["page"]:
                spilled.append(f"{name} at {width} px: the page is {spill['page']} px wide")
            if width >= 1280 and spill["boxes"]:  # on a phone a wide table may scroll in its own box
                spilled.append(f"{name} at {width} px: scrolls sideways inside {spill['boxes']}")
        assert not page.errors, page.errors
        page.context.close()
    assert not spilled, "\n".join(spilled)


def test_the_skip_link_comes_first_and_every_chart_says_what_it_shows(system, browser, finished_job):
    from playwright.sync_api import expect

    page = watched(browser.new_context(viewport={"width": 1280, "height": 900}).new_page())
    log_in(page, system)
    for name in ("home", "plan"):
        page.goto(system.url + pages(finished_job["id"])[name])
        page.keyboard.press("Tab")
        first = page.evaluate("() => [document.activeElement.textContent.trim(), document.activeElement.hash]")
        assert first == ["Skip to content", "#content"], (name, first)
        page.keyboard.press("Enter")
        expect(page.locator("main#content")).to_be_focused()

    for name, count in (("plan", 4), ("live", 3)):  # live: throughput, loss and the timeline (no held-out chart)
        page.goto(system.url + pages(finished_job["id"])[name])
        drawn(page, name)
        charts = page.evaluate(CHARTS)
        assert len(charts) >= count, (name, charts)
        for chart, role, label in charts:
            assert role == "img" and len(label) > 20, (name, chart, role, label)
    assert not page.errors, page.errors


def test_dark_mode_follows_the_system_and_the_charts_read_in_it(system, browser, finished_job):
    page = watched(browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme="dark").new_page())
    log_in(page, system)
    page.goto(system.url + pages(finished_job["id"])["plan"])
    drawn(page, "plan")
    seen = page.evaluate("""() => {
      const div = document.querySelector('[data-figure-id="fig-memory"]');
      return {
        page: getComputedStyle(document.body).backgroundColor,
        text: getComputedStyle(div).color,
        paper: div.querySelector('.main-svg').style.background,
        title: div.querySelector('.gtitle').style.fill,
      };
    }""")
    red, green, blue = (int(v) for v in seen["page"][seen["page"].index("(") + 1 : -1].split(",")[:3])
    assert red + green + blue < 3 * 60, seen  # a dark page
    assert seen["paper"] in ("", "transparent", "rgba(0, 0, 0, 0)"), seen  # the card shows through the chart
    assert seen["title"] == seen["text"], seen  # the chart's text in the page's own (light) colour
    assert not page.errors, page.errors
