"""Workers 1..N: the HTTP API (``workers.http``), later the claim path.

``python -m workers --index I --listen-fd FD`` is one worker process, started
by the supervisor (``workers.__main__``).
"""
