"""A headless Chromium (Debian's ``chromium`` and ``chromium-driver``) driven by Selenium, the way a person
uses the UI; nothing is downloaded at run time. Each step leaves a screenshot in the test's artifacts."""

from __future__ import annotations

import base64
import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


class Browser:
    def __init__(self, artifacts: Path):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        for path, package in ((CHROMIUM, "chromium"), (DRIVER, "chromium-driver")):
            if not Path(path).exists() and shutil.which(Path(path).name) is None:
                pytest.fail(f"{path} is missing: apt-get install -y {package} (.ci/run does it)")
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                    "--disable-gpu", "--no-first-run"):
            options.add_argument(arg)
        self.driver = webdriver.Chrome(service=Service(DRIVER), options=options)
        self.driver.implicitly_wait(0)
        self.artifacts = artifacts
        artifacts.mkdir(parents=True, exist_ok=True)
        self.step = 0

    def shot(self, name: str) -> Path:
        self.step += 1
        path = self.artifacts / f"{self.step:02d}-{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def page_shot(self, name: str) -> Path:
        """The whole page, beyond the window's height (Chromium's DevTools capture)."""
        width, height = self.driver.execute_script(
            "return [document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        shot = self.driver.execute_cdp_cmd("Page.captureScreenshot", {
            "captureBeyondViewport": True, "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
        self.step += 1
        path = self.artifacts / f"{self.step:02d}-{name}.png"
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def wait(self, find, what: str, timeout_s: float = 60):
        """``find()``'s first truthy value (elements not there yet count as falsy); a screenshot on timeout."""
        from selenium.common.exceptions import WebDriverException

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                found = find()
            except WebDriverException:
                found = None
            if found:
                return found
            time.sleep(0.5)
        path = self.shot("timeout")
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; screenshot {path}")

    def by_text(self, tag: str, text: str):
        from selenium.webdriver.common.by import By

        return [e for e in self.driver.find_elements(By.TAG_NAME, tag) if e.text.strip() == text and e.is_displayed()]

    def set_field(self, name: str, value: str):
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys

        field = self.wait(lambda: self.driver.find_elements(By.NAME, name), f"the field {name}")[0]
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", field)
        for _ in range(3):  # the form re-renders while one types; a keystroke can get lost: type again
            field.send_keys(Keys.CONTROL, "a")
            field.send_keys(Keys.DELETE)
            for char in value:
                field.send_keys(char)
            if field.get_attribute("value") == value:
                break
        field.send_keys(Keys.TAB)
        return field

    def login(self, url: str, username: str, password: str) -> None:
        from selenium.webdriver.common.by import By

        self.driver.get(f"{url}/")
        self.wait(lambda: self.driver.find_elements(By.NAME, "username"), "the login form")
        self.shot("login")
        self.driver.find_element(By.NAME, "username").send_keys(username)
        self.driver.find_element(By.NAME, "password").send_keys(password)
        self.driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        self.wait(lambda: "/auth/login" not in self.driver.current_url and self.by_text("a", "Dags"), "the home page")

    def close(self) -> None:
        self.driver.quit()


@contextlib.contextmanager
def signed_in(url: str, user: str, password: str, artifacts: Path) -> Iterator[Browser]:
    """A browser signed in to the Airflow UI at ``url``; closed at the end, its screenshots kept in ``artifacts``."""
    browser = Browser(artifacts)
    try:
        browser.login(url, user, password)
        yield browser
    finally:
        browser.close()
        print(f"screenshots: {artifacts}")
