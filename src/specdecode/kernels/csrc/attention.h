// The small per-row ops of a decoder layer (RMSNorm, RoPE, SiLU/GeLU gating, per-head norms) and attention over
// k rows: each row reduced over fixed chunks of kAttChunk key positions counted from 0, merged in chunk order,
// so a row's result depends only on the keys it sees; keys and values are stored in the float16 KV cache here.
//
// A part of the kernels' one translation unit: ops.cpp includes the parts in order.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "simd.h"

namespace sd {

constexpr int64_t kAttChunk = 128;  // keys per attention partial (part of the numerics: do not change lightly)
// Attention asks for its keys and values ahead from kPrefetchKeysFrom cached keys, in AVX-512 builds only. On a
// 2-core Zen 4 (AVX-512) the requests took a 4,096-key row from 5.18 to 3.85 ms; on a 2-core Zen 3 the AVX2 build
// was never faster with them and 6-27% slower at 1,024 keys (its arithmetic, at half the width, already hides the
// stream): benchmarks/attention_ab.py. Elsewhere the requests are compiled out. From 448 keys (was 1,024): at a
// SmolLM2-1.7B-shaped cache (32 key/value heads, 4 MB a layer at 500 keys) a one-row pass over 500 keys took
// 5.17-5.24 -> 4.50-4.60 ms, over 900 keys 9.1-9.4 -> 7.5-7.9 ms (two A/B runs, Zen 4); at SmolLM2-135M's cache
// 500 keys went 1.82 -> 1.55 ms in one run and level in the other; below ~300 keys the requests cost a little.
// Since then the requests follow the thread's own next task (`Ahead`): the next head's first keys after a head's
// last chunk, clipped to the keys its rows see (they used to run past a row's last key into unused slots). At the
// 1.7B shape, 24 layers over 500 keys 8.28 -> 7.22 and 6.44 -> 5.66 ms, over 900 keys 13.75 -> 13.07 and 10.89 ->
// 10.19 ms (two A/B runs, Zen 4, the VM's speed differing between them); the 135M shape level (within ±3% but for
// one 4-row case at 7% worse in one run and 1% better in the other).
#if SD_AVX512
constexpr bool kPrefetchKeys = true;
#else
constexpr bool kPrefetchKeys = false;
#endif
constexpr int64_t kPrefetchKeysFrom = 448;

// ------------------------------------------------------------------------------------------------ small ops

// y = (x · 1/sqrt(mean(x²) + eps)) · w, the sum of squares in 16 lanes then the fixed tree.
static void rms_norm_rows(const float* x, int64_t rows, int64_t n, const float* w, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    VF ss = vf_zero();
    for (int64_t i = 0; i < n; i += kLanes) {
      const VF v = vf_load(xr + i);
      ss = vf_fma(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(vf_hsum(ss) / static_cast<float>(n) + eps);
    float* yr = y + r * n;
    for (int64_t i = 0; i < n; i += kLanes) vf_store(yr + i, vf_mul(vf_mul(vf_load(xr + i), vf_set(inv)), vf_load(w + i)));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor xf = x.to(at::kFloat).contiguous(), wf = w.to(at::kFloat).contiguous();
  TORCH_CHECK(xf.dim() == 2 && xf.size(1) % kLanes == 0 && wf.numel() == xf.size(1), "rms_norm: bad shapes");
  at::Tensor y = at::empty_like(xf);
  rms_norm_rows(xf.data_ptr<float>(), xf.size(0), xf.size(1), wf.data_ptr<float>(), static_cast<float>(eps),
                y.data_ptr<float>());
  return y;
}

// x·cos + swap_halves(x)·signed_sin per head (transformers' rotate_half, its sign folded into the table), with
// row r's table rows cos[r] / sin[r].
static void rope_rows(float* x, int64_t rows, int64_t heads, int64_t ld, int64_t d, const float* const* cos,
                      const float* const* sin) {
  const int64_t half = d / 2;
  float tmp[256];
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos[r];
    const float* s = sin[r];
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * ld + h * d;
      for (int64_t i = 0; i < half; ++i) tmp[i] = v[i] * c[i] + v[i + half] * s[i];
      for (int64_t i = half; i < d; ++i) tmp[i] = v[i] * c[i] + v[i - half] * s[i];
      std::memcpy(v, tmp, d * sizeof(float));
    }
  }
}

// a = silu(gate) · up = gate / (1 + exp(−gate)) · up
static void silu_mul_rows(const float* gu, int64_t rows, int64_t inter, float* a) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gu + r * 2 * inter;
    const float* up = gate + inter;
    float* out = a + r * inter;
    for (int64_t i = 0; i < inter; i += kLanes) {
      const VF gv = vf_load(gate + i);
      const VF e = vf_exp(vf_sub(vf_zero(), gv));
      alignas(64) float num[kLanes], den[kLanes], upl[kLanes];
      vf_lanes(gv, num);
      vf_lanes(vf_add(vf_set(1.0f), e), den);
      vf_lanes(vf_load(up + i), upl);
      for (int l = 0; l < kLanes; ++l) out[i + l] = (num[l] / den[l]) * upl[l];
    }
  }
}

// a = gelu_tanh(gate) · up, gelu_tanh(g) = g/2 · (1 + tanh(√(2/π)·(g + 0.044715·g³))), tanh(y) = 1 − 2/(e^{2y} + 1)
static void gelu_mul_rows(const float* gu, int64_t rows, int64_t inter, float* a) {
  const float beta = 0.7978845608028654f, kappa = 0.044715f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gu + r * 2 * inter;
    const float* up = gate + inter;
    float* out = a + r * inter;
    for (int64_t i = 0; i < inter; i += kLanes) {
      const VF g = vf_load(gate + i);
      const VF inner = vf_mul(vf_set(beta), vf_add(g, vf_mul(vf_set(kappa), vf_mul(vf_mul(g, g), g))));
      const VF e = vf_exp(vf_add(inner, inner));
      alignas(64) float gl[kLanes], den[kLanes], upl[kLanes];
      vf_lanes(g, gl);
      vf_lanes(vf_add(e, vf_set(1.0f)), den);
      vf_lanes(vf_load(up + i), upl);
      for (int l = 0; l < kLanes; ++l) {
        const float t = 1.0f - 2.0f / den[l];
        out[i + l] = (0.5f * gl[l] * (1.0f + t)) * upl[l];
      }
    }
  }
}

// An RMSNorm over each of `heads` heads of d values (row r's heads at x + r·ld), in place.
static void norm_heads(float* x, int64_t rows, int64_t heads, int64_t ld, int64_t d, const float* w, float eps) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) rms_norm_rows(x + r * ld + h * d, 1, d, w, eps, x + r * ld + h * d);
}

// ------------------------------------------------------------------------------------------------ attention

// Rows of one call: which cache they use, the slot their key/value goes to, and what they see: logical key
// positions 0..prefix-1 are slots 0..prefix-1, then extra slots (a tree row's ancestors and itself).
struct RowsView {
  const int32_t* meta;           // [rows][4]: cache, write slot, position (the RoPE table's row), prefix
  const int64_t* extra_offsets;  // [rows + 1], or null: no row has extras
  const int64_t* extra_slots;
  int64_t rows;
  int64_t cache(int64_t r) const { return meta[4 * r]; }
  int64_t slot(int64_t r) const { return meta[4 * r + 1]; }
  int64_t position(int64_t r) const { return meta[4 * r + 2]; }
  int64_t prefix(int64_t r) const { return meta[4 * r + 3]; }
  int64_t extras(int64_t r) const { return extra_offsets == nullptr ? 0 : extra_offsets[r + 1] - extra_offsets[r]; }
  int64_t visible(int64_t r) const { return prefix(r) + extras(r); }
  int64_t slot_of(int64_t r, int64_t i) const {
    const int64_t p = prefix(r);
    return i < p ? i : extra_slots[extra_offsets[r] + (i - p)];
  }
};

struct CacheView {
  // float16, as llama.cpp keeps its cache (half the bytes to read per step; sums stay float32)
  uint16_t* keys;    // [layers][kv_heads][capacity / 16][head_dim][16]: tiles of 16 keys, so 16 keys are one load
  uint16_t* values;  // [layers][kv_heads][capacity][head_dim]
  int64_t capacity;
};

struct AttnShape {
  int64_t heads, kv_heads, head_dim;
  float scaling;
  int64_t window = 0;  // > 0: each row sees only the last `window` of its visible keys
  // The first logical key position row r attends to.
  int64_t first(const RowsView& rows, int64_t r) const {
    const int64_t n = rows.visible(r);
    return window > 0 && n > window ? n - window : 0;
  }
};

// One task: the rows `rows_in` (of one cache) that see keys [c·kAttChunk, ...), one key/value head h. Each key
// tile and value row is loaded once for all those rows and the group's query heads. Per (row, query head): the
// chunk's max score m, sum l of exp(score − m), and o = Σ exp(score − m)·v, each lane and sum in a fixed order
// that depends only on that row's keys.
struct Partial {
  float* base;  // [rows][chunks][heads][d + 2]: m, l, o (heads counted from head0)
  int64_t chunks, heads, d;
  int64_t head0 = 0;
  float* at(int64_t r, int64_t c, int64_t head) const {
    return base + ((r * chunks + c) * heads + head - head0) * (d + 2);
  }
};

struct Scratch {
  std::vector<float> scores, acc;
  std::vector<uint16_t> gathered;
  std::vector<const uint16_t*> tiles;
};

// Scores of NG query heads (q rows d apart) against B ≤ 4 key tiles: out[g·kAttChunk + 16·b + lane] =
// scaling · Σ_e q[g][e]·tile_b[e][lane], each lane one chain of fused multiply-adds over e in order. The tiles'
// loads are shared by the heads.
template <int NG, int B>
static inline void scores_block(const float* q, int64_t d, const uint16_t* const* tiles, float scaling, float* out) {
  VF acc[NG][B];
  for (int g = 0; g < NG; ++g)
    for (int b = 0; b < B; ++b) acc[g][b] = vf_zero();
  for (int64_t e = 0; e < d; ++e) {
    VF k[B];
    for (int b = 0; b < B; ++b) k[b] = vf_from_half(tiles[b] + e * kLanes);
    for (int g = 0; g < NG; ++g) {
      const VF qe = vf_set(q[g * d + e]);
      for (int b = 0; b < B; ++b) acc[g][b] = vf_fma(qe, k[b], acc[g][b]);
    }
  }
  const VF scale = vf_set(scaling);
  for (int g = 0; g < NG; ++g)
    for (int b = 0; b < B; ++b) vf_store(out + g * kAttChunk + b * kLanes, vf_mul(acc[g][b], scale));
}

static void scores_tiles(int heads, int blocks, const float* q, int64_t d, const uint16_t* const* tiles,
                         float scaling, float* out) {
#define SD_SCORES(NG)                                                        \
  switch (blocks) {                                                          \
    case 1: return scores_block<NG, 1>(q, d, tiles, scaling, out);           \
    case 2: return scores_block<NG, 2>(q, d, tiles, scaling, out);           \
    case 3: return scores_block<NG, 3>(q, d, tiles, scaling, out);           \
    default: return scores_block<NG, 4>(q, d, tiles, scaling, out);          \
  }
  switch (heads) {
    case 1: SD_SCORES(1)
    case 2: SD_SCORES(2)
    case 3: SD_SCORES(3)
    default: SD_SCORES(4)
  }
#undef SD_SCORES
}

// For NG query heads: acc_g[0 .. 16·V) += Σ_j p_g[j]·rows[j][offset ...], j in order (the value rows' loads
// shared by the heads; acc_g = acc + g·stride, p_g = p + g·kAttChunk).
template <int NG, int V>
static inline void accumulate_values(float* acc, int64_t stride, const float* p, const uint16_t* const* rows,
                                     int64_t n, int64_t offset) {
  VF o[NG][V];
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < V; ++v) o[g][v] = vf_load(acc + g * stride + v * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* row = rows[j] + offset;
    VF x[V];
    for (int v = 0; v < V; ++v) x[v] = vf_from_half(row + v * kLanes);
    for (int g = 0; g < NG; ++g) {
      const VF pj = vf_set(p[g * kAttChunk + j]);
      for (int v = 0; v < V; ++v) o[g][v] = vf_fma(pj, x[v], o[g][v]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < V; ++v) vf_store(acc + g * stride + v * kLanes, o[g][v]);
}

// The value accumulation of `heads` query heads over n keys, register-blocked for the usual head sizes.
static void accumulate_heads(int64_t heads, int64_t vectors, float* acc, int64_t stride, const float* p,
                             const uint16_t* const* rows, int64_t n) {
  int64_t g = 0;
  if (vectors == 4) {
    for (; g + 3 <= heads; g += 3) accumulate_values<3, 4>(acc + g * stride, stride, p + g * kAttChunk, rows, n, 0);
    for (; g < heads; ++g) accumulate_values<1, 4>(acc + g * stride, stride, p + g * kAttChunk, rows, n, 0);
  } else if (vectors == 8) {
    for (; g + 2 <= heads; g += 2) accumulate_values<2, 8>(acc + g * stride, stride, p + g * kAttChunk, rows, n, 0);
    for (; g < heads; ++g) accumulate_values<1, 8>(acc + g * stride, stride, p + g * kAttChunk, rows, n, 0);
  } else {
    for (; g < heads; ++g)
      for (int64_t v = 0; v < vectors; v += 4)
        if (v + 4 <= vectors)
          accumulate_values<1, 4>(acc + g * stride + v * kLanes, stride, p + g * kAttChunk, rows, n, v * kLanes);
        else
          for (int64_t u = v; u < vectors; ++u)
            accumulate_values<1, 1>(acc + g * stride + u * kLanes, stride, p + g * kAttChunk, rows, n, u * kLanes);
  }
}

// Ask for [p, p + bytes) into L2 (prefetcht1): the KV cache of a long context streams from DRAM, and without
// these requests its reads did not overlap the arithmetic on AVX-512 (kPrefetchKeys).
static inline void prefetch_to_l2(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(p) + at, 0, 2);
}

