"""The campaign's inference handler: ``tests.campaign.handler:work``.

Each result carries the item's id (from the payload) and a fresh attempt
nonce, so the checker can tell one run from another. Every run is appended to
``$QN_CAMPAIGN_RUNS`` (one JSON line per item, flushed before the results go
back), so a run whose results were lost with a killed process still counts.
``$QN_CAMPAIGN_WORK_S`` is the simulated device time per item.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any


def work(items: list[dict[str, Any]]) -> list[Any]:
    by = f"inference-{os.getpid()}"
    # The simulated device time, so the outside consumer gets items too.
    time.sleep(float(os.environ.get("QN_CAMPAIGN_WORK_S") or 0) * len(items))
    now = time.time()
    results = []
    for item in items:
        payload = item.get("payload")
        item_id = payload.get("id") if isinstance(payload, dict) else None
        results.append({"id": item_id, "nonce": uuid.uuid4().hex[:12], "by": by})
    where = os.environ.get("QN_CAMPAIGN_RUNS")
    if where:
        lines = "".join(
            json.dumps({"t": now, "ev": "run", "key": i["key"], "lease_id": i["lease_id"], **r})
            + "\n"
            for i, r in zip(items, results, strict=True)
        )
        with open(where, "a", encoding="utf-8") as f:  # one write: lines never interleave
            f.write(lines)
            f.flush()
    return results
