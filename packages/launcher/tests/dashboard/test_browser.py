"""The dashboard in a real browser: headless Chromium loads the page, shows two runs, and picks up
a step appended while it is open. Skipped only when Chromium, chromedriver or selenium is absent
(CI installs them: `apt-get install chromium chromium-driver`, `pip install -e packages/launcher[test]`).
The screenshot lands in <repo>/artifacts/dashboard/ (git-ignored) for a human to look at.
"""

import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from prime_rl.launcher.dashboard.server import build_server

from .helpers import append_metrics, make_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
PARTIAL_HEAD = '{"step": 31, "reward/me'
ARTIFACTS = Path(__file__).resolve().parents[4] / "artifacts" / "dashboard"

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - depends on the machine
    webdriver = None

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None or webdriver is None,
    reason="needs chromium + chromedriver (apt-get install chromium chromium-driver) and selenium "
    "(pip install -e packages/launcher[test])",
)


def metrics(step: int, scale: float) -> dict:
    return {
        "step": step,
        "reward/mean": scale * (1 - 0.9**step),
        "loss/mean": 2.0 * 0.93**step / scale,
        "perf/throughput": 21000.0 * scale + 37 * (step % 5),
        "perf/mfu": 0.36 * scale,
        "perf/peak_memory": 61.2 * scale,
        "mismatch_kl": 1e-3 / step,
        "time/step": 3.1 / scale,
    }


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    for rel, scale in [("sweep/lr-1e-6", 1.0), ("sweep/lr-3e-6", 1.25)]:
        run = make_run(tmp_path, rel, logs={"trainer/torchrun/0.log": "INFO training\n"})
        for step in range(1, 31):
            append_metrics(run, metrics(step, scale))
            if step % 10 == 0 and scale == 1.0:  # online evals: own rows at the step they evaluated
                append_metrics(
                    run, {"step": step, "eval/arithmetic/reward_mean": 0.02 * step, "eval/arithmetic/pass@4": 0.5}
                )
    # Problems must show up in the page, not crash it.
    append_metrics(tmp_path / "sweep/lr-1e-6", {}, raw=PARTIAL_HEAD)  # a line still being written
    append_metrics(tmp_path / "sweep/lr-3e-6", {}, raw="not json at all\n")
    return tmp_path


@pytest.fixture
def base_url(runs_root: Path) -> Iterator[str]:
    server = build_server(runs_root, port=0, poll_ms=300)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def driver() -> Iterator["webdriver.Chrome"]:
    profile = tempfile.mkdtemp(prefix="dashboard-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1500,1300",
        f"--user-data-dir={profile}",
    ]:
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    try:
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


def step_cells(drv) -> dict[str, str]:
    # Read in one script call: the table may be re-rendered between two WebDriver round trips.
    return drv.execute_script(
        "const out = {}; for (const c of document.querySelectorAll('td.step')) out[c.dataset.run] = c.textContent;"
        "return out;"
    )


def text_of(drv, selector: str) -> str:
    return drv.execute_script("return document.querySelector(arguments[0]).innerText", selector)


def test_page_shows_two_runs_and_a_new_step(driver, base_url: str, runs_root: Path) -> None:
    wait = WebDriverWait(driver, 20, poll_frequency=0.1)
    driver.get(base_url + "/")
    wait.until(lambda d: len(step_cells(d)) == 2)
    assert step_cells(driver) == {"sweep/lr-1e-6": "30", "sweep/lr-3e-6": "30"}

    # One uPlot canvas per default metric, each with both runs in its legend.
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".plot canvas")) == 8)
    titles = [h.text for h in driver.find_elements(By.CSS_SELECTOR, ".plot h3")]
    assert titles == [
        "reward/mean",
        "loss/mean",
        "perf/throughput",
        "perf/mfu",
        "perf/peak_memory",
        "mismatch_kl",
        "time/step",
        "eval/arithmetic/reward_mean",  # the online eval curve beside the training reward, by default
    ]
    eval_x = driver.execute_script("return window.dashboard.charts.get('eval/arithmetic/reward_mean').plot.data[0]")
    assert eval_x == [10, 20, 30]  # only the evaluated steps, not a line broken by 27 gaps
    legend = text_of(driver, '.plot[data-key="reward/mean"] .u-legend')
    assert "sweep/lr-1e-6" in legend and "sweep/lr-3e-6" in legend
    notes = text_of(driver, "#runs tbody")
    assert "last line still being written" in notes and "1 malformed line skipped" in notes
    keys = driver.execute_script("return [...document.querySelectorAll('#keys input')].map((b) => b.value)")
    assert len(keys) == 9 and "perf/throughput" in keys and "eval/arithmetic/pass@4" in keys
    cell = driver.execute_script(
        "return [...document.querySelectorAll('#runs tbody tr')].find((r) => r.innerText.includes('lr-1e-6')).innerText"
    )
    assert "0.6" in cell  # the "eval reward" column: the newest eval/<env>/reward_mean

    # Finish the half-written line and add one more: step 32 must appear without a reload.
    append_metrics(runs_root / "sweep/lr-1e-6", {}, raw=json.dumps(metrics(31, 1.0))[len(PARTIAL_HEAD) :] + "\n")
    append_metrics(runs_root / "sweep/lr-1e-6", metrics(32, 1.0))
    wait.until(lambda d: step_cells(d)["sweep/lr-1e-6"] == "32")
    points = driver.execute_script("return window.dashboard.charts.get('reward/mean').plot.data[0].length")
    assert points == 32

    # The selector drives the plots: untick one metric and its chart goes away.
    driver.execute_script("document.querySelector('#keys input[value=\"perf/mfu\"]').click()")
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".plot canvas")) == 7)
    assert driver.find_elements(By.CSS_SELECTOR, '.plot[data-key="perf/mfu"]') == []

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors
