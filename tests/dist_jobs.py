"""Test helper: several k3convert command lines, one after another, in one torchrun job.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_jobs.py JOBS.json RESULT

JOBS.json is a list of argument lists for ``k3convert.cli.main``. Each process writes
``RESULT.<rank>.json``: the exit status of every job, in order. Starting torchrun and
importing torch on every worker costs far more than a tiny conversion, so the tests of
tests/test_distributed_convert.py share one job. An exception that escapes a command
ends this process at once (the other process may be waiting in a collective: torchrun
then stops the job instead of letting it hang).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> None:
    jobs_path, result = sys.argv[1], sys.argv[2]
    from k3convert import cli

    with open(jobs_path, encoding="utf-8") as fh:
        jobs = json.load(fh)
    rank = os.environ.get("RANK", "0")
    codes = []
    for argv in jobs:
        try:
            codes.append(cli.main([str(a) for a in argv]))
        except Exception:  # any escape ends the job, loudly
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(3)
        sys.stdout.flush()
    with open(f"{result}.{rank}.json", "w", encoding="utf-8") as fh:
        json.dump(codes, fh)
    sys.exit(max(codes, default=0))


if __name__ == "__main__":
    main()
