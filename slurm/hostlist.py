"""Slurm hostlist expressions: `n[1-3,7],gpu[01-02]` ⇄ names. Pure functions."""

from __future__ import annotations

import re
from collections.abc import Iterable

_BRACKET = re.compile(r"^(?P<prefix>[^\[\],]*)\[(?P<ranges>[^\]]*)\](?P<suffix>.*)$")
# More names than any cluster has: an expression that expands past it is nonsense (from
# Slurm or a user), refused before it fills the memory.
MAX_NAMES = 1_000_000


def _split_top_level(expression: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in expression:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {expression!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {expression!r}")
    parts.append("".join(current))
    return [p for p in parts if p]


def _expand_one(item: str) -> list[str]:
    match = _BRACKET.match(item)
    if not match:
        return [item]
    prefix, suffix = match["prefix"], match["suffix"]
    names: list[str] = []
    for part in match["ranges"].split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"bad range {part!r} in hostlist item {item!r}")
        width = len(low)
        stop = int(high) if high else int(low)
        if stop < int(low):
            raise ValueError(f"descending range {part!r} in hostlist item {item!r}")
        tails = _expand_one(suffix) if suffix else [""]
        if len(names) + (stop - int(low) + 1) * len(tails) > MAX_NAMES:
            raise ValueError(f"hostlist item {item[:80]!r} names more than {MAX_NAMES} hosts")
        for number in range(int(low), stop + 1):
            for tail in tails:
                names.append(f"{prefix}{number:0{width}d}{tail}")
    return names


def expand(expression: str) -> tuple[str, ...]:
    """`n[1-3],m5` → ("n1", "n2", "n3", "m5"). Empty or "(null)" → ()."""
    expression = expression.strip()
    if not expression or expression in ("(null)", "None"):
        return ()
    names: list[str] = []
    for item in _split_top_level(expression):
        names.extend(_expand_one(item))
        if len(names) > MAX_NAMES:
            raise ValueError(f"hostlist {expression[:80]!r} names more than {MAX_NAMES} hosts")
    return tuple(names)


def compress(names: Iterable[str]) -> str:
    """("n1", "n2", "n3", "m5") → "m5,n[1-3]": the form sbatch --exclude accepts."""
    groups: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    for name in sorted(set(names)):
        match = re.fullmatch(r"(.*?)(\d+)", name)
        if not match:
            plain.append(name)
            continue
        digits = match[2]
        width = len(digits) if digits.startswith("0") else 0
        groups.setdefault((match[1], width), []).append(int(digits))
    items = list(plain)
    for (prefix, width), numbers in sorted(groups.items()):
        numbers.sort()
        ranges: list[str] = []
        start = previous = numbers[0]
        for number in [*numbers[1:], None]:
            if number is not None and number == previous + 1:
                previous = number
                continue
            first, last = f"{start:0{width}d}", f"{previous:0{width}d}"
            ranges.append(first if start == previous else f"{first}-{last}")
            if number is not None:
                start = previous = number
        if len(numbers) == 1:
            items.append(f"{prefix}{ranges[0]}")
        else:
            items.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(items)
