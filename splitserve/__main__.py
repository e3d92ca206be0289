import sys

from splitserve.entrypoints.cli import main

if __name__ == "__main__":  # not when the engine core process (spawn) imports this module
    sys.exit(main())
