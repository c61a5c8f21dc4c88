"""``python -m funcopt``: the same commands as the ``funcopt`` console script."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
