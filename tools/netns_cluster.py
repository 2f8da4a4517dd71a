#!/usr/bin/env python3
"""The network-namespace cluster moved into the lab: ``python -m smb2.testing.netns``
(the library is :mod:`smb2.testing.netns`).  This path keeps working for a release."""

import sys

from smb2.testing.netns.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
