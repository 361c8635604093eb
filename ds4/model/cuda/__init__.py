"""Row 2 (device): the DeepSeek V4 forward on a GPU with static KV buffers and CUDA-graph decode.

Same math as the CPU reference (ds4.model); weights stay packed where they are routed experts.
"""

from ds4.model.cuda.model import CudaModel
from ds4.model.cuda.state import DeviceKVState
from ds4.model.cuda.weights import dict_source, gguf_source

__all__ = ["CudaModel", "DeviceKVState", "dict_source", "gguf_source"]
