"""The inference processes (``python -m workers.inference``), one per GPU,
running the user's handler (``process``)."""