// Slots [first, first + n) of a cache's keys or values (2·d bytes a slot, contiguous in slot order), clipped to
// its capacity; nothing when `stream` is false. (A function, not a lambda: g++ 12 dropped the prefetches of the
// same code written as a capturing lambda in attend_chunk; check `objdump -d | grep prefetcht1` after changes.)
static inline void prefetch_slots(bool stream, const uint16_t* base, int64_t first, int64_t n, int64_t d,
                                  int64_t capacity) {
  if (!stream) return;
  n = std::min(n, capacity - first);
  if (n > 0) prefetch_to_l2(base + first * d, n * d * 2);
}

// The cached keys and values a thread reads after the chunk it is on: `slots` consecutive slots from `first` of
// key/value head h's cache in `layer` (nothing when slots is 0). attend_chunk asks for them while it computes, so
// the stream does not stall where one task's keys end and the next task's (another head: another region) begin.
struct Ahead {
  const CacheView* cache = nullptr;
  int64_t h = 0, first = 0, slots = 0;
};

// The slots of chunk c that the rows `rows_in` (of one cache, key/value head h) read from the cache's prefix part
// (tree rows' extra keys are gathered apart and not streamed).
static Ahead chunk_ahead(const RowsView& rows, const CacheView& cache, const std::vector<int64_t>& rows_in, int64_t h,
                         int64_t c) {
  int64_t end = 0;
  for (int64_t r : rows_in) end = std::max(end, std::min(rows.prefix(r), (c + 1) * kAttChunk));
  return Ahead{&cache, h, c * kAttChunk, std::max<int64_t>(0, end - c * kAttChunk)};
}

