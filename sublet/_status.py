"""`sublet status`: what each device's subletd is doing, for people, scripts and Prometheus.

It asks every daemon it can find (--socket, else $SUBLET_SOCKET, else the system daemons at
/run/sublet/gpu*.sock and the user's own, started on demand, in $XDG_RUNTIME_DIR/sublet/ or
/tmp/sublet-UID/) for its status (the daemon's Status message, as JSON from
sublet_status_json) and prints it, or writes it to --output FILE atomically (for a node
exporter's textfile collector). It does not import torch: it answers in a blink.

Exit status: 0 when every daemon answered; 1 when some did not (the others are still shown);
2 on a usage error; 3 when no daemon was found at all; 4 on this machine's own trouble; 5
when no daemon answered and one at least refused this user (permission denied).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import unicodedata
from pathlib import Path
from typing import Any

from . import _daemon, _lib
from ._units import human

# EXIT_ERROR: this machine's own trouble (the output cannot be written, libsublet is missing).
EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, EXIT_NONE, EXIT_ERROR = 0, 1, 2, 3, 4
# A daemon answers but may not be asked (its socket's group): not "none found", whose advice
# is to start one, which would put a second daemon on the GPU.
EXIT_DENIED = 5
SYSTEM_SOCKET_DIR = Path("/run/sublet")


def duration(seconds: float | None) -> str:
    if seconds is None:  # a time the daemon sent that JSON cannot hold (status_json.c)
        return "an unknown time"
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    days, h = divmod(hours, 24)
    return f"{days}d {h}h {m:02d}m" if days else f"{h}h {m:02d}m {s:02d}s"


def sockets(explicit: list[str]) -> tuple[list[str], list[str]]:
    """The sockets to ask: (those that must answer, the user's own daemons' sockets, which
    may be left over from a daemon that was killed)."""
    if explicit:
        return explicit, []
    if os.environ.get("SUBLET_SOCKET"):
        return [os.environ["SUBLET_SOCKET"]], []
    system = [str(p) for p in sorted(SYSTEM_SOCKET_DIR.glob("gpu*.sock"))]
    return system, [str(p) for p in _daemon.user_sockets()]


def query(path: str) -> dict[str, Any]:
    """The status of the daemon at `path`; raises SubletError when it cannot be reached."""
    client = _lib.Client.open(path)
    try:
        status = client.status()
    finally:
        client.close()
    status["socket"] = path
    return status


# --------------------------------------------------------------------------- text

# Bidirectional controls: they reorder what follows on the terminal, so a name could make the
# line say what it does not.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                  "\u2066\u2067\u2068\u2069")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    if c in _BIDI or unicodedata.category(c) in ("Cc", "Zl", "Zp"):
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
    return c


def shown(v: object) -> str:
    """Text from the daemon (a loan's name is anyone's choice) as it may go to a terminal: a
    control character would act on it (an escape sequence clears the screen or retitles the
    window; a newline forges a line), so each shows as an escape (\\x1b, \\n, \\u202e), and a
    backslash is doubled so that no name can pass for one."""
    return "".join(_escape(c) for c in str(v))


def seconds_shown(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:.2f}"


def text_loan(loan: dict[str, Any]) -> list[str]:
    name = f' "{shown(loan["name"])}"' if loan["name"] else ""
    ps = loan["page_size"]
    who = (f"borrowed by pid {loan['borrower_pid']} (uid {loan['borrower_uid']})"
           if loan["borrower_pid"] else "waiting for a borrower")
    if loan.get("local"):
        who = f"a local lend of pid {loan['borrower_pid']} (sublet.lend)"
    return [
        f"  loan {loan['id']}{name}: {shown(loan['state'])}, region {loan['region']}, {who}",
        f"    pages    {human(loan['unkept_pages'] * ps)} unkept, "
        f"{human(loan['fresh_pages'] * ps)} free memory, {human(loan['kept_pages'] * ps)} kept",
        f"    served   {human(loan['served_unkept_bytes'])} unkept, "
        f"{human(loan['served_fresh_bytes'])} free memory, {human(loan['served_kept_bytes'])} "
        f"kept; {human(loan['live_bytes'])} held now",
        f"    copied   {human(loan['copied_out_bytes'])} to the host "
        f"in {seconds_shown(loan['copy_out_seconds'])} s; moved {human(loan.get('moved_bytes', 0))} on "
        f"the GPU",
    ]


def pin_shown(pin: dict[str, Any] | None) -> str:
    """The pin ahead of the save area in progress (a Lend's kept bytes), if one runs."""
    if not pin:
        return ""
    return f" (pinning ahead: {human(pin['done_bytes'])} of {human(pin['target_bytes'])})"


def text_status(s: dict[str, Any]) -> str:
    t = s["totals"]
    lines = [
        f"GPU {s['device_ordinal']}: {shown(s['device_name'])} ({shown(s['device_uuid'])})",
        f"  daemon   subletd {shown(s['daemon_version'])}, {shown(s['backend'])} backend, "
        f"up {duration(s['uptime_seconds'])}, {s['clients']} clients, {shown(s['socket'])}",
        f"  memory   {human(s['total_bytes'])} total, {human(s['free_bytes'])} free, "
        f"pages of {human(s['page_size'])}, {human(s['host_bytes'])} pinned on the host"
        + pin_shown(s.get("pin")),
        f"  regions  {len(s['regions'])}",
    ]
    for r in s["regions"]:
        lent = f", lent (loan {r['loan']})" if r["loan"] else ""
        if r.get("released_bytes"):
            lent += f", {human(r['released_bytes'])} released to the driver"
        lines.append(f"    region {r['id']}: {human(r['bytes'])} ({r['pages']} pages), "
                     f"owner pid {r['owner_pid']} (uid {r['owner_uid']}){lent}")
    for h in s.get("held", []):  # gone, but a borrower that kept its window has not let go
        lines.append(f"    region {h['region']}: {human(h['bytes'])} released, still held by "
                     f"pid {h['holder_pid']} (uid {h['holder_uid']}), which kept its window")
    lines += text_loan(s["loan"]) if s["loan"] else ["  loan     none"]
    for r in s.get("releases", []):
        more = r.get("need_increments") or 0  # needs after the first (Release.need)
        after = f", {more} more need{'s' if more > 1 else ''} since" if more else ""
        need = (f" by need of {human(r['need_bytes'])} ({human(r['free_bytes'])} free before"
                f"{after})" if r.get("need_bytes") is not None else "")
        lines.append(f"  release  {r['id']} of region {r['region']}{need}: {shown(r['state'])}, "
                     f"{human(r['released_bytes'])} given back to the driver, "
                     f"{human(r['stayed_bytes'])} stayed holding {human(r['kept_bytes'])} kept "
                     f"({human(r['moved_bytes'])} moved there, "
                     f"{human(r['copied_out_bytes'])} on the host)")
    for o in s.get("release_offers", []):  # releases a scheduler starts and ends
        name = f" \"{shown(o['name'])}\"" if o.get("name") else ""
        by_need = (f" for a need of {human(o['need_bytes'])}"  # take(need=), Taken.need
                   if o.get("need_bytes") is not None else "")
        taker = (f", taken by pid {o['taker_pid']} (uid {o['taker_uid']}){by_need}"
                 if o["taker_pid"] else "")
        released = (f", {human(o['released_bytes'])} given back to the driver"
                    if o["released_bytes"] else "")
        trouble = f"; resume fails: {shown(o['trouble'])}" if o.get("trouble") else ""
        lines.append(f"  offer    {o['id']}{name} (release) of region {o['region']}, owner pid "
                     f"{o['owner_pid']}: {shown(o['state'])}{taker}{released}{trouble}")
    for r in s.get("retained", []):
        lines.append(f"  retained {human(r['bytes'])} of old pages by pid {r['pid']} "
                     f"(uid {r['uid']}): replaced at the end of its loan, counted until it "
                     f"disconnects")
    if s.get("lends_waiting"):
        lines.append(f"  waiting  {s['lends_waiting']} lends wait for the device, in line")
    if s.get("borrows_waiting"):
        lines.append(f"  waiting  {s['borrows_waiting']} borrows wait for an offer")
    lines.append(f"  totals   {t['loans_ended']} loans ended, {t['borrowers_died']} borrowers "
                 f"died, {human(t['copied_out_bytes'])} copied out and "
                 f"{human(t['copied_in_bytes'])} back")
    return "\n".join(lines)


# --------------------------------------------------------------------------- Prometheus

# The text exposition format, version 0.0.4 (what a node exporter's textfile collector reads).
# Per daemon, labelled by device and uuid; sublet_up is labelled by socket, the one thing known
# of a daemon that did not answer. tests/python/test_status_prometheus.py checks the output with
# `promtool check metrics` and with the format's rules.
METRICS = [  # name, type, help, value from a status
    ("sublet_uptime_seconds", "gauge", "seconds since the daemon started",
     lambda s: s["uptime_seconds"]),
    ("sublet_memory_total_bytes", "gauge", "device memory", lambda s: s["total_bytes"]),
    ("sublet_memory_free_bytes", "gauge", "free device memory", lambda s: s["free_bytes"]),
    ("sublet_host_pinned_bytes", "gauge", "pinned host memory held for kept bytes",
     lambda s: s["host_bytes"]),
    ("sublet_clients", "gauge", "connected clients", lambda s: s["clients"]),
    ("sublet_lends_waiting", "gauge", "lends waiting for the device",
     lambda s: s.get("lends_waiting", 0)),
    ("sublet_borrows_waiting", "gauge", "borrows waiting for an offer",
     lambda s: s.get("borrows_waiting", 0)),
    ("sublet_regions", "gauge", "regions", lambda s: len(s["regions"])),
    ("sublet_retained_bytes", "gauge", "old pages borrowers of other users may still hold",
     lambda s: sum(r["bytes"] for r in s.get("retained", []))),
    ("sublet_held_bytes", "gauge", "bytes of released regions a borrower still holds",
     lambda s: sum(h["bytes"] for h in {h["region"]: h for h in s.get("held", [])}.values())),
    ("sublet_released_bytes", "gauge", "region bytes released to the driver (live releases)",
     lambda s: sum(r["released_bytes"] for r in s.get("releases", []))),
    ("sublet_region_bytes", "gauge", "bytes in regions",
     lambda s: sum(r["bytes"] for r in s["regions"])),
    ("sublet_loan_active", "gauge", "1 while a loan is borrowed",
     lambda s: int(bool(s["loan"]) and s["loan"]["state"] == "active")),
    ("sublet_loan_live_bytes", "gauge", "bytes the borrower holds now",
     lambda s: s["loan"]["live_bytes"] if s["loan"] else 0),
    ("sublet_loan_copied_out_bytes", "gauge", "kept bytes saved in the loan in progress",
     lambda s: s["loan"]["copied_out_bytes"] if s["loan"] else 0),
    ("sublet_loan_moved_bytes", "gauge", "kept bytes moved on the GPU in the loan in progress",
     lambda s: s["loan"].get("moved_bytes", 0) if s["loan"] else 0),
    ("sublet_loans_ended_total", "counter", "loans ended", lambda s: s["totals"]["loans_ended"]),
    ("sublet_borrowers_died_total", "counter", "borrowers that died mid-loan",
     lambda s: s["totals"]["borrowers_died"]),
    ("sublet_copied_out_bytes_total", "counter", "kept bytes saved to the host",
     lambda s: s["totals"]["copied_out_bytes"]),
    ("sublet_copied_in_bytes_total", "counter", "kept bytes restored",
     lambda s: s["totals"]["copied_in_bytes"]),
]


def label_value(v: object) -> str:
    """A label value, quoted, with the three characters the format escapes."""
    text = str(v).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")
    return f'"{text}"'


def sample(name: str, labels: dict[str, object], value: object) -> str:
    inner = ",".join(f"{k}={label_value(v)}" for k, v in labels.items())
    return f"{name}{{{inner}}} {'NaN' if value is None else value}"  # None: JSON's null time


def family(name: str, kind: str, help_text: str, samples: list[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def prometheus(statuses: list[dict[str, Any]], unreachable: list[str]) -> str:
    """The metrics of the daemons that answered, and sublet_up 0 for those that did not."""
    from . import __version__
    device = [{"device": s["device_ordinal"], "uuid": s["device_uuid"]} for s in statuses]
    out = family("sublet_build_info", "gauge", "the sublet package that wrote these metrics",
                 [sample("sublet_build_info", {"version": __version__}, 1)])
    out += family("sublet_up", "gauge", "1 when the daemon at the socket answered, else 0",
                  [sample("sublet_up", {"socket": s["socket"]}, 1) for s in statuses] +
                  [sample("sublet_up", {"socket": path}, 0) for path in unreachable])
    out += family("sublet_daemon_info", "gauge", "the daemon serving each device",
                  [sample("sublet_daemon_info", dict(d, version=s["daemon_version"],
                                                     backend=s["backend"], socket=s["socket"]), 1)
                   for d, s in zip(device, statuses)])
    for name, kind, help_text, value in METRICS:
        out += family(name, kind, help_text,
                      [sample(name, d, value(s)) for d, s in zip(device, statuses)])
    out += family("sublet_served_bytes_total", "counter", "bytes lent, by where they came from",
                  [sample("sublet_served_bytes_total", dict(d, source=source),
                          s["totals"][f"served_{source}_bytes"])
                   for d, s in zip(device, statuses) for source in ("unkept", "fresh", "kept")])
    return "\n".join(out) + "\n"


def write_atomically(path: str, text: str) -> None:
    """Writes `text` to `path` so that a reader sees the old file or the new one, never part:
    a temporary file in the same directory, flushed, then renamed over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # collectors run as another user; mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# --------------------------------------------------------------------------- main


class _VersionAction(argparse.Action):
    """--version, reading libsublet's version only when asked (so that --help works without
    the library)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from . import __version__
        print(f"sublet {__version__}")  # to standard output, as argparse's own does
        parser.exit()


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="sublet", description="sublet: lend GPU memory",
        epilog="exit status: 0 every daemon answered, 1 some did not, 2 usage error, 3 no "
               "daemon found, 4 the output could not be written or libsublet is missing, 5 no "
               "daemon answered and one at least refused this user (permission denied)")
    parser.add_argument("-V", "--version", action=_VersionAction,
                        help="show the version and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="show what each device's subletd is doing")
    form = status.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="a JSON list, one object per device")
    form.add_argument("--prometheus", action="store_true",
                      help="Prometheus text format (for a node exporter's textfile collector)")
    status.add_argument("--output", metavar="FILE",
                        help="write to FILE atomically (a temporary file renamed over it) "
                             "instead of standard output")
    status.add_argument("--socket", action="append", default=[], metavar="PATH",
                        help="ask the daemon at PATH (repeatable; default: $SUBLET_SOCKET, "
                             "else /run/sublet/gpu*.sock and your own daemons' sockets)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except OSError as e:  # libsublet missing (FileNotFoundError), or --output not writable
        print(f"sublet: {e}", file=sys.stderr)
        return EXIT_ERROR


def run(argv: list[str] | None) -> int:
    try:
        args = parse(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code else EXIT_OK
    paths, leftovers = sockets(args.socket)
    statuses, unreachable, denied = [], [], False
    for path in paths + leftovers:
        try:
            statuses.append(query(path))
        except _lib.SubletError as e:
            if path in leftovers and isinstance(e, _lib.DaemonUnavailableError):
                continue  # left by a daemon of ours that was killed: nothing to show
            print(f"sublet status: {path}: {e}", file=sys.stderr)
            unreachable.append(path)
            denied = denied or isinstance(e, _lib.DaemonPermissionError)
    if args.json:
        text = json.dumps(statuses, indent=None) + "\n"
    elif args.prometheus:
        text = prometheus(statuses, unreachable)  # even with no daemon: up 0, build info
    else:
        text = "\n\n".join(text_status(s) for s in statuses) + "\n"
    if not statuses and not unreachable:
        print(f"sublet status: no subletd found: none at /run/sublet/gpu*.sock or in "
              f"{_daemon.user_dir_path()}, and $SUBLET_SOCKET is not set (a sublet program "
              f"starts your own; or start the service: systemctl start subletd@0.socket)",
              file=sys.stderr)
    if args.output:
        try:
            write_atomically(args.output, text)
        except OSError as e:
            raise OSError(f"cannot write {args.output}: {e.strerror or e}: give --output a "
                          f"file in a directory that exists and that you may write") from e
    else:
        sys.stdout.write(text)
    if not statuses:
        return EXIT_DENIED if denied else EXIT_NONE
    return EXIT_PARTIAL if unreachable else EXIT_OK
