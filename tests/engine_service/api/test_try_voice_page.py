"""The try-a-voice page in a real headless Chromium: it loads, lists the voices, and plays streamed audio.

Needs Debian's `chromium` and `chromium-driver` (scripts/bootstrap.sh installs them) and the python `selenium`
package; the test is skipped, with the reason, only where they are missing. The server runs on its own thread
and loop because the WebDriver calls block.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator

import pytest

from tests.engine_service.api.api_server import KEY, serve

pytestmark = pytest.mark.timeout(120)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="python package selenium is not installed")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)",
                allow_module_level=True)

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """An espeak-backed API server on a thread of its own."""
    from engines.espeak import EspeakEngine

    ready: dict[str, str] = {}
    started, stop = threading.Event(), None

    async def run() -> None:
        nonlocal stop
        stop = asyncio.Event()
        engine = EspeakEngine()
        await engine.start()
        async with serve(engine) as server:
            ready["url"] = server.url
            started.set()
            await stop.wait()
        await engine.close()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(30), "API server did not start"
    yield ready["url"]
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def body_data(driver, name: str) -> str | None:
    return driver.find_element(By.TAG_NAME, "body").get_attribute(f"data-{name}")


def test_page_loads_lists_voices_and_plays_streamed_audio(server_url, browser):
    browser.get(server_url + "/")
    assert browser.title == "Try a voice"
    key = browser.find_element(By.ID, "key")
    key.send_keys(KEY, Keys.TAB)  # the change event loads the voices
    WebDriverWait(browser, 20).until(lambda driver: body_data(driver, "voices") == "2")
    voices = Select(browser.find_element(By.ID, "voice"))
    assert [option.text for option in voices.options] == ["en", "zh"]
    assert voices.first_selected_option.text == "en"

    text = browser.find_element(By.ID, "text")
    text.clear()
    text.send_keys("Hello from the browser. This sentence is streamed while it is made.")
    browser.find_element(By.ID, "speak").click()
    WebDriverWait(browser, 60).until(lambda driver: body_data(driver, "state") in ("played", "error"))
    assert body_data(browser, "state") == "played", browser.find_element(By.ID, "status").text

    time_to_first_audio_ms = float(body_data(browser, "ttfa-ms"))
    received_s = float(body_data(browser, "received-seconds"))
    played_s = float(body_data(browser, "played-seconds"))
    print(f"page: time to first audio {time_to_first_audio_ms:.0f} ms, {played_s:.2f} s played")
    assert 0 < time_to_first_audio_ms < 5000
    assert received_s > 2.0 and played_s == received_s  # every scheduled piece of audio was played out
    assert browser.find_element(By.ID, "ttfa").text.endswith(" ms")


def test_page_reports_a_wrong_key(server_url, browser):
    browser.get(server_url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(server_url + "/")
    browser.find_element(By.ID, "key").send_keys("not-the-right-key-000", Keys.TAB)
    WebDriverWait(browser, 20).until(lambda driver: body_data(driver, "state") == "error")
    assert "invalid_api_key" in browser.find_element(By.ID, "status").text
