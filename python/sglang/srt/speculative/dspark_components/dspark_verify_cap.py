"""DSpark verify cap: a per-request number of verified drafts inside the static verify.

The verify keeps its [bs, gamma + 1] layout; each request gets a live length L = 1 + k that caps
acceptance on every accept path, gives sampled rows q = 0 past k (an exact sample of a verify
with k drafts) and gives rows >= L the anchor row's experts. k is decided on TP rank 0 and
broadcast. How, and what is refused: docs/verify-cap.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from typing import Optional

import msgspec
import torch

logger = logging.getLogger(__name__)

ACCEPTED_FORMS = (
    "K (an integer 1..gamma: verify K drafts every step), "
    "conf:T (one threshold in [0, 1] on the running product of the confidence head's "
    "per-position survival), or conf:t2,...,tgamma (one threshold per draft 2..gamma)"
)
# Requests the live buffer covers: the verify graphs' largest batch is far below.
FLAG = "--speculative-dspark-verify-cap"
MAX_REQUESTS = 1024
# targets whose forward enters the cap's router scope (the live lengths reach every router)
CAP_TARGETS = ("DeepseekV4ForCausalLM",)


class VerifyCapSpec(msgspec.Struct, frozen=True):
    """The flag's parsed value, held by the server arguments (``str``: the flag's form)."""

    fixed: Optional[int] = None
    thresholds: Optional[tuple[float, ...]] = (
        None  # one value, or one per draft 2..gamma
    )

    def __str__(self) -> str:
        if self.thresholds is None:
            return str(self.fixed)
        return "conf:" + ",".join(str(t) for t in self.thresholds)


def verify_cap_spec(value) -> VerifyCapSpec:
    """The cap --speculative-dspark-verify-cap's text names; ArgumentTypeError listing the forms."""
    text = str(value).strip()
    try:
        if text.startswith("conf:"):
            vals = tuple(float(v) for v in text[len("conf:") :].split(","))
            if not vals or any(not (0.0 <= v <= 1.0) for v in vals):
                raise ValueError("thresholds must lie in [0, 1]")
            return VerifyCapSpec(thresholds=vals)
        k = int(text)
        if k < 1:
            raise ValueError("K must be >= 1")
        return VerifyCapSpec(fixed=k)
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"invalid --speculative-dspark-verify-cap {value!r} ({e}); accepted forms: "
            f"{ACCEPTED_FORMS}"
        ) from None


def parse_verify_cap(value) -> VerifyCapSpec:
    """type_parser of the flag: the value every reader uses, parsed once (gamma is checked
    after resolution); a parsed value comes back as it is."""
    if isinstance(value, VerifyCapSpec):
        return value
    return verify_cap_spec(value)


