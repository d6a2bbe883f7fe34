"""The image's final root file system, made from the builder's (deploy/image/build.sh).

    python assemble.py version REPO            # the version in pyproject.toml
    python assemble.py inputs REPO             # hash of what the image is built from
    python assemble.py containers-conf         # podman settings for this host
    python assemble.py rootfs REPO BUILDER OUT # the final root file system in OUT

`rootfs` copies from BUILDER (a Debian root file system with python3 and the venv at
/opt/kvshare) only the files of the Debian packages the interpreter needs at run time:
the dependency closure of python3 and the C++ runtime (grpcio's), as dpkg recorded it,
minus the packages that only install or administer a system (shell, dpkg, apt, perl,
debconf, coreutils). Then the venv, the user kvshare (10001:10001), the directories the
server writes (/var/lib/kvshare, /run/kvshare/journal, /tmp), a placeholder config, a
dpkg status file of what is in the image (for scanners) and an SBOM:
/usr/share/kvshare/sbom.cdx.json, CycloneDX 1.5 JSON, one component per Debian and
Python package, each with its purl.

Standard library only: it runs with the host's python3 before anything is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import sys
import tomllib
import uuid
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

UID = GID = 10001
PACKAGES = ("kvshare", "kvcommon", "cacheserver", "replica_agent", "policy")
# What the image runs: the interpreter, its standard library's C libraries, the C++
# runtime, the CA bundle (OTLP export over https, a Redis Cluster over TLS).
ROOTS: tuple[str, ...] = ("python3-minimal", "python3.11-minimal", "libpython3.11-stdlib")
ROOTS += ("libstdc++6", "libgcc-s1", "ca-certificates", "base-files", "tzdata", "netbase")
# Needed only to install or administer a system: never copied, even when depended on.
LEFT_OUT = frozenset(
    {
        "bash", "dash", "coreutils", "dpkg", "apt", "debconf", "perl-base", "debianutils",
        "sensible-utils", "findutils", "grep", "sed", "tar", "gzip", "util-linux",
        "login", "passwd", "mount", "diffutils", "hostname", "init-system-helpers",
        "ncurses-bin", "bsdutils", "libc-bin", "mawk", "openssl", "readline-common",
        "debian-archive-keyring", "gpgv", "usr-is-merged", "usrmerge",
    }
)  # fmt: skip
PLACEHOLDER_CONFIG = """\
# Placeholder: mount the deployment's kvshare.toml over this file (a ConfigMap, a bind
# mount). This one serves TLS on every interface with the certificate and key mounted
# under /etc/kvshare/secrets/, and admits nobody until principals are added.
listen = "0.0.0.0:50051"
data_dir = "/var/lib/kvshare"
secret_file = "/etc/kvshare/secrets/server.secret"

[tls]
cert = "/etc/kvshare/secrets/tls.crt"
key = "/etc/kvshare/secrets/tls.key"

[storage]
# A memory-backed volume; journal_bytes unset: the journal takes what it has free.
journal_dir = "/run/kvshare/journal"

