"""``python -m shardwise ...``: the same as the ``shardwise`` console script (see :mod:`shardwise.cli`)."""

from shardwise.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
