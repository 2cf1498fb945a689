"""--weight-loader-disable-async-load: DeepSeek-V4's loader, pooled copies (stock) and serial, on CPU.

A synthetic checkpoint in DeepSeek-V4's own tensor names (``layers.N.attn.wo_b.weight``,
``layers.N.ffn.shared_experts.w2.weight``, ``embed.weight``, ...; safetensors shards) is loaded
through the engine's real ``DeepseekV4ForCausalLM.load_weights`` (the stock thread pool,
``maybe_executor_submit``) and sglang's ``safetensors_weights_iterator``, into a stand-in
module holding parameters of those names (on the GPU where there is one: the copies are then
host-to-device, as in serving). Each load runs in a fresh process (peak RSS only
grows within a process): the parent alternates stock and serial children, ``--rounds`` times,
and reports each child's peak RSS above its pre-load baseline (VmHWM), its load time and the
sha256 of every loaded parameter (serial must equal stock bit for bit). The JSON is named
after the device holding the parameters (``serial_weight_load-cpu.json`` on a CPU machine);
test_serial_weight_load.py runs the same children on a smaller checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from e2e.provenance import add_overwrite_arg, write_result  # noqa: E402

LAYERS = 8


def tensor_names(layers: int) -> dict[str, str]:
    """checkpoint name -> the engine's parameter name (remap_weight_name_to_dpsk_hf_format)."""
    names = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
    }
    for i in range(layers):
        names[f"layers.{i}.attn.wo_b.weight"] = (
            f"model.layers.{i}.self_attn.wo_b.weight"
        )
        names[f"layers.{i}.ffn.shared_experts.w2.weight"] = (
            f"model.layers.{i}.mlp.shared_experts.down_proj.weight"
        )
        names[f"layers.{i}.attn_norm.weight"] = (
            f"model.layers.{i}.input_layernorm.weight"
        )
    return names


def shapes(layers: int, mib_per_matrix: int) -> dict[str, tuple[int, ...]]:
    cols = 2048
    rows = mib_per_matrix * (1 << 20) // (2 * cols)
    out = {}
    for name in tensor_names(layers):
        out[name] = (cols,) if name.endswith("norm.weight") else (rows, cols)
    return out


