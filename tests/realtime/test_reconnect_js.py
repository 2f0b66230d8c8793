"""realtime/static/realtime/reconnect.js, the pages' reconnect schedule, run in node: full jitter under
a doubling cap, and a fresh start only when the page says the connection is live. Skipped without node."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

NODE = shutil.which("node")
SCRIPT = Path(__file__).resolve().parents[2] / "realtime" / "static" / "realtime" / "reconnect.js"
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


def run(body: str) -> object:
    """Evaluate `body` (JS statements ending in `return ...;`) with reconnect.js's exports as `r`."""
    program = f"const r = require({json.dumps(str(SCRIPT))});\nconsole.log(JSON.stringify((() => {{ {body} }})()));"
    done = subprocess.run([NODE or "node", "-e", program], capture_output=True, text=True, timeout=30, check=True)
    return json.loads(done.stdout)


def test_the_cap_doubles_from_the_first_wait_up_to_the_most():
    # a random() just under 1 gives (nearly) the cap of each try
    delays = run("const b = r.Backoff(500, 15000, () => 0.9999); "
                 "return Array.from({length: 8}, () => b.next());")
    assert delays == [499, 999, 1999, 3999, 7999, 14998, 14998, 14998]


def test_each_wait_is_anywhere_from_zero_to_its_cap():
    waits = run("const b = r.Backoff(500, 15000); const out = []; "
                "for (let n = 0; n < 4000; n++) { if (n % 8 === 0) b.live(); out.push([n % 8, b.next()]); } "
                "return out;")
    caps = [min(15000, 500 * 2**attempt) for attempt in range(8)]
    assert all(0 <= wait < caps[attempt] for attempt, wait in waits)
    # full jitter: the waits of one try spread over its whole range, not around its cap
    for attempt in (0, 3):
        mine = [wait for n, wait in waits if n == attempt]
        assert min(mine) < caps[attempt] * 0.1 and max(mine) > caps[attempt] * 0.9


def test_it_starts_afresh_only_when_told_the_connection_is_live():
    attempts = run("const b = r.Backoff(500, 15000, () => 0.5); b.next(); b.next(); b.next(); "
                   "const before = b.attempts(); b.live(); return [before, b.attempts(), b.next()];")
    assert attempts == [3, 0, 250]


def test_a_huge_attempt_count_stays_at_the_most():
    assert run("return r.reconnectDelay(5000, 500, 15000, () => 0.9999);") == 14998
