"""The peer failure detector (elastic/heartbeat.py): pure decisions, the threads against a
fake store, and real gloo groups whose ranks are frozen with SIGSTOP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from elastic.heartbeat import (
    LEFT,
    PEER_SILENT_EXIT_CODE,
    PeerHeartbeat,
    SilentVerdict,
    StoreAddress,
    namespace,
    silent_peers,
    watched_peers,
)
from testing.ports import free_port

REPO = Path(__file__).resolve().parents[1]


# -- silent_peers: a table -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("last_seen", "now", "bound", "expected"),
    [
        ({}, 100.0, 6.0, []),  # nobody to watch
        ({1: 99.0, 2: 98.0}, 100.0, 6.0, []),  # all recent
        ({1: 94.0}, 100.0, 6.0, []),  # exactly the bound: not yet
        ({1: 93.9}, 100.0, 6.0, [1]),  # just past it
        ({3: 10.0, 1: 50.0, 2: 99.0}, 100.0, 6.0, [1, 3]),  # sorted, only the silent ones
        ({1: 110.0}, 100.0, 6.0, []),  # a startup grace in the future
        ({0: 0.0, 1: 0.0}, 1e9, 6.0, [0, 1]),  # everyone, long ago
        ({1: 99.0}, 100.0, 0.5, [1]),  # a short bound
    ],
)
def test_silent_peers_table(last_seen, now, bound, expected) -> None:
    assert silent_peers(last_seen, now, bound) == expected


@pytest.mark.parametrize("bound", [0.0, -1.0, float("inf"), float("nan")])
def test_silent_peers_rejects_a_bad_bound(bound) -> None:
    with pytest.raises(ValueError, match="bound"):
        silent_peers({1: 0.0}, 1.0, bound)


@pytest.mark.parametrize(
    ("rank", "world", "kwargs", "expected"),
    [
        (0, 1, {}, []),
        (0, 3, {}, [1, 2]),
        (2, 3, {}, [0, 1]),
        (5, 10, {"watch_all_up_to": 4, "neighbours": 3}, [6, 7, 8]),
        (9, 10, {"watch_all_up_to": 4, "neighbours": 3}, [0, 1, 2]),  # wraps around the ring
        (1, 5, {"watch_all_up_to": 2, "neighbours": 8}, [0, 2, 3, 4]),  # fewer peers than 8
    ],
)
def test_watched_peers_table(rank, world, kwargs, expected) -> None:
    assert watched_peers(rank, world, **kwargs) == expected


def test_every_rank_is_watched_by_its_neighbours_in_a_large_world() -> None:
    world = 200
    watchers: dict[int, int] = {}
    for rank in range(world):
        for peer in watched_peers(rank, world):
            watchers[peer] = watchers.get(peer, 0) + 1
    assert set(watchers) == set(range(world))
    assert set(watchers.values()) == {8}


def test_namespace_separates_attempts_and_world_sizes() -> None:
    keys = {namespace("job", a, w) for a in (0, 1) for w in (2, 3)}
    assert len(keys) == 4
    assert namespace("job", 1, 3) == "elastic_heartbeat/job/1/3"


def test_verdict_message_names_the_rank_and_host() -> None:
    verdict = SilentVerdict(
        rank=0,
        silent_ranks=[2],
        hosts={2: "host n2, address 10.1.2.4, pid 77"},
        silent_s=6.4,
        bound_s=6.0,
        store_silent=False,
        store="the TCP store at 10.1.2.2:29500 (hosted by rank 0)",
    )
    text = verdict.message()
    assert "rank 2 (host n2, address 10.1.2.4, pid 77)" in text
    assert "6.4s" in text and str(PEER_SILENT_EXIT_CODE) in text
    assert verdict.fields()["silent_ranks"] == [2]
    assert json.dumps(verdict.fields())  # an event payload


# -- the threads, against a fake store ------------------------------------------------------


class FakeStore:
    """An in-memory store shared by the fake ranks; ``freeze()`` makes every call block
    (as a TCPStore client does when its server is SIGSTOPped)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.running.set()

    def freeze(self) -> None:
        self.running.clear()

    def thaw(self) -> None:
        self.running.set()

    def client(self) -> FakeClient:
        return FakeClient(self)

    def _gate(self) -> None:
        self.running.wait()

    def add(self, key: str, value: int) -> int:
        self._gate()
        with self.lock:
            new = int(self.data.get(key, b"0")) + value
            self.data[key] = str(new).encode()
            return new

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._gate()
        with self.lock:
            return [self.data[k] for k in keys]

    def set(self, key: str, value: str) -> None:
        self._gate()
        with self.lock:
            self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        self._gate()
        with self.lock:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self._gate()
        with self.lock:
            return all(k in self.data for k in keys)


