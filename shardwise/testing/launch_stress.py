"""Launch the training job many times and count how it ends: ``./dev stress --cli --runs N``.

A job that trained every step and printed its summary can still fail at the very end: a
rank that dies in native code while its interpreter shuts down (``terminate called without
an active exception``, SIGABRT) makes torchrun report the whole job FAILED. Such an end
shows up once in tens of launches, so this runner launches ``shardwise train`` itself (the
CLI, which starts torchrun and its ranks) ``--runs`` times, each with a short run drawn from
a shuffled grid of GPT presets and small Transformers configs (written locally, no network)
at 2 and 4 ranks, every fault default on (``SHARDWISE_*`` removed from the environment), under
glibc's heap checks and Python's fault handler (:mod:`~shardwise.testing.crash_signs`).

Every launch is classified: ``ok`` (exit 0, no sign of a native crash), ``NATIVE ABORT``
(a crash sign in the output, whatever the exit code: a crash is a defect even when the job
reports success) or ``FAILED`` (a non-zero exit). A failure is reported with the rank and exit
code torchrun names, the lines that say what died, and the launch's log::

    ./dev stress --cli --runs 20
    ./dev stress --cli --runs 200 --seed 7 --log-dir /tmp/launches

Exit status: 0 when every launch was clean, 1 otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from shardwise.testing.crash_signs import NATIVE_CRASH, loud_crash_env
from shardwise.testing.hf_families import tiny_config
from shardwise.testing.jobs import kill_job

__all__ = ["Launch", "Outcome", "launches", "run_launch", "main"]

RUN_ARGS = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--data-bytes", "20000"]
"""The cheapest run that still shards, gathers, reduces, steps and tears down on every rank."""

PRESETS = ("nano", "tiny")
HF_CONFIGS: dict[str, dict] = {  # small configs of Transformers' families (about 35 K parameters)
    family: tiny_config(family, tie_word_embeddings=False) for family in ("llama", "phi3", "qwen2", "mistral", "gpt2")
}
WORLD_SIZES = (2, 4)
LAUNCH_TIMEOUT_S = 600.0


class Launch(NamedTuple):
    model: str  # a preset name, or a Transformers model_type
    nproc: int

    def argv(self, config_dir: Path) -> list[str]:
        """``shardwise train``'s arguments for this launch."""
        source = ["--model", self.model] if self.model in PRESETS else ["--hf-config", str(config_dir / self.model)]
        return ["train", *source, "--nproc", str(self.nproc), *RUN_ARGS]


class Outcome(NamedTuple):
    returncode: int
    crashed: bool  # a native crash sign in the output
    rank: str  # the failed rank as torchrun names it ("?" when it names none)
    message: str  # the lines that say what died ("" when clean)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.crashed


def launches(runs: int, seed: int) -> list[Launch]:
    """``runs`` launches: the grid of every model x world size, shuffled, repeated as needed."""
    grid = [Launch(m, n) for m, n in itertools.product((*PRESETS, *HF_CONFIGS), WORLD_SIZES)]
    rng = random.Random(seed)
    out: list[Launch] = []
    while len(out) < runs:
        rng.shuffle(grid)
        out += grid
    return out[:runs]


def write_configs(directory: Path) -> Path:
    """Each of :data:`HF_CONFIGS` as ``directory/<model_type>/config.json``."""
    for family, config in HF_CONFIGS.items():
        (directory / family).mkdir(parents=True, exist_ok=True)
        (directory / family / "config.json").write_text(json.dumps(config))
    return directory


def _launch_env(seed: int) -> dict[str, str]:
    """Heap checks and the fault handler on; every ``SHARDWISE_*`` knob unset (the fault defaults)."""
    env = loud_crash_env(seed)
    for name in [n for n in env if n.startswith("SHARDWISE_")]:
        del env[name]
    return env


_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)
_TORCHRUN_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.M)


def classify(returncode: int, text: str) -> Outcome:
    """How a launch ended, from its exit code and its output (torchrun's failure summary
    names the first failed rank and its exit code)."""
    signs = [line.strip() for line in text.splitlines() if NATIVE_CRASH.search(line)]
    ranks, codes = _TORCHRUN_RANK.findall(text), _TORCHRUN_EXIT.findall(text)
    rank = ",".join(f"{r} (exit {c})" for r, c in zip(ranks, codes)) or "?"
    message = "; ".join(dict.fromkeys(signs)) if signs else _last_error(text)
    return Outcome(returncode, bool(signs), rank, "" if returncode == 0 and not signs else message)


def _last_error(text: str) -> str:
    errors = [line.strip() for line in text.splitlines() if "Error" in line or "error" in line]
    return errors[-1] if errors else "(no error line)"


def run_launch(launch: Launch, config_dir: Path, log: Path, seed: int) -> Outcome:
    """Launch ``shardwise train`` once (output to ``log``) and classify how it ended."""
    cmd = [sys.executable, "-m", "shardwise", *launch.argv(config_dir)]
    with log.open("w") as out:
        out.write(f"# {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_launch_env(seed),
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_job(proc)
            returncode = -9
            out.write(f"\n# stress: killed after {LAUNCH_TIMEOUT_S:.0f} s\n")
    return classify(returncode, log.read_text(errors="replace"))


def _verdict(outcome: Outcome) -> str:
    if outcome.ok:
        return "ok"
    kind = "NATIVE ABORT" if outcome.crashed else f"FAILED (exit {outcome.returncode})"
    return f"{kind} rank {outcome.rank}: {outcome.message}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev stress --cli", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="how many launches (default 20)")
    parser.add_argument("--until-failure", action="store_true", help="stop at the first unclean launch")
    parser.add_argument("--seed", type=int, default=None, help="the shuffle's seed (default: from the clock)")
    parser.add_argument("--log-dir", default=None, help="where each launch's output goes (default: a new temp dir)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="shardwise-launches-"))
    config_dir = write_configs(log_dir / "configs")
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    print(f"stress --cli: {args.runs} launches of shardwise train (seed {seed}); logs in {log_dir}", flush=True)
    failed, aborted, done = 0, 0, 0
    for i, launch in enumerate(launches(args.runs, seed), start=1):
        start = time.monotonic()
        outcome = run_launch(launch, config_dir, log_dir / f"launch{i:03d}-{launch.model}-{launch.nproc}.log", seed + i)
        done += 1
        failed += outcome.returncode != 0
        aborted += outcome.crashed
        print(f"launch {i}: {launch.model} x {launch.nproc} ranks, {time.monotonic() - start:.0f} s: "
              f"{_verdict(outcome)}", flush=True)
        if not outcome.ok and args.until_failure:
            break
    print(f"stress --cli: {done} launches, {failed} non-zero exits, {aborted} native aborts", flush=True)
    return 0 if failed == aborted == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
