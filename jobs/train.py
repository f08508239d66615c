"""Ray job entry point: the same as ``megatrain-ray train``.

    ray job submit --working-dir . -- python jobs/train.py --config my_run.yaml --set train.steps=100

Under ``ray job submit`` RAY_ADDRESS is set, so the run joins that cluster instead of starting one.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
