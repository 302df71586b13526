"""deploy/: the Kubernetes manifests and the image's entry point, checked without a cluster.

No Kubernetes schema validator is packaged for offline use (kubeconform is neither in Debian
nor on PyPI), so the manifests are parsed and what sublet depends on is checked: selectors
that match, the socket directory shared by hostPath, the sublet group on both sides, GPU access
without taking the GPUs, hostPID, unprivileged containers, and the metrics path. subletd-node
runs for real against a stand-in nvidia-smi and memfd daemons.

The metrics sidecar is checked the way a node would run it: its host directory as kubelet
creates it (root's, 0755; fsGroup does not reach a hostPath), the init container's command
run on it as root, then `sublet status --prometheus --output` run as the sidecar's real user
(uid 64000, under root), and the probes' own code judging the file fresh, stale or missing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO

yaml = pytest.importorskip("yaml")

DEPLOY = REPO / "deploy"
SOCKET_DIR = "/run/sublet"


def load(name: str) -> dict[str, dict]:
    docs = yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text())
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def daemonset() -> dict:
    return load("subletd-daemonset.yaml")


def dockerfile_user() -> tuple[int, int]:
    user = re.search(r"^USER (\d+):(\d+)$", (DEPLOY / "Dockerfile").read_text(), re.M)
    return int(user.group(1)), int(user.group(2))


def mounts_of(container: dict) -> dict[str, dict]:
    return {m["name"]: m for m in container.get("volumeMounts", [])}


def test_selector_matches_the_pods_and_namespaces_agree(daemonset):
    ds = daemonset["DaemonSet"]
    selector = ds["spec"]["selector"]["matchLabels"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert selector and selector.items() <= labels.items()
    namespace = daemonset["Namespace"]["metadata"]["name"]
    assert ds["metadata"]["namespace"] == daemonset["ConfigMap"]["metadata"]["namespace"] == namespace


def test_sockets_are_shared_through_the_host_directory(daemonset):
    spec = daemonset["DaemonSet"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["sockets"]["hostPath"]["path"] == SOCKET_DIR
    for c in spec["initContainers"] + spec["containers"]:
        assert mounts_of(c)["sockets"]["mountPath"] == SOCKET_DIR, c["name"]
    pod = load("example-pod.yaml")["Pod"]["spec"]
    (pod_volume,) = [v for v in pod["volumes"] if v.get("hostPath")]
    assert pod_volume["hostPath"]["path"] == SOCKET_DIR
    assert mounts_of(pod["containers"][0])[pod_volume["name"]]["mountPath"] == SOCKET_DIR


def test_the_sublet_group_on_both_sides(daemonset):
    uid, gid = dockerfile_user()
    spec = daemonset["DaemonSet"]["spec"]["template"]["spec"]
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]) == (uid, gid)
    init = " ".join(spec["initContainers"][0]["command"])
    assert f"chown {uid}:{gid} {SOCKET_DIR}" in init and f"chmod 0750 {SOCKET_DIR}" in init
    assert f"--allow-group {gid}" in daemonset["ConfigMap"]["data"]["SUBLETD_OPTIONS"]
    pod = load("example-pod.yaml")["Pod"]["spec"]
    assert gid in pod["securityContext"]["supplementalGroups"]


def test_all_gpus_reachable_without_taking_them(daemonset):
    spec = daemonset["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia" and spec["hostPID"] is True
    assert "NVIDIA_VISIBLE_DEVICES=all" in (DEPLOY / "Dockerfile").read_text()
    for c in spec["containers"]:
        assert "nvidia.com/gpu" not in str(c.get("resources", {})), c["name"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    pod = load("example-pod.yaml")["Pod"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_containers_are_unprivileged(daemonset):
    spec = daemonset["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]} and "privileged" not in sc, c["name"]
    init = spec["initContainers"][0]["securityContext"]  # root only to chown the directory
    assert init["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    pod = load("example-pod.yaml")["Pod"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_metrics_are_written_where_the_textfile_volume_is(daemonset):
    spec = daemonset["DaemonSet"]["spec"]["template"]["spec"]
    (metrics,) = [c for c in spec["containers"] if c["name"] == "metrics"]
    command = " ".join(metrics["command"])
    out = re.search(r"--prometheus\s+--output (\S+)", command).group(1)
    textfile = mounts_of(metrics)["textfile"]
    assert Path(out).parent == Path(textfile["mountPath"])
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["textfile"]["hostPath"]["type"] == "DirectoryOrCreate"


def test_the_docs_name_the_textfile_directory_the_daemonset_uses(daemonset):
    """Every doc and man page that names a node exporter's textfile directory names the one
    the DaemonSet mounts from the host (one spelling: node-exporter, not node_exporter)."""
    volumes = daemonset["DaemonSet"]["spec"]["template"]["spec"]["volumes"]
    host = {v["name"]: v for v in volumes}["textfile"]["hostPath"]["path"]
    docs = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "man").glob("*.[0-9]")]
    named = {(path.relative_to(REPO).as_posix(), m.group(0))
             for path in docs for m in re.finditer(r"/var/lib/node[-_]exporter[\w/.-]*",
                                                   path.read_text().replace("\\-", "-"))}
    assert named, "the docs name the textfile directory"
    assert [(doc, p) for doc, p in named
            if p.rstrip("/") != host and not p.startswith(host + "/")] == []


def test_images_are_one_and_options_are_subletd_options(daemonset, native, tmp_path):
    spec = daemonset["DaemonSet"]["spec"]["template"]["spec"]
    assert len({c["image"] for c in spec["initContainers"] + spec["containers"]}) == 1
    options = daemonset["ConfigMap"]["data"]["SUBLETD_OPTIONS"].split()
    options = [o if o != str(dockerfile_user()[1]) else str(os.getgid()) for o in options]
    proc = subprocess.Popen([str(native.subletd), "--backend", "memfd", "--socket",
                             str(tmp_path / "s.sock"), *options], stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, SUBLET_MEMFD_TOTAL="64M"))
    wait_for(lambda: (tmp_path / "s.sock").exists(), proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def wait_for(condition, *procs, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for p in procs:
            assert p.poll() is None, p.stderr.read() if p.stderr else "exited"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


NVIDIA_SMI = """#!/bin/sh
printf '0, GPU-4b3a1f0e-8c3d-11ee-b962-0242ac120002\\n1, GPU-5b3a1f0e-8c3d-11ee-b962-0242ac120003\\n'
"""


def start_node(native, tmp_path) -> tuple[subprocess.Popen, Path]:
    """subletd-node with a stand-in nvidia-smi (two GPUs) and subletd on the memfd backend."""
    bin_dir, sockets = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    sockets.mkdir()
    (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI)
    (bin_dir / "subletd").write_text(f'#!/bin/sh\nexec {native.subletd} --backend memfd "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    proc = subprocess.Popen(["sh", str(DEPLOY / "subletd-node")], stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
                                                SUBLET_SOCKET_DIR=str(sockets),
                                                SUBLETD_OPTIONS="--reserve 0 --log-level warn",
                                                SUBLET_MEMFD_TOTAL="64M"))
    wait_for(lambda: len(list(sockets.glob("gpu*.sock"))) == 2, proc)
    return proc, sockets


def test_node_entry_point_runs_one_daemon_per_gpu_and_stops_them(native, tmp_path):
    proc, sockets = start_node(native, tmp_path)
    for n in (0, 1):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sockets / f"gpu{n}.sock"))  # a daemon listens on each
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert list(sockets.glob("gpu*.sock")) == []  # each daemon removed its socket


def test_node_entry_point_exits_when_a_daemon_dies(native, tmp_path):
    proc, sockets = start_node(native, tmp_path)
    pids = subprocess.run(["pgrep", "-x", "-P", str(proc.pid), "subletd"], capture_output=True,
                          text=True).stdout.split()
    assert len(pids) == 2
    os.kill(int(pids[0]), signal.SIGKILL)
    assert proc.wait(timeout=20) == 1  # the pod restarts
    assert "exited" in proc.stderr.read()
    wait_for(lambda: subprocess.run(["kill", "-0", pids[1]], capture_output=True).returncode != 0)


def test_dockerfile_copies_what_exists_and_runs_unprivileged():
    """docker build cannot run here: what can be checked without it is."""
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)
    assert [s[0].split(":")[0] for s in stages] == ["debian", "debian"] and stages[0][1] == "build"
    for src in re.findall(r"^COPY (?!--from)(\S+) ", text, re.M):
        assert (REPO / src).exists(), f"COPY {src}: no such file in the checkout"
    assert "cmake --install" in text and "-DCMAKE_INSTALL_PREFIX=/usr" in text
    assert re.search(r"SUBLET_LIB=/usr/lib/x86_64-linux-gnu/libsublet\.so\.0\b", text)
    assert dockerfile_user() != (0, 0)
    assert re.search(r'^CMD \["/usr/bin/subletd-node"\]$', text, re.M)



# --------------------------------------------------------------------------- the metrics sidecar

def pod_spec(daemonset: dict) -> dict:
    return daemonset["DaemonSet"]["spec"]["template"]["spec"]


def container(spec: dict, name: str) -> dict:
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


def identity(spec: dict, c: dict) -> tuple[int, set[int]]:
    """The uid and the gids a container's processes run with. fsGroup is left out: kubelet
    applies it to volumes whose ownership it manages, never to a hostPath."""
    pod, own = spec.get("securityContext", {}), c.get("securityContext", {})
    uid = own.get("runAsUser", pod.get("runAsUser", dockerfile_user()[0]))
    gid = own.get("runAsGroup", pod.get("runAsGroup", dockerfile_user()[1]))
    return uid, {gid, *pod.get("supplementalGroups", [])}


def textfile_dir(spec: dict) -> str:
    """The metrics container's mount of the textfile hostPath."""
    return mounts_of(container(spec, "metrics"))["textfile"]["mountPath"]


