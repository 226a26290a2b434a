"""kvpush's protocol core: what each side does with a request, without any I/O.

The way h11 and wsproto separate HTTP and WebSocket logic from sockets, this package holds
the per-request state machines of both roles and nothing else: no ZeroMQ, NIXL, threads or
clock of its own. A core takes *events* (engine calls, decoded control frames, NIXL
notifications, transfer ends, timer expiries, peer liveness), each stamped with the caller's
``now``, and returns *effects* (:mod:`kvpush.protocol.effects`: send a frame, post or abandon
a transfer, emit a result or a release, drop a peer) for an I/O driver to carry out. Its
timers are deadlines it keeps itself: the driver asks :meth:`next_deadline` and calls
:meth:`tick` when it is due.

Because a core has no I/O, :mod:`kvpush.testing.sim` can drive many producers and consumers
through reordered, dropped, duplicated and delayed messages, stalls, kills and link cuts, and
check the invariants after every step; a failing seed replays exactly. The states, the wire
identities and the invariants: ``docs/PROTOCOL.md``.

* :mod:`kvpush.protocol.producer` -- the prefill side (sources, owners, WRITEs, leases).
* :mod:`kvpush.protocol.consumer` -- the decode side (registrations, READs, completion).
"""
