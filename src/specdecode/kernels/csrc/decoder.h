// The whole decoder stack in one call (decoder), the LM head with its exact float32 refinement of each row's top
// logits (lm_head, matrix_rows), one step of an EAGLE draft head (head_step), and the phase timer they report to.
//
// A part of the kernels' one translation unit: ops.cpp includes the parts in order.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <memory>
#include <vector>

#include "attention.h"
#include "linear.h"

namespace sd {

constexpr int kMaxRefine = 64;  // the most top logits per row lm_head recomputes in float32

// ------------------------------------------------------------------------------------------------ profiling

// Wall time per phase of the decoder and head, accumulated while profiling is on (benchmarks/profile_runner.py).
enum Phase { kNorm, kMatrices, kRope, kAttention, kActivation, kHead, kRefine, kPhases };
static bool g_profiling = false;
static double g_phase_seconds[kPhases] = {0};

struct PhaseTimer {
  Phase phase;
  std::chrono::steady_clock::time_point start;
  explicit PhaseTimer(Phase p) : phase(p) {
    if (g_profiling) start = std::chrono::steady_clock::now();
  }
  ~PhaseTimer() {
    if (g_profiling) g_phase_seconds[phase] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

// Turn phase timing on or off; return the seconds accumulated per phase since the last call (then reset).
std::vector<double> profile(bool enable) {
  std::vector<double> out(g_phase_seconds, g_phase_seconds + kPhases);
  std::fill(g_phase_seconds, g_phase_seconds + kPhases, 0.0);
  g_profiling = enable;
  return out;
}

// ------------------------------------------------------------------------------------------------ decoder

// x [rows, hidden] (float32, in place): the decoder layers `layer_ids`, keys/values stored at each row's slot.
// Each cache brings `tables` RoPE tables (cos/sin [capacity, head_dim], cache c's table t at c·tables + t); row
// r's rotary rows are row position(r) of its cache's table for the layer.
void decoder(const at::Tensor& x, at::IntArrayRef layer_ids, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
             std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, int64_t tables, const at::Tensor& meta,
             const at::Tensor& extra_offsets, const at::Tensor& extra_slots, int64_t heads, int64_t kv_heads,
             int64_t head_dim, double eps, double scaling) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous float32 [rows, hidden]");
  const AttnShape shape{heads, kv_heads, head_dim, static_cast<float>(scaling)};
  TORCH_CHECK(head_dim % kLanes == 0 && head_dim <= 256 && heads % kv_heads == 0, "unsupported attention shape");
  const auto caches = cache_views(keys, values, shape);
  const RowsView rows = rows_view(meta, extra_offsets, extra_slots);
  TORCH_CHECK(rows.rows == x.size(0), "one meta row per token");
  check_rows(rows, caches);
  TORCH_CHECK(tables >= 1 && cos.size() == caches.size() * tables && sin.size() == cos.size(),
              "cos/sin: `tables` tables per cache");
  std::vector<const float*> cos_rows(tables * rows.rows), sin_rows(tables * rows.rows);  // [table][row]
  for (size_t i = 0; i < cos.size(); ++i)
    TORCH_CHECK(cos[i].scalar_type() == at::kFloat && sin[i].scalar_type() == at::kFloat && cos[i].is_contiguous() &&
                    sin[i].is_contiguous() && cos[i].dim() == 2 && cos[i].size(1) == head_dim &&
                    sin[i].sizes() == cos[i].sizes(),
                "cos/sin: float32 [capacity, head_dim]");
  for (int64_t t = 0; t < tables; ++t) {
    for (int64_t r = 0; r < rows.rows; ++r) {
      const int64_t c = rows.cache(r) * tables + t, pos = rows.position(r);
      TORCH_CHECK(pos >= 0 && pos < cos[c].size(0), "row ", r, ": position outside the rotary table");
      cos_rows[t * rows.rows + r] = cos[c].data_ptr<float>() + pos * head_dim;
      sin_rows[t * rows.rows + r] = sin[c].data_ptr<float>() + pos * head_dim;
    }
  }
  std::vector<std::shared_ptr<const Layer>> layers;
  for (int64_t id : layer_ids) {
    layers.push_back(layer_at(id));
    const Layer& layer = *layers.back();
    TORCH_CHECK(layer.rope < tables, "layer ", id, " needs RoPE table ", layer.rope, " of ", tables);
    TORCH_CHECK(!layer.q_norm.defined() || (layer.q_norm.numel() == head_dim && layer.k_norm.numel() == head_dim),
                "layer ", id, ": query/key norms must have head_dim values");
  }
  for (const auto& cache : keys) TORCH_CHECK(cache.size(0) >= static_cast<int64_t>(layers.size()), "cache has too few layers");
  const int64_t m = x.size(0), hidden = x.size(1);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  float* xp = x.data_ptr<float>();
  const float e = static_cast<float>(eps);
  std::vector<float> h(m * hidden), q(m * q_width), attn(m * q_width), qkv, gu, act, normed;
  // x += parts(in), or x += norm(parts(in)) when the layer norms that output first (Gemma's sandwich norms);
  // `h` is free scratch at both call sites
  const auto residual_add = [&](const std::vector<std::shared_ptr<const Matrix>>& parts, const float* in,
                                int64_t ld, const at::Tensor& norm) {
    if (!norm.defined()) {
      PhaseTimer timer(kMatrices);
      apply_parts(parts, in, ld, m, xp, hidden, xp, hidden);
      return;
    }
    {
      PhaseTimer timer(kMatrices);
      apply_parts(parts, in, ld, m, h.data(), hidden, nullptr, 0);
    }
    PhaseTimer timer(kNorm);
    normed.resize(m * hidden);
    rms_norm_rows(h.data(), m, hidden, norm.data_ptr<float>(), e, normed.data());
    for (int64_t i = 0; i < m * hidden; i += kLanes)
      vf_store(xp + i, vf_add(vf_load(xp + i), vf_load(normed.data() + i)));
  };
  for (size_t li = 0; li < layers.size(); ++li) {
    const Layer& layer = *layers[li];
    const AttnShape layer_shape{heads, kv_heads, head_dim, static_cast<float>(scaling), layer.window};
    const float* const* layer_cos = cos_rows.data() + layer.rope * rows.rows;
    const float* const* layer_sin = sin_rows.data() + layer.rope * rows.rows;
    const int64_t qkv_width = width_of(layer.qkv), inter = width_of(layer.gate_up) / 2;
    TORCH_CHECK(qkv_width == q_width + 2 * kv_width && layer.qkv[0]->k == hidden, "layer ", li, ": q/k/v shape");
    qkv.resize(m * qkv_width);
    gu.resize(m * 2 * inter);
    act.resize(m * inter);
    {
      PhaseTimer timer(kNorm);
      rms_norm_rows(xp, m, hidden, layer.input_norm.data_ptr<float>(), e, h.data());
    }
    {
      PhaseTimer timer(kMatrices);
      apply_parts(layer.qkv, h.data(), hidden, m, qkv.data(), qkv_width, nullptr, 0);
    }
    if (layer.q_norm.defined()) {
      PhaseTimer timer(kNorm);
      norm_heads(qkv.data(), m, heads, qkv_width, head_dim, layer.q_norm.data_ptr<float>(), e);
      norm_heads(qkv.data() + q_width, m, kv_heads, qkv_width, head_dim, layer.k_norm.data_ptr<float>(), e);
    }
    {
      PhaseTimer timer(kRope);
      rope_rows(qkv.data(), m, heads + kv_heads, qkv_width, head_dim, layer_cos, layer_sin);
      store_kv(rows, caches, static_cast<int64_t>(li), shape, qkv.data() + q_width, qkv.data() + q_width + kv_width,
               qkv_width);
      // attention reads q rows from the fused q/k/v buffer: gather them contiguous first
      for (int64_t r = 0; r < m; ++r)
        std::memcpy(q.data() + r * q_width, qkv.data() + r * qkv_width, q_width * sizeof(float));
    }
    {
      PhaseTimer timer(kAttention);
      attention_rows(rows, caches, static_cast<int64_t>(li), layer_shape, q.data(), attn.data());
    }
    residual_add(layer.o, attn.data(), q_width, layer.attn_out_norm);
    {
      PhaseTimer timer(kNorm);
      rms_norm_rows(xp, m, hidden, layer.post_norm.data_ptr<float>(), e, h.data());
    }
    {
      PhaseTimer timer(kMatrices);
      apply_parts(layer.gate_up, h.data(), hidden, m, gu.data(), 2 * inter, nullptr, 0);
    }
    {
      PhaseTimer timer(kActivation);
      if (layer.gelu)
        gelu_mul_rows(gu.data(), m, inter, act.data());
      else
        silu_mul_rows(gu.data(), m, inter, act.data());
    }
    residual_add(layer.down, act.data(), inter, layer.mlp_out_norm);
  }
}

// ------------------------------------------------------------------------------------------------ LM head

// The `count` highest of v[0..n) by (value descending, index ascending), as a fixed function of v.
static void top_indices(const float* v, int64_t n, int count, int64_t* out) {
  float best[kMaxRefine];
  int64_t index[kMaxRefine];
  int have = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[i];
    if (have == count && !(x > best[count - 1])) continue;
    int at = have < count ? have++ : count - 1;
    while (at > 0 && x > best[at - 1]) {
      best[at] = best[at - 1];
      index[at] = index[at - 1];
      --at;
    }
    best[at] = x;
    index[at] = i;
  }
  std::copy(index, index + have, out);
}

// Σ_k w[k]·h[k] in float32 with w = q·scale exact (int8 rows, one scale per block of k / blocks), 16 lanes, fixed tree.
static float exact_dot(const int8_t* q, const float* scale, int64_t k, int64_t block, const float* h) {
  VF acc = vf_zero();
  for (int64_t i = 0; i < k; i += kLanes) {
    const VF w = vf_mul(vf_from_i8(q + i), vf_set(scale[i / block]));
    acc = vf_fma(w, vf_load(h + i), acc);
  }
  return vf_hsum(acc);
}

static inline float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// Output c of tile t's scale of group j, as the kernels compute it (two levels: the exact product d·sc).
static float group_scale(const Matrix& w, int64_t t, int64_t j, int64_t c) {
  const int64_t at = (t * w.groups + j) * kLanes + c;
  switch (w.kind) {
    case kScaleSuper:
      return half_value(w.ssp[(t * w.supers + j / w.per) * kLanes + c]) *
             static_cast<float>(static_cast<const int8_t*>(w.sp)[at]);
    case kScaleF16:
      return half_value(static_cast<const uint16_t*>(w.sp)[at]);
    default:
      return static_cast<const float*>(w.sp)[at];
  }
}

// Output row n of a symmetric matrix read back from its tile layout: q = u − sym (int8) and each group's float32
// scale, so that w = scale·q exactly. The layouts are the ones described at Matrix.
static void matrix_row_int8(const Matrix& w, int64_t n, int8_t* q, float* scale) {
  const bool quads = w.abits == 8 && SD_DOT8;
  const int64_t t = n / kLanes, c = n % kLanes, g = w.g;
  for (int64_t j = 0; j < w.groups; ++j) {
    const uint8_t* p = w.wp + (t * w.groups + j) * w.group_bytes();
    for (int64_t i = 0; i < g; ++i) q[j * g + i] = static_cast<int8_t>(get_value(p, w.packing, quads, g, c, i) - w.sym);
    scale[j] = group_scale(w, t, j, c);
  }
}

// Rows `rows` of a symmetric matrix as {int8 q [r, k], float32 scales [r, groups]}: its exact weights without a
// second copy of them (a tied head's embedding table and exact rows).
std::vector<at::Tensor> matrix_rows(int64_t matrix, const at::Tensor& rows) {
  const auto w = matrix_at(matrix);
  TORCH_CHECK(w->sym >= 0 && w->sym <= 128, "exact int8 rows need a symmetric matrix");
  const at::Tensor index = rows.to(at::kLong).contiguous();
  const int64_t r = index.numel();
  at::Tensor q = at::empty({r, w->k}, at::kChar), scale = at::empty({r, w->groups}, at::kFloat);
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < r; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < w->n, "row ", ip[i], " out of range");
    matrix_row_int8(*w, ip[i], q.data_ptr<int8_t>() + i * w->k, scale.data_ptr<float>() + i * w->groups);
  }
  return {q, scale};
}

