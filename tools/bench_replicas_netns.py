#!/usr/bin/env python3
"""The benchmark moved into the package: ``smb2 bench replicas-netns`` (:mod:`smb2.bench.replicas_netns`).
This path keeps working for a release."""

import sys

from smb2.bench.replicas_netns import main

if __name__ == "__main__":
    sys.exit(main())
