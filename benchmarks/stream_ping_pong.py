"""One thread, a DEALER and a ROUTER passing 128-byte frames back and forth: CPU and wall us
per frame over ZeroMQ and over kvpush.stream (`python benchmarks/stream_ping_pong.py zmq tcp`)."""
import sys, time, zmq
from kvpush import stream
def run(ctx, n=3000):
    r = ctx.socket(zmq.ROUTER); r.setsockopt(zmq.LINGER, 0); r.bind("tcp://127.0.0.1:*")
    a = r.getsockopt_string(zmq.LAST_ENDPOINT)
    d = ctx.socket(zmq.DEALER); d.setsockopt(zmq.LINGER, 0); d.setsockopt(zmq.IDENTITY, b"kabc"); d.connect(a)
    p = zmq.Poller(); p.register(r, zmq.POLLIN); p.register(d, zmq.POLLIN)
    payload = b"x" * 128
    def drain(s):
        out = []
        while True:
            try: out.append(s.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again: return out
    def wait(s):
        while True:
            p.poll(1000)
            got = drain(s)
            if got: return got
            drain(d if s is r else r)
    for i in range(n + 200):
        if i == 200: t0 = time.process_time(); w0 = time.perf_counter()
        d.send(payload, zmq.NOBLOCK)
        wait(r)
        r.send_multipart([b"kabc", payload], zmq.NOBLOCK)
        wait(d)
    cpu = (time.process_time() - t0) / n / 2 * 1e6; wall = (time.perf_counter() - w0) / n / 2 * 1e6
    d.close(); r.close()
    return cpu, wall
for kind in sys.argv[1:]:
    ctx = zmq.Context() if kind == "zmq" else stream.Context()
    print(kind, "cpu us/frame %.1f wall us/frame %.1f" % run(ctx))
    ctx.destroy(0) if kind == "zmq" else ctx.destroy()
