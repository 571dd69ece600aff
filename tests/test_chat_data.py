"""Chat data for fine-tuning: conversations through the tokenizer's chat template, the loss kept on
the assistant's replies only, read by the training loop's dataset, and trained on CPU."""
import json

from conftest import require_modules

require_modules("torch", "megatron.core", "tokenizers")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_tiny import CONVERSATIONS  # noqa: E402
from hf_tiny import hf_tokenizer as _hf_tokenizer  # noqa: E402


def _prepare(cli, tmp_path, tokenizer="byte", name="chat", lines=CONVERSATIONS):
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in lines))
    code, out, err = cli("prepare-data", "--input", str(src), "--output-prefix", str(tmp_path / name),
                         "--format", "chat", "--tokenizer", tokenizer, "--bad-lines", "skip")
    return code, out, err


def _documents(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokens, masks = IndexedDataset(str(prefix)), IndexedDataset(str(prefix) + "_lossmask")
    return [(tokens[i].tolist(), masks[i].tolist()) for i in range(len(tokens))]


def test_byte_chat_data_learns_exactly_the_replies(tmp_path, cli):
    code, out, _ = _prepare(cli, tmp_path)
    assert code == 0 and out["result"]["format"] == "chat" and out["result"]["documents_out"] == 24
    docs = _documents(tmp_path / "chat")
    learned = [bytes(t for t, m in zip(ids, mask) if m).decode() for ids, mask in docs[:3]]
    assert learned == ["YES<|end|>\nNO AND NEVER<|end|>\n", "BLUE<|end|>\n", "ONE TWO THREE<|end|>\n"]
    assert all(ids[-1] == 256 and mask[-1] == 0 for ids, mask in docs)  # end of document, not learned
    assert out["result"]["learned_tokens"] == 8 * sum(map(len, learned))


def test_hf_chat_template_marks_reply_tokens_of_the_whole_text(tmp_path, cli):
    tok = _hf_tokenizer(tmp_path / "tok")
    code, out, err = _prepare(cli, tmp_path, tokenizer=str(tmp_path / "tok"))
    assert code == 0, (out, err[-2000:])
    ids, mask = _documents(tmp_path / "chat")[1]
    text = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nname a colour<|im_end|>\n"
            "<|im_start|>assistant\nBLUE<|im_end|>\n")
    assert ids[:-1] == tok.encode(text).ids  # the whole text tokenized once: no seams at the turns
    assert tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False) == "BLUE<|im_end|>\n"
    assert ids[-1] == tok.token_to_id("<|im_end|>")


