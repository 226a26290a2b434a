"""kvpush.agent.Agent keeps a dropped peer's NIXL metadata until a peer of that name comes
back (NIXL's ``remove_remote_agent`` closes the UCX endpoint in flush mode, and such a close
of a connection a cut or a kill left behind is where UCX can abort the process). Real NIXL
agents in this process; a peer's "new incarnation" is a new agent under the same name (new
metadata, which NIXL refuses while the old is loaded)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpush import agent as agent_mod
from kvpush.agent import Agent, TransportConfig
from kvpush.errors import PeerUnavailable
from tests.support.harness import make_cache

CONFIG = TransportConfig()


@pytest.fixture()
def factory() -> Iterator[Any]:
    made: list[Agent] = []
    caches = []

    def make(name: str) -> Agent:
        cache = make_cache(num_blocks=8)
        caches.append(cache)
        made.append(Agent(name, cache.layout, CONFIG))
        return made[-1]

    try:
        yield make
    finally:
        for a in made:
            a.close()


def _refused(local: Agent, incarnation: Agent) -> bool:
    try:
        local._agent.add_remote_agent(incarnation.metadata())
    except Exception:
        return True
    local._agent.remove_remote_agent(incarnation.name)
    return False


def test_a_dropped_peer_is_kept_until_it_comes_back(factory: Any) -> None:
    local, peer = factory("kvpush-test-local"), factory("kvpush-test-peer")
    name = local.add_peer(peer.metadata(), peer.layout, peer.name)
    assert name == peer.name and local.has_peer(name)
    local.remove_peer(name)
    # Gone for kvpush at once: no link, no post.
    assert not local.has_peer(name)
    with pytest.raises(PeerUnavailable):
        local.link(name)
    with pytest.raises(PeerUnavailable):
        local.post("WRITE", name, np.zeros(1, np.int64), np.zeros(1, np.int64), b"")
    # The same incarnation back (after a cut): its kept endpoint serves on, never closed.
    removed: list[str] = []
    remove = local._remove_remote
    local._remove_remote = lambda n: (removed.append(n), remove(n))[1]  # type: ignore[method-assign]
    assert local.add_peer(peer.metadata(), peer.layout, peer.name) == name
    assert local.has_peer(name) and not local._dormant and not removed
    local.remove_peer(name)
    # Still loaded in NIXL (its endpoint not closed): a new incarnation is refused by NIXL.
    again = factory(peer.name)
    assert _refused(local, again)
    # Through kvpush, the new incarnation replaces it: the old metadata goes first.
    assert local.add_peer(again.metadata(), again.layout, again.name) == name
    assert local.has_peer(name) and not local._dormant and removed == [name]
    # Back without saying its name (the caller did not know it): found all the same.
    local.remove_peer(name)
    third = factory(peer.name)
    assert local.add_peer(third.metadata(), third.layout) == name
    assert not local._dormant


def test_dropped_peers_kept_are_bounded(factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_mod, "DORMANT_MAX", 2)
    local = factory("kvpush-test-local")
    peers = [factory(f"kvpush-test-peer-{i}") for i in range(3)]
    for p in peers:
        local.add_peer(p.metadata(), p.layout, p.name)
    for p in peers:
        local.remove_peer(p.name)
    assert list(local._dormant) == [p.name for p in peers[1:]]
    # the oldest was removed from NIXL for real; the others are still loaded
    assert not _refused(local, factory(peers[0].name))
    assert _refused(local, factory(peers[1].name))
    local.close()
    assert not local._dormant


def test_notifications_read_around_a_removal_are_kept(factory: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX is progressed around each removal (through get_new_notifs): what that reads
    comes out of the next notifications(), nothing is lost."""
    monkeypatch.setattr(agent_mod, "DORMANT_MAX", 0)  # every removal at once
    local, peer, gone = (factory(f"kvpush-test-{n}") for n in ("local", "peer", "gone"))
    local.add_peer(peer.metadata(), peer.layout, peer.name)
    peer.add_peer(local.metadata(), local.layout, local.name)
    local.add_peer(gone.metadata(), gone.layout, gone.name)
    peer.send_notification(local.name, b"hello")
    seen: list[bytes] = []
    for _ in range(200):  # until the notification is in (read by the removal's progress)
        local.remove_peer(gone.name)
        seen += local._stash.get(peer.name, [])
        if seen:
            break
        local.add_peer(gone.metadata(), gone.layout, gone.name)
        peer.notifications()
    assert seen == [b"hello"]
    assert local.notifications().get(peer.name) == [b"hello"]
    assert not local._stash


def test_a_link_pickles_with_its_compiled_constants_rebuilt() -> None:
    """A contained data plane (data_plane="child") hands its Links to the engine's process
    by pickle; the compiled PreparedLink does not pickle, so it is rebuilt there (merging
    the hot path's PreparedLink with the data-plane child broke add_peer)."""
    import pickle

    import numpy as np

    from kvpush.agent import Link

    link = Link(remote_num_blocks=8, desc_bytes=64, local_num_blocks=8, num_regions=2)
    back = pickle.loads(pickle.dumps(link))
    assert back == link and back.prepared is not None
    ids = np.array([1, 2], dtype=np.int64)
    a, b = link.plan(ids, ids, 8, 2, True), back.plan(ids, ids, 8, 2, True)
    assert a.local_indices.tolist() == b.local_indices.tolist()
