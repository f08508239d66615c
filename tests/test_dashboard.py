"""The pipeline in the Ray dashboard, seen from outside a real run.

One ``megatrain-ray train`` in a subprocess starts its private Ray with the dashboard (the default:
127.0.0.1, token authentication on); while it trains, the tests read its roles through Ray's state
API and (where a Chromium and selenium are installed) the dashboard's actors page in a headless
browser; then SIGTERM stops it, as ``ray job stop`` would. The session's shared Ray cluster stays
without a dashboard: starting one costs seconds and a few hundred MiB for every other test. Also:
the cluster.dashboard setting, and the Grafana file copied into Ray's provisioning folder.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from megatrain_ray.orchestration import labels

pytestmark = pytest.mark.slow  # a second Ray with its dashboard, a headless browser: a minute or more

STEPS = 100000  # more than it ever reaches: the run is stopped once the checks are done
ROLES = {"store": "ParameterStore", "prefetch": "Prefetcher", "compute": "ComputeWorker",
         "grad-sink": "GradientSink", "data-0": "BatchSource", "queues": "QueueHost"}
"""Role name -> its class, for a one-node, one-worker run of the built-in preset with one data loader
(``queues``: the actor holding the node's queues)."""
TOKEN_FILE = os.path.expanduser("~/.ray/auth_token")


class _Run:
    """A ``megatrain-ray train`` subprocess whose output lines are collected by a thread."""

    def __init__(self, args: list[str], cwd):
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.setdefault("RAY_DEDUP_LOGS", "0")
        self.proc = subprocess.Popen([sys.executable, "-m", "megatrain_ray.cli", "train", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None:
                self.reader.join(5)
                pytest.fail(f"the run ended (status {self.proc.returncode}) before printing {pattern!r}:\n"
                            + "".join(self.lines[-40:]))
            time.sleep(0.5)
        pytest.fail(f"no line matching {pattern!r} within {timeout:.0f} s:\n" + "".join(self.lines[-40:]))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the run saves a checkpoint and shuts its Ray down
            try:
                self.proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)  # a second one skips the checkpoint
                self.proc.wait(timeout=60)
        self.reader.join(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, shm_dirs):
    """(dashboard URL, run id, the run) of a run that is training now."""
    base = tmp_path_factory.mktemp("dashboard")
    with shm_dirs() as shm_dir:
        run = _Run(["--set", "cluster.ray_address=local", "--set", "compute.device=cpu", "--set",
                    f"memory.shm_dir={shm_dir}", "--set", f"train.run_dir={base / 'runs'}", "--set",
                    f"train.steps={STEPS}", "--set", "train.checkpoint_every=0", "--set", "train.save_final=false"],
                   base)
        try:
            url = run.wait_for(r"^Ray dashboard: (http://127\.0\.0\.1:\d+) \(log in with the token in "
                               r"~/\.ray/auth_token\); metrics: http://[\d.]+:\d+/metrics$", 300).group(1)
            run_id = run.wait_for(r"^run (\S+): config, metrics", 60).group(1)
            run.wait_for(r"^step +2/", 300)  # the pipeline is running
            yield url, run_id, run
        finally:
            status = run.stop()
        assert status == 130, "".join(run.lines[-40:])  # interrupted, checkpoint saved, cleaned up
        assert os.listdir(shm_dir) == []


def test_start_line_names_the_dashboard_and_metrics_endpoint(live_run):
    """The line printed at start: the dashboard answers at its URL, the run's gauges are on the
    metrics endpoint it names."""
    url, run_id, run = live_run
    lines = [ln for ln in run.lines if ln.startswith("Ray dashboard: ")]
    assert len(lines) == 1, lines
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as page:  # the page itself needs no token; its API does
        assert b"Ray Dashboard" in page.read()
    metrics = re.search(r"metrics: (\S+)$", lines[0]).group(1)
    deadline = time.monotonic() + 120  # the gauges of the steps done, within a few export periods
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(metrics, timeout=30).read().decode()
        steps = [float(v) for v in re.findall(rf'^ray_megatrain_step{{[^}}]*run_id="{run_id}"[^}}]*}} (\S+)$',
                                              text, re.M)]
        if steps and steps[0] >= 1:
            break
        time.sleep(2)
    assert steps and steps[0] >= 1, text[-2000:]


STATE_QUERY = """
import dataclasses, json, sys
from ray.util.state import list_actors, list_tasks
url, run_id = sys.argv[1:]
actors = [a for a in list_actors(address=url, detail=True, limit=10000, raise_on_missing_output=False)
          if (a.name or "").endswith("-" + run_id)]
tasks = list_tasks(address=url, detail=True, limit=10000, raise_on_missing_output=False)
ids = {a.actor_id for a in actors}
print(json.dumps({"actors": [dataclasses.asdict(a) for a in actors],
                  "tasks": [dataclasses.asdict(t) for t in tasks if t.actor_id in ids]}, default=str))
"""
"""Ray's state API (``ray.util.state``), queried from a client process of its own, as a user would:
one started with ``RAY_AUTH_MODE=token`` sends the token it finds in ~/.ray/auth_token (the mode of
a process is fixed once Ray is imported, so this test process cannot switch to it)."""


def _state(url: str, run_id: str) -> dict:
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "token"}
    proc = subprocess.run([sys.executable, "-c", STATE_QUERY, url, run_id], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_roles_and_their_tasks_through_the_state_api(live_run):
    """Every role by name, alive, labelled with what it is and where it runs; the compute worker's
    tasks named by step, the loops by their steps; none of the queue host's calls."""
    url, run_id, _ = live_run
    state = _state(url, run_id)
    by_role = {a["name"].removesuffix(f"-{run_id}"): a for a in state["actors"]}
    assert set(by_role) == set(ROLES), sorted(by_role)
    for role, cls in ROLES.items():
        a = by_role[role]
        assert a["state"] == "ALIVE", (role, a["state"])
        assert a["class_name"] == cls, (role, a["class_name"])
        assert a["repr_name"] == f"{role}: {cls}, node 0", a["repr_name"]

    def tasks_of(role: str) -> list[dict]:
        return [t for t in state["tasks"] if t["actor_id"] == by_role[role]["actor_id"]]

    names = {t["name"] for t in tasks_of("compute") if t["name"].startswith("ComputeWorker step ")}
    assert names >= {labels.step_task(0, STEPS), labels.step_task(1, STEPS)}, sorted(names)[:10]
    assert all(re.fullmatch(rf"ComputeWorker step \d+/{STEPS}", n) for n in names), names
    for role in ("prefetch", "grad-sink"):
        cls = "GradientSink" if role == "grad-sink" else "Prefetcher"
        loops = [t for t in tasks_of(role) if t["name"] == labels.loop_task(role, cls, 0, STEPS)]
        assert [t["state"] for t in loops] == ["RUNNING"], [(t["name"], t["state"]) for t in tasks_of(role)]
    # The queue host records no task events: its puts and gets (several per unit and step) would
    # crowd the roles' own tasks out of Ray's task table (the state API lists at most 10,000).
    assert tasks_of("queues") == [], [t["name"] for t in tasks_of("queues")][:5]
    # nor do the health checks' pings of the idle roles (twice a second each)
    pings = [t["name"] for t in state["tasks"] if t["name"].endswith(("health_ping", "__ray_ready__"))]
    assert pings == [], pings[:5]


def _browser():
    """A headless Chromium driven by selenium, or a skip saying what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium)")
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("no Chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def _wait(browser, css: str, timeout: float = 120):
    """The elements matching ``css``, once there are some."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = browser.find_elements("css selector", css)
        if found:
            return found
        time.sleep(0.5)
    pytest.fail(f"no {css!r} on the page within {timeout:.0f} s:\n{browser.find_element('tag name', 'body').text[:2000]}")


def _until_not_stale(act, timeout: float = 120):
    """``act()``, done again while the page re-renders the elements it found under it (selenium's
    StaleElementReferenceException: the element was replaced between finding and using it;
    NoSuchElementException or StopIteration: what it looked up next, a label's input or a button,
    is not rendered yet, or was taken out in the re-render; ElementNotInteractableException or
    ElementClickInterceptedException: it is rendered but not usable yet, under the token dialog
    while that closes or before the table's filters are laid out)."""
    from selenium.common.exceptions import (
        ElementClickInterceptedException,
        ElementNotInteractableException,
        NoSuchElementException,
        StaleElementReferenceException,
    )

    retried = (StaleElementReferenceException, NoSuchElementException, StopIteration,
               ElementNotInteractableException, ElementClickInterceptedException)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return act()
        except retried:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_the_dashboards_actors_page_lists_the_roles(live_run, tmp_path):
    """In a real browser, as a person does it: open the actors page, give the token the dashboard
    asks for, filter the table by the run id, and find every role of the run by name and label.
    MEGATRAIN_DASHBOARD_SCREENSHOT=FILE.png keeps a screenshot of the page."""
    url, run_id, _ = live_run
    browser = _browser()
    try:
        with open(TOKEN_FILE) as f:
            token = f.read().strip()
        browser.get(f"{url}/#/actors")
        _until_not_stale(lambda: _wait(browser, "input[type=password]")[0].send_keys(token))  # "Token Required"
        _until_not_stale(lambda: next(b for b in browser.find_elements("tag name", "button")
                                      if b.text.strip().upper() == "SUBMIT").click())

        def filter_by_name():  # the table's filters: the input the "Name" label names
            name = next(lb for lb in _wait(browser, "label[for]") if lb.text.strip() == "Name")
            browser.find_element("id", name.get_attribute("for")).send_keys(f"-{run_id}")

        _until_not_stale(filter_by_name)
        wanted = {f"{role}-{run_id}": f"{role}: {cls}, node 0" for role, cls in ROLES.items()}
        deadline = time.monotonic() + 120
        text = ""
        while time.monotonic() < deadline:
            text = _until_not_stale(lambda: browser.find_element("tag name", "body").text)
            if all(name in text and label in text for name, label in wanted.items()):
                break
            time.sleep(1)
        browser.save_screenshot(os.environ.get("MEGATRAIN_DASHBOARD_SCREENSHOT") or str(tmp_path / "actors.png"))
        missing = [f"{name} ({label})" for name, label in wanted.items() if name not in text or label not in text]
        assert not missing, f"the actors page does not list {missing}; it shows:\n{text[:3000]}"
        assert "Authentication Token Required" not in text
    finally:
        browser.quit()


def test_the_dashboard_setting_is_validated_and_said_when_off(ray_cluster):
    """cluster.dashboard takes true/false (an error naming the key otherwise); the start line says
    when it is off or when the cluster joined has none, and still names the metrics endpoint."""
    from megatrain_ray.config import load_config
    from megatrain_ray.errors import ConfigError
    from megatrain_ray.orchestration.cluster import endpoints_line, metrics_endpoint

    assert load_config(None, []).cluster.dashboard is True  # on by default
    assert load_config(None, ["cluster.dashboard=false"]).cluster.dashboard is False
    with pytest.raises(ConfigError, match=r"^cluster\.dashboard must be true or false, got 'maybe'"):
        load_config(None, ["cluster.dashboard=maybe"])
    endpoint = metrics_endpoint()
    assert re.fullmatch(r"http://[\d.]+:\d+/metrics", endpoint)
    assert endpoints_line("", True) == f"Ray dashboard: off (cluster.dashboard=false); metrics: {endpoint}"
    assert endpoints_line("", False) == f"Ray dashboard: none on this cluster; metrics: {endpoint}"


def test_the_grafana_file_goes_into_rays_provisioning_folder(tmp_path):
    """Where Ray's dashboard wrote its Grafana setup (<session>/metrics/grafana/dashboards), the
    shipped file is copied in, byte for byte; elsewhere nothing is written."""
    from megatrain_ray.orchestration import grafana

    assert grafana.install(str(tmp_path)) is None and list(tmp_path.iterdir()) == []
    assert grafana.install(None) is None
    folder = tmp_path / "metrics" / "grafana" / "dashboards"
    folder.mkdir(parents=True)
    path = grafana.install(str(tmp_path))
    assert path == str(folder / "megatrain_ray_pipeline.json")
    with open(path, "rb") as got, open(grafana.SHIPPED, "rb") as shipped:
        assert got.read() == shipped.read()
    board = json.loads(open(path).read())
    assert board["uid"] == "megatrain-ray" and len(board["panels"]) == len(grafana.PANELS)


def test_a_ray_without_dashboard_packages_is_detected_before_it_starts(monkeypatch):
    """A plain ``ray`` install (no ray[default]) cannot start the dashboard: ray.init would raise
    "Cannot include dashboard with missing packages" and the run would die at start. connect()
    asks first and starts Ray without it, saying which package is missing."""
    from megatrain_ray.orchestration import cluster

    assert cluster._dashboard_missing() == ""  # this install has them (ray[default])
    monkeypatch.setattr("ray._private.utils.get_dashboard_dependency_error",
                        lambda: ImportError("No module named 'aiohttp'"))
    assert "aiohttp" in cluster._dashboard_missing()
