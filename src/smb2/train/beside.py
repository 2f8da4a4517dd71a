"""Buffers kept beside a buffer (its "side buffers"), with one owner.

A parameter store keeps, beside its own buffer, each rank's optimizer state
(``<store>/optim/<rank>``), rank 0's frozen tensors (``<store>/frozen``),
DiLoCo's outer momentum (``<store>/outer``), rule allreduce's gradient sums
(``<store>/gradients``), the ranks' stability counts
(``<store>/counts``), the store itself while rank 0 makes it again for
another number of workers (``<store>/remaking``), and locks: the store's
own (``buffer:<store>``) and the locked rule's per-tensor ones
(``<store>/<tensor>``).  Every one is made, found and removed here:

* **named after the parent**: ``<parent>/<what>`` (:func:`name_of`), the
  store's own lock ``buffer:<parent>`` (:func:`lock_name`);
* **kept like the parent**: with its ``replicas``, so that a side buffer
  outlives a lost server exactly when the store does (a lock on a
  replicated store is a replicated lock, its words in the replicated buffer
  ``lock:<name>``);
* **removed with it**: :func:`remove` destroys the parent, every
  ``<parent>/...`` buffer and the words of its replicated locks, so that
  ``smb2 rm`` leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import logging

from ..client import DEFAULT_STRIPE, Buffer, Client
from ..errors import BufferConflict, NoSuchBuffer
from ..lock import Lock, ReplicatedLock, replicated_lock_buffer

log = logging.getLogger("smb2.train")

__all__ = ["discard", "find", "lock", "lock_name", "make", "name_of", "remove"]


def name_of(parent: str, what: str) -> str:
    """The side buffer ``what`` of ``parent``: ``<parent>/<what>``."""
    return f"{parent}/{what}"


def lock_name(parent: str, what: str | None = None) -> str:
    """The name of ``parent``'s own lock (``what`` None: the buffer's lock,
    ``buffer:<parent>``, as :meth:`smb2.Buffer.lock`), or of its lock
    ``what`` (``<parent>/<what>``)."""
    return f"buffer:{parent}" if what is None else name_of(parent, what)


def lock(client: Client, parent: Buffer, what: str | None = None,
         lease: float | None = None) -> Lock | ReplicatedLock:
    """``parent``'s lock (see :func:`lock_name`), kept like it: on as many
    servers as the buffer has copies."""
    name = lock_name(parent.name, what)
    if parent.replicas > 1:
        return client.replicated_lock(name, parent.replicas, lease=lease)
    return client.lock(name) if lease is None else client.lock(name, lease=lease)


async def make(client: Client, parent: str, what: str, nbytes: int, *, replicas: int,
               stripe: int | None = None, replace: bool = True) -> Buffer:
    """The side buffer ``what`` of ``parent``, of ``nbytes`` bytes with the
    parent's ``replicas``: the existing one where its size is right, else
    made (one of another size, an earlier store's of another model, is
    destroyed and made again; with ``replace=False`` it is left, and
    :class:`~smb2.BufferConflict` raised).  ``stripe``: None lets the
    client choose."""
    name = name_of(parent, what)
    try:
        buf = await client.attach(name)
    except NoSuchBuffer:
        buf = None
    if buf is not None:
        if buf.nbytes == nbytes:
            return buf
        if not replace:
            raise BufferConflict(f"side buffer {name!r} of {parent!r} holds {buf.nbytes} bytes, not {nbytes}",
                                 hint=f"remove it with `smb2 rm {name}`")
        log.debug("side buffer %r of %r: %d bytes, made again with %d", name, parent, buf.nbytes, nbytes)
        await client.destroy(name)
    try:
        return await client.create(name, nbytes, stripe=DEFAULT_STRIPE if stripe is None else stripe,
                                   replicas=replicas)
    except BufferConflict:
        buf = await client.attach(name)         # made by another rank in between
        if buf.nbytes != nbytes:
            raise
        return buf


async def find(client: Client, parent: str, what: str) -> Buffer:
    """The side buffer ``what`` of ``parent`` (:class:`~smb2.NoSuchBuffer`
    if there is none)."""
    return await client.attach(name_of(parent, what))


async def discard(client: Client, parent: str, what: str) -> bool:
    """Destroy the side buffer ``what`` of ``parent`` (one its owner no
    longer needs while the parent lives on); True if it existed."""
    return await client.destroy(name_of(parent, what))


def belongs(parent: str, name: str) -> bool:
    """Is buffer ``name`` kept beside ``parent`` (a side buffer, or the words
    of one of its replicated locks)?"""
    return (name.startswith(f"{parent}/") or name == replicated_lock_buffer(lock_name(parent))
            or name.startswith(replicated_lock_buffer(f"{parent}/")))


async def remove(client: Client, parent: str) -> bool:
    """Destroy ``parent`` and everything kept beside it; True if ``parent``
    existed."""
    companions = [b for b in await client.buffers() if belongs(parent, b)]
    existed = await client.destroy(parent)
    await asyncio.gather(*(client.destroy(b) for b in companions))
    return existed
