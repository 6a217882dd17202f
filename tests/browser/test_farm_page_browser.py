"""The Farm page in a real browser: Debian's headless Chromium driven through chromedriver
(selenium), on a thread farm (gateway + echo workers) under a load of 32 streams. The page
must show the decode queue filling and emptying and the workers' running counts, refreshing
by itself: the same document throughout (no reload), its tables redrawn from the JSON.

Run by `make test-browser` (`apt-get install chromium chromium-driver`; no browser is
downloaded at run time); skipped, saying why, where Chromium or selenium is missing.
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from syshax.broker.keys import DEVICE_CLASSES
from werkzeug.serving import make_server

from syshax.farm_page import FarmPageSettings, make_app

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
STREAMS = 32


@pytest.fixture
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip(
            "needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)"
        )
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="needs selenium (make test-browser installs it)"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1500,1250"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    yield driver
    driver.quit()


@pytest.fixture
def dashboard(redis_url):
    """Start the dashboard app for a farm's keys on a free port (werkzeug, as `syshax
    dashboard` serves it); returns a function keys -> base URL."""
    servers = []

    def start(keys) -> str:
        app = make_app(FarmPageSettings(redis_url=redis_url, keys=keys, poll_ms=500))
        server = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()


# One script reads what the page shows, in one go: the tables are redrawn under it every poll.
READ_PAGE = """
const text = (sel) => (document.querySelector(sel) || {}).textContent || "0";
return {
  decode: arguments[0].map((c) => parseInt(text(`#stream-decode-${c} td[data-field=length]`), 10)),
  running: Object.fromEntries(arguments[1].map(
    (w) => [w, parseInt(text(`#worker-${w} td[data-field=running]`).split("/")[0], 10)])),
  now: document.getElementById("updated").dataset.now || "",
};
"""


def _read(driver) -> tuple[int, dict[str, int], str]:
    """(decode streams' total length, running count per worker, the data's time) on the page."""
    seen = driver.execute_script(READ_PAGE, list(DEVICE_CLASSES), ["xpu", "cpu0"])
    return sum(seen["decode"]), seen["running"], seen["now"]


def _load(farm) -> None:
    client = farm.client()

    def one(i: int) -> str:
        reply = client.chat.completions.create(
            model=farm.model,
            messages=[{"role": "user", "content": f"stream {i}: count the sheep " * 6}],
            max_tokens=48,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)

    with ThreadPoolExecutor(STREAMS) as pool:
        assert all(pool.map(one, range(STREAMS)))


def test_the_farm_page_follows_a_loaded_farm_without_a_reload(
    thread_farm, dashboard, browser, tmp_path: Path
):
    farm = thread_farm(workers="echo", slots=6, step_delay=0.04, detokenize=True)
    base = dashboard(farm.keys)
    browser.get(f"{base}/farm/")
    browser.execute_script("window.__sameDocument = true")  # gone if the page reloads
    end = time.monotonic() + 10
    while not _read(browser)[2]:
        assert time.monotonic() < end, "the page never loaded the farm's state"
        time.sleep(0.1)
    first_update = float(_read(browser)[2])
    load = threading.Thread(target=_load, args=(farm,), daemon=True)
    load.start()
    peak, running_seen, shot = 0, {"xpu": 0, "cpu0": 0}, None
    deadline = time.monotonic() + 90
    while load.is_alive() and time.monotonic() < deadline:
        length, running, _ = _read(browser)
        for worker, n in running.items():
            running_seen[worker] = max(running_seen[worker], n)
        if length > peak:
            peak = length
            if length >= 8:  # the page at the deepest queue seen (docs/img/farm_page.png)
                shot = tmp_path / "farm_page.png"
                browser.save_screenshot(str(shot))
        time.sleep(0.2)
    load.join(30)
    assert not load.is_alive(), "the 32 streams did not finish"
    assert peak >= 8, f"the page never showed the decode queue filling (peak {peak})"
    assert all(running_seen.values()), f"a worker's running count never showed: {running_seen}"

    def drained() -> bool:
        length, running, _ = _read(browser)
        return length == 0 and not any(running.values())

    end = time.monotonic() + 15
    while not drained() and time.monotonic() < end:
        time.sleep(0.2)
    assert drained(), "the page never showed the queue empty again"
    assert browser.execute_script("return window.__sameDocument === true")
    assert float(_read(browser)[2]) > first_update
    assert shot is not None and shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_a_dead_letter_requeued_by_a_click_completes(thread_farm, dashboard, browser, r):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait
    from syshax.broker.keys import KEYS
    from syshax.broker.schemas import PrefillJob
    from syshax.broker.worker_io import WorkQueues
    from syshax.shared.sampling import SamplingParams

    now = time.time()
    params = SamplingParams(max_tokens=5, temperature=0.0).to_dict()
    job = PrefillJob(request_id="req-click", prompt_ids=list(range(9, 21)), params=params,
                     created=now, deadline=now + 30)  # fmt: skip
    queues = WorkQueues(r, [KEYS.prefill_stream], "lost-worker", KEYS)
    queues.ensure_groups()
    r.xadd(KEYS.prefill_stream, {"j": job.pack()})
    (entry,) = queues.read(1, None)
    queues.dead_letter(entry, "engine error: <b>injected</b>")  # markup stays text
    browser.get(f"{dashboard(KEYS)}/farm/")
    # The page re-renders its tables on every refresh, so an element found a moment ago may
    # be gone by the time it is read or clicked: each read and click finds it again, and the
    # wait retries one that went stale (CI saw a click land on a replaced button).
    wait = WebDriverWait(browser, 10, ignored_exceptions=[StaleElementReferenceException])
    requeue = (By.CSS_SELECTOR, "#dead button[data-action=requeue]")
    wait.until(expected_conditions.element_to_be_clickable(requeue))
    reason = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#dead td.reason").text)
    assert reason == "engine error: <b>injected</b>"
    wait.until(lambda d: d.find_element(*requeue).click() or True)
    wait.until(expected_conditions.alert_is_present()).dismiss()  # "no": nothing happens
    time.sleep(0.5)
    assert r.xlen(KEYS.dead_letter_stream) == 1 and r.xlen(KEYS.prefill_stream) == 0
    wait.until(lambda d: d.find_element(*requeue).click() or True)
    wait.until(expected_conditions.alert_is_present()).accept()
    wait.until(lambda d: "requeued on" in d.find_element(By.ID, "flash").text)
    assert r.xlen(KEYS.dead_letter_stream) == 0
    farm = thread_farm(gateway=False, workers="echo")
    events = farm.events("req-click", 15)
    assert events[-1].finish_reason == "length" and len(events) == 5
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, "#dead tbody tr"))