static void attend_chunk(const RowsView& rows, const CacheView& cache, int64_t layer, const AttnShape& shape,
                         const float* q, const std::vector<int64_t>& rows_in, const std::vector<int64_t>& out_rows,
                         int64_t h, int64_t c, const Partial& partial, Scratch& scratch, const Ahead& ahead) {
  const int64_t d = shape.head_dim, group = shape.heads / shape.kv_heads, tile = d * kLanes;
  const int64_t cap = cache.capacity, nrows = static_cast<int64_t>(rows_in.size());
  const int64_t per_chunk = kAttChunk / kLanes;
  const uint16_t* kbase = cache.keys + (layer * shape.kv_heads + h) * d * cap;
  const uint16_t* vbase = cache.values + (layer * shape.kv_heads + h) * cap * d;
  const int64_t i0 = c * kAttChunk;
  scratch.scores.resize(nrows * group * kAttChunk);
  scratch.tiles.resize(nrows * per_chunk);
  scratch.acc.resize(nrows * group * d);
  int64_t gathers = 0, most = 0;
  std::vector<int64_t> count(nrows), skip(nrows);  // positions i0 .. i0+count; the first `skip` outside the window
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t r = rows_in[i];
    count[i] = std::min(rows.visible(r), i0 + kAttChunk) - i0;
    skip[i] = std::max<int64_t>(0, shape.first(rows, r) - i0);
    most = std::max(most, count[i]);
    const int64_t prefix = rows.prefix(r);
    for (int64_t b = 0; b * kLanes < count[i]; ++b) {
      const int64_t first = i0 + b * kLanes, valid = std::min<int64_t>(kLanes, count[i] - b * kLanes);
      if (first + valid > prefix) ++gathers;
    }
  }
  scratch.gathered.resize(gathers * tile);
  gathers = 0;
  for (int64_t i = 0; i < nrows; ++i) {  // each block of 16 positions: its cache tile, or the row's keys gathered
    const int64_t r = rows_in[i], prefix = rows.prefix(r);
    for (int64_t b = 0; b * kLanes < count[i]; ++b) {
      const int64_t first = i0 + b * kLanes, valid = std::min<int64_t>(kLanes, count[i] - b * kLanes);
      if (first + valid <= prefix) {
        scratch.tiles[i * per_chunk + b] = kbase + (first / kLanes) * tile;  // lanes past `valid`: masked below
        continue;
      }
      uint16_t* dst = scratch.gathered.data() + (gathers++) * tile;
      std::fill(dst, dst + tile, uint16_t{0});
      for (int64_t j = 0; j < valid; ++j) {
        const int64_t slot = rows.slot_of(r, first + j);
        const uint16_t* src = kbase + (slot / kLanes) * tile + slot % kLanes;
        for (int64_t e = 0; e < d; ++e) dst[e * kLanes + j] = src[e * kLanes];
      }
      scratch.tiles[i * per_chunk + b] = dst;
    }
  }
  const int64_t most_blocks = (most + kLanes - 1) / kLanes;
  // The keys and values ahead of their use: this chunk's first value rows, then while the scores are computed the
  // next chunk's key tiles, while the values are summed the next chunk's value rows (`ahead`: the chunk this thread
  // takes next, clipped to the keys its rows see). Below kPrefetchKeysFrom cached keys the requests cost more than
  // they save.
  const bool stream = kPrefetchKeys && rows.visible(rows_in.back()) >= kPrefetchKeysFrom;
  const bool onward = stream && ahead.slots > 0;
  const CacheView& next = onward ? *ahead.cache : cache;
  const uint16_t* next_keys = next.keys + (layer * shape.kv_heads + ahead.h) * d * next.capacity;
  const uint16_t* next_values = next.values + (layer * shape.kv_heads + ahead.h) * next.capacity * d;
  // the next chunk's slots in equal parts of whole tiles over this chunk's key blocks and value steps
  const auto share = [&](int64_t steps) { return (ahead.slots + steps * kLanes - 1) / (steps * kLanes) * kLanes; };
  const int64_t key_share = share((most_blocks + 3) / 4), value_share = share((most + kLanes - 1) / kLanes);
  prefetch_slots(stream, vbase, i0, std::min<int64_t>(2 * kLanes, most), d, cap);
  for (int64_t b0 = 0; b0 < most_blocks; b0 += 4) {  // four tiles stay in L1 for every row and query head
    const int64_t from = b0 / 4 * key_share;
    prefetch_slots(onward, next_keys, ahead.first + from, std::min(key_share, ahead.slots - from), d, next.capacity);
    for (int64_t i = 0; i < nrows; ++i) {
      const int64_t blocks = std::min<int64_t>(4, (count[i] + kLanes - 1) / kLanes - b0);
      if (blocks <= 0) continue;
      const uint16_t* const* tp = scratch.tiles.data() + i * per_chunk + b0;
      const float* qrow = q + rows_in[i] * shape.heads * d + h * group * d;
      float* sg = scratch.scores.data() + i * group * kAttChunk + b0 * kLanes;
      for (int64_t g = 0; g < group; g += 4) {
        const int heads = static_cast<int>(std::min<int64_t>(4, group - g));
        scores_tiles(heads, static_cast<int>(blocks), qrow + g * d, d, tp, shape.scaling, sg + g * kAttChunk);
      }
    }
  }
  for (int64_t i = 0; i < nrows; ++i) {  // softmax weights per (row, query head)
    const int64_t n = count[i], lo = skip[i], blocks = (n + kLanes - 1) / kLanes;
    for (int64_t g = 0; g < group; ++g) {
      float* sc = scratch.scores.data() + (i * group + g) * kAttChunk;
      // padding lanes and positions before the window: a valid score for the max, masked to zero below
      for (int64_t j = n; j < blocks * kLanes; ++j) sc[j] = sc[lo];
      for (int64_t j = 0; j < lo; ++j) sc[j] = sc[lo];
      VF mv = vf_load(sc);
      for (int64_t b = 1; b < blocks; ++b) mv = vf_max(mv, vf_load(sc + b * kLanes));
      const float m = vf_hmax(mv);  // a max: exact in any order
      VF l = vf_zero();
      for (int64_t b = 0; b < blocks; ++b) {
        VF p = vf_exp(vf_sub(vf_load(sc + b * kLanes), vf_set(m)));
        if ((b + 1) * kLanes > n || b * kLanes < lo) {
          alignas(64) float mask[kLanes];
          for (int j = 0; j < kLanes; ++j) mask[j] = b * kLanes + j < n && b * kLanes + j >= lo ? 1.0f : 0.0f;
          p = vf_mul(p, vf_load(mask));
        }
        vf_store(sc + b * kLanes, p);
        l = vf_add(l, p);
      }
      float* out = partial.at(out_rows[i], c, h * group + g);
      out[0] = m;
      out[1] = vf_hsum(l);
    }
  }
  const int64_t vectors = d / kLanes;
  std::fill(scratch.acc.begin(), scratch.acc.end(), 0.0f);
  for (int64_t j0 = 0; j0 < most; j0 += kLanes) {  // 16 value rows stay in L1 for every row and query head
    prefetch_slots(stream, vbase, i0 + j0 + 2 * kLanes, std::min<int64_t>(kLanes, most - j0 - 2 * kLanes), d, cap);
    const int64_t from = j0 / kLanes * value_share;
    prefetch_slots(onward, next_values, ahead.first + from, std::min(value_share, ahead.slots - from), d,
                   next.capacity);
    for (int64_t i = 0; i < nrows; ++i) {
      const int64_t r = rows_in[i], j1 = std::min(count[i], j0 + kLanes);
      if (j0 >= j1) continue;
      const uint16_t* vrows[kLanes];
      for (int64_t j = j0; j < j1; ++j) vrows[j - j0] = vbase + rows.slot_of(r, i0 + j) * d;
      accumulate_heads(group, vectors, scratch.acc.data() + i * group * d, d,
                       scratch.scores.data() + i * group * kAttChunk + j0, vrows, j1 - j0);
    }
  }
  for (int64_t i = 0; i < nrows; ++i)
    for (int64_t g = 0; g < group; ++g)
      std::memcpy(partial.at(out_rows[i], c, h * group + g) + 2, scratch.acc.data() + (i * group + g) * d,
                  d * sizeof(float));
}