class FakeClient:
    """One rank's connection: ``freeze()`` blocks only this rank's calls (its process stopped)."""

    def __init__(self, store: FakeStore) -> None:
        self.store = store
        self.running = threading.Event()
        self.running.set()

    def freeze(self) -> None:
        self.running.clear()

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def call(*args):
            self.running.wait()
            return method(*args)

        return call


def _fake_rank(store: FakeStore, rank: int, world: int, verdicts: list, **kw) -> PeerHeartbeat:
    return PeerHeartbeat(
        rank=rank,
        world_size=world,
        address=StoreAddress("10.0.0.1", 1, 0),
        key_prefix="t",
        interval_s=0.05,
        timeout_s=0.6,
        on_silent=verdicts.append,
        exit_process=False,
        connect=kw.pop("connect", store.client),
        startup_grace_s=kw.pop("startup_grace_s", 0.5),
        self_info=f"fake host of rank {rank}",
        **kw,
    )


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.timeout(30)
def test_a_peer_that_stops_is_named_by_every_survivor() -> None:
    store = FakeStore()
    verdicts: dict[int, list] = {r: [] for r in range(3)}
    clients = [store.client() for _ in range(3)]
    ranks = [
        _fake_rank(store, r, 3, verdicts[r], connect=lambda c=clients[r]: c).start()
        for r in range(3)
    ]
    try:
        time.sleep(0.5)
        assert not any(verdicts.values())
        # Rank 2 freezes: its heartbeat thread stops in its next store call.
        clients[2].freeze()
        stopped = time.monotonic()
        assert _wait(lambda: verdicts[0] and verdicts[1], 5)
        detected = time.monotonic() - stopped
        for r in (0, 1):
            (v,) = verdicts[r]
            assert v.silent_ranks == [2] and not v.store_silent
            assert v.hosts == {2: "fake host of rank 2"}
            assert v.silent_s > 0.6
        # Its last beat may have left up to one interval (0.05 s) before the
        # freeze, and survivors see it only at their next poll: the silence they
        # measure starts that much before `stopped`.
        assert 0.6 - 2 * 0.05 <= detected < 3.0
    finally:
        for hb in ranks:
            hb.stop()


@pytest.mark.timeout(30)
def test_a_bound_crossed_between_two_reads_is_acted_on_within_the_judging_cadence() -> None:
    # Reads every 0.5 s taking 0.2 s each, bound 2 s: a monitor that judged at the read
    # cadence (woken with the reads) would see the bound crossed 0.2 s after it looked, and
    # act at its next look, 0.3 s past the bound.
    store = FakeStore()
    verdicts: dict[int, list] = {r: [] for r in range(4)}

    class SlowReads(FakeClient):
        def multi_get(self, keys):
            values = self.__getattr__("multi_get")(keys)
            time.sleep(0.2)
            return values

    clients = [SlowReads(store) for _ in range(4)]
    ranks = [
        PeerHeartbeat(
            rank=r, world_size=4, address=StoreAddress("10.0.0.1", 1, 0), key_prefix="t",
            interval_s=0.5, timeout_s=2.0, on_silent=verdicts[r].append, exit_process=False,
            connect=lambda c=clients[r]: c, startup_grace_s=0.5, self_info=f"host {r}",
        ).start()
        for r in range(4)
    ]  # fmt: skip
    try:
        time.sleep(1.2)
        clients[3].freeze()
        assert _wait(lambda: all(verdicts[r] for r in range(3)), 10)
        for r in range(3):
            (v,) = verdicts[r]
            assert v.silent_ranks == [3] and v.bound_s == 2.0
            assert 2.0 < v.silent_s < 2.0 + 0.15, (r, v.silent_s)
    finally:
        for hb in ranks:
            hb.stop()


@pytest.mark.timeout(30)
def test_a_frozen_store_counts_as_its_host_rank_being_silent() -> None:
    store = FakeStore()
    verdicts: dict[int, list] = {r: [] for r in range(3)}
    ranks = [_fake_rank(store, r, 3, verdicts[r]).start() for r in range(3)]
    try:
        time.sleep(0.4)
        store.freeze()  # rank 0's process (the store's host) is SIGSTOPped
        assert _wait(lambda: verdicts[1] and verdicts[2], 5)
        for r in (1, 2):
            (v,) = verdicts[r]
            assert v.store_silent and v.silent_ranks == [0]
            assert v.hosts == {0: "fake host of rank 0"}
    finally:
        store.thaw()
        for hb in ranks:
            hb.stop()


