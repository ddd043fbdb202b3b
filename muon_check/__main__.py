"""`python -m muon_check`: the conformance check (muon_check.conformance's command line)."""

import sys

from .conformance import main

if __name__ == "__main__":
    sys.argv[0] = "python -m muon_check"  # the usage line names the command a user typed
    raise SystemExit(main())
