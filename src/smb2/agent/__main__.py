"""``python -m smb2.agent``: the ``smb2-agent`` command."""

import sys

from .cli import main

sys.exit(main())
