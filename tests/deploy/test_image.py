"""The server image (deploy/image/build.sh), run for real with podman: non-root, a
read-only root file system, a data volume, ports published on 127.0.0.1 only.

A put/get/lookup smoke passes from the host (this repository's client) and from a
second container of the same image (its own client, over the host's loopback), the
health command answers from both, and a new container on the same volume serves what
the first stored. `podman kube play` of the rendered overlays: the single server serves
the same smoke through the Service's ports, and two scale-out servers over a 3-node
Redis Cluster (TLS, an ACL user; on the host's loopback) read what the other stored.
Needs root, podman and mmdebstrap (skipped otherwise); the image is built once per
session, or reused when an image of the same inputs exists (build.sh).

Run alone: `python -m pytest tests/deploy/test_image.py -m packaging -s` (prints the
image size and the start times docs/deploy.md records).
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from kvshare.bench.redis_cluster import ClusterAccess, LocalRedisCluster
from policy.sealing import BlockSealer, Keyring, new_key_entry
from replica_agent.client import BlockClient, ClientTls
from tests.support.certs import TestCA
from tests.support.repo import REPO

# The first test of a session builds the image (build.sh: up to ~5 minutes on 2 busy
# cores) in its session fixture, which the default 300 s per test would cut short.
pytestmark = [pytest.mark.slow, pytest.mark.packaging, pytest.mark.timeout(1800)]

BUILD = REPO / "deploy" / "image" / "build.sh"
MODEL = "image/model@r1;fp32;L2;H2;D8;B4;tp0/1"
UID = 10001
# What the second container runs: the image's own client, over the host's loopback.
# argv: ADDRESS TOKEN_FILE [TENANT [CA_FILE]]. Payloads are sealed, as the agent seals
# them (the overlays' tenant requires sealed blocks), with a key made here.
SMOKE = """
import os, sys
from pathlib import Path
from policy.sealing import BlockSealer, Keyring, new_key_entry
from replica_agent.client import BlockClient, ClientTls
address, token_file = sys.argv[1], sys.argv[2]
tenant = sys.argv[3] if len(sys.argv) > 3 else "alpha"
tls = ClientTls(root_ca=Path(sys.argv[4])) if len(sys.argv) > 4 else None
token = open(token_file).read().strip()
sealer = BlockSealer(Keyring.parse_toml(new_key_entry(tenant, 1), "smoke"))
model = "image/model@r1;fp32;L2;H2;D8;B4;tp0/1"
digests = [os.urandom(32) for _ in range(3)]
plain = [os.urandom(1 << 20) for _ in digests]
sealed = [sealer.seal(tenant, model, d, p) for d, p in zip(digests, plain)]
with BlockClient(address, token, tls=tls, same_host=False) as client:
    assert client.put(tenant, model, digests, sealed) == [True, True, True]
    assert client.lookup(tenant, model, digests) == 3
    got = client.get(tenant, model, digests)
    assert [sealer.open(tenant, model, d, g) for d, g in zip(digests, got)] == plain
    assert client.lookup(tenant, model, [os.urandom(32)]) == 0
