"""The training runtime: what runs inside a Megatron job (needs torch and megatron-core), and
the plan of a CPU run (cpu_run.py, which needs neither).

compat.py   fixes for running megatron.training from the pip wheel
attention.py  core attention through torch SDPA, for Megatron-Core's local layers
specs.py    the layer spec: Transformer Engine's when it imports, else local + SDPA
entry.py    the pretrain_gpt.py equivalent: datasets, forward step, pretrain()
cpu_loop.py a tiny real Megatron-Core training loop on CPU with gloo (no pretrain())
cpu_run.py  train's request as that loop's config and command (planned without torch)
"""
