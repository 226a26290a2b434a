"""A closing use whose READ NIXL never lets go of still ends (sans-IO ConsumerCore)."""

from __future__ import annotations

import numpy as np

from kvpush import messages as m
from kvpush.errors import RequestAborted
from kvpush.protocol.consumer import GRACE_ROUNDS
from kvpush.protocol.effects import Abandon, Post
from kvpush.request import RequestState
from tests.support.cores import P, core, results


def test_a_read_nixl_never_releases_ends_unsafe_after_bounded_graces() -> None:
    c = core(grace=1.0)
    ticket = m.PullTicket(P, "tcp://x:1", "p", m.encode_ids(np.array([3, 4])), 30.0, 0.0,
                          sid=5)
    c.pull(0.0, [ticket], [np.array([3, 4])], np.array([8, 9]), 10.0, 1, 21)
    (key,) = [e.key for e in c.drain() if isinstance(e, Post)]
    c.abort(0.5, "p", RequestState.ABORTED, RequestAborted("engine"))
    c.drain()
    now, asked = 0.5, 0
    for _ in range(GRACE_ROUNDS):         # the driver's release is refused every time:
        now += 1.0                        # no transfer_ended comes
        c.tick(now)
        effects = c.drain()
        asked += effects.count(Abandon(key))
        if results(effects):
            break
    (res,) = results(effects)
    assert res.state is RequestState.ABORTED and not res.blocks_safe
    assert asked == GRACE_ROUNDS - 1      # asked again each grace before giving up
    assert c.in_flight() == 0 and c.status("p") == "none"
