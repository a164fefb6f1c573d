"""bench/RESULTS.md from the result files the benchmarks wrote (bench/results/*.json,
the full runs; quick runs are left out)."""

from __future__ import annotations

import json

from bench.common import REPO, RESULTS_DIR

ORDER = ["detection", "recovery", "grow", "preemption", "overhead", "reduction", "scaling", "transfer",
         "controller_scale", "world_scale", "goodput", "chaos", "chaos_multinode", "chaos_hsdp",
         "cluster_sim"]


def number(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "fraction":
        return f"{value:.2%}"
    if unit == "s":
        return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"
    if unit == "ms":
        return f"{value:.0f} ms" if value >= 10 else f"{value:.2g} ms"
    return f"{value:.3g} {unit}"


def ettr_table(document: dict) -> list[str]:
    """The cluster simulation's table: every policy at each size and scenario (K: nodes a
    replica), medians with the spread over seeds, how long a replica was out of the world
    (K-node policies), and the ETTR goal."""
    def cell(entry: dict, key: str) -> str:
        value = entry[key]
        return f"{value['median']:.2%} [{value['min']:.2%}–{value['max']:.2%}]"

    def out(entry: dict) -> str:
        if "replicas" not in entry:
            return "—"
        replicas = entry["replicas"]
        back = (f"{replicas['out_h']['median']:.2f} / {replicas['out_h']['mean']:.2f} ({replicas['returns']})"
                if replicas["returns"] else "none back")
        return f"{back}; {replicas['released']['median']:g}; {replicas['out_at_end']['median']:g}"

    lines = ["", "| scenario | GPUs | K | policy | ETTR median [min–max] | goodput median [min–max] | "
             "work median [min–max] | interruptions | a replica out, h: median / mean (returns); released; "
             "out at end |",
             "|---|---|---|---|---|---|---|---|---|"]
    for entry in document["table"]:
        lines.append(f"| {entry['scenario']} | {entry['gpus']:,} | {entry.get('nodes_per_replica', 1)} | "
                     f"{entry['policy']} | {cell(entry, 'ettr')} | {cell(entry, 'goodput')} | "
                     f"{entry['work']['median']:.4f} [{entry['work']['min']:.4f}–{entry['work']['max']:.4f}] | "
                     f"{entry['interruptions']['median']:g} | {out(entry)} |")
    lines += [""] + [f"- {line}" for line in document.get("model", [])]
    return lines


def measured_code(document: dict) -> str:
    """The code version a result file says it measured (older files kept it, if at all,
    in the chaos settings)."""
    return document.get("code") or document.get("settings", {}).get("code") or "not recorded"


def main() -> None:
    documents = {}
    for path in sorted(RESULTS_DIR.glob("*.json")):
        if path.name.endswith(".quick.json"):
            continue
        document = json.loads(path.read_text())
        documents[document["benchmark"]] = document
    missing = [name for name in ORDER if name not in documents]
    lines = ["# Benchmark results", "",
             "Written by `python -m bench.report` from `bench/results/*.json` (`make bench` runs every benchmark, "
             "then this). Each figure is the median of the repetitions, with its baseline measured in the same run "
             "where the benchmark has one. Re-run one row with its command below.", ""]
    if missing:
        lines += [f"**Not measured yet:** {', '.join(missing)}.", ""]
    lines += ["What each benchmark measured, and when (`code` is `git describe --always --dirty` at the run; "
              "a `-dirty` suffix means the working tree differed from that commit):", "",
              "| benchmark | code | date |", "|---|---|---|"]
    for name in [n for n in ORDER if n in documents] + sorted(set(documents) - set(ORDER)):
        lines.append(f"| {name} | `{measured_code(documents[name])}` | {documents[name].get('date', 'not recorded')} |")
    lines += ["", "| benchmark | metric | Tidal | baseline | ratio | goal | met |", "|---|---|---|---|---|---|---|"]
    for name in [n for n in ORDER if n in documents] + sorted(set(documents) - set(ORDER)):
        for row in documents[name]["rows"]:
            ratio = f"{row['ratio']:.3g} ({row['ratio_meaning']})" if row.get("ratio") is not None else "—"
            baseline = (f"{number(row['baseline'], row['unit'])} ({row['baseline_name']})"
                        if row.get("baseline") is not None else "—")
            lines.append(f"| {name} | {row['metric']} | {number(row['tidal'], row['unit'])} | {baseline} | {ratio} | "
                         f"{row['goal']} | {'yes' if row['met'] else '**no**'} |")
    lines += ["", "## Details", ""]
    for name in [n for n in ORDER if n in documents] + sorted(set(documents) - set(ORDER)):
        document = documents[name]
        machine = document["machine"]
        lines += [f"### {name}", ""] + ([document["text"], ""] if document.get("text") else [])
        lines += [f"- command: `{document['command']}`", f"- code: {measured_code(document)}",
                  f"- date: {document['date']}",
                  f"- machine: {machine['cores']} cores ({machine['cpu']}), {machine['memory_gib']} GiB, "
                  f"kernel {machine['kernel']}, Python {machine['python']}, torch {machine['torch']}, "
                  f"{machine['slurm'] or 'no Slurm'}, {machine['backend']}",
                  f"- settings: {json.dumps(document['settings'])}"]
        for row in document["rows"]:
            samples = ", ".join(f"{v:.4g}" for v in row["tidal_samples"])
            base = ", ".join(f"{v:.4g}" for v in row["baseline_samples"])
            lines.append(f"- {row['metric']}: Tidal [{samples}]" + (f"; baseline [{base}]" if base else "")
                         + (f". {row['note']}" if row["note"] else ""))
        if "table" in document:
            lines += ettr_table(document)
        lines.append("")
    (REPO / "bench" / "RESULTS.md").write_text("\n".join(lines))
    absent = f", missing {', '.join(missing)}" if missing else ""
    print(f"report: wrote bench/RESULTS.md ({len(documents)} benchmarks{absent})")


if __name__ == "__main__":
    main()
