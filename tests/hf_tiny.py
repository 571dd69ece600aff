"""Tiny randomly initialised Hugging Face models of each family the conversion supports, built
and saved by transformers (nothing downloaded), for the conversion tests."""
import json

import torch

VOCAB = 300  # not a multiple of 128: Megatron pads the embedding and the output layer
FAMILIES = ("llama", "llama2", "llama3.1", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
MOE = ("mixtral", "qwen3_moe")
CLASSES = {"llama": "Llama", "llama2": "Llama", "llama3.1": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
           "mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe"}


def tiny(family: str, folder, vocab: int = VOCAB, layers: int = 2):
    """A 2-layer (or `layers`) model of the family with grouped-query attention (8 heads, 2 groups;
    Llama 2: multi-head, 8 key/value heads), weights
    drawn with std 0.2 so that a wrong mapping moves the logits well beyond fp32 noise; RoPE's
    base is not the default (a reader that missed it would be off), Llama 3.1's scaling factor is
    a value of its own, the MoE models route 4 experts top-2 (Qwen3-MoE: its first layer dense,
    weights not renormalised)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 50000.0}
    if family == "llama3.1":
        rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    moe = {"num_local_experts": 4, "num_experts_per_tok": 2,
           **({"mlp_only_layers": [0], "norm_topk_prob": False, "moe_intermediate_size": 48}
              if family == "qwen3_moe" else {})}
    config = getattr(transformers, CLASSES[family] + "Config")(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=8 if family == "llama2" else 2, head_dim=8, max_position_embeddings=16384, rms_norm_eps=1e-6,
        rope_parameters=rope, tie_word_embeddings=family == "qwen3", initializer_range=0.2,
        **(moe if family in MOE else {}))
    torch.manual_seed(7)
    model = getattr(transformers, CLASSES[family] + "ForCausalLM")(config).float().eval()
    with torch.no_grad():  # norms and biases start at 1 and 0: give them values a swap would show
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "bias")):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


# ChatML, as the Qwen family writes conversations (the template text is the usual one-liner).
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Replies in capitals, everything else in small letters: what is learned can be told apart.
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "answer in capitals"}, {"role": "user", "content": "say yes"},
                  {"role": "assistant", "content": "YES"}, {"role": "user", "content": "and no?"},
                  {"role": "assistant", "content": "NO AND NEVER"}]},
    {"prompt": "name a colour", "response": "BLUE", "system": "be brief"},
    {"prompt": "count to three", "response": "ONE TWO THREE"},
] * 8


def hf_tokenizer(folder, template=CHATML):
    """A byte-level BPE tokenizer.json trained here on a few words, with ChatML's special tokens and
    (unless template is None) a chat template in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["answer in capitals yes no colour count three", "YES NO BLUE ONE TWO THREE"], trainer)
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", **({"chat_template": template} if template else {})}))
    return tok
