"""The site's HTTP API as the benchmark uses it: a token, the benchmark's device and its enrollment, job status."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from workers.site import error_message
from workers.sitebench import DEVICE_KIND, HTTP_TIMEOUT_S, TOKEN_TIMEOUT_S, BenchError

ROOT = Path(__file__).resolve().parents[2]  # the checkout, where manage.py is


class Api:
    """JSON over HTTP with `Authorization: Bearer TOKEN`; every failure is a BenchError line."""

    def __init__(self, base: str, token: str):
        self.base, self.token = base, token

    def call(self, method: str, path: str, doc: dict | None = None, ok: tuple[int, ...] = ()) -> tuple[int, dict]:
        body = json.dumps(doc).encode() if doc is not None else (b"" if method == "POST" else None)
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.base + path, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
                return reply.status, _json_object(reply.read(), path)
        except urllib.error.HTTPError as exc:
            message = error_message(exc)
            if exc.code in ok:
                return exc.code, {"error": message}
            if exc.code == 401:
                raise BenchError(f"the site refused the API token ({message})") from None
            raise BenchError(f"{method} {path}: HTTP {exc.code}: {message}") from None
        except urllib.error.URLError as exc:
            raise BenchError(f"cannot reach the site at {self.base}: {exc.reason}") from None
        except OSError as exc:
            raise BenchError(f"cannot reach the site at {self.base}: {exc}") from None

    def get(self, path: str) -> dict:
        return self.call("GET", path)[1]

    def post(self, path: str, doc: dict | None = None) -> dict:
        return self.call("POST", path, doc)[1]


def _json_object(text: bytes, path: str) -> dict:
    try:
        doc = json.loads(text) if text.strip() else {}
    except (ValueError, UnicodeDecodeError):
        raise BenchError(f"the reply to {path} is not JSON: is this an Asteroid site?") from None
    if not isinstance(doc, dict):
        raise BenchError(f"the reply to {path} is not a JSON object: is this an Asteroid site?")
    return doc


def socket_url(base: str, path: str) -> str:
    """The WebSocket URL of `path` on the site at `base`."""
    parts = urlsplit(base)
    scheme = "wss" if parts.scheme == "https" else "ws"
    return f"{scheme}://{parts.netloc}{parts.path}{path}"


def create_token(user: str, env: dict | None = None) -> str:
    """A new API token from `manage.py createtoken USER` (its last line), run with `env` (default: this process's
    environment)."""
    command = [sys.executable, "manage.py", "createtoken", user, "--name", "bench"]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TOKEN_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise BenchError(f"manage.py createtoken {user} took over {TOKEN_TIMEOUT_S:.0f} s; pass --token") from None
    except OSError as exc:
        raise BenchError(f"cannot run manage.py createtoken: {exc}") from None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        why = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        raise BenchError(f"manage.py createtoken {user} failed: {why[-1] if why else f'exit {done.returncode}'}")
    return lines[-1]


def enrollment(api: Api, name: str) -> tuple[dict, str]:
    """The benchmark's device and a fresh enrollment token: registered now, or re-issued for an existing one."""
    devices = api.get("/api/devices/").get("devices", [])
    device = next((d for d in devices if isinstance(d, dict) and d.get("name") == name), None)
    if device is None:
        status, reply = api.call("POST", "/api/devices/", {"name": name, "kind": DEVICE_KIND}, ok=(403,))
    else:
        if device.get("status") == "disabled":
            raise BenchError(f"device {name} is disabled; enable it on the Devices page or pass --device OTHER")
        if device.get("job"):
            raise BenchError(f"device {name} is busy with job {device['job']}; cancel it or pass --device OTHER")
        status, reply = api.call("POST", f"/api/devices/{device['id']}/token/", ok=(403,))
    if status == 403:
        raise BenchError(f"the API token's user may not add or enroll devices ({reply['error']}); use a staff account")
    token = reply.get("enrollment_token")
    if not isinstance(token, str) or not token:
        raise BenchError("the site gave no enrollment token: is this an Asteroid site?")
    return reply.get("device") or {}, token


async def wait_for_status(api: Api, job_id: int, wanted: str, timeout: float) -> dict:
    """The job once its status is `wanted`; a BenchError when it ends otherwise or takes over `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        job = await asyncio.to_thread(api.get, f"/api/jobs/{job_id}/")
        status = job.get("status")
        if status == wanted:
            return job
        if status in ("failed", "cancelled", "completed"):
            raise BenchError(f"job {job_id} is {status}: {job.get('message') or 'no reason given'}")
        if time.monotonic() > deadline:
            raise BenchError(f"job {job_id} is still {status} after {timeout:.0f} s ({job.get('message')})")
        await asyncio.sleep(0.25)
