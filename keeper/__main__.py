"""``python -m keeper``: the keeper process, started by the supervisor (the
loop is keeper/loop.py)."""

import sys

from keeper.loop import main

sys.exit(main())
