"""A buffer's parts and their identity: is every part of a buffer there,
and the same buffer?

Every part (one per server) carries the buffer's identity: the random
``buffer_id`` its creator chose, with the geometry (size, stripe, part count)
and its own index.  Part 0 is made first and sealed last (once every part
exists), so a part missing beside a sealed part 0 was lost (its server
restarted without its data), never still being made.  :func:`judge` reads
the parts ``create``/``lookup`` found and names the lost ones;
:func:`damaged` says so as a :class:`~smb2.errors.BufferDamaged`.
(docs/protocol.md, "Buffer identity"; the client's side is in
:meth:`smb2.Client.create` and :meth:`smb2.Client.attach`.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from .errors import BufferDamaged
from .placement import first_server

#: how many lost ranges a message lists before it says "and N more"
SHOWN_RANGES = 4
#: the ``server_id`` of a part a lazy client's ``attach`` has not looked up
#: yet (:func:`unseen`): no server process has it, so the part is looked up
#: on its server's first use, as after a restart
UNSEEN: Any = object()
#: the segment id a lost part's place gets in ``BufferDamaged.remains``: no
#: server hands it out (ids count up from 1), so a request there is refused
NO_SEGMENT = (1 << 32) - 1


def judge(infos: Sequence[dict[str, Any] | None], *,
          created_now: Sequence[bool] = ()) -> tuple[str | None, dict[int, str]]:
    """The buffer's identity and its lost parts, from what each server
    answered for its part (None: it has none).  ``created_now``: which
    parts the caller's own ``create`` just made (zeros).

    The identity is part 0's, unless part 0 is missing or was made just now
    beside older parts: then the one most of the other parts carry.  A part
    is lost when it carries another identity, or (once part 0 was sealed)
    when it is missing or had to be made now.  Returns (identity, {part:
    why}); parts of a creation still under way (part 0 not sealed yet) are
    not lost."""
    made = list(created_now) or [False] * len(infos)
    anchor = infos[0]
    older = Counter(i["buffer_id"] for i, new in zip(infos[1:], made[1:])
                    if i is not None and not new and "buffer_id" in i)
    if anchor is not None and not made[0]:
        truth = anchor.get("buffer_id")
    elif older:
        truth = older.most_common(1)[0][0]
    elif anchor is not None:
        truth = anchor.get("buffer_id")
    else:
        # a replicated buffer made while part 0's server was away: the identity its parts were made with
        newer = Counter(i.get("buffer_id") for i in infos if i is not None)
        truth = newer.most_common(1)[0][0] if newer else None
    complete = anchor is not None and not made[0] and bool(anchor.get("sealed"))
    if anchor is None and older:
        complete = True     # the other parts exist: part 0, made first, was lost
    lost: dict[int, str] = {}
    for k, (info, new) in enumerate(zip(infos, made)):
        if info is None:
            if complete:
                lost[k] = "missing"
        elif info.get("buffer_id") != truth:
            lost[k] = "missing" if new else "another buffer's (made after this one's was lost)"
        elif new and complete:
            lost[k] = "missing"
    return truth, lost


def remains(infos: Sequence[dict[str, Any] | None], identity: str | None,
            lost: dict[int, str]) -> list[dict[str, Any]]:
    """Part infos for a Buffer of the parts that are left: each lost part's
    place points at :data:`NO_SEGMENT`."""
    whole = next(i for k, i in enumerate(infos) if i is not None and k not in lost
                 and i.get("buffer_id") == identity)
    return [{**whole, "segment": NO_SEGMENT, "index": k, "server_id": None} if k in lost or info is None
            else info for k, info in enumerate(infos)]


def unseen(first: dict[str, Any], nservers: int) -> list[dict[str, Any]]:
    """Part infos for a Buffer that knows only part 0 (``first``, sealed):
    every other part's place says :data:`UNSEEN` until its server is used."""
    return [first] + [{**first, "segment": NO_SEGMENT, "index": k, "server_id": UNSEEN}
                      for k in range(1, nservers)]


def lost_at_first_use(info: dict[str, Any] | None, identity: str | None) -> str | None:
    """Why the part a lazy client's buffer looks up on its server's first
    use (``info``; None where that server has none) is lost, in
    :func:`damaged`'s words, or None where it carries the buffer's
    ``identity``.  Part 0 was sealed when the buffer was attached, so every
    part existed then."""
    if info is None:
        return "missing"
    if info.get("buffer_id") != identity:
        return "another buffer's (made after this one's was lost)"
    return None


def damaged(name: str, lost: dict[int, str], servers: Sequence[str], nbytes: int, stripe: int) -> BufferDamaged:
    """The :class:`BufferDamaged` for buffer ``name`` whose ``lost`` parts
    (from :func:`judge`) are on ``servers`` (the client's list)."""
    n = len(servers)
    err = BufferDamaged(
        "", name=name, servers=[servers[k] for k in sorted(lost)], parts=sorted(lost),
        geometry=(nbytes, stripe, n, first_server(name, n)),
        hint=("if the server keeps a --data-dir, restart it from there to get the part back; if the data is "
              f"gone, remove the buffer (`smb2 rm {name}` or client.destroy) and create it again, or pass "
              "create(..., recreate_lost=True) to accept zeros in the lost ranges"))
    # the message quotes the ranges the error computes from its geometry
    ranges: list[str] = []
    for lo, hi in err.ranges():
        if len(ranges) == SHOWN_RANGES:
            ranges.append("...")
            break
        ranges.append(f"{lo}-{hi}")
    whose = "; ".join(f"part {k} on server {servers[k]} is {why}" for k, why in sorted(lost.items()))
    if ranges:
        lost_text = f"so bytes {', '.join(ranges)} of it are lost ({err.lost_bytes} of {nbytes} bytes)"
    else:
        # a buffer smaller than its stripes' round leaves some parts empty
        lost_text = f"which held none of its {nbytes} bytes, so no data is lost"
    err.args = (f"buffer {name!r} is damaged: {whose}, {lost_text}",)
    return err
