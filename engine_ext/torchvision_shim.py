# Makes the CUDA-built torchvision wheel importable beside CPU-only torch (import this before sglang):
# its _C ops cannot load, and _meta_registrations registers a fake for
# torchvision::nms unconditionally, which needs the schema to exist.
import torch

_lib = torch.library.Library("torchvision", "DEF")
_lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
