"""Alternating CPU timings, one process a measurement: sides of muser-bench's CPU bench, or our step from two trees.

    python scripts/lab/cpu_ab.py --case step:32768 --rounds 5 --sides ours,ggml,ggml_baseline
    python scripts/lab/cpu_ab.py --case step:2048 --rounds 5 --sides ours --trees /tmp/old,.   # kernel A/B
    python scripts/lab/cpu_ab.py --case step:2048 --rounds 5 --sides lavapipe

Each (tree, side) runs ``python -m muser_ti.cli.bench_cpu --side S --case C`` in a fresh process (the tree first on
PYTHONPATH; the native ggml side through muser_ti.bench.native_ggml), in turns, ``--rounds`` times; it prints
every process's median, the medians of them, and the 1-minute load average before and after each process (a
figure is quiet when the load before it is under --quiet, 0.5 by default, and other processes used under 0.1
of a core during it: the load after a process counts the process itself) as JSON lines, then a summary line.  With
--wait-quiet S each process waits up to S seconds for a quiet host and is redone if others used the CPU during it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def busy_s() -> float:
    """Seconds of CPU time the whole machine has spent busy (all cores; /proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def children_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def env_for(tree: Path, side: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from muser_ti.bench import native_ggml
    from muser_ti.cli.bench_cpu import LAVAPIPE_ICD

    env = dict(os.environ)
    paths = [str(tree)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if side == "ggml":
        paths.insert(0, str(native_ggml.built() / "py"))
    if side == "lavapipe":
        env["VK_ICD_FILENAMES"] = LAVAPIPE_ICD
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def one(tree: Path, side: str, case: str, repeats: int) -> dict:
    before = load1()
    busy0, own0, t0 = busy_s(), children_s(), time.time()
    done = subprocess.run([sys.executable, "-m", "muser_ti.cli.bench_cpu", "--side", side, "--case", case,
                           "--repeats", str(repeats)], cwd=tree, env=env_for(tree, side), capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    ms = json.loads(done.stdout.strip().splitlines()[-1])["ms"]
    # other processes' CPU use during this one, in cores: the machine's busy time less this child's
    others = max(0.0, (busy_s() - busy0) - (children_s() - own0)) / (time.time() - t0)
    return {"tree": str(tree), "side": side, "case": case, "ms": ms, "load_before": before, "load_after": load1(),
            "others_cores": round(others, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="step:2048")
    ap.add_argument("--sides", default="ours")
    ap.add_argument("--trees", default=".")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quiet", type=float, default=0.5)
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="wait up to this many seconds a process for the load to fall under --quiet, and redo a "
                         "process the load rose over --quiet during (at most 3 times)")
    args = ap.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    who = [(t, s) for t in trees for s in args.sides.split(",")]
    runs = {w: [] for w in who}
    quiet = True
    for r in range(args.rounds):
        for w in (who if r % 2 == 0 else who[::-1]):  # order alternates round by round
            for _ in range(4 if args.wait_quiet else 1):
                waited = 0.0
                while args.wait_quiet and load1() >= args.quiet and waited < args.wait_quiet:
                    time.sleep(5)
                    waited += 5
                res = one(*w, args.case, args.repeats)
                if not args.wait_quiet or (res["load_before"] < args.quiet and res["others_cores"] < 0.1):
                    break
                print(json.dumps({"redo": res}), flush=True)
            quiet &= res["load_before"] < args.quiet and res["others_cores"] < 0.1
            runs[w].append(res["ms"])
            print(json.dumps(res), flush=True)
    summary = {f"{t.name or t}:{s}": {"median_ms": statistics.median(v), "runs_ms": v} for (t, s), v in runs.items()}
    print(json.dumps({"case": args.case, "quiet": quiet, "medians": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
