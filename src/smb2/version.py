"""smb2's version: the one place it is written.

The package metadata reads it at build time (pyproject.toml,
``[tool.setuptools.dynamic]``), ``smb2.__version__``, ``smb2 --version``,
``smb2-server --version`` and the server's ``smb2_server_info`` metric at run
time.  Bump it here, together with a section in CHANGELOG.md.
"""

__version__ = "0.1.0"