def chmod_mode(mode: int, spec: str) -> int:
    """chmod's MODE applied to mode: octal, or symbolic clauses like g+rwx,o-w."""
    if re.fullmatch(r"[0-7]{3,4}", spec):
        return int(spec, 8)
    for clause in spec.split(","):
        who, op, perms = re.fullmatch(r"([ugoa]*)([+=-])([rwx]*)", clause).groups()
        bits = 0
        for w in who or "a":
            for p in perms:
                for ww in ("ugo" if w == "a" else w):
                    bits |= {"r": 4, "w": 2, "x": 1}[p] << {"u": 6, "g": 3, "o": 0}[ww]
        if op == "+":
            mode |= bits
        elif op == "-":
            mode &= ~bits
        else:
            mask = 0
            for w in who or "a":
                for ww in ("ugo" if w == "a" else w):
                    mask |= 7 << {"u": 6, "g": 3, "o": 0}[ww]
            mode = (mode & ~mask) | bits
    return mode


def after_init(spec: dict, path: str, owner: tuple[int, int, int]) -> tuple[int, int, int]:
    """(uid, gid, mode) of the host directory mounted at `path` once the init containers'
    chown, chgrp and chmod ran on it, starting from `owner`."""
    uid, gid, mode = owner
    for c in spec.get("initContainers", []):
        mounted = {m["mountPath"] for m in c.get("volumeMounts", [])}
        if path not in mounted:
            continue
        script = " ".join(c["command"][2:]) if c["command"][:2] == ["sh", "-c"] else ""
        for step in re.split(r"&&|;|\|\|", script):
            words = shlex.split(step)
            if len(words) != 3 or words[2] != path:
                continue
            if words[0] == "chown":
                u, _, g = words[1].partition(":")
                uid, gid = int(u), int(g) if g else gid
            elif words[0] == "chgrp":
                gid = int(words[1])
            elif words[0] == "chmod":
                mode = chmod_mode(mode, words[1])
    return uid, gid, mode


