// specdecode's CPU kernels: a row-invariant quantized linear layer, attention over k rows, and the whole
// decoder stack in one call (Llama; with the options of Qwen 3 and Gemma 3: query/key norms, sandwich norms,
// GeGLU, sliding-window layers, one RoPE table per layer kind).
//
// The contract (what the tests check): every output row is computed by the same sequence of operations
// whatever else shares the call — how many rows, which requests, which tree — so a k-row pass gives each row
// bitwise the one-row result. How:
//   * activations are quantized per row, per group of the weights (16 or 32 values), to int16 with one float
//     scale: x ≈ d·xq, d = max|x| / 32767;
//   * weights stay in the GGUF file's integers: w = s·(u − o) (symmetric types) or w = s·u + m (Q4_1, K-quants),
//     u unsigned, one (s, m) per group; integer dot products per group are exact in any order;
//   * each output's float accumulation over groups runs in one fixed order (group 0, 1, ...), lanes = outputs;
//   * threads split output columns (linear) or (row, key/value head, key chunk) tasks (attention), never a
//     reduction; attention reduces each row over fixed chunks of kAttChunk logical key positions counted from 0,
//     merged in order, so a row's result depends only on the keys it sees, in order.
// The vector backends (AVX-512, AVX2, portable C) run the same IEEE operations lane by lane (fused multiply-adds
// only where written, -ffp-contract=off), so they give bitwise the same results as each other.
//
// The library is one translation unit, this file: the parts below in order (simd.h: lanes; weights.h:
// registry and repacking; linear.h; attention.h: small ops and attention; decoder.h: decoder and heads;
// sampling.h), then the tests' probes and the one TORCH_LIBRARY block that declares every operator.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "simd.h"
#include "weights.h"
#include "linear.h"
#include "attention.h"
#include "decoder.h"
#include "sampling.h"

#ifndef SD_NS
#define SD_NS specdecode_kernels
#endif

namespace sd {

// ------------------------------------------------------------------------------------------------ tests' probes

std::vector<at::Tensor> quantize(const at::Tensor& x, int64_t g) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  TORCH_CHECK(xf.dim() == 2 && (g == 16 || g == 32) && xf.size(1) % g == 0, "quantize: x [rows, k], g 16 or 32");
  QuantRows q;
  quantize_rows(xf.data_ptr<float>(), xf.size(1), xf.size(0), xf.size(1), g, 16, q);
  auto qt = at::from_blob(q.q.data(), {xf.size(0), xf.size(1)}, at::kShort).clone();
  auto dt = at::from_blob(q.d.data(), {xf.size(0), q.groups}, at::kFloat).clone();
  return {qt, dt};
}

at::Tensor exp_lanes(const at::Tensor& x) {
  at::Tensor xf = x.to(at::kFloat).contiguous().view(-1);
  TORCH_CHECK(xf.numel() % kLanes == 0, "exp_lanes: a multiple of 16 values");
  at::Tensor y = at::empty_like(xf);
  for (int64_t i = 0; i < xf.numel(); i += kLanes) vf_store(y.data_ptr<float>() + i, vf_exp(vf_load(xf.data_ptr<float>() + i)));
  return y.view(x.sizes());
}

// Whether matrices with int8 activations take the quad layout (vpdpbusd builds) rather than the pairs one.
bool quad_layout() { return SD_DOT8; }

std::string isa() {
#if SD_AVX512
#ifdef __AVX512VNNI__
  return "avx512-vnni";
#else
  return "avx512";
#endif
#elif SD_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace sd

TORCH_LIBRARY(SD_NS, m) {
  m.def("register_matrix(Tensor packed, Tensor scales, Tensor? offsets, Tensor? bias, int n, int k, int g, bool nibbles, int sym, int abits, Tensor? supers=None, Tensor? super_offsets=None, int per=1, bool high_bits=False) -> int",
        &sd::register_matrix);
  m.def("register_layer(Tensor input_norm, int[] qkv, int[] o, Tensor post_norm, int[] gate_up, int[] down, Tensor? q_norm, Tensor? k_norm, Tensor? attn_out_norm, Tensor? mlp_out_norm, int window, int rope, bool gelu) -> int",
        &sd::register_layer);
  m.def("release(int matrix, int layer) -> ()", &sd::release);
  m.def("matrix_rows(int matrix, Tensor rows) -> Tensor[]", &sd::matrix_rows);
  m.def("repack_rows(Tensor raw, str kind, int row0, int k, bool quads, Tensor(a!) packed, Tensor(b!) scales, Tensor(c!)? offsets, Tensor(d!)? supers, Tensor(e!)? super_offsets, bool high_bits=False) -> ()", &sd::repack_rows);
  m.def("linear(Tensor x, int[] parts) -> Tensor", &sd::linear);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &sd::rms_norm);
  m.def("attention(Tensor q, Tensor[] keys, Tensor[] values, Tensor meta, Tensor extra_offsets, Tensor extra_slots, int layer, int heads, int kv_heads, float scaling, int window=0) -> Tensor",
        &sd::attention);
  m.def("decoder(Tensor x, int[] layers, Tensor[] keys, Tensor[] values, Tensor[] cos, Tensor[] sin, int tables, Tensor meta, Tensor extra_offsets, Tensor extra_slots, int heads, int kv_heads, int head_dim, float eps, float scaling) -> ()",
        &sd::decoder);
  m.def("lm_head(Tensor x, Tensor norm, float eps, int[] head, int vocab, Tensor? exact_q, Tensor? exact_scale, int refine, bool exact_from_head=False) -> Tensor",
        &sd::lm_head);
  m.def("head_step(Tensor features, Tensor embeddings, int fc, int layer, Tensor keys, Tensor values, Tensor cos, Tensor sin, Tensor meta, Tensor extra_offsets, Tensor extra_slots, int heads, int kv_heads, int head_dim, float eps, float scaling, Tensor norm, float norm_eps, int readout, int vocab, int read_from) -> Tensor[]",
        &sd::head_step);
  m.def("quantize(Tensor x, int g) -> Tensor[]", &sd::quantize);
  m.def("exp_lanes(Tensor x) -> Tensor", &sd::exp_lanes);
  m.def("keyed_gumbel_argmax(Tensor warped, int seed, int[] positions) -> Tensor", &sd::keyed_gumbel_argmax);
  m.def("philox_uniforms(int seed, int position, int count) -> Tensor", &sd::philox_uniforms);
  m.def("inverse_cdf_rows(Tensor probs, Tensor u) -> Tensor", &sd::inverse_cdf_rows);
  m.def("argmax_rows(Tensor logits) -> Tensor", &sd::argmax_rows);
  m.def("exact_chain(Tensor target, Tensor? draft, Tensor tokens, Tensor accept_u, float draw_u) -> int[]", &sd::exact_chain);
  m.def("isa() -> str", &sd::isa);
  m.def("quad_layout() -> bool", &sd::quad_layout);
  m.def("profile(bool enable) -> float[]", &sd::profile);
}
