"""daphne serving HTTPS and wss on the launcher's listening socket: `python -m webapp.tlsdaphne --fd N CERT KEY`.

The launcher (webapp/startsite.py) runs this instead of `python -m daphne --fd N` when the site serves TLS. It
registers the `asteroid-tls:` endpoint (webapp/twistedplugins/asteroid_tls.py) with Twisted and hands daphne an
endpoint string for it; everything else is daphne's own command line.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    fd, cert, key, *rest = argv
    import twisted.plugins

    twisted.plugins.__path__.append(str(Path(__file__).parent / "twistedplugins"))
    from daphne.cli import CommandLineInterface

    endpoint = f"asteroid-tls:fileno={fd}:cert={_escape(cert)}:key={_escape(key)}"
    CommandLineInterface().run(["-e", endpoint, *rest])


def _escape(path: str) -> str:
    """A path inside a Twisted endpoint string (where ':' and '=' separate fields)."""
    return path.replace("\\", "\\\\").replace(":", "\\:").replace("=", "\\=")


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "--fd":
        sys.exit("usage: python -m webapp.tlsdaphne --fd N CERT KEY [daphne options] APPLICATION")
    main(sys.argv[2:])
