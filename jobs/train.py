"""Ray job entry point: the same as ``megatrain-ray train``.

    export RAY_AUTH_MODE=token                    # token authentication on (Ray 2.60)
    ray get-auth-token --generate > /dev/null     # once: ~/.ray/auth_token, if there is none
    ADDRESS=$(python jobs/head.py start)          # a head on free ports, beside any other Ray
    ray job submit --address $ADDRESS --working-dir . -- python jobs/train.py --config my_run.yaml --set train.steps=100
    python jobs/head.py stop                      # this head only

Under ``ray job submit`` RAY_ADDRESS is set, so the run joins that cluster instead of starting one.
The job runs in Ray's temporary copy of the working directory, so a relative train.run_dir is
taken from ~/megatrain-ray on the node of the job's driver (it says where; see
:func:`megatrain_ray.orchestration.cluster.job_path`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
