"""The Kubernetes manifests (deploy/k8s) as a cluster would take them.

Every overlay renders with `kubectl kustomize`; every object passes the Kubernetes
schemas (kubernetes-validate, strict: an unknown field is an error); the server pod meets
the "restricted" Pod Security Standard, probes the gRPC health service, and is selected
by a NetworkPolicy and a PodDisruptionBudget; the config the ConfigMap carries is loaded
by the server's own loader, and its paths and ports are the pod's mounts and ports. The
probe command is run against a real server started from that config.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from cacheserver.config import ServerConfig, load_config
from kvcommon.errors import ConfigError
from policy.naming import load_or_create_server_secret
from replica_agent.adapters.settings import parse_store_settings
from replica_agent.adapters.vllm_options import ENGINE_KEYS, parse_vllm_options
from tests.support.certs import TestCA
from tests.support.repo import REPO
from tests.support.servers import ServerProcess

K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("base", "overlays/single", "overlays/scale-out")
VLLM_EXAMPLE = K8S / "examples" / "vllm-replica.yaml"
# The oldest Kubernetes with every field the manifests use (a StatefulSet's
# persistentVolumeClaimRetentionPolicy is GA from 1.32), and the newest the validator has.
K8S_VERSIONS = ("1.32.0", kubernetes_validate.latest_version())
SERVER_UID = 10001
# What the docs tell operators to put in the Secret kvshare-secrets (docs/deploy.md).
SERVER_SECRET_KEYS = {"server.secret", "tls.crt", "tls.key", "ca.crt"}
# The "restricted" standard's volume types (Kubernetes' Pod Security Standards).
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}

Obj = dict[str, Any]


@cache
def _rendered(overlay: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        # kubectl is not in Debian's archive at a version that renders these overlays (its
        # kubernetes-client is 1.20), and no other source is reachable here: a machine
        # without it skips, and .ci/run says so in its log.
        pytest.skip("kubectl is missing: `kubectl kustomize` renders the overlays offline")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"kubectl kustomize {overlay}: {result.stderr}"
    return result.stdout


def render(overlay: str) -> list[Obj]:
    """The overlay's objects, as `kubectl kustomize` renders them (fresh copies)."""
    return [obj for obj in yaml.safe_load_all(_rendered(overlay)) if obj]


def yaml_objects(path: Path) -> list[Obj]:
    return [obj for obj in yaml.safe_load_all(path.read_text()) if obj]


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def server_set(objects: list[Obj]) -> Obj:
    return one(objects, "StatefulSet", "kvshare")


def server_container(pod: Obj) -> Obj:
    (container,) = (c for c in pod["containers"] if c["name"] == "kvshare")
    found: Obj = container
    return found


def all_containers(pod: Obj) -> Iterator[Obj]:
    yield from pod.get("initContainers", [])
    yield from pod["containers"]
    yield from pod.get("ephemeralContainers", [])


def restricted_violations(pod: Obj) -> list[str]:
    """What in a pod spec breaks the "restricted" Pod Security Standard (the baseline
    profile's rules and the restricted profile's own), or our own additions to it
    (a read-only root file system). Empty: the pod is admitted under `restricted`."""
    problems = []
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            problems.append(f"pod {flag}")
    context = pod.get("securityContext", {})
    if context.get("sysctls"):
        problems.append("pod sysctls")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']}: {sorted(kinds)}")
    for container in all_containers(pod):
        name = container["name"]
        own = container.get("securityContext", {})

        def setting(key: str, own: Obj = own) -> Any:
            return own.get(key, context.get(key))

        if own.get("privileged"):
            problems.append(f"{name}: privileged")
        if own.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if setting("runAsNonRoot") is not True:
            problems.append(f"{name}: runAsNonRoot is not true")
        if setting("runAsUser") in (0, None):
            problems.append(f"{name}: runAsUser unset or 0")
        if (setting("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile is not RuntimeDefault or Localhost")
        capabilities = own.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities {capabilities['add']}")
        if own.get("procMount", "Default") != "Default":
            problems.append(f"{name}: procMount")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            problems.append(f"{name}: hostPort")
        if own.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: root file system is writable")
    return problems


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels only: the manifests use no expressions) on labels."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def mounts(container: Obj) -> dict[str, str]:
    """mount path -> volume name."""
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def volume_under(path: str | Path, container: Obj) -> str:
    """The volume a path of the container lies on (the deepest mount above it)."""
    text = str(path)
    above = [m for m in mounts(container) if text == m or text.startswith(m.rstrip("/") + "/")]
    assert above, f"{text} is on no volume of {container['name']} (the root is read-only)"
    return mounts(container)[max(above, key=len)]