print("smoke ok uid", os.getuid())
"""


def podman_conf(directory: Path) -> dict[str, str]:
    """runc (crun refuses hybrid cgroups) and ulimits within the hard limits."""
    conf = directory / "containers.conf"
    made = subprocess.run(
        ["python3", str(REPO / "deploy" / "image" / "assemble.py"), "containers-conf"],
        capture_output=True,
        text=True,
        check=True,
    )
    conf.write_text(made.stdout)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


@dataclass
class Podman:
    env: dict[str, str]

    def __call__(self, *args: str, check: bool = True, timeout_s: float = 300) -> str:
        done = subprocess.run(
            ["podman", *args], capture_output=True, text=True, env=self.env, timeout=timeout_s
        )
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args[:3])}: {done.stderr.strip()}")
        return done.stdout

    def run(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["podman", "run", "--rm", *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout_s,
        )


@pytest.fixture(scope="session")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    if os.geteuid() != 0:
        pytest.skip("building the image needs root (mmdebstrap's root mode, chroot)")
    for tool in ("podman", "mmdebstrap"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing: apt-get install podman mmdebstrap runc")
    return Podman(podman_conf(tmp_path_factory.mktemp("podman")))


@pytest.fixture(scope="session")
def image(podman: Podman) -> str:
    started = time.monotonic()
    done = subprocess.run(
        [str(BUILD)], capture_output=True, text=True, env=podman.env, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ref = done.stdout.strip().splitlines()[-1]
    size = int(podman("image", "inspect", "--format", "{{.Size}}", ref))
    print(f"\nimage {ref}: {size / 2**20:.0f} MiB, build.sh {time.monotonic() - started:.0f} s")
    return ref


def free_ports(count: int) -> list[int]:
    """`count` consecutive free loopback ports (the bulk port is the gRPC port + 1)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            socks = []
            for port in range(first, first + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return list(range(first, first + count))
    raise AssertionError("no free consecutive ports")


@dataclass
class Server:
    name: str
    address: str
    token: str
    token_file: Path
    ready_s: float


@pytest.fixture
def tenancy(tmp_path: Path) -> tuple[Path, str, Path]:
    """A config for the container (plaintext: its ports are published on 127.0.0.1
    only), a principal's token, and the token in a file a container can read."""
    token = secrets.token_urlsafe(24)
    port = free_ports(2)[0]
    config = tmp_path / "kvshare.toml"
    config.write_text(
        f'listen = "0.0.0.0:{port}"\n'
        "allow_insecure_listen = true  # published on the host's 127.0.0.1 only\n"
        'data_dir = "/var/lib/kvshare"\n'
        "[bulk]\n"
        f'listen = "0.0.0.0:{port + 1}"\n'
        "same_host = false\n"
        "[[tenants]]\n"
        'id = "alpha"\n'
        "quota_bytes = 0\n"
        "[[principals]]\n"
        'name = "a"\n'
        f'token_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
        'tenants = ["alpha"]\n'
        'actions = ["read", "write"]\n'
    )
    config.chmod(0o644)
    token_file = tmp_path / "a.token"
    token_file.write_text(token)
    token_file.chmod(0o644)  # the second container's user reads it; a test token
    return config, token, token_file


@pytest.fixture
def start(
    podman: Podman, image: str, tenancy: tuple[Path, str, Path]
) -> Iterator[Callable[[str], Server]]:
    """start(volume) runs the server container on `volume`; all removed at the end."""
    config, token, token_file = tenancy
    port = int(config.read_text().split('listen = "0.0.0.0:')[1].split('"')[0])
    names: list[str] = []

    def run(volume: str) -> Server:
        name = f"kvshare-test-{secrets.token_hex(4)}"
        names.append(name)
        started = time.monotonic()
        podman(
            "run", "-d", "--name", name,
            "--read-only", "--cap-drop=ALL", "--security-opt=no-new-privileges",
            "-p", f"127.0.0.1:{port}:{port}", "-p", f"127.0.0.1:{port + 1}:{port + 1}",
            "-v", f"{volume}:/var/lib/kvshare",
            "-v", f"{config}:/etc/kvshare/kvshare.toml:ro",
            image,
        )  # fmt: skip
        while "serving on" not in podman("logs", name):
            state = podman("inspect", "--format", "{{.State.Status}}", name).strip()
            assert state == "running", podman("logs", name, check=False)
            time.sleep(0.05)
        ready_s = time.monotonic() - started
        return Server(name, f"127.0.0.1:{port}", token, token_file, ready_s)

    yield run
    for name in names:
        podman("rm", "-f", "-t", "5", name, check=False)


@pytest.fixture
def volume(podman: Podman) -> Iterator[str]:
    name = f"kvshare-test-data-{secrets.token_hex(4)}"
    podman("volume", "create", name)
    yield name
    podman("volume", "rm", "-f", name, check=False)


def test_image_runs_as_kvshare_without_a_shell_and_carries_its_sbom(
    podman: Podman, image: str
) -> None:
    config = json.loads(podman("image", "inspect", "--format", "{{json .Config}}", image))
    assert config["User"] == f"{UID}:{UID}"
    assert config["Cmd"] == ["kvshare", "serve", "--config", "/etc/kvshare/kvshare.toml"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.title"] == "kvshare"
    assert image.endswith(":" + labels["org.opencontainers.image.version"])
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    # No shell, no package manager, no compiler: each is not found.
    for tool in ("/bin/sh", "/bin/bash", "/usr/bin/apt-get", "/usr/bin/dpkg", "/usr/bin/gcc"):
        done = podman.run("--read-only", image, tool, "--version")
        assert done.returncode != 0 and "no such file" in done.stderr.lower(), tool
    # Positive control: the interpreter is there, as user kvshare.
    done = podman.run("--read-only", image, "python3", "-c", "import os; print(os.getuid())")
    assert done.stdout.strip() == str(UID), done.stderr
    sbom_path = labels["dev.kvshare.sbom"]
    read = podman.run("--read-only", image, "python3", "-c", f"print(open('{sbom_path}').read())")
    sbom = json.loads(read.stdout)
    assert sbom["bomFormat"] == "CycloneDX" and sbom["specVersion"] == "1.5"
    purls = {c["purl"].split("@")[0] for c in sbom["components"]}
    for expected in ("pkg:pypi/kvshare", "pkg:pypi/grpcio", "pkg:pypi/lmdb", "pkg:pypi/redis"):
        assert expected in purls
    assert "pkg:deb/debian/libc6" in purls and "pkg:deb/debian/python3.11-minimal" in purls
    assert not {"pkg:pypi/torch", "pkg:deb/debian/bash", "pkg:deb/debian/dash"} & purls
    # Every Python distribution in the venv is in the SBOM.
    listed = podman.run(
        "--read-only", image, "python3", "-c",
        "import importlib.metadata as m; print('\\n'.join(d.name for d in m.distributions()))",
    )  # fmt: skip
    names = {n.strip().lower().replace("_", "-") for n in listed.stdout.split()}
    assert names and names <= {p.split("/")[-1] for p in purls}


def test_read_only_non_root_server_smoke_from_host_and_second_container(
    podman: Podman, image: str, start: Callable[[str], Server], volume: str
) -> None:
    server = start(volume)
    print(f"\nserver container ready (serving line) {server.ready_s:.2f} s after podman run")
    # Runs as kvshare, on a read-only root file system.
    top = podman("top", server.name, "user", "huser").split()
    assert "10001" in top or "kvshare" in top, top
    done = subprocess.run(
        ["podman", "exec", server.name, "python3", "-c", "open('/opt/kvshare/x', 'w')"],
        capture_output=True, text=True, env=podman.env, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "Read-only file system" in done.stderr
    # The journal is fitted to the container's 64 MiB /dev/shm (the default would not fit).
    logs = subprocess.run(
        ["podman", "logs", server.name], capture_output=True, text=True, env=podman.env
    )
    logs_text = logs.stdout + logs.stderr
    assert "put journal:" in logs_text and "/dev/shm" in logs_text

    # From the host: this repository's client, gRPC and the bulk channel.
    digests = [os.urandom(32) for _ in range(4)]
    payloads = [os.urandom(1 << 20) for _ in digests]
    with BlockClient(server.address, server.token, same_host=False) as client:
        assert client.put("alpha", MODEL, digests, payloads) == [True] * 4
        assert client.lookup("alpha", MODEL, digests) == 4
        assert client.get("alpha", MODEL, digests) == payloads
    with BlockClient(server.address, server.token, bulk=False) as client:
        assert client.get("alpha", MODEL, digests[:2]) == payloads[:2]

    # From a second container of the same image, over the host's loopback.
    host = ["--network", "host", "--read-only", "--cap-drop=ALL"]
    token_mount = ["-v", f"{server.token_file}:/run/a.token:ro"]
    smoke = podman.run(
        *host, *token_mount, image, "python3", "-c", SMOKE, server.address, "/run/a.token"
    )
    assert smoke.returncode == 0, smoke.stderr[-2000:]
    assert smoke.stdout.strip() == f"smoke ok uid {UID}"
    health = podman.run(*host, image, "kvshare", "health", "--address", server.address)
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr

    # A new container on the same volume serves what the first stored (SIGTERM drains
    # the journal into LMDB; the volume keeps LMDB).
    podman("stop", "-t", "60", server.name)
    assert podman("inspect", "--format", "{{.State.ExitCode}}", server.name).strip() == "0"
    second = start(volume)
    print(f"restarted on the same volume: ready {second.ready_s:.2f} s after podman run")
    with BlockClient(second.address, second.token, same_host=False) as client:
        assert client.get("alpha", MODEL, digests) == payloads


# -- podman kube play of the rendered single-server overlay --------------------------

SERVICE_NAME = "kvshare.kvshare.svc"


def render(overlay: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        ["kubectl", "kustomize", str(REPO / "deploy" / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def playable(
    objects: list[dict[str, Any]],
    *,
    image: str,
    secrets_dir: Path,
    data_dir: Path,
    empty_dirs: Path,
    pod_name: str,
    host_ports: dict[str, int],
    token_sha256: str,
) -> list[dict[str, Any]]:
    """The rendered overlay as podman 4.3's kube play takes it. Podman plays Pods,
    Deployments, ConfigMaps and volume claims, not StatefulSets, Services or Secrets, so
    this test-side transform (nothing else is changed):
    - the StatefulSet's pod template becomes Pod `pod_name`, its image this build's;
    - the Secret kvshare-secrets (a projected volume), the volume claim `data` and the
      emptyDirs become host directories made here, owned by the server's user (podman
      makes an emptyDir a root-owned volume and ignores fsGroup);
    - the Service's ports are the pod's ports published on the host's 127.0.0.1
      (hostIP/hostPort): clients reach the server only through them;
    - in the ConfigMap's kvshare.toml: the principal's placeholder hash is this test's
      token's, and `[bulk] advertise` is the host's published bulk port (the Service's
      DNS name does not resolve on this host);
    - CPU requests and limits are dropped (podman refuses more CPUs than the host has);
    - the init container is kept once run (podman 4.3 fails removing it).
    """
    statefulset = next(o for o in objects if o["kind"] == "StatefulSet")
    configmap = copy.deepcopy(next(o for o in objects if o["kind"] == "ConfigMap"))
    service = next(
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "kvshare"
    )
    toml = configmap["data"]["kvshare.toml"]
    assert "0" * 64 in toml  # the placeholder the shipped config carries
    toml = toml.replace("0" * 64, token_sha256)
    toml = re.sub(
        r'(?m)^advertise = "[^"]*"', f'advertise = "127.0.0.1:{host_ports["bulk"]}"', toml
    )
    configmap["data"]["kvshare.toml"] = toml
    spec = copy.deepcopy(statefulset["spec"]["template"]["spec"])
    by_port_name = {p["targetPort"]: p["name"] for p in service["spec"]["ports"]}
    for container in spec.get("initContainers", []) + spec["containers"]:
        container["image"] = image
        for limits in container.get("resources", {}).values():
            limits.pop("cpu", None)
        for port in container.get("ports", []):
            if port["name"] in by_port_name and by_port_name[port["name"]] in host_ports:
                port["hostIP"] = "127.0.0.1"
                port["hostPort"] = host_ports[by_port_name[port["name"]]]
    spec["volumes"] = host_volumes(statefulset, spec, secrets_dir, data_dir, empty_dirs)
    return [configmap, pod_of(statefulset, pod_name, spec)]


def host_volumes(
    statefulset: dict[str, Any],
    spec: dict[str, Any],
    secrets_dir: Path,
    data_dir: Path,
    empty_dirs: Path,
) -> list[dict[str, Any]]:
    """The pod's volumes as host directories owned by the server's user: the Secrets'
    projected volume, the emptyDirs (one directory each), and the volume claim `data`."""
    volumes = []
    for volume in spec["volumes"]:
        if "projected" in volume or "secret" in volume:
            volume = {"name": volume["name"], "hostPath": {"path": str(secrets_dir)}}
        elif "emptyDir" in volume:
            path = empty_dirs / volume["name"]
            path.mkdir(mode=0o700, parents=True)
            os.chown(path, UID, UID)
            volume = {"name": volume["name"], "hostPath": {"path": str(path)}}
        volumes.append(volume)
    claims = [c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]]
    assert claims == ["data"]
    volumes.append({"name": "data", "hostPath": {"path": str(data_dir)}})
    return volumes


def service_secrets(secrets_dir: Path, ca: TestCA) -> Path:
    """The files of the Secret kvshare: a server certificate for the Service's name and
    127.0.0.1 (tls.crt, tls.key), the CA that issued it (ca.crt) and a new naming key
    (server.secret), in `secrets_dir` (made here)."""
    sans: list[x509.GeneralName] = [
        x509.DNSName(SERVICE_NAME),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    server_cert = ca._issue("server", SERVICE_NAME, sans, ExtendedKeyUsageOID.SERVER_AUTH)
    secrets_dir.mkdir()
    (secrets_dir / "server.secret").write_bytes(os.urandom(32))
    shutil.copy(server_cert.cert, secrets_dir / "tls.crt")
    shutil.copy(server_cert.key, secrets_dir / "tls.key")
    shutil.copy(ca.cert_path, secrets_dir / "ca.crt")
    return secrets_dir


def pod_of(statefulset: dict[str, Any], pod_name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "labels": statefulset["spec"]["template"]["metadata"]["labels"],
            # podman 4.3 removes a run-once init container while it still runs, and
            # fails the play: keep it ("always" runs it at each start of the pod).
            "annotations": {"io.podman.annotations.init.container.type": "always"},
        },
        "spec": spec,
    }


def test_kube_play_of_the_single_overlay_serves_through_the_service_ports(
    podman: Podman, image: str, tmp_path: Path
) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (kustomize) is missing")
    ca = TestCA(tmp_path / "ca")
    secrets_dir = service_secrets(tmp_path / "secrets", ca)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for path in (secrets_dir, data_dir, *secrets_dir.iterdir()):
        os.chown(path, UID, UID)  # what the kubelet's fsGroup would make readable
    token = secrets.token_urlsafe(24)
    grpc_port, bulk_port = free_ports(2)
    manifest = tmp_path / "play.yaml"
    pod = f"kvshare-test-{secrets.token_hex(4)}"
    server = f"{pod}-kvshare"  # podman names a pod's container <pod>-<container>
    objects = playable(
        render("single"),
        image=image,
        secrets_dir=secrets_dir,
        data_dir=data_dir,
        empty_dirs=tmp_path / "emptydir",
        pod_name=pod,
        host_ports={"grpc": grpc_port, "bulk": bulk_port},
        token_sha256=hashlib.sha256(token.encode()).hexdigest(),
    )
    manifest.write_text(yaml.safe_dump_all(objects))
    started = time.monotonic()
    try:
        podman("kube", "play", str(manifest), timeout_s=600)
        logs = ""
        while "serving on" not in logs:
            state = podman("inspect", "--format", "{{.State.Status}}", server)
            logs = subprocess.run(
                ["podman", "logs", server],
                capture_output=True, text=True, env=podman.env, timeout=60,
            ).stdout  # fmt: skip
            assert state.strip() == "running", podman("logs", server, check=False)
            time.sleep(0.1)
        print(f"\nkube play: server ready {time.monotonic() - started:.2f} s after kube play")
        address = f"127.0.0.1:{grpc_port}"
        tls = ["--tls-ca", "/run/ca.crt", "--tls-server-name", SERVICE_NAME]
        client = ["--network", "host", "--read-only", "--cap-drop=ALL"]
        ca_mount = ["-v", f"{ca.cert_path}:/run/ca.crt:ro"]
        health = podman.run(
            *client, *ca_mount, image, "kvshare", "health", "--address", address, *tls
        )
        assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
        token_file = tmp_path / "token"
        token_file.write_text(token)
        token_file.chmod(0o644)
        smoke = podman.run(
            *client, *ca_mount, "-v", f"{token_file}:/run/a.token:ro", image,
            "python3", "-c", SMOKE, address, "/run/a.token", "acme", "/run/ca.crt",
        )  # fmt: skip
        assert smoke.returncode == 0, smoke.stderr[-2000:]
        assert smoke.stdout.strip() == f"smoke ok uid {UID}"
        # And from the host, through the same published Service ports.
        digest = os.urandom(32)
        sealer = BlockSealer(Keyring.parse_toml(new_key_entry("acme", 1), "test"))
        payload = sealer.seal("acme", MODEL, digest, os.urandom(1 << 20))
        tls_client = ClientTls(root_ca=ca.cert_path)
        with BlockClient(address, token, tls=tls_client, same_host=False) as host_client:
            assert host_client.put("acme", MODEL, [digest], [payload]) == [True]
            assert host_client.get("acme", MODEL, [digest]) == [payload]
        # The pod runs as the server's user with a read-only root file system.
        wrote = subprocess.run(
            ["podman", "exec", server, "python3", "-c", "open('/x', 'w')"],
            capture_output=True, text=True, env=podman.env, timeout=60,
        )  # fmt: skip
        assert wrote.returncode != 0 and "Read-only file system" in wrote.stderr
    finally:
        podman("kube", "down", str(manifest), check=False, timeout_s=300)
        podman("pod", "rm", "-f", pod, check=False)
        for played in objects:  # kube play keeps a volume per ConfigMap
            if played["kind"] == "ConfigMap":
                podman("volume", "rm", "-f", played["metadata"]["name"], check=False)


def scale_out_pods(
    objects: list[dict[str, Any]],
    *,
    image: str,
    tmp_path: Path,
    secrets_dir: Path,
    names: list[str],
    ports: list[int],
    edit_toml: Callable[[str], str],
) -> list[dict[str, Any]]:
    """The scale-out overlay's servers as host-network pods, one per entry of `names`,
    each on its own loopback ports (`ports[i]` for gRPC, the next for bulk): the Redis
    Cluster runs on the host's loopback, which a pod on a bridge network cannot reach.
    Beyond `playable`'s transform, each pod gets its own copy of the ConfigMap with
    `listen`, `[bulk] listen` and `metrics_listen` on 127.0.0.1 and its bulk port
    announced (the overlay announces its pod's DNS name), and the probes ask its port."""
    statefulset = next(o for o in objects if o["kind"] == "StatefulSet")
    base = next(o for o in objects if o["kind"] == "ConfigMap")
    played: list[dict[str, Any]] = []
    for index, (name, port) in enumerate(zip(names, ports, strict=True)):
        configmap = copy.deepcopy(base)
        configmap["metadata"]["name"] = f"{name}-config"
        toml = edit_toml(configmap["data"]["kvshare.toml"])
        toml = toml.replace('"0.0.0.0:50051"', f'"127.0.0.1:{port}"')
        toml = toml.replace('"0.0.0.0:50052"', f'"127.0.0.1:{port + 1}"')
        toml = re.sub(r'(?m)^metrics_listen = "[^"]*"', 'metrics_listen = ""', toml)
        configmap["data"]["kvshare.toml"] = toml
        spec = copy.deepcopy(statefulset["spec"]["template"]["spec"])
        spec["hostNetwork"] = True
        for volume in spec["volumes"]:
            if "configMap" in volume:
                volume["configMap"]["name"] = configmap["metadata"]["name"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            container["image"] = image
            container.pop("ports", None)
            container.pop("env", None)
            for limits in container.get("resources", {}).values():
                limits.pop("cpu", None)
        server = next(c for c in spec["containers"] if c["name"] == "kvshare")
        command = server["command"]
        assert command[command.index("--bulk-advertise") + 1].startswith("$(POD_NAME).")
        server["command"] = [
            *command[: command.index("--bulk-advertise")],
            "--bulk-advertise",
            f"127.0.0.1:{port + 1}",
        ]
        probes = json.dumps({k: server[k] for k in server if k.endswith("Probe")})
        server.update(json.loads(probes.replace("127.0.0.1:50051", f"127.0.0.1:{port}")))
        spec["volumes"] = host_volumes(
            statefulset,
            spec,
            secrets_dir,
            owned_dir(tmp_path / f"data{index}"),
            tmp_path / f"emptydir{index}",
        )
        played += [configmap, pod_of(statefulset, name, spec)]
    return played


def owned_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    os.chown(path, UID, UID)
    return path


def wait_serving(podman: Podman, container: str) -> None:
    logs = ""
    while "serving on" not in logs:
        state = podman("inspect", "--format", "{{.State.Status}}", container).strip()
        assert state == "running", podman("logs", container, check=False)
        logs = subprocess.run(
            ["podman", "logs", container], capture_output=True, text=True, env=podman.env
        ).stdout
        time.sleep(0.1)


def test_kube_play_of_the_scale_out_overlay_two_servers_share_a_redis_cluster(
    podman: Podman, image: str, tmp_path: Path
) -> None:
    """Two servers of the scale-out overlay over a 3-node Redis Cluster (TLS, password,
    on the host's loopback): a block put through one is read through the other."""
    if shutil.which("kubectl") is None or shutil.which("redis-server") is None:
        pytest.skip("kubectl (kustomize) and redis-server are needed")
    ca = TestCA(tmp_path / "ca")
    node_cert = ca.server_cert("redis-node")
    peer = ca.client_cert("redis-peer", common_name="redis-node")
    password = secrets.token_urlsafe(16)
    access = ClusterAccess(
        ca.cert_path,
        node_cert.cert,
        node_cert.key,
        peer.cert,
        peer.key,
        username="kvshare",
        password=password,
        key_pattern="kvshare:*",
    )
    secrets_dir = service_secrets(tmp_path / "secrets", ca)  # one naming key: one store
    shutil.copy(ca.cert_path, secrets_dir / "redis-ca.crt")  # the Secret kvshare-redis
    (secrets_dir / "redis.password").write_text(password + "\n")
    for path in (secrets_dir, *secrets_dir.iterdir()):
        os.chown(path, UID, UID)
    token = secrets.token_urlsafe(24)
    token_sha256 = hashlib.sha256(token.encode()).hexdigest()
    suffix = secrets.token_hex(4)
    names = [f"kvshare-test-{suffix}-{i}" for i in range(2)]
    ports = free_ports(4)
    ports = [ports[0], ports[2]]

    with LocalRedisCluster(tmp_path / "redis", primaries=3, access=access) as cluster:
        seeds = json.dumps(cluster.seeds)

        def edit(toml: str) -> str:
            assert "0" * 64 in toml
            toml = toml.replace("0" * 64, token_sha256)
            # The test's cluster authenticates an ACL user confined to kvshare's keys.
            return re.sub(
                r"(?m)^nodes = .*$", f'nodes = {seeds}\nusername = "kvshare"', toml, count=1
            )

        manifest = tmp_path / "play.yaml"
        objects = scale_out_pods(
            render("scale-out"),
            image=image,
            tmp_path=tmp_path,
            secrets_dir=secrets_dir,
            names=names,
            ports=ports,
            edit_toml=edit,
        )
        manifest.write_text(yaml.safe_dump_all(objects))
        try:
            podman("kube", "play", str(manifest), timeout_s=600)
            for name in names:
                wait_serving(podman, f"{name}-kvshare")
            tls = ClientTls(root_ca=ca.cert_path)
            sealer = BlockSealer(Keyring.parse_toml(new_key_entry("acme", 1), "test"))
            digests = [os.urandom(32) for _ in range(3)]
            plain = [os.urandom(256 << 10) for _ in digests]
            sealed = [sealer.seal("acme", MODEL, d, p) for d, p in zip(digests, plain, strict=True)]
            first, second = (f"127.0.0.1:{port}" for port in ports)
            with BlockClient(first, token, tls=tls, same_host=False) as writer:
                assert writer.put("acme", MODEL, digests, sealed) == [True] * 3
            # The second server has never seen these blocks: it finds them in the cluster
            # (shared behind the put's acknowledgement: wait until they are there).
            with BlockClient(second, token, tls=tls, same_host=False) as reader:
                for _ in range(600):  # up to about 2 minutes on a loaded host
                    if reader.lookup("acme", MODEL, digests) == 3:
                        break
                    time.sleep(0.2)
                got = reader.get("acme", MODEL, digests)
            opened = [sealer.open("acme", MODEL, d, g) for d, g in zip(digests, got, strict=True)]
            assert opened == plain
            health = podman.run(
                "--network", "host", "--read-only", "-v", f"{ca.cert_path}:/run/ca.crt:ro",
                image, "kvshare", "health", "--address", second, "--service", "kvshare.cluster",
                "--tls-ca", "/run/ca.crt", "--tls-server-name", SERVICE_NAME,
            )  # fmt: skip
            assert health.returncode == 0, health.stderr
        finally:
            podman("kube", "down", str(manifest), check=False, timeout_s=300)
            for name in names:
                podman("pod", "rm", "-f", name, check=False)
            for played in objects:  # kube play keeps a volume per ConfigMap
                if played["kind"] == "ConfigMap":
                    podman("volume", "rm", "-f", played["metadata"]["name"], check=False)
