"""A node's keep-alive as the heartbeat's second witness (elastic/nodes.py): the pure
decisions as tables, the channel the ``ft`` agent exports, and the detector's threads
against fake stores in which a frozen node, a stalled rank and an unreachable
rendezvous store each get their own verdict."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from test_elastic_heartbeat import FakeStore, _wait
from torch.distributed import TCPStore

from elastic.heartbeat import (
    NODE_SILENT,
    OK,
    SILENT,
    STALL_LIMIT,
    STALLED,
    PeerHeartbeat,
    StoreAddress,
    peer_status,
    store_status,
)
from elastic.nodes import (
    ENV_NODE,
    ENV_STORE,
    NodeChannel,
    check_node_bounds,
    departed_key,
    export_node,
    keepalive_counter,
    keepalive_key,
)
from elastic.rendezvous import FtConfig, FtRendezvousHandler
from testing.ports import free_port

BOUNDS = {"timeout_s": 5.0, "node_timeout_s": 1.0, "stall_limit_s": 60.0}


@pytest.mark.parametrize(
    ("age", "node_age", "expected"),
    [
        (0.5, 0.1, OK),
        (1.5, None, OK),  # no witness: the peer bound alone
        (5.1, None, SILENT),
        (1.2, 1.2, NODE_SILENT),  # heartbeat and node both stopped: frozen or cut off
        (1.2, 0.1, OK),  # its node lives: not yet anything
        (0.5, 3.0, OK),  # the agent alone is slow: the rank beats, nothing to judge
        (10.0, 0.1, STALLED),  # a 10 s garbage collection: waited for
        (61.0, 0.2, STALL_LIMIT),
        (1.0, 1.0, OK),  # exactly the node bound: not yet
    ],
)
def test_peer_status_table(age, node_age, expected) -> None:
    assert peer_status(age, node_age, **BOUNDS) == expected


@pytest.mark.parametrize(
    ("store_age", "host_node_age", "expected"),
    [
        (0.5, None, OK),
        (5.5, None, SILENT),
        (1.5, 1.5, NODE_SILENT),  # the store's host node stopped with it
        (1.5, 0.1, OK),  # its node lives: a slow store, the peer bound decides
        (5.5, 0.1, SILENT),
    ],
)
def test_store_status_table(store_age, host_node_age, expected) -> None:
    assert store_status(store_age, host_node_age, timeout_s=5.0, node_timeout_s=1.0) == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({ENV_STORE: "10.0.0.9:29400", ENV_NODE: "n1_7", "TORCHELASTIC_RUN_ID": "job"},
         NodeChannel("10.0.0.9", 29400, "n1_7", "job")),
        ({ENV_STORE: "[fd00::1]:29400", ENV_NODE: "n", "TORCHELASTIC_RUN_ID": "j"},
         NodeChannel("fd00::1", 29400, "n", "j")),
        ({ENV_STORE: "10.0.0.9:29400", ENV_NODE: "n"}, None),  # not under torchrun
        ({ENV_NODE: "n", "TORCHELASTIC_RUN_ID": "j"}, None),  # not under ft
        ({ENV_STORE: "10.0.0.9", ENV_NODE: "n", "TORCHELASTIC_RUN_ID": "j"}, None),
        ({ENV_STORE: "h:70000", ENV_NODE: "n", "TORCHELASTIC_RUN_ID": "j"}, None),
        ({ENV_STORE: "h:1", ENV_NODE: "bad\nid", "TORCHELASTIC_RUN_ID": "j"}, None),
    ],
)  # fmt: skip
def test_the_channel_is_read_from_the_environment_or_not_at_all(env, expected) -> None:
    assert NodeChannel.from_env(env) == expected


def test_what_the_agent_exports_is_what_a_worker_reads() -> None:
    for host in ("10.1.2.3", "fd00::7"):
        env = {"TORCHELASTIC_RUN_ID": "job"}
        export_node(env, host, 29411, "node_a")
        assert NodeChannel.from_env(env) == NodeChannel(host, 29411, "node_a", "job")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(b"7 1796655680.5", 7), (b"0 1.0", 0), (b"x 1.0", None), (b"", None), (b"-1 2", None),
     (b"\xff", None), ("12 3", 12)],
)  # fmt: skip
def test_keepalive_counter_table(raw, expected) -> None:
    assert keepalive_counter(raw) == expected


@pytest.mark.parametrize(
    ("node", "stall", "interval"), [(0.1, 60.0, 0.25), (1.0, 0.5, 0.25), (float("inf"), 60, 0.2)]
)
def test_node_bounds_that_cannot_work_are_refused(node, stall, interval) -> None:
    with pytest.raises(ValueError, match=r"node timeout|stall limit"):
        check_node_bounds(node, stall, interval)


# -- the detector with node keep-alives, against fake stores ---------------------------------


class Agent:
    """A node's keep-alive writer in the fake rendezvous store (a torchrun agent's thread)."""

    def __init__(self, rdzv: FakeStore, node: str) -> None:
        self.rdzv, self.key = rdzv, keepalive_key("job", node)
        self.stopped = threading.Event()
        self.done = threading.Event()
        rdzv.set(self.key, "0 0")
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        n = 0
        while not self.done.wait(0.05):
            if not self.stopped.is_set():
                n += 1
                self.rdzv.set(self.key, f"{n} {time.time()}")


class Job:
    """Three fake ranks on three fake nodes: a process-group store, a rendezvous store."""

    def __init__(self, *, timeout_s=3.0, node_timeout_s=0.3, stall_limit_s=30.0, reach_rdzv=True):
        self.pg, self.rdzv = FakeStore(), FakeStore()
        self.clients = [self.pg.client() for _ in range(3)]
        self.agents = [Agent(self.rdzv, f"node{r}") for r in range(3)]
        self.verdicts: dict[int, list] = {r: [] for r in range(3)}
        self.stalls: dict[int, list] = {r: [] for r in range(3)}

        def unreachable():
            raise ConnectionError("rendezvous store unreachable from here")

        self.ranks = [
            PeerHeartbeat(
                rank=r, world_size=3, address=StoreAddress("10.0.0.1", 1, 0), key_prefix="t",
                interval_s=0.05, timeout_s=timeout_s, on_silent=self.verdicts[r].append,
                exit_process=False, connect=lambda c=self.clients[r]: c, startup_grace_s=0.5,
                self_info=f"fake host of rank {r}",
                nodes=NodeChannel("10.0.0.2", 2, f"node{r}", "job"),
                node_timeout_s=node_timeout_s, stall_limit_s=stall_limit_s,
                connect_nodes=self.rdzv.client if reach_rdzv else unreachable,
                on_stall=self.stalls[r].append,
            ).start()
            for r in range(3)
        ]  # fmt: skip

    def close(self) -> None:
        self.pg.thaw()
        for hb in self.ranks:
            hb.stop()
        for agent in self.agents:
            agent.done.set()


@pytest.fixture
def job_factory():
    made: list[Job] = []

    def make(**kwargs) -> Job:
        made.append(Job(**kwargs))
        return made[-1]

    yield make
    for job in made:
        job.close()


@pytest.mark.timeout(30)
def test_a_frozen_node_is_silent_at_the_node_bound_not_the_peer_bound(job_factory) -> None:
    job = job_factory()
    time.sleep(0.6)
    job.clients[2].freeze()  # rank 2's process stops ...
    job.agents[2].stopped.set()  # ... and so does its agent: the whole node
    frozen = time.monotonic()
    assert _wait(lambda: job.verdicts[0] and job.verdicts[1], 10)
    detected = time.monotonic() - frozen
    assert detected < 1.5, detected  # the peer bound is 3 s
    for r in (0, 1):
        (v,) = job.verdicts[r]
        assert v.silent_ranks == [2] and v.node_witness and not v.store_silent
        assert v.bound_s == 0.3 and "keep-alive stopped too" in v.message()
        assert v.fields()["node_witness"] is True


@pytest.mark.timeout(30)
def test_a_frozen_node_is_judged_even_when_the_store_goes_away_just_after(job_factory) -> None:
    # Rank 0 hosts the store; it judges node 2 first and leaves, taking the store with it,
    # before rank 1 has seen node 2's heartbeat stand still for long while the store
    # answered. Rank 1 still has node 2's keep-alive as a witness: node bound, not the
    # store's 3 s bound on a store whose host node (node 0) lives.
    job = job_factory()
    time.sleep(0.6)
    job.clients[2].freeze()
    job.agents[2].stopped.set()
    frozen = time.monotonic()
    time.sleep(0.1)
    job.pg.freeze()  # rank 0's process (and the store it hosts) is gone
    assert _wait(lambda: job.verdicts[1], 10)
    (v,) = job.verdicts[1]
    assert time.monotonic() - frozen < 1.5
    assert v.silent_ranks == [2] and v.node_witness and not v.store_silent


@pytest.mark.timeout(30)
def test_a_frozen_node_is_marked_departed_with_the_keep_alive_it_left(job_factory) -> None:
    job = job_factory()
    time.sleep(0.6)
    job.clients[2].freeze()
    job.agents[2].stopped.set()
    assert _wait(lambda: job.verdicts[0] and job.verdicts[1], 10)
    time.sleep(0.1)  # the mark is written before the verdict is handed on: nothing pending
    standing = job.rdzv.get(keepalive_key("job", "node2"))
    assert job.rdzv.get(departed_key("job", "node2")) == standing
    for node in ("node0", "node1"):
        assert not job.rdzv.check([departed_key("job", node)])


@pytest.mark.timeout(30)
def test_a_stalled_rank_whose_node_lives_is_waited_for_and_said(job_factory, caplog) -> None:
    job = job_factory(timeout_s=0.6)
    time.sleep(0.6)
    caplog.set_level("WARNING", logger="elastic.heartbeat")
    # Its heartbeat stops (the GIL held); its agent goes on. Only its store calls block
    # here: in a real stall its monitor stops too and, once it runs again, judges nobody
    # on the gap (a self-stall), so here it does not judge the store its calls wait on.
    job.ranks[2].judge_store = False
    job.clients[2].freeze()
    assert _wait(lambda: job.stalls[0] and job.stalls[1], 10)
    time.sleep(1.5)  # well past the peer bound (0.6 s) and the node bound (0.3 s)
    assert not job.verdicts[0] and not job.verdicts[1]
    for r in (0, 1):
        (notice,) = job.stalls[r]  # once per stall
        assert notice.stalled_rank == 2 and notice.node == "node2" and notice.stalled_s > 0.6
        assert notice.fields()["limit_s"] == 30.0
    assert "is alive: its process is stalled" in caplog.text
    job.clients[2].running.set()  # the stall ends
    time.sleep(0.5)
    assert not job.verdicts[0] and not job.verdicts[1]
    assert job.ranks[0].running and job.ranks[1].running
    assert not job.ranks[0]._observed.stalled  # it beats again: the stall is over


@pytest.mark.timeout(30)
def test_a_stall_past_the_stall_limit_is_silent(job_factory) -> None:
    job = job_factory(timeout_s=0.6, stall_limit_s=1.5)
    time.sleep(0.6)
    job.clients[2].freeze()
    stalled = time.monotonic()
    assert _wait(lambda: job.verdicts[0] and job.verdicts[1], 10)
    assert time.monotonic() - stalled >= 1.5
    for r in (0, 1):
        (v,) = job.verdicts[r]
        assert v.silent_ranks == [2] and v.bound_s == 1.5 and not v.node_witness
    assert not job.rdzv.check([departed_key("job", "node2")])  # its node lives: not departed


@pytest.mark.timeout(30)
def test_without_the_rendezvous_store_the_peer_bound_alone_decides(job_factory, caplog) -> None:
    caplog.set_level("WARNING", logger="elastic.heartbeat")
    job = job_factory(timeout_s=1.2, reach_rdzv=False)
    time.sleep(0.6)
    job.clients[2].freeze()
    job.agents[2].stopped.set()
    frozen = time.monotonic()
    assert _wait(lambda: job.verdicts[0] and job.verdicts[1], 10)
    assert time.monotonic() - frozen >= 1.2 - 0.1
    assert not job.verdicts[0][0].node_witness and job.verdicts[0][0].bound_s == 1.2
    assert "judging by heartbeats alone" in caplog.text


@pytest.mark.timeout(30)
def test_a_frozen_store_host_node_is_a_store_verdict_at_the_node_bound(job_factory) -> None:
    job = job_factory()
    time.sleep(0.6)
    job.pg.freeze()  # rank 0 hosts the process group's store: its node freezes
    job.agents[0].stopped.set()
    frozen = time.monotonic()
    assert _wait(lambda: job.verdicts[1] and job.verdicts[2], 10)
    assert time.monotonic() - frozen < 1.5
    for r in (1, 2):
        (v,) = job.verdicts[r]
        assert v.store_silent and v.silent_ranks == [0] and v.node_witness


def test_malformed_node_values_are_ignored_never_a_crash(job_factory, caplog) -> None:
    caplog.set_level("WARNING", logger="elastic.heartbeat")
    job = job_factory(timeout_s=0.6)
    job.agents[1].done.set()
    job.rdzv.set(keepalive_key("job", "node1"), "not a keep-alive")
    job.pg.set("t/node/2", "bad\x00node")
    time.sleep(1.2)
    assert "not a counter" in caplog.text
    assert all(hb.running for hb in job.ranks)


# -- the ft agent tells its workers ----------------------------------------------------------


def test_each_round_exports_the_store_and_the_node_id_for_the_workers() -> None:
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    config = FtConfig(last_call_timeout=0.1, keep_alive_interval=0.05, join_timeout=20.0)
    exported: dict[str, str] = {"TORCHELASTIC_RUN_ID": "job"}
    handler = FtRendezvousHandler(
        TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)),
        "job", 1, 1, config=config, node_id="node_x", export_to=exported,
    )  # fmt: skip
    try:
        handler.next_rendezvous()
        channel = NodeChannel.from_env(exported)
        assert channel == NodeChannel("127.0.0.1", port, "node_x", "job")
        assert keepalive_counter(server.get(channel.key("node_x"))) is not None
    finally:
        handler._stop_heartbeat()
    del server
