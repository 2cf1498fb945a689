"""A real rebase of the series onto an older sglang release (``--to``), resolved by following
the tool's output, then ``make``, ``make check``, every kept patch exported alone and the CPU
tests on that release; records the transcript.

Runs in a fresh clone of this repository's HEAD (nothing here is touched), with the shared
wheel cache. Each stop is settled the way the tool's printout says: a conflict region
resolved in ``build/rebase/repo`` and ``git add``-ed, then ``tools/fork rebase --continue``,
or the patch dropped with ``--drop``; a patch that applies but whose contract does not hold on
the target is ported after the rebase with the patch workflow (``make tree``, a fixup,
``make refresh``). The resolutions are below, per release and one per stop, with the reason
read from the region the tool named, so a drill replays unattended. The transcript (every
command and its output, machine paths removed) goes to
``benchmark/results/rebase-drill-<release>.log``, its provenance to ``<that>.provenance.json``.

    python3 benchmark/rebase/rebase_drill.py --to 0.5.22|0.5.21 [--keep DIR] [--no-test]

Written for the pin 0.5.23 and the series at the time of the record; a series whose hunks
moved needs its resolutions reviewed (the script stops where the tool's output differs: a
stop at another patch, or regions in other files).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmark" / "results"
sys.path.insert(0, str(REPO / "tools"))
from e2e.provenance import write_sidecar  # noqa: E402


class Drill:
    def __init__(self, clone: Path, target: str):
        self.clone = clone
        self.target = target
        self.log = RESULTS / f"rebase-drill-{target}.log"
        self.lines: list[str] = []
        self.stops: list[str] = []  # "<patch>: <decision>", in order
        self.t0 = time.monotonic()
        self.current: str | None = None  # the patch the tool stopped at
        self.why_drop = ""

    def note(self, text: str) -> None:
        self.lines += [f"# {line}" for line in text.strip().splitlines()] + [""]

    def run(self, cmd: str, expect: int | None = 0, quiet_pip: bool = True) -> str:
        t0 = time.monotonic()
        r = subprocess.run(
            cmd,
            shell=True,
            cwd=self.clone,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        out = (
            (r.stdout + r.stderr)
            .replace(str(self.clone) + "/", "./")
            .replace(str(self.clone), ".")
        )
        if quiet_pip:  # the local package mirror's notices, not the tool's output
            out = "\n".join(
                line
                for line in out.splitlines()
                if not line.startswith("WARNING: Location ")
            )
        self.lines += [
            f"$ {cmd}",
            out.rstrip(),
            f"(exit {r.returncode}, {time.monotonic() - t0:.0f} s)",
            "",
        ]
        print(f"$ {cmd}\n{out[-3000:]}\n(exit {r.returncode})", flush=True)
        if "rebase --continue" in cmd and self.current:
            self.decide(self.current, "resolved")
        elif "rebase --drop" in cmd:
            names = re.findall(r"--drop (\S+)", cmd)
            refused = "fork: error:" in out
            for name in names:
                self.decide(
                    name,
                    "drop refused" if refused else f"dropped{self.why_drop}",
                )
        if "rebase --" in cmd:
            self.current = None
        if expect is not None and r.returncode != expect:
            self.save()
            sys.exit(f"drill: `{cmd}` exited {r.returncode}, expected {expect}")
        return out

    def region(self, path: str, keep) -> None:
        """Replace the first conflict region of ``path`` (in the scratch repository) with
        ``keep(head_lines, patch_lines)``."""
        f = self.clone / "build" / "rebase" / "repo" / path
        text = f.read_text().splitlines(keepends=True)
        start = next(i for i, line in enumerate(text) if line.startswith("<<<<<<< "))
        base = next(
            i for i in range(start, len(text)) if text[i].startswith("||||||| ")
        )
        mid = next(
            i for i in range(base, len(text)) if text[i].rstrip("\n") == "======="
        )
        end = next(i for i in range(mid, len(text)) if text[i].startswith(">>>>>>> "))
        text[start : end + 1] = keep(text[start + 1 : base], text[mid + 1 : end])
        f.write_text("".join(text))

    def insert(self, path: str, before: str, lines: str) -> None:
        """Insert ``lines`` before the one line of ``path`` (in the scratch repository) that
        starts with ``before``: a hunk re-homed where the target has that code."""
        f = self.clone / "build" / "rebase" / "repo" / path
        text = f.read_text().splitlines(keepends=True)
        at = [i for i, line in enumerate(text) if line.startswith(before)]
        if len(at) != 1:
            self.save()
            sys.exit(
                f"drill: {path}: {len(at)} lines start with {before!r}, expected one"
            )
        text[at[0] : at[0]] = [lines]
        f.write_text("".join(text))

    def replace(self, path: str, old: str, new: str) -> None:
        """Replace the one occurrence of ``old`` in ``path`` of ``build/tree`` (a patch's port)."""
        f = self.clone / "build" / "tree" / path
        text = f.read_text()
        if text.count(old) != 1:
            self.save()
            sys.exit(
                f"drill: {path}: {text.count(old)} occurrences of {old.splitlines()[0]!r}, expected one"
            )
        f.write_text(text.replace(old, new))

    def save(self) -> None:
        """The transcript, and beside it the provenance of the machine and commit that ran it."""
        self.log.write_text("\n".join(self.lines) + "\n")
        write_sidecar(self.log)

    def stop(self, out: str, patch: str, *files: str) -> None:
        """The tool stopped at ``patch`` naming regions in exactly these files (a file once per
        region; line numbers are not compared: they move with the series)."""
        if f"stopped at {patch}" not in out:
            self.save()
            got = re.findall(r"^stopped at (\S+)", out, re.M)
            sys.exit(
                f"drill: the tool did not stop at {patch} as recorded (it stopped at {got}); "
                "review the resolutions"
            )
        self.current = patch
        stop = out[out.index(f"stopped at {patch}") :]
        named = [n.split(":")[0] for n in re.findall(r"^  - (\S+?):? ", stop, re.M)]
        if sorted(named) != sorted(files):
            self.save()
            sys.exit(
                f"drill: {patch}: the tool named regions in {named}, the drill resolves {list(files)}"
            )

    def decide(self, patch: str, decision: str) -> None:
        self.stops.append(f"{patch.split('-')[0]}: {decision}")


DISPATCHER = "python/sglang/srt/layers/moe/token_dispatcher/standard.py"


def port_b12x_dispatch(d: Drill) -> None:
    """0018 applies to the target without a stop, but its contract at EP > 1 (upstream's dispatcher
    hands b12x local expert ids, -1 for other ranks' experts and for padding) does not hold there:
    the target inlines the keeps-global-ids list and indexes the mapping with the raw ids, so a -1 id
    aliases the mapping's last entry (test_b12x_moe's EP2 test). Port it with the patch workflow:
    0.5.23's two helpers in the target's dispatcher, the -1-keeping map only for b12x (every other
    runner maps exactly as the target does, flags off = upstream)."""
    d.note(
        "0018 (b12x MoE) applies cleanly, but at EP > 1 it relies on upstream's dispatcher keeping "
        "-1 ids (b12x's skip sentinel) when it maps global expert ids to local ones; the target indexes "
        "its mapping with the raw ids, so a -1 aliases the last entry, and has no "
        "_keeps_global_expert_ids / _map_topk_ids_to_local_experts (0.5.23's helpers, which the "
        "EP2 test drives). Port it in build/tree with a fixup of 0018: the two helpers (the "
        "keeps-global list as the target has it), the -1-keeping map only when the runner is b12x."
    )
    d.run("make tree")
    d.replace(
        DISPATCHER,
        "from sglang.srt.layers.moe.utils import (\n",
        "from sglang.srt.layers.moe.utils import (\n    MoeRunnerBackend,\n",
    )
    d.replace(
        DISPATCHER,
        "class StandardDispatcher(BaseDispatcher):\n",
        '''def _map_topk_ids_to_local_experts(
    topk_ids: torch.Tensor, local_expert_mapping: torch.Tensor
) -> torch.Tensor:
    """Map global expert ids while preserving the ``-1`` drop sentinel."""
    return torch.where(
        topk_ids < 0,
        -1,
        local_expert_mapping[topk_ids.clamp_min(0)],
    )


def _keeps_global_expert_ids(backend: MoeRunnerBackend) -> bool:
    return (
        backend.is_flashinfer_cutlass()
        or backend.is_flashinfer_cutedsl()
        or backend.is_flashinfer_trtllm()
        or backend.is_experimental_sgl_trtllm()
        or backend.is_flashinfer_trtllm_routed()
        or backend.is_hpc_ops()
        or backend.is_flashinfer_megamoe()
        or backend.is_flashinfer_mxfp4()
    )


class StandardDispatcher(BaseDispatcher):
''',
    )
    d.replace(
        DISPATCHER,
        """        self.skip_local_expert_mapping = (
            backend.is_flashinfer_cutlass()
            or backend.is_flashinfer_cutedsl()
            or backend.is_flashinfer_trtllm()
            or backend.is_experimental_sgl_trtllm()
            or backend.is_flashinfer_trtllm_routed()
            or backend.is_hpc_ops()
            or backend.is_flashinfer_megamoe()
            or self.enable_flashinfer_mxfp4_moe
        )
""",
        """        self.skip_local_expert_mapping = _keeps_global_expert_ids(backend)
        # b12x skips -1 ids (padding): they must stay -1, not alias the mapping's last entry
        self.keep_drop_sentinel = backend is MoeRunnerBackend.B12X
""",
    )
    d.replace(
        DISPATCHER,
        "                    topk_ids_local = self.local_expert_mapping[topk_output.topk_ids]\n",
        """                    topk_ids_local = (
                        _map_topk_ids_to_local_experts(
                            topk_output.topk_ids, self.local_expert_mapping
                        )
                        if self.keep_drop_sentinel
                        else self.local_expert_mapping[topk_output.topk_ids]
                    )
""",
    )
    d.run(
        "cd build/tree && git commit -q -a --fixup \"$(git log --format=%H -1 --grep='^moe: DeepSeek-V4 MXFP4 "
        f"experts on b12x')\" && GIT_SEQUENCE_EDITOR=true git rebase -q -i --autosquash upstream/{d.target} "
        "&& git log --oneline -3"
    )
    d.run("make refresh")


def stops_0522(d: Drill) -> str:
    """The stops of the rebase onto 0.5.22 and how each is settled; the last output."""
    out = d.run("make rebase TO=0.5.22", expect=2)
    d.stop(
        out,
        "0002-moe_fused_gate-optional-live-length-dead-verify",
        "python/sglang/kernels/ops/moe/moe_fused_gate.py",
    )
    d.note(
        "moe_fused_gate.py:455: the region's base is 0.5.23's SM120 top-22 fast path, which 0.5.22 "
        "does not have (its side is empty); our hunk only adds `and live_lens is None` to it. "
        "Keep 0.5.22's side."
    )
    d.region("python/sglang/kernels/ops/moe/moe_fused_gate.py", lambda head, ours: head)
    d.run(
        "git -C build/rebase/repo add python/sglang/kernels/ops/moe/moe_fused_gate.py"
    )

    out = d.run("python3 tools/fork rebase --continue", expect=1)
    d.stop(
        out,
        "0003-DSpark-per-request-verify-cap-inside",
        "python/sglang/srt/layers/moe/mega_gate.py",
        "python/sglang/srt/layers/moe/topk.py",
        "python/sglang/srt/layers/moe/topk.py",
        "python/sglang/srt/speculative/dspark_components/dspark_verify.py",
        "python/sglang/srt/speculative/dspark_components/dspark_verify.py",
        "python/sglang/srt/speculative/dspark_components/dspark_worker_v2.py",
        "python/sglang/srt/speculative/dspark_components/dspark_worker_v2.py",
    )
    d.note(
        "0003's router wiring (select_experts) and accept wiring (dspark_verify.py, "
        "dspark_worker_v2.py) sit in code 0.5.22 does not have (no static accept tail, no "
        "sampling-accept graph, select_experts without num_shared_topk_slots), and mega_gate.py "
        "is gone (modify/delete). Carrying it is a port of the feature, not a merge: drop it, as "
        "the tool offers. No patch depends on it."
    )
    out = d.run(
        "python3 tools/fork rebase --drop 0003-DSpark-per-request-verify-cap-inside",
        expect=1,
    )
    d.stop(
        out,
        "0004-dsv4-wo_a-from-an-exact-fp8",
        "python/sglang/srt/models/deepseek_v4_dspark.py",
    )
    d.note(
        "deepseek_v4_dspark.py:1091: 0.5.22's DSpark draft has no post_load_weights (its side is "
        "empty; the base is 0.5.23's method, which our hunk extends with the twin build). 0.5.22's "
        "loader calls model.post_load_weights() when a model has one: re-home the edit into a "
        "draft post_load_weights that holds only the twin build. Put it before load_weights, not at "
        "the region (before _assert_confidence_head_loaded): 0012 adds checkpoint_owner there, and "
        "two insertions at one point would make 0012 conflict when exported alone (test_export)."
    )
    dspark = "python/sglang/srt/models/deepseek_v4_dspark.py"
    d.region(dspark, lambda head, ours: head)
    _rehome_draft_twin_build(d, dspark)
    d.run("git -C build/rebase/repo add python/sglang/srt/models/deepseek_v4_dspark.py")

    out = d.run("python3 tools/fork rebase --continue", expect=1)
    d.stop(
        out,
        "0005-dspark-fence-the-folded-accept-results",
        "python/sglang/srt/speculative/dspark_components/dspark_sampling_accept_graph.py",
        "python/sglang/srt/speculative/dspark_components/dspark_verify.py",
        "python/sglang/srt/speculative/dspark_components/dspark_verify.py",
        "python/sglang/srt/speculative/dspark_components/dspark_verify.py",
        "python/sglang/srt/speculative/dspark_components/dspark_verify.py",
        "python/sglang/srt/speculative/dspark_components/dspark_worker_v2.py",
        "python/sglang/srt/speculative/dspark_components/dspark_worker_v2.py",
        "python/sglang/srt/speculative/dspark_components/dspark_worker_v2.py",
    )
    d.note(
        "0005 fences the folded accept results of 0.5.23's verify epilogue and sampling-accept "
        "region; 0.5.22 has no sampling-accept graph (modify/delete) and its epilogue's buffers "
        "differ (the regions in dspark_verify.py and dspark_worker_v2.py). 0006's trap lives in "
        "the same missing file, and its tests exercise it. Both are ports, not merges: drop "
        "both (no patch depends on either)."
    )
    out = d.run(
        "python3 tools/fork rebase --drop 0005-dspark-fence-the-folded-accept-results "
        "--drop 0006-dspark-scale-the-draft-s-sampling",
        expect=1,
    )
    d.stop(
        out,
        "0007-dspark-draft-block-logits-from-an",
        "python/sglang/srt/arg_groups/speculative_hook.py",
    )
    d.note(
        "speculative_hook.py:238: 0.5.22 has its --speculative-skip-dp-mlp-sync check where our "
        "validate_draft_head_fp8 call sits (the base is empty: both sides add lines there); keep "
        "both, ours first."
    )
    d.region(
        "python/sglang/srt/arg_groups/speculative_hook.py",
        lambda head, ours: ours + ["\n"] + head,
    )
    d.run(
        "git -C build/rebase/repo add python/sglang/srt/arg_groups/speculative_hook.py"
    )
    out = d.run("python3 tools/fork rebase --continue", expect=1)
    d.stop(
        out,
        "0008-scheduler-finish-a-request-whose-output",
        "python/sglang/srt/managers/scheduler.py",
    )
    d.note(
        "scheduler.py:2821: the base is 0.5.23's _create_generation_req extension point, which "
        "0.5.22 does not have (its side is empty); our hunk gives each new request its loop guard "
        "there. Keep 0.5.22's side and re-home the one call where 0.5.22's handler has its request "
        "(normal or session; the session-not-found branch has returned aborted): just before "
        "`if recv_req.pp_prefetch_ticketed`."
    )
    sched = "python/sglang/srt/managers/scheduler.py"
    d.region(sched, lambda head, ours: head)
    d.insert(
        sched,
        "        if recv_req.pp_prefetch_ticketed is True:",
        "        if self.loop_abort is not None:  # --enable-loop-abort\n"
        "            self.loop_abort.attach(req)\n\n",
    )
    d.run(f"git -C build/rebase/repo add {sched}")

    out = d.run("python3 tools/fork rebase --continue", expect=1)
    d.stop(
        out,
        "0009-openai-map-client-thinking-switches-onto",
        "python/sglang/srt/entrypoints/openai/serving_chat.py",
    )
    d.note(
        "serving_chat.py:1354: the base is 0.5.23's MiniMax-M3 normalization, which 0.5.22 does "
        "not have (its side is empty); our hunk adds the alias mapping after it, before the "
        "server's default chat-template kwargs fill in. Keep only our two lines."
    )
    chat = "python/sglang/srt/entrypoints/openai/serving_chat.py"
    d.region(
        chat,
        lambda head, ours: ours[
            ours.index("        if get_serving().enable_thinking_aliases:\n") :
        ],
    )
    d.run(f"git -C build/rebase/repo add {chat}")

    out = d.run("python3 tools/fork rebase --continue", expect=1)
    fast_load_files = [
        "python/sglang/srt/model_loader/loader.py",
        "python/sglang/srt/models/deepseek_v4.py",
        "python/sglang/srt/models/deepseek_v4_dspark.py",
        "python/sglang/srt/models/deepseek_v4_nextn.py",
    ]
    d.stop(
        out,
        "0012-model_loader-fast-load-read-the-checkpoint",
        "python/sglang/srt/model_loader/loader.py",
        "python/sglang/srt/models/deepseek_v4.py",
        "python/sglang/srt/models/deepseek_v4_dspark.py",
        "python/sglang/srt/models/deepseek_v4_nextn.py",
    )
    d.note(
        "0012's four regions are its import lines, placed after imports 0.5.22 does not have "
        "(monokernel_weights_iterator, deepseek_v4_boundary): 0.5.22's side is empty. Keep our "
        "import, the region's last line."
    )
    for path in fast_load_files:
        d.region(path, lambda head, ours: head + ours[-1:])
    d.run("git -C build/rebase/repo add " + " ".join(fast_load_files))

    out = d.run("python3 tools/fork rebase --continue", expect=1)
    d.stop(
        out,
        "0015-engram-gather-every-Engram-layer-s",
        "python/sglang/srt/layers/engram.py",
        "python/sglang/srt/models/deepseek_v4.py",
    )
    d.note(
        "engram.py:1018: the printout says port here (Engram.forward exists in 0.5.22), but the "
        "hunk's base is 0.5.23's staged lookup (staged_by_scheduler, not found) and our module "
        "layers/engram_prefetch.py, which the printout does not read, gathers through 0.5.23's "
        "EngramEmbedding internals that 0.5.22 lacks (peer shards, new_rows, _sort_host_reads, "
        "Engram.embed_rows): carrying it is a port of the feature, not a merge. Drop it with what "
        "the printout says depends on it: 0017 (its row store refuses --engram-prefetch, a field "
        "of 0015's) and 0021 (it fuses the rows 0015's prefetch gathers)."
    )
    three = (
        "--drop 0015-engram-gather-every-Engram-layer-s --drop "
        "0017-engram-rows-on-local-storage-behind --drop 0021-engram-one-TP-all-reduce-for"
    )
    if three not in out:
        d.save()
        sys.exit(
            "drill: the stop at 0015 does not offer dropping 0017 and 0021 with it (Depends:)"
        )
    return d.run(f"python3 tools/fork rebase {three} --no-test", expect=None)


def _add(d: Drill, *paths: str) -> None:
    d.run("git -C build/rebase/repo add " + " ".join(paths))


def _rehome_draft_twin_build(d: Drill, dspark: str) -> None:
    """0004's draft twin build in a post_load_weights of its own (releases whose DSpark draft has
    none), placed before load_weights so 0012's insertion at the region stays apart."""
    d.insert(
        dspark,
        "    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:",
        "    def post_load_weights(self, is_nextn=False, weight_names=None):\n"
        "        _wo_a_twin.build_wo_a_fp8_twins(\n"
        '            self, get_exec().kernel.dsv4_wo_a_fp8_twin, "dspark draft"\n'
        "        )\n\n",
    )


def _resolve_0001(d: Drill) -> None:
    d.note(
        "pipeline.py: the base is 0.5.23's handle_deprecated_dp_attention step, which 0.5.21 "
        "does not have (its side is empty); our hunk puts the fork's build check before it. "
        "Keep only our lines (the check and its comment)."
    )
    d.region("python/sglang/srt/arg_groups/pipeline.py", lambda head, ours: ours[:6])
    _add(d, "python/sglang/srt/arg_groups/pipeline.py")


def _resolve_0002(d: Drill) -> None:
    d.note(
        "moe_fused_gate.py: the region's base is 0.5.23's SM120 top-22 fast path, which 0.5.21 "
        "does not have (its side is empty); our hunk only adds `and live_lens is None` to it. "
        "Keep 0.5.21's side."
    )
    d.region("python/sglang/kernels/ops/moe/moe_fused_gate.py", lambda head, ours: head)
    _add(d, "python/sglang/kernels/ops/moe/moe_fused_gate.py")


def _drop_0003(d: Drill) -> str:
    d.note(
        "0003's accept wiring sits in code 0.5.21 does not have (the printout: "
        "_serves_accept_tail / _static_accept_tail not found, drop or port; no sampling-accept "
        "graph), its router wiring in select_experts without num_shared_topk_slots, and "
        "mega_gate.py is gone (modify/delete). Carrying it is a port of the feature: drop it. "
        "No patch depends on it; 0002 becomes an orphan (the note says so)."
    )
    return "--drop 0003-DSpark-per-request-verify-cap-inside"


def _resolve_0004(d: Drill) -> None:
    d.note(
        "0004 on 0.5.21: every region's base holds 0.5.23 code 0.5.21 lacks (its side is empty "
        "or shorter): enable_dsa_fused_indexer, the deepseek_v4_boundary / deepseek_v4_mhc "
        "imports, the gfx950 wo_a routes (hip_fast_path, fp8_grid, emit_fp8), the draft's "
        "post_load_weights. exec_.py: our field alone; deepseek_v4.py: our import, our "
        "wo_a_twin parameter before 0.5.21's return annotation, our twin call at the top of the "
        "body, our keyword in MQALayer's call; deepseek_v4_dspark.py: our import, and the twin "
        "build re-homed into a draft post_load_weights before load_weights (0.5.21's loader "
        "calls model.post_load_weights() when a model has one), as on 0.5.22."
    )
    exec_ = "python/sglang/srt/arg_groups/fields/exec_.py"
    d.region(
        exec_,
        lambda head, ours: ours[: ours.index("    enable_dsa_fused_indexer: A[\n")],
    )
    v4 = "python/sglang/srt/models/deepseek_v4.py"
    d.region(v4, lambda head, ours: head + ours[-1:])
    d.region(v4, lambda head, ours: ["    wo_a_twin=None,\n"] + head)
    d.region(
        v4,
        lambda head, ours: ours[
            : ours.index(
                "    # the gfx950 routes, like the CUDA ones, are V4.1's (fast_path); DSv4 keeps the\n"
            )
        ],
    )
    d.region(v4, lambda head, ours: head + ours[-1:])
    dspark = "python/sglang/srt/models/deepseek_v4_dspark.py"
    d.region(dspark, lambda head, ours: head + ours[-1:])
    d.region(dspark, lambda head, ours: head)
    _rehome_draft_twin_build(d, dspark)
    _add(d, exec_, v4, dspark)


def _drop_0005(d: Drill) -> str:
    d.note(
        "0005 fences the folded accept results of 0.5.23's verify epilogue and sampling-accept "
        "graph; 0.5.21 has no sampling-accept graph (modify/delete) and the printout finds the "
        "code of three regions absent (run_static, _block_accept_lens; the post-fold buffers): "
        "a port, not a merge. Drop it (no patch depends on it)."
    )
    return "--drop 0005-dspark-fence-the-folded-accept-results"


def _drop_0006(d: Drill) -> str:
    d.note(
        "0006 scales the draft's sampling temperature through 0.5.23's DraftParams "
        "(resolve_draft_params, draft_markov_block, greedy_draft: not found in 0.5.21) and stages "
        "it in the sampling-accept graph, which 0.5.21 does not have (modify/delete): a port of "
        "the feature. Drop it (no patch depends on it)."
    )
    return "--drop 0006-dspark-scale-the-draft-s-sampling"


def _resolve_0007(d: Drill) -> None:
    d.note(
        "speculative_hook.py: 0.5.21 has its --speculative-skip-dp-mlp-sync check where our "
        "validate_draft_head_fp8 call sits (the base is empty: both sides add lines there); keep "
        "both, ours first (as on 0.5.22)."
    )
    hook = "python/sglang/srt/arg_groups/speculative_hook.py"
    d.region(hook, lambda head, ours: ours + ["\n"] + head)
    _add(d, hook)


def _resolve_0008(d: Drill) -> None:
    d.note(
        "scheduler.py: the printout says _create_generation_req is absent in 0.5.21 (drop, or "
        "port to where its caller lives now): 0.5.21's handle_generate_request builds the request "
        "itself (normal or session; the session-not-found branch has returned aborted). Port the "
        "one call there: keep 0.5.21's side and attach the loop guard just before "
        "`if recv_req.pp_prefetch_ticketed`, as on 0.5.22."
    )
    sched = "python/sglang/srt/managers/scheduler.py"
    d.region(sched, lambda head, ours: head)
    d.insert(
        sched,
        "        if recv_req.pp_prefetch_ticketed is True:",
        "        attach_loop_guard(req, get_schedule())\n\n",
    )
    _add(d, sched)


def _resolve_0009(d: Drill) -> None:
    d.note(
        "serving_chat.py: the base is 0.5.23's MiniMax-M3 normalization, which 0.5.21 does not "
        "have (its side is empty); our hunk adds the alias mapping after it, before the server's "
        "default chat-template kwargs fill in. Keep only our two lines (as on 0.5.22)."
    )
    chat = "python/sglang/srt/entrypoints/openai/serving_chat.py"
    d.region(
        chat,
        lambda head, ours: ours[
            ours.index("        if get_serving().enable_thinking_aliases:\n") :
        ],
    )
    _add(d, chat)


def _resolve_0010(d: Drill) -> None:
    d.note(
        "model_hook.py: the base is 0.5.23's NPU decode-context-parallel check, which 0.5.21 "
        "does not have (its side is empty); our hunk validates the flag before it, where "
        "model_arch is known. Keep only our lines."
    )
    hook = "python/sglang/srt/arg_groups/model_hook.py"
    d.region(
        hook,
        lambda head, ours: ours[
            : ours.index(
                "    if get_platform().is_npu and cfg.dcp_size > 1 and not is_deepseek_dsa(hf_config):\n"
            )
        ],
    )
    _add(d, hook)


def _resolve_0012(d: Drill) -> None:
    d.note(
        "0012 on 0.5.21: its import lines sit after imports 0.5.21 does not have "
        "(monokernel_weights_iterator, deepseek_v4_boundary / deepseek_v4_mhc), and its loader "
        "branch after 0.5.23's INSTANTTENSOR branch, which 0.5.21 lacks. loader.py: our import, "
        "our fast-load branch before 0.5.21's safetensors branch; deepseek_v4_nextn.py: our "
        "import. In deepseek_v4.py and deepseek_v4_dspark.py the only place isort allows our "
        "import is right above 0004's (`deepseek_v4_wo_a_twin`): the two patches' lines would "
        "touch and 0012 would no longer export alone. Import the module where it is used "
        "instead, in checkpoint_owner, which 0012 adds."
    )
    loader = "python/sglang/srt/model_loader/loader.py"
    d.region(loader, lambda head, ours: head + ours[-1:])
    d.region(
        loader,
        lambda head, ours: ours[
            ours.index(
                "        elif use_safetensors and get_model().weight_loader_fast_load:\n"
            ) :
        ],
    )
    nextn = "python/sglang/srt/models/deepseek_v4_nextn.py"
    d.region(nextn, lambda head, ours: head + ours[-1:])
    local = (
        "        from sglang.srt.models import deepseek_v4_fast_load as _fast_load\n\n"
    )
    paths = [loader, nextn]
    for path in (
        "python/sglang/srt/models/deepseek_v4.py",
        "python/sglang/srt/models/deepseek_v4_dspark.py",
    ):
        d.region(path, lambda head, ours: head)
        d.insert(path, "        return _fast_load.", local)
        paths.append(path)
    _add(d, *paths)


def _resolve_0014(d: Drill) -> None:
    d.note(
        "0014 on 0.5.21: each region's base holds 0.5.23 code 0.5.21 lacks (its side is empty): "
        "enable_dsa_fused_indexer, the NPU decode-context-parallel check, the layer binding and "
        "kernel precompile after post_load_weights. model_hook.py: our validation alone; "
        "deepseek_v4.py: our configure call at the end of 0.5.21's post_load_weights. "
        "exec_.py: at the region our field would abut 0004's field (0.5.21 lacks the field "
        "between them) and 0014 would not export alone: put it before "
        "enable_deepseek_v4_fp4_indexer, four upstream lines away."
    )
    exec_ = "python/sglang/srt/arg_groups/fields/exec_.py"
    field: list[str] = []

    def keep_head(head, ours):
        field.extend(ours[ours.index("    dsv4_hc_fused_stats: A[\n") :])
        return head

    d.region(exec_, keep_head)
    d.insert(exec_, "    enable_deepseek_v4_fp4_indexer: A[", "".join(field))
    hook = "python/sglang/srt/arg_groups/model_hook.py"
    d.region(
        hook,
        lambda head, ours: ours[
            : ours.index(
                "    if get_platform().is_npu and cfg.dcp_size > 1 and not is_deepseek_dsa(hf_config):\n"
            )
        ],
    )
    v4 = "python/sglang/srt/models/deepseek_v4.py"
    d.region(v4, lambda head, ours: ours[:3])
    _add(d, exec_, hook, v4)


def _drop_0015(d: Drill) -> str:
    d.note(
        "engram.py: the printout says port here (Engram.forward exists in 0.5.21), but the "
        "hunk's base is 0.5.23's staged lookup (staged_by_scheduler, not found) and our module "
        "layers/engram_prefetch.py, which the printout does not read, gathers through 0.5.23's "
        "EngramEmbedding internals that 0.5.21 lacks (as on 0.5.22): a port of the feature. "
        "Drop it with what the printout says depends on it: 0017 and 0021."
    )
    return (
        "--drop 0015-engram-gather-every-Engram-layer-s --drop "
        "0017-engram-rows-on-local-storage-behind --drop 0021-engram-one-TP-all-reduce-for"
    )


def _resolve_0019(d: Drill) -> None:
    d.note(
        "fp8.py: both regions' bases hold 0.5.23 code 0.5.21 lacks (the UE8M0 DeepGEMM scale "
        "check and the Hopper BF16 weight cache before our b12x prepare; the gfx950 dense route "
        "before our b12x apply). Keep 0.5.21's side with our lines: the b12x prepare as the "
        "first branch of 0.5.21's `if self.block_fp8_as_mxfp8:` chain, our b12x apply alone."
    )
    fp8 = "python/sglang/srt/layers/quantization/fp8.py"
    d.region(fp8, lambda head, ours: ours[-3:])
    d.region(
        fp8,
        lambda head, ours: ours[
            ours.index('        b12x = getattr(layer, "b12x_block_fp8", None)\n') :
        ],
    )
    _add(d, fp8)


def _resolve_0022(d: Drill) -> None:
    d.note(
        "parallel_hook.py: the base is 0.5.23's --attn-dp-size checks, which 0.5.21 does not "
        "have (its side is empty); our validation follows them. Keep only our lines (after "
        "0020's validation, a blank line apart: --continue checks 0022 still exports alone)."
    )
    hook = "python/sglang/srt/arg_groups/parallel_hook.py"
    d.region(hook, lambda head, ours: ours[-4:])
    _add(d, hook)


# (patch the tool stops at, the files its regions are in, how the stop is settled): a
# settle function resolves (then --continue) or returns the --drop arguments
STEPS_0521 = [
    (
        "0001-fork-say-which-fork-build-this",
        ["python/sglang/srt/arg_groups/pipeline.py"],
        _resolve_0001,
    ),
    (
        "0002-moe_fused_gate-optional-live-length-dead-verify",
        ["python/sglang/kernels/ops/moe/moe_fused_gate.py"],
        _resolve_0002,
    ),
    (
        "0003-DSpark-per-request-verify-cap-inside",
        [
            "python/sglang/srt/arg_groups/speculative_hook.py",
            "python/sglang/srt/layers/moe/mega_gate.py",
            *["python/sglang/srt/layers/moe/topk.py"] * 3,
            "python/sglang/srt/models/deepseek_v4.py",
            "python/sglang/srt/multimodal/dsv41/vl_routing.py",
            *["python/sglang/srt/speculative/dspark_components/dspark_verify.py"] * 3,
            *["python/sglang/srt/speculative/dspark_components/dspark_worker_v2.py"]
            * 3,
        ],
        _drop_0003,
    ),
    (
        "0004-dsv4-wo_a-from-an-exact-fp8",
        [
            "python/sglang/srt/arg_groups/fields/exec_.py",
            *["python/sglang/srt/models/deepseek_v4.py"] * 4,
            *["python/sglang/srt/models/deepseek_v4_dspark.py"] * 2,
        ],
        _resolve_0004,
    ),
    (
        "0005-dspark-fence-the-folded-accept-results",
        [
            "python/sglang/srt/speculative/dspark_components/dspark_sampling_accept_graph.py",
            *["python/sglang/srt/speculative/dspark_components/dspark_verify.py"] * 4,
            *["python/sglang/srt/speculative/dspark_components/dspark_worker_v2.py"]
            * 3,
        ],
        _drop_0005,
    ),
    (
        "0006-dspark-scale-the-draft-s-sampling",
        [
            *["python/sglang/srt/speculative/dspark_components/dspark_draft.py"] * 2,
            *["python/sglang/srt/speculative/dspark_components/dspark_draft_sampler.py"]
            * 3,
            "python/sglang/srt/speculative/dspark_components/dspark_sampling_accept_graph.py",
        ],
        _drop_0006,
    ),
    (
        "0007-dspark-draft-block-logits-from-an",
        ["python/sglang/srt/arg_groups/speculative_hook.py"],
        _resolve_0007,
    ),
    (
        "0008-scheduler-finish-a-request-whose-output",
        ["python/sglang/srt/managers/scheduler.py"],
        _resolve_0008,
    ),
    (
        "0009-openai-map-client-thinking-switches-onto",
        ["python/sglang/srt/entrypoints/openai/serving_chat.py"],
        _resolve_0009,
    ),
    (
        "0010-dsv4-copy-each-checkpoint-tensor-before",
        ["python/sglang/srt/arg_groups/model_hook.py"],
        _resolve_0010,
    ),
    (
        "0012-model_loader-fast-load-read-the-checkpoint",
        [
            *["python/sglang/srt/model_loader/loader.py"] * 2,
            "python/sglang/srt/models/deepseek_v4.py",
            "python/sglang/srt/models/deepseek_v4_dspark.py",
            "python/sglang/srt/models/deepseek_v4_nextn.py",
        ],
        _resolve_0012,
    ),
    (
        "0014-dsv4-hyper-connection-mix-statistics-in",
        [
            "python/sglang/srt/arg_groups/fields/exec_.py",
            "python/sglang/srt/arg_groups/model_hook.py",
            "python/sglang/srt/models/deepseek_v4.py",
        ],
        _resolve_0014,
    ),
    (
        "0015-engram-gather-every-Engram-layer-s",
        [
            "python/sglang/srt/layers/engram.py",
            "python/sglang/srt/models/deepseek_v4.py",
        ],
        _drop_0015,
    ),
    (
        "0019-fp8-32x32-ue8m0-block-fp8-linears",
        [*["python/sglang/srt/layers/quantization/fp8.py"] * 2],
        _resolve_0019,
    ),
    (
        "0022-linear-split-a-replicated-linear-s",
        ["python/sglang/srt/arg_groups/parallel_hook.py"],
        _resolve_0022,
    ),
]


def stops_0521(d: Drill, upto: int | None = None, out: str | None = None) -> str:
    """The stops of the rebase onto 0.5.21 and how each is settled; the last output.
    ``upto``/``out`` replay only some steps on a rebase already stopped (to write the next).
    """
    if out is None:
        out = d.run("make rebase TO=0.5.21", expect=2)
    for patch, files, settle in STEPS_0521[:upto]:
        d.stop(out, patch, *files)
        drop = settle(d)
        if drop:
            out = d.run(f"python3 tools/fork rebase {drop} --no-test", expect=None)
        else:
            out = d.run("python3 tools/fork rebase --continue --no-test", expect=None)
    return out


RELEASES = {
    "0.5.22": (stops_0522, [port_b12x_dispatch]),
    "0.5.21": (stops_0521, [port_b12x_dispatch]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--to", required=True, choices=sorted(RELEASES))
    ap.add_argument("--keep", type=Path, help="clone into this directory and keep it")
    ap.add_argument("--no-test", action="store_true", help="stop after make")
    args = ap.parse_args()
    clone = args.keep or Path(tempfile.mkdtemp(prefix="rebase-drill-")) / "fork"
    if clone.exists():
        shutil.rmtree(clone)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    d = Drill(clone, args.to)
    d.note(
        f"Real rebase onto sglang {args.to} from a clone of {head}, resolved by following the "
        f"tool's output (benchmark/rebase/rebase_drill.py --to {args.to}). Machine: "
        f"{os.cpu_count()} CPU(s), {platform.machine()}, Python {platform.python_version()}; "
        "wheel cache shared."
    )
    stops, ports = RELEASES[args.to]
    out = stops(d)
    # The drill runs make and the tests itself after its ports: --no-test. A patch left
    # without a user (0002 once 0003 is dropped) is dropped as the orphan stop says.
    if "stopped after the last patch" not in out and "rebased " not in out:
        out = d.run("python3 tools/fork rebase --continue --no-test", expect=None)
    for drop in re.findall(r"`(tools/fork rebase --drop \S+)`$", out, re.M):
        d.note(
            f"orphan stop: {drop.split()[-1]} has no user left in the series; drop it"
        )
        d.why_drop = " (orphan stop)"
        d.run(f"python3 {drop} --no-test")
    rebased = time.monotonic() - d.t0
    for port in ports:
        port(d)
    d.run("git status --short && cat patches/series")
    d.run("make")
    d.run("make check")  # lint needs the formatters `make` installs into .venv
    kept = [
        line.split(".patch")[0]
        for line in (clone / "patches" / "series").read_text().splitlines()
        if line.endswith(".patch")
    ]
    d.note("Every kept patch exported alone (make export proves it on clean upstream).")
    exported = []
    for name in kept:
        out = d.run(f"python3 tools/fork export {name}", expect=None)
        if "(exit 0," in d.lines[-2]:
            exported.append(name)
    tests = "not run (--no-test)"
    if not args.no_test:
        out = d.run("make test", expect=None)
        tail = [line for line in out.splitlines() if line.startswith("=")]
        tests = tail[-1].strip("= ") if tail else "(no summary line)"
    d.note(
        f"Record: {len(d.stops)} decisions ("
        + "; ".join(d.stops)
        + f"); {len(kept)} kept; rebase settled in {rebased:.0f} s; exported alone: "
        f"{len(exported)} of {len(kept)}; make test: {tests}; "
        f"{time.monotonic() - d.t0:.0f} s in all."
    )
    d.save()
    print(f"wrote {d.log.relative_to(REPO)} (clone: {clone})")


if __name__ == "__main__":
    main()
