"""RESULTS.md-ready entries from the files a GPU session (benchmarks/gpu_session.sh) brought back.

For each benchmark JSON under a folder, in name order: a heading with the date
and commit, the machine (harness.describe_machine), the command that wrote it
(from the parts' logs beside it), then a markdown table of each of its
tabulated results (the printed table's rows, the targets' PASS/MISS, ooo's
rows), to paste under the benchmark's "### CUDA" section (headed "CPU" for the
script's CPU smoke run).

    python3 benchmarks/gpu_session.py $OUT [--commit HASH]
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import harness

# What the scripts' JSON holds as one row per table line; "cases" and "stats_ms"
# keep every sample and are left to the JSON itself.
TABLE_KEYS = ("rows", "micro_rows", "single", "split", "simulate_dp", "simulate_pipeline", "targets", "graph", "scan")
# The line gpu_session.sh logs before each command.
RUN_LINE = re.compile(r"^gpu_session: run \[[^\]]*\]: (.*)$")


def commands_by_json(folder: Path) -> dict[str, str]:
    """The command that wrote each JSON file (by file name), from the logs' run lines."""
    found = {}
    for log in sorted(folder.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            run = RUN_LINE.match(line)
            target = run and re.search(r"--json (\S+)", run.group(1))
            if target:
                found[Path(target.group(1)).name] = run.group(1)
    return found


def flatten(row: dict, prefix: str = "") -> dict:
    """Nested dicts as dotted keys ({"ms": {"eager": 1}} -> {"ms.eager": 1})."""
    flat = {}
    for key, value in row.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def markdown_rows(rows: list[dict]) -> str:
    """One markdown table over every key any row has ("-" where a row has none)."""
    flat = [flatten(row) for row in rows]
    headers = list(dict.fromkeys(key for row in flat for key in row))
    return harness.format_markdown_table(headers, [[harness.fmt(row.get(h)) for h in headers] for row in flat])


def entry(payload: dict, command: str | None, commit: str | None = None) -> str:
    """One RESULTS.md entry: heading, machine, command, then each table.

    ``commit`` stands in for the machine's git commit where it has none (the
    device's copy of the tree carries no .git).
    """
    machine = dict(payload.get("machine", {}))
    machine["git_commit"] = machine.get("git_commit") or commit
    where = "CUDA" if str(machine.get("device", "")).startswith("cuda") else "CPU"
    lines = [f"### {where} ({str(machine.get('date', 'undated'))[:10]}, commit {machine.get('git_commit') or 'n/a'})",
             "", harness.describe_machine(machine) if "reprop" in machine else "(no machine description)",
             f"`{command or 'command not found in the logs'}`"]
    for key in TABLE_KEYS:
        rows = payload.get(key)
        if isinstance(rows, dict):  # settings and their rows (ooo's simulate_dp)
            rows = rows.get("rows")
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            lines += ["", f"{key}:", "", markdown_rows(rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="where the session's files are ($OUT's copy)")
    p.add_argument("--commit", default=None, help="the commit the session sent, where the JSON has none")
    args = p.parse_args(argv)
    commands = commands_by_json(args.folder)
    paths = sorted(args.folder.glob("*.json"))
    if not paths:
        raise SystemExit(f"no JSON files under {args.folder}")
    for path in paths:
        print(f"<!-- {path.name} -->")
        print(entry(json.loads(path.read_text()), commands.get(path.name), args.commit))
        print()


if __name__ == "__main__":
    main()
