"""A real Prometheus for the tests: Debian's `prometheus` package (2.42 on Debian 12),
installed with apt-get as root when missing, and a Prometheus process of the test's own
that scrapes one controller every second and answers PromQL through its HTTP API.

The package's own service is never left running: while apt-get installs, a policy-rc.d
refuses every service start (unless the machine has one of its own, as containers do),
and afterwards the service is disabled (systemctl under systemd, else update-rc.d). The test's process listens on
127.0.0.1 only, keeps its data in the test's folder, and is stopped by its PID."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO_ROOT
from tests.integration.conftest import free_port
from tests.waiting import wait_for

DEBIAN_PACKAGE = "prometheus"
PACKAGED_SERVICE = "prometheus.service"
# invoke-rc.d and deb-systemd-invoke ask this program before a package's scripts start a
# service; exit status 101 means "not now" (/usr/share/doc/init-system-helpers/README.policy-rc.d.gz).
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
REFUSE_EVERY_START = ("#!/bin/sh\n# Written by Tidal's tests while apt-get installs prometheus; removed after.\n"
                      "exit 101\n")
INSTALL_TIMEOUT_S = 600.0
# The shipped scrape job (deploy/prometheus/tidal-scrape.yml): the test scrapes with it, at
# a faster interval, so the board is checked against the labels that job gives.
SCRAPE_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "tidal-scrape.yml"
SCRAPE_INTERVAL = "1s"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
QUERY_TIMEOUT_S = 10.0


class PrometheusUnavailable(Exception):
    """Prometheus cannot run here; the message says why and what would fix it."""


def installed_binary() -> str:
    """The path of Debian's prometheus, installed first when it is missing (root only).
    Raises PrometheusUnavailable when it is missing and cannot be installed."""
    found = shutil.which(DEBIAN_PACKAGE)
    if found:
        return found
    if os.geteuid() != 0:
        raise PrometheusUnavailable(f"{DEBIAN_PACKAGE} is not installed, and installing Debian's package needs "
                                    f"root: apt-get install --no-install-recommends {DEBIAN_PACKAGE}")
    if not shutil.which("apt-get"):
        raise PrometheusUnavailable(f"{DEBIAN_PACKAGE} is not installed and there is no apt-get to install it with "
                                    "(the tests expect Debian 12)")
    install_package()
    found = shutil.which(DEBIAN_PACKAGE)
    if not found:
        raise PrometheusUnavailable(f"apt-get installed {DEBIAN_PACKAGE} but no {DEBIAN_PACKAGE} is on PATH")
    return found


def install_package() -> None:
    """apt-get install Debian's prometheus without starting (or, under systemd, enabling)
    its service; refreshes the package lists once if the first try fails."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", DEBIAN_PACKAGE]
    print(f"tests: installing Debian's {DEBIAN_PACKAGE} with apt-get", file=sys.stderr, flush=True)
    with services_not_started():
        tried = _apt_get(install, env)
        if tried.returncode != 0:
            # A fresh machine's package lists are empty or old: refresh once and retry.
            _apt_get(["apt-get", "update", "-q"], env)
            tried = _apt_get(install, env)
    if tried.returncode != 0:
        raise PrometheusUnavailable(f"`{' '.join(install)}` failed (exit {tried.returncode}): "
                                    f"{tried.stdout[-2000:]}")
    disable_packaged_service()


