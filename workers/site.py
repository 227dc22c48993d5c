"""Where the site is: its HTTP API and agent socket addresses from the --server URL, and JSON/bytes POSTs to it."""

from __future__ import annotations

import http.client
import ipaddress
import json
import ssl
import unicodedata
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

from engine.errors import UserError

HTTP_TIMEOUT_S = 30.0
CA_PATH = "/api/agent/ca/"


class HttpError(Exception):
    """The site answered with an error status; `message` is its one-line `error` when it gave one."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class NotHttp(OSError):
    """What answered at the site's address does not speak HTTP (another service on that port, a garbled reply):
    asking again does not help. An OSError, so every caller that handles an unreachable site handles it too."""


@dataclass(frozen=True)
class Site:
    """The site's base URL (http or https, maybe with a path prefix), the agent socket's URL, and for https the
    TLS the agent speaks there (the pinned CA bundle and the board's certificate: engine/tls.py; None: the
    system's trusted CAs)."""

    url: str
    socket_url: str
    tls: ssl.SSLContext | None = field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, url: str) -> Site:
        """A Site from the --server URL; the socket is the same host's `/ws/agent/` (ws for http, wss for https)."""
        parts = _split(url)
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
            raise UserError(f"--server must be an http(s) URL like http://HOST:8000, got {url!r}")
        netloc = _ascii_netloc(parts)
        if netloc is None:
            raise UserError(
                f"--server {url!r} is not a valid server URL: {parts.hostname!r} is not a host name or address"
            )
        path = quote(parts.path.rstrip("/"), safe="/%:@!$&'()*+,;=~")  # HTTP request lines are ASCII
        base = f"{parts.scheme}://{netloc}{path}"
        scheme = "wss" if parts.scheme == "https" else "ws"
        return cls(base, f"{scheme}://{netloc}{path}/ws/agent/")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    def post(self, path: str, body: bytes, content_type: str, credential: str | None = None) -> dict:
        """POST to `{url}{path}`; the JSON reply (empty dict for none). Raises HttpError for an error status
        and OSError (URLError, timeouts) when the site cannot be reached."""
        return self.send("POST", path, body, content_type, credential)

    def send(self, method: str, path: str, body: bytes, content_type: str, credential: str | None = None) -> dict:
        """`post` with another method (DELETE)."""
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        if credential:
            headers["Authorization"] = f"Bearer {credential}"
        request = urllib.request.Request(self.url + path, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S, context=self.tls) as reply:
                text = reply.read()
        except urllib.error.HTTPError as exc:
            raise HttpError(exc.code, error_message(exc)) from None
        except (http.client.HTTPException, ValueError) as exc:  # BadStatusLine, IncompleteRead, a bad header ...
            if isinstance(exc, OSError):  # RemoteDisconnected: a reset, retried like any
                raise
            raise NotHttp(f"no HTTP answer ({type(exc).__name__}: {_short(exc)})") from None
        if not text.strip():
            return {}
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            raise HttpError(200, f"the reply to {path} is not JSON") from None
        if not isinstance(doc, dict):
            raise HttpError(200, f"the reply to {path} is not a JSON object")
        return doc

    def post_json(self, path: str, doc: dict, credential: str | None = None) -> dict:
        return self.post(path, json.dumps(doc).encode(), "application/json", credential)

    @property
    def https(self) -> bool:
        return self.url.startswith("https://")

    def fetch_ca(self) -> bytes:
        """The CA bundle the site serves (GET /api/agent/ca/), read WITHOUT checking the site's certificate: the
        caller trusts it only if it matches the pin it was given."""
        unchecked = ssl.create_default_context()
        unchecked.check_hostname, unchecked.verify_mode = False, ssl.CERT_NONE
        request = urllib.request.Request(self.url + CA_PATH, headers={"Accept": "application/x-pem-file"})
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S, context=unchecked) as reply:
                return reply.read(1 << 20)
        except urllib.error.HTTPError as exc:
            raise HttpError(exc.code, error_message(exc)) from None


def _split(url: str):
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number or out of range
    except ValueError:
        return None
    return parts


def _ascii_netloc(parts) -> str | None:
    """The URL's [user@]host[:port] as it goes on the wire (an internationalized name in its IDNA form); None for
    a host no resolver takes: a character other than letters, digits, '-', '.', '_' (an emoji, a space), or a
    label of more than 63 characters."""
    host = parts.hostname
    try:
        ipaddress.ip_address(host)
        return parts.netloc
    except ValueError:
        pass
    if not all(c in "-._" or unicodedata.category(c)[0] in "LNM" for c in host):
        return None
    try:
        wire = host.encode("idna").decode("ascii")
    except UnicodeError:
        return None
    if host.isascii():
        return parts.netloc  # as given, its case included (the state file names the site by this URL)
    if "@" in parts.netloc:
        return None  # credentials in a URL are not how the site is reached; not worth rewriting
    return wire if parts.port is None else f"{wire}:{parts.port}"


def _short(exc: Exception) -> str:
    text = str(exc).strip() or "no details"
    return text if len(text) <= 80 else text[:77] + "..."


def error_message(exc: urllib.error.HTTPError) -> str:
    """The site's `{"error": "one line"}`, else the HTTP reason."""
    try:
        doc = json.loads(exc.read())
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            return doc["error"]
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return str(exc.reason)
