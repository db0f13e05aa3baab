"""``python -m hethub.train`` / ``torchrun -m hethub.train``: one training rank.

The entry point lives in the runtime (:mod:`hethub.runtime.train`); this module keeps the short
name that the README, the docs and torchrun command lines use, and only delegates.
"""

import sys

from hethub.runtime.train import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
