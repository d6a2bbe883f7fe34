"""The long run of the store's model-based test (tests/reliability/test_store_model.py).

    python benchmarks/statemachine.py [--examples 500] [--steps 40] [--json]

Runs the hypothesis state machine of benchmarks/reliability/store_machine.py against
real `kvshare serve` processes: puts, gets, lookups, deletes, namespace deletes,
refused calls of principals without rights, quota and budget eviction, clean restarts
and kill -9 with the put journal on and off, every name read back after every step
and reconciled with the model. Exits 1 and prints the shrunk failing sequence on the
first violation. `--json` prints {"examples", "steps", "kill9", "clean_restarts",
"violations", "tolerated", "seconds"}; "tolerated" counts violations of known bugs
(store_machine.KNOWN_BUGS), each of which has an xfail test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages

from hypothesis import HealthCheck, settings

from benchmarks.reliability import store_machine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="sequences to run")
    parser.add_argument("--steps", type=int, default=40, help="most rules per sequence")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    started = time.monotonic()
    violation = ""
    try:
        store_machine.run(
            settings(
                max_examples=args.examples,
                stateful_step_count=args.steps,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                print_blob=True,
            )
        )
    except Exception as error:  # the shrunk failing sequence, as hypothesis reports it
        violation = "".join(traceback.format_exception(error))
    stats = store_machine.STATS
    report = {
        "examples": stats["examples"],
        "steps": stats["steps"],
        "kill9": stats["kill9"],
        "clean_restarts": stats["clean_restarts"],
        "violations": 1 if violation else 0,
        "tolerated": {
            k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("tolerated:")
        },
        "seconds": round(time.monotonic() - started, 1),
    }
    if violation:
        print(violation, file=sys.stderr)
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 1 if violation else 0


if __name__ == "__main__":
    raise SystemExit(main())