// logits [rows, vocab] = head(norm(x)); then each row's `refine` highest logits recomputed in float32 from the
// exact int8 rows (int8 [V, hidden] with float32 scales [V, blocks]) when given, else, with `exact_from_head`,
// from the head's own (symmetric) blocks read back from their tiles: the same values, so the same bits.
at::Tensor lm_head(const at::Tensor& x, const at::Tensor& norm, double eps, at::IntArrayRef head, int64_t vocab,
                   const c10::optional<at::Tensor>& exact_q, const c10::optional<at::Tensor>& exact_scale,
                   int64_t refine, bool exact_from_head) {
  const at::Tensor xf = x.to(at::kFloat).contiguous(), wf = norm.to(at::kFloat).contiguous();
  const auto parts = parts_of(head);
  TORCH_CHECK(parts.size() == 1, "the LM head is one matrix");
  const Matrix& w = *parts[0];
  TORCH_CHECK(xf.dim() == 2 && xf.size(1) == w.k && vocab >= 1 && vocab <= w.n, "lm_head: bad shapes");
  TORCH_CHECK(refine >= 0 && refine <= kMaxRefine, "refine must be in 0..", kMaxRefine);
  const int64_t m = xf.size(0), hidden = xf.size(1);
  std::vector<float> h(m * hidden);
  at::Tensor logits = at::empty({m, vocab}, xf.options());
  float* out = logits.data_ptr<float>();
  {
    PhaseTimer timer(kHead);
    rms_norm_rows(xf.data_ptr<float>(), m, hidden, wf.data_ptr<float>(), static_cast<float>(eps), h.data());
    QuantRows q;
    quantize_rows(h.data(), hidden, m, hidden, w.g, w.abits, q);
    linear_rows(w, q, out, vocab, vocab, nullptr, 0);
  }
  if (refine > 0 && !exact_q.has_value() && exact_from_head) {
    PhaseTimer timer(kRefine);
    TORCH_CHECK(w.sym >= 0 && w.sym <= 128, "exact rows from the head: a symmetric head");
    const int count = static_cast<int>(std::min<int64_t>(refine, vocab));
    at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
      int64_t top[kMaxRefine];
      std::vector<int8_t> qrow(hidden);
      std::vector<float> srow(w.groups);
      for (int64_t r = r0; r < r1; ++r) {
        float* row = out + r * vocab;
        top_indices(row, vocab, count, top);
        for (int i = 0; i < count; ++i) {
          matrix_row_int8(w, top[i], qrow.data(), srow.data());
          row[top[i]] = exact_dot(qrow.data(), srow.data(), hidden, w.g, h.data() + r * hidden);
        }
      }
    });
  } else if (refine > 0 && exact_q.has_value()) {
    PhaseTimer timer(kRefine);
    const at::Tensor eq = exact_q->contiguous(), es = exact_scale.value().to(at::kFloat).contiguous();
    TORCH_CHECK(eq.scalar_type() == at::kChar && eq.size(1) == hidden && eq.size(0) >= vocab && es.size(0) == eq.size(0),
                "exact rows: int8 [V, hidden] and float32 scales [V, blocks]");
    const int64_t block = hidden / es.size(1);
    TORCH_CHECK(block * es.size(1) == hidden && block % kLanes == 0, "exact rows: blocks must divide hidden by 16s");
    const int count = static_cast<int>(std::min<int64_t>(refine, vocab));
    const int8_t* qp = eq.data_ptr<int8_t>();
    const float* sp = es.data_ptr<float>();
    at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
      int64_t top[kMaxRefine];
      for (int64_t r = r0; r < r1; ++r) {
        float* row = out + r * vocab;
        top_indices(row, vocab, count, top);
        for (int i = 0; i < count; ++i)
          row[top[i]] = exact_dot(qp + top[i] * hidden, sp + top[i] * es.size(1), hidden, block, h.data() + r * hidden);
      }
    });
  }
  return logits;
}