def validate_verify_cap(server_args) -> Optional[VerifyCapSpec]:
    """The resolution hook's check (after gamma is fixed): the parsed cap, None when off; ValueError
    wherever a router would not see request-major rows or the live length."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    cap = cfg.speculative_dspark_verify_cap
    cap_min = cfg.speculative_dspark_verify_cap_min
    log_path = cfg.speculative_dspark_verify_cap_log
    algorithm = cfg.speculative_algorithm
    if cap is None:
        if cap_min is not None or log_path:
            raise ValueError(
                "--speculative-dspark-verify-cap-min / --speculative-dspark-verify-cap-log "
                "need --speculative-dspark-verify-cap; add it (e.g. conf:0.1) or drop them."
            )
        return None
    if algorithm != "DSPARK":
        raise ValueError(
            "--speculative-dspark-verify-cap needs --speculative-algorithm DSPARK "
            f"(got {algorithm!r}); drop the flag."
        )
    if not isinstance(cap, VerifyCapSpec):  # Engine(...) bypasses argparse
        from sglang.srt.arg_groups.overrides import declare_resolution

        cap = parse_verify_cap(cap)
        declare_resolution(
            server_args, "validate_verify_cap", speculative_dspark_verify_cap=cap
        )
    spec = cap
    gamma = int(cfg.speculative_num_draft_tokens) - 1
    if spec.fixed is not None and not (1 <= spec.fixed <= gamma):
        raise ValueError(
            f"--speculative-dspark-verify-cap {cap}: K must be in 1..gamma (gamma={gamma}); "
            f"use a K in 1..{gamma}."
        )
    if spec.thresholds is not None and len(spec.thresholds) not in (1, gamma - 1):
        raise ValueError(
            f"--speculative-dspark-verify-cap {cap}: give one threshold or gamma - 1 = "
            f"{gamma - 1} (drafts 2..{gamma}), got {len(spec.thresholds)}; use one, e.g. "
            f"conf:{spec.thresholds[0]}."
        )
    if cap_min is not None and spec.thresholds is None:
        raise ValueError(
            "--speculative-dspark-verify-cap-min is the fewest drafts a conf: cap verifies; "
            f"with the fixed cap {cap} every request verifies {spec.fixed}; drop "
            "--speculative-dspark-verify-cap-min."
        )
    cap_min = 1 if cap_min is None else int(cap_min)
    if not (1 <= cap_min <= gamma):
        raise ValueError(
            f"--speculative-dspark-verify-cap-min must be in 1..gamma (gamma={gamma}), "
            f"got {cap_min}; use one in 1..{gamma}."
        )
    if log_path and spec.thresholds is None:
        raise ValueError(
            "--speculative-dspark-verify-cap-log records the confidence stopping rule; "
            "it needs a conf: cap (e.g. conf:0.1); drop the log with a fixed cap."
        )
    log_dir = os.path.dirname(os.path.abspath(log_path)) if log_path else None
    if log_dir is not None and not (
        os.path.isdir(log_dir) and os.access(log_dir, os.W_OK)
    ):
        raise ValueError(
            f"--speculative-dspark-verify-cap-log {log_path}: {log_dir} is not a writable directory; "
            "create it or log elsewhere."
        )
    from sglang.srt.speculative.ragged_verify import read_ragged_verify_mode

    ragged_mode = read_ragged_verify_mode().value
    if ragged_mode != "static":
        raise ValueError(
            "--speculative-dspark-verify-cap runs inside the static verify layout; it "
            f"needs SGLANG_RAGGED_VERIFY_MODE=static (got {ragged_mode!r}); set it, or drop "
            "the cap."
        )
    if cfg.attn_dp_size > 1:
        raise ValueError(
            "--speculative-dspark-verify-cap needs the verify rows of one rank in the "
            f"MoE (request-major); found attn_dp_size {cfg.attn_dp_size}: drop dp attention or "
            "the cap."
        )
    from sglang.srt.arg_groups.model_override_base import model_config_of

    target_arch = model_config_of(server_args).hf_config.architectures[0]
    if target_arch not in CAP_TARGETS:
        raise ValueError(
            f"--speculative-dspark-verify-cap: the target is {target_arch}; only "
            f"{', '.join(CAP_TARGETS)} routes its verify rows by live length (elsewhere the cap "
            "would only shorten acceptance); drop the flag."
        )
    if cfg.moe_a2a_backend not in (None, "none") and cfg.tp_size > 1:
        raise ValueError(
            f"--speculative-dspark-verify-cap cannot be used with --moe-a2a-backend "
            f"{cfg.moe_a2a_backend} at tp {cfg.tp_size}: the backend scatters the verify rows over the "
            "attention-TP ranks before the router, so a rank's rows are not request-major; use "
            "--moe-a2a-backend none or drop the cap."
        )
    if str(cfg.device).startswith("npu"):
        raise ValueError(
            f"--speculative-dspark-verify-cap: the NPU top-k route does not take the live "
            f"length (found --device {cfg.device}); drop the flag."
        )
    max_running = cfg.max_running_requests
    if max_running is not None and max_running > MAX_REQUESTS:
        raise ValueError(
            f"--speculative-dspark-verify-cap holds one live length per request for at most "
            f"{MAX_REQUESTS} requests; --max-running-requests is {max_running}: set it to at "
            f"most {MAX_REQUESTS}."
        )
    return spec


def threshold_vector(spec: VerifyCapSpec, gamma: int) -> torch.Tensor:
    """Per-draft threshold [gamma]; draft 1 is always verified (threshold 0)."""
    thr = spec.thresholds
    vals = [thr[0]] * gamma if len(thr) == 1 else [0.0, *thr]
    return torch.tensor(vals[:gamma], dtype=torch.float32)


def drafts_from_confidence(
    confidence: torch.Tensor, thresholds: torch.Tensor, k_min: int
) -> torch.Tensor:
    """k [bs]: leading drafts whose running product of survival stays >= threshold (draft i's
    decision reads drafts < i only)."""
    gamma = confidence.shape[1]
    survive = torch.cumprod(confidence.float().clamp(0.0, 1.0), dim=1)
    keep = (survive >= thresholds.to(survive.device)).to(torch.int64)
    k = keep.cumprod(dim=1).sum(dim=1)
    return k.clamp(min=int(k_min), max=gamma)


def mask_dead_draft_probs(
    draft_probs: torch.Tensor, live_lens: torch.Tensor
) -> torch.Tensor:
    """q = 0 for drafts past each request's live length ([bs, gamma, V] -> new tensor)."""
    gamma = draft_probs.shape[1]
    pos = torch.arange(gamma, device=draft_probs.device)
    alive = pos[None, :] < (live_lens.to(draft_probs.device)[:, None] - 1)
    return draft_probs * alive[:, :, None].to(draft_probs.dtype)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class VerifyCap:
    """The cap's state: the live-length buffer (int64, L = 1 + k) read by address."""

    def __init__(
        self,
        *,
        spec: VerifyCapSpec,
        gamma: int,
        k_min: int = 1,
        log_path: Optional[str] = None,
        device=None,
        tp_group=None,
    ) -> None:
        assert (
            not _capturing()
        ), "DSpark verify cap: the live-length buffer must exist before graph capture"
        self.spec = spec
        self.gamma = int(gamma)
        self.stride = self.gamma + 1
        self.k_min = int(k_min)
        self._tp_group = tp_group
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.live = torch.full(
            (MAX_REQUESTS,),
            self.stride if spec.fixed is None else 1 + spec.fixed,
            dtype=torch.int64,
            device=device,
        )
        self.thresholds = (
            None
            if spec.thresholds is None
            else threshold_vector(spec, self.gamma).to(self.live.device)
        )
        self._log_path = log_path
        self._log = None
        self._warned_no_conf = False

    @property
    def needs_confidence(self) -> bool:
        return self.thresholds is not None

    def begin_step(self, bs: int, confidence: Optional[torch.Tensor]) -> None:
        """Before the target verify: this step's live lengths (rank 0's, on every rank)."""
        if self.thresholds is None:
            return  # fixed K: constant buffer, identical on every rank
        if confidence is None:
            if not self._warned_no_conf:
                self._warned_no_conf = True
                logger.warning(
                    "DSpark verify cap: the draft gave no confidence this step; "
                    "verifying every draft."
                )
            self.live[:bs].fill_(self.stride)
            return
        k = drafts_from_confidence(
            confidence[:bs, : self.gamma], self.thresholds, self.k_min
        )
        self.live[:bs].copy_(k + 1)
        group = self._group()
        if group is not None and group.world_size > 1:
            # The head's input comes out of an all-reduce whose last bits may differ
            # between ranks; one verify row must see one expert set on all ranks.
            group.broadcast(self.live[:bs], src=0)

    def _group(self):
        if self._tp_group is None:
            from sglang.srt.runtime_context import get_parallel

            try:
                self._tp_group = get_parallel().tp_group
            except (
                RuntimeError
            ):  # no parallel state in this process (CPU unit tests): one rank
                return None
        return self._tp_group

    def cutoff(self, bs: int) -> torch.Tensor:
        return self.live[:bs]

    def router_scope(self, forward_batch):
        """Around the target's forward: in a target verify, the routers route dead rows as
        their anchor (``router_live_rows``); elsewhere they run upstream's code."""
        # Imported here: server-argument parsing imports this module, and the MoE package is heavy.
        from sglang.srt.layers.moe.router_live_rows import LiveRows, live_rows_scope

        if not forward_batch.forward_mode.is_target_verify():
            return live_rows_scope(None)
        return live_rows_scope(LiveRows(self.live, self.stride, FLAG))

    def log_step(
        self, confidence: Optional[torch.Tensor], correct_len: torch.Tensor
    ) -> None:
        """Rank 0: per request [confidence (gamma), live length, accepted drafts] as float32.
        Costs a device sync per step (measurement only)."""
        if not self._log_path or confidence is None:
            return
        if self._log is None:
            group = self._group()
            rank0 = group is None or group.rank_in_group == 0
            self._log = open(self._log_path, "ab") if rank0 else False
        if not self._log:
            return
        bs = correct_len.shape[0]
        rec = torch.cat(
            [
                confidence[:bs, : self.gamma].float(),
                self.live[:bs].float().unsqueeze(1),
                correct_len[:bs].float().unsqueeze(1),
            ],
            dim=1,
        )
        self._log.write(rec.cpu().numpy().astype("float32").tobytes())
        self._log.flush()


