"""``examples/vllm/launch.free_port``: the ports the vLLM tests and benchmarks give their
servers. It only probes a port, so two calls used to be able to return the same one before
either server bound it (a full ``vllm_compare`` run lost a group that way: a vLLM side
channel's "Address already in use", its server never healthy for 600 s)."""

from __future__ import annotations

import socket

from examples.vllm import launch


def test_no_port_is_handed_out_twice() -> None:
    ports = [launch.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_a_span_is_consecutive_free_and_apart_from_the_others() -> None:
    single = {launch.free_port() for _ in range(50)}
    first = launch.free_port(4)                       # a TP-4 instance: port + rank
    span = set(range(first, first + 4))
    assert not span & single
    for port in span:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))               # free now
    assert launch.free_port() not in span
