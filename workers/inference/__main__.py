import sys

from workers.inference.process import main

sys.exit(main())
