"""scripts/record-slurm-json asks each Slurm release for the JSON schema Tidal's CLI client
asks it for, so that a recording shows what the product reads."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tidal.slurm import parse
from tidal.slurm.cli_json import json_flag

SCRIPT = Path(__file__).resolve().parent.parent.parent / "scripts" / "record-slurm-json"


def load_recorder() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("record_slurm_json", str(SCRIPT))
    spec = importlib.util.spec_from_loader("record_slurm_json", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["record_slurm_json"] = module
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("printed, flag", [
    ("slurm-wlm 22.05.8", "--json"),
    ("slurm 23.11.4", "--json=v0.0.40"),
    ("slurm-wlm 24.11.5", "--json=v0.0.42"),
    ("slurm 25.11.0", "--json=v0.0.44"),
    ("slurm 26.05.5", "--json=v0.0.45"),
])
def test_recorder_asks_what_the_client_asks(printed: str, flag: str) -> None:
    assert load_recorder().json_flag(printed) == flag == json_flag(parse.parse_version(printed))
