"""``pdserve``: see and stop the clusters that ``--pd-reuse`` runs kept. [pytest-free]

``pdserve ls`` lists them (id, spec, engine, age, idle time, time left, whether a run holds one now);
``pdserve stop NAME...`` stops the named ones (an id, or a spec name: every kept cluster of that spec) and
``pdserve stop --all`` stops every one. Both read ``--dir``, else ``$PDSERVE_REUSE_DIR``, else the default
(``${PDSERVE_CACHE_DIR:-~/.cache/pytest-pdserve}/reuse``), the same directory the plugin uses. A kept cluster
whose keeper is gone is cleaned up by either command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pytest_pdserve.config.setting_table import SETTINGS_BY_NAME
from pytest_pdserve.errors import ReuseError
from pytest_pdserve.reuse.client import keeper_info, list_kept, stop_kept
from pytest_pdserve.reuse.dirs import check_reuse_dir, default_reuse_dir
from pytest_pdserve.reuse.state import KeptCluster

__all__ = ["main"]


def _reuse_dir(given: str | None) -> Path:
    env = os.environ.get(SETTINGS_BY_NAME["reuse_dir"].env_var, "").strip()
    return Path(given or env or default_reuse_dir()).expanduser()


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _row(kept: KeptCluster, now: float) -> dict[str, object]:
    info = keeper_info(kept)
    claimed = bool(info.get("claimed"))
    idle = float(info.get("idle_seconds", 0.0))
    p, d = kept.state.topology
    ttl = float(info.get("ttl", kept.ttl))  # the keeper's: the last run that claimed it may have set another
    idle_text, stops_in = ("in use", "-") if claimed else (_age(idle), _age(ttl - idle))
    if not info:  # no answer: nothing to say of its idle time (a stopped keeper stops nothing)
        idle_text, stops_in = "?", "keeper stopped" if kept.keeper_stopped() else "?"
    return {
        "id": kept.id, "cluster": kept.spec_name, "engine": kept.state.engine, "topology": f"{p}P x {d}D",
        "age": _age(now - kept.created), "idle": idle_text, "stops_in": stops_in, "proxy": kept.state.proxy.url,
        "keeper_pid": kept.keeper_pid,
    }  # fmt: skip


def _ls(directory: Path, as_json: bool) -> int:
    now = time.time()
    rows = [_row(k, now) for k in list_kept(directory, report=print)]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no kept clusters in {directory}")
        return 0
    columns = ["id", "cluster", "engine", "topology", "age", "idle", "stops_in", "proxy", "keeper_pid"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip())
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in columns).rstrip())
    return 0


def _stop(directory: Path, names: Sequence[str], everything: bool) -> int:
    kept = list_kept(directory, report=print)
    if everything:
        chosen = kept
    else:
        chosen = [k for k in kept if k.id in names or k.spec_name in names]
        unknown = [n for n in names if not any(n in (k.id, k.spec_name) for k in kept)]
        if unknown:
            known = ", ".join(k.id for k in kept) or "none"
            print(f"pdserve stop: no kept cluster named {', '.join(unknown)} (kept: {known})", file=sys.stderr)
            return 1
    failed = 0
    for k in chosen:
        if stop_kept(k):
            print(f"stopped {k.id}")
        else:
            failed += 1
            why = k.keeper_stopped() or f"its keeper (pid {k.keeper_pid}) did not stop it"
            print(f"pdserve stop: {k.id}: {why}", file=sys.stderr)
    if everything and not chosen:
        print(f"no kept clusters in {directory}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``pdserve ls`` / ``pdserve stop``."""
    parser = argparse.ArgumentParser(prog="pdserve", description="See and stop clusters kept by --pd-reuse runs.")
    parser.add_argument("--dir", help="reuse directory (default: $PDSERVE_REUSE_DIR or the plugin's default)")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list kept clusters")
    ls.add_argument("--json", action="store_true", help="print JSON")
    stop = sub.add_parser("stop", help="stop kept clusters")
    stop.add_argument("names", nargs="*", metavar="NAME", help="a kept cluster's id, or a spec name")
    stop.add_argument("--all", action="store_true", help="stop every kept cluster")
    args = parser.parse_args(argv)
    directory = _reuse_dir(args.dir)
    if not os.path.lexists(directory):  # nothing was ever kept there: listing or stopping everything is a success
        if args.command == "ls" or args.all:
            print(f"no kept clusters in {directory}")
            return 0
        names = ", ".join(args.names)
        print(f"pdserve stop: no kept cluster named {names} (no reuse dir {directory})", file=sys.stderr)
        return 1
    try:
        check_reuse_dir(directory)  # the plugin's own rule: never trust, or clean up in, a directory not ours
        if args.command == "ls":
            return _ls(directory, args.json)
        if not args.names and not args.all:
            parser.error("stop: name a kept cluster, or give --all")
        return _stop(directory, args.names, args.all)
    except ReuseError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
