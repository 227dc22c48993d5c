"""static/js/live.js run in node over a stub page: the stubs every such test needs, and the run itself."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

LIVE_JS = Path(__file__).resolve().parents[2] / "static/js/live.js"

# After the test's page (it defines `page`, id -> stub element, and `window`, with any Plotly stub) and before
# live.js: a document over `page`, a location, timers kept in `timers`, and sockets the test drives (`sockets`;
# `send(msg)` hands the first one a message).
STUBS = r"""
const fs = require('fs');
const sockets = [], timers = [];
if (window.Plotly) global.Plotly = window.Plotly;
global.document = { readyState: 'complete', getElementById: (id) => page[id] || null, querySelectorAll: () => [],
                    querySelector: () => null };
global.location = { protocol: 'http:', host: '127.0.0.1:8000' };
global.setTimeout = (fn) => timers.push(fn);
global.clearTimeout = () => {};
global.WebSocket = class {
  constructor(url) { this.url = url; this.on = {}; sockets.push(this); }
  addEventListener(kind, fn) { this.on[kind] = fn; }
  close() {}
};
const send = (msg) => sockets[0].on.message({ data: JSON.stringify(msg) });
eval(fs.readFileSync(process.argv[2], 'utf8'));
"""


def run_live_js(tmp_path: Path, page: str, script: str, *args: str):
    """Run `page`, the stubs, live.js and then `script` (its arguments in process.argv[3:]) in node; the JSON the
    script printed. Skips where node is not installed."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    harness = tmp_path / "live_page.js"
    harness.write_text(page + STUBS + script)
    out = subprocess.run([node, str(harness), str(LIVE_JS), *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
