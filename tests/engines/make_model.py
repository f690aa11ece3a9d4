"""Make the suite's model: a tiny random Llama with a byte-level BPE tokenizer trained here.

Runs in the engines' virtualenv (it has torch, transformers and tokenizers through vLLM):

    python make_model.py OUT_DIR

Nothing is downloaded: the weights are random (seeded, so every run makes the same model)
and the tokenizer is trained on text generated below. A few seconds on one core.
"""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB = 512
# A chat template vLLM's chat endpoint can render (plain role: text lines).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TEXT = (
    "the prefill computes a prompt and the decode pulls its keys and values over the wire "
    "envoy asks pdproc which pod prefills each request then sends the decode its body "
    "a small model answers with random words because its weights are random numbers "
    "tell me a story about the sea the mountain the river and the city at night "
    "the quick brown fox jumps over the lazy dog"
)


def corpus() -> list[str]:
    words = TEXT.split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12 + i % 9)))
    lines += [str(n) for n in range(1000)]
    return lines


def make_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_weights(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    # Wider weights than the default init: the logits then differ clearly between tokens,
    # so greedy choices are stable and a wrong KV cache changes the text.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    make_weights(out)
    print(out)


if __name__ == "__main__":
    main()
