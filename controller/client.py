"""A client of the controller's admin API (the `tidal` CLI and the tests use it).

Over the Unix socket by default (the controller identifies the caller by uid); over TCP
with the admin token otherwise. Every call has a deadline."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import grpc

from tidal.proto import admin_pb2, admin_pb2_grpc

DEFAULT_SOCKET = Path("/run/tidal/controller.sock")


class AdminClient:
    def __init__(self, *, unix_socket: Path | None = None, address: str | None = None, token: str | None = None,
                 tls_ca: Path | None = None, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._metadata: tuple[tuple[str, str], ...] = ()
        if address:
            if tls_ca is not None:
                credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca.read_bytes())
                self._channel = grpc.secure_channel(address, credentials)
            else:
                self._channel = grpc.insecure_channel(address)
            if token:
                self._metadata = (("authorization", f"Bearer {token}"),)
        else:
            path = unix_socket or Path(os.environ.get("TIDAL_CONTROLLER_SOCKET", str(DEFAULT_SOCKET)))
            self._channel = grpc.insecure_channel(f"unix:{path}")
        self.stub = admin_pb2_grpc.AdminServiceStub(self._channel)

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def submit(self, spec: admin_pb2.JobSpec, owner: str = "") -> admin_pb2.SubmitJobResponse:
        return self.stub.SubmitJob(admin_pb2.SubmitJobRequest(spec=spec, owner=owner), timeout=self.timeout_s,
                                   metadata=self._metadata)

    def job(self, job_id: str) -> admin_pb2.Job:
        return self.stub.GetJob(admin_pb2.GetJobRequest(job_id=job_id), timeout=self.timeout_s,
                                metadata=self._metadata)

    def history(self, job_id: str) -> admin_pb2.JobHistory:
        return self.stub.GetJobHistory(admin_pb2.GetJobHistoryRequest(job_id=job_id), timeout=self.timeout_s,
                                       metadata=self._metadata)

    def jobs(self, include_finished: bool = False) -> list[admin_pb2.Job]:
        response = self.stub.ListJobs(admin_pb2.ListJobsRequest(include_finished=include_finished),
                                      timeout=self.timeout_s, metadata=self._metadata)
        return list(response.jobs)

    def events(self, job_id: str = "", after_sequence: int = 0, limit: int = 1000) -> list[admin_pb2.Event]:
        response = self.stub.ListEvents(admin_pb2.ListEventsRequest(job_id=job_id, after_sequence=after_sequence,
                                                                    limit=limit),
                                        timeout=self.timeout_s, metadata=self._metadata)
        return list(response.events)

    def watch_events(self, job_id: str = "", after_sequence: int = 0,
                     timeout_s: float | None = None) -> Iterator[admin_pb2.Event]:
        """Events as they happen; `timeout_s` bounds the whole watch (None: until cancelled)."""
        yield from self.stub.WatchEvents(admin_pb2.ListEventsRequest(job_id=job_id, after_sequence=after_sequence),
                                         timeout=timeout_s, metadata=self._metadata)

    def resize(self, job_id: str, min_replicas: int = 0, max_replicas: int = 0) -> admin_pb2.Job:
        return self.stub.ResizeJob(admin_pb2.ResizeJobRequest(job_id=job_id, min_replicas=min_replicas,
                                                              max_replicas=max_replicas),
                                   timeout=self.timeout_s, metadata=self._metadata)

    def drain(self, target: str) -> list[str]:
        response = self.stub.Drain(admin_pb2.DrainRequest(target=target), timeout=self.timeout_s,
                                   metadata=self._metadata)
        return list(response.unit_ids)

    def cancel(self, job_id: str) -> admin_pb2.Job:
        return self.stub.CancelJob(admin_pb2.CancelJobRequest(job_id=job_id), timeout=self.timeout_s,
                                   metadata=self._metadata)

    def nodes(self) -> admin_pb2.ListNodesResponse:
        return self.stub.ListNodes(admin_pb2.ListNodesRequest(), timeout=self.timeout_s, metadata=self._metadata)
