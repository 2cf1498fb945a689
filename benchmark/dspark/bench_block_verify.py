"""Block vs token-wise verification on the same draws: mean accepted drafts and emitted tokens
per step, gamma = 5, synthetic draft/target pairs at several divergences (target logits
z * 2, draft logits z * 2 + sigma * noise, vocab 4096, independent rows), the kernel's
decisions reproduced by its torch twin (chain_verify_ref) from the same uniforms. With a
verify cap K = 3: the block rule with q = 0 past the live length (ours) vs upstream's trim
after acceptance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark/: harness.py

from chain_verify_ref import chain_verify_ref  # noqa: E402
from harness import parse_args, report  # noqa: E402

from sglang.srt.speculative.dspark_components.dspark_verify_cap import (  # noqa: E402
    mask_dead_draft_probs,
)

GAMMA, VOCAB, ROWS = 5, 4096, 20000


def main() -> None:
    args = parse_args(__doc__)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for sigma in (0.25, 0.5, 1.0, 1.5, 2.0, 3.0):
        z = torch.randn((ROWS, GAMMA + 1, VOCAB), device=dev, generator=g) * 2
        target = torch.softmax(z, -1)
        draft = torch.softmax(
            z[:, :GAMMA]
            + sigma * torch.randn((ROWS, GAMMA, VOCAB), device=dev, generator=g),
            -1,
        )
        cand = torch.zeros((ROWS, GAMMA + 1), dtype=torch.int64, device=dev)
        cand[:, 1:] = torch.multinomial(draft.view(-1, VOCAB), 1, generator=g).view(
            ROWS, GAMMA
        )
        u = torch.rand((ROWS, GAMMA), device=dev, generator=g)
        uf = torch.rand((ROWS,), device=dev, generator=g)
        kw = dict(candidates=cand, target_probs=target, uniforms=u, uniforms_final=uf)
        n_tok, _ = chain_verify_ref(draft_probs=draft, block_verification=False, **kw)
        n_blk, _ = chain_verify_ref(draft_probs=draft, block_verification=True, **kw)
        live = torch.full((ROWS,), 4, device=dev)
        n_cap, _ = chain_verify_ref(
            draft_probs=mask_dead_draft_probs(draft, live),
            block_verification=True,
            **kw,
        )
        n_trim = n_blk.clamp(max=3)
        rows.append(
            {
                "sigma": sigma,
                "token_accepted": float(n_tok.float().mean()),
                "block_accepted": float(n_blk.float().mean()),
                "block_minus_token": float((n_blk - n_tok).float().mean()),
                "block_gain_pct": float(
                    100 * ((n_blk + 1).float().mean() / (n_tok + 1).float().mean() - 1)
                ),
                "k3_block_q0": float(n_cap.float().mean()),
                "k3_block_trim_after": float(n_trim.float().mean()),
            }
        )
    report(
        "block_verify",
        list(rows[0]),
        rows,
        args.out,
        {
            "gamma": GAMMA,
            "vocab": VOCAB,
            "rows": ROWS,
            "what": "mean accepted drafts per step (emitted = accepted + 1), same draws for every rule",
        },
        overwrite=args.overwrite,
    )


if __name__ == "__main__":
    main()
