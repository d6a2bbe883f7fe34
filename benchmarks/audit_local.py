"""Run `kvshare audit timing` against a fresh local deployment, as docs/isolation.md
records it.

    python benchmarks/audit_local.py [--probes 400] [--tls] [--out FILE.json]

Starts `kvshare serve` in its own process (a temp data dir; tenants `alpha` and `beta`
with `read_public = true`, a `[public]` scope; principals made with `kvshare admin`:
`alpha-replica`, `beta-replica`, a publish-only `publisher`), writes their tokens to
owner-only files, runs the audit with beta as the attacker and alpha as the victim
(and the publisher for the public part), prints its JSON and its exit code, and stops
the server. `--tls` serves TLS with a self-signed certificate and passes `--tls-ca`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kvshare.bench.tls import write_self_signed
from policy.admin import issue_token, public_stanza, tenant_stanza

REPO = Path(__file__).resolve().parent.parent
PRINCIPALS = {
    "alpha-replica": (["alpha"], ["read", "write"]),
    "beta-replica": (["beta"], ["read", "write"]),
    "publisher": ([], ["publish"]),
}


def write_deployment(directory: Path, *, tls: bool) -> tuple[Path, dict[str, Path], Path | None]:
    """The config, each principal's token file, and the CA to trust (TLS)."""
    lines = [f'data_dir = "{directory / "data"}"', 'listen = "127.0.0.1:0"']
    ca = None
    if tls:
        cert, key = write_self_signed(directory)
        lines += ["[tls]", f'cert = "{cert}"', f'key = "{key}"']
        ca = cert
    stanzas = [public_stanza(256 << 20)]
    stanzas += [tenant_stanza(t, 1 << 30, read_public=True) for t in ("alpha", "beta")]
    tokens: dict[str, Path] = {}
    for name, (tenants, actions) in PRINCIPALS.items():
        issued = issue_token(name, tenants, actions)
        stanzas.append(issued.stanza)
        tokens[name] = directory / f"{name}.token"
        tokens[name].write_text(issued.token + "\n")
        tokens[name].chmod(0o600)
    config = directory / "kvshare.toml"
    config.write_text("\n".join(lines) + "\n\n" + "\n".join(stanzas))
    return config, tokens, ca


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=int, default=400)
    parser.add_argument("--tls", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvshare-audit-") as tmp:
        config, tokens, ca = write_deployment(Path(tmp), tls=args.tls)
        server = subprocess.Popen(
            [sys.executable, "-m", "kvshare.cli", "serve", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
        )
        try:
            assert server.stdout is not None
            address = next(
                m[1] for line in server.stdout if (m := re.search(r"serving on (\S+)", line))
            )
            command = [
                sys.executable, "-m", "kvshare.cli", "audit", "timing",
                "--target", address,
                "--attacker-tenant", "beta", "--attacker-token-file", str(tokens["beta-replica"]),
                "--victim-tenant", "alpha", "--victim-token-file", str(tokens["alpha-replica"]),
                "--publisher-token-file", str(tokens["publisher"]),
                "--probes", str(args.probes), "--json",
                *(["--tls-ca", str(ca)] if ca is not None else []),
            ]  # fmt: skip
            audit = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        finally:
            server.terminate()
            server.wait(30)
    sys.stderr.write(audit.stderr)
    if audit.returncode == 2 or not audit.stdout.strip():
        return audit.returncode or 2
    report = json.loads(audit.stdout)
    text = json.dumps(report, indent=1)
    print(text)
    print(f"exit code {audit.returncode} (verdict {report['verdict']})", file=sys.stderr)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return audit.returncode


if __name__ == "__main__":
    raise SystemExit(main())
