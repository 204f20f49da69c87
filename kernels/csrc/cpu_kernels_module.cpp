// The CPU kernels' extension (lookahead.kernels.cpu_kernels builds this file): one translation unit, since
// the later files use cpu_kernels.cpp's thread pool, and the functions Python calls.
#include <torch/extension.h>

#include "cpu_kernels.cpp"
#include "chain_attention.cpp"
#include "quant_gemm.cpp"
#include "decoder_step.cpp"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("give_back_freed", torch::wrap_pybind_function(give_back_freed), "give_back_freed");
  m.def("stamps", torch::wrap_pybind_function(stamps), "stamps");
  m.def("rows_gemm", torch::wrap_pybind_function(rows_gemm), "rows_gemm");
  m.def("chain_attention", torch::wrap_pybind_function(chain_attention), "chain_attention");
  m.def("bf16_pairs", torch::wrap_pybind_function(bf16_pairs), "bf16_pairs");
  m.def("decoder_step", torch::wrap_pybind_function(decoder_step), "decoder_step");
  m.def("top_ids", torch::wrap_pybind_function(top_ids), "top_ids");
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
  m.def("norm_rows", torch::wrap_pybind_function(norm_rows), "norm_rows");
  m.def("quant_gemm", torch::wrap_pybind_function(quant_gemm), "quant_gemm");
  m.def("quant_path", torch::wrap_pybind_function(quant_path), "quant_path");
  m.def("quant_rows", torch::wrap_pybind_function(quant_rows), "quant_rows");
}