@pytest.mark.timeout(30)
def test_ranks_that_leave_cleanly_are_not_silent() -> None:
    store = FakeStore()
    verdicts: dict[int, list] = {r: [] for r in range(3)}
    ranks = [_fake_rank(store, r, 3, verdicts[r]).start() for r in range(3)]
    try:
        time.sleep(0.3)
        ranks[0].stop()  # the store host leaves first, then its store goes away
        ranks[2].stop()
        assert int(store.data["t/beat/0"]) >= LEFT
        time.sleep(0.3)  # rank 0's process lives on a moment after leaving the guard
        store.freeze()
        time.sleep(1.5)  # 2.5 x the bound
        assert not any(verdicts.values())
        io_thread = ranks[1]._threads[0]
        assert not io_thread.is_alive()  # no more round trips to a departed host's store
    finally:
        store.thaw()
        for hb in ranks:
            hb.stop()


@pytest.mark.timeout(30)
def test_a_peer_that_never_starts_gets_the_startup_grace_then_is_silent() -> None:
    store = FakeStore()
    verdicts: list = []
    hb = _fake_rank(store, 0, 2, verdicts, startup_grace_s=1.0).start()
    started = time.monotonic()
    try:
        assert _wait(lambda: verdicts, 6)
        assert time.monotonic() - started >= 1.0 + 0.6
        assert verdicts[0].silent_ranks == [1]
        assert "no heartbeat seen" in verdicts[0].hosts[1]
    finally:
        hb.stop()


def test_judging_after_a_self_stall_starts_afresh() -> None:
    hb = _fake_rank(FakeStore(), 1, 2, [])  # rank 1 watches rank 0, which hosts the store
    hb.start()
    hb.stop()
    obs = hb._observed
    assert obs is not None
    obs.last_ok = 100.0
    obs.last_seen = {0: 90.0}
    verdict = hb.judge(now=100.1, baseline=0.0)
    assert verdict.silent_ranks == [0] and not verdict.store_silent
    assert verdict.silent_s == pytest.approx(10.1)
    # This process did not run from 90 to 99.9: nothing before the baseline counts.
    assert hb.judge(now=100.1, baseline=99.9) is None
    # No store round trip completed for 5 s (bound 0.6): the store's host is silent.
    verdict = hb.judge(now=105.0, baseline=0.0)
    assert verdict.store_silent and verdict.silent_ranks == [0]
    assert verdict.silent_s == pytest.approx(5.0)
    # A slow store does not make a peer silent: at the last completed read its counter
    # had moved 0.2 s before (less than two heartbeats).
    obs.last_seen = {0: 99.8}
    assert hb.judge(now=100.5, baseline=0.0) is None


def test_a_peer_silent_before_the_store_went_away_is_still_named() -> None:
    # Rank 2 watches ranks 0 (the store's host) and 1; bound 6 s, heartbeat 0.5 s. Rank 1
    # froze at 94.5; rank 0 noticed first and left at 100, taking the store with it, so
    # rank 2's reads fail from then on: rank 2 must still name rank 1 at 100.5, not wait
    # another 6 s for the store.
    hb = PeerHeartbeat(
        rank=2,
        world_size=3,
        address=StoreAddress("10.0.0.1", 1, 0),
        key_prefix="t",
        interval_s=0.5,
        timeout_s=6.0,
        connect=FakeStore().client,
        exit_process=False,
        self_info="rank 2",
    )
    hb.start()
    hb.stop()
    obs = hb._observed
    assert obs is not None
    obs.last_ok, obs.last_seen = 100.0, {0: 99.9, 1: 94.5}
    assert hb.judge(now=100.3, baseline=0.0) is None  # rank 1 silent 5.8 s: not yet
    verdict = hb.judge(now=100.6, baseline=0.0)
    assert verdict.silent_ranks == [1] and not verdict.store_silent
    assert verdict.silent_s == pytest.approx(6.1)


# -- real gloo groups, real TCPStore, SIGSTOP -------------------------------------------------

