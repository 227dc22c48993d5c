"""Enrollment: exchange the one-time token for a device credential, and keep it in a private state file."""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.error
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.errors import UserError
from workers.site import HttpError, NotHttp, Site

ENROLL_PATH = "/api/agent/enroll/"


@dataclass(frozen=True)
class State:
    """What the agent keeps between runs: the site, the device credential, and the device the site made."""

    server: str
    credential: str
    device: dict = field(default_factory=dict)
    enrolled_with: str = ""  # sha256 of the enrollment token spent, so re-running the pasted command is harmless

    def to_dict(self) -> dict:
        return asdict(self)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


ENROLL_TRIES = 5


def default_state_path(site: Site) -> Path:
    """~/.config/asteroid/agent-<host>-<port>.json: one credential per site."""
    return Path.home() / ".config" / "asteroid" / f"agent-{site.host}-{site.port}.json"


def enroll(site: Site, token: str, tries: int = ENROLL_TRIES) -> State:
    """POST the enrollment token; the device credential the site gives back. Every failure is one UserError line.
    A site that is starting or briefly failing (unreachable, HTTP 5xx) is asked again with growing pauses."""
    for attempt in range(1, tries + 1):
        try:
            reply = site.post_json(ENROLL_PATH, {"token": token})
            break
        except HttpError as exc:
            if exc.status == 400:  # not about the token: the site says what (e.g. it does not answer to this host)
                raise UserError(f"the server at {site.url} refused the enrollment request: {exc.message}") from None
            if exc.status == 404:  # the site answers, but not here: --server names a path, or is not the site
                raise UserError(
                    f"{site.url} has no enrollment endpoint ({exc.message}): give --server the site's own address, "
                    "http://HOST:PORT without a path, as the site's Add device page shows it"
                ) from None
            if exc.status in (401, 403):
                raise UserError(
                    f"the server refused the enrollment token ({exc.message}): it is wrong or already used; "
                    "get a new one from the site's Devices page"
                ) from None
            problem = f"enrollment at {site.url} failed: HTTP {exc.status} {exc.message}"
        except NotHttp as exc:  # another service answers there: asking again does not help
            raise UserError(
                f"cannot reach the server at {site.url}: {exc}; is --server the site's address and port?"
            ) from None
        except urllib.error.URLError as exc:
            problem = f"cannot reach the server at {site.url}: {exc.reason}"
        except OSError as exc:  # timeouts, resets
            problem = f"cannot reach the server at {site.url}: {exc}"
        if attempt == tries:
            raise UserError(problem)
        time.sleep(min(2 ** (attempt - 1), 8))  # 1, 2, 4, 8 s: long enough for a site to finish starting
    credential, device = reply.get("credential"), reply.get("device")
    if not isinstance(credential, str) or not credential or not isinstance(device, dict):
        raise UserError(f"{site.url} is not an Asteroid site: its enrollment reply has no credential and device")
    return State(site.url, credential, device, token_digest(token))


def save_state(path: Path, state: State) -> None:
    """Write the state file readable by its owner only (it holds a credential), replacing any old one atomically."""
    path = Path(path).expanduser()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            os.fchmod(handle.fileno(), 0o600)  # the umask can only narrow the mode; an existing file keeps its own
            json.dump(state.to_dict(), handle, indent=2)
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"cannot write the state file {path}: {exc.strerror or exc}") from None


def load_state(path: Path) -> State | None:
    """The saved state, or None when there is no state file."""
    path = Path(path).expanduser()
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"cannot read the state file {path} ({exc}): delete it and enroll again with --token") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("server"), str) and isinstance(doc.get("credential"), str)):
        raise UserError(f"the state file {path} is not an agent state file: delete it and enroll again with --token")
    device = doc.get("device") if isinstance(doc.get("device"), dict) else {}
    return State(doc["server"], doc["credential"], device, str(doc.get("enrolled_with", "")))


def obtain(site: Site, token: str | None, path: Path) -> State:
    """The credential for `site`: enroll with `token` (saving it), or reuse the state file's.

    A token already spent by this state file is not sent again (it is single use): running the pasted
    command line twice, or from a boot script, keeps working.
    """
    state = load_state(path)
    known = state if state is not None and state.server == site.url else None
    if token:
        if known is not None and known.enrolled_with == token_digest(token):
            return known
        state = enroll(site, token)
        save_state(path, state)
        return state
    if known is None:
        if state is None:
            raise UserError(f"no credential for {site.url} (no state file {path}): pass --token ENROLLMENT_TOKEN "
                            "from the site's Devices page")  # fmt: skip
        raise UserError(
            f"no credential for {site.url} ({path} is for {state.server}): if the site moved, pass --token "
            f"ENROLLMENT_TOKEN from its Devices page; or run with --server {state.server} for the old address"
        )
    return known
