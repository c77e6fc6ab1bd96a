"""Every recipe's evaluation report opened in headless Chromium from disk, as a person opens it: the verdict
comes first, every plot loads, nothing is wider than the page (a desktop window and MLflow's narrower artifact
pane), nothing is fetched. The reports and full-page screenshots stay in $PIPELINE_TEST_ARTIFACTS/reports/
(default var/test-artifacts/reports/), one folder per case."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pipeline import deployment
from pipeline.evaluate.report import write_report
from tests import reports
from tests.browser import Browser

ARTIFACTS = Path(os.environ.get("PIPELINE_TEST_ARTIFACTS", deployment.PROJECT_ROOT / "var" / "test-artifacts")) / "reports"
WIDTHS_PX = (1280, 760)  # a desktop window; the MLflow UI's artifact pane beside its file tree

# Elements whose box reaches past the viewport's right edge (or left of 0), and the document's scroll width.
OVERFLOW = """
const width = document.documentElement.clientWidth;
const wide = [...document.body.querySelectorAll('*')].filter(el => {
  const box = el.getBoundingClientRect();
  return box.width > 0 && (box.right > width + 0.5 || box.left < -0.5);
}).map(el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') + ' right=' + Math.round(el.getBoundingClientRect().right));
return {wide: wide.slice(0, 10), scrollWidth: document.documentElement.scrollWidth, width: width};
"""
IMAGES = "return [...document.images].map(i => ({alt: i.alt, complete: i.complete, width: i.naturalWidth}))"
# Everything the page would load: only inline data and in-page anchors may appear.
REFERENCES = """return [...document.querySelectorAll('[src], [href], link, script[src]')]
  .map(el => el.getAttribute('src') || el.getAttribute('href') || '')
  .filter(ref => !ref.startsWith('data:') && !ref.startsWith('#'))"""


@pytest.mark.parametrize("case", sorted(reports.CASES))
def test_the_report_reads_in_a_browser(case):
    report = reports.report(case)
    folder = ARTIFACTS / case
    shutil.rmtree(folder, ignore_errors=True)
    write_report(report, folder / "report")
    browser = Browser(folder)
    try:
        driver = browser.driver
        for width in WIDTHS_PX:
            driver.set_window_size(width, 1000)
            driver.get((folder / "report" / "report.html").as_uri())
            images = browser.wait(lambda: (found := driver.execute_script(IMAGES)) and all(i["complete"] for i in found)
                                  and found, "the report's images")
            shot = browser.page_shot(f"{width}px")
            print(f"screenshot: {shot}")
            assert [i["alt"] for i in images] == [p.title for p in report.plots()]
            assert all(i["width"] > 0 for i in images), images
            layout = driver.execute_script(OVERFLOW)
            assert layout["wide"] == [] and layout["scrollWidth"] <= layout["width"], (width, layout)
            assert driver.execute_script(REFERENCES) == []
            first = driver.execute_script("return document.querySelector('main').firstElementChild")
            assert first.get_attribute("id") == "verdict" and first.text.startswith(f"Gate {report.decision['status']}")
            header = [th.text for th in driver.find_elements("css selector", "table.figures th")]
            assert [c.label for c in report.figures.columns] == header[2:2 + len(report.figures.columns)]
    finally:
        browser.close()
