"""What time-boxed device calls of the suite reached: each test's outcome, and the tests no call reached.

A device call runs the suite under a time limit (`scripts/lab/run.sh tests`), so a call's log may stop
short.  This reads the logs of one or more calls (pytest -v lines, with or without xdist), collects the suite
here with the same --arch options, and writes:

    DIR/results.txt    outcome and node id, one a line, sorted by id (a later log's outcome wins)
    DIR/unreached.txt  the collected ids no log names: the next call's TEST_IDS file

It prints each log's counts and the totals.  A test whose outcomes differ between logs (failed, then passed
on a rerun) is listed, and so are ids a log names that this collection does not (a parametrised id may print
otherwise on another pytest).

    python3 scripts/lab/suite_results.py call2/tests.log call3/tests.log --out out/suite
"""

import argparse
import gzip
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_WORD = "|".join(OUTCOMES)
# xdist:   [gw3] [ 41%] PASSED tests/test_x.py::test_y[cuda-a b]
XDIST_LINE = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_WORD}) (tests/\S.*?)\s*$")
# plain -v: tests/test_x.py::test_y[cuda-a b] PASSED [ 12%]   (SKIPPED may carry "(reason)" before the %)
PLAIN_LINE = re.compile(rf"^(tests/\S.*?) ({_WORD})(?: \(.*\))?\s+\[\s*\d+%\]\s*$")


def outcomes_in(text: str) -> dict[str, str]:
    """Node id -> outcome for every result line of one log; a test reported twice keeps its last."""
    found = {}
    for line in text.splitlines():
        m = XDIST_LINE.match(line)
        if m:
            found[m.group(2)] = m.group(1)
            continue
        m = PLAIN_LINE.match(line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def collect(archs: list[str], tests: str) -> list[str]:
    """The suite's node ids as pytest collects them here with these --arch options."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", tests]
    for arch in archs:
        cmd += ["--arch", arch]
    done = subprocess.run(cmd, capture_output=True, text=True)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if done.returncode != 0 or not ids:
        tail = done.stdout[-2000:] + done.stderr[-2000:]
        raise SystemExit(f"collecting {tests} failed (rc {done.returncode}):\n{tail}")
    return ids


def merge(logs: dict[str, dict[str, str]]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The last outcome of each id over the logs in order, and the ids whose outcomes differ between logs."""
    last, seen = {}, {}
    for found in logs.values():
        for node, outcome in found.items():
            last[node] = outcome
            seen.setdefault(node, []).append(outcome)
    differing = {node: outs for node, outs in seen.items() if len(set(outs)) > 1}
    return last, differing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=Path, help="tests.log of each call, in the order they ran (.gz too)")
    ap.add_argument("--out", type=Path, required=True, help="folder for results.txt and unreached.txt")
    ap.add_argument("--arch", action="append", default=None, help="as the calls ran them (default cuda and vulkan)")
    ap.add_argument("--tests", default="tests/", help="what the calls ran (default tests/)")
    args = ap.parse_args(argv)
    archs = args.arch or ["cuda", "vulkan"]

    logs = {}
    for path in args.logs:
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            logs[str(path)] = outcomes_in(raw.decode("utf-8", errors="replace"))
        except (OSError, EOFError) as exc:  # EOFError: a cut .gz
            ap.error(f"cannot read log {path}: {exc}")
    collected = collect(archs, args.tests)
    last, differing = merge(logs)
    known = set(collected)
    unreached = [node for node in collected if node not in last]
    strangers = sorted(set(last) - known)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.txt").write_text("".join(f"{last[n]} {n}\n" for n in sorted(last)), encoding="utf-8")
    (args.out / "unreached.txt").write_text("".join(f"{n}\n" for n in unreached), encoding="utf-8")

    for name, found in logs.items():
        counts = Counter(found.values())
        print(f"{name}: " + ", ".join(f"{counts[o]} {o.lower()}" for o in OUTCOMES if counts[o]))
    totals = Counter(last[n] for n in last if n in known)
    print(f"all logs, {len(collected)} collected: " + ", ".join(f"{totals[o]} {o.lower()}" for o in OUTCOMES
                                                                   if totals[o]) + f", {len(unreached)} not reached")
    for node, outs in sorted(differing.items()):
        print(f"outcomes differ between logs: {node}: {' then '.join(outs)}")
    for node in strangers:
        print(f"named by a log, not collected here: {node}")
    print(f"wrote {args.out / 'results.txt'} and {args.out / 'unreached.txt'}")
    return 1 if totals["FAILED"] or totals["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
