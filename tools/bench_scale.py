#!/usr/bin/env python3
"""The benchmark lives in the package: ``smb2 bench scale`` (:mod:`smb2.bench.scale`)."""

import sys

from smb2.bench.scale import main

if __name__ == "__main__":
    sys.exit(main())