// Row r's chunks: [first_chunk, end_chunk), those holding a key it sees (its window's start on).
static inline int64_t end_chunk(const RowsView& rows, int64_t r) {
  return (rows.visible(r) + kAttChunk - 1) / kAttChunk;
}
static inline int64_t first_chunk(const RowsView& rows, const AttnShape& shape, int64_t r) {
  return shape.first(rows, r) / kAttChunk;
}
static inline bool sees_chunk(const RowsView& rows, const AttnShape& shape, int64_t r, int64_t c) {
  return first_chunk(rows, shape, r) <= c && c < end_chunk(rows, r);
}

// dst[0 .. d) = row r's attention output for one query head: its chunks' partials (partial's row `at`) merged
// in chunk order, o = Σ_c exp(m_c − m)·o_c / Σ_c exp(m_c − m)·l_c with m = max_c m_c (acc: d floats of scratch).
static void merge_chunks(const RowsView& rows, const AttnShape& shape, const Partial& partial, int64_t r,
                         int64_t at, int64_t head, float* acc, float* dst) {
  const int64_t d = shape.head_dim;
  const int64_t mine = end_chunk(rows, r), first = first_chunk(rows, shape, r);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t c = first; c < mine; ++c) m = std::max(m, partial.at(at, c, head)[0]);
  float l = 0.0f;
  std::fill(acc, acc + d, 0.0f);
  for (int64_t c = first; c < mine; ++c) {
    const float* p = partial.at(at, c, head);
    const float w = exp_scalar(p[0] - m);
    l = l + p[1] * w;
    for (int64_t e = 0; e < d; ++e) acc[e] = acc[e] + p[2 + e] * w;
  }
  for (int64_t e = 0; e < d; ++e) dst[e] = acc[e] / l;
}

// Many rows (a prefill, a large batched pass): one task per (cache, key/value head, block of consecutive rows) walks
// every chunk those rows see with its partials in the task's own scratch, then merges them, so the partials
// never fill a [rows][chunks] array in memory (at 2,048 rows 77 MB a layer, freshly faulted in each call). The
// same attend_chunk and merge_chunks as the per-chunk tasks below: every row's numbers are the same bits.
static void attention_row_blocks(const RowsView& rows, const std::vector<CacheView>& caches, int64_t layer,
                                 const AttnShape& shape, const float* q, float* out, int64_t rows_per_block) {
  const int64_t d = shape.head_dim, group = shape.heads / shape.kv_heads;
  struct Task {
    int64_t cache, h, cost;
    std::vector<int64_t> rows;
  };
  std::vector<Task> tasks;
  for (int64_t ci = 0; ci < static_cast<int64_t>(caches.size()); ++ci) {
    std::vector<int64_t> mine;
    for (int64_t r = 0; r < rows.rows; ++r)
      if (rows.cache(r) == ci) mine.push_back(r);
    for (size_t b = 0; b < mine.size(); b += rows_per_block) {
      std::vector<int64_t> block(mine.begin() + b, mine.begin() + std::min(mine.size(), b + rows_per_block));
      int64_t cost = 0;
      for (int64_t r : block) cost += rows.visible(r) - shape.first(rows, r);
      for (int64_t h = 0; h < shape.kv_heads; ++h) tasks.push_back(Task{ci, h, cost, block});
    }
  }
  // the costliest first, taken one at a time by whichever thread is free: the blocks' costs differ (causal rows)
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    std::vector<float> local, acc(d);
    std::vector<int64_t> seeing, slots;
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) {
      const Task& task = tasks[t];
      const int64_t n = static_cast<int64_t>(task.rows.size());
      int64_t chunks = 0;
      for (int64_t r : task.rows) chunks = std::max(chunks, end_chunk(rows, r));
      local.resize(n * chunks * group * (d + 2));
      // local index i stands for task.rows[i]: the Partial's rows are 0 .. n-1, its heads this group's
      const Partial partial{local.data(), chunks, group, d, task.h * group};
      for (int64_t c = 0; c < chunks; ++c) {
        seeing.clear();
        slots.clear();
        for (int64_t i = 0; i < n; ++i) {
          const int64_t r = task.rows[i];
          if (!sees_chunk(rows, shape, r, c)) continue;
          seeing.push_back(r);
          slots.push_back(i);
        }
        if (!seeing.empty()) {
          const CacheView& cache = caches[task.cache];
          const Ahead ahead = chunk_ahead(rows, cache, task.rows, task.h, c + 1);  // the rows' next chunk
          attend_chunk(rows, cache, layer, shape, q, seeing, slots, task.h, c, partial, scratch, ahead);
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = task.rows[i];
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = task.h * group + g;
          merge_chunks(rows, shape, partial, r, i, head, acc.data(), out + r * shape.heads * d + head * d);
        }
      }
    }
  });
}

