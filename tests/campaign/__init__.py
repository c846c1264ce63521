"""A fault campaign against a real node, checked the way Jepsen checks a queue.

Four parts, each a module:

- ``workload``: the producer (rows with known ids through ``POST /rows``), the
  outside GPU consumer (claims over HTTP, completes with the item's id and an
  attempt nonce) and the receiver (polls ``/results``, acks), each logging
  every request and answer to a JSON-lines file; inside the node, inference
  processes run ``tests.campaign.handler:work``, which logs every run;
- ``nemesis``: a seeded random schedule of faults (kill -9 of any process of
  the node, SIGSTOP/SIGCONT, disk faults under the completion log, a clean
  restart mid-load), each printed with its time;
- ``checker``: a plain function over those logs, the table and
  ``GET /accounting``: counts every item as written, finished, acknowledged,
  lost, unexpected, duplicated (naming the docs/delivery.md window) or
  recovered, and says pass or fail;
- ``run``: puts them together (``scripts/campaign``, tests/campaign/test_campaign.py).

The partition campaign (``scripts/partition-campaign``) is the same over a
fleet in network namespaces: ``partition_fleet`` (the nodes, the cuts, the
fleet's clients and the cluster poller), ``partition_nemesis``,
``partition_checker`` (the rules extended for a fleet) and ``partition_run``
(tests/campaign/test_partition_campaign.py).

The whole story is in docs/reliability.md.
"""
