"""A non-editable install (`pip install .`, a wheel) holds every package of the source tree.

setup.cfg maps each `tidal.*` package to its folder (`package_dir`) and lists the packages
by name: a subpackage left off the list is missing from a wheel while an editable install
(which maps whole folders) still finds it. Seen on a GPU machine given a wheel: the
controller failed at start with "No module named 'tidal.controller.core'"."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_of_the_source_tree_is_listed_in_setup_cfg() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    mapping = dict(line.split(" = ") for line in config["options"]["package_dir"].strip().splitlines())
    found = set()
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *relative.parts]))
    assert "tidal.controller.core" in found
    assert found - listed == set(), f"packages missing from setup.cfg's packages: {sorted(found - listed)}"
