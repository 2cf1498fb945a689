"""DeepSeek-V4's ``checkpoint_owner()``: what of the checkpoint a rank copies (--weight-loader-fast-load).

The rules: docs/fast-load.md.

INVARIANT: every rule here mirrors the model's own ``load_weights`` and the weight
loader of the parameter the tensor lands in; whatever it cannot prove is kept
whole. A parameter whose loader is not exactly ``FusedMoE.weight_loader`` (a
subclass's override, GGUF, WNA16, ModelOpt, KTransformers, triton_kernels'
transpose, pre-sharded weights) gets its tensors whole. A slice the loader does
not take after all is caught by the stand-in, which refuses the load naming the
tensor. test/test_fast_load.py drives FusedMoE's real loader with these slices.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
from sglang.srt.layers.engram import EngramEmbedding
from sglang.srt.layers.moe.fused_moe_triton.layer import (
    FusedMoE,
    FusedMoeWeightScaleSupported,
)
from sglang.srt.layers.utils import get_layer_id
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_loader.fast_load import CheckpointOwner, RankSlice


def _layout_method(moe) -> object:
    """The method whose weight layout FusedMoE's loaders follow (upstream's private
    ``_weight_layout_method``, restated for releases without it)."""
    return getattr(moe, "weight_load_method", None) or moe.quant_method


_EXPERT = re.compile(
    r"^(?P<prefix>.*\.)experts\.(?P<eid>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<rest>.+)$"
)
_SHARD_ID = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_SHARD_DIM = {
    "w1": 0,
    "w2": 1,
    "w3": 0,
}  # FusedMoE._weight_loader_impl's SHARD_ID_TO_SHARDED_DIM
_SLICED_SCALES = (
    FusedMoeWeightScaleSupported.GROUP.value,
    FusedMoeWeightScaleSupported.BLOCK.value,
)


class _Experts:
    """The FusedMoE side, shared by the target and the draft."""

    def __init__(self, model: nn.Module, num_experts: int):
        self.params: Dict[str, nn.Parameter] = dict(model.named_parameters())
        self.num_experts = (
            num_experts  # routed + fused shared, as make_expert_params_mapping
        )

    def lookup(
        self, mapped: str
    ) -> Optional[Tuple[nn.Parameter, FusedMoE, int, str, str]]:
        """(param, layer, expert id, shard id, param name) of a routed or fused-shared
        expert tensor whose parameter is loaded by FusedMoE.weight_loader itself."""
        m = _EXPERT.match(mapped)
        if m is None or int(m["eid"]) >= self.num_experts:
            return None
        w = "w2_" if m["proj"] == "down_proj" else "w13_"
        param_name = f"{m['prefix']}experts.{w}{m['rest']}"
        param = self.params.get(param_name)
        loader = getattr(param, "weight_loader", None)
        moe = getattr(loader, "__self__", None)
        if not (
            isinstance(moe, FusedMoE)
            and getattr(loader, "__func__", None) is FusedMoE.weight_loader
            and type(moe)._weight_loader_physical is FusedMoE._weight_loader_physical
            and type(moe)._weight_loader_impl is FusedMoE._weight_loader_impl
        ):
            return None
        return param, moe, int(m["eid"]), _SHARD_ID[m["proj"]], param_name

    @staticmethod
    def loaded_here(param: nn.Parameter, moe: FusedMoE, eid: int) -> bool:
        """FusedMoE.weight_loader copies expert ``eid`` on this rank (else it returns untouched)."""
        if getattr(param, "_sglang_require_global_experts", False) or _is_ktransformers(
            moe
        ):
            return True
        meta = (
            get_global_expert_location_metadata() if moe.uses_expert_location else None
        )
        if meta is None:
            return moe._map_global_expert_id_to_local_expert_id(eid) != -1
        if moe._has_fused_shared and eid >= meta.num_logical_experts:
            return True  # shared slots: kept whole
        return any(
            0 <= moe._map_global_expert_id_to_local_expert_id(p) < moe.num_local_experts
            for p in meta.logical_to_all_physical(moe.layer_id, eid, False)
        )

    @staticmethod
    def rank_slice(
        param: nn.Parameter,
        moe: FusedMoE,
        eid: int,
        shard_id: str,
        param_name: str,
        shape: Tuple[int, ...],
    ) -> Optional[RankSlice]:
        """The narrow FusedMoE._load_w13 / _load_w2 apply to a routed expert at moe_tp_size > 1."""
        if moe.moe_tp_size == 1 or eid >= moe._num_global_routed:
            return None
        if (
            moe.use_triton_kernels
            or moe.use_presharded_weights
            or _is_ktransformers(moe)
        ):
            return None
        if getattr(param, "is_gguf_weight", False) or getattr(
            param, "is_gguf_weight_type", False
        ):
            return None
        method = (
            moe.scheme
            if getattr(moe, "scheme", None) is not None
            else _layout_method(moe)
        )
        if any(k in type(method).__name__ for k in ("WNA16", "ModelOpt")):
            return None
        if any(
            k in param_name for k in ("input_scale", "g_idx", "weight_shape", "bias")
        ):
            return None
        if "scale" in param_name or "zero" in param_name or "offset" in param_name:
            if getattr(param, "quant_method", None) not in _SLICED_SCALES:
                return None
        elif "weight" not in param_name:
            return None
        dim = _SHARD_DIM[shard_id]
        if getattr(param, "is_transposed", False):
            dim = 1 - dim
        expert_shape = tuple(param.shape[1:])
        if len(shape) != len(expert_shape) or dim >= len(shape):
            return None
        if moe.use_padded_loading:  # narrow_padded_param_and_loaded_weight
            gated = shard_id in ("w1", "w3") and moe.moe_runner_config.is_gated
            shard = expert_shape[dim] // 2 if gated else expert_shape[dim]
            start = shard * moe.moe_tp_rank
            if (
                start >= shape[dim]
            ):  # all padding: the loader zeroes it, never reading the tensor
                return RankSlice(dim, shape[dim], 0)
            length = min(shard, shape[dim] - start)
        else:
            length = shape[dim] // moe.moe_tp_size
            start = length * moe.moe_tp_rank
        return RankSlice(dim, start, length)


def _is_ktransformers(moe: FusedMoE) -> bool:
    return type(getattr(moe, "quant_method", None)).__name__ == "KTEPWrapperMethod"


def _vocab_rows(param: Optional[nn.Parameter]) -> Optional[RankSlice]:
    """The rank's vocabulary rows VocabParallelEmbedding.weight_loader (embed, lm_head) narrows to."""
    loader = getattr(param, "weight_loader", None)
    emb = getattr(loader, "__self__", None)
    if not (
        isinstance(emb, VocabParallelEmbedding)
        and getattr(loader, "__func__", None) is VocabParallelEmbedding.weight_loader
        and emb.tp_size > 1
        and not emb.use_presharded_weights
        and type(param) is nn.Parameter
        and not getattr(param, "is_gguf_weight_type", False)
    ):
        return None
    dim, packed = getattr(param, "output_dim", None), getattr(param, "packed_dim", None)
    if dim is None or packed == dim:
        return None
    s = emb.shard_indices
    return RankSlice(
        dim, s.org_vocab_start_index, s.org_vocab_end_index - s.org_vocab_start_index
    )


