"""End to end, on the system `make run` starts: a script trains through the API and the job socket, then a
user does the same in a real headless Chromium (Debian's, driven by Playwright) and watches it live."""

from __future__ import annotations

import json
import re

from websockets.sync.client import connect

from tests.e2e.conftest import SHOTS, log_in, watched

JOB = {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 32, "iterations": 3}


def test_a_script_trains_through_the_api_and_watches_the_socket(system):
    job = system.api("/api/jobs/", JOB)
    assert job["status"] == "queued" and job["id"]
    done = system.wait("the plan", lambda: (j := system.api(f"/api/jobs/{job['id']}/"))["status"] != "planning"
                       and j["status"] != "queued" and j, 120)  # fmt: skip
    assert done["status"] == "planned", done["message"]
    ws_url = system.url.replace("http://", "ws://") + f"/ws/jobs/{job['id']}/"
    with connect(ws_url, additional_headers={"Authorization": f"Bearer {system.token}"}, open_timeout=10) as ws:
        assert json.loads(ws.recv(10))["type"] == "snapshot"
        launched = system.api(f"/api/jobs/{job['id']}/launch/", {})
        assert launched["status"] == "running"
        iterations, status = [], None
        while status not in ("completed", "failed", "cancelled"):
            frame = json.loads(ws.recv(240))
            for msg in frame["messages"] if frame["type"] == "batch" else [frame]:  # an agent message's worth
                if msg["type"] == "iteration":
                    iterations.append(msg)
                elif msg["type"] == "status":
                    status = msg["status"]
    final = system.api(f"/api/jobs/{job['id']}/")
    assert status == "completed", final["message"] + "\n" + system.tail()
    assert [m["iteration"] for m in iterations] == [0, 1, 2]
    assert all(m["throughput"] > 0 and m["loss"] > 0 for m in iterations)
    assert final["latest"]["iteration"] == 2 and "samples/s against" in final["message"]
    devices = {d["name"]: d for d in system.api("/api/devices/")["devices"]}
    assert all(devices[name]["status"] == "online" and devices[name]["job"] is None for name in final["devices"])
    assert all(d["measured"]["emulated"] and d["measured"]["host_gflops"] > 0 for d in devices.values())


def test_a_user_plans_launches_and_watches_a_job_in_chromium(system, browser, tmp_path):
    from playwright.sync_api import expect

    shots = SHOTS or tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    page = watched(browser.new_page(viewport={"width": 1366, "height": 900}))
    external: list[str] = []
    page.on("request", lambda r: r.url.startswith(system.url) or r.url.startswith("data:") or external.append(r.url))
    log_in(page, system)
    expect(page.locator("h1")).to_have_text("Asteroid")

    page.goto(system.url + "/devices/")
    expect(page.locator("#devices tbody tr")).to_have_count(6)
    expect(page.locator("#devices .status-online")).to_have_count(6, timeout=20_000)
    page.screenshot(path=str(shots / "devices.png"), full_page=True)

    page.goto(system.url + "/jobs/new/")
    page.select_option("#id_model", "mobilenetv2")
    page.fill("#id_batch_size", str(JOB["batch_size"]))
    page.fill("#id_iterations", str(JOB["iterations"]))
    before = len(system.api("/api/jobs/")["jobs"])
    page.dblclick("#job-form button[type=submit]", delay=30)  # double-clicked, as people do: one job all the same
    expect(page.locator("#launch")).to_be_visible(timeout=120_000)  # the page reloads once planned
    assert len(system.api("/api/jobs/")["jobs"]) == before + 1
    expect(page.locator("#comparison tbody tr")).to_have_count(5)
    expect(page.locator("#comparison tr.best td").first).to_have_text("asteroid")
    for fig in ("fig-comparison", "fig-pipeline", "fig-memory", "fig-timeline"):
        expect(page.locator(f'[data-figure-id="{fig}"] .main-svg').first).to_be_attached()
    page.screenshot(path=str(shots / "plan.png"), full_page=True)

    page.click("#launch")
    page.wait_for_url("**/live/")
    points = "() => (document.getElementById('throughput-chart').data || [{x: []}])[0].x.length"
    page.wait_for_function(f"{points} >= 1", timeout=180_000)
    expect(page.locator("#device-states .state-training").first).to_be_attached()
    expect(page.locator("#job-status")).to_have_text("completed", timeout=180_000)
    page.wait_for_function(f"{points} >= {JOB['iterations']}")
    expect(page.locator("#cancel-form")).to_be_hidden()
    expect(page.locator("#download-model")).to_be_visible()
    speeds = page.locator("#device-states td.speed")  # each device's compute against the plan's
    expect(speeds).to_have_count(len(page.locator("#device-states tr").all()))
    for k in range(speeds.count()):
        expect(speeds.nth(k)).to_have_text(re.compile(r"^\d+ %$"))
    assert page.locator("#event-log li").count() >= 3
    page.screenshot(path=str(shots / "live.png"), full_page=True)

    page.goto(system.url + "/jobs/")
    expect(page.locator("#jobs .status-completed").first).to_be_visible()
    assert not page.errors, page.errors
    assert not external, f"pages fetched from outside the site: {external}"
