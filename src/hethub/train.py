"""``python -m hethub.train`` / ``torchrun -m hethub.train``: one training rank.

The entry point lives in the runtime (:mod:`hethub.runtime.train`); this module keeps the short
name that the README, the docs and torchrun command lines use, and only delegates.
"""

import sys

from hethub.errors import missing_extra

try:
    from hethub.runtime.train import exit_rank, main, parse_args
except ModuleNotFoundError as _err:  # torch is the train extra: say so instead of a traceback
    _missing = missing_extra(_err, what="'python -m hethub.train'")
    if _missing is None:
        raise
    if __name__ != "__main__":
        raise _missing from None
    print(f"hethub.train: error: {_missing}", file=sys.stderr)
    sys.exit(_missing.exit_code)

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    exit_rank(main())
