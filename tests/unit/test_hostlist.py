from __future__ import annotations

import pytest

from tidal.slurm.hostlist import compress, expand


@pytest.mark.parametrize("expression, names", [
    ("n1", ("n1",)),
    ("n[1-3]", ("n1", "n2", "n3")),
    ("n[1-2,5],gpu[08-10]", ("n1", "n2", "n5", "gpu08", "gpu09", "gpu10")),
    ("rack[1-2]-n[1-2]", ("rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2")),
    ("", ()),
    ("(null)", ()),
])
def test_expand(expression: str, names: tuple[str, ...]) -> None:
    assert expand(expression) == names


@pytest.mark.parametrize("bad", ["n[1-", "n1]", "n[a-b]", "n[3-1]",
                                 # Past MAX_NAMES: refused before it fills the memory.
                                 "n[0-999999999]", "n[0-999][0-999][0-999]", "a[0-999999],b[0-999999]"])
def test_expand_refuses_malformed(bad: str) -> None:
    with pytest.raises(ValueError):
        expand(bad)


def test_compress_round_trips() -> None:
    names = ("n1", "n2", "n3", "n7", "gpu08", "gpu09", "login")
    assert compress(names) == "login,gpu[08-09],n[1-3,7]"
    assert sorted(expand(compress(names))) == sorted(names)
    assert compress(["n4"]) == "n4"
