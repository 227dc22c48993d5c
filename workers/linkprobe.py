"""This board's link to the LAN, measured: how fast a few MiB reach the site (its upload rate, in Mbps)."""

from __future__ import annotations

import logging
import random
import time

from workers.site import HttpError, Site

log = logging.getLogger(__name__)

PATH = "/api/agent/link/"
SLOT_PATH = "/api/agent/link/slot/"  # boards measure one at a time (webapp.devices.api.link_slot)
FIRST_BYTES = 256 * 1024  # a first send sizes the real ones ...
TARGET_S = 0.4  # ... to take about this long each on this link ...
MAX_BYTES = 8 * 1024 * 1024  # ... within what the site takes (webapp.devices.api.link_probe)
SENDS = 2  # timed sends after the first; the fastest of all counts (noise on a link only ever slows a send)
TURN_WAIT_S = 60.0  # how long a board waits for its turn while others measure (each takes about a second)


def measure_link(site: Site, credential: str) -> float | None:
    """Mbps of this board's link towards the site (what its boundary traffic to the other boards goes through, on
    a switched LAN); None when the site cannot take the probe (an older site, an error, no turn), said in the log."""
    try:
        if not _take_turn(site, credential):
            log.warning("no turn to measure this board's link within %.0f s: it is planned at the job's bandwidth",
                        TURN_WAIT_S)  # fmt: skip
            return None
        try:
            seconds = _send(site, credential, FIRST_BYTES)
            best = FIRST_BYTES / seconds
            size = int(min(MAX_BYTES, max(FIRST_BYTES, FIRST_BYTES * TARGET_S / max(seconds, 1e-4))))
            for _ in range(SENDS):
                best = max(best, size / _send(site, credential, size))
        finally:
            _give_back(site, credential)
    except HttpError as exc:
        log.warning("could not measure this board's link to the site (%s): it is planned at the job's bandwidth", exc)
        return None
    except OSError as exc:
        log.warning("could not measure this board's link to the site (%s)", exc)
        return None
    return best * 8 / 1e6


def _take_turn(site: Site, credential: str) -> bool:
    """Whether this board got its turn to measure within TURN_WAIT_S."""
    deadline = time.monotonic() + TURN_WAIT_S
    while True:
        try:
            site.post_json(SLOT_PATH, {}, credential)
            return True
        except HttpError as exc:
            if exc.status != 429:
                raise
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5 + random.random())  # another board is measuring: its turn takes about a second


def _give_back(site: Site, credential: str) -> None:
    try:
        site.send("DELETE", SLOT_PATH, b"", "application/json", credential)
    except (HttpError, OSError) as exc:  # the turn lapses on its own
        log.debug("could not give back the link probe turn: %s", exc)


def _send(site: Site, credential: str, size: int) -> float:
    """Seconds from the first byte sent to the site's answer that all `size` bytes arrived."""
    started = time.monotonic()
    reply = site.post(PATH, bytes(size), "application/octet-stream", credential)
    if reply.get("received") != size:
        raise HttpError(200, f"the site received {reply.get('received')!r} of {size} bytes")
    return time.monotonic() - started