// out[r, head·d ...] = softmax(q·K^T · scaling) V over each row's visible keys: the chunks of each row reduced
// as above, then merged in chunk order.
static void attention_rows(const RowsView& rows, const std::vector<CacheView>& caches, int64_t layer,
                           const AttnShape& shape, const float* q, float* out) {
  constexpr int64_t kRowsPerTask = 32, kRowBlocksFrom = 128;  // below 128 rows, chunks balance the threads better
  if (rows.rows >= kRowBlocksFrom) return attention_row_blocks(rows, caches, layer, shape, q, out, kRowsPerTask);
  const int64_t d = shape.head_dim;
  int64_t chunks = 0;
  for (int64_t r = 0; r < rows.rows; ++r) chunks = std::max(chunks, end_chunk(rows, r));
  struct Task {
    int64_t cache, h, c;
    std::vector<int64_t> rows;
  };
  std::vector<Task> tasks;
  for (int64_t ci = 0; ci < static_cast<int64_t>(caches.size()); ++ci) {
    for (int64_t h = 0; h < shape.kv_heads; ++h) {
      for (int64_t c = 0; c < chunks; ++c) {
        Task task{ci, h, c, {}};
        for (int64_t r = 0; r < rows.rows; ++r) {
          if (rows.cache(r) != ci || !sees_chunk(rows, shape, r, c)) continue;
          task.rows.push_back(r);
          if (static_cast<int64_t>(task.rows.size()) == kRowsPerTask) {
            tasks.push_back(task);
            task.rows.clear();
          }
        }
        if (!task.rows.empty()) tasks.push_back(std::move(task));
      }
    }
  }
  std::vector<float> partials(rows.rows * chunks * shape.heads * (d + 2));
  const Partial partial{partials.data(), chunks, shape.heads, d};
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    Scratch scratch;
    for (int64_t t = t0; t < t1; ++t) {  // a thread's tasks in order: a head's chunks, then the next head's
      const Task& task = tasks[t];
      Ahead ahead;
      if (t + 1 < t1) {
        const Task& next = tasks[t + 1];
        ahead = chunk_ahead(rows, caches[next.cache], next.rows, next.h, next.c);
      }
      attend_chunk(rows, caches[task.cache], layer, shape, q, task.rows, task.rows, task.h, task.c, partial, scratch,
                   ahead);
    }
  });
  at::parallel_for(0, rows.rows * shape.heads, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(d);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / shape.heads, head = i % shape.heads;
      merge_chunks(rows, shape, partial, r, r, head, acc.data(), out + r * shape.heads * d + head * d);
    }
  });
}

static std::vector<CacheView> cache_views(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                          const AttnShape& shape) {
  TORCH_CHECK(keys.size() == values.size() && !keys.empty(), "keys and values: one tensor per cache");
  std::vector<CacheView> views;
  for (size_t i = 0; i < keys.size(); ++i) {
    const at::Tensor& k = keys[i];
    const at::Tensor& v = values[i];
    TORCH_CHECK(k.scalar_type() == at::kHalf && v.scalar_type() == at::kHalf && k.is_contiguous() &&
                    v.is_contiguous() && k.dim() == 5 && v.dim() == 4,
                "caches: contiguous float16 keys [layers, kv_heads, capacity / 16, head_dim, 16] and values "
                "[layers, kv_heads, capacity, head_dim]");
    TORCH_CHECK(k.size(1) == shape.kv_heads && k.size(3) == shape.head_dim && k.size(4) == kLanes &&
                    v.size(3) == shape.head_dim && v.size(2) == k.size(2) * kLanes && v.size(0) == k.size(0),
                "caches do not match the attention shape");
    views.push_back({reinterpret_cast<uint16_t*>(k.data_ptr<at::Half>()),
                     reinterpret_cast<uint16_t*>(v.data_ptr<at::Half>()), v.size(2)});
  }
  return views;
}

