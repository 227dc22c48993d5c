"""Enrollment: exchange the one-time token for a device credential (and, over TLS, a board certificate for the
key made here), and keep them in a private state file with the site's pinned CA."""

from __future__ import annotations

import hashlib
import json
import os
import ssl
import time
import urllib.error
from dataclasses import asdict, dataclass, field, replace
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
    ca: str = ""  # the site's CA bundle (PEM), trusted because it matched the pin of the Add device line
    certificate: str = ""  # this board's certificate (PEM), signed by the site's CA at enrollment
    key: str = ""  # its private key (PEM), made on this board; never sent

    def tls(self, site: Site) -> Site:
        """`site` speaking TLS as this board: trusting only the pinned CA, showing the board's certificate
        (unchanged for an http site; the system's CAs for an https one enrolled without a pin)."""
        if not site.https or not self.ca:
            return site
        from engine.tls import client_context  # (cryptography: the agent checks its packages first)

        cert, key = (self.certificate.encode(), self.key.encode()) if self.certificate else (None, None)
        return replace(site, tls=client_context(self.ca.encode(), cert, key))

    def to_dict(self) -> dict:
        return asdict(self)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


ENROLL_TRIES = 5


def default_state_path(site: Site) -> Path:
    """~/.config/asteroid/agent-<host>-<port>.json: one credential per site."""
    return Path.home() / ".config" / "asteroid" / f"agent-{site.host}-{site.port}.json"


def pinned_ca(site: Site, pin: str) -> bytes:
    """The site's CA bundle, fetched and kept only if it matches `pin` (kubeadm's discovery hash); UserError else."""
    from engine.tls import fingerprint, matches

    try:
        bundle = site.fetch_ca()
    except HttpError as exc:
        if exc.status == 404:
            raise UserError(f"{site.url} serves no CA to pin ({exc.message}): drop --ca, or check --server") from None
        raise UserError(f"cannot read the CA of {site.url}: HTTP {exc.status} {exc.message}") from None
    except OSError as exc:
        raise UserError(f"cannot reach the server at {site.url}: {getattr(exc, 'reason', exc)}") from None
    if not matches(bundle, pin):
        raise UserError(
            f"the CA {site.url} shows ({fingerprint(bundle)}) is not the one --ca pins: something between this board "
            "and the site may be posing as it, or the pin is mistyped; nothing was sent (copy the Add device line "
            "again)"
        )
    return bundle


def enroll(site: Site, token: str, tries: int = ENROLL_TRIES, ca: bytes = b"") -> State:
    """POST the enrollment token (over https with a certificate request for a key made here); the device
    credential (and certificate) the site gives back. Every failure is one UserError line. A site that is starting
    or briefly failing (unreachable, HTTP 5xx) is asked again with growing pauses."""
    body, key = {"token": token}, b""
    if site.https:
        from engine.tls import make_csr

        key, csr = make_csr()
        body["csr"] = csr.decode("ascii")
    for attempt in range(1, tries + 1):
        try:
            reply = site.post_json(ENROLL_PATH, body)
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
            if isinstance(exc.reason, ssl.SSLCertVerificationError):  # asking again does not help
                why = exc.reason.verify_message
                raise UserError(
                    f"the server at {site.url} shows a certificate its pinned CA did not sign ({why}): "
                    "something between this board and the site may be posing as it; the token was not sent"
                ) from None
            problem = f"cannot reach the server at {site.url}: {exc.reason}"
        except OSError as exc:  # timeouts, resets
            problem = f"cannot reach the server at {site.url}: {exc}"
        if attempt == tries:
            raise UserError(problem)
        time.sleep(min(2 ** (attempt - 1), 8))  # 1, 2, 4, 8 s: long enough for a site to finish starting
    credential, device = reply.get("credential"), reply.get("device")
    if not isinstance(credential, str) or not credential or not isinstance(device, dict):
        raise UserError(f"{site.url} is not an Asteroid site: its enrollment reply has no credential and device")
    certificate = reply.get("certificate") if isinstance(reply.get("certificate"), str) else ""
    return State(site.url, credential, device, token_digest(token), ca.decode("ascii"), certificate,
                 key.decode("ascii") if certificate else "")  # fmt: skip


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
    pems = [doc.get(k) if isinstance(doc.get(k), str) else "" for k in ("ca", "certificate", "key")]
    return State(doc["server"], doc["credential"], device, str(doc.get("enrolled_with", "")), *pems)


def obtain(site: Site, token: str | None, path: Path, pin: str = "") -> State:
    """The credential for `site`: enroll with `token` (saving it), or reuse the state file's. With `pin` (the Add
    device line's CA=) the site's CA is fetched and checked against it before the token is sent.

    A token already spent by this state file is not sent again (it is single use): running the pasted
    command line twice, or from a boot script, keeps working.
    """
    from engine.tls import client_context, matches

    state = load_state(path)
    known = state if state is not None and state.server == site.url else None
    if pin and not site.https:
        raise UserError(f"--ca pins the CA of an https site, and --server {site.url} is http: use https://")
    if known is not None and pin and known.ca and not matches(known.ca.encode(), pin):
        known = None if token else known  # the site's CA changed (it was set up again): enroll anew with the token
        if known is not None:
            raise UserError(f"the state file {path} trusts another CA than --ca pins: pass --token to enroll again")
    if token:
        if known is not None and known.enrolled_with == token_digest(token):
            return known
        ca = pinned_ca(site, pin) if pin else b""
        trusting = replace(site, tls=client_context(ca)) if ca else site
        state = enroll(trusting, token, ca=ca)
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
