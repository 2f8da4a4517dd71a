"""Builds the compiled parts of smb2 (everything else is in pyproject.toml).

SMB2_DEBUG=1 makes a debug build: -O0 -g, Cython line tracing and an
annotated HTML file beside each .pyx.
"""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("SMB2_DEBUG") == "1"

directives = {"language_level": 3, "embedsignature": True}
macros = []
if DEBUG:
    directives.update(linetrace=True, boundscheck=True, wraparound=True)
    macros.append(("CYTHON_TRACE_NOGIL", "1"))
cflags = ["-O0", "-g"] if DEBUG else ["-O3"]

extensions = [
    Extension("smb2._core", ["src/smb2/_core.pyx"], extra_compile_args=cflags,
              define_macros=macros),
]

setup(ext_modules=cythonize(extensions, compiler_directives=directives, annotate=DEBUG))