def _engram_rows(param: Optional[nn.Parameter]) -> Optional[RankSlice]:
    loader = getattr(param, "weight_loader", None)
    table = getattr(loader, "__self__", None)
    if (
        isinstance(table, EngramEmbedding)
        and getattr(loader, "__func__", None) is EngramEmbedding._load_rows
    ):
        return RankSlice(0, table.row_start, table.rows)
    return None


# load_weights(is_nextn=True) keeps these outside the draft's decoder layer
_NEXTN_OUT_OF_LAYER = (
    "shared_head.norm",
    "shared_head.head",
    "embed_tokens",
    ".e_proj",
    "h_proj",
    "enorm",
    "hnorm",
    "hc_head_base",
    "hc_head_fn",
    "hc_head_scale",
)


class DeepseekV4Owner(CheckpointOwner):
    """DeepseekV4ForCausalLM.load_weights (is_nextn: DeepseekV4ForCausalLMNextN's)."""

    def __init__(self, model: nn.Module, *, is_nextn: bool):
        self.model = model
        self.config = model.config
        self.is_nextn = is_nextn
        self.experts = _Experts(
            model, model.config.n_routed_experts + model.num_fused_shared_experts
        )
        self.is_dsv41 = getattr(model.config, "model_type", None) == "deepseek_v41"
        n = self.config.num_hidden_layers
        self.nextn_prefix = f"model.layers.{0 if n == 1 else n}"
        self._names: Dict[str, Optional[str]] = (
            {}
        )  # keeps() and rank_slice() ask in turn

    def _param_name(self, name: str) -> Optional[str]:
        if name not in self._names:
            self._names[name] = self._map(name)
        return self._names[name]

    def _map(self, name: str) -> Optional[str]:
        """The name load_weights maps ``name`` to, or None where it drops it unread."""
        cfg = self.config
        mapped = self.model.remap_weight_name_to_dpsk_hf_format(
            name, is_nextn=self.is_nextn, num_hidden_layers=cfg.num_hidden_layers
        )
        if (
            self.is_dsv41
            and getattr(self.model, "vision", None) is None
            and (
                mapped.startswith(("vision.", "aligner.", "image_"))
                or mapped.endswith(".gate.e_score_correction_bias_vl")
            )
        ):
            return None
        layer_id = get_layer_id(mapped)
        inner = self.model.model
        if (
            layer_id is not None
            and hasattr(inner, "start_layer")
            and not (inner.start_layer <= layer_id < inner.end_layer)
        ):
            return None
        if self.model.num_fused_shared_experts > 0 and "mlp.shared_experts" in mapped:
            mapped = mapped.replace(
                "mlp.shared_experts", f"mlp.experts.{cfg.n_routed_experts}"
            )
        if not self.is_nextn:
            if hasattr(cfg, "num_nextn_predict_layers"):
                parts = mapped.split(".")
                if (
                    cfg.num_nextn_predict_layers > 0
                    and mapped.startswith("model.layers")
                    and len(parts) >= 3
                    and int(parts[2]) >= cfg.num_hidden_layers
                ):
                    return None
                if mapped.startswith("mtp"):
                    return None
            return mapped
        if "shared_head.head" in mapped or "embed_tokens" in mapped:
            return None
        if not mapped.startswith(self.nextn_prefix):
            return None
        in_decoder = not any(w in mapped for w in _NEXTN_OUT_OF_LAYER)
        return mapped.replace(
            self.nextn_prefix, "model.decoder" if in_decoder else "model"
        )

    def keeps(self, name: str) -> bool:
        mapped = self._param_name(name)
        if mapped is None:
            return False
        found = self.experts.lookup(mapped)
        return found is None or self.experts.loaded_here(*found[:3])

    def rank_slice(
        self, name: str, shape: Tuple[int, ...], dtype: torch.dtype
    ) -> Optional[RankSlice]:
        mapped = self._param_name(name)
        if mapped is None:
            return None
        found = self.experts.lookup(mapped)
        if found is not None:
            return self.experts.rank_slice(*found, shape)
        param = self.experts.params.get(mapped)
        return _vocab_rows(param) or _engram_rows(param)


