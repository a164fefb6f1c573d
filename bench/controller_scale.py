"""Controller scale: simulated launchers (asyncio gRPC clients on loopback, each with a
connection and a session stream of its own, heartbeating at 1 Hz) register as the units
of one job, which forms a world of all of them. Measured on the real controller process:
its CPU per 1,000 launchers over a steady window, its memory (RSS), and a failure's
fan-out when one launcher reports a failed worker: the delay from that report to each
launcher's receipt of what the failure sends it (the next Generation to each survivor, the
one message a failure is; a Generation naming it failed to the failed one), p50 and p99, at 100,
1,000 and 2,000 launchers. Goals: 2,000 launchers ≤ 50% of one core; fan-out p99 ≤ 500 ms.

The simulated launchers share this machine's 2 cores with the controller, in client
processes of their own; their CPU is not counted."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from bench.common import Row, median, parser, percentile, workspace, write_result
from tests.integration.conftest import ControllerProcess, wait_until
from tidal.launcher.worlds import Place, placement
from tidal.proto import admin_pb2, common_pb2, launcher_pb2, launcher_pb2_grpc

LAUNCHERS_PER_CLIENT = 250


async def simulated_launcher(target: str, job_id: str, secret: str, unit: str, out: list[dict],
                             victim_trigger: Path | None) -> None:
    channel = grpc.aio.insecure_channel(target)
    stub = launcher_pb2_grpc.LauncherServiceStub(channel)
    outbox: asyncio.Queue[launcher_pb2.LauncherMessage] = asyncio.Queue()
    generation = 0

    async def messages():
        yield launcher_pb2.LauncherMessage(register=launcher_pb2.Register(
            job_id=job_id, unit_id=unit, secret=secret, nodes=[f"sim-{unit}"], address="127.0.0.1",
            store_port=1))
        while True:
            yield await outbox.get()

    async def heartbeats() -> None:
        await asyncio.sleep(random.random())
        sequence = 0
        while True:
            sequence += 1
            beat = launcher_pb2.Heartbeat(sequence=sequence)
            beat.sent_at.GetCurrentTime()
            beat.workers.append(launcher_pb2.WorkerProgress(local_rank=0, rank=0, pid=1))
            outbox.put_nowait(launcher_pb2.LauncherMessage(heartbeat=beat))
            await asyncio.sleep(1.0)

    async def fail_when_told() -> None:
        assert victim_trigger is not None
        while not victim_trigger.exists():
            await asyncio.sleep(0.01)
        exited = launcher_pb2.WorkerExited(generation=generation, local_rank=0, pid=1, exit_code=1)
        exited.exited_at.GetCurrentTime()
        out.append({"unit": unit, "failed_at": time.time(), "generation": generation})
        outbox.put_nowait(launcher_pb2.LauncherMessage(worker_exited=exited))

    tasks = [asyncio.ensure_future(heartbeats())]
    if victim_trigger is not None:
        tasks.append(asyncio.ensure_future(fail_when_told()))
    registered = False
    try:
        # Like a real launcher: a session that could not be opened (2,000 connections at
        # once overflow the listen backlog) is retried with backoff until registered.
        for attempt in range(20):
            try:
                async for message in stub.Session(messages()):
                    kind = message.WhichOneof("body")
                    if kind == "registered":
                        registered = True
                    elif kind == "generation":
                        world = message.generation
                        place = placement(world, unit)
                        if place is Place.MEMBER:
                            if 0 < generation < world.generation:
                                # The next generation replacing the running one: a failure's message.
                                out.append({"unit": unit, "told_at": time.time(), "generation": generation})
                            generation = world.generation
                            outbox.put_nowait(launcher_pb2.LauncherMessage(
                                generation_report=launcher_pb2.GenerationReport(
                                    generation=generation, phase=launcher_pb2.GENERATION_PHASE_STARTED)))
                        elif place in (Place.FAILED, Place.STOPPED):
                            # This unit declared failed (the failure's message to it), or a stop.
                            out.append({"unit": unit, "told_at": time.time(), "generation": world.generation})
                            stopped = launcher_pb2.GenerationReport(generation=world.generation,
                                                                    phase=launcher_pb2.GENERATION_PHASE_STOPPED)
                            outbox.put_nowait(launcher_pb2.LauncherMessage(generation_report=stopped))
                print(f"{unit}: the controller ended the session", flush=True)
                return
            except grpc.aio.AioRpcError as error:
                print(f"{unit}: session attempt {attempt} {'after registering ' if registered else ''}failed: "
                      f"{error.code().name} {error.details()}", flush=True)
                if registered:
                    return
                await asyncio.sleep(min(5.0, 0.2 * 2 ** attempt) * (0.5 + random.random()))
    finally:
        for task in tasks:
            task.cancel()
        await channel.close()


async def client_main(args: argparse.Namespace) -> None:
    out: list[dict] = []
    # The victim client's first `--victims` launchers each fail when their own trigger file
    # appears (<trigger>-0, <trigger>-1, …): one STOP broadcast per repetition.
    victims = args.victims if args.victim else 0
    launchers = [simulated_launcher(args.target, args.job, args.secret, f"s{args.first + i}", out,
                                    Path(f"{args.trigger}-{i}") if i < victims else None) for i in range(args.count)]
    runner = asyncio.gather(*launchers)
    done = Path(args.done)
    while not done.exists():
        await asyncio.sleep(0.2)
    Path(args.out).write_text("\n".join(json.dumps(r) for r in out) + "\n")
    runner.cancel()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(folder: Path, launchers: int, window_s: float, windows: int, broadcasts: int) -> dict[str, Any]:
    """Controller CPU in `windows` steady windows of `window_s`, then `broadcasts` failure
    fan-outs, one failed launcher each (the world re-forms without it in between)."""
    folder.mkdir(parents=True, exist_ok=True)
    # Registrations of 2,000 launchers spread over seconds: one world, not a world and regrowth.
    # The simulated launchers share 2 cores with the controller: a client process starved for
    # a few seconds would be judged silent and lose its units for good (they do not come back
    # as a real launcher's replacement would), so silence is judged over 15 s, not 3 s. What is
    # measured (CPU in steady state, the fan-out of a reported failure) does not depend on it.
    controller = ControllerProcess(folder, {"join_settle_s": "10", "register_timeout_s": "60",
                                            "heartbeat_timeout_s": "15", "launcher_messages_per_s": "50",
                                            "metrics_listen": ""})
    controller.start()
    clients: list[subprocess.Popen[bytes]] = []
    trigger, done = folder / "fail-now", folder / "done"
    try:
        spec = admin_pb2.JobSpec(name="scale", min_replicas=1, max_replicas=launchers, command=["true"],
                                 mode=common_pb2.JOB_MODE_RESTART)
        with controller.admin() as admin:
            submitted = admin.submit(spec)
        job_id = submitted.job.job_id
        secret = Path(submitted.secret_path).read_text().strip()
        for first in range(0, launchers, LAUNCHERS_PER_CLIENT):
            count = min(LAUNCHERS_PER_CLIENT, launchers - first)
            log = open(folder / f"client-{first}.log", "wb")  # noqa: SIM115
            clients.append(subprocess.Popen(
                [sys.executable, "-m", "bench.controller_scale", *client_arguments(
                    target=controller.address, job_id=job_id, secret=secret, first=first, count=count,
                    trigger=trigger, done=done, out=folder / f"client-{first}.jsonl", victims=broadcasts)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()

        def running(replicas: int) -> admin_pb2.Job | None:
            with controller.admin() as admin:
                job = admin.job(job_id)
            return job if job.state == admin_pb2.JOB_STATE_RUNNING and job.replicas == replicas else None

        def explain() -> str:
            """What the controller and the clients last said, for a run that did not get there."""
            with controller.admin() as admin:
                job, events = admin.job(job_id), admin.events(job_id)
            told = [f"job {admin_pb2.JobState.Name(job.state)}, {job.replicas} replicas"]
            told += [f"{e.kind} {e.unit_id}: {e.reason}"[:300] for e in events[-15:]]
            for path in sorted(folder.glob("client-*.log")):
                told.append(f"{path.name}: {path.read_text(errors='replace')[-1500:]}")
            return "\n".join(told)

        try:
            formed = wait_until(lambda: running(launchers), 300, f"a world of {launchers} simulated launchers",
                                interval=1.0)
        except AssertionError as timed_out:
            raise AssertionError(f"{timed_out}\n{explain()}") from None
        time.sleep(3.0)
        assert controller.process is not None  # started above
        pid = controller.process.pid
        cpu: list[float] = []
        for _ in range(windows):
            cpu0, wall0 = cpu_seconds(pid), time.monotonic()
            time.sleep(window_s)
            cpu.append((cpu_seconds(pid) - cpu0) / (time.monotonic() - wall0))
        memory = rss_mib(pid)
        with controller.admin() as admin:
            formed_sequence = admin.job(job_id).last_event.sequence
        stopped_generations = []
        for index in range(broadcasts):
            stopped_generations.append(formed.generation)
            Path(f"{trigger}-{index}").touch()
            # Every survivor has the next generation once the world runs without the victim.
            try:
                formed = wait_until(partial(running, launchers - index - 1), 120,
                                    f"the world re-formed without victim {index}", interval=0.2)
            except AssertionError as timed_out:
                raise AssertionError(f"{timed_out}\n{explain()}") from None
            time.sleep(1.0)
        # When the controller recorded each next generation (world_formed, in the transaction
        # persisted before anything is sent): the report-to-decision share of the fan-out.
        with controller.admin() as admin:
            events = admin.events(job_id, after_sequence=formed_sequence, limit=10000)
        formed_at = {e.generation: e.time.ToNanoseconds() / 1e9 for e in events if e.kind == "world_formed"}
        done.touch()
        for client in clients:
            client.wait(60)
        records = [json.loads(line) for path in folder.glob("client-*.jsonl")
                   for line in path.read_text().splitlines() if line.strip()]
        fan_outs: list[list[float]] = []
        decided: list[float] = []
        for generation in stopped_generations:
            failed_at = next(r["failed_at"] for r in records if "failed_at" in r and r["generation"] == generation)
            if generation + 1 in formed_at:
                decided.append(formed_at[generation + 1] - failed_at)
            delays = [r["told_at"] - failed_at for r in records if "told_at" in r and r["generation"] == generation]
            expected = launchers - len(fan_outs) - 1
            assert len(delays) >= expected, f"generation {generation}: {len(delays)} of {expected} launchers were told"
            fan_outs.append(delays)
        return {"cpu": cpu, "rss_mib": memory, "p50": [percentile(d, 0.5) for d in fan_outs],
                "p99": [percentile(d, 0.99) for d in fan_outs], "receipts": [len(d) for d in fan_outs],
                "decided": decided}
    finally:
        done.touch()
        for client in clients:
            if client.poll() is None:
                os.killpg(client.pid, signal.SIGKILL)
                client.wait(10)
        controller.stop()


def client_arguments(*, target: str, job_id: str, secret: str, first: int, count: int, trigger: Path, done: Path,
                     out: Path, victims: int) -> list[str]:
    """A client process's arguments (`command_line` reads them). `--secret=VALUE` in one: a
    job secret (token_urlsafe) starts with "-" one time in 64, which argparse took for an
    option ("--secret: expected one argument"), and the benchmark waited 300 s for a world."""
    return ["--client", "--target", target, "--job", job_id, f"--secret={secret}", "--first", str(first),
            "--count", str(count), "--trigger", str(trigger), "--done", str(done), "--out", str(out),
            "--victims", str(victims), *(["--victim"] if first == 0 else [])]


def command_line() -> argparse.ArgumentParser:
    command = parser(__doc__.split("\n\n")[0])
    command.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    for name in ("--target", "--job", "--secret", "--trigger", "--done", "--out"):
        command.add_argument(name, help=argparse.SUPPRESS)
    command.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    command.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    command.add_argument("--victim", action="store_true", help=argparse.SUPPRESS)
    command.add_argument("--victims", type=int, default=1, help=argparse.SUPPRESS)
    return command


def main() -> None:
    args = command_line().parse_args()
    if args.client:
        asyncio.run(client_main(args))
        return
    sizes = [50] if args.quick else [100, 1000, 2000]
    window_s = 2.0 if args.quick else 10.0
    windows = 2 if args.quick else 5
    broadcasts = args.repeat or (2 if args.quick else 5)
    results = {}
    with workspace(args.keep, "controller_scale") as folder:
        for size in sizes:
            results[size] = measure(folder / f"n{size}", size, window_s, windows, broadcasts)
            r = results[size]
            print(f"controller_scale: {size} launchers: controller CPU {median(r['cpu']):.1%} of a core, "
                  f"RSS {r['rss_mib']:.0f} MiB, fan-out p50 {median(r['p50']) * 1000:.0f} ms "
                  f"p99 {median(r['p99']) * 1000:.0f} ms (median of {broadcasts}; report to the controller's "
                  f"decision {median(r['decided']) * 1000:.0f} ms)", flush=True)
    largest = max(sizes)
    cpu_largest = median(results[largest]["cpu"])
    rows = [Row(benchmark="controller_scale", metric=f"controller CPU at {largest} launchers, 1 Hz heartbeats",
                unit="% of a core", tidal=100 * cpu_largest, goal="≤ 50% at 2,000",
                met=largest < 2000 or cpu_largest <= 0.5,
                tidal_samples=[100 * c for c in results[largest]["cpu"]],
                note=f"median of {windows} windows of {window_s:g} s; "
                     + "; ".join(f"{n}: {100 * median(r['cpu']):.1f}% ({100000 * median(r['cpu']) / n:.1f}% per "
                                 f"1,000), RSS {r['rss_mib']:.0f} MiB" for n, r in results.items()))]
    for size in sizes:
        r = results[size]
        rows.append(Row(benchmark="controller_scale", metric=f"failure fan-out at {size} launchers, p99",
                        unit="ms", tidal=1000 * median(r["p99"]), goal="p99 ≤ 500 ms", met=median(r["p99"]) <= 0.5,
                        tidal_samples=[1000 * p for p in r["p99"]],
                        note=f"each sample is one broadcast's p99, from the failure report to each launcher's "
                             f"receipt; p50 {1000 * median(r['p50']):.0f} ms; of it, from the report to the "
                             f"controller's decision (its world_formed event, persisted before any send) "
                             f"{1000 * median(r['decided']):.0f} ms (median); receipts per broadcast "
                             f"{', '.join(map(str, r['receipts']))}"))
    write_result("controller_scale", rows, quick=args.quick,
                 settings={"sizes": sizes, "window_s": window_s, "windows": windows, "broadcasts": broadcasts,
                           "launchers_per_client": LAUNCHERS_PER_CLIENT})


if __name__ == "__main__":
    main()
