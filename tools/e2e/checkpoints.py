"""Tiny checkpoints the end-to-end harness serves, written from a seed (nothing downloaded).

Every checkpoint directory holds ``config.json``, a character-level ``tokenizer.json`` built
with ``tokenizers`` (one token per printable ASCII character, so any text round-trips and
token counts are easy to reason about) and, where weights matter, ``model.safetensors``.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
SIMPLE_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def char_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    return vocab


def write_tokenizer(path: Path, chat_template: str = SIMPLE_CHAT_TEMPLATE, model_max_length: int = 8192) -> int:
    """A character-level fast tokenizer in ``path``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = char_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    for special in SPECIAL_TOKENS:
        tok.add_special_tokens([special])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": SPECIAL_TOKENS[UNK_ID], "bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
        "model_max_length": model_max_length, "add_bos_token": False, "chat_template": chat_template,
    }, indent=1))
    return len(vocab)


def write_tiny_llama(path: Path) -> Path:
    """A two-layer Llama of hidden size 64, served with ``--load-format dummy`` (random weights)."""
    vocab = write_tokenizer(path)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": vocab, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "tie_word_embeddings": False,
    }, indent=1))
    return path