class DeepseekV4DSparkOwner(CheckpointOwner):
    """DeepseekV4ForCausalLMDSpark.load_weights: only the ``mtp.*`` tensors it maps."""

    def __init__(self, model: nn.Module):
        from sglang.srt.models import (
            deepseek_v4_dspark as dspark,  # the model's module, loaded
        )

        self.model = model
        self.remap = (
            model._remap_dspark_weight_name_npu
            if dspark._is_npu
            else model._remap_dspark_weight_name
        )
        self.n_routed = dspark._dspark_stage_config(model.config).n_routed_experts
        self.experts = _Experts(model, self.n_routed + model.num_fused_shared_experts)

    def _mapped(self, name: str) -> Optional[str]:
        mapped = self.remap(name)
        if (
            mapped is not None
            and self.model.num_fused_shared_experts > 0
            and ".mlp.shared_experts." in mapped
        ):
            mapped = mapped.replace(
                ".mlp.shared_experts.", f".mlp.experts.{self.n_routed}."
            )
        return mapped

    def keeps(self, name: str) -> bool:
        mapped = self._mapped(name)
        if mapped is None:
            return False
        found = self.experts.lookup(mapped)
        return found is None or self.experts.loaded_here(*found[:3])

    def rank_slice(
        self, name: str, shape: Tuple[int, ...], dtype: torch.dtype
    ) -> Optional[RankSlice]:
        mapped = self._mapped(name)
        found = self.experts.lookup(mapped) if mapped is not None else None
        return self.experts.rank_slice(*found, shape) if found is not None else None
