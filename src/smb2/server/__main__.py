"""``python -m smb2.server``: the ``smb2-server`` command."""

import sys

from .cli import main

sys.exit(main())