def test_conversations_that_cannot_be_split_are_reported(tmp_path, cli):
    # a template that rewrites earlier turns once a reply follows them
    rewriting = ("{% for m in messages %}{{ m.role }}{% if loop.last and m.role == 'assistant' %}!{% endif %}: "
                 "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    _hf_tokenizer(tmp_path / "tok", template=rewriting)
    code, out, _ = _prepare(cli, tmp_path, tokenizer=str(tmp_path / "tok"), lines=CONVERSATIONS[:1] + [
        {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "x", "response": ""}, {"text": "plain"}])
    assert code == 0 and out["result"]["documents_out"] == 0
    reasons = [b["reason"] for b in out["result"]["bad_lines"]]
    assert "rewrites earlier turns" in reasons[0] and "no assistant message" in reasons[1]
    assert "prompt" in reasons[2] and "messages" in reasons[3]
    # a tokenizer without a chat template is refused before anything is read
    _hf_tokenizer(tmp_path / "plain", template=None)
    code, out, _ = _prepare(cli, tmp_path, tokenizer=str(tmp_path / "plain"), name="other")
    assert code != 0 and out["error"]["where"] == "/tokenizer" and "chat_template" in out["error"]["message"]
    assert not [p for p in tmp_path.glob("other.*") if p.suffix != ".jsonl"] and not list(tmp_path.glob("other_lossmask*"))


@pytest.fixture()
def single_process():
    from megatron_skill.convert.checkpoint import init_single_process

    init_single_process()


def test_masked_tokens_carry_no_loss(tmp_path, cli, single_process):
    """The training loop's own dataset and model: the mask is 1 exactly on reply labels, and
    labels under a 0 change nothing in the loss while a reply label does."""
    from megatron_skill.runtime.cpu_loop import build_data, build_model

    assert _prepare(cli, tmp_path)[0] == 0
    cfg = {"seed": 3, "seq_length": 64, "vocab_size": 257, "data_path": [str(tmp_path / "chat")],
           "data_cache": str(tmp_path / "cache"), "train_iters": 4, "global_batch_size": 4, "micro_batch_size": 4}
    dataset, _, _ = build_data(cfg, 0, 1)
    reply = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ <|end>\n")
    for i in range(8):
        item = dataset[i]
        labels, mask = item["labels"].tolist(), item["loss_mask"].tolist()
        for label, m in zip(labels, mask):
            if m:
                assert label in reply
            if chr(label).isupper() if label < 256 else False:
                assert m == 1
    batch = {k: torch.stack([torch.as_tensor(dataset[i][k]) for i in range(4)])
             for k in ("tokens", "labels", "loss_mask", "position_ids")}
    torch.manual_seed(0)
    model = build_model({"model": {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
                                   "vocab_size": 257}, "tp": 1, "seq_length": 64, "padded_vocab_size": 384})

    def loss(labels):
        with torch.no_grad():
            per_token = model(batch["tokens"], batch["position_ids"], None, labels=labels)
        return (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()

    base = loss(batch["labels"])
    masked = batch["loss_mask"] == 0
    scrambled = torch.where(masked, torch.randint(0, 257, batch["labels"].shape), batch["labels"])
    assert torch.equal(loss(scrambled), base)
    one_reply = batch["labels"].clone()
    pos = torch.nonzero(~masked)[0]
    one_reply[pos[0], pos[1]] = (one_reply[pos[0], pos[1]] + 1) % 257
    assert not torch.equal(loss(one_reply), base)


@pytest.mark.slow
def test_cpu_training_runs_on_chat_data(tmp_path, cli):
    code, out, _ = _prepare(cli, tmp_path)
    assert code == 0
    request = {"model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                         "vocab_size": 257}, "backend": "cpu", "seq_length": 64, "global_batch_size": 4,
               "runs_root": str(tmp_path / "runs"),
               "training": {**out["result"]["training"], "train_iters": 3, "log_interval": 1}}
    code, out, err = cli("train", "--request", "-", stdin=json.dumps(request))
    assert code == 0, (out, err[-3000:])
    assert len(out["result"]["loss_curve"]) == 3


def test_render_warns_that_megatron_lms_entry_would_learn_the_prompts(tmp_path, cli):
    assert _prepare(cli, tmp_path)[0] == 0
    base = ["render", "--model", json.dumps({"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                                             "num_attention_heads": 4, "vocab_size": 257}),
            "--gpu", "h100-sxm", "--num-gpus", "1", "--output-dir", str(tmp_path / "r"), "--dry-run",
            "--training", json.dumps({"data_path": [str(tmp_path / "chat")]})]
    code, out, _ = cli(*base)
    assert code == 0 and "warnings" not in out["result"]
    code, out, _ = cli(*base, "--megatron-lm", str(tmp_path / "Megatron-LM"))
    assert code == 0 and any("chat loss mask" in w for w in out["result"]["warnings"]), out


ENTRY_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1] + "/tools")
from megatron_skill.convert.checkpoint import init_single_process
init_single_process()
from megatron.training.arguments import parse_and_validate_args
from megatron.training.global_vars import set_args
from megatron_skill.adapter.skill_flags import add_skill_arguments
sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "257", "--data-path", sys.argv[2], "--split", "100,0,0", "--data-cache-path", sys.argv[3],
            "--transformer-impl", "local"]
set_args(parse_and_validate_args(extra_args_provider=add_skill_arguments,
                                 args_defaults={"tokenizer_type": "NullTokenizer"}))
from megatron_skill.runtime import entry
train, _, _ = entry.datasets_provider([4, 0, 0])
items = [train[i] for i in range(4)]
print(json.dumps({"kind": type(train.datasets[0] if hasattr(train, "datasets") else train).__name__,
                  "labels": [it["labels"].tolist() for it in items], "mask": [it["loss_mask"].tolist() for it in items]}))
"""


def test_the_gpu_entrys_dataset_applies_the_mask(tmp_path, cli):
    """The GPU entry's own datasets_provider, with Megatron's parser reading its arguments (run on
    the CPU: the provider needs no GPU): prepare-data's chat mask is what its samples carry."""
    import subprocess
    import sys

    from conftest import ROOT

    assert _prepare(cli, tmp_path)[0] == 0
    proc = subprocess.run([sys.executable, "-c", ENTRY_PROBE, str(ROOT), str(tmp_path / "chat"), str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["kind"] == "MaskedGPTDataset"
    reply = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ <|end>\n")
    pairs = [(label, m) for labels, mask in zip(got["labels"], got["mask"]) for label, m in zip(labels, mask)]
    assert all(label in reply for label, m in pairs if m) and any(m for _, m in pairs)
    assert all(m == 1 for label, m in pairs if label < 256 and chr(label).isupper())
