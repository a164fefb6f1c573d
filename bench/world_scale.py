"""World scale: what one world change costs at 1,024, 4,096 and 16,384 ranks in Tidal's own
path, measured on this machine with lightweight clients in place of torch workers, plus the
communicator set-up that cannot be measured here, cited.

A world change at scale, part by part:

(a) The rendezvous store, measured. One launcher serves the generation's store to every
    rank: the real TCPStore server, made as the launcher makes it (`launcher.store.ServedStore`:
    a listening socket bound by the launcher, served by the `store_server` child process).
    Every rank is a real C-level TCPStore client (`torch.distributed.TCPStore(is_master=False)`)
    on a thread of one of CLIENT_PROCESSES client processes, and does exactly the store
    operations of Tidal's worker path (`train.world.Membership.form`) and of the collective
    backend's connect that a GPU world uses (NCCL):
      - connect (a new client, as `_connect_store`; see CONNECT_ATTEMPT_S; at most
        CONNECTS_IN_FLIGHT of a client process at once), or with the connection kept, the
        check of it;
      - the arrival barrier, `train.world.await_peers` itself: one add; the last rank to
        arrive sets a key, the others wait for it (one wait each);
      - the groups' NCCL unique ids, as torch 2.13's ProcessGroupNCCL fetches them at the
        first collective (ProcessGroupNCCL.cpp `initNCCLComm`): a group of more than
        TORCH_NCCL_RANKS_PER_ROOT (128) ranks uses NCCL's scalable init, where each of its
        ceil(size/128) root ranks sets its 128-byte id ("UniqueNCCLID:<root>") and every rank
        multiGets all of them (`allgatherUniqueNCCLIDs`); a smaller group is one set by its
        rank 0 (key "0") and one get by each other rank (`broadcastUniqueNCCLID`). The groups
        are those of a replica of one node sharded over its 8 GPUs (`HybridSharded`): the
        replica group of each shard index (size/8 ranks) and the replica's shard group (8
        ranks), under the prefixes `train.groups.form_groups` and `Membership.form` give
        them. No group of every rank: a live HybridSharded world has none (its world-wide
        collectives go through the shard and replica groups, `train.groups.gather_world`);
        before 2026-11-27 it had one, whose scalable init made every rank fetch 128 ids.
    The figure is the wall time from the moment every rank is told the world (all at once)
    to the moment the last rank holds every id it needs, median over repetitions (with when
    the last rank had connected and when all knew all had arrived); and the store server's
    CPU seconds in that window. The figure charged to a world change is every rank
    connecting anew (a first world, one whose store host was lost, and every world change
    before workers kept their connection). At --kept-sizes (default 1,024 and 4,096; --quick:
    its smallest) it is also measured with the survivors' connections kept, as a worker keeps
    its client when the next world's store is at the same address (`train.world.Membership.
    _kept_store`; the controller keeps rank 0's unit as host while it lives): a warm-up
    generation, not measured, only connects the clients, and each measured one starts with a read-only check instead of
    a connect. That second figure is reported, not charged: on this machine it is no smaller
    within the noise (1,024 and 4,096 ranks), and at 8,192 and 16,384 ranks it was larger
    (2026-11-27: 8,192 ranks 39.7 and 42.5 s kept against 24.1 and 28.2 s connecting;
    16,384 ranks 351 s kept, the server 7 s of CPU of it): thousands of client threads of a
    process wake at once and queue for its GIL, where connecting spreads them out; a
    cluster's workers are processes on other hosts. Not resolved here.
    The clients share this machine's 2 cores with the server, and a client thread's Python
    between its store calls holds its process's GIL: on a cluster the clients are on other
    hosts, so the wall time here is an upper bound of the store's share, and the server's
    CPU seconds the serial work no client host can take off it. Reverse DNS: torch names
    each connection's peer with getnameinfo on both ends (on the server, on its loop
    thread); this sandbox's resolver throttles those lookups, so the processes here run with
    getnameinfo made numeric (NUMERIC_NAMES_C). On a cluster whose resolver answers slowly
    for the workers' addresses, that is one lookup per rank on the store server's loop each
    world change, not measured here. Gloo's full-mesh connect (every rank reads every rank's
    key of N addresses: O(N^2) bytes) is not what a 16,384-GPU world uses and is not
    measured at scale. File descriptors: the server holds one socket per rank; the soft
    RLIMIT_NOFILE is raised to the hard one (20,000 here) before the server starts, each
    client process holds size/CLIENT_PROCESSES, and a repetition starts only once the server
    closed the previous one's sockets.

(b) The controller, measured: forming a generation of size/8 launchers (8 GPUs a node, one
    node a unit) with its own functions: `planning.plan_generation` (the rank table), the
    member lookups `forming.commit_generation` does for each unit, and the messages it
    sends, each built (`core.messages`) and serialized as gRPC does per stream: a failure's
    next generation (`messages.member`, each launcher its own assignment) and a change at a
    step boundary (`messages.at_step_boundary`, the whole table to each launcher). The
    figure is the larger of the two, plus the plan. The real controller process's fan-out
    of a failure at 2,000 launchers over gRPC (bench.controller_scale) is shown beside it
    when bench/results/controller_scale.json has it.

(c) The launchers' relay, measured: what one launcher does per generation, its 8 workers
    together: parse the serialized Generation, decide (`launcher.worlds.on_generation`),
    build each worker's World and send it over a Unix socket (`proto.control.encode`), the
    worker decoding it. Launchers relay in parallel, so one launcher's time is the part.

(d) The communicator set-up, cited, not measured (no GPU here): COMMUNICATOR_CITED below
    says the source and the figure. What a world change sets up is each GPU's replica group
    (size/8 ranks: 2,048 at 16,384 GPUs; the 8 groups of a node's GPUs at once, each its own
    NCCL bootstrap) and its shard group (the node's 8 GPUs). Under `DataParallel` (every GPU
    a replica) the replica group is every rank: COMMUNICATOR_EVERY_RANK_CITED, reported.

Total = store + controller + relay + communicator. `bench.cluster_sim` reads the 16,384 row's
parts from bench/results/world_scale.json for its Tidal-at-scale row.

Baseline (same run, at `--baseline-sizes`, default 1,024, 4,096 and 16,384 ranks, 2
repetitions): the store as a world change used it before 2026-11-27, with a group of every
rank as well (its NCCL ids: at 16,384 ranks, 128 roots' ids fetched by every rank). (The
baseline before that, the arrival barrier polled every 2 ms by every rank, took 360 s at
4,096 ranks in 2026-11-26's run; docs/benchmarks.md keeps it.)

No goal of its own: the goal (ETTR ≥ 97 % at 16,384 GPUs) is bench.cluster_sim's, which
takes these figures.

`--quick`: 128 and 256 ranks, 2 repetitions, no baseline (about 10 s on 2 cores)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, Row, median, parser, workspace, write_result

SIZES = (1_024, 4_096, 16_384)
QUICK_SIZES = (128, 256)
GPUS_PER_NODE = 8
# A replica of one node, sharded over its GPUs: world, replica and shard groups.
SHARD_SIZE = 8
# torch 2.13's ProcessGroupNCCL: TORCH_NCCL_RANKS_PER_ROOT's default, and an id's size.
NCCL_RANKS_PER_ROOT = 128
NCCL_UNIQUE_ID_BYTES = 128
CLIENT_PROCESSES = 8
# The worker path's store timeout (`Membership.timeout_s` of a typical job).
STORE_TIMEOUT_S = 300.0
# A worker's store connect: attempts of 1 s within 10 s (`train.world._connect_store`).
# Here 16,384 client threads share 2 cores with the server, and a thread not run within
# its attempt's second times out for want of a core, not for the server: the clients get
# attempts of CONNECT_ATTEMPT_S within CONNECT_DEADLINE_S (what a rank waits is measured).
CONNECT_ATTEMPT_S = 5.0
CONNECT_DEADLINE_S = 120.0
# A client process connects at most this many of its ranks at once (8 processes: 256 in
# flight), below the server's listen backlog (net.core.somaxconn, 4,096 here). Unbounded,
# 16,384 connects at once on 2 cores overflowed it (2026-11-27: 80,806 listen drops) and
# every rank of one client process, its threads starved of the cores, failed to connect
# within CONNECT_DEADLINE_S: the run measured nothing. Bounded, no listen drops, but that
# day's runs at 16,384 ranks still did not finish: the ranks that arrived waited out the
# 300 s store timeout with the machine idle (8 and, tried once, 32 client processes). Not
# resolved; the last 16,384-rank figure is d8f299b's (2026-11-26). A cluster's ranks
# connect from 2,048 hosts with cores of their own; what SYN drops at a full backlog would
# add there is not measured.
CONNECTS_IN_FLIGHT = 32

# The communicator set-up at scale, from a public figure (no GPU here to measure it).
MEGASCALE_SOURCE = ("Jiang et al., MegaScale: Scaling Large Language Model Training to More Than 10,000 GPUs, "
                    "NSDI 2024, its section on collective communication group initialization: with their "
                    "fixes (the TCPStore replaced by Redis, an O(n) global barrier), initialization of a "
                    "2,048-GPU job from 1,047 s to under 5 s, and of a job of more than 10,000 GPUs under 30 s")
MEGASCALE_URL = "https://www.usenix.org/conference/nsdi24/presentation/jiang-ziheng"
MEGASCALE_HOW = ("from the paper as remembered, the passage not retrieved here (the search tool found the "
                 "paper's page and summaries, not the sentence)")
# Charged: a live HybridSharded world's largest group has one rank per replica (2,048 at
# 16,384 GPUs in one-node replicas); used for every size here (at most 2,048 replicas).
COMMUNICATOR_CITED: dict[str, Any] = {
    "seconds": 5.0,
    "gpus": "2,048",
    "source": MEGASCALE_SOURCE,
    "url": MEGASCALE_URL,
    "how_cited": MEGASCALE_HOW + ": their whole initialization of a 2,048-GPU job (every group of its "
                 "3D parallelism), taken as an upper figure for what a world change of HybridSharded "
                 "one-node replicas sets up on each GPU: a replica group of at most 2,048 ranks (the 8 "
                 "of a node at once) and the node's shard group of 8. Not measured: no GPU here",
}
# Reported: under DataParallel the replica group is every rank.
COMMUNICATOR_EVERY_RANK_CITED: dict[str, Any] = {
    "seconds": 30.0,
    "gpus": "more than 10,000",
    "source": MEGASCALE_SOURCE,
    "url": MEGASCALE_URL,
    "how_cited": MEGASCALE_HOW + ": an upper figure for their whole initialization at 12,288 GPUs, used "
                 "as-is for a group of 16,384 ranks",
}


# (a) The store.

# torch's c10d sockets name each connection's peer with getnameinfo (a reverse DNS lookup,
# client and server side, for their log lines even when not logged); this sandbox's resolver
# throttles those (about 25 in a burst, then 5 s timeouts), which no cluster's /etc/hosts or
# nscd would. The client processes and the store server run with getnameinfo made numeric.
NUMERIC_NAMES_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>
int getnameinfo(const struct sockaddr *addr, socklen_t addrlen, char *host, socklen_t hostlen, char *serv,
                socklen_t servlen, int flags) {
    static int (*real)(const struct sockaddr *, socklen_t, char *, socklen_t, char *, socklen_t, int) = 0;
    if (!real) real = dlsym(RTLD_NEXT, "getnameinfo");
    return real(addr, addrlen, host, hostlen, serv, servlen, flags | NI_NUMERICHOST | NI_NUMERICSERV);
}
"""


