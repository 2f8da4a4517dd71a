"""RDMA device discovery, shared by the server and the client side.

:func:`unavailable_reason` says why this process cannot use RDMA (no
``_verbs`` extension, no device, no ACTIVE port, no usable GID), or None.
:class:`Device` is one opened device port with a protection domain; a
process opens each (device, port, GID index) once (:func:`get_device`) and
keeps it: every queue pair and memory region of the process hangs off it,
which is what lets a client's registered arrays serve all its servers.

The GID defaults to the port's RoCE v2 GID that carries an IPv4 address
(IPv4-mapped, ``::ffff:a.b.c.d``), then any RoCE v2 GID, then index 0; on an
InfiniBand port the LID routes instead.  ``SMB2_RDMA_DEVICE`` and
``SMB2_RDMA_GID_INDEX`` set the defaults for both sides (the ``--rdma-device``
/ ``--rdma-gid-index`` options of ``smb2-server`` and the ``rdma_device`` /
``rdma_gid_index`` keywords of ``connect`` win over them).
"""

from __future__ import annotations

import importlib.util
import logging
import mmap
import os
import threading
from typing import Any

log = logging.getLogger("smb2.transport.rdma")

try:
    from . import _verbs
    _IMPORT_ERROR: str | None = None
except ImportError as exc:
    _verbs = None  # type: ignore[assignment]
    if importlib.util.find_spec(f"{__package__}._verbs") is None:
        _IMPORT_ERROR = ("smb2._verbs was not built: the libibverbs headers were missing "
                         "(apt-get install libibverbs-dev, then reinstall smb2)")
    else:  # built, but e.g. libibverbs.so.1 is not installed here
        _IMPORT_ERROR = (f"smb2._verbs does not load: {exc} (RDMA uses this host's libibverbs.so.1: "
                         "apt-get install libibverbs1, or rdma-core; TCP and shm work without it)")

_SYSFS = "/sys/class/infiniband"
_lock = threading.Lock()
_devices: dict[tuple[str | None, int, int | None], Device] = {}


def env_device() -> str | None:
    return os.environ.get("SMB2_RDMA_DEVICE") or None


def env_gid_index() -> int | None:
    v = os.environ.get("SMB2_RDMA_GID_INDEX")
    return int(v) if v not in (None, "") else None


def _gid_type(dev: str, port: int, index: int) -> str:
    try:
        with open(f"{_SYSFS}/{dev}/ports/{port}/gid_attrs/types/{index}") as f:
            return f.read().strip()
    except OSError:
        return ""


def _gid_str(gid: bytes) -> str:
    if gid[:12] == b"\0" * 10 + b"\xff\xff":
        return "::ffff:" + ".".join(str(b) for b in gid[12:])
    return ":".join(gid[i:i + 2].hex() for i in range(0, 16, 2))


class Device:
    """An opened device port: context, protection domain, addressing."""

    def __init__(self, name: str | None = None, port: int = 1, gid_index: int | None = None) -> None:
        if _verbs is None:
            raise OSError(f"no RDMA support in this smb2: {_IMPORT_ERROR}")
        names = _verbs.device_names()
        if not names:
            raise OSError("no RDMA device on this machine")
        if name is None:
            name = self._first_active(names, port)
        elif name not in names:
            raise OSError(f"no RDMA device named {name!r} (have: {', '.join(names)})")
        self.name = name
        self.port = port
        self.context = _verbs.Context(name)
        try:
            attr = self.context.query_port(port)
            if not attr["active"]:
                raise OSError(f"port {port} of {name} is not ACTIVE (state {attr['state']})")
            self.ethernet: bool = attr["ethernet"]
            self.lid: int = attr["lid"]
            self.mtu: int = attr["active_mtu"]
            self.device_attr: dict[str, Any] = self.context.query_device()
            self.gid_index: int = (gid_index if gid_index is not None
                                   else self._pick_gid(attr["gid_tbl_len"]))
            self.gid: bytes = self.context.query_gid(port, self.gid_index)
            if self.ethernet and self.gid == bytes(16):
                raise OSError(f"GID {self.gid_index} of {name} port {port} is empty "
                              "(RoCE needs an IP address on the netdev)")
            self.pd = _verbs.PD(self.context)
            self.table = _verbs.MRTable()
            self.max_sge: int = max(1, min(16, int(self.device_attr["max_sge"])))
            self.max_rd_atomic: int = max(1, min(16, int(self.device_attr["max_qp_rd_atom"])))
        except BaseException:
            self.context.close()
            raise
        log.debug("opened RDMA device %s port %d, GID %d (%s)", name, port, self.gid_index,
                  _gid_str(self.gid))

    @staticmethod
    def _first_active(names: list[str], port: int) -> str:
        assert _verbs is not None
        for n in names:
            try:
                with _verbs.Context(n) as ctx:
                    if ctx.query_port(port)["active"]:
                        return n
            except OSError:
                continue
        raise OSError(f"no RDMA device has an ACTIVE port {port} (devices: {', '.join(names)})")

    def _pick_gid(self, table_len: int) -> int:
        if not self.ethernet:
            return 0
        best: tuple[int, int] | None = None
        for i in range(table_len):
            try:
                gid = self.context.query_gid(self.port, i)
            except OSError:
                continue
            if gid == bytes(16):
                continue
            v2 = "v2" in _gid_type(self.name, self.port, i).lower()
            v4 = gid[:12] == b"\0" * 10 + b"\xff\xff"
            rank = (2 if v2 else 0) + (1 if v4 else 0)
            if best is None or rank > best[0]:
                best = (rank, i)
        if best is None:
            raise OSError(f"{self.name} port {self.port} has no usable GID "
                          "(is an IP address configured on its netdev?)")
        return best[1]

    @property
    def gid_text(self) -> str:
        return _gid_str(self.gid)

    def describe(self) -> dict[str, Any]:
        return {"device": self.name, "port": self.port, "gid_index": self.gid_index,
                "gid": self.gid_text, "lid": self.lid, "mtu": self.mtu}

    def register(self, obj: Any, access: int | None = None) -> Any:
        """Register ``obj``'s memory (local write) and make it findable by
        the data path (``table``)."""
        assert _verbs is not None
        mr = _verbs.MR(self.pd, obj, _verbs.ACCESS_LOCAL_WRITE if access is None else access)
        self.table.add(mr)
        return mr

    def unregister(self, mr: Any) -> None:
        self.table.remove(mr)
        mr.close()

    def close(self) -> None:
        self.context.close()


def get_device(name: str | None = None, gid_index: int | None = None, port: int = 1) -> Device:
    """The process's Device for these settings (opened on first use)."""
    name = name if name is not None else env_device()
    gid_index = gid_index if gid_index is not None else env_gid_index()
    key = (name, port, gid_index)
    with _lock:
        dev = _devices.get(key)
        if dev is None or dev.context.closed:
            dev = _devices[key] = Device(name, port, gid_index)
        return dev


def unavailable_reason(name: str | None = None, gid_index: int | None = None) -> str | None:
    """Why this process cannot do RDMA with these settings, or None."""
    if _verbs is None:
        return f"no RDMA support in this smb2: {_IMPORT_ERROR}"
    try:
        get_device(name, gid_index)
    except OSError as exc:
        return str(exc)
    return None


def alloc_pinned(size: int) -> mmap.mmap:
    """Page-aligned anonymous memory for a registered area."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
