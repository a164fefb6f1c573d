"""TLS on the launchers' TCP port, and the systemd unit as shipped."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.conftest import REPO, TidalRun, wait_until
from tidal.controller.client import AdminClient

pytestmark = pytest.mark.integration


def make_certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "controller.pem", directory / "controller.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "2", "-subj", "/CN=tidal-test", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_launcher_and_admin_over_tls(tidal_run: TidalRun) -> None:
    cert, key = make_certificate(tidal_run.directory)
    controller = tidal_run.controller
    controller.stop()
    controller.settings.update({"tls_cert_file": str(cert), "tls_key_file": str(key)})
    controller.start()
    assert controller.ready["tls"] is True
    tidal_run.submit(min_replicas=1, max_replicas=1, steps=20, step_time=0.0)
    tidal_run.start_launcher("secure", extra=("--tls-ca", str(cert)))
    controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.generation == 1)
    controller.wait_event(tidal_run.job_id, "job_completed")
    assert tidal_run.launchers["secure"].process.wait(20) == 0  # type: ignore[union-attr]
    token = (controller.state_dir / "admin.token").read_text().strip()
    with AdminClient(address=controller.address, token=token, tls_ca=cert) as admin:
        assert admin.job(tidal_run.job_id).job_id == tidal_run.job_id
    with AdminClient(address=controller.address, token=token, timeout_s=2) as plaintext, \
            pytest.raises(grpc.RpcError) as refused:
        plaintext.jobs()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_health_is_not_serving_while_a_required_slurm_does_not_answer(tidal_run: TidalRun, tmp_path: Path) -> None:
    controller = tidal_run.controller
    controller.stop()
    controller.settings["require_slurm"] = "true"
    controller.extra_env = {"SLURM_CONF": str(tmp_path / "no-such-slurm.conf"), "TIDAL_SLURM_BACKEND": "cli"}
    controller.start()
    with grpc.insecure_channel(controller.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    log = tidal_run.directory / f"controller-{controller.starts}.log"
    wait_until(lambda: "controller_not_ready" in log.read_text(), 20, "the controller to say why")
    assert "Slurm does not answer" in log.read_text()
    with grpc.insecure_channel(controller.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_systemd_unit_runs_the_daemon_in_the_foreground_and_restarts_it() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(REPO / "scripts" / "tidal-controller.service")
    service = unit["Service"]
    assert service["ExecStart"].split()[0].endswith("/tidal-controller")
    assert service["Type"] == "notify" and service["Restart"] == "on-failure"
    assert service["StateDirectory"] == "tidal" and service["RuntimeDirectory"] == "tidal"
    assert "TIDAL_LOG_FORMAT=json" in service["Environment"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"
