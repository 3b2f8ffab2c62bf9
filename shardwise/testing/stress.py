"""Run chosen tests many times, shuffled, under glibc's heap checks: ``./dev stress``.

A rare native crash (a double free, a use after free) in a training process can corrupt
data silently before it aborts, so "it passed when rerun" is not an answer. This runner
repeats a pytest selection ``--runs`` times, each run in a fresh interpreter under glibc's
heap checks and Python's fault handler (:mod:`~shardwise.testing.crash_signs`), and the
tests in a different random order each run (the order a crash needs is often "after that
other test"). Each run's output is kept in ``--log-dir``; a run that fails is
reported with its seed, its order and the lines that say what died where (the rank
harness already reports a dead rank's exit code and the stacks of its threads)::

    ./dev stress --runs 20 tests/test_state_dict.py tests/test_checkpoint.py
    ./dev stress --runs 50 --until-failure tests/test_faults.py -k digest
    ./dev stress --runs 20 --keep-order tests/test_parity.py tests/test_compile.py   # an order's failure

``./dev stress --cli --runs N`` launches ``shardwise train`` itself N times instead
(:mod:`~shardwise.testing.launch_stress`): how the job ends, not how a test does.

Exit status: 0 when every run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

from shardwise.testing import launch_stress
from shardwise.testing.crash_signs import NATIVE_CRASH, loud_crash_env

__all__ = ["main"]


def _collect(pytest_args: list[str]) -> list[str]:
    """The node ids the selection names, in collection order."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *pytest_args],
        capture_output=True, text=True,
    )
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"stress: pytest collected no tests from {pytest_args}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return ids


def _run_once(run: int, ids: list[str], extra: list[str], log_dir: Path, seed: int,
              shuffle: bool = True) -> tuple[bool, str, Path]:
    order = list(ids)
    if shuffle:
        random.Random(seed).shuffle(order)
    env = loud_crash_env(seed)
    log = log_dir / f"run{run:03d}-seed{seed}.log"
    start = time.monotonic()
    with log.open("w") as out:
        out.write(f"# seed {seed}, MALLOC_PERTURB_={env['MALLOC_PERTURB_']}\n# order:\n")
        out.writelines(f"#   {i}\n" for i in order)
        out.flush()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *order],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    text = log.read_text(errors="replace")
    crashed = bool(NATIVE_CRASH.search(text))
    ok = done.returncode == 0 and not crashed
    summary = _last_line(text)
    verdict = "ok" if ok else ("NATIVE CRASH" if crashed else f"failed (exit {done.returncode})")
    return ok, f"run {run}: {verdict} in {time.monotonic() - start:.0f} s, seed {seed}: {summary}", log


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _evidence(log: Path, context: int = 12) -> str:
    """The lines around each sign of a native crash or a failure, for the report."""
    lines = log.read_text(errors="replace").splitlines()
    marks = [i for i, line in enumerate(lines) if NATIVE_CRASH.search(line) or line.startswith("FAILED")]
    shown: list[str] = []
    for i in marks[:6]:
        shown.extend(lines[max(0, i - 2) : i + context])
        shown.append("    ...")
    return "\n".join(shown)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--cli" in argv:  # launches of the training job instead of pytest runs
        argv.remove("--cli")
        return launch_stress.main(argv)
    parser = argparse.ArgumentParser(prog="./dev stress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="how many runs (default 20)")
    parser.add_argument("--until-failure", action="store_true", help="stop at the first failed run")
    parser.add_argument("--seed", type=int, default=None, help="first run's seed (default: from the clock)")
    parser.add_argument("--log-dir", default=None, help="where each run's output goes (default: a new temp dir)")
    parser.add_argument("--keep-order", action="store_true",
                        help="run the tests in the order given, every run (an order-dependent failure)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    targets = [a for a in pytest_args if not a.startswith("-")] or ["tests"]
    ids = _collect(pytest_args or targets)
    extra = [a for a in pytest_args if a.startswith("-") and a not in ("-x",)]
    if "-k" in extra:  # the selection is already in the ids
        k = extra.index("-k")
        del extra[k : k + 2]
    log_dir = Path(args.log_dir) if args.log_dir else Path(_tempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    base = args.seed if args.seed is not None else int(time.time()) % 100_000
    order = "in the order given" if args.keep_order else "shuffled"
    print(f"stress: {len(ids)} tests x {args.runs} runs, {order}, MALLOC_CHECK_=3; logs in {log_dir}", flush=True)
    failed = []
    for run in range(1, args.runs + 1):
        ok, line, log = _run_once(run, ids, extra, log_dir, base + run, shuffle=not args.keep_order)
        print(line, flush=True)
        if not ok:
            failed.append(log)
            print(_evidence(log), flush=True)
            if args.until_failure:
                break
    runs = run
    print(f"stress: {runs - len(failed)} of {runs} runs clean" + (f"; failed: {[str(f) for f in failed]}" if failed else ""))
    return 1 if failed else 0


def _tempdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="shardwise-stress-")


if __name__ == "__main__":
    sys.exit(main())
