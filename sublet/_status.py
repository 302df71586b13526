"""`sublet status`: what each device's subletd is doing (issue 5).

A stub for now: the status request (StatsGet) is not yet in the client library's API.
"""

from __future__ import annotations

import argparse
import sys

EXIT_UNAVAILABLE = 3  # scripts can tell "no status to show" from a usage error (2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sublet", description="sublet: lend GPU memory")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="show what each device's subletd is doing")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--prometheus", action="store_true", help="Prometheus text format")
    parser.parse_args(argv)
    print("sublet status is not available yet: the client library has no status request",
          file=sys.stderr)
    return EXIT_UNAVAILABLE