[telemetry]
metrics_listen = "0.0.0.0:9464"
"""


def version(repo: Path) -> str:
    with (repo / "pyproject.toml").open("rb") as file:
        return str(tomllib.load(file)["project"]["version"])


def inputs(repo: Path) -> str:
    """sha256 over the image's inputs: paths and bytes, in a fixed order."""
    digest = hashlib.sha256()
    files = [repo / "pyproject.toml", repo / "constraints.txt"]
    files += sorted((repo / "deploy" / "image").rglob("*"))
    for package in PACKAGES:
        files += sorted((repo / package).rglob("*"))
    for path in files:
        if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        digest.update(str(path.relative_to(repo)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:32]


def containers_conf() -> str:
    """runc (crun refuses hybrid cgroups) and ulimits within this host's hard limits."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nofile = 65536 if nofile == resource.RLIM_INFINITY else min(nofile, 65536)
    nproc = 4096 if nproc == resource.RLIM_INFINITY else min(nproc, 4096)
    return (
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
    )


def dpkg_status(builder: Path) -> dict[str, dict[str, str]]:
    """Installed packages by name: each stanza's fields (continuation lines kept)."""
    text = (builder / "var/lib/dpkg/status").read_text(encoding="utf-8")
    packages: dict[str, dict[str, str]] = {}
    for stanza in text.strip().split("\n\n"):
        fields: dict[str, str] = {}
        key = ""
        for line in stanza.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line
            else:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        fields["_stanza"] = stanza
        if "installed" in fields.get("Status", ""):
            packages[fields["Package"].split(":")[0]] = fields
    return packages


def closure(packages: dict[str, dict[str, str]]) -> list[str]:
    """ROOTS and everything they depend on (the first installed alternative), minus
    LEFT_OUT."""
    provides: dict[str, str] = {}
    for name, fields in packages.items():
        for item in fields.get("Provides", "").split(","):
            if item.strip():
                provides.setdefault(item.split("(")[0].strip(), name)
    wanted: set[str] = set()
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        name = name if name in packages else provides.get(name, "")
        if not name or name in wanted or name in LEFT_OUT:
            continue
        wanted.add(name)
        fields = packages[name]
        for key in ("Pre-Depends", "Depends"):
            for group in fields.get(key, "").split(","):
                choices = [c.split("(")[0].split(":")[0].strip() for c in group.split("|")]
                installed = [c for c in choices if c in packages or c in provides]
                if installed:
                    todo.append(installed[0])
    return sorted(wanted)


def copy_path(builder: Path, out: Path, path: str) -> None:
    """Copy one file or link recorded by dpkg (directories are made as needed)."""
    source = builder / path.lstrip("/")
    if not source.is_symlink() and source.is_dir():
        (out / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        return
    if not source.is_symlink() and not source.exists():
        return  # a conffile removed, a diverted file
    target = out / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.exists():
        return
    if source.is_symlink():
        target.symlink_to(source.readlink())
    else:
        shutil.copy2(source, target)


def rootfs(repo: Path, builder: Path, out: Path) -> None:
    out.mkdir(parents=True)
    # The merged-/usr links first (/bin -> usr/bin, /lib64 -> usr/lib64, ...).
    for entry in sorted(builder.iterdir()):
        if entry.is_symlink():
            (out / entry.name).symlink_to(entry.readlink())
            if entry.is_dir():  # its target, e.g. usr/lib64
                (out / str(entry.readlink()).lstrip("/")).mkdir(parents=True, exist_ok=True)
    packages = dpkg_status(builder)
    chosen = closure(packages)
    info = builder / "var/lib/dpkg/info"
    for name in chosen:
        arch = packages[name].get("Architecture", "")
        listing = info / f"{name}.list"
        if not listing.exists():
            listing = info / f"{name}:{arch}.list"
        for path in listing.read_text(encoding="utf-8").splitlines():
            if path not in ("/.", ""):
                copy_path(builder, out, path)
    # What maintainer scripts made: the standard library's compiled modules, the CA
    # bundle, the venv.
    for made in ("usr/lib/python3.11", "etc/ssl/certs", "opt/kvshare"):
        for walked, dirs, files in os.walk(builder / made):
            for child in dirs + files:
                copy_path(builder, out, "/" + str((Path(walked) / child).relative_to(builder)))
    for leftover in ("usr/lib/python3.11/ensurepip", "usr/share/doc", "usr/share/man"):
        shutil.rmtree(out / leftover, ignore_errors=True)
    scripts = out / "opt/kvshare/bin"
    for script in ("activate", "activate.csh", "activate.fish", "Activate.ps1"):
        (scripts / script).unlink(missing_ok=True)
    kvshare = scripts / "kvshare"
    kvshare.write_text(
        "#!/opt/kvshare/bin/python3\nimport sys\n\nfrom kvshare.cli import main\n\n"
        "sys.exit(main())\n",
        encoding="utf-8",
    )
    kvshare.chmod(0o755)
    _system_files(out, packages, chosen)
    _write_sbom(repo, out, packages, chosen)
    for shell in ("bin/sh", "bin/bash", "bin/dash", "usr/bin/apt", "usr/bin/dpkg"):
        if (out / shell).exists() or (out / shell).is_symlink():
            raise SystemExit(f"assemble.py: {shell} made it into the image; check LEFT_OUT")


def _system_files(out: Path, packages: dict[str, dict[str, str]], chosen: list[str]) -> None:
    etc = out / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text(
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"kvshare:x:{UID}:{GID}:kvshare:/var/lib/kvshare:/usr/sbin/nologin\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        encoding="utf-8",
    )
    (etc / "group").write_text(f"root:x:0:\nkvshare:x:{GID}:\nnogroup:x:65534:\n", encoding="utf-8")
    for name in ("hostname", "hosts", "resolv.conf"):  # the runtime mounts its own
        (etc / name).write_text("", encoding="utf-8")
    config = etc / "kvshare"
    (config / "secrets").mkdir(parents=True)
    (config / "kvshare.toml").write_text(PLACEHOLDER_CONFIG, encoding="utf-8")
    (config / "secrets").chmod(0o750)  # the group is the server's: it reads them
    os.chown(config / "secrets", 0, GID)
    for directory, mode in (("tmp", 0o1777), ("var/tmp", 0o1777), ("root", 0o700)):
        (out / directory).mkdir(parents=True, exist_ok=True)
        (out / directory).chmod(mode)
    for directory in ("var/lib/kvshare", "run/kvshare", "run/kvshare/journal"):
        (out / directory).mkdir(parents=True, exist_ok=True)
        (out / directory).chmod(0o700)
        os.chown(out / directory, UID, GID)
    status = out / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True, exist_ok=True)
    status.write_text(
        "\n\n".join(packages[name]["_stanza"] for name in chosen) + "\n", encoding="utf-8"
    )


def _python_packages(site: Path) -> list[dict[str, str]]:
    found = []
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        headers = HeaderParser().parsestr(meta.read_text(encoding="utf-8", errors="replace"))
        found.append(
            {
                "name": headers["Name"],
                "version": headers["Version"],
                "license": headers.get("License-Expression") or headers.get("License") or "",
            }
        )
    return found


def _write_sbom(
    repo: Path, out: Path, packages: dict[str, dict[str, str]], chosen: list[str]
) -> None:
    components = []
    for name in chosen:
        fields = packages[name]
        arch = fields.get("Architecture", "all")
        components.append(
            {
                "type": "library" if name.startswith("lib") else "application",
                "bom-ref": f"deb:{name}",
                "name": name,
                "version": fields["Version"],
                "purl": f"pkg:deb/debian/{name}@{fields['Version']}?arch={arch}&distro=debian-12",
                "supplier": {"name": "Debian"},
            }
        )
    site = out / "opt/kvshare/lib/python3.11/site-packages"
    for dist in _python_packages(site):
        normalised = dist["name"].lower().replace("_", "-").replace(".", "-")
        component: dict[str, Any] = {
            "type": "library",
            "bom-ref": f"pypi:{normalised}",
            "name": dist["name"],
            "version": dist["version"],
            "purl": f"pkg:pypi/{normalised}@{dist['version']}",
        }
        if dist["license"] and len(dist["license"]) < 100:
            component["licenses"] = [{"expression": dist["license"]}]
        components.append(component)
    image_version = version(repo)
    content = json.dumps(components, sort_keys=True).encode()
    sbom = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, content.hex()[:4096])}",
        "version": 1,
        "metadata": {
            "component": {
                "type": "container",
                "bom-ref": "image",
                "name": "localhost/kvshare",
                "version": image_version,
                "licenses": [{"expression": "Apache-2.0"}],
            },
            "tools": {"components": [{"type": "application", "name": "deploy/image/assemble.py"}]},
        },
        "components": components,
    }
    target = out / "usr/share/kvshare/sbom.cdx.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(sbom, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    match argv:
        case ["version", repo]:
            print(version(Path(repo)))
        case ["inputs", repo]:
            print(inputs(Path(repo)))
        case ["containers-conf"]:
            print(containers_conf(), end="")
        case ["rootfs", repo, builder, out]:
            rootfs(Path(repo), Path(builder), Path(out))
        case _:
            print(__doc__, file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
