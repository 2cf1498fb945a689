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


# DeepSeek-V4 / V4.1's special tokens as deepseek-recipe (upstream's chat encoder for the models,
# loaded by the HTTP server) spells them; it refuses a tokenizer without them. The checkpoint spells
# the image token <｜deepseek_image｜> (sglang's parser/deepseek_recipe_renderer.py IMAGE_TOKEN).
DEEPSEEK_SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜System｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜latest_reminder｜>",
    "<｜deepseek_image｜>",
    "<｜image｜>",
    "<｜ref｜>",
    "<｜/ref｜>",
    "<｜box｜>",
    "<｜/box｜>",
    "<｜point｜>",
    "<｜/point｜>",
    "<｜polygon｜>",
    "<｜/polygon｜>",
)


def write_tokenizer(
    path: Path,
    chat_template: str | None = SIMPLE_CHAT_TEMPLATE,
    model_max_length: int = 8192,
    extra_special_tokens: tuple[str, ...] = (),
    vocab_size: int | None = None,
) -> int:
    """A character-level fast tokenizer in ``path``; returns its vocabulary size.

    ``vocab_size`` pads the vocabulary with ``<extra_i>`` tokens after the printable characters,
    so that every id a model of that vocabulary can emit decodes; ``extra_special_tokens`` take
    the last ids, in order. ``chat_template=None`` writes none (an encoder such as V4.1's
    renders the prompt).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = char_vocab()
    for i in range(len(vocab), (vocab_size or 0) - len(extra_special_tokens)):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    for special in SPECIAL_TOKENS + tuple(extra_special_tokens):
        tok.add_special_tokens([special])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "model_max_length": model_max_length,
        "add_bos_token": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size()


def _llama_config(
    vocab: int, hidden: int, intermediate: int, heads: int, kv_heads: int, layers: int
) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
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

    vocab_size = write_tokenizer(
        path,
        chat_template=None if dsv41_tokens else SIMPLE_CHAT_TEMPLATE,
        extra_special_tokens=DEEPSEEK_SPECIAL_TOKENS if dsv41_tokens else (),
    )
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

    def rand(
        *shape,
    ):  # q/k/v and the MLP's inputs: any values, their outputs are projected to zero
        return (torch.randn(*shape, generator=gen) * 0.05).to(bf16)

    p = "model.layers.0."
    weights = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": head,
        "model.norm.weight": torch.ones(hidden, dtype=bf16),
        p + "input_layernorm.weight": torch.ones(hidden, dtype=bf16),
        p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=bf16),
        p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        p
        + "self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim, dtype=bf16),
        p + "mlp.gate_proj.weight": rand(inter, hidden),
        p + "mlp.up_proj.weight": rand(inter, hidden),
        p + "mlp.down_proj.weight": torch.zeros(hidden, inter, dtype=bf16),
    }
    save_file(weights, str(path / "model.safetensors"))
    return path


def write_tiny_llama(path: Path) -> Path:
    """A two-layer Llama of hidden size 64, served with ``--load-format dummy`` (random weights)."""
    vocab = write_tokenizer(path)
    (path / "config.json").write_text(
        json.dumps(_llama_config(vocab, 64, 128, 4, 2, 2), indent=1)
    )
    return path


# ---------------------------------------------------------------------------- DeepSeek-V4 + DSpark
#
# Written in the original DeepSeek-V4 checkpoint naming (``embed``, ``layers.N.attn.wq_a``,
# ``mtp.0.markov_head.embed``, ...), which the engine's loaders remap, with the DSpark draft
# bundled under ``mtp.*`` and announced by the ``dspark_*`` config keys. Weights are bf16 except
# ``wo_a``, stored as e4m3 with one power-of-two scale per 32 x 32 block (as DeepSeek-V4.1 ships
# it): the loader dequantizes it to bf16, so the wo_a fp8 twin finds an exact twin in every layer.

# FlashMLA's sparse decode takes 64 or 128 query heads and sglang pads only at attention-TP > 1,
# so both checkpoints keep DeepSeek-V4.1-Flash's attention at TP1: 64 heads in 8 output groups
# (wo_a at G = 8, 4096 wide). The tiny one shrinks everything else.
TINY_DSV4 = dict(
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=64,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_lora_rank=1024,
    o_groups=8,
    moe_intermediate_size=256,
    n_routed_experts=8,
    num_experts_per_tok=2,
    vocab_size=128,
    markov_rank=64,
    gamma=5,
    draft_stages=1,
)
# The tiny checkpoint with DeepSeek-V4-Flash's attention layout (its ``compress_ratios`` start
# 0, 0, then alternate 4 and 128; the draft's layers are sliding-window only): layers 0 and 1
# sliding-window attention, layer 2 compressed 4:1 with the C4 indexer (top-512 of the compressed
# entries: it selects only past 2,048 tokens of context), layer 3 compressed 128:1.
LONG_DSV4 = dict(TINY_DSV4, compress_ratios=[0, 0, 4, 128])
# The long checkpoint's draft agrees with its target in runs of 2 and 3 tokens (accepts and
# rejections, so the compressed state is rolled back after rejected drafts).
LONG_DRAFT_RUNS = (2, 3)
# DeepSeek-V4.1-Flash's shapes at TP1 (hidden, heads, lora ranks, o_groups, expert width, vocab)
# with few layers and experts and three draft stages, random weights: for timing.
REAL_SHAPE_DSV4 = dict(
    hidden_size=5120,
    num_hidden_layers=4,
    num_attention_heads=64,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1280,
    o_lora_rank=1024,
    o_groups=8,
    moe_intermediate_size=2304,
    n_routed_experts=8,
    num_experts_per_tok=6,
    vocab_size=129280,
    markov_rank=256,
    gamma=5,
    draft_stages=3,
)
# DeepSeek-V4.1-Flash's widths at TP1 at full depth (43 layers, 3 draft stages), few experts: the
# side-by-side decode timing (``e2e.side_by_side``). Dense linears (attention's wq_a, wkv, wq_b, wo_b,
# the shared expert, the draft's main_proj) ship as e4m3 in 32 x 32 blocks with power-of-two scales
# under a ``quantization_config`` as DeepSeek-V4.1 ships them (``fp8_quantization_config``); wo_a as
# e4m3 with 32 x 32 power-of-two scales (the loader dequantizes it to bf16, as upstream does for
# every DeepSeek-V4 checkpoint); the 8 routed experts as e4m3 32 x 32 blocks too (``experts``:
# "fp8"), or bf16 left out of the quantization (``experts``: "bf16", the format the harness served
# before). The DeepSeek-V4 architecture (no Engram): the V4.1 rows have not been served on the H200.
# About 23 GB with fp8 experts (13 GB of it the experts), written in ``shards`` files.
FULL_DEPTH_DSV4 = dict(
    REAL_SHAPE_DSV4,
    num_hidden_layers=43,
    dense_fp8=True,
    experts="fp8",
    shards=8,
)
# The full-depth checkpoint's draft agrees with its target along runs of 2 and 3 tokens of the
# successor cycle (``write_dsv4(..., draft_runs=...)``): greedy requests accept about 2.5 drafts
# per verify step.
FULL_DEPTH_DRAFT_RUNS = (2, 3)
FP8_BLOCK = 32
MASK_TOKEN_ID = len(char_vocab())  # the draft's mask token: the first <extra_i> token
# The Engram layers of the tiny DeepSeek-V4.1 checkpoint (``write_dsv4(..., engram=TINY_ENGRAM)``):
# two layers, n-grams of 2 to 4 tokens with 4 hash heads each (upstream's hash kernel takes powers
# of two for both), 32-wide fp8 rows (one e8m0 scale per row), tables of ~7,000 rows.
TINY_ENGRAM = dict(
    layer_ids=[1, 2],
    max_ngram_size=4,
    n_heads=4,
    head_dim=32,
    vocab_size=512,
    pad_token_id=EOS_ID,
)


def dsv4_config(shape: dict) -> dict:
    layers, stages = shape["num_hidden_layers"], shape["draft_stages"]
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": shape["vocab_size"],
        "hidden_size": shape["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": 1,
        "head_dim": shape["head_dim"],
        "qk_rope_head_dim": shape["qk_rope_head_dim"],
        "q_lora_rank": shape["q_lora_rank"],
        "o_lora_rank": shape["o_lora_rank"],
        "o_groups": shape["o_groups"],
        "moe_intermediate_size": shape["moe_intermediate_size"],
        "n_routed_experts": shape["n_routed_experts"],
        "n_shared_experts": 1,
        "num_experts_per_tok": shape["num_experts_per_tok"],
        "n_group": 1,
        "topk_group": 1,
        "num_hash_layers": 1,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        # Sliding-window attention only unless the shape names its layers' ratios (the draft's
        # layers are sliding-window in any case): the flash_mla sparse decode path with window
        # indices; ratio 4 adds the C4 indexer (the harness keeps it off DeepGEMM).
        "compress_ratios": compress_ratios(shape) + [0] * stages,
        "window_size": 128,
        "sliding_window": 128,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000,
        "compress_rope_theta": 40000,
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 4,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 1024,
        },
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "num_nextn_predict_layers": stages,
        "dspark_block_size": shape["gamma"],
        "dspark_noise_token_id": MASK_TOKEN_ID,
        "dspark_target_layer_ids": list(range(layers - stages, layers)),
        "dspark_markov_rank": shape["markov_rank"],
        "dspark_n_routed_experts": shape["n_routed_experts"],
        "dspark_num_experts_per_tok": shape["num_experts_per_tok"],
        **(
            {"quantization_config": fp8_quantization_config(shape)}
            if shape.get("dense_fp8")
            else {}
        ),
    }


def compress_ratios(shape: dict) -> list[int]:
    """The target layers' compress ratios: the shape's ``compress_ratios`` (0, 4 or 128 each, as
    DeepSeek-V4 serves them) or 0 for every layer."""
    layers = shape["num_hidden_layers"]
    ratios = list(shape.get("compress_ratios", [0] * layers))
    if len(ratios) != layers or set(ratios) - {0, 4, 128}:
        raise ValueError(
            f"compress_ratios: one of 0, 4, 128 per target layer ({layers}), not {ratios!r}"
        )
    return ratios


def fp8_quantization_config(shape: dict) -> dict:
    """DeepSeek-V4.1's block-fp8 ``quantization_config``: e4m3 weights in 32 x 32 blocks, one
    power-of-two fp32 scale per block (``scale_fmt`` ue8m0, stored as ``<name>.scale``, which
    upstream's loader renames to ``weight_scale_inv``), activations quantized per token and group
    of 32 at run time. Upstream's ``Fp8Config.from_config`` reads it; wo_a needs 128 x 128 blocks
    for its fp8 GEMM, so upstream dequantizes it to bf16 at load. Experts kept in bf16
    (``experts`` "bf16") are named in ``modules_to_not_convert``."""
    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }
    if shape.get("experts", "fp8") == "bf16":
        config["modules_to_not_convert"] = ["mlp.experts"]
    elif shape.get("experts") != "fp8":
        raise ValueError(f"experts: 'fp8' or 'bf16', not {shape.get('experts')!r}")
    return config


def engram_layout(engram: dict):
    """Upstream's Engram layout (``sglang.srt.layers.engram.EngramLayout``) of ``engram``'s sizes:
    the primes, hence every table's row count, are upstream's."""
    from types import SimpleNamespace

    from sglang.srt.layers.engram import EngramLayout

    return EngramLayout.from_config(
        SimpleNamespace(
            engram_layer_ids=list(engram["layer_ids"]),
            engram_num_embeddings=[],
            engram_max_ngram_size=engram["max_ngram_size"],
            engram_vocab_size=engram["vocab_size"],
            engram_n_heads=engram["n_heads"],
            engram_head_dim=engram["head_dim"],
        )
    )


def compressed_vocab_size(path: Path) -> int:
    """The number of distinct tokens upstream's Engram hasher normalizes the tokenizer in ``path``
    to (``build_compressed_token_map``); the config must state it (the hasher asserts it).
    """
    from transformers import AutoTokenizer

    from sglang.srt.layers.engram import build_compressed_token_map

    return build_compressed_token_map(AutoTokenizer.from_pretrained(path))[1]


def dsv41_config(shape: dict, engram: dict, compressed_vocab: int) -> dict:
    """``dsv4_config`` as a DeepSeek-V4.1 config: ``model_type`` deepseek_v41 (upstream's
    ``DeepseekV41Config``), the hyper-connection pre-mix predicted from the previous sublayer, no
    per-head query norm, and the Engram layers' fields."""
    layout = engram_layout(engram)
    config = dsv4_config(shape)
    config.update(
        model_type="deepseek_v41",
        hc_pre_from_prev_sublayer=True,
        q_head_norm=False,
        vision_n_layers=0,
        engram_layer_ids=list(layout.layer_ids),
        engram_num_embeddings=[
            layout.column_bounds(i)[-1] for i in range(len(layout.layer_ids))
        ],
        engram_max_ngram_size=layout.max_ngram_size,
        engram_vocab_size=engram["vocab_size"],
        engram_n_heads=layout.n_heads,
        engram_head_dim=layout.head_dim,
        engram_pad_token_id=engram["pad_token_id"],
        engram_compressed_vocab_size=compressed_vocab,
    )
    return config


def _e4m3_blocks(w, block: int = 32):
    """``w`` (bf16) as e4m3 + one power-of-two fp32 scale per ``block`` x ``block`` tile, exact in bf16."""
    import torch

    n, k = w.shape
    tiles = w.float().view(n // block, block, k // block, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(2.0**-60)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(n, k), scale


class _Weights:
    """Draws a checkpoint's tensors; ``agree`` builds the weights described in ``write_dsv4``."""

    def __init__(self, shape: dict, agree: bool, seed: int, device: str):
        import torch

        self.torch, self.shape, self.agree, self.device = torch, shape, agree, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.tensors: dict = {}

    def randn(self, *size, std: float = 1.0, dtype=None):
        t = self.torch.randn(*size, generator=self.gen, device=self.device) * std
        return t.to(dtype or self.torch.bfloat16)

    def linear(self, name: str, out: int, inp: int, out_proj: bool = False):
        # In the agreeing checkpoint the projections that write the residual stream are tiny, so the
        # stream keeps carrying the token embedding while every kernel still runs on real numbers.
        std = (1e-3 if (self.agree and out_proj) else 1.0) / inp**0.5
        self.tensors[name + ".weight"] = self.randn(out, inp, std=std)

    def fp8_linear(self, name: str, out: int, inp: int, out_proj: bool = False):
        std = (1e-3 if (self.agree and out_proj) else 1.0) / inp**0.5
        q, scale = _e4m3_blocks(self.randn(out, inp, std=std))
        self.tensors[name + ".weight"], self.tensors[name + ".scale"] = q, scale

    def dense(self, name: str, out: int, inp: int, out_proj: bool = False):
        """A linear that the quantization config covers: block fp8 when the shape ships dense
        linears in fp8 (``dense_fp8``), else bf16."""
        if self.shape.get("dense_fp8"):
            self.fp8_linear(name, out, inp, out_proj=out_proj)
        else:
            self.linear(name, out, inp, out_proj=out_proj)

    def expert(self, name: str, out: int, inp: int, out_proj: bool = False):
        if self.shape.get("dense_fp8") and self.shape.get("experts", "fp8") == "fp8":
            self.fp8_linear(name, out, inp, out_proj=out_proj)
        else:
            self.linear(name, out, inp, out_proj=out_proj)

    def norm(self, name: str, dim: int):
        self.tensors[name + ".weight"] = self.torch.ones(
            dim, dtype=self.torch.bfloat16, device=self.device
        )

    def hc(self, prefix: str, kinds=("attn", "ffn")):
        hc, dim = 4, self.shape["hidden_size"]
        mix = (2 + hc) * hc
        f32 = self.torch.float32
        for kind in kinds:
            # Agreeing: mixing weights zero, so pre = post = sigmoid(0)-ish constants and comb is the
            # uniform doubly-stochastic matrix: four equal streams stay equal.
            self.tensors[f"{prefix}hc_{kind}_fn"] = (
                self.torch.zeros(mix, hc * dim, dtype=f32, device=self.device)
                if self.agree
                else self.randn(mix, hc * dim, std=0.02, dtype=f32)
            )
            self.tensors[f"{prefix}hc_{kind}_base"] = (
                self.torch.zeros(mix, dtype=f32, device=self.device)
                if self.agree
                else self.randn(mix, std=0.5, dtype=f32)
            )
            self.tensors[f"{prefix}hc_{kind}_scale"] = self.torch.ones(
                3, dtype=f32, device=self.device
            )

    def hc_head(self, prefix: str):
        hc, dim, f32 = 4, self.shape["hidden_size"], self.torch.float32
        self.tensors[f"{prefix}hc_head_fn"] = (
            self.torch.zeros(hc, hc * dim, dtype=f32, device=self.device)
            if self.agree
            else self.randn(hc, hc * dim, std=0.02, dtype=f32)
        )
        self.tensors[f"{prefix}hc_head_base"] = self.torch.zeros(
            hc, dtype=f32, device=self.device
        )
        self.tensors[f"{prefix}hc_head_scale"] = self.torch.ones(
            1, dtype=f32, device=self.device
        )

    def engram(self, prefix: str, rows: int, config: dict):
        """One Engram layer as DeepSeek-V4.1 stores it: the hash table's e4m3 rows with one e8m0
        (power-of-two) scale per 32 values, the ``wkv`` projection of the concatenated rows to
        one key per hyper-connection stream plus the shared value, and the gate's two weights.
        """
        torch, dim, hc = self.torch, self.shape["hidden_size"], config["hc_mult"]
        head_dim = config["engram_head_dim"]
        cols = (config["engram_max_ngram_size"] - 1) * config["engram_n_heads"]
        table = self.randn(rows, head_dim, dtype=torch.float32)
        tiles = table.view(rows, head_dim // 32, 32)
        amax = tiles.abs().amax(-1).clamp_min(2.0**-60)
        scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
        self.tensors[prefix + "embed.weight"] = (
            (tiles / scale[..., None]).to(torch.float8_e4m3fn).view(rows, head_dim)
        )
        # e8m0 cast on the host: the one dtype of the checkpoint the generating device may lack
        self.tensors[prefix + "embed.scale"] = scale.cpu().to(torch.float8_e8m0fnu)
        self.linear(prefix + "wkv", dim * (hc + 1), cols * head_dim, out_proj=True)
        for name in ("q_weight", "k_weight"):
            self.tensors[prefix + name] = (
                1 + self.randn(hc, dim, std=0.1, dtype=torch.float32)
            ).to(torch.bfloat16)

    def compressor(self, prefix: str, ratio: int, head_dim: int):
        """A compressor as DeepSeek-V4 stores it: the positional bias ``ape`` (fp32, one row per
        position in a block of ``ratio``), the kv and gate projections (bf16; upstream's loader
        fuses them into ``wkv_gate``) and the fp32 norm. Ratio 4 overlaps two blocks, so its
        widths double (upstream's ``Compressor.coff``)."""
        dim, width = self.shape["hidden_size"], (1 + (ratio == 4)) * head_dim
        f32 = self.torch.float32
        self.tensors[prefix + "ape"] = self.randn(ratio, width, std=0.02, dtype=f32)
        self.linear(prefix + "wkv", width, dim)
        self.linear(prefix + "wgate", width, dim)
        self.tensors[prefix + "norm.weight"] = self.torch.ones(
            head_dim, dtype=f32, device=self.device
        )

    def indexer(self, prefix: str, config: dict):
        """The C4 indexer of a ratio-4 layer: its query projection from the q LoRA, the per-head
        weights and its own ratio-4 compressor of ``index_head_dim``-wide keys, bf16 (fp32
        ``ape`` and norm), as upstream's ``C4Indexer`` loads them."""
        heads, hd = config["index_n_heads"], config["index_head_dim"]
        self.linear(prefix + "wq_b", heads * hd, self.shape["q_lora_rank"])
        self.linear(prefix + "weights_proj", heads, self.shape["hidden_size"])
        self.compressor(prefix + "compressor.", 4, hd)

    def block(self, prefix: str, hash_vocab: int | None):
        s, dim = self.shape, self.shape["hidden_size"]
        heads, hd, groups = s["num_attention_heads"], s["head_dim"], s["o_groups"]
        self.hc(prefix)
        a = prefix + "attn."
        self.tensors[a + "attn_sink"] = self.randn(
            heads, std=0.5, dtype=self.torch.float32
        )
        self.dense(a + "wq_a", s["q_lora_rank"], dim)
        self.dense(a + "wkv", hd, dim)
        self.norm(a + "q_norm", s["q_lora_rank"])
        self.norm(a + "kv_norm", hd)
        self.dense(a + "wq_b", heads * hd, s["q_lora_rank"])
        self.fp8_linear(a + "wo_a", groups * s["o_lora_rank"], heads // groups * hd)
        self.dense(a + "wo_b", dim, groups * s["o_lora_rank"], out_proj=True)
        self.norm(prefix + "attn_norm", dim)
        self.norm(prefix + "ffn_norm", dim)
        f = prefix + "ffn."
        experts, inter = s["n_routed_experts"], s["moe_intermediate_size"]
        self.linear(f + "gate", experts, dim)
        if (
            hash_vocab is None
        ):  # score-routed: a correction bias; hash-routed: a token -> experts table
            self.tensors[f + "gate.bias"] = self.randn(
                experts, std=0.1, dtype=self.torch.float32
            )
        else:
            pick = self.torch.rand(
                hash_vocab, experts, generator=self.gen, device=self.device
            ).argsort(dim=1)
            self.tensors[f + "gate.tid2eid"] = pick[:, : s["num_experts_per_tok"]].to(
                self.torch.int32
            )
        for e in range(experts):
            self.expert(f"{f}experts.{e}.w1", inter, dim)
            self.expert(f"{f}experts.{e}.w3", inter, dim)
            self.expert(f"{f}experts.{e}.w2", dim, inter, out_proj=True)
        self.dense(f + "shared_experts.w1", inter, dim)
        self.dense(f + "shared_experts.w3", inter, dim)
        self.dense(f + "shared_experts.w2", dim, inter, out_proj=True)


def write_dsv4(
    path: Path,
    *,
    agree: bool,
    shape: dict = TINY_DSV4,
    seed: int = 0,
    device: str = "cpu",
    target_margin: float = 6.4,
    draft_bias: float = 40.0,
    engram: dict | None = None,
    draft_runs: tuple[int, ...] | None = None,
) -> Path:
    """A DeepSeek-V4 target with a bundled DSpark draft, from ``seed``.

    ``agree=False``: random weights (the draft rarely agrees with the target). ``agree=True``: a
    checkpoint whose draft agrees with its target often, so the accept paths, caps and block
    verification really run. Every token ``t`` has a fixed successor ``succ(t)`` (one random cycle
    over the printable characters); the residual stream carries the token's embedding (mixing
    weights zero, residual-writing projections tiny), and the shared LM head maps embedding ``t``
    to ``succ(t)`` with a logit margin of about 6 (so temperature-1 sampling still spreads ~20 %
    of the mass over other tokens). The draft's Markov head adds a bias of 40 to ``succ(prev)``,
    so the draft proposes the successor chain of its anchor: greedy requests accept every draft,
    sampled ones about 80 % of drafts each.

    ``target_margin`` and ``draft_bias`` set those two numbers (the agreeing checkpoint's are the
    defaults). The sampling checkpoint takes a margin of ln(127) ~ 4.84, so the target's top token
    carries about half the mass over the 128-token vocabulary, and a draft bias of ~6.6, so the
    draft's q puts about 0.85 on it: accepts and rejections both happen, and a wrong use of q (a
    wrong temperature, the wrong logits) moves the emitted distribution. ``succ.json`` in the
    checkpoint records the successor map (token id -> its successor) the statistics read.

    ``engram`` (sizes as ``TINY_ENGRAM``) makes it a DeepSeek-V4.1 checkpoint (``dsv41_config``):
    Engram layers (``_Weights.engram``), and no ``hc_head`` tensors, target or draft (V4.1
    collapses the streams with the last sublayer's pre-mix; upstream's V4.1 modules have none).

    ``draft_runs`` (with ``agree``) makes the draft agree only in part (``draft_miss_positions``):
    along the successor cycle, runs of agreeing tokens of the given lengths, in turn, each followed
    by one token whose Markov row points at another token (the ids below the special tokens:
    ``<extra_i>`` tokens, and on a small vocabulary printable ones too), so a greedy verify step
    accepts the rest of the run its anchor starts and the bonus token then starts the next run:
    (2, 3) accepts 2 and 3 drafts in turn, about 2.5 per step
    (``draft.json`` records the runs and that figure). The shape's ``shards`` (default 1) splits
    the weights over that many safetensors files with an index (written last, so a cut-short
    write is not mistaken for a checkpoint: ``checkpoint_written``).
    """
    import torch

    vocab = write_tokenizer(
        path,
        vocab_size=shape["vocab_size"],
        extra_special_tokens=DEEPSEEK_SPECIAL_TOKENS,
    )
    assert vocab == shape["vocab_size"], (vocab, shape["vocab_size"])
    config = (
        dsv4_config(shape)
        if engram is None
        else dsv41_config(shape, engram, compressed_vocab_size(path))
    )
    (path / "config.json").write_text(json.dumps(config, indent=1))
    w = _Weights(shape, agree, seed, device)
    dim, rank = shape["hidden_size"], shape["markov_rank"]

    embed = w.randn(vocab, dim)
    head = w.randn(vocab, dim, std=1.0 / dim**0.5)
    markov_in = w.randn(vocab, rank, std=1.0 / rank**0.5)
    markov_out = w.randn(vocab, rank, std=1.0, dtype=torch.float32)
    if agree:
        printable = torch.arange(len(SPECIAL_TOKENS), len(char_vocab()), device=device)
        cycle = printable[
            torch.randperm(len(printable), generator=w.gen, device=device)
        ]
        succ = torch.arange(vocab, device=device)
        succ[cycle] = torch.roll(cycle, -1)
        unit = embed.float() / embed.float().norm(dim=1, keepdim=True)
        head = torch.zeros(vocab, dim, device=device)
        # the final norm leaves |h| ~ sqrt(dim): logit(succ(t) | t) ~ target_margin
        head[succ[cycle]] = target_margin / dim**0.5 * unit[cycle]
        head = head.to(torch.bfloat16)
        code = markov_in.float() / markov_in.float().norm(dim=1, keepdim=True)
        markov_in = code.to(torch.bfloat16)
        markov_out = torch.zeros(vocab, rank, device=device)
        proposal = succ.clone()  # the draft's greedy next token after each cycle token
        if draft_runs:
            miss = draft_miss_positions(len(cycle), draft_runs)
            spare = torch.arange(vocab - len(miss), vocab, device=device)
            spare -= len(
                DEEPSEEK_SPECIAL_TOKENS
            )  # <extra_i> tokens, not the special ones
            # on a small vocabulary a spare can be the miss token's own successor (the miss would
            # agree): the spares rotate until none is
            own = succ[cycle[miss]]
            shift = next(
                (k for k in range(len(miss)) if not (spare.roll(k) == own).any()), None
            )
            if shift is None:
                raise ValueError(f"draft_runs {draft_runs!r}: no spare tokens left")
            proposal[cycle[miss]] = spare.roll(shift)
            (path / "draft.json").write_text(
                json.dumps(
                    {
                        "draft_runs": list(draft_runs),
                        "miss_positions": miss,
                        "miss_tokens": cycle[miss].tolist(),
                        "intended_accepted_drafts_per_step": intended_acceptance(
                            len(cycle), draft_runs, shape["gamma"]
                        ),
                    }
                )
            )
        # With draft_runs a spare token can also be another token's successor (a 128-token
        # vocabulary has 6 unused ids): its row holds both anchors' codes, summed (two summands:
        # the same bits in any order), so either anchor proposes it. Assigned instead, one of the
        # two writes would win, which varies between writes of the checkpoint.
        markov_out.index_put_(
            (proposal[cycle],), draft_bias * code[cycle], accumulate=True
        )
        (path / "succ.json").write_text(json.dumps(succ.tolist()))
    w.tensors.update({"embed.weight": embed, "head.weight": head})
    w.norm("norm", dim)
    hc_head = not config.get("hc_pre_from_prev_sublayer", False)
    if hc_head:
        w.hc_head("")
    for layer in range(shape["num_hidden_layers"]):
        w.block(
            f"layers.{layer}.",
            hash_vocab=vocab if layer < config["num_hash_layers"] else None,
        )
    # drawn after every other target tensor, so a shape without compressed layers draws as before
    for layer, ratio in enumerate(
        config["compress_ratios"][: shape["num_hidden_layers"]]
    ):
        if ratio:
            w.compressor(f"layers.{layer}.attn.compressor.", ratio, shape["head_dim"])
        if ratio == 4:
            w.indexer(f"layers.{layer}.attn.indexer.", config)
    for i, layer in enumerate(config.get("engram_layer_ids", [])):
        w.engram(f"layers.{layer}.engram.", config["engram_num_embeddings"][i], config)
    stages = shape["draft_stages"]
    for stage in range(stages):
        p = f"mtp.{stage}."
        w.block(p, hash_vocab=None)
        if stage == 0:
            w.dense(p + "main_proj", dim, dim * stages)
            w.norm(p + "main_norm", dim)
        if stage == stages - 1:
            w.norm(p + "norm", dim)
            if hc_head:
                w.hc_head(p)
    w.tensors["mtp.0.markov_head.embed.weight"] = markov_in
    w.tensors["mtp.0.markov_head.head.weight"] = markov_out
    w.tensors["mtp.0.confidence_head.proj.weight"] = w.randn(
        1, dim + rank, std=2.0 / (dim + rank) ** 0.5, dtype=torch.float32
    )
    save_shards(w.tensors, path, shape.get("shards", 1))
    return path


def draft_miss_positions(cycle_len: int, runs: tuple[int, ...]) -> list[int]:
    """Positions along the successor cycle where the draft proposes another token: after each run
    of ``runs[i % len(runs)]`` agreeing positions, one miss; the tail that no full run fills
    agrees (it joins the first run across the wrap)."""
    if not runs or min(runs) < 1:
        raise ValueError(f"draft_runs: lengths >= 1, not {runs!r}")
    miss, pos, i = [], 0, 0
    while pos + runs[i % len(runs)] < cycle_len:
        pos += runs[i % len(runs)]
        miss.append(pos)
        pos, i = pos + 1, i + 1
    return miss


def intended_acceptance(
    cycle_len: int, runs: tuple[int, ...], gamma: int, tokens: int = 64
) -> float:
    """Drafts accepted per greedy verify step that ``draft_runs`` gives, simulated: from every
    start on the cycle, a request of ``tokens`` tokens (the first from the prefill), each step
    accepting the agreeing positions from its anchor up to ``gamma`` and adding the bonus token.
    """
    miss = set(draft_miss_positions(cycle_len, runs))
    accepted = steps = 0
    for start in range(cycle_len):
        pos, emitted = start, 1
        while emitted < tokens:
            k = 0
            while k < gamma and (pos + k) % cycle_len not in miss:
                k += 1
            accepted, steps = accepted + k, steps + 1
            emitted += k + 1
            pos = (pos + k + 1) % cycle_len
    return round(accepted / steps, 3)


def checkpoint_written(path: Path) -> bool:
    """A complete checkpoint is in ``path``: its one weight file, or its shards' index."""
    path = Path(path)
    return (path / "model.safetensors").exists() or (
        path / "model.safetensors.index.json"
    ).exists()


def save_shards(tensors: dict, path: Path, shards: int = 1) -> list[Path]:
    """``tensors`` (on any device) as ``model.safetensors``, or as ``shards`` files of about equal
    bytes written by one thread each (device-to-host copy and write overlap) with the standard
    ``model.safetensors.index.json``, written last."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import save_file

    path = Path(path)
    if shards <= 1:
        dest = path / "model.safetensors"
        save_file(
            {k: v.contiguous().cpu() for k, v in tensors.items()},
            str(dest),
            metadata={"format": "pt"},
        )
        return [dest]
    names = list(tensors)
    nbytes = {k: tensors[k].numel() * tensors[k].element_size() for k in names}
    total, groups, acc = sum(nbytes.values()), [[] for _ in range(shards)], 0
    for k in names:  # in order, cut at equal byte counts
        groups[min(shards - 1, acc * shards // max(total, 1))].append(k)
        acc += nbytes[k]
    groups = [g for g in groups if g]
    files = [
        path / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        for i in range(len(groups))
    ]

    def write(i: int) -> None:
        save_file(
            {k: tensors[k].contiguous().cpu() for k in groups[i]},
            str(files[i]),
            metadata={"format": "pt"},
        )

    with ThreadPoolExecutor(len(groups)) as pool:
        list(pool.map(write, range(len(groups))))
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: files[i].name for i, g in enumerate(groups) for k in g},
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return files
