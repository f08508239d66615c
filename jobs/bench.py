"""Ray job entry point: the same as ``megatrain-ray bench`` (see :mod:`megatrain_ray.bench`).

    ray job submit --working-dir . -- python jobs/bench.py --preset 7b --steps 5 --baseline --out bench-out

Under ``ray job submit`` RAY_ADDRESS is set, so the pipeline joins that cluster; ``--out`` is a
path on the node the job's driver runs on (the head, for a one-node cluster).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
