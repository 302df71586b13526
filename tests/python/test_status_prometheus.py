"""`sublet status --prometheus` as monitoring reads it: sublet_up per daemon (0 for one that does
not answer), build info, a textfile written atomically (--output), and output that follows the
text exposition format: checked here rule by rule, and by `promtool check metrics` when it is
installed ($PROMTOOL or on PATH; CI extracts it from Debian's prometheus package)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import CHILD_ENV

pytestmark = pytest.mark.daemon

NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*)\} '
                    r"(\S+)")


def check_exposition_format(text: str) -> dict[tuple[str, str], float]:
    """Fails on anything the 0.0.4 text format or promtool's lint rejects; returns the samples."""
    assert text.endswith("\n")
    families: dict[str, str] = {}
    samples: dict[tuple[str, str], float] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            current = line.split(" ")[2]
            assert NAME.fullmatch(current) and current not in families, line
            families[current] = ""
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name == current and kind in ("gauge", "counter"), line
            assert name.endswith("_total") == (kind == "counter"), f"{name}: a {kind}"
            families[name] = kind
        else:
            m = SAMPLE.fullmatch(line)
            assert m, f"not a sample: {line!r}"
            assert m.group(1) == current and families[current], f"{line!r} outside its family"
            key = (m.group(1), m.group(2))
            assert key not in samples, f"duplicate series {line!r}"
            samples[key] = float(m.group(3))
    return samples


def promtool() -> str | None:
    return os.environ.get("PROMTOOL") or shutil.which("promtool")


def status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sublet", "status", *args], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, **CHILD_ENV))


@pytest.fixture
def daemon(native, tmp_path):
    sock = tmp_path / "gpu0.sock"
    proc = subprocess.Popen([str(native.subletd), "--backend", "memfd", "--socket", str(sock)],
                            stderr=subprocess.DEVNULL, env=dict(os.environ,
                                                                SUBLET_MEMFD_TOTAL="64M"))
    deadline = time.monotonic() + 10
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "subletd did not start"
        time.sleep(0.01)
    yield str(sock)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)


def test_up_for_each_daemon_and_zero_for_the_unreachable(daemon, tmp_path):
    import sublet
    missing = str(tmp_path / "gpu1.sock")
    out = tmp_path / "sublet.prom"
    r = status("--prometheus", "--socket", daemon, "--socket", missing, "--output", str(out))
    assert r.returncode == 1 and r.stdout == "" and missing in r.stderr
    samples = check_exposition_format(out.read_text())
    assert samples[("sublet_up", f'socket="{daemon}"')] == 1
    assert samples[("sublet_up", f'socket="{missing}"')] == 0
    assert samples[("sublet_build_info", f'version="{sublet.__version__}"')] == 1
    info = [labels for name, labels in samples if name == "sublet_daemon_info"]
    assert len(info) == 1 and f'version="{sublet.__version__}"' in info[0]
    assert 'backend="memfd"' in info[0]
    total = [v for (name, _), v in samples.items() if name == "sublet_memory_total_bytes"]
    assert total == [64 * 1024 ** 2]
    tool = promtool()
    if tool:  # promtool reads the metrics on stdin and lints names, types and units
        check = subprocess.run([tool, "check", "metrics"], input=out.read_text(),
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0 and check.stdout + check.stderr == "", check.stdout + check.stderr


def test_no_daemon_at_all_still_says_so_to_monitoring(tmp_path):
    missing = str(tmp_path / "gpu0.sock")
    r = status("--prometheus", "--socket", missing)
    assert r.returncode == 3
    samples = check_exposition_format(r.stdout)
    assert samples[("sublet_up", f'socket="{missing}"')] == 0
    assert any(name == "sublet_build_info" for name, _ in samples)


def test_the_format_check_rejects_broken_output():
    """The checks are real: broken outputs fail the format check, and the first two fail
    promtool too (it does not look for duplicate series)."""
    bad = ["# HELP sublet_x_total x\n# TYPE sublet_x_total gauge\nsublet_x_total{a=\"1\"} 1\n",
           "# HELP sublet_z z\n# TYPE sublet_z gauge\nsublet_z{a=\"x\"y\"} 1\n",
           "# HELP sublet_y y\n# TYPE sublet_y gauge\nsublet_y{a=\"1\"} 1\nsublet_y{a=\"1\"} 2\n"]
    for i, text in enumerate(bad):
        with pytest.raises(AssertionError):
            check_exposition_format(text)
        tool = promtool()
        if tool and i < 2:
            check = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True,
                                   text=True, timeout=60)
            assert check.returncode != 0 or check.stdout + check.stderr, text


def test_label_values_are_escaped():
    from sublet._status import label_value, sample
    line = sample("sublet_daemon_info", {"device": 'a"b\\c\nd'}, 1)
    assert line == 'sublet_daemon_info{device="a\\"b\\\\c\\nd"} 1'
    assert SAMPLE.fullmatch(line) and label_value(3) == '"3"'


def test_output_is_replaced_atomically(tmp_path):
    from sublet._status import write_atomically
    out = tmp_path / "sublet.prom"
    out.write_text("old\n")
    with open(out) as reader:  # a collector in the middle of reading the old file
        write_atomically(str(out), "new\n")
        assert reader.read() == "old\n"
    assert out.read_text() == "new\n" and (out.stat().st_mode & 0o777) == 0o644
    assert os.listdir(tmp_path) == ["sublet.prom"]  # no temporary file left behind
    with pytest.raises(TypeError):
        write_atomically(str(out), None)  # a failed write leaves the old file and no temporary
    assert out.read_text() == "new\n" and os.listdir(tmp_path) == ["sublet.prom"]
