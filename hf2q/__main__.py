"""``python -m hf2q`` is the same as the ``hf2q`` console script."""

from hf2q.cli.app import main

if __name__ == "__main__":
    raise SystemExit(main())
