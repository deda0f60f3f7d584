"""The ``ft`` rendezvous handler (elastic/rendezvous.py): several handlers, each with a
connection of its own, against one TCPStore, each ``next_rendezvous`` in a thread of
its own (as each agent calls it in a process of its own)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from elastic.nodes import departed_key, keepalive_key
from elastic.rendezvous import FtConfig, FtRendezvousHandler, Liveness, create_handler
from testing.ports import free_port

pytestmark = pytest.mark.timeout(60)

FAST = FtConfig(
    last_call_timeout=0.3,
    keep_alive_interval=0.05,
    keep_alive_timeout=0.5,
    rejoin_timeout=5.0,
    join_timeout=20.0,
)


@pytest.fixture
def server():
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    yield store
    del store


def client(server: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


class Nodes:
    """Handlers against one store, and a pool to run their rounds in parallel."""

    def __init__(self, server: TCPStore, run_id: str = "job", min_nodes: int = 2, max_nodes=4):
        self.server, self.run_id, self.min, self.max = server, run_id, min_nodes, max_nodes
        self.pool = cf.ThreadPoolExecutor(16)
        self.handlers: list[FtRendezvousHandler] = []

    def add(self, config: FtConfig = FAST, run_id: str | None = None) -> FtRendezvousHandler:
        h = FtRendezvousHandler(
            client(self.server),
            run_id or self.run_id,
            self.min,
            self.max,
            config=config,
            local_addr="127.0.0.1",
            node_id=f"node{len(self.handlers)}",
        )
        self.handlers.append(h)
        return h

    def start(self, handlers) -> list[cf.Future]:
        return [self.pool.submit(h.next_rendezvous) for h in handlers]

    def close(self):
        for h in self.handlers:
            h._stop_heartbeat()
        self.pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def nodes(server):
    made: list[Nodes] = []

    def make(**kw) -> Nodes:
        n = Nodes(server, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def results(futures, timeout=15.0):
    return [f.result(timeout=timeout) for f in futures]


def assert_one_round(infos, size):
    assert sorted(i.rank for i in infos) == list(range(size))
    assert {i.world_size for i in infos} == {size}
    addrs = {
        (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos
    }
    assert len(addrs) == 1  # every node got rank 0's address and port


@pytest.mark.parametrize("size", [2, 3])
def test_round_of_n_nodes(nodes, size):
    n = nodes(min_nodes=2, max_nodes=4)
    hs = [n.add() for _ in range(size)]
    t0 = time.monotonic()
    infos = results(n.start(hs))
    assert_one_round(infos, size)
    assert time.monotonic() - t0 < 3.0  # last call (0.3 s) + slack, not c10d's seconds
    # The agent's store is per round and shared by the round's members.
    infos[0].store.set("k", "v")
    assert all(i.store.get("k") == b"v" for i in infos)
    assert all(h.num_nodes_waiting() == 0 for h in hs)
    assert not any(h.use_agent_store for h in hs)


def test_max_nodes_completes_without_last_call(nodes):
    slow = FtConfig(last_call_timeout=30.0, keep_alive_interval=0.05, join_timeout=20.0)
    n = nodes(min_nodes=1, max_nodes=3)
    hs = [n.add(slow) for _ in range(3)]
    t0 = time.monotonic()
    assert_one_round(results(n.start(hs)), 3)
    assert time.monotonic() - t0 < 5.0


def test_re_round_after_a_member_stops_heartbeating(nodes):
    n = nodes(min_nodes=2, max_nodes=4)
    hs = [n.add() for _ in range(3)]
    assert_one_round(results(n.start(hs)), 3)
    hs[2]._stop_heartbeat()  # node2's agent died
    time.sleep(FAST.keep_alive_timeout + 0.2)
    t0 = time.monotonic()
    infos = results(n.start(hs[:2]))
    took = time.monotonic() - t0
    assert_one_round(infos, 2)
    assert took < 2.0, took  # the dead member is not waited for (rejoin_timeout is 5 s)


def test_a_member_a_worker_marked_departed_is_not_waited_for_while_its_keep_alive_stands(
    nodes, server
):
    slow_to_forget = FtConfig(
        last_call_timeout=0.3, keep_alive_interval=0.05, keep_alive_timeout=4.0,
        rejoin_timeout=8.0, join_timeout=20.0,
    )  # fmt: skip
    n = nodes(min_nodes=2, max_nodes=4)
    hs = [n.add(slow_to_forget) for _ in range(3)]
    assert_one_round(results(n.start(hs)), 3)
    hs[2]._stop_heartbeat()  # node2 froze: its keep-alive stands still
    time.sleep(0.2)
    store = client(server)
    standing = store.get(keepalive_key("job", "node2")).decode()
    store.set(departed_key("job", "node2"), "7 1.0")  # not the value it reads: no effect
    t0 = time.monotonic()
    futures = n.start(hs[:2])
    time.sleep(1.0)
    assert not any(f.done() for f in futures)  # waited for: its keep-alive is 1.2 s old of 4
    store.set(departed_key("job", "node2"), standing)  # a worker's verdict, with what it saw
    infos = results(futures)
    took = time.monotonic() - t0
    assert_one_round(infos, 2)
    assert took < 2.0, took  # not the 4 s keep-alive bound


def test_re_round_completes_when_all_live_members_rejoined(nodes):
    slow_last_call = FtConfig(
        last_call_timeout=2.0, keep_alive_interval=0.05, keep_alive_timeout=0.5, join_timeout=20.0
    )
    n = nodes(min_nodes=2, max_nodes=4)
    hs = [n.add(slow_last_call) for _ in range(2)]
    first = n.start(hs)
    time.sleep(0.3)
    hs.append(n.add(slow_last_call))  # a third node joins the first round before last call
    first.append(n.pool.submit(hs[2].next_rendezvous))
    assert_one_round(results(first, 20), 3)
    # A worker failed: every member re-rounds; no last call, all three are back at once.
    t0 = time.monotonic()
    assert_one_round(results(n.start(hs)), 3)
    assert time.monotonic() - t0 < 1.0  # well under the 2 s last call


def await_one_waiting(members, who: str) -> None:
    """Until the first member counts one node waiting (5 s at most); then every member does."""
    deadline = time.monotonic() + 5
    while members[0].num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, f"{who} never showed as waiting"
        time.sleep(0.02)
    assert all(h.num_nodes_waiting() == 1 for h in members)


def test_new_node_is_waiting_then_joins_the_next_round(nodes):
    n = nodes(min_nodes=2, max_nodes=4)
    hs = [n.add() for _ in range(2)]
    infos = results(n.start(hs))
    assert_one_round(infos, 2)
    newcomer = n.add()
    pending = n.pool.submit(newcomer.next_rendezvous)
    await_one_waiting(hs, "the newcomer")
    assert not pending.done()  # it waits for the members, who are still running
    # The members' monitors see it and restart into the next round, which includes it.
    again = [*results(n.start(hs)), pending.result(timeout=15)]
    assert_one_round(again, 3)
    assert all(h.num_nodes_waiting() == 0 for h in [*hs, newcomer])


def ghost_joins(server: TCPStore, rnd: int, name: str = "ghost", run_id: str = "job") -> None:
    """What an agent that took a slot of round ``rnd`` and then died leaves in the store:
    its id in the slot and a keep-alive last written 10 s ago."""
    store = client(server)
    store.set(f"ft/{run_id}/hb/{name}", f"3 {time.time() - 10}")
    slot = store.add(f"ft/{run_id}/r{rnd}/n", 1)
    store.set(f"ft/{run_id}/r{rnd}/s{slot}", name)


def test_a_joiner_that_died_before_the_round_closed_is_left_out(nodes, server):
    n = nodes(min_nodes=2, max_nodes=4)
    ghost_joins(server, 0)  # slot 1 of the first round: a dead decider
    hs = [n.add() for _ in range(2)]
    infos = results(n.start(hs))
    assert_one_round(infos, 2)
    members = json.loads(client(server).get("ft/job/r0/members"))
    assert members == ["node0", "node1"] or members == ["node1", "node0"]


def test_the_round_closes_when_every_decider_died(nodes, server):
    """The first three joiners decide every poll; here all three died after joining, so
    the live nodes (slots 4 and 5) close the round on their slower evaluation."""
    n = nodes(min_nodes=2, max_nodes=8)
    for i in range(3):
        ghost_joins(server, 0, f"ghost{i}")
    hs = [n.add() for _ in range(2)]
    t0 = time.monotonic()
    assert_one_round(results(n.start(hs)), 2)
    assert time.monotonic() - t0 < FtConfig().decide_interval + 2.0


def test_a_dead_joiner_is_not_counted_as_waiting(nodes, server):
    n = nodes(min_nodes=2, max_nodes=4)
    hs = [n.add() for _ in range(2)]
    assert_one_round(results(n.start(hs)), 2)
    ghost_joins(server, 1)  # joined the next round, then died: no restart for it
    assert [h.num_nodes_waiting() for h in hs] == [0, 0]
    newcomer = n.add()
    pending = n.pool.submit(newcomer.next_rendezvous)
    await_one_waiting(hs, "the live newcomer")
    again = [*results(n.start(hs)), pending.result(timeout=15)]
    assert_one_round(again, 3)


def test_close_ends_waiting_nodes_and_later_joins(nodes):
    n = nodes(min_nodes=3, max_nodes=3)
    hs = [n.add() for _ in range(3)]
    waiting = n.start(hs[:2])  # only two of the three: the round cannot complete
    time.sleep(0.3)
    assert not hs[0].is_closed()
    hs[2].set_closed()
    for f in waiting:
        with pytest.raises(RendezvousClosedError):
            f.result(timeout=5)
    assert all(h.is_closed() for h in hs)
    with pytest.raises(RendezvousClosedError):
        hs[2].next_rendezvous()


def test_shutdown_closes_the_rendezvous_for_everyone(nodes):
    n = nodes(min_nodes=2, max_nodes=2)
    hs = [n.add() for _ in range(2)]
    results(n.start(hs))
    assert hs[0].shutdown()
    assert hs[1].is_closed()
    with pytest.raises(RendezvousClosedError):
        hs[1].next_rendezvous()


def test_run_ids_are_fenced_apart(nodes):
    short = FtConfig(last_call_timeout=0.2, keep_alive_interval=0.05, join_timeout=1.5)
    n = nodes(min_nodes=2, max_nodes=2)
    a = n.add(short, run_id="job-a")
    b = n.add(short, run_id="job-b")
    assert a.get_run_id() == "job-a"
    for f in n.start([a, b]):
        with pytest.raises(RendezvousTimeoutError):
            f.result(timeout=10)
    # Closing one job does not close the other.
    a.set_closed()
    assert a.is_closed() and not b.is_closed()


def test_unreachable_store_fails_clearly_within_the_connect_timeout():
    port = free_port()  # nothing listens there
    params = RendezvousParameters(
        backend="ft",
        endpoint=f"127.0.0.1:{port}",
        run_id="x",
        min_nodes=1,
        max_nodes=2,
        is_host="0",
        connect_timeout="1.5",
    )
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        create_handler(params)
    assert time.monotonic() - t0 < 10


def test_create_handler_hosts_the_store_when_the_endpoint_is_local():
    port = free_port()
    params = RendezvousParameters(
        backend="ft",
        endpoint=f"127.0.0.1:{port}",
        run_id="hosted",
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        last_call_timeout="0.1",
    )
    host = create_handler(params)  # 127.0.0.1 is this machine: it hosts the store
    info = host.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert host.get_backend() == "ft"
    assert host.shutdown()


def test_bad_conf_value_is_rejected():
    params = RendezvousParameters(
        backend="ft", endpoint="127.0.0.1:1", run_id="x", min_nodes=1, max_nodes=1,
        last_call_timeout="soon",
    )  # fmt: skip
    with pytest.raises(ValueError, match="last_call_timeout"):
        FtConfig.from_params(params)


def test_liveness_by_wall_age_and_by_a_stalled_counter():
    live = Liveness(timeout=0.3)
    assert not live.alive("old", f"3 {time.time() - 10}")  # written 10 s ago
    frozen = f"1 {time.time() + 3600}"  # a clock far ahead: only the counter can tell
    assert live.alive("frozen", frozen)
    time.sleep(0.4)
    assert not live.alive("frozen", frozen)  # the same keep-alive for 0.4 s


def test_torchrun_discovers_the_backend():
    code = (
        "from torch.distributed.elastic.rendezvous import registry, api\n"
        "registry._register_out_of_tree_handlers()\n"
        "print('ft' in api.rendezvous_handler_registry._registry)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stdout + out.stderr


# -- torch's rendezvous handler contract --------------------------------------------------


def _params(endpoint: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="ft", endpoint=endpoint, run_id="contract", min_nodes=1, max_nodes=1, **conf
    )


def test_an_unknown_conf_key_or_store_type_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"keep_alive_max_attempt: not a setting"):
        FtConfig.from_params(_params("127.0.0.1:1", keep_alive_max_attempt="5"))
    with pytest.raises(ValueError, match="store_type='file'"):
        FtConfig.from_params(_params("127.0.0.1:1", store_type="file"))
    # What torchrun adds itself, and the one store type there is, are settings.
    FtConfig.from_params(_params("127.0.0.1:1", timeout="900", rank="0", store_type="TCP"))


@pytest.mark.timeout(60)
def test_an_unreachable_store_raises_within_the_connect_timeout_not_twice_it():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port} within 6 s"):
        create_handler(_params(f"127.0.0.1:{port}", is_host="0", connect_timeout="6"))
    assert time.monotonic() - t0 < 7.5  # TCPStore's own client took ~1.5 x the bound


@pytest.mark.timeout(60)
def test_an_endpoint_that_does_not_resolve_raises_promptly(monkeypatch):
    monkeypatch.setattr("elastic.rendezvous.RESOLVE_GRACE_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="does not resolve"):
        create_handler(_params("no-such-host.invalid:29400", connect_timeout="60"))
    assert time.monotonic() - t0 < 5  # was: no error within 120 s


@pytest.mark.timeout(60)
def test_the_keep_alive_thread_stops_when_the_handler_is_dropped():
    import gc
    import threading

    def keepalives() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "ft-rdzv-keepalive"]

    before = set(keepalives())
    handler = create_handler(
        _params(f"127.0.0.1:{free_port()}", last_call_timeout="0.1", keep_alive_interval="0.05")
    )
    handler.next_rendezvous()
    mine = [t for t in keepalives() if t not in before]
    assert len(mine) == 1 and mine[0].is_alive()
    del handler  # no shutdown(): torchrun's agent may just drop it
    gc.collect()
    mine[0].join(timeout=5)
    assert not mine[0].is_alive()


def test_a_joiner_that_died_before_the_round_closed_is_never_rank_0(server, nodes):
    n = nodes(min_nodes=2, max_nodes=4)
    # node "ghost" took slot 1 of round 0 and wrote a fresh keep-alive, then died.
    prefix = "ft/job/"
    server.add(f"{prefix}round", 0)
    server.add(f"{prefix}r0/n", 1)
    server.set(f"{prefix}r0/s1", "ghost")
    server.set(f"{prefix}hb/ghost", f"0 {time.time()}")
    infos = results(n.start([n.add(), n.add()]))
    assert {i.world_size for i in infos} == {3}  # still alive-looking when the round closed
    assert sorted(i.rank for i in infos)[0] == 0  # but rank 0 is one of the living


@pytest.mark.timeout(60)
def test_a_store_that_dies_after_the_round_is_a_connection_error_naming_it():
    # torch's contract: the handler's calls raise RendezvousConnectionError when the
    # store is gone (c10d's backend converts its store's errors the same way).
    port = free_port()
    serve = (
        "import time\nfrom torch.distributed import TCPStore\n"
        f"s = TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False, "
        "multi_tenant=True)\nprint('up', flush=True)\ntime.sleep(120)\n"
    )
    host = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "up"
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        handler = FtRendezvousHandler(
            store, "job", 1, 1, config=FAST, local_addr="127.0.0.1", node_id="n0"
        )
        handler.next_rendezvous()
        assert not handler.is_closed()
    finally:
        host.kill()
        host.wait(10)
    try:
        for call in (handler.is_closed, handler.set_closed):
            with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port} failed"):
                call()
    finally:
        handler._stop_heartbeat()