def numeric_names_preload(folder: Path) -> str | None:
    """Build the getnameinfo shim (see NUMERIC_NAMES_C) into `folder`; its path, or None
    without a C compiler (then the sandbox's resolver limits how many ranks connect)."""
    source, library = folder / "numeric_names.c", folder / "numeric_names.so"
    source.write_text(NUMERIC_NAMES_C)
    try:
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"], check=True,
                       capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return str(library)


def nccl_connect(store: Any, rank: int, size: int, unique_id: bytes) -> int:
    """The store operations of one rank of a ProcessGroupNCCL of `size` ranks at its first
    collective (torch 2.13): scalable init above NCCL_RANKS_PER_ROOT ranks, else rank 0's
    broadcast. Returns the round trips made."""
    if size <= 1:
        return 0
    if size <= NCCL_RANKS_PER_ROOT:
        if rank == 0:
            store.set("0", unique_id)
        else:
            store.get("0")
        return 1
    roots = (size + NCCL_RANKS_PER_ROOT - 1) // NCCL_RANKS_PER_ROOT
    keys = [f"UniqueNCCLID:{r}" for r in range(roots)]
    trips = 0
    # The roots spread evenly over the ranks (`getRootIndex`).
    for index in range(roots):
        if rank == index * size // roots:
            store.set(keys[index], unique_id)
            trips += 1
    store.multi_get(keys)
    return trips + 1