def write_checkpoint(
    path: Path, layers: int = LAYERS, mib_per_matrix: int = 16, shards: int = 4
) -> Path:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    items = list(shapes(layers, mib_per_matrix).items())
    per = -(-len(items) // shards)
    for s in range(shards):
        part = {
            n: torch.randn(*shp, generator=gen).to(torch.bfloat16)
            for n, shp in items[s * per : (s + 1) * per]
        }
        save_file(part, str(path / f"model-{s:05d}-of-{shards:05d}.safetensors"))
    (path / "layout.json").write_text(  # not a result: read back by child()
        json.dumps({"layers": layers, "mib_per_matrix": mib_per_matrix})
    )
    return path


def vm_hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text(
        "5"
    )  # resets VmHWM to the current RSS (Linux >= 4.0)


def child(ckpt: Path, serial: bool) -> dict:
    """One load in this process: publish the flag, load, hash, measure."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    publish(
        ServerArgs(
            model_path="dummy", device=device, weight_loader_disable_async_load=serial
        ),
        role="test",
    )
    layout = json.loads((ckpt / "layout.json").read_text())
    layers = layout["layers"]

    class StandIn(nn.Module):
        """The attributes DeepseekV4ForCausalLM.load_weights reads, parameters named as the engine's."""

        remap_weight_name_to_dpsk_hf_format = staticmethod(
            DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format
        )

        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(
                num_hidden_layers=layers,
                n_routed_experts=4,
                model_type="deepseek_v4",
                num_nextn_predict_layers=0,
            )
            (
                self.wo_a_fp8,
                self.quant_config,
                self.num_fused_shared_experts,
                self.vision,
            ) = (False, None, 0, None)
            self.pp_group = SimpleNamespace(is_first_rank=True, is_last_rank=True)
            self.model = nn.Module()
            self.model.layers, self.model.start_layer, self.model.end_layer = (
                nn.ModuleList(),
                0,
                layers,
            )
            self.params = {}
            for ck, shp in shapes(layers, layout["mib_per_matrix"]).items():
                module, _, leaf = tensor_names(layers)[ck].rpartition(".")
                owner = self
                for part in module.split("."):
                    if not hasattr(owner, part):
                        owner.add_module(part, nn.Module())
                    owner = getattr(owner, part)
                owner.register_parameter(
                    leaf,
                    nn.Parameter(
                        torch.empty(shp, dtype=torch.bfloat16, device=device),
                        requires_grad=False,
                    ),
                )

        def post_load_weights(self, is_nextn=False, weight_names=None):
            pass

        def _prewarm_mhc_kernels(self):
            pass

    model = StandIn()
    for p in model.parameters():
        p.data.zero_()  # touch the pages: the baseline holds the parameters
    files = sorted(str(f) for f in ckpt.glob("*.safetensors"))
    reset_hwm()
    base = vm_hwm_kib()
    t0 = time.perf_counter()
    DeepseekV4ForCausalLM.load_weights(model, safetensors_weights_iterator(files))
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = vm_hwm_kib()
    digests = {
        n: hashlib.sha256(
            p.detach().view(torch.int16).cpu().numpy().tobytes()
        ).hexdigest()
        for n, p in model.named_parameters()
    }
    return {
        "serial": serial,
        "device": device,
        "peak_rss_above_baseline_mib": round((peak - base) / 1024, 1),
        "load_seconds": round(seconds, 3),
        "params": len(digests),
        "digests": digests,
        "param_mib": round(sum(p.numel() * 2 for p in model.parameters()) / 2**20, 1),
    }


def run_child(ckpt: Path, serial: bool, env: dict | None = None) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import bench_serial_weight_load as b; from pathlib import Path; "
        f"print('RESULT' + json.dumps(b.child(Path({str(ckpt)!r}), {serial})))"
    )
    r = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(
            f"child failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmark/results"))
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/serial_weight_load_ckpt"))
    ap.add_argument("--mib-per-matrix", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = add_overwrite_arg(ap).parse_args()
    ckpt = write_checkpoint(args.ckpt, mib_per_matrix=args.mib_per_matrix)
    ckpt_mib = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**20
    runs = {False: [], True: []}
    for _ in range(args.rounds):
        for serial in (False, True):  # alternate, so drift hits both alike
            runs[serial].append(run_child(ckpt, serial))
            print(
                {k: v for k, v in runs[serial][-1].items() if k != "digests"},
                flush=True,
            )
    identical = all(
        r["digests"] == runs[False][0]["digests"] for rs in runs.values() for r in rs
    )
    rows = [
        {
            "mode": "serial" if serial else "stock (pool)",
            "peak_rss_above_baseline_mib": [
                r["peak_rss_above_baseline_mib"] for r in rs
            ],
            "median_peak_rss_mib": statistics.median(
                r["peak_rss_above_baseline_mib"] for r in rs
            ),
            "load_seconds": [r["load_seconds"] for r in rs],
            "median_load_seconds": statistics.median(r["load_seconds"] for r in rs),
        }
        for serial, rs in runs.items()
    ]
    for row in rows:
        print(row)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    device = (
        torch.cuda.get_device_name().replace(" ", "_")
        if torch.cuda.is_available()
        else "cpu"
    )
    path = write_result(
        args.out / f"serial_weight_load-{device}.json",
        {
            "benchmark": "serial_weight_load",
            "device": device,
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "checkpoint_mib": round(ckpt_mib, 1),
            "tensors": runs[False][0]["params"],
            "largest_shard_mib": round(
                max(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**20, 1
            ),
            "largest_tensor_mib": args.mib_per_matrix,
            "weights_bitwise_identical": identical,
            "what": "DeepseekV4ForCausalLM.load_weights on a synthetic bf16 checkpoint (safetensors, mmap) into "
            "parameters on the device; host peak RSS above the pre-load baseline (VmHWM) and load time per "
            "fresh process",
            "rows": rows,
        },
        overwrite=args.overwrite,
    )
    print(f"wrote {path}")
    assert identical, "serial load changed the weights"


if __name__ == "__main__":
    main()
