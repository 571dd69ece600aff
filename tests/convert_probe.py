"""One rank of tiny models built at TP x PP on CPU (gloo), each filled from a Hugging Face folder
by convert.hf.fill and run forward on the token ids in IDS: the last stage writes each model's
logits (gathered over TP) to OUT_DIR/<folder name>.pt.
Run with torchrun: convert_probe.py TP PP EP IDS OUT_DIR HF_DIR [HF_DIR ...]."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))


def main(tp: int, pp: int, ep: int, ids_path: str, out_dir: str, hf_dirs: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    for hf_dir in hf_dirs:
        one(hf_dir, tp, pp, ep, ids_path, str(Path(out_dir) / (Path(hf_dir).name + ".pt")))
    dist.barrier()
    dist.destroy_process_group()


def one(hf_dir: str, tp: int, pp: int, ep: int, ids_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_skill.convert import hf as conv
    from megatron_skill.core.flops import padded_vocab_size
    from megatron_skill.core.model import from_hf_config
    from megatron_skill.runtime.cpu_loop import build_model

    spec = from_hf_config(hf_dir)
    padded = padded_vocab_size(spec.vocab_size, tp)
    model = build_model({"model": {k: v for k, v in spec.to_fields().items() if v is not None}, "tp": tp, "pp": pp,
                         "ep": ep, "seq_length": 64, "padded_vocab_size": padded}).eval()
    first = get_transformer_layer_offset(model.config)
    local_experts = (spec.num_experts or 0) // ep
    conv.fill(model, conv.hf_reader(hf_dir), spec, padded, tp, ps.get_tensor_model_parallel_rank(), first,
              len(model.decoder.layers), first_expert=ps.get_expert_model_parallel_rank() * local_experts)
    ids = torch.load(ids_path)
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    shape = (ids.shape[1], ids.shape[0], spec.hidden_size)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(shape)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids, pos, None)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        else:
            pieces = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(pieces, out.contiguous(), group=ps.get_tensor_model_parallel_group())
            if ps.get_tensor_model_parallel_rank() == 0:
                torch.save(torch.cat(pieces, dim=-1)[..., :spec.vocab_size], out_path)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:])
