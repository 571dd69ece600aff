"""Stands in for the training entry inside a rendered launch script, in tests.

Joins the process group exactly as Megatron would (torchrun's env://, gloo on CPU), checks
the world with an all-reduce, and rank 0 writes what it saw, with the argument vector the
script passed, to $RUN_DIR/probe.json.
"""
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([rank], dtype=torch.int64)
dist.all_reduce(t)
ranks = [None] * world
dist.all_gather_object(ranks, {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]),
                               "host": socket.gethostname()})
if rank == 0:
    out = {"world_size": world, "rank_sum": int(t.item()), "ranks": ranks, "argv": sys.argv[1:],
           "master_addr": os.environ.get("MASTER_ADDR"), "master_port": os.environ.get("MASTER_PORT"),
           "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "rdzv_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
           "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    with open(os.path.join(os.environ["RUN_DIR"], "probe.json"), "w") as f:
        json.dump(out, f)
dist.destroy_process_group()
