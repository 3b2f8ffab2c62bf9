"""Run a script you do not edit with shardwise in place of torch's FSDP2, in every rank.

::

    python -m shardwise.as_torch_fsdp train.py --lr 3e-4            # one process
    torchrun --nproc-per-node 8 -m shardwise.as_torch_fsdp train.py --lr 3e-4
    accelerate launch -m shardwise.as_torch_fsdp train.py --lr 3e-4
    torchrun ... -m shardwise.as_torch_fsdp -m torchtitan.train --job.config_file llama3.toml

Each process the launcher starts runs this module: it installs the switch
(:func:`shardwise.install_as_torch_fsdp`) before the script imports anything, then runs
the script (a path, or ``-m module``) as ``__main__`` with ``sys.argv`` set as if it had
been started directly. The switch stays on until the process exits.
"""

from __future__ import annotations

import os
import runpy
import sys

from shardwise.switch import install_as_torch_fsdp

USAGE = "usage: python -m shardwise.as_torch_fsdp (SCRIPT.py | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    """Install the switch and run the target; its exit status is the process's.

    Args:
        argv: ``[script, *args]`` or ``["-m", module, *args]``; default ``sys.argv[1:]``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(f"{USAGE}\n\n{__doc__.strip()}\n")
        return
    if not argv or argv == ["-m"]:
        raise SystemExit(USAGE)
    if argv[0] == "-m":
        install_as_torch_fsdp()
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file path in argv[0]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"shardwise.as_torch_fsdp: no such script: {script!r}\n{USAGE}")
    install_as_torch_fsdp()
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