def may_write(uid: int, gids: set[int], owner: tuple[int, int, int]) -> bool:
    """Whether uid with gids may make and rename files in a directory (write and search)."""
    d_uid, d_gid, mode = owner
    if uid == 0:
        return True
    shift = 6 if uid == d_uid else 3 if d_gid in gids else 0
    return (mode >> shift) & 0o3 == 0o3


def test_the_sidecar_user_can_write_the_textfile_directory_as_created(daemonset):
    """kubelet makes a missing hostPath directory (DirectoryOrCreate) root's, mode 0755."""
    spec = pod_spec(daemonset)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["textfile"]["hostPath"]["type"] == "DirectoryOrCreate"
    uid, gids = identity(spec, container(spec, "metrics"))
    assert uid != 0
    created = (0, 0, 0o755)
    for path in {textfile_dir(spec)} | {m["mountPath"] for c in spec.get("initContainers", [])
                                        for m in c.get("volumeMounts", [])
                                        if m["name"] == "textfile"}:
        assert may_write(uid, gids, after_init(spec, path, created)), (
            f"uid {uid} (groups {sorted(gids)}) cannot write {path}: root's 0755 as kubelet "
            f"makes it, {oct(after_init(spec, path, created)[2])} after the init containers")
    # and nobody but root and the sublet group gains write access: others still only read
    assert after_init(spec, textfile_dir(spec), created)[2] & 0o002 == 0


