"""Tiny checkpoints the end-to-end harness serves, written from a seed (nothing downloaded).

Every checkpoint directory holds ``config.json``, a character-level ``tokenizer.json`` built
with ``tokenizers`` (one token per printable ASCII character, so any text round-trips and
token counts are easy to reason about) and, where weights matter, ``model.safetensors``.

``write_cycle_llama`` writes real weights whose greedy output follows a fixed successor map
(``CYCLES``), so a test knows the output of any prompt before it runs: a digit prompt loops
with period 3, a letter prompt walks the 26-letter cycle. With ``dsv41_tokens`` its tokenizer
also carries DeepSeek-V4.1's special tokens, so the server can render prompts through
upstream's real V4.1 encoder (``--tool-call-parser deepseekv41``: deepseek-recipe).
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


# DeepSeek-V4.1's special tokens as deepseek-recipe spells them (the checkpoint spells the image
# token <｜deepseek_image｜>, sglang's parser/deepseek_recipe_renderer.py IMAGE_TOKEN).
DSV41_SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜System｜>", "<｜User｜>", "<｜Assistant｜>",
    "<think>", "</think>", "｜DSML｜", "<｜latest_reminder｜>", "<｜deepseek_image｜>",
)


def write_tokenizer(path: Path, chat_template: str | None = SIMPLE_CHAT_TEMPLATE, model_max_length: int = 8192,
                    extra_special_tokens: tuple[str, ...] = ()) -> int:
    """A character-level fast tokenizer in ``path``; returns its vocabulary size.

    ``extra_special_tokens`` get the ids after the printable characters, in order.
    ``chat_template=None`` writes none (an encoder such as V4.1's renders the prompt).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = char_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    for special in SPECIAL_TOKENS + tuple(extra_special_tokens):
        tok.add_special_tokens([special])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": SPECIAL_TOKENS[UNK_ID], "bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
        "model_max_length": model_max_length, "add_bos_token": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size()


def _llama_config(vocab: int, hidden: int, intermediate: int, heads: int, kv_heads: int, layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_hidden_layers": layers, "vocab_size": vocab,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "tie_word_embeddings": False,
    }


# Greedy successor of each character under write_cycle_llama's weights; any other token -> "a".
CYCLES = ("012", "abcdefghijklmnopqrstuvwxyz")


def cycle_successor(vocab: dict[str, int]) -> dict[int, int]:
    """token id -> the token id the cycle model emits next (greedy)."""
    nxt = {}
    for cycle in CYCLES:
        for a, b in zip(cycle, cycle[1:] + cycle[0]):
            nxt[vocab[a]] = vocab[b]
    return {t: nxt.get(t, vocab["a"]) for t in vocab.values()}


def write_cycle_llama(path: Path, dsv41_tokens: bool = False) -> Path:
    """A one-layer Llama whose greedy next token depends only on the current one (``CYCLES``).

    Embeddings are one-hot (hidden size >= vocabulary), attention's and the MLP's output
    projections are zero, so the last hidden state is the current token's embedding;
    ``lm_head`` row ``b`` is the sum of the embeddings of ``b``'s predecessors. Every logit is
    exactly 0 but the successor's (about sqrt(hidden) after the final norm): no rounding can
    change the greedy choice. Served without ``--load-format dummy``.
    """
    import torch
    from safetensors.torch import save_file

    vocab_size = write_tokenizer(path, chat_template=None if dsv41_tokens else SIMPLE_CHAT_TEMPLATE,
                                 extra_special_tokens=DSV41_SPECIAL_TOKENS if dsv41_tokens else ())
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab()
    hidden, heads, kv_heads, inter = 128, 4, 2, 128
    assert vocab_size <= hidden, (vocab_size, hidden)
    head_dim = hidden // heads
    config = _llama_config(vocab_size, hidden, inter, heads, kv_heads, 1)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    bf16 = torch.bfloat16
    embed = torch.zeros(vocab_size, hidden, dtype=bf16)
    embed[torch.arange(vocab_size), torch.arange(vocab_size)] = 1
    head = torch.zeros(vocab_size, hidden, dtype=bf16)
    for a, b in cycle_successor(vocab).items():
        head[b, a] = 1
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):  # q/k/v and the MLP's inputs: any values, their outputs are projected to zero
        return (torch.randn(*shape, generator=gen) * 0.05).to(bf16)

    p = "model.layers.0."
    weights = {
        "model.embed_tokens.weight": embed, "lm_head.weight": head,
        "model.norm.weight": torch.ones(hidden, dtype=bf16),
        p + "input_layernorm.weight": torch.ones(hidden, dtype=bf16),
        p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=bf16),
        p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim, dtype=bf16),
        p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
        p + "mlp.down_proj.weight": torch.zeros(hidden, inter, dtype=bf16),
    }
    save_file(weights, str(path / "model.safetensors"))
    return path


def write_tiny_llama(path: Path) -> Path:
    """A two-layer Llama of hidden size 64, served with ``--load-format dummy`` (random weights)."""
    vocab = write_tokenizer(path)
    (path / "config.json").write_text(json.dumps(_llama_config(vocab, 64, 128, 4, 2, 2), indent=1))
    return path
