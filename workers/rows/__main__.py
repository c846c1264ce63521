import sys

from workers.rows.service import main

sys.exit(main())
