import sys

from splitserve.entrypoints.cli import main

sys.exit(main())
