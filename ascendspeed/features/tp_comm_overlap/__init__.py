"""Tensor-parallel communication behind computation: ``--use-ascend-coc --coc-parallel-num N`` splits every
tensor-parallel linear's GEMM and collective into chunks that overlap (any device, any process group);
``--use-ascend-mc2`` runs the sequence-parallel linears as torch_npu's fused kernels on Ascend NPUs.
megatron-core users call ``ascendspeed.features.enable_features(tensor_model_parallel_size=2,
use_ascend_coc=True, coc_parallel_num=4)``. See ``docs/features/tp-communication-overlap.md``.
"""
from ascendspeed.features.tp_comm_overlap.feature import TpCommOverlapFeature

FEATURE = TpCommOverlapFeature()

__all__ = ["FEATURE", "TpCommOverlapFeature"]
