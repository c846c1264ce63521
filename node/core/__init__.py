"""The ground floor: what every other part of the node imports, and which
imports nothing else of the project (checked by the import-layer contracts in
pyproject.toml): the exception tree (``errors``), the configuration
(``config``; ``node.config`` names the same objects), every host-wide name
(``names``), row fields and their validation (``rows``), the one class
identity (``classes``), structured logs (``log``), process helpers and exit
codes (``proc``), metrics (``metrics``), and the data directory's identity
(``identity``)."""
