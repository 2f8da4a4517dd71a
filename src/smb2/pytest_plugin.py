"""pytest plugin shipped with smb2 (entry point ``pytest11``).

Fixture ``smb2_cluster``: a running cluster for the test.  By default a
:class:`~smb2.LocalCluster` of 4 in-process servers on free ports; with
``SMB2_SERVERS=h:p,...`` set, those external servers instead (their buffers
are the test's to clean up).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

try:
    import pytest_asyncio
    HAVE_PYTEST_ASYNCIO = True
except ImportError:  # smb2 installed without its test extras: no fixture
    HAVE_PYTEST_ASYNCIO = False

if HAVE_PYTEST_ASYNCIO:
    @pytest_asyncio.fixture
    async def smb2_cluster() -> AsyncIterator[Any]:
        from .testing.cluster import ExternalCluster, LocalCluster, external_servers

        external = external_servers()
        if external:
            cluster: Any = ExternalCluster(external)
            try:
                yield cluster
            finally:
                await cluster.close()
            return
        async with LocalCluster(servers=4) as local:
            yield local
