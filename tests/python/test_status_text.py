"""`sublet status` as people read it, on a terminal, whatever the daemon says (issue 25, items
11 and 14). A loan's name is anyone's choice: control characters in it (an escape sequence, a
newline that forges a line, a bidirectional override) must show as escapes, never reach the
terminal raw. A time the daemon's JSON had to leave null (status_json.c) prints as unknown."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import unicodedata

import pytest

from conftest import CHILD_ENV
from test_status_prometheus import daemon  # noqa: F401 (the fixture: a subletd of the test's own)

pytestmark = pytest.mark.daemon

EVIL = "kv\x1b[2J\x1b]0;owned\x07\nGPU 9: forged\u202etxt.exe\\x1b \x85\u2028 é 🙂"
SHOWN = "kv\\x1b[2J\\x1b]0;owned\\x07\\nGPU 9: forged\\u202etxt.exe\\\\x1b \\x85\\u2028 é 🙂"
# What subletd lets through in a name (no C0, DEL or C1: EVIL is refused) still acts on a
# terminal: bidirectional overrides and the line separator. `sublet status` escapes them.
NAME = "kv\u202etxt.exe\\x1b \u2028 é 🙂"
NAME_SHOWN = "kv\\u202etxt.exe\\\\x1b \\u2028 é 🙂"
BIDI = set("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def sublet_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sublet", "status", *args], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, **CHILD_ENV))


def raw_controls(text: str) -> list[str]:
    """The characters of text that act on a terminal, but for the newlines between lines."""
    return [c for c in text if c != "\n" and (unicodedata.category(c) in ("Cc", "Zl", "Zp")
                                              or c in BIDI)]


@pytest.fixture
def offer(daemon):  # noqa: F811 (the fixture imported above)
    """A loan on offer at the daemon, named NAME."""
    from sublet import _lib
    client = _lib.Client.open(daemon)
    region = client.region_create(client.get_info().page_size)
    loan_id, _ = client.lend(region, None, NAME)
    yield daemon, client, loan_id
    client.withdraw(loan_id)
    client.close()


def test_control_characters_in_a_name_are_refused_and_the_rest_escaped(offer):
    import sublet
    sock, client, loan_id = offer
    region = client.region_create(client.get_info().page_size)
    with pytest.raises(sublet.InvalidArgumentError, match="1 to 63 bytes"):
        client.lend(region, None, EVIL)  # escape sequences, a newline forging a GPU line
    r = sublet_status("--socket", sock)
    assert r.returncode == 0, r.stderr
    assert raw_controls(r.stdout) == [], r.stdout
    assert f'  loan {loan_id} "{NAME_SHOWN}": offered' in r.stdout
    as_json = sublet_status("--json", "--socket", sock)  # JSON escapes them itself
    assert as_json.returncode == 0 and raw_controls(as_json.stdout) == []


def test_shown_escapes_and_leaves_the_rest():
    from sublet._status import shown
    assert shown(EVIL) == SHOWN
    assert shown("kv-cache é 🙂 \u200d") == "kv-cache é 🙂 \u200d"  # a joiner acts on no terminal
    assert shown(42) == "42"


def test_times_json_left_null_print_as_unknown(offer):
    """Times the daemon sent that JSON could not hold come as null: the text says so, and
    Prometheus reads NaN."""
    from sublet import _status
    sock, client, _ = offer
    s = dict(client.status(), socket=sock)
    s["uptime_seconds"] = None
    s["loan"] = dict(s["loan"], copy_out_seconds=None)
    text = _status.text_status(s)
    assert "up an unknown time" in text and "to the host in ? s" in text
    metrics = _status.prometheus([s], [])
    assert any(line.startswith("sublet_uptime_seconds{") and line.endswith(" NaN")
               for line in metrics.splitlines())


def test_help_names_every_exit_status():
    """`sublet --help` lists each exit status the command has (sublet/_status.py's EXIT_*)."""
    from sublet import _status
    codes = sorted(v for k, v in vars(_status).items() if k.startswith("EXIT_"))
    assert codes == list(range(6))
    out = subprocess.run([sys.executable, "-m", "sublet", "--help"], capture_output=True,
                         text=True, env=dict(os.environ, **CHILD_ENV), timeout=60)
    assert out.returncode == 0, out.stderr
    epilog = " ".join(out.stdout.split("exit status:", 1)[1].split())
    for code in codes:
        assert f" {code} " in f" {epilog} ", (code, epilog)
    assert "5 no daemon answered and one at least refused this user" in epilog



def test_a_borrow_waiting_for_an_offer_is_counted(daemon):  # noqa: F811
    """Status.borrows_waiting: a Borrow parked in the daemon until an offer comes is counted,
    shown in the text and given to monitoring; no longer once it is given up."""
    import threading
    from sublet import _lib, _status
    waiter, watcher = _lib.Client.open(daemon), _lib.Client.open(daemon)
    outcome: list[BaseException | None] = []

    def borrow() -> None:
        try:
            waiter.borrow(name="none-yet", timeout_ms=60000)
            outcome.append(None)
        except _lib.SubletError as e:
            outcome.append(e)

    thread = threading.Thread(target=borrow)
    thread.start()
    try:
        deadline = time.monotonic() + 30  # it parks once the daemon has read it
        while watcher.status()["borrows_waiting"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        s = dict(watcher.status(), socket=daemon)
        assert s["borrows_waiting"] == 1
        assert "  waiting  1 borrows wait for an offer" in _status.text_status(s)
        assert any(line.startswith("sublet_borrows_waiting{") and line.endswith(" 1")
                   for line in _status.prometheus([s], []).splitlines())
    finally:
        waiter.cancel()
        thread.join(timeout=60)
    assert len(outcome) == 1 and outcome[0] is not None       # given up, nothing borrowed
    assert watcher.status()["borrows_waiting"] == 0
    assert "borrows wait" not in _status.text_status(dict(watcher.status(), socket=daemon))
    waiter.close()
    watcher.close()
