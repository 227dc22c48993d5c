"""Where the site is: its HTTP API and agent socket addresses from the --server URL, and JSON/bytes POSTs to it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from engine.errors import UserError

HTTP_TIMEOUT_S = 30.0


class HttpError(Exception):
    """The site answered with an error status; `message` is its one-line `error` when it gave one."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


@dataclass(frozen=True)
class Site:
    """The site's base URL (http or https, maybe with a path prefix) and the agent socket's URL."""

    url: str
    socket_url: str

    @classmethod
    def parse(cls, url: str) -> Site:
        """A Site from the --server URL; the socket is the same host's `/ws/agent/` (ws for http, wss for https)."""
        parts = _split(url)
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
            raise UserError(f"--server must be an http(s) URL like http://HOST:8000, got {url!r}")
        base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        scheme = "wss" if parts.scheme == "https" else "ws"
        return cls(base, f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}/ws/agent/")

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
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
                text = reply.read()
        except urllib.error.HTTPError as exc:
            raise HttpError(exc.code, error_message(exc)) from None
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


def _split(url: str):
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number or out of range
    except ValueError:
        return None
    return parts


def error_message(exc: urllib.error.HTTPError) -> str:
    """The site's `{"error": "one line"}`, else the HTTP reason."""
    try:
        doc = json.loads(exc.read())
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            return doc["error"]
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return str(exc.reason)