CHILD = textwrap.dedent(
    """
    import datetime, json, logging, os, sys, time
    import torch, torch.distributed as dist
    import elastic

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s [rank %(process)d] %(message)s")
    rank, world, port, mode, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    events = []
    def on_event(name, step, every_rank=False, **fields):
        with open(os.path.join(out, f"events.{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"event": name, "step": step, "time": time.time(), **fields}) + "\\n")
    with elastic.RunGuard(on_event=on_event, watchdog_s=0, heartbeat_s=0.25,
                          peer_timeout_s=3.0, env={}) as guard:
        assert guard.heartbeat is not None
        print("ready", flush=True)
        t = torch.ones(1)
        for step in guard.steps(0, 10**6):
            if mode == "busy" and step == 3:
                time.sleep(7)  # a long legitimate phase (a slow save): GIL released
                big = torch.randn(1500, 1500)
                for _ in range(10):
                    big = big @ big / 1500.0  # torch releases the GIL
            dist.all_reduce(t)
            time.sleep(0.1)
            if mode == "busy" and step == 20:
                stats = guard.heartbeat.stats()
                print("stats", json.dumps(stats), flush=True)
                break
    dist.barrier()
    print("done", flush=True)
    sys.stdout.flush()
    os._exit(0)
    """
)


class Group:
    """``world`` processes in one gloo group over a TCPStore hosted by rank 0."""

    def __init__(self, tmp_path: Path, world: int, mode: str = "train") -> None:
        self.tmp = tmp_path
        script = tmp_path / "child.py"
        script.write_text(CHILD)
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(name, None)
        self.procs = []
        self.logs = []
        for rank in range(world):
            log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115
            self.logs.append(log)
            cmd = [
                sys.executable,
                str(script),
                str(rank),
                str(world),
                str(port),
                mode,
                str(tmp_path),
            ]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            self.procs.append(proc)

    def log(self, rank: int) -> str:
        return (self.tmp / f"rank{rank}.log").read_text(errors="replace")

    def events(self, rank: int) -> list[dict]:
        path = self.tmp / f"events.{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_ready(self, timeout_s: float = 60) -> None:
        assert _wait(
            lambda: all("ready" in self.log(r) for r in range(len(self.procs))), timeout_s
        ), [self.log(r) for r in range(len(self.procs))]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(10)
        for log in self.logs:
            log.close()


@pytest.fixture
def group_factory(tmp_path):
    groups: list[Group] = []

    def make(world: int, mode: str = "train") -> Group:
        sub = tmp_path / f"g{len(groups)}"
        sub.mkdir()
        group = Group(sub, world, mode)
        groups.append(group)
        return group

    yield make
    for group in groups:
        group.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("frozen", [2, 0], ids=["peer-frozen", "store-host-frozen"])
def test_survivors_of_a_sigstopped_rank_leave_within_the_bound(group_factory, frozen) -> None:
    group = group_factory(3)
    group.wait_ready()
    time.sleep(1.0)
    os.kill(group.procs[frozen].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    survivors = [r for r in range(3) if r != frozen]
    for r in survivors:
        group.procs[r].wait(30)
    took = time.monotonic() - stopped
    detected = [r for r in survivors if group.procs[r].returncode == PEER_SILENT_EXIT_CODE]
    assert detected, [group.log(r) for r in survivors]
    for r in survivors:
        if r not in detected:
            # The first survivor to leave closed its gloo connections: this one's collective
            # failed at once ("Connection closed by peer"), before its own verdict.
            assert group.procs[r].returncode == 1 and "Connection closed" in group.log(r)
            continue
        assert f"rank {frozen} (host" in group.log(r), group.log(r)
        (event,) = [e for e in group.events(r) if e["event"] == "peer_silent"]
        assert event["silent_ranks"] == [frozen]
        assert event["store_silent"] == (frozen == 0)
        assert event["silent_s"] > 3.0
    # Bound 3 s, heartbeat 0.25 s: the survivors leave in about 3 s (measured 3.0-3.3),
    # not after the 120 s collective timeout.
    assert took < 10, took
    print(f"frozen rank {frozen}: survivors left {took:.1f}s after SIGSTOP")


@pytest.mark.timeout(120)
def test_a_long_busy_phase_with_the_gil_released_does_not_fire(group_factory) -> None:
    group = group_factory(2, mode="busy")
    for proc in group.procs:
        proc.wait(100)
    for r in range(2):
        assert group.procs[r].returncode == 0, group.log(r)
        assert "done" in group.log(r)
        assert not [e for e in group.events(r) if e["event"] == "peer_silent"]
    stats = json.loads(group.log(0).split("stats ", 1)[1].splitlines()[0])
    # Heartbeats kept flowing while the training thread slept 7 s (2.3x the 3 s bound)
    # and multiplied matrices: no gap much longer than the 0.25 s interval.
    assert stats["max_beat_gap_s"] < 1.5, stats


# -- configuration ---------------------------------------------------------------------------


def test_trainer_config_turns_the_detector_on_by_default() -> None:
    from trainer.config import load_config

    run = load_config(None).run
    assert (run.peer_timeout_s, run.heartbeat_s) == (5.0, 0.25)
    assert (run.node_timeout_s, run.peer_stall_limit_s) == (1.0, 60.0)  # ft: elastic/nodes.py
    assert load_config(None, ["run.peer_timeout_s=0"]).run.peer_timeout_s == 0.0  # off


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["run.peer_timeout_s=-1"], "run.peer_timeout_s"),
        (["run.heartbeat_s=0"], "run.heartbeat_s"),
        (["run.peer_timeout_s=1", "run.heartbeat_s=1"], "run.peer_timeout_s"),  # < 2 beats
        (["run.node_timeout_s=0.3"], "run.node_timeout_s"),  # < 2 beats of 0.25 s
        (["run.peer_stall_limit_s=3"], "run.peer_stall_limit_s"),  # below the peer bound
    ],
)
def test_trainer_config_rejects_bad_detector_settings(overrides, named) -> None:
    from trainer.config import load_config

    with pytest.raises(ValueError, match=named):
        load_config(None, overrides)


