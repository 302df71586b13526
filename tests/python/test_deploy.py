"""deploy/: the Kubernetes manifests and the image's entry point, checked without a cluster.

No Kubernetes schema validator is packaged for offline use (kubeconform is neither in Debian
nor on PyPI), so the manifests are parsed and what sublet depends on is checked: selectors
that match, the socket directory shared by hostPath, the sublet group on both sides, GPU access
without taking the GPUs, hostPID, unprivileged containers, and the metrics path. subletd-node
runs for real against a stand-in nvidia-smi and memfd daemons.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
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
