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

from tests.engine_service.api.api_server import KEY, GatedEngine, serve

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


def serve_on_a_thread(make_engine) -> Iterator[str]:
    """An API server around `make_engine()` on a thread and loop of its own; yields its URL."""
    ready: dict[str, str] = {}
    started, stop = threading.Event(), None

    async def run() -> None:
        nonlocal stop
        stop = asyncio.Event()
        engine = make_engine()
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
def server_url() -> Iterator[str]:
    """An espeak-backed API server."""
    from engines.espeak import EspeakEngine

    yield from serve_on_a_thread(EspeakEngine)


@pytest.fixture(scope="module")
def gated() -> Iterator[tuple[str, GatedEngine, asyncio.AbstractEventLoop]]:
    """A server whose engine sends its first chunk and holds the rest until its gate opens; with its loop."""
    made: list = []

    def make() -> GatedEngine:
        made.extend([GatedEngine(chunks=50), asyncio.get_running_loop()])
        return made[0]

    for url in serve_on_a_thread(make):
        yield url, made[0], made[1]


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


def fresh_page(browser, url: str) -> None:
    browser.get(url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(url + "/")


def enter_key(browser, key: str = KEY) -> None:
    field = browser.find_element(By.ID, "key")
    field.clear()
    field.send_keys(key, Keys.TAB)


def test_the_key_stays_in_memory_unless_remember_is_ticked(server_url, browser):
    fresh_page(browser, server_url)
    enter_key(browser)
    WebDriverWait(browser, 20).until(lambda driver: body_data(driver, "voices") == "2")
    assert browser.execute_script("return localStorage.getItem('tts_api_key')") is None
    browser.get(server_url + "/")
    assert browser.find_element(By.ID, "key").get_attribute("value") == ""  # gone with the page

    enter_key(browser)
    browser.find_element(By.ID, "remember").click()
    assert browser.execute_script("return localStorage.getItem('tts_api_key')") == KEY
    browser.get(server_url + "/")
    assert browser.find_element(By.ID, "key").get_attribute("value") == KEY
    assert browser.find_element(By.ID, "remember").is_selected()
    WebDriverWait(browser, 20).until(lambda driver: body_data(driver, "voices") == "2")  # listed with it
    browser.find_element(By.ID, "remember").click()  # untick: forgotten at once
    assert browser.execute_script("return localStorage.getItem('tts_api_key')") is None


def test_a_new_request_clears_the_last_error_and_figures(server_url, browser):
    fresh_page(browser, server_url)
    enter_key(browser, "not-the-right-key-000")
    WebDriverWait(browser, 20).until(lambda driver: body_data(driver, "state") == "error")
    enter_key(browser)
    WebDriverWait(browser, 20).until(lambda driver: body_data(driver, "state") == "ready")
    assert "invalid_api_key" not in browser.find_element(By.ID, "status").text

    text = browser.find_element(By.ID, "text")
    text.clear()
    text.send_keys("Short.")
    browser.find_element(By.ID, "speak").click()
    WebDriverWait(browser, 60).until(lambda driver: body_data(driver, "state") in ("played", "error"))
    assert body_data(browser, "state") == "played" and body_data(browser, "ttfa-ms") is not None

    text.clear()  # an empty text is refused: the last request's figures must not stay beside the error
    browser.find_element(By.ID, "speak").click()
    WebDriverWait(browser, 20).until(lambda driver: body_data(driver, "state") == "error")
    assert "empty_text" in browser.find_element(By.ID, "status").text
    assert [browser.find_element(By.ID, name).text for name in ("ttfa", "received", "played")] == ["–"] * 3
    assert body_data(browser, "ttfa-ms") is None and body_data(browser, "played-seconds") is None


def test_stop_aborts_the_stream(gated, browser):
    url, engine, loop = gated
    fresh_page(browser, url)
    enter_key(browser)
    WebDriverWait(browser, 20).until(lambda driver: body_data(driver, "voices") == "2")
    stop = browser.find_element(By.ID, "stop")
    assert not stop.is_enabled()
    browser.find_element(By.ID, "speak").click()
    # The first chunk is scheduled; the engine holds the rest, so the stream is open when Stop is clicked.
    WebDriverWait(browser, 20).until(lambda driver: body_data(driver, "ttfa-ms") is not None)
    assert len(engine.channels) == 1 and not engine.channels[0].cancelled
    stop.click()
    assert body_data(browser, "state") == "stopped" and browser.find_element(By.ID, "status").text == "Stopped."
    assert not stop.is_enabled()
    # The engine goes on; its next write finds the connection closed, and the server cancels the
    # engine's stream (aiohttp notices a gone client when it writes).
    loop.call_soon_threadsafe(engine.gate.set)
    WebDriverWait(browser, 10).until(lambda driver: engine.channels[0].cancelled)
    assert body_data(browser, "state") == "stopped" and body_data(browser, "received-seconds") is None
