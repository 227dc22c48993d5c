"""This board's link to the LAN, measured: how fast a few MiB reach the site (its upload rate, in Mbps)."""

from __future__ import annotations

import logging
import time

from workers.site import HttpError, Site

log = logging.getLogger(__name__)

PATH = "/api/agent/link/"
FIRST_BYTES = 256 * 1024  # a first send sizes the real one ...
TARGET_S = 0.5  # ... to take about this long on this link ...
MAX_BYTES = 8 * 1024 * 1024  # ... within what the site takes (webapp.devices.api.link_probe)


def measure_link(site: Site, credential: str) -> float | None:
    """Mbps of this board's link towards the site (what its boundary traffic to the other boards goes through, on
    a switched LAN); None when the site cannot take the probe (an older site, an error), said in the log."""
    try:
        seconds = _send(site, credential, FIRST_BYTES)
        size = int(min(MAX_BYTES, max(FIRST_BYTES, FIRST_BYTES * TARGET_S / max(seconds, 1e-4))))
        seconds = _send(site, credential, size)
    except HttpError as exc:
        log.warning("could not measure this board's link to the site (%s): it is planned at the job's bandwidth", exc)
        return None
    except OSError as exc:
        log.warning("could not measure this board's link to the site (%s)", exc)
        return None
    return size * 8 / seconds / 1e6


def _send(site: Site, credential: str, size: int) -> float:
    """Seconds from the first byte sent to the site's answer that all `size` bytes arrived."""
    started = time.monotonic()
    reply = site.post(PATH, bytes(size), "application/octet-stream", credential)
    if reply.get("received") != size:
        raise HttpError(200, f"the site received {reply.get('received')!r} of {size} bytes")
    return time.monotonic() - started
