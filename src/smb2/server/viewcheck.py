"""The servers' own check of a replicated cluster's view: no stripe of any
buffer a server knows may lose its last member copy.

A stripe with no member copy can never be caught up again (a joining copy
catches up from a member), so a view that takes away the last one makes
that stripe's bytes unreadable although they are still in memory.  Clients
check this for the buffers they have open, but a client knows only those;
a server knows every buffer it holds a part of, and every buffer of a
replicated cluster is striped over all of its servers.  So the servers
check it twice (docs/reliability.md, "Who can change the view"):

* on a change a client asks for (``view_change``): refused, nothing written;
* on a view read from etcd that some other writer put there (credentials
  stolen, or an old tool): not installed, and overwritten by the view the
  server held, when that view was the one right before (then nobody ever
  used the other: every server refuses it, and clients learn views only
  from servers; so the servers it dropped missed no update).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..membership import View
from ..placement import Placement
from .segment import Segment


def placement(seg: Segment) -> Placement:
    """How ``seg``'s buffer is striped (the same on every server)."""
    return Placement.of(seg.name, seg.nservers, seg.nbytes, seg.stripe, seg.replicas, seg.zones)


def stripe_groups(seg: Segment) -> list[list[str]]:
    """The servers (replica order) of each stripe group of ``seg``'s buffer."""
    p = placement(seg)
    return [[seg.servers[s] for s in p.replicas_of(i)] for i in range(min(p.nstripes, p.nservers))]


def lost_groups(segments: Iterable[Segment], old: View, new: View) -> list[tuple[Segment, list[list[str]]]]:
    """The stripe groups (servers, replica order) of each buffer that ``new``
    would leave without a member copy that ``old`` had one of.  A member copy
    moved to joining counts as lost too: joining copies catch up from a
    member, so a stripe whose copies are all joining is stuck (and a view that
    moved them there, forged with stolen credentials, let updates be lost in
    the Jepsen test's forge nemesis)."""
    out = []
    for seg in segments:
        if seg.replicas <= 1:
            continue
        groups = [g for g in stripe_groups(seg) if old.primary(g) is not None and new.primary(g) is None]
        if groups:
            out.append((seg, groups))
    return out


def lost_copies(segments: Iterable[Segment], old: View, new: View) -> list[str]:
    """:func:`lost_groups` in words: one entry per buffer, naming its servers."""
    return [f"buffer {seg.name!r} (its copies on {', '.join(sorted({'+'.join(g) for g in groups}))})"
            for seg, groups in lost_groups(segments, old, new)]
