"""What a person sees of a live run in the Ray dashboard, recorded to a folder (run on a GPU box).

    python benchmarks/dashboard_check.py OUT_DIR [--set key=value ...]

Starts ``megatrain-ray train`` (a private Ray with its dashboard; by default the built-in preset on
the device Ray finds, 100000 steps) and, once two steps are logged: reads the run's actors and
tasks through Ray's state API (``actors.json``, ``tasks.json``), scrapes the node's metrics
endpoint (``metrics.txt``: the ``ray_megatrain_*`` lines), copies the run's start lines
(``run.log``), and where selenium and a Chromium are installed takes a screenshot of the
dashboard's actors page after logging in with the token (``actors.png``; the README's screenshot).
Then it stops the run with SIGTERM, as ``ray job stop`` does. Prints a table of the roles last.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

STATE = """
import dataclasses, json, sys
from ray.util.state import list_actors, list_tasks
url, run_id = sys.argv[1:]
actors = [a for a in list_actors(address=url, detail=True, limit=10000, raise_on_missing_output=False)
          if (a.name or "").endswith("-" + run_id)]
ids = {a.actor_id for a in actors}
tasks = [t for t in list_tasks(address=url, detail=True, limit=10000, raise_on_missing_output=False) if t.actor_id in ids]
print(json.dumps({"actors": [dataclasses.asdict(a) for a in actors],
                  "tasks": [dataclasses.asdict(t) for t in tasks]}, default=str))
"""


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out, overrides = argv[0], argv[1:]
    os.makedirs(out, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    args = ["--set", "cluster.ray_address=local", "--set", "train.steps=100000", "--set", "train.checkpoint_every=0",
            "--set", "train.save_final=false", "--set", f"train.run_dir={os.path.join(out, 'runs')}", *overrides]
    proc = subprocess.Popen([sys.executable, "-m", "megatrain_ray.cli", "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        url = _wait(lines, proc, r"^Ray dashboard: (http://\S+)", 600).group(1)
        metrics = _wait(lines, proc, r"metrics: (http://\S+/metrics)", 10).group(1)
        run_id = _wait(lines, proc, r"^run (\S+): config", 600).group(1)
        _wait(lines, proc, r"^step +2/", 900)
        time.sleep(12)  # a few metric export periods
        state = subprocess.run([sys.executable, "-c", STATE, url, run_id], env={**env, "RAY_AUTH_MODE": "token"},
                               capture_output=True, text=True, timeout=300)
        if state.returncode:
            raise SystemExit(f"state API failed:\n{state.stderr[-3000:]}")
        got = json.loads(state.stdout.strip().splitlines()[-1])
        for name in ("actors", "tasks"):
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump(got[name], f, indent=1)
        import urllib.request

        text = urllib.request.urlopen(metrics, timeout=30).read().decode()
        with open(os.path.join(out, "metrics.txt"), "w") as f:
            f.write("".join(ln + "\n" for ln in text.splitlines() if ln.startswith("ray_megatrain_")))
        shot = _screenshot(url, run_id, os.path.join(out, "actors.png"))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
        time.sleep(1)
        with open(os.path.join(out, "run.log"), "w") as f:
            f.writelines(lines)
    running = {t["actor_id"]: t["name"] for t in got["tasks"] if t["state"] == "RUNNING"}
    print(f"run {run_id}: exit status {proc.returncode}; screenshot: {shot}")
    print(f"{'role':<24} {'state':<7} {'running task':<28} label")
    for a in sorted(got["actors"], key=lambda a: a["name"]):
        print(f"{a['name'].removesuffix('-' + run_id):<24} {a['state']:<7} {running.get(a['actor_id'], '-'):<28} "
              f"{a['repr_name']}")
    return 0


def _wait(lines: list[str], proc, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(lines):
            m = re.search(pattern, line)
            if m:
                return m
        if proc.poll() is not None:
            raise SystemExit(f"the run ended (status {proc.returncode}):\n{''.join(lines[-40:])}")
        time.sleep(0.5)
    raise SystemExit(f"no line matching {pattern!r} in {timeout:.0f} s:\n{''.join(lines[-40:])}")


def _screenshot(url: str, run_id: str, path: str) -> str:
    """The actors page, filtered by the run id, logged in with the token; or why there is none."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return "none (selenium not installed)"
    binary, driver = shutil.which("chromium") or shutil.which("google-chrome"), shutil.which("chromedriver")
    if not binary or not driver:
        return "none (no chromium/chromedriver on PATH)"
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1800,900"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        browser.get(f"{url}/#/actors")
        with open(os.path.expanduser("~/.ray/auth_token")) as f:
            _first(browser, "input[type=password]").send_keys(f.read().strip())
        next(b for b in browser.find_elements("tag name", "button") if b.text.strip().upper() == "SUBMIT").click()
        time.sleep(3)
        name = next(lb for lb in browser.find_elements("css selector", "label[for]") if lb.text.strip() == "Name")
        browser.find_element("id", name.get_attribute("for")).send_keys(f"-{run_id}")
        time.sleep(5)
        browser.save_screenshot(path)
        return path
    finally:
        browser.quit()


def _first(browser, css: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = browser.find_elements("css selector", css)
        if found:
            return found[0]
        time.sleep(0.5)
    raise SystemExit(f"no {css} on the dashboard page")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
