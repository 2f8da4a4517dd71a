#!/usr/bin/env python3
"""The benchmark moved into the package: ``smb2 bench replicated-lock`` (:mod:`smb2.bench.replicated_lock`).
This path keeps working for a release."""

import sys

from smb2.bench.replicated_lock import main

if __name__ == "__main__":
    sys.exit(main())
