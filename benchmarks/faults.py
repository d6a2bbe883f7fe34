"""Fault injection: named scenarios against real `kvshare serve` processes.

    python benchmarks/faults.py [--cycles 50] [--only NAME,...] [--json]

Scenarios (benchmarks/reliability/fault_scenarios*.py; each docstring says what passes):
  kill9          kill -9 under a write load, --cycles times, journal on and off in turn,
                 every acknowledged block checked after each restart
  disk_full      the data dir's file system full, then space given back (root: tmpfs)
  lmdb_map_full  an LMDB map smaller than the disk budget, journal off and on
  journal_full   the journal's tmpfs full (root)
  corrupt_files  bytes flipped in data.mdb and in the journal ring while stopped
  agents         an agent killed mid-PUT and one stalled mid-GET, beside another tenant
  server_paused  SIGSTOP/SIGCONT of the server under a replica agent (breaker)
  clock_jumps    the server's wall clock jumps a day back and forth (libfaketime)
  descriptor_flood  idle connections exhaust the server's descriptors; the bulk
                 listener says so and serves again once they end
  refused_put_memory  gRPC Puts refused after a 14 MiB frame give their memory back
  dripped_reply  a relay drips the bulk replies: the client's call ends at its deadline
  redis_node_shutdown  a Redis Cluster node shut down under two servers holding pooled
                 connections to it: no call fails, its blocks are misses (needs Redis)
  worker_killed_mid_read  a bulk worker killed -9 with a read transaction open: LMDB's
                 reader table keeps none of its slots, and LMDB stops growing under churn
A scenario that needs root or a tool it does not find is skipped with the reason
("passed": null). `--json` prints {"scenarios": [{"name", "passed", "detail"}],
"kill9_cycles", "acknowledged_lost", "torn_served"}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages

from benchmarks.reliability import fault_scenarios as f1
from benchmarks.reliability import fault_scenarios2 as f2
from benchmarks.reliability import fault_scenarios3 as f3
from benchmarks.reliability import fault_scenarios_cluster as fc
from benchmarks.reliability import fault_scenarios_workers as fw
from benchmarks.reliability.harness import private_journal_dir

SCENARIOS = {
    "kill9": None,  # needs --cycles: see run()
    "disk_full": f1.disk_full,
    "lmdb_map_full": f1.lmdb_map_full,
    "journal_full": f1.journal_tmpfs_full,
    "corrupt_files": f2.corrupt_files,
    "agents": f2.agents,
    "server_paused": f2.server_paused,
    "clock_jumps": f2.clock_jumps,
    "descriptor_flood": f3.descriptor_flood,
    "refused_put_memory": f3.refused_put_memory,
    "dripped_reply": f3.dripped_reply,
    "redis_node_shutdown": fc.redis_node_shutdown,
    "worker_killed_mid_read": fw.worker_killed_mid_read,
}


def run(name: str, cycles: int) -> f1.Outcome:
    directory = Path(tempfile.mkdtemp(prefix=f"kvshare-faults-{name}-"))
    with private_journal_dir() as journal_dir:
        env = f1.Env(directory, journal_dir)
        try:
            if name == "kill9":
                return f1.kill9_cycles(env, cycles)
            scenario = SCENARIOS[name]
            assert scenario is not None
            return scenario(env)
        except Exception as error:  # a scenario that breaks is a failed scenario
            tail = traceback.format_exception(error)[-1].strip()
            return f1.Outcome(False, f"scenario raised: {tail}")
        finally:
            env.close()
            shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=50, help="kill -9 cycles")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; use {', '.join(SCENARIOS)}")
    outcomes = {name: run(name, args.cycles) for name in names}
    scenarios = [{"name": n, "passed": o.passed, "detail": o.detail} for n, o in outcomes.items()]
    report = {
        "scenarios": scenarios,
        "kill9_cycles": sum(o.kill9_cycles for o in outcomes.values()),
        "acknowledged_lost": sum(o.acknowledged_lost for o in outcomes.values()),
        "torn_served": sum(o.torn_served for o in outcomes.values()),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for s in scenarios:
            verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[s["passed"]]
            print(f"{verdict} {s['name']}: {s['detail']}")
        print({k: v for k, v in report.items() if k != "scenarios"})
    return 0 if all(o.passed is not False for o in outcomes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
