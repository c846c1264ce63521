import sys

from workers.ledger.process import main

sys.exit(main())
