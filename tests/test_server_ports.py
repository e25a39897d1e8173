"""The throwaway servers' ports: a port taken between its pick and the start is no failure.

Tests run beside other test processes; any of them may take a port this one
picked before the server binds it. The first start moves to another port; a
port the caller named stays, and its failure says which port was busy. The
database servers the suite starts (tests/databases.py) move the same way.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from django_redis_mutex.testing import (
    PortTaken,
    RedisClusterServers,
    RedisServer,
    free_port,
    start_on_a_picked_port,
)

from .databases import PostgresServer


@contextmanager
def listening_on(port: int) -> Iterator[socket.socket]:
    """Hold ``port`` on 127.0.0.1 as another process's server would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield sock


def answers(server: RedisServer) -> bool:
    client = redis.Redis(port=server.port, socket_timeout=5)
    try:
        return bool(client.ping())
    finally:
        client.close()


def test_a_picked_port_taken_before_the_start_moves_the_server() -> None:
    server = RedisServer()
    picked = server.port
    with listening_on(picked), server:
        assert server.port != picked
        assert answers(server)


def test_a_picked_cluster_bus_port_taken_before_the_start_moves_the_node() -> None:
    server = RedisServer(cluster=True)
    picked = server.port
    with listening_on(picked + 10000), server:
        assert server.port != picked
        assert answers(server)


def test_picked_ports_leave_the_kernels_ephemeral_range_to_outgoing_connections() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as ports:
        ephemeral_floor = int(ports.read().split()[0])
    if ephemeral_floor < 22000:
        pytest.skip("this kernel's ephemeral range leaves no room below it for a cluster node")
    picked = [free_port() for _ in range(50)]
    assert all(10000 <= port < ephemeral_floor for port in picked)
    nodes = [free_port(cluster=True) for _ in range(50)]
    assert all(port >= 10000 and port + 10000 < ephemeral_floor for port in nodes)


def test_a_named_busy_port_is_an_error_naming_it_and_the_server_stays_there() -> None:
    port = free_port()
    server = RedisServer(port)
    with (
        listening_on(port),
        pytest.raises(PortTaken, match=f"on port {port}: .*Address already in use") as taken,
    ):
        server.start()
    assert taken.value.port == port
    assert server.port == port
    server.close()


def test_a_cluster_whose_start_fails_leaves_no_node_running() -> None:
    cluster = RedisClusterServers(primaries=3)
    cluster.nodes[2].binary = "false"  # exits at once, as a node refused its port would
    with pytest.raises(RuntimeError, match="redis-server exited with 1"):
        cluster.start()
    for node in cluster.nodes[:2]:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", node.port), timeout=5).close()


def test_a_restart_keeps_its_port_after_a_move() -> None:
    server = RedisServer()
    with listening_on(server.port):
        server.start()
    try:
        moved = server.port
        server.restart()
        assert server.port == moved
        assert answers(server)
    finally:
        server.close()


def test_a_database_server_whose_picked_port_was_taken_moves_to_a_fresh_one() -> None:
    server = PostgresServer()
    picked = server.port
    # Bound, as an outgoing connection's port is: connections to it are refused.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", picked))
        server.start()
    try:
        assert server.port != picked
        assert server.ready()
    finally:
        server.close()


def test_start_on_a_picked_port_moves_until_a_start_binds_and_gives_up_after_its_attempts() -> None:
    ports = iter(range(1, 100))
    tried: list[int] = []
    current = [next(ports)]

    def start_taken_until(free_from: int) -> int:
        tried.append(current[0])
        if current[0] < free_from:
            raise PortTaken(current[0], f"port {current[0]} was taken")
        return current[0]

    def pick_again() -> None:
        current[0] = next(ports)

    assert start_on_a_picked_port(lambda: start_taken_until(3), pick_again) == 3
    assert tried == [1, 2, 3]

    tried.clear()
    with pytest.raises(PortTaken, match="port 7 was taken"):
        start_on_a_picked_port(lambda: start_taken_until(1000), pick_again, attempts=5)
    assert tried == [3, 4, 5, 6, 7]


def test_start_on_a_picked_port_lets_any_other_error_through_at_once() -> None:
    calls: list[str] = []

    def start() -> None:
        calls.append("start")
        raise RuntimeError("redis-server exited with 1")

    with pytest.raises(RuntimeError, match="exited with 1"):
        start_on_a_picked_port(start, lambda: calls.append("moved"))
    assert calls == ["start"]
