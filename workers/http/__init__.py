"""The HTTP workers (``python -m workers.http``): the aiohttp app (``app``),
the work path's routes (``work``), queue state (``state``), the console
(``console`` and its static files), metrics (``metrics``), the error codes
(``errors``) and the API's description (``openapi``)."""