def test_the_sidecar_says_what_fails_and_a_probe_notices(daemonset):
    spec = pod_spec(daemonset)
    metrics = container(spec, "metrics")
    command = " ".join(metrics["command"])
    assert "/dev/null" not in command and not re.search(r"\d?>\s*&?\s*\S", command), (
        "the sidecar's output is its log: errors must reach kubectl logs")
    for probe in ("readinessProbe", "livenessProbe"):
        exec_ = metrics[probe]["exec"]["command"]
        assert textfile_dir(spec) in " ".join(exec_), probe
    # a probe that fails slower than the file is written: 4 rounds of `sleep 15`
    interval = int(re.search(r"sleep (\d+)", command).group(1))
    live = metrics["livenessProbe"]
    assert live["initialDelaySeconds"] > interval
    assert live["periodSeconds"] * live.get("failureThreshold", 3) > 2 * interval


def probe_code(daemonset: dict, probe: str, directory: Path) -> list[str]:
    """The probe's command with the textfile mount replaced by `directory`, run by this
    test's Python (the image's python3 is not this machine's)."""
    spec = pod_spec(daemonset)
    argv = container(spec, "metrics")[probe]["exec"]["command"]
    assert argv[0] == "python3"
    return [sys.executable, *[a.replace(textfile_dir(spec), str(directory)) for a in argv[1:]]]


@pytest.mark.parametrize("probe", ["readinessProbe", "livenessProbe"])
def test_probes_fail_on_a_stale_or_missing_file(daemonset, probe, tmp_path):
    argv = probe_code(daemonset, probe, tmp_path)
    assert subprocess.run(argv, capture_output=True).returncode != 0  # missing
    prom = tmp_path / "sublet.prom"
    prom.write_text("sublet_up 1\n")
    assert subprocess.run(argv, capture_output=True).returncode == 0  # fresh
    old = time.time() - 120
    os.utime(prom, (old, old))
    assert subprocess.run(argv, capture_output=True).returncode != 0  # stale


