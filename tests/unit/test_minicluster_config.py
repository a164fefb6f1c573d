"""scripts/minicluster's slurm.conf: the cluster the issue asks for, tuned for tests."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent.parent / "scripts" / "minicluster"


def load_minicluster():
    loader = importlib.machinery.SourceFileLoader("minicluster", str(SCRIPT))
    spec = importlib.util.spec_from_loader("minicluster", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["minicluster"] = module  # its dataclasses look themselves up there
    loader.exec_module(module)
    return module


def test_slurm_conf_has_two_preempting_partitions(tmp_path: Path) -> None:
    minicluster = load_minicluster()
    conf = minicluster.render_slurm_conf(minicluster.Layout(tmp_path), nodes=4, port_base=17000)
    lines = {line.split("=", 1)[0]: line for line in conf.splitlines() if "=" in line and not line.startswith("#")}
    assert "Port=[17001-17004]" in lines["NodeName"] and "NodeAddr=127.0.0.1" in lines["NodeName"]
    assert "PreemptType=preempt/partition_prio" in conf and "PreemptMode=REQUEUE" in conf
    partitions = [line for line in conf.splitlines() if line.startswith("PartitionName=")]
    train, urgent = partitions
    assert "PartitionName=train" in train and "PriorityTier=1 " in train and "GraceTime=5" in train
    assert "PartitionName=urgent" in urgent and "PriorityTier=100" in urgent
    assert all("OverSubscribe=EXCLUSIVE" in p for p in partitions)
    assert f"SlurmdSpoolDir={tmp_path}/spool/%n" in conf and "ProctrackType=proctrack/linuxproc" in conf
    assert "cred_expire=30" in conf and "MinJobAge=60" in conf and "KillWait=2" in conf