def build_verify_cap(spec, *, device=None, target_model=None) -> Optional[VerifyCap]:
    """The cap from the resolved spec arguments (the flag's parsed value), handed to
    ``target_model``; None when off."""
    value = spec.speculative_dspark_verify_cap
    if value is None:
        return None
    if target_model is not None and not hasattr(target_model, "verify_cap"):
        raise ValueError(
            f"{FLAG}: the target model {type(target_model).__name__} does not hold a "
            f"verify cap (only {', '.join(CAP_TARGETS)} routes its verify rows by live length)."
        )
    gamma = int(spec.speculative_num_draft_tokens) - 1
    cap = VerifyCap(
        spec=value,
        gamma=gamma,
        k_min=int(spec.speculative_dspark_verify_cap_min or 1),
        log_path=spec.speculative_dspark_verify_cap_log,
        device=device,
    )
    logger.info(
        "DSpark verify cap on (%s, min %d, gamma %d): acceptance capped per request, "
        "dead verify rows route to the anchor's experts%s",
        value,
        cap.k_min,
        gamma,
        f", per-step log {cap._log_path}" if cap._log_path else "",
    )
    if target_model is not None:
        target_model.verify_cap = cap
    return cap


def verify_cap_needs_confidence(value: Optional[VerifyCapSpec]) -> bool:
    """Whether the flag's parsed value is a conf: stopping rule (it needs the draft's
    confidence head)."""
    return value is not None and value.thresholds is not None


def verify_cap_cutoff(
    cap: Optional[VerifyCap], bs: int, cutoff: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """The accept's cutoff lengths: ``cutoff``, else the cap's live lengths, else None."""
    if cutoff is not None or cap is None:
        return cutoff
    return cap.cutoff(bs)


def verify_cap_router_scope(cap: Optional[VerifyCap], forward_batch):
    """The target model's forward runs in this scope, with the cap the model holds."""
    return contextlib.nullcontext() if cap is None else cap.router_scope(forward_batch)
