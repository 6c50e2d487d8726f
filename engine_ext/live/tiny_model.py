"""A tiny random-weight Llama for live CPU SGLang servers: hidden 128, 2 layers, vocab 1024, fp32, a
byte-level BPE tokenizer with a chat template, built offline in seconds (no hub access). Its directory is
a local path, so SGLang and sglang-router load model and tokenizer from disk.

Usage: python tiny_model.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny model for testing.",
    "SGLang serves language models with prefill and decode disaggregation.",
    "User: what is the capital of France? Assistant: Paris.",
]


def make_tiny_model(out: Path, seed: int = 0) -> Path:
    """Write config, safetensors weights and tokenizer files into `out` (created) and return it."""
    import torch
    import torchvision_shim  # noqa: F401  (transformers imports torchvision: the shim first)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 50, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    print("tiny model in", make_tiny_model(Path(sys.argv[1])))
