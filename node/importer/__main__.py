"""``python -m node.importer FILE``: the same as ``python -m node import FILE``."""

import sys

from node.importer.cli import main

sys.exit(main())