def _apt_get(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise PrometheusUnavailable(f"`{' '.join(command)}` took over {INSTALL_TIMEOUT_S:.0f} s") from error


@contextlib.contextmanager
def services_not_started() -> Iterator[None]:
    """While inside: packages' scripts start no service. A policy-rc.d the machine already
    has is left as it is (a container's refuses every start); otherwise one that refuses
    is written for the time being and removed after."""
    if POLICY_RC_D.exists():
        yield
        return
    POLICY_RC_D.write_text(REFUSE_EVERY_START)
    POLICY_RC_D.chmod(0o755)
    try:
        yield
    finally:
        POLICY_RC_D.unlink(missing_ok=True)


def disable_packaged_service() -> None:
    """The package's service stopped and not started at boot (its postinst enables it
    even when policy-rc.d refused the start): under systemd with `systemctl disable
    --now`, else its init script's links with `update-rc.d disable`. Raises
    PrometheusUnavailable if it still runs."""
    if not Path("/run/systemd/system").is_dir():
        if shutil.which("update-rc.d"):
            subprocess.run(["update-rc.d", DEBIAN_PACKAGE, "disable"], capture_output=True, timeout=60)
        return
    subprocess.run(["systemctl", "disable", "--now", PACKAGED_SERVICE], capture_output=True, timeout=60)
    active = subprocess.run(["systemctl", "is-active", "--quiet", PACKAGED_SERVICE], timeout=60)
    if active.returncode == 0:
        raise PrometheusUnavailable(f"the package's {PACKAGED_SERVICE} is running and `systemctl disable --now` "
                                    "did not stop it")


def version(binary: str) -> str:
    """`prometheus --version`'s first line, e.g. 'prometheus, version 2.42.0+ds (...)'."""
    shown = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    return (shown.stdout or shown.stderr).splitlines()[0]


def scrape_config(metrics_address: str) -> dict[str, Any]:
    """deploy/prometheus/tidal-scrape.yml, pointed at `metrics_address` (host:port) and
    scraped every second."""
    config: dict[str, Any] = yaml.safe_load(SCRAPE_CONFIG.read_text())
    (scrape_job,) = config["scrape_configs"]
    scrape_job["scrape_interval"] = SCRAPE_INTERVAL
    scrape_job["static_configs"] = [{"targets": [metrics_address]}]
    config["global"] = {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL}
    return config


class PrometheusServer:
    """One Prometheus process scraping a controller's metrics, with its configuration,
    data and log under `directory`, listening on 127.0.0.1 on a free port."""

    def __init__(self, binary: str, directory: Path, metrics_address: str) -> None:
        self.binary = binary
        self.directory = directory
        self.config = scrape_config(metrics_address)
        self.scrape_job = self.config["scrape_configs"][0]["job_name"]
        self.port = free_port()
        self.log_path = directory / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start it and wait until it serves queries and has scraped the controller once."""
        self.directory.mkdir(parents=True, exist_ok=True)
        config_path = self.directory / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(self.config))
        command = [self.binary, f"--config.file={config_path}", f"--storage.tsdb.path={self.directory / 'data'}",
                   f"--web.listen-address=127.0.0.1:{self.port}"]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for("Prometheus to scrape the controller", self._scraped_once, timeout_s=START_TIMEOUT_S,
                 interval_s=0.2)

    def _scraped_once(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}: {self.log()}")
        try:
            return any(series["value"][1] == "1" for series in self.query(f'up{{job="{self.scrape_job}"}}'))
        except urllib.error.HTTPError as error:
            if error.code == 503:
                return False  # listening, its storage not ready yet ("Service Unavailable")
            raise
        except (urllib.error.URLError, ConnectionError):
            return False  # not listening yet

    def stop(self) -> None:
        """SIGTERM to its PID, SIGKILL after STOP_TIMEOUT_S."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT_S)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def _get(self, path: str, parameters: list[tuple[str, str]]) -> Any:
        """GET an /api/v1 endpoint; its `data`. Raises AssertionError with Prometheus'
        own error for a bad query."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(parameters)}"
        try:
            with urllib.request.urlopen(url, timeout=QUERY_TIMEOUT_S) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as error:
            if error.code not in (400, 422):
                raise  # 503 while it starts: a plain-text body
            # 400 and 422 carry Prometheus' reason (a parse error, a bad range).
            answer = json.load(error)
        if answer.get("status") != "success":
            raise AssertionError(f"{path} {parameters}: {answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]

    def query(self, expression: str) -> list[dict[str, Any]]:
        """An instant query's series (/api/v1/query at now): each {"metric": labels,
        "value": [time, "number"]}."""
        data = self._get("/api/v1/query", [("query", expression)])
        if data["resultType"] != "vector":
            raise AssertionError(f"{expression}: a {data['resultType']}, not an instant vector")
        series: list[dict[str, Any]] = data["result"]
        return series

    def label_values(self, label: str, metric: str) -> list[str]:
        """What Grafana's `label_values(metric, label)` lists (/api/v1/label/<label>/values)."""
        values: list[str] = self._get(f"/api/v1/label/{label}/values", [("match[]", metric)])
        return values


def has_a_number(series: list[dict[str, Any]]) -> bool:
    """Whether any series' value is a number (histogram_quantile gives NaN for a window
    with no observations: Grafana draws nothing)."""
    return any(not math.isnan(float(each["value"][1])) for each in series)

