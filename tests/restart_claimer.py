"""A long-lived GPU worker on the host, for tests/acceptance/test_restart_claimers.py.

``python -m tests.restart_claimer NAME DATA_DIR OUT STOP_FILE``: one
``LocalClaimer`` kept for the whole run, claiming one lease at a time and
completing it at once (retrying a completion the node cannot take yet), until
STOP_FILE exists. Every grant and every completion's final outcome is one
flushed JSON line in OUT, with the boot id of the segments it came from.
"""

from __future__ import annotations

import json
import os
import sys
import time

from node.client import ClientError, LocalClaimer

# A completion refused as retryable (503) is sent again for this long.
COMPLETE_DEADLINE_S = 120.0
# Pause between retries of a refused call: the polling interval of a
# deadline wait, not synchronisation.
RETRY_S = 0.05


def main() -> int:
    name, data_dir, out_path, stop_file = sys.argv[1:5]
    out = open(out_path, "a", buffering=1, encoding="utf-8")

    def say(**event: object) -> None:
        out.write(json.dumps({**event, "t": time.time()}) + "\n")

    claimer = LocalClaimer(name, data_dir=data_dir, consumer=f"gpu-{os.getpid()}")
    say(ev="attached", boot=claimer.boot_id)
    while not os.path.exists(stop_file):
        try:
            grants = claimer.claim(1, lease_s=300, wait_s=0.2)
        except ClientError as exc:
            say(ev="refused", status=exc.status, code=exc.code)
            time.sleep(RETRY_S)
            continue
        for grant in grants:
            say(ev="grant", key=grant.key, lease_id=grant.lease_id, boot=claimer.boot_id)
            deadline = time.monotonic() + COMPLETE_DEADLINE_S
            while True:
                try:
                    claimer.complete(grant.lease_id, grant.key, {"by": os.getpid()})
                except ClientError as exc:
                    if exc.status == 503 and time.monotonic() < deadline:
                        time.sleep(RETRY_S)
                        continue
                    say(ev="done", key=grant.key, lease_id=grant.lease_id, outcome=exc.code)
                    break
                say(ev="done", key=grant.key, lease_id=grant.lease_id, outcome="ok")
                break
    say(ev="stopped")
    claimer.close()
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