def connect(host: str, port: int, connecting: threading.Semaphore | None = None) -> Any:
    """A rank's store client (attempts of CONNECT_ATTEMPT_S within CONNECT_DEADLINE_S);
    `connecting` bounds the connects in flight (CONNECTS_IN_FLIGHT)."""
    import torch.distributed as dist

    deadline = time.monotonic() + CONNECT_DEADLINE_S
    while True:
        try:
            with connecting or contextlib.nullcontext():
                return dist.TCPStore(host, port, is_master=False,
                                     timeout=datetime.timedelta(seconds=CONNECT_ATTEMPT_S), wait_for_workers=False)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def rank_path(host: str, port: int, generation: int, rank: int, size: int, world_group: bool,
              kept: Any = None,
              connecting: threading.Semaphore | None = None) -> tuple[Any, tuple[float, float, float]]:
    """One rank's store operations for one generation (see the module); returns its client
    (kept until the next generation, as a worker keeps `_store`) and when it was connected,
    when every rank had arrived, and when it finished (time.time()). With `kept` (a client
    of the previous generation at the same store), no connect: the worker's read-only check
    that the server still answers (`train.world.Membership._kept_store`), then the same
    operations. `world_group`: also a group of every rank's NCCL ids (the baseline: before
    2026-11-27, a live HybridSharded world had one)."""
    import torch.distributed as dist

    from tidal.proto.control import World
    from tidal.train import world as worlds

    if kept is not None:
        store = kept
        worlds.check_kept_store(store, worlds.STORE_TIMEOUT_S)
    else:
        store = connect(host, port, connecting)
    connected = time.time()
    store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    prefix = dist.PrefixStore(f"gen/{generation}", store)
    world = World(generation=generation, rank=rank, world_size=size, master_addr=host, master_port=port)
    # A worker looks at its launcher's word every 2 ms meanwhile (no store operation): here
    # there is no launcher, and hundreds of ranks share a process, so it looks once a second.
    worlds.await_peers(prefix, world, deadline=time.monotonic() + STORE_TIMEOUT_S, timeout_s=STORE_TIMEOUT_S,
                       check_interrupted=lambda: None, look_s=1.0)
    arrived = time.time()
    unique_id = os.urandom(NCCL_UNIQUE_ID_BYTES)
    group = dist.PrefixStore("group", prefix)
    shard_rank, replica = rank % SHARD_SIZE, rank // SHARD_SIZE
    if world_group:
        nccl_connect(dist.PrefixStore("world", group), rank, size, unique_id)
    nccl_connect(dist.PrefixStore(f"replica/{shard_rank}", group), replica, size // SHARD_SIZE, unique_id)
    nccl_connect(dist.PrefixStore(f"shard/{replica}", prefix), shard_rank, SHARD_SIZE, unique_id)
    return store, (connected, arrived, time.time())


def client_main(args: argparse.Namespace) -> None:
    """A client process: ranks `first`..`first+count-1` of a world of `size`, one thread each.
    Reads `go <generation> <world group: 0 or 1> <how>` (threads made: answers `ready`), then `start`
    (runs them: answers `done <last connected> <last arrived> <last finished> <errors> <first
    error>`, then `closed` once its clients are dropped, or kept). `how`: `connect` (every
    rank connects anew, its client dropped after), `warm` (connects, at most
    CONNECTS_IN_FLIGHT at once, as every connect here, clients kept) or `kept` (the kept clients,
    no connect)."""
    import torch.distributed  # noqa: F401  (once, before the threads)

    threading.stack_size(256 * 1024)
    stores: list[Any] = [None] * args.count
    finished = [(0.0, 0.0, 0.0)] * args.count
    errors: list[str] = []
    connecting = threading.Semaphore(CONNECTS_IN_FLIGHT)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "go":
            break
        generation, world_group, how = int(words[1]), words[2] == "1", words[3]
        go = threading.Event()

        def run(index: int, generation: int = generation, world_group: bool = world_group, go: threading.Event = go,
                how: str = how) -> None:
            go.wait()
            try:
                if how == "warm":
                    stores[index] = connect(args.host, args.port, connecting)
                    finished[index] = (time.time(),) * 3
                else:
                    stores[index], finished[index] = rank_path(args.host, args.port, generation, args.first + index,
                                                               args.size, world_group,
                                                               kept=stores[index] if how == "kept" else None,
                                                               connecting=connecting)
            except Exception as error:  # reported, the run fails
                errors.append(f"rank {args.first + index}: {type(error).__name__}: {error}")

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(args.count)]
        for thread in threads:
            thread.start()
        print("ready", flush=True)
        sys.stdin.readline()  # "start"
        go.set()
        for thread in threads:
            thread.join()
        latest = [max(f[i] for f in finished) for i in range(3)]
        print(f"done {latest[0]:.6f} {latest[1]:.6f} {latest[2]:.6f} {len(errors)} {errors[0] if errors else ''}",
              flush=True)
        errors.clear()
        if how == "connect":
            # The generation's clients close before the next one's connect (the server's fds).
            stores[:] = [None] * args.count
        print("closed", flush=True)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def measure_store(size: int, repetitions: int, world_group: bool, first_generation: int,
                  kept: bool = False) -> dict[str, Any]:
    """`repetitions` generations of `size` ranks at one real store server (see the module);
    `world_group`: with a group of every rank as well (the baseline).
    `kept`: a world change whose store host survived: every rank keeps its client from the
    generation before (a warm-up generation, not measured, connects them) and only checks it."""
    from tidal.launcher.store import ServedStore, stop_store_server

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < size + 64:
        raise SystemExit(f"world_scale: {size} ranks need {size + 64} file descriptors in the store server; "
                         f"the hard limit is {hard}")
    served = ServedStore("127.0.0.1")
    served.wait(120.0)
    server_pid = served.server_pid
    assert server_pid is not None
    baseline_fds = open_fds(server_pid)
    processes = min(CLIENT_PROCESSES, max(1, size // 128))
    clients: list[subprocess.Popen[str]] = []
    walls: list[float] = []
    server_cpu: list[float] = []
    # When the last rank had connected, and when every rank knew all had arrived.
    connected: list[float] = []
    arrived: list[float] = []
    try:
        per = size // processes
        for index in range(processes):
            count = per if index < processes - 1 else size - per * (processes - 1)
            clients.append(subprocess.Popen(
                [sys.executable, "-m", "bench.world_scale", "--client", "--host", "127.0.0.1", "--port",
                 str(served.port), "--first", str(index * per), "--count", str(count), "--size", str(size)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True))
        for repetition in range(-1 if kept else 0, repetitions):
            generation = first_generation + repetition + (1 if kept else 0)
            how = "connect" if not kept else "warm" if repetition < 0 else "kept"
            for client in clients:
                assert client.stdin is not None
                client.stdin.write(f"go {generation} {int(world_group)} {how}\n")
                client.stdin.flush()
            for client in clients:
                assert client.stdout is not None
                line = client.stdout.readline()
                if line.strip() != "ready":
                    raise RuntimeError(f"client said {line!r}")
            cpu0 = cpu_seconds(server_pid)
            started = time.time()
            for client in clients:
                assert client.stdin is not None
                client.stdin.write("start\n")
                client.stdin.flush()
            latest = [0.0, 0.0, 0.0]
            for client in clients:
                assert client.stdout is not None
                words = client.stdout.readline().split(maxsplit=5)
                if not words or words[0] != "done" or words[4] != "0":
                    raise RuntimeError(f"a client failed: {' '.join(words)}")
                latest = [max(a, float(b)) for a, b in zip(latest, words[1:4], strict=True)]
            for client in clients:
                assert client.stdout is not None
                client.stdout.readline()  # "closed"
            if how == "warm":
                print(f"world_scale: store, {size} ranks: warm-up generation connected in {latest[2] - started:.3f} s"
                      " (not measured)", flush=True)
                continue
            server_cpu.append(cpu_seconds(server_pid) - cpu0)
            walls.append(latest[2] - started)
            connected.append(latest[0] - started)
            arrived.append(latest[1] - started)
            # The server has closed the generation's sockets before the next one's connect.
            deadline = time.monotonic() + 60.0
            while how == "connect" and open_fds(server_pid) > baseline_fds + 16 and time.monotonic() < deadline:
                time.sleep(0.1)
            print(f"world_scale: store, {size} ranks, {how}{', with a world group' if world_group else ''}: "
                  f"{walls[-1]:.3f} s (all connected {connected[-1]:.3f} s, all arrived {arrived[-1]:.3f} s), "
                  f"server CPU {server_cpu[-1]:.3f} s", flush=True)
    finally:
        for client in clients:
            if client.stdin is not None:
                client.stdin.close()
        for client in clients:
            try:
                client.wait(30)
            except subprocess.TimeoutExpired:
                client.kill()
                client.wait(10)
        served.close()
        stop_store_server()
    return {"wall_s": walls, "connected_s": connected, "arrived_s": arrived, "server_cpu_s": server_cpu,
            "client_processes": processes}


# (b) The controller.


def measure_controller(size: int, repetitions: int) -> dict[str, Any]:
    """Forming one generation of size/8 launchers with the controller's own functions (see
    the module); seconds per repetition."""
    from tidal.controller.core import messages, planning

    units = size // GPUS_PER_NODE
    candidates = [planning.Candidate(unit_id=f"u{i:05d}", nodes=(f"node{i:05d}",), procs_per_node=GPUS_PER_NODE,
                                     address=f"10.0.{i // 250}.{i % 250}", store_port=29_500, previous_group_rank=i,
                                     registered_at=float(i)) for i in range(units)]
    plan_s, failure_s, planned_s, sizes = [], [], [], {}
    for repetition in range(repetitions):
        started = time.perf_counter()
        plan = planning.plan_generation(job_id="job", number=2 + repetition, candidates=candidates, replicas=units,
                                        reason="bench", now=0.0, resume_step=100)
        # commit_generation's lookups: each member's place.
        for candidate in candidates:
            plan.member(candidate.unit_id)
        planned_at = time.perf_counter()
        total = 0
        for candidate in candidates:
            total += len(messages.member(plan, candidate.unit_id, stop_grace_s=10.0, reason="bench")
                         .SerializeToString())
        failure_at = time.perf_counter()
        sizes["failure_message_bytes_total"] = total
        # One message for every launcher (`forming.reconfigure`), serialized once per stream.
        message = messages.at_step_boundary(plan, 1 + repetition, (), "bench")
        total = 0
        for _ in candidates:
            total += len(message.SerializeToString())
        done = time.perf_counter()
        sizes["step_boundary_message_bytes_total"] = total
        plan_s.append(planned_at - started)
        failure_s.append(failure_at - planned_at)
        planned_s.append(done - failure_at)
    print(f"world_scale: controller, {units} launchers: plan {median(plan_s):.3f} s, failure messages "
          f"{median(failure_s):.3f} s, step-boundary messages {median(planned_s):.3f} s", flush=True)
    return {"launchers": units, "plan_s": plan_s, "failure_messages_s": failure_s,
            "step_boundary_messages_s": planned_s,
            "total_s": [p + max(f, b) for p, f, b in zip(plan_s, failure_s, planned_s, strict=True)], **sizes}


# (c) The launchers' relay.


def measure_relay(size: int, repetitions: int) -> dict[str, Any]:
    """One launcher's relay of a generation of size/8 launchers to its 8 workers (see the
    module); seconds per repetition."""
    from tidal.controller.core import messages, planning
    from tidal.launcher.lifecycle import LauncherState
    from tidal.launcher.worlds import LeaderView, SendWorlds, on_generation
    from tidal.proto import launcher_pb2
    from tidal.proto.control import World, decode, encode

    units = size // GPUS_PER_NODE
    candidates = [planning.Candidate(unit_id=f"u{i:05d}", nodes=(f"node{i:05d}",), procs_per_node=GPUS_PER_NODE,
                                     address="10.0.0.1", store_port=29_500, previous_group_rank=i,
                                     registered_at=float(i)) for i in range(units)]
    plan = planning.plan_generation(job_id="job", number=3, candidates=candidates, replicas=units, reason="bench",
                                    now=0.0, resume_step=100)
    unit_id = candidates[units // 2].unit_id
    wire = messages.at_step_boundary(plan, 2, (), "bench").SerializeToString()
    view = LeaderView(state=LauncherState.RUNNING, generation=2, stop_grace_s=10.0, live_mode=True,
                      live_workers_running=True, workers_generation=2, workers_started=True, all_said_hello=True)
    pairs = [socket.socketpair() for _ in range(GPUS_PER_NODE)]
    seconds = []
    try:
        for _ in range(repetitions):
            started = time.perf_counter()
            generation = launcher_pb2.ControllerMessage.FromString(wire).generation
            actions = on_generation(view, generation, unit_id)
            send = next(a for a in actions if isinstance(a, SendWorlds))
            mine = next(a for a in send.rank_table.assignments if a.unit_id == unit_id)
            for local_rank, (ours, _) in enumerate(pairs):
                ours.sendall(encode(World(generation=send.generation, rank=mine.first_rank + local_rank,
                                          world_size=send.rank_table.world_size, master_addr=send.rendezvous.host,
                                          master_port=send.rendezvous.port, target_step=send.target_step,
                                          at_step_boundary=send.at_step_boundary)))
            for _, theirs in pairs:
                line = b""
                while not line.endswith(b"\n"):
                    line += theirs.recv(65536)
                assert isinstance(decode(line), World)
            seconds.append(time.perf_counter() - started)
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
    print(f"world_scale: relay, one launcher of {units}, 8 workers: {median(seconds) * 1000:.2f} ms", flush=True)
    return {"total_s": seconds, "message_bytes": len(wire)}


def controller_fan_out_s(folder: Path = RESULTS_DIR) -> tuple[float, str] | None:
    """The real controller's failure fan-out p99 at its largest size (bench.controller_scale)."""
    path = folder / "controller_scale.json"
    if not path.exists():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"] if "fan-out" in r["metric"]]
    if not rows:
        return None
    row = max(rows, key=lambda r: int(r["metric"].split(" at ")[1].split()[0]))
    return row["tidal"] / 1000, f"bench/results/controller_scale.json: {row['metric']} (median)"


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure_size(size: int, repetitions: int, baseline: bool, generation: int,
                 fan_out: tuple[float, str] | None, results: dict[str, Any], with_kept: bool = False) -> int:
    """Every part at `size` ranks into `results[str(size)]`; returns the next generation number."""
    # 16,384 ranks: 3 generations at most (each about half a minute here, clients and all).
    store_repetitions = repetitions if size < 16_384 else min(repetitions, 3)
    # Every rank connecting (what a world change is charged), then, at the sizes asked for,
    # a world change whose store host survived with the survivors' connections kept.
    store = measure_store(size, store_repetitions, False, generation)
    generation += store_repetitions
    kept = None
    if with_kept:
        kept = measure_store(size, store_repetitions, False, generation, kept=True)
        generation += store_repetitions + 1
    before = None
    if baseline:
        before = measure_store(size, min(store_repetitions, 2), True, generation)
        generation += 2
    controller = measure_controller(size, repetitions)
    relay = measure_relay(size, max(repetitions, 20))
    parts = {"store_s": median(store["wall_s"]), "controller_s": median(controller["total_s"]),
             "relay_s": median(relay["total_s"])}
    if fan_out is not None and size >= 16_384:
        # The real controller's gRPC fan-out at 2,000 launchers, when larger than the in-process figure.
        parts["controller_s"] = max(parts["controller_s"], fan_out[0])
    parts["communicator_s"] = COMMUNICATOR_CITED["seconds"]
    parts["total_s"] = sum(parts.values())
    if kept is not None:
        # Its store host survived, the survivors' connections kept (reported, not charged).
        parts["store_connections_kept_s"] = median(kept["wall_s"])
    results[str(size)] = {"store": store, "store_kept": kept, "store_before": before, "controller": controller,
                          "relay": relay, "parts_s": parts}
    print(f"world_scale: {size} ranks: store {parts['store_s']:.3f} s + controller {parts['controller_s']:.3f} s "
          f"+ relay {parts['relay_s'] * 1000:.2f} ms + communicator {parts['communicator_s']:g} s (cited) = "
          f"{parts['total_s']:.2f} s", flush=True)
    return generation


def rows_at(size: int, r: dict[str, Any], fan_out: tuple[float, str] | None) -> list[Row]:
    """The result rows of one size: each part, and the total."""
    store, kept, before, parts = r["store"], r.get("store_kept"), r["store_before"], r["parts_s"]
    controller, relay = r["controller"], r["relay"]
    store_note = (f"connect + arrival barrier + NCCL ids of the replica and shard groups (no group of every rank); "
                  f"the last rank "
                  f"connected at {median(store['connected_s']):.2f} s, all arrived at {median(store['arrived_s']):.2f} "
                  f"s; store server CPU {median(store['server_cpu_s']):.2f} s")
    if before:
        store_note += f" (before: {median(before['server_cpu_s']):.2f} s)"
    store_note += f"; {store['client_processes']} client processes on the same 2 cores (an upper bound)"
    rows = [Row(benchmark="world_scale", metric=f"store: one world change's rendezvous at {size:,} ranks (one server)",
                unit="s", tidal=median(store["wall_s"]), tidal_samples=store["wall_s"],
                baseline=median(before["wall_s"]) if before else None,
                baseline_samples=before["wall_s"] if before else [],
                baseline_name="with a group of every rank as well (before 2026-11-27)" if before else "",
                ratio=median(before["wall_s"]) / median(store["wall_s"]) if before else None,
                ratio_meaning="before / now" if before else "", goal="reported", met=True, note=store_note)]
    if kept:
        rows.append(Row(
            benchmark="world_scale", metric=f"store: a world change at {size:,} ranks whose store host survived, "
            "the survivors' connections kept (one server)", unit="s", tidal=median(kept["wall_s"]),
            tidal_samples=kept["wall_s"], baseline=median(store["wall_s"]), baseline_samples=store["wall_s"],
            baseline_name="every rank connecting anew (the row above, same run)",
            ratio=median(store["wall_s"]) / median(kept["wall_s"]), ratio_meaning="connecting / kept",
            goal="reported (not charged to world changes: see the module)", met=True,
            note=f"check + arrival barrier + NCCL ids; all arrived at {median(kept['arrived_s']):.2f} s; store server "
                 f"CPU {median(kept['server_cpu_s']):.2f} s (connecting: {median(store['server_cpu_s']):.2f} s)"))
    controller_note = (f"plan and lookups {median(controller['plan_s']):.3f} s; failure messages (each launcher its "
                       f"own assignment) {median(controller['failure_messages_s']):.3f} s; step-boundary message "
                       f"(the whole table, serialized for each) {median(controller['step_boundary_messages_s']):.3f} s,"
                       " "
                       f"{controller['step_boundary_message_bytes_total'] / 2**20:.1f} MiB in all")
    total_note = (f"store {parts['store_s']:.2f} s + controller {parts['controller_s']:.2f} s"
                  + (f" ({fan_out[1]}, when larger than in-process)" if fan_out is not None and size >= 16_384 else "")
                  + f" + relay {parts['relay_s'] * 1000:.1f} ms, measured; + communicator "
                  f"{parts['communicator_s']:g} s cited (replica groups of {max(1, size // SHARD_SIZE):,} ranks, "
                  f"HybridSharded one-node replicas): {COMMUNICATOR_CITED['source']} ({COMMUNICATOR_CITED['url']}); "
                  f"under DataParallel (a group of every rank) the cited set-up is "
                  f"{COMMUNICATOR_EVERY_RANK_CITED['seconds']:g} s instead")
    return [
        *rows,
        Row(benchmark="world_scale", metric=f"controller: forming a generation of {controller['launchers']:,} "
            "launchers (plan, tables, messages serialized)", unit="s", tidal=median(controller["total_s"]),
            tidal_samples=controller["total_s"], goal="reported", met=True, note=controller_note),
        Row(benchmark="world_scale", metric=f"relay: one launcher's generation to its 8 workers at {size:,} ranks",
            unit="ms", tidal=1000 * median(relay["total_s"]), tidal_samples=[1000 * s for s in relay["total_s"]],
            goal="reported", met=True, note=f"a Generation of {relay['message_bytes']:,} bytes parsed and decided, "
                                           "8 Worlds sent over Unix sockets and decoded"),
        Row(benchmark="world_scale", metric=f"world change at {size:,} ranks: store + controller + relay + "
            "communicator (cited)", unit="s", tidal=parts["total_s"],
            # One figure: the sum of the parts' medians (and the cited set-up).
            tidal_samples=[parts["total_s"]],
            goal="reported (the ETTR goal is bench.cluster_sim's, with this figure)", met=True, note=total_note),
    ]


def main() -> None:
    command = parser(__doc__.split("\n\n")[0])
    command.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    command.add_argument("--host", help=argparse.SUPPRESS)
    for name in ("--port", "--first", "--count", "--size"):
        command.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    command.add_argument("--sizes", help="comma-separated world sizes (default 1024,4096,16384)")
    command.add_argument("--kept-sizes", default="1024,4096",
                         help="sizes whose store is also measured with the survivors' connections kept (default "
                              "1024,4096; --quick: its smallest; '' for none)")
    command.add_argument("--baseline-sizes", default="1024,4096,16384",
                         help="sizes whose store is also measured with a group of every rank as well, as before "
                              "2026-11-27 (default 1024,4096,16384; '' for none)")
    args = command.parse_args()
    if args.client:
        client_main(args)
        return
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else SIZES)
    repetitions = args.repeat or (2 if args.quick else 5)
    baseline_sizes = set() if args.quick else {int(n) for n in args.baseline_sizes.split(",") if n.strip()}
    # --quick: the smallest size only (each measurement starts its own client processes).
    kept_sizes = {min(sizes)} if args.quick else {int(n) for n in args.kept_sizes.split(",") if n.strip()}
    fan_out = controller_fan_out_s()
    results: dict[str, Any] = {}
    generation = 1
    with workspace(args.keep, "world_scale") as folder:
        preload = numeric_names_preload(folder)
        if preload is not None:
            # Inherited by the store server and the client processes.
            os.environ["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD", ""), preload]))
        for size in sizes:
            generation = measure_size(size, repetitions, size in baseline_sizes, generation, fan_out, results,
                                      with_kept=size in kept_sizes)
        os.environ.pop("LD_PRELOAD", None)
    rows = [row for size in sizes for row in rows_at(size, results[str(size)], fan_out)]
    write_result("world_scale", rows, quick=args.quick,
                 settings={"sizes": sizes, "repetitions": repetitions, "gpus_per_node": GPUS_PER_NODE,
                           "shard_size": SHARD_SIZE, "nccl_ranks_per_root": NCCL_RANKS_PER_ROOT,
                           "client_processes": CLIENT_PROCESSES, "baseline": "with a group of every rank",
                           "kept_sizes": sorted(kept_sizes),
                           "nofile_hard": resource.getrlimit(resource.RLIMIT_NOFILE)[1]},
                 extra={"results": results, "communicator_cited": COMMUNICATOR_CITED,
                        "communicator_every_rank_cited": COMMUNICATOR_EVERY_RANK_CITED,
                        "controller_fan_out": {"seconds": fan_out[0], "source": fan_out[1]} if fan_out else None})


if __name__ == "__main__":
    main()