def quantity_bytes(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def config_of(objects: list[Obj], tmp_path: Path) -> tuple[str, ServerConfig]:
    """The ConfigMap's kvshare.toml as the server loads it (cacheserver.config)."""
    text = one(objects, "ConfigMap")["data"]["kvshare.toml"]
    path = tmp_path / "kvshare.toml"
    path.write_text(text)
    return text, load_config(path)


# -- rendering and schemas -------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_each_object_passes_the_kubernetes_schemas(
    overlay: str,
) -> None:
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget"} <= kinds
    for obj in objects:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_vllm_example_passes_the_kubernetes_schemas() -> None:
    objects = yaml_objects(VLLM_EXAMPLE)
    assert {o["kind"] for o in objects} == {"Namespace", "ConfigMap", "Deployment"}
    for obj in objects:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_check_refuses_a_misspelt_field_and_a_wrong_type() -> None:
    """Positive control: the validation above is not vacuous."""
    misspelt = server_set(render("overlays/single"))
    server_container(misspelt["spec"]["template"]["spec"])["securityContext"]["runAsNonroot"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="runAsNonroot"):
        kubernetes_validate.validate(misspelt, K8S_VERSIONS[0], strict=True)
    wrong = server_set(render("overlays/single"))
    wrong["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError, match="'one'"):
        kubernetes_validate.validate(wrong, K8S_VERSIONS[0], strict=True)


# -- the server pod ----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_server_pod_meets_the_restricted_pod_security_standard(overlay: str) -> None:
    pod = server_set(render(overlay))["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    assert pod["securityContext"]["runAsUser"] == SERVER_UID
    assert pod["securityContext"]["runAsGroup"] == SERVER_UID
    assert pod["automountServiceAccountToken"] is False


def test_the_overlays_namespace_enforces_the_restricted_standard() -> None:
    for overlay in ("overlays/single", "overlays/scale-out"):
        objects = render(overlay)
        namespace = one(objects, "Namespace")
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {
            namespace["metadata"]["name"]
        }


def test_the_restricted_check_finds_each_kind_of_violation() -> None:
    """Positive control: each change below breaks `restricted`, and the check says so."""
    pod = server_set(render("overlays/single"))["spec"]["template"]["spec"]
    init = "initContainers"

    def broken(change: str) -> Obj:
        spec: Obj = copy.deepcopy(pod)
        container = server_container(spec)
        match change:
            case "root":
                spec["securityContext"]["runAsUser"] = 0
            case "nonroot":
                del spec["securityContext"]["runAsNonRoot"]
            case "escalation":
                spec[init][0]["securityContext"]["allowPrivilegeEscalation"] = True
            case "capability":
                container["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN"]
            case "drop":
                container["securityContext"]["capabilities"]["drop"] = []
            case "seccomp":
                spec["securityContext"]["seccompProfile"]["type"] = "Unconfined"
            case "hostpath":
                spec["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
            case "privileged":
                container["securityContext"]["privileged"] = True
            case "hostnetwork":
                spec["hostNetwork"] = True
            case "writable":
                container["securityContext"]["readOnlyRootFilesystem"] = False
        return spec

    changes = ["root", "nonroot", "escalation", "capability", "drop", "seccomp"]
    changes += ["hostpath", "privileged", "hostnetwork", "writable"]
    for change in changes:
        assert restricted_violations(broken(change)), change


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_server_is_probed_through_its_grpc_health_service(overlay: str) -> None:
    """Startup, readiness and liveness ask grpc.health.v1 on the gRPC port. Through
    `kvshare health` (TLS), not the kubelet's own `grpc:` probe, which has no TLS."""
    container = server_container(server_set(render(overlay))["spec"]["template"]["spec"])
    (grpc_port,) = (p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        if "grpc" in probe:
            assert probe["grpc"]["port"] == grpc_port, kind
            continue
        command = probe["exec"]["command"]
        assert command[:4] == ["kvshare", "health", "--address", f"127.0.0.1:{grpc_port}"], kind
        assert command[command.index("--tls-ca") + 1].startswith("/etc/kvshare/secrets/")
        assert probe["timeoutSeconds"] <= probe["periodSeconds"], kind
    assert container["livenessProbe"]["failureThreshold"] >= 3  # no restart on one slow answer


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_network_policy_admits_only_the_replicas_and_the_scraper(overlay: str) -> None:
    objects = render(overlay)
    labels = server_set(objects)["spec"]["template"]["metadata"]["labels"]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    (policy,) = (p for p in policies if selects(p["spec"]["podSelector"], labels))
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    container = server_container(server_set(objects)["spec"]["template"]["spec"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    admitted: dict[int, list[Obj]] = {}
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "an ingress rule without `from` admits everyone"
        for peer in rule["from"]:
            # Both selectors in one peer: the pod's labels AND its namespace's.
            assert peer["podSelector"]["matchLabels"] and peer["namespaceSelector"]["matchLabels"]
        for port in rule["ports"]:
            admitted.setdefault(port["port"], []).extend(rule["from"])
    assert set(admitted) == {ports["grpc"], ports["bulk"], ports["metrics"]}

    # The vLLM example's pods are admitted to gRPC and bulk, and only there.
    example = yaml_objects(VLLM_EXAMPLE)
    namespace_labels = one(example, "Namespace")["metadata"]["labels"]
    replica_labels = one(example, "Deployment")["spec"]["template"]["metadata"]["labels"]

    def admits(port: int, pod_labels: dict[str, str]) -> bool:
        return any(
            selects(peer["podSelector"], pod_labels)
            and selects(peer["namespaceSelector"], namespace_labels)
            for peer in admitted.get(port, [])
        )

    assert admits(ports["grpc"], replica_labels) and admits(ports["bulk"], replica_labels)
    assert not admits(ports["metrics"], replica_labels)
    unlabelled = {k: v for k, v in replica_labels.items() if not k.startswith("kvshare.io/")}
    assert not admits(ports["grpc"], unlabelled)  # control: the label is what admits


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_disruption_budget_lets_one_server_go_at_a_time(overlay: str) -> None:
    objects = render(overlay)
    statefulset = server_set(objects)
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    budget = one(objects, "PodDisruptionBudget")
    assert selects(budget["spec"]["selector"], labels)
    assert budget["spec"]["maxUnavailable"] == 1
    assert statefulset["spec"]["updateStrategy"]["type"] == "RollingUpdate"


# -- the config and the pod agree ------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_configmaps_config_is_loaded_by_the_server_and_names_the_pods_mounts(
    overlay: str, tmp_path: Path
) -> None:
    objects = render(overlay)
    _, config = config_of(objects, tmp_path)
    statefulset = server_set(objects)
    pod = statefulset["spec"]["template"]["spec"]
    container = server_container(pod)
    volumes = {v["name"]: v for v in pod["volumes"]}
    claims = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # The container runs the server on this config.
    command = container["command"]
    config_path = Path(command[command.index("--config") + 1])
    configmap = one(objects, "ConfigMap")["metadata"]["name"]  # kvshare-config-<hash>
    assert volumes[volume_under(config_path, container)]["configMap"]["name"] == configmap
    assert config_path.name == "kvshare.toml"
    assert config.access is not None and config.tls is not None  # tokens, TLS: no dev mode

    # Blocks on the volume claim; the journal on a memory-backed emptyDir it fits in.
    assert volume_under(config.data_dir, container) in claims
    assert config.data_dir != Path(next(m for m, v in mounts(container).items() if v in claims))
    journal = volumes[volume_under(config.storage.journal_dir, container)]["emptyDir"]
    assert journal["medium"] == "Memory"
    assert config.storage.journal_bytes <= quantity_bytes(journal["sizeLimit"])
    limit = quantity_bytes(container["resources"]["limits"]["memory"])
    assert config.storage.memory_budget_bytes + quantity_bytes(journal["sizeLimit"]) < limit

    # Every secret the server reads is a copy the init container makes from the Secrets.
    secret_files = [config.secret_path, config.tls.cert_chain, config.tls.private_key]
    if config.redis_cluster is not None:
        assert config.redis_cluster.password_file is not None
        assert config.redis_cluster.tls_ca is not None
        secret_files += [config.redis_cluster.password_file, config.redis_cluster.tls_ca]
    probe = container["readinessProbe"]["exec"]["command"]
    secret_files.append(Path(probe[probe.index("--tls-ca") + 1]))
    copies = volumes[volume_under(secret_files[0], container)]
    assert copies["emptyDir"]["medium"] == "Memory"
    provided: set[str] = set()
    for source in volumes["secret-volume"]["projected"]["sources"]:
        items = source["secret"].get("items")
        names = [i["path"] for i in items] if items else sorted(SERVER_SECRET_KEYS)
        provided.update(names)
    for path in secret_files:
        assert volume_under(path, container) == copies["name"] == "secrets", path
        assert path.name in provided, f"{path.name}: no Secret provides it"
    (init,) = pod["initContainers"]
    assert mounts(init)["/etc/kvshare/secrets"] == "secrets"
    assert mounts(init)["/etc/kvshare/secret-volume"] == "secret-volume"

    # Ports: the config's are the container's.
    assert config.listen == f"0.0.0.0:{ports['grpc']}"
    assert config.bulk.listen == f"0.0.0.0:{ports['bulk']}"
    assert config.telemetry.metrics_listen.endswith(f":{ports['metrics']}")
    assert config.bulk.same_host is False  # replicas are in other pods


def test_the_single_server_advertises_the_services_name_and_bulk_port(tmp_path: Path) -> None:
    objects = render("overlays/single")
    _, config = config_of(objects, tmp_path)
    service = one(objects, "Service", "kvshare")
    (bulk,) = (p for p in service["spec"]["ports"] if p["name"] == "bulk")
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert config.bulk.advertise == f"{name}.{namespace}.svc:{bulk['port']}"
    assert bulk["targetPort"] == "bulk"


def test_each_scaled_out_server_advertises_its_own_pod_name(tmp_path: Path) -> None:
    """A ticket is good only at the server that issued it: each announces its pod's
    DNS name under the headless Service, and all share one Redis Cluster and one
    naming secret."""
    objects = render("overlays/scale-out")
    _, config = config_of(objects, tmp_path)
    statefulset = server_set(objects)
    assert statefulset["spec"]["replicas"] >= 2
    headless = one(objects, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    container = server_container(statefulset["spec"]["template"]["spec"])
    command = container["command"]
    advertise = command[command.index("--bulk-advertise") + 1]
    (bulk,) = (p["port"] for p in headless["spec"]["ports"] if p["name"] == "bulk")
    assert advertise == f"$(POD_NAME).{headless['metadata']['name']}.$(POD_NAMESPACE).svc:{bulk}"
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert config.bulk.advertise == ""  # the flag, not the shared file, names the pod
    assert config.redis_cluster is not None and config.redis_cluster.tls
    assert config.secret_file is not None


def test_the_vllm_replica_reaches_the_store_with_its_secrets_through_the_connector() -> None:
    """The example's kv_transfer_config is one the connector accepts (its own parsers),
    names the single overlay's Service, and reads its token and keyring from owner-only
    copies of the Secret; the pod meets `restricted` too."""
    objects = yaml_objects(VLLM_EXAMPLE)
    transfer = json.loads(one(objects, "ConfigMap")["data"]["kv-transfer-config.json"])
    assert transfer["kv_connector"] == "KVShareConnector"
    assert transfer["kv_connector_module_path"] == "replica_agent.adapters.vllm"
    extra = transfer["kv_connector_extra_config"]
    settings = parse_store_settings(extra, source="example", engine_keys=ENGINE_KEYS)
    parse_vllm_options(extra, source="example")
    service = one(render("overlays/single"), "Service", "kvshare")
    (grpc,) = (p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    store = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert settings.targets == (f"{store}:{grpc}",)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    (engine,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert settings.keyring_file is not None and settings.tls is not None
    for path in (settings.token_file, settings.keyring_file, settings.tls.root_ca):
        assert path is not None
        copies = volumes[volume_under(path, engine)]
        assert copies["emptyDir"]["medium"] == "Memory", path
    assert volumes["secret-volume"]["secret"]["secretName"] == "vllm-kvshare"
    (init,) = pod["initContainers"]
    assert mounts(init)["/etc/kvshare/secrets"] == "secrets"


# -- the config and the probe, for real ----------------------------------------------------


@pytest.mark.slow
def test_the_single_overlays_config_serves_and_its_probe_answers(tmp_path: Path) -> None:
    """`kvshare serve` on the ConfigMap's own config (paths moved under tmp_path,
    addresses to loopback) with a certificate for the Service's name; the probe command
    of the manifest, run as the kubelet would, exits 0. Control: the same probe
    expecting another name in the certificate fails."""
    objects = render("overlays/single")
    text, _ = config_of(objects, tmp_path)
    container = server_container(server_set(objects)["spec"]["template"]["spec"])
    probe = container["readinessProbe"]["exec"]["command"]
    server_name = probe[probe.index("--tls-server-name") + 1]

    secrets_dir = tmp_path / "secrets"
    ca = TestCA(tmp_path / "ca")
    issued = ca._issue(
        "tls",
        server_name,
        [x509.DNSName(server_name)],
        ExtendedKeyUsageOID.SERVER_AUTH,
    )
    secrets_dir.mkdir()
    files = {"tls.crt": issued.cert, "tls.key": issued.key, "ca.crt": ca.cert_path}
    for name, source in files.items():
        shutil.copyfile(source, secrets_dir / name)
    (secrets_dir / "server.secret").write_bytes(os.urandom(32))
    for path in secrets_dir.iterdir():
        path.chmod(0o400)

    moves = {
        '"/etc/kvshare/secrets/': f'"{secrets_dir}/',
        '"/var/lib/kvshare/': f'"{tmp_path}/var/',
        '"/run/kvshare/': f'"{tmp_path}/run/',
        '"0.0.0.0:50051"': '"127.0.0.1:0"',
        '"0.0.0.0:50052"': '"127.0.0.1:0"',
        '"0.0.0.0:9464"': '"127.0.0.1:0"',
    }
    for old, new in moves.items():
        assert old in text, f"the config no longer has {old}: update this test"
        text = text.replace(old, new)
    config_file = tmp_path / "local.toml"
    config_file.write_text(text)
    tomllib.loads(text)

    server = ServerProcess("--config", str(config_file))
    try:

        def run_probe(command: list[str]) -> subprocess.CompletedProcess[str]:
            local = [
                part.replace("127.0.0.1:50051", server.address).replace(
                    "/etc/kvshare/secrets", str(secrets_dir)
                )
                for part in command
            ]
            assert local[0] == "kvshare"
            return subprocess.run(
                [sys.executable, "-m", "kvshare.cli", *local[1:]],
                capture_output=True,
                text=True,
                timeout=60,
            )

        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            answer = run_probe(container[kind]["exec"]["command"])
            assert answer.returncode == 0, f"{kind}: {answer.stderr}"
        wrong = [*probe]
        wrong[wrong.index("--tls-server-name") + 1] = "another.kvshare.svc"
        assert run_probe(wrong).returncode != 0
    finally:
        server.terminate()


# -- the secret copies, for real -------------------------------------------------------


def secret_volume(directory: Path, files: dict[str, bytes], version: int) -> None:
    """Lay out (or update) a Secret volume as the kubelet does: the files in a
    timestamped directory, `..data` a link to it, each name a link through `..data`;
    an update swaps `..data` in one rename."""
    directory.mkdir(exist_ok=True)
    timestamped = directory / f"..v{version}"
    timestamped.mkdir()
    for name, data in files.items():
        (timestamped / name).write_bytes(data)
        (timestamped / name).chmod(0o440)  # what fsGroup makes of defaultMode 0400
    staged = directory / "..data_tmp"
    staged.symlink_to(timestamped.name)
    staged.rename(directory / "..data")
    for name in files:
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")


def copy_script(container: Obj, source: Path, target: Path) -> str:
    script: str = container["command"][-1]
    for old, new in (("/etc/kvshare/secret-volume", source), ("/etc/kvshare/secrets", target)):
        assert f'"{old}"' in script
        script = script.replace(f'"{old}"', f'"{new}"')
    return script


def wait_for(check: Callable[[], bool], timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_servers_init_container_copies_the_secret_owner_only(tmp_path: Path) -> None:
    """The init container's own script, on a Secret volume laid out as the kubelet
    does (group-readable files behind links): the copies are regular files of mode
    0400 that the server's secret check accepts."""
    pod = server_set(render("overlays/single"))["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    source, target = tmp_path / "secret-volume", tmp_path / "secrets"
    target.mkdir()
    files = {"server.secret": os.urandom(32), "tls.key": b"key", "ca.crt": b"ca"}
    secret_volume(source, files, 1)
    script = copy_script(init, source, target)
    done = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in target.iterdir()) == sorted(files)
    for name, data in files.items():
        copy = target / name
        assert not copy.is_symlink() and copy.read_bytes() == data
        assert stat.S_IMODE(copy.stat().st_mode) == 0o400
    assert load_or_create_server_secret(target / "server.secret") == files["server.secret"]
    with pytest.raises(ConfigError, match="readable by group"):  # control: the original
        load_or_create_server_secret(source / "server.secret")


@pytest.mark.slow
def test_the_replicas_sidecar_follows_a_rotated_secret(tmp_path: Path) -> None:
    """The vLLM example's sidecar copies the Secret to 0400 files, and when the Secret
    changes replaces each changed copy by a rename (a new file the connector notices)."""
    pod = one(yaml_objects(VLLM_EXAMPLE), "Deployment")["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    assert sidecar["restartPolicy"] == "Always"
    source, target = tmp_path / "secret-volume", tmp_path / "secrets"
    target.mkdir()
    secret_volume(source, {"token": b"token-1", "keyring.toml": b"keys-1"}, 1)
    process = subprocess.Popen(
        [sys.executable, "-I", "-c", copy_script(sidecar, source, target)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert wait_for(lambda: (target / ".copied").exists()), "no first copy"
        token = target / "token"
        assert token.read_bytes() == b"token-1"
        assert stat.S_IMODE(token.stat().st_mode) == 0o400
        first = token.stat().st_ino
        secret_volume(source, {"token": b"token-2", "keyring.toml": b"keys-1"}, 2)
        assert wait_for(lambda: token.read_bytes() == b"token-2"), "the rotation was missed"
        assert token.stat().st_ino != first  # replaced by a rename, never rewritten
        assert stat.S_IMODE(token.stat().st_mode) == 0o400
        assert (target / "keyring.toml").read_bytes() == b"keys-1"
    finally:
        process.kill()
        _, errors = process.communicate(timeout=30)
    assert b"Traceback" not in errors, errors