// ------------------------------------------------------------------------------------------------ EAGLE head

// One step of an EAGLE draft head over rows (feature f_t, embedding e_{t+1}) [n, hidden] each: x = fc(norm(f) ‖
// norm(e)) (unit-scale norms: the head's norm scales are folded into fc's columns), then the head's decoder layer
// (keys/values stored at each row's slot, as `decoder`), then logits = readout(final_norm(x)) of rows
// `read_from`.. . Returns {x [n, hidden] (the predicted features), logits [n - read_from, vocab]}.
std::vector<at::Tensor> head_step(const at::Tensor& features, const at::Tensor& embeddings, int64_t fc, int64_t layer,
                                  const at::Tensor& keys, const at::Tensor& values, const at::Tensor& cos,
                                  const at::Tensor& sin, const at::Tensor& meta, const at::Tensor& extra_offsets,
                                  const at::Tensor& extra_slots, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                  double eps, double scaling, const at::Tensor& norm, double norm_eps, int64_t readout,
                                  int64_t vocab, int64_t read_from) {
  const at::Tensor f = features.to(at::kFloat).contiguous(), e = embeddings.to(at::kFloat).contiguous();
  TORCH_CHECK(f.dim() == 2 && e.sizes() == f.sizes() && f.size(1) % kLanes == 0, "head_step: features and embeddings [n, hidden]");
  const int64_t n = f.size(0), hidden = f.size(1);
  TORCH_CHECK(read_from >= 0 && read_from <= n, "head_step: read_from must be in 0..rows");
  const auto fc_parts = parts_of({fc});
  TORCH_CHECK(fc_parts[0]->k == 2 * hidden && fc_parts[0]->n == hidden, "head_step: fc must map 2·hidden to hidden");
  std::vector<float> ones(hidden, 1.0f), mixed(n * 2 * hidden);
  const float e32 = static_cast<float>(eps);
  {
    PhaseTimer timer(kNorm);
    for (int64_t r = 0; r < n; ++r) {
      rms_norm_rows(f.data_ptr<float>() + r * hidden, 1, hidden, ones.data(), e32, mixed.data() + r * 2 * hidden);
      rms_norm_rows(e.data_ptr<float>() + r * hidden, 1, hidden, ones.data(), e32, mixed.data() + (r * 2 + 1) * hidden);
    }
  }
  at::Tensor x = at::empty({n, hidden}, f.options());
  {
    PhaseTimer timer(kMatrices);
    apply_parts(fc_parts, mixed.data(), 2 * hidden, n, x.data_ptr<float>(), hidden, nullptr, 0);
  }
  const int64_t layer_ids[1] = {layer};
  decoder(x, at::IntArrayRef(layer_ids, 1), {keys}, {values}, {cos}, {sin}, 1, meta, extra_offsets, extra_slots, heads,
          kv_heads, head_dim, eps, scaling);
  const int64_t readout_ids[1] = {readout};
  at::Tensor logits = lm_head(x.narrow(0, read_from, n - read_from), norm, norm_eps,
                              at::IntArrayRef(readout_ids, 1), vocab, c10::nullopt, c10::nullopt, 0, false);
  return {x, logits};
}

}  // namespace sd
