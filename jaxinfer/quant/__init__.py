"""Weight-only quantization: int8 (per output channel or group-wise) and int4 group-wise (packed).

    format.py    QuantizedWeight, int4 packing, dequantize (the storage format; no model code)
    quantize.py  quantize_int8 / quantize_int4 / quantize (min/max, or the search below)
    search.py    the k-quant grid search of group parameters, and GPTQ
    gguf.py      GGUF Q8_0 / Q4_0 / Q4_1 tensors as stored
    xla.py       the quantized matmul and embedding lookup on the XLA path

Replacing a model's layers by quantized ones is model code: `jaxinfer.models.quantize`.
"""

from jaxinfer.quant.format import (INT4_GROUP_SIZES, QuantizedWeight, concat_output_channels,
                                   dequantize, pack_int4, permute_output_channels, stack,
                                   unpack_int4)
from jaxinfer.quant.gguf import GGUF_QUANT_TYPES, from_gguf, from_gguf_tensor
from jaxinfer.quant.quantize import quantize, quantize_int4, quantize_int8
from jaxinfer.quant.search import gptq_int4, search_int4_params, value_weights
from jaxinfer.quant.xla import quantized_embedding, quantized_matmul

__all__ = ["INT4_GROUP_SIZES", "GGUF_QUANT_TYPES", "QuantizedWeight", "concat_output_channels",
           "dequantize", "from_gguf", "from_gguf_tensor", "gptq_int4", "pack_int4",
           "permute_output_channels", "quantize", "quantize_int4", "quantize_int8",
           "quantized_embedding", "quantized_matmul", "search_int4_params", "stack",
           "unpack_int4", "value_weights"]
