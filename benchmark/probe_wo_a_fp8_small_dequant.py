"""What the exact e4m3 -> bf16 dequantisation costs the Hopper small kernel of the wo_a twin: the
kernel as shipped against the same kernel with the conversion replaced by one logic op per word
(wrong values, timing only: 408 SASS instructions per thread instead of 656). The variant is built
from the engine's own source by a text substitution, so the two differ in nothing else.
Not run by the GPU bundle: python3 benchmark/probe_wo_a_fp8_small_dequant.py RESULTS_DIR
H200 (results/wo_a_fp8_small_dequant_probe-NVIDIA_H200.json): G = 2 5.88-5.90 us -> 5.20-5.22 us,
G = 8 15.29-15.33 -> 13.89-14.52: the conversion is a third of the gap to a pure read (3.92 us at
G = 2), the rest is elsewhere.
"""
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

from bench_wo_a_fp8 import twin_exact_weight
from harness import LAYERS, graph_us_per_call
from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as shipped
from sglang.srt.models.deepseek_v4_wo_a_twin import make_twin

_EDITS = (
    ('''    o0, o1 = gl.inline_asm_elementwise(_ASM, "=r,=r,r,r,r", [w32, sb, sb], dtype=(gl.int32, gl.int32),
                                       is_pure=True, pack=1)''',
     '''    o0, o1 = w32 ^ sb, w32 & sb'''),
)


def cheap_variant():
    src = Path(shipped.__file__).read_text()
    for old, new in _EDITS:
        assert src.count(old) == 1, "the kernel changed: update the probe's edit"
        src = src.replace(old, new)
    path = Path(tempfile.mkdtemp()) / "wo_a_small_cheap.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("wo_a_small_cheap", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    variants = {"exact": shipped, "one_op_per_word": cheap_variant()}
    res = []
    for g in (2, 8):
        tw = [make_twin(twin_exact_weight(g, i)) for i in range(LAYERS)]
        pk = [shipped.pack_twin(t[0]) for t in tw]
        for m in (2, 8):
            x = torch.randn(m, g, 4096, device="cuda").to(torch.bfloat16)
            for name, mod in variants.items():
                us = graph_us_per_call([lambda i=i: mod.wo_a_fp8_small_sm90(x, pk[i], tw[i][1]) for i in range(LAYERS)])
                res.append({"G": g, "M": m, "dequant": name, "us": us})
                print(res[-1], flush=True)
        del tw, pk
    dev = torch.cuda.get_device_name().replace(" ", "_")
    json.dump(res, open(f"{sys.argv[1]}/wo_a_fp8_small_dequant_probe-{dev}.json", "w"), indent=1)


if __name__ == "__main__":
    main()