def test_run_guard_rejects_a_negative_peer_timeout() -> None:
    from elastic.guard import RunGuard

    with pytest.raises(ValueError, match="peer_timeout_s"):
        RunGuard(env={}, peer_timeout_s=-1.0)


# -- the start-up detector: store judgement off, a stop condition, taken over by a guard ------


@pytest.mark.timeout(30)
def test_without_store_judgement_a_store_gone_quiet_is_no_verdict_but_a_stopped_peer_is() -> None:
    store = FakeStore()
    verdicts: dict[int, list] = {r: [] for r in range(3)}
    clients = [store.client() for _ in range(3)]
    ranks = [
        _fake_rank(store, r, 3, verdicts[r], connect=lambda c=clients[r]: c, judge_store=False)
        for r in range(3)
    ]
    for hb in ranks:
        hb.start()
    try:
        time.sleep(0.4)
        clients[2].freeze()  # rank 2 stops while the store answers: still named
        assert _wait(lambda: verdicts[0] and verdicts[1], 5)
        assert [v.silent_ranks for v in verdicts[0]] == [[2]]
        store.freeze()  # now the store's host goes away without saying so
        time.sleep(1.5)  # 2.5 x the bound
        assert not verdicts[2]  # rank 2 never judges the store (nor its frozen self)
    finally:
        store.thaw()
        for client in clients:
            client.running.set()
        for hb in ranks:
            hb.stop()


@pytest.mark.timeout(30)
def test_a_detector_whose_keep_running_turns_false_leaves_cleanly() -> None:
    store = FakeStore()
    verdicts: dict[int, list] = {r: [] for r in range(2)}
    group_up = threading.Event()
    group_up.set()
    ranks = [
        _fake_rank(store, 0, 2, verdicts[0], keep_running=group_up.is_set).start(),
        _fake_rank(store, 1, 2, verdicts[1]).start(),
    ]
    try:
        time.sleep(0.3)
        group_up.clear()  # rank 0's process group was destroyed
        assert _wait(lambda: not ranks[0].running, 2)
        assert int(store.data["t/beat/0"]) >= LEFT
        time.sleep(1.5)
        assert not verdicts[1]  # a rank that left is not silent
    finally:
        for hb in ranks:
            hb.stop()


@pytest.mark.timeout(30)
def test_configure_gives_a_running_detector_its_new_owners_settings() -> None:
    store = FakeStore()
    verdicts: list = []
    taken: list = []
    hb = _fake_rank(store, 0, 2, verdicts, startup_grace_s=0.3, judge_store=False).start()
    try:
        with pytest.raises(ValueError, match="at least twice"):
            hb.configure(interval_s=0.5, timeout_s=0.6, on_silent=taken.append)
        hb.configure(interval_s=0.05, timeout_s=0.4, on_silent=taken.append)
        assert hb.judge_store  # the new owner judges the store again
        assert _wait(lambda: taken, 5)  # rank 1 never came: the new callback hears it
        assert not verdicts and taken[0].bound_s == 0.4
    finally:
        hb.stop()
