"""`python -m stcast`: the command line."""

import sys

if __name__ == "__main__":
    try:
        from .cli import main
    except KeyboardInterrupt:  # Ctrl-C while starting up: no traceback either
        sys.stderr.write("stcast: interrupted\n")
        sys.exit(130)
    sys.exit(main())
