"""A light stand-in for the training entry (no torch): each rank that torchrun starts writes
what it was given -- its rank, the world, the rendezvous id, the argument vector -- to
$RUN_DIR/probe-RANK.json. The rendezvous itself is tested with rendezvous_probe.py."""
import json
import os
import socket
import sys

seen = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                            "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")}
seen.update(host=socket.gethostname(), argv=sys.argv[1:])
with open(os.path.join(os.environ["RUN_DIR"], f"probe-{seen['RANK']}.json"), "w") as f:
    json.dump(seen, f)
