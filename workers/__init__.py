"""The node's worker processes, one package each, started by the supervisor:

- ``workers.http`` (``python -m workers.http --index I --listen-fd FD``): the
  HTTP API, claims straight from shared memory (``workers/claim/``);
- ``workers.ledger``: the completion log's single writer, delivery and the
  accounting;
- ``workers.inference``: one process a GPU running the user's handler.

``workers/claim/`` (the claim path) and ``workers/classes.py`` (the
``max_classes`` check) are shared by them.
"""
