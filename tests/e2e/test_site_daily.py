"""The site as a lab uses it every day, in Chromium on the system `make run` starts: an administrator adds a board
and pastes the enrollment line it shows into a shell whose `python` is not the project's (the board appears
online without a reload), invites a user who picks a username and password, cancels a job (asked first), runs
it again and compares the two runs."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import CHROMIUM, ROOT, SHOTS, logged_in, watched
from tests.e2e.test_recovery import ended, planned, reached

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no chromium (make test installs Debian's)")


def test_the_enrollment_line_pasted_in_a_shell_brings_the_board_online(system, browser, tmp_path):
    from playwright.sync_api import expect

    page = logged_in(browser, system, permissions=["clipboard-read", "clipboard-write"])
    page.goto(system.url + "/devices/")
    expect(page.locator("#devices tbody tr")).to_have_count(6)
    devices_page = watched(page.context.new_page())  # left open: its rows refresh by themselves
    devices_page.goto(system.url + "/devices/")
    page.goto(system.url + "/devices/add/")
    page.fill("#id_name", "nano-pasted")
    page.select_option("#id_kind", "jetson-nano")
    page.click("main form button[type=submit]")
    command = page.locator("#agent-command").inner_text().strip()
    assert command.startswith(f"make agent SERVER={system.url} TOKEN=ast_enroll_"), command
    page.click("button.copy[data-copy=agent-command]")
    expect(page.locator("button.copy")).to_have_text("Copied")
    pasted = page.evaluate("() => navigator.clipboard.readText()")
    assert pasted.strip() == command
    if SHOTS:
        page.screenshot(path=str(SHOTS / "enrollment.png"), full_page=True)
    row = devices_page.locator("#devices tr", has_text="nano-pasted")
    expect(row).to_have_count(1, timeout=10_000)  # added elsewhere: the open page shows it without a reload
    expect(row).to_contain_text("not enrolled")

    # The board's shell: its `python` is the system's, which lacks the agent's packages (here: one that fails).
    shell_bin = tmp_path / "bin"
    shell_bin.mkdir()
    for name in ("python", "python3"):
        (shell_bin / name).write_text("#!/bin/sh\necho 'not the project python' >&2\nexit 1\n")
        (shell_bin / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{shell_bin}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "ASTEROID_CACHE_DIR": system.env["ASTEROID_CACHE_DIR"]}  # fmt: skip
    line = f"{pasted.strip()} EMULATE=nano STATE={tmp_path / 'agent.json'}"  # this machine emulates the Nano
    agent = subprocess.Popen(["bash", "-c", line], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        expect(row.locator(".status")).to_have_text("Online", timeout=120_000)
        expect(row).not_to_contain_text("not enrolled")
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        _, err = agent.communicate(timeout=60)
    assert "Traceback" not in err, err
    expect(row.locator(".status")).to_have_text("Offline", timeout=30_000)
    devices_page.once("dialog", lambda dialog: dialog.accept())
    row.locator("button", has_text="Remove").click()  # back to the six of cluster C for the other tests
    expect(devices_page.locator("#devices tr", has_text="nano-pasted")).to_have_count(0, timeout=10_000)
    assert not page.errors and not devices_page.errors, page.errors + devices_page.errors


def test_an_invited_user_picks_a_username_and_password_and_sees_only_their_jobs(system, browser):
    from playwright.sync_api import expect

    admin = logged_in(browser, system)
    admin.goto(system.url + "/users/")
    admin.click("#invite-form button[type=submit]")
    link = admin.locator("#invitation-link").inner_text().strip()
    assert link.startswith(system.url + "/accounts/join/ast_invite_"), link
    if SHOTS:
        admin.screenshot(path=str(SHOTS / "users.png"), full_page=True)
    newcomer = watched(browser.new_context().new_page())
    newcomer.goto(link)
    newcomer.fill("#id_username", "dana")
    newcomer.fill("#id_password1", "dana's long passphrase 42")
    newcomer.fill("#id_password2", "dana's long passphrase 42")
    newcomer.click("#join-form button[type=submit]")
    expect(newcomer.locator(".messages")).to_contain_text("Welcome, dana")
    newcomer.goto(system.url + "/jobs/")
    expect(newcomer.locator(".empty")).to_contain_text("No jobs yet")
    newcomer.goto(link)  # used once: refused, with what to do
    expect(newcomer.locator("#invalid-invitation")).to_contain_text("ask an administrator for a new one")
    admin.goto(system.url + "/users/")
    expect(admin.locator("#people")).to_contain_text("dana")


def test_cancel_asks_first_then_run_again_and_compare(system, browser):
    from playwright.sync_api import expect

    job = planned(system, {"iterations": 40})  # long enough to be cancelled mid-run
    system.api(f"/api/jobs/{job['id']}/launch/", {})
    reached(system, job["id"], 1)
    page = logged_in(browser, system)
    page.goto(system.url + f"/jobs/{job['id']}/live/")
    expect(page.locator("#job-progress-bar")).to_be_visible()
    asked = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    page.click("#cancel-form button")
    assert asked and f"Cancel job {job['id']}?" in asked[0], asked
    assert system.api(f"/api/jobs/{job['id']}/")["status"] in ("running", "recovering")  # not without a yes
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#cancel-form button")
    expect(page.locator("#job-status")).to_have_text("cancelled", timeout=60_000)
    expect(page.locator("#model-link")).to_be_hidden()  # a cancelled job has no trained model to offer
    ended(system, job["id"])

    page.click(".when-finished button:has-text('Run again')")
    page.wait_for_url("**/jobs/*/")
    again = int(page.url.rstrip("/").rsplit("/", 1)[1])
    assert again != job["id"]
    expect(page.locator("#launch")).to_be_visible(timeout=120_000)  # planned afresh on today's devices
    page.click("#launch")
    page.wait_for_url("**/live/")

    def moved():
        j = system.api(f"/api/jobs/{again}/")
        return j if j["finished_at"] or (j["latest"].get("iteration") or 0) >= 1 else None

    progressed = system.wait("iteration 2 of the new run, or its end", moved, 240)
    assert not progressed["finished_at"], progressed["message"] + "\n" + system.tail()
    expect(page.locator("#job-progress")).to_contain_text("/ 40", timeout=60_000)
    system.api(f"/api/jobs/{again}/cancel/", {})  # two iterations are enough to compare
    ended(system, again)

    page.goto(system.url + "/jobs/")
    for number in (job["id"], again):
        page.check(f'input[name=jobs][value="{number}"]')
    page.click("#compare")
    page.wait_for_url("**/jobs/compare/**")
    expect(page.locator("#compared thead th")).to_have_count(3)
    expect(page.locator("#compared tbody tr").first).to_contain_text("Cancelled")
    expect(page.locator("#compared")).to_contain_text("mobilenetv2 (synthetic)")
    for fig in ("fig-compare-throughput", "fig-compare-loss"):
        expect(page.locator(f'[data-figure-id="{fig}"] .main-svg').first).to_be_attached()
    if SHOTS:
        page.screenshot(path=str(SHOTS / "compare.png"), full_page=True)
    assert not page.errors, page.errors


def test_a_staff_registered_model_trains_from_the_job_form_and_comes_back_in_its_own_keys(system, browser):
    """Issue 53: staff register a lab's module file, a user's job trains it from the form, and the trained model
    the site offers loads into the lab's own module with strict=True."""
    import io

    import torch
    from playwright.sync_api import expect

    from tests.engine.test_user_models import users

    page = logged_in(browser, system)
    page.goto(system.url + "/models/")
    page.fill("#id_name", "lab-unet")
    page.fill("#id_source", f"{ROOT}/tests/engine/usermodels.py:unet")
    page.fill("#id_input_shape", "3,16,16")
    page.click("main form[action='/models/add/'] button[type=submit]")
    expect(page.locator("#lab-models")).to_contain_text("lab-unet", timeout=60_000)
    page.goto(system.url + "/jobs/new/")
    page.select_option("#id_model", "lab-unet")
    page.fill("#id_batch_size", "16")
    page.fill("#id_iterations", "4")
    page.click("#job-form button[type=submit]")
    expect(page.locator("#launch")).to_be_visible(timeout=120_000)  # the page reloads once planned
    expect(page.locator("h1")).to_contain_text("lab-unet")
    expect(page.locator("#lab-layers")).to_contain_text("6 layers of lab-unet")
    page.click("#launch")
    page.wait_for_url("**/live/")
    job_id = int(page.url.rstrip("/").split("/")[-2])
    final = ended(system, job_id)
    assert final["status"] == "completed", final["message"] + "\n" + system.tail()
    expect(page.locator("#download-model")).to_be_visible(timeout=60_000)
    body = page.request.get(system.url + f"/jobs/{job_id}/model.pt").body()
    users("unet")().load_state_dict(torch.load(io.BytesIO(body), weights_only=True), strict=True)
    assert not page.errors, page.errors