static RowsView rows_view(const at::Tensor& meta, const at::Tensor& extra_offsets, const at::Tensor& extra_slots) {
  TORCH_CHECK(meta.scalar_type() == at::kInt && meta.is_contiguous() && meta.dim() == 2 && meta.size(1) == 4,
              "rows: contiguous int32 [rows, 4]");
  TORCH_CHECK(extra_offsets.scalar_type() == at::kLong && extra_offsets.is_contiguous() &&
                  (extra_offsets.numel() == meta.size(0) + 1 || extra_offsets.numel() == 0) &&
                  extra_slots.scalar_type() == at::kLong && extra_slots.is_contiguous(),
              "extras: int64 offsets [rows + 1] (or none) and slots");
  const bool none = extra_offsets.numel() == 0;
  if (!none)
    TORCH_CHECK(extra_offsets.data_ptr<int64_t>()[0] == 0 &&
                    extra_offsets.data_ptr<int64_t>()[meta.size(0)] == extra_slots.numel(),
                "extras: offsets must span the slots");
  return {meta.data_ptr<int32_t>(), none ? nullptr : extra_offsets.data_ptr<int64_t>(), extra_slots.data_ptr<int64_t>(),
          meta.size(0)};
}

static void check_rows(const RowsView& rows, const std::vector<CacheView>& caches) {
  for (int64_t r = 0; r < rows.rows; ++r) {
    TORCH_CHECK(rows.cache(r) >= 0 && rows.cache(r) < static_cast<int64_t>(caches.size()), "row ", r, ": bad cache");
    const int64_t cap = caches[rows.cache(r)].capacity;
    TORCH_CHECK(rows.slot(r) >= 0 && rows.slot(r) < cap, "row ", r, ": write slot outside the cache");
    TORCH_CHECK(rows.prefix(r) >= 0 && rows.prefix(r) <= cap && rows.visible(r) >= 1, "row ", r, ": bad prefix");
    TORCH_CHECK(rows.extras(r) >= 0, "row ", r, ": bad extras");
    for (int64_t i = 0; i < rows.extras(r); ++i) {
      const int64_t slot = rows.extra_slots[rows.extra_offsets[r] + i];
      TORCH_CHECK(slot >= 0 && slot < cap, "row ", r, ": extra slot outside the cache");
    }
  }
}

// Store rows' keys (transposed) and values at their slots of layer `layer`.
static void store_kv(const RowsView& rows, const std::vector<CacheView>& caches, int64_t layer, const AttnShape& shape,
                     const float* k, const float* v, int64_t ld) {
  const int64_t d = shape.head_dim;
  for (int64_t r = 0; r < rows.rows; ++r) {
    const CacheView& cache = caches[rows.cache(r)];
    const int64_t slot = rows.slot(r);
    for (int64_t h = 0; h < shape.kv_heads; ++h) {
      const float* kr = k + r * ld + h * d;
      const float* vr = v + r * ld + h * d;
      uint16_t* kd = cache.keys + ((layer * shape.kv_heads + h) * cache.capacity + (slot / kLanes) * kLanes) * d +
                     slot % kLanes;
      uint16_t* vd = cache.values + ((layer * shape.kv_heads + h) * cache.capacity + slot) * d;
      for (int64_t e = 0; e < d; ++e) {  // rounded to nearest (even), the same on every instruction set
        kd[e * kLanes] = c10::Half(kr[e]).x;
        vd[e] = c10::Half(vr[e]).x;
      }
    }
  }
}

at::Tensor attention(const at::Tensor& q, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                     const at::Tensor& meta, const at::Tensor& extra_offsets, const at::Tensor& extra_slots,
                     int64_t layer, int64_t heads, int64_t kv_heads, double scaling, int64_t window) {
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  TORCH_CHECK(qf.dim() == 3 && qf.size(1) == heads && heads % kv_heads == 0, "attention: q must be [rows, heads, d]");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  const AttnShape shape{heads, kv_heads, qf.size(2), static_cast<float>(scaling), window};
  TORCH_CHECK(shape.head_dim % kLanes == 0 && shape.head_dim <= 256, "head_dim must be a multiple of 16, <= 256");
  const auto caches = cache_views(keys, values, shape);
  const RowsView rows = rows_view(meta, extra_offsets, extra_slots);
  check_rows(rows, caches);
  TORCH_CHECK(rows.rows == qf.size(0), "attention: one meta row per query row");
  at::Tensor out = at::empty_like(qf);
  attention_rows(rows, caches, layer, shape, qf.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

}  // namespace sd
