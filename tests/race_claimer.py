"""A claimer on the host that stops between its read and its grant, for
tests/acceptance/test_claim_race.py.

``python -m tests.race_claimer NAME DATA_DIR PATH``: one ``LocalClaimer``
claims one lease (PATH ``c``: the C claim path; ``python``: the Python path)
and prints it as one JSON line, then exits. Started with
``QUEUE_NODE_TEST_LEASE_STOP=read:stop`` (and the test build of shm's
extensions) it SIGSTOPs itself once it has read the entry's row and found it
due, before its grant: the test lets it go on with SIGCONT.
"""

from __future__ import annotations

import json
import sys

from node.client import LocalClaimer


def main() -> int:
    name, data_dir, path = sys.argv[1:4]
    claimer = LocalClaimer(name, data_dir=data_dir, consumer="late")
    if path == "python":
        claimer.claimer._c_path = False  # the Python path: the same steps, in Python
    assert claimer.claimer.on_c_path == (path == "c")
    grants = claimer.claim(1, lease_s=300)
    print(json.dumps([g._asdict() for g in grants]), flush=True)
    claimer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
