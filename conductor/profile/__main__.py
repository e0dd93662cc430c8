import sys

from conductor.profile.cli import main

if __name__ == "__main__":  # vLLM spawns worker processes: the guard is required
    sys.exit(main())
