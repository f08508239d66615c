"""Ray job entry point: the same as ``megatrain-ray bench`` (see :mod:`megatrain_ray.bench`).

    ray job submit --address $ADDRESS --working-dir . -- python jobs/bench.py --preset 7b --steps 5 --out bench-out

(the cluster started as in jobs/train.py). Under ``ray job submit`` RAY_ADDRESS is set, so the
pipeline joins that cluster; a relative ``--out`` is taken from ~/megatrain-ray on the node the
job's driver runs on (the head, for a one-node cluster), not from Ray's temporary copy of the
working directory.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