def sidecar_once(argv: list[str], env: dict[str, str], socket_dir: str) -> tuple[int, str]:
    """`sublet ARGV` in-process (the test's Python, as the child's user), asking the daemons
    of socket_dir where the pod's would ask /run/sublet's: exit code, stderr."""
    import contextlib
    import io
    os.environ.update(env)
    for name in ("SUBLET_SOCKET", "XDG_RUNTIME_DIR"):  # the pod sets neither
        os.environ.pop(name, None)
    from sublet import _status
    from sublet.__main__ import main
    _status.SYSTEM_SOCKET_DIR = Path(socket_dir)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def as_user(uid: int, gids: set[int], fn, *args) -> object:
    """fn(*args) in a forked child that is uid with gids (needs root); its JSON-able result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            os.setgroups(sorted(gids))
            os.setgid(min(gids))
            os.setuid(uid)
            os.write(write, json.dumps(fn(*args)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, out
    return json.loads(out)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("sh"),
                    reason="becomes the sidecar's user (uid 64000) and chowns: needs root")
def test_the_sidecar_writes_its_file_as_its_user(daemonset, native):
    """For real: the host directory made as kubelet makes it, the init container's command
    run on it (as root, as the init container runs), then the sidecar's `sublet status` as
    uid 64000, and its probe on what it wrote."""
    spec = pod_spec(daemonset)
    uid, gids = identity(spec, container(spec, "metrics"))
    mount = textfile_dir(spec)
    base = Path(tempfile.mkdtemp(prefix="sl-node-"))
    try:
        base.chmod(0o755)  # the sidecar's user must reach the directory inside
        host = {"textfile": base / "textfile", "sockets": base / "run-sublet"}
        for d in host.values():
            d.mkdir()
            os.chown(d, 0, 0)
            d.chmod(0o755)  # kubelet's DirectoryOrCreate
        for c in spec["initContainers"]:
            script = c["command"][2]
            for m in c["volumeMounts"]:
                script = script.replace(m["mountPath"], str(host[m["name"]]))
            subprocess.run(["sh", "-c", script], check=True)
        st = host["textfile"].stat()
        assert not st.st_mode & stat.S_IWOTH
        command = " ".join(container(spec, "metrics")["command"])
        args = shlex.split(re.search(r"python3 -m sublet ([^;>]*)", command).group(1))
        args = [a.replace(mount, str(host["textfile"])) for a in args]
        # The pod's daemon, as the pod runs it: uid 64000, the ConfigMap's options, its socket
        # in the host's socket directory (memfd backend: no GPU).
        daemon_uid, daemon_gids = identity(spec, container(spec, "subletd"))
        options = daemonset["ConfigMap"]["data"]["SUBLETD_OPTIONS"].split()
        sock = host["sockets"] / "gpu0.sock"
        daemon = subprocess.Popen([str(native.subletd), "--backend", "memfd", "--socket",
                                   str(sock), *options], stderr=subprocess.PIPE, text=True,
                                  user=daemon_uid, group=min(daemon_gids),
                                  extra_groups=sorted(daemon_gids),
                                  env=dict(os.environ, SUBLET_MEMFD_TOTAL="64M"))
        try:
            wait_for(sock.exists, daemon)
            env = {"SUBLET_LIB": str(native.libsublet)}
            code, err = as_user(uid, gids, sidecar_once, args, env, str(host["sockets"]))
        finally:
            daemon.terminate()
            daemon.wait(timeout=10)
        prom = host["textfile"] / "sublet.prom"
        assert code == 0 and prom.exists(), f"exit {code}: {err}"
        assert prom.stat().st_uid == uid and prom.stat().st_mode & 0o044 == 0o044  # collectors read
        assert f'sublet_up{{socket="{sock}"}} 1' in prom.read_text()
        argv = probe_code(daemonset, "livenessProbe", host["textfile"])
        assert subprocess.run(argv, capture_output=True).returncode == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
