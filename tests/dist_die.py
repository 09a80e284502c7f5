"""Test helper: ``k3convert shard`` under torchrun whose process 1 dies mid-unit.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_die.py shard SRC OUT ...

On process 1 the writer's ``write_unit`` (as ``k3convert.shard.writer`` imported it) is
wrapped: the first unit is written normally (and journaled by the writer), the second
ends the process with ``os._exit(1)`` after its header and first tensor went through,
leaving a partial temporary unit file behind, as a crash or a killed node would. Run with
``--workers 1`` so "the second unit" starts only after the first one is done. It dies
once both processes have recorded their share of the source's fingerprint in the journal
(as in a long run, where hashing runs ahead of writing): a rerun keeps the journaled
units only when it can tell, by content, that the source is the one they came from.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    from k3convert import cli
    from k3convert.shard import writer

    real = writer.write_unit
    calls = 0

    def dying(ck, up, out, compression, on_bytes=None, **kw):
        nonlocal calls
        calls += 1
        if calls < 2:
            return real(ck, up, out, compression, on_bytes=on_bytes, **kw)
        prints = [out / writer.JOURNAL / f"source-{r}-of-2.fingerprint" for r in (0, 1)]
        deadline = time.monotonic() + 60
        while not all(p.is_file() for p in prints) and time.monotonic() < deadline:
            time.sleep(0.02)
        seen = 0

        def then_die(n: int) -> None:
            nonlocal seen
            if on_bytes is not None:
                on_bytes(n)
            seen += 1
            if seen == 2:  # the header, then one tensor: the temp file exists
                sys.stdout.flush()
                os._exit(1)

        return real(ck, up, out, compression, on_bytes=then_die, **kw)

    if os.environ.get("RANK") == "1":
        writer.write_unit = dying
    sys.exit(cli.main(sys.argv[1:]))


if __name__ == "__main__":
    main()
