import sys

from conductor.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
