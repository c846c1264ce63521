"""The ground floor: what every other part of the node imports, and which
imports nothing else of the project (checked by the import-layer contract in
pyproject.toml): the exception tree (``errors``), row fields and their
validation (``rows``), structured logs (``log``), process helpers and exit
codes (``proc``), metrics (``metrics``), and the data directory's identity
(``identity``)."""
