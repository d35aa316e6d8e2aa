// The row-invariant quantized linear layer: activation rows quantized each on its own (per group, to int16, or
// int8 for vpdpbusd), then integer dot products against each 16-output weight tile, unpacked once for a block
// of rows, with each output's float accumulation over groups in one fixed order.
//
// tile_rows is one template per weight format and row count (tile_fn_of picks the instance from the Matrix, so the
// inner loops hold no branch on either); its parameters:
//   R          rows in this block, 1..kRowBlock: each row's 16 integer accumulators stay in registers (pinned: see
//              vi_pin), and each group of the tile is loaded and unpacked once for all R rows;
//   G          the group size g (16 or 32): inputs per scale, the length of each exact integer dot product;
//   PACKING    how the integers u are held (a Packing, Matrix::packing; layouts at Matrix in weights.h): one byte
//              per weight; 4-bit nibbles, two to a byte; or 5-bit weights as nibbles plus a plane of their fifth
//              bits, or-ed back into the unpacked nibbles (16 added where the bit is set) before the dot products;
//   SCALES     how the scales and offsets are stored, a ScaleKind (Matrix::kind): float32, float16, or a K-quant's
//              int8 multiplier per group times a float16 factor per super-block;
//   SYMMETRIC  a symmetric type (Matrix::sym >= 0): w = s·(u − sym), so Σ w·x = s·d·(Σ u·xq − sym·Σ xq) and there
//              are no offsets; else w = s·u + m, m the group's offset (Q4_1, Q5_1, K-quants), added as m·d·Σ xq;
//   QUADS      the activations are int8 quads for vpdpbusd (the quad layout: SD_DOT8 builds, Matrix::abits == 8);
//              else int16 pairs (int8 activations included, where vpdpbusd is missing: the same integer sums).
// Every packing yields the same integers u in the same lanes, so the same sums and bitwise the same outputs.
//
// A part of the kernels' one translation unit: ops.cpp includes the parts in order.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <limits>
#include <memory>
#include <vector>

#include "weights.h"

namespace sd {

constexpr int64_t kPrefetchGroups = 16;  // weight groups tile_rows asks for ahead of their use

// ------------------------------------------------------------------------------------------------ activations

#if SD_AVX512 && defined(__AVX512VNNI__)
#define SD_DOT8 1  // int8 activations run on vpdpbusd (4 products per lane); elsewhere on the int16 path, same sums
#else
#define SD_DOT8 0
#endif

// Rows quantized per group of g to `bits` (16 or 8) bits: x ≈ d·q, d = max|x| / (2^(bits−1) − 1); sum = Σq per
// group (exact integers). int16 values go to q; 8-bit ones on vpdpbusd builds to q8 instead.
struct QuantRows {
  int64_t rows = 0, k = 0, g = 0, groups = 0, bits = 16;
  std::vector<int16_t> q;
  std::vector<int8_t> q8;
  std::vector<float> d, dsum;  // dsum = d · float(sum)
  std::vector<int32_t> sum;
  bool packed8() const { return SD_DOT8 && bits == 8; }
};

static void quantize_group(const float* x, int64_t g, int64_t bits, int16_t* q, int8_t* q8, float& d, int32_t& sum) {
  VF amax = vf_zero();
  for (int64_t i = 0; i < g; i += kLanes) amax = vf_max(amax, vf_abs(vf_load(x + i)));
  const float m = vf_hmax(amax);
  if (!(m > 0.0f) || !std::isfinite(m)) {  // all zeros (or non-finite input: poisoned, as the float path would be)
    if (q != nullptr) std::fill(q, q + g, 0);
    if (q8 != nullptr) std::fill(q8, q8 + g, 0);
    d = m > 0.0f ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    sum = 0;
    return;
  }
  const float top = bits == 8 ? 127.0f : 32767.0f;
  const float inv = top / m;
  d = m / top;
  alignas(64) int16_t values[32];
  VI s = vi_zero();
  for (int64_t i = 0; i < g; i += kLanes) {
    VF v = vf_mul(vf_load(x + i), vf_set(inv));
    v = vf_min(vf_max(vf_round(v), vf_set(-top)), vf_set(top));
    const VI iv = vi_quantize(v);
    vi_store16(q != nullptr ? q + i : values + i, iv);
    s = vi_add(s, iv);
  }
  sum = vi_hsum(s);
  if (q8 != nullptr)
    for (int64_t i = 0; i < g; ++i) q8[i] = static_cast<int8_t>(values[i]);
}

static void quantize_rows(const float* x, int64_t ldx, int64_t rows, int64_t k, int64_t g, int64_t bits,
                          QuantRows& out) {
  out.rows = rows;
  out.k = k;
  out.g = g;
  out.bits = bits;
  out.groups = k / g;
  if (out.packed8()) {
    out.q8.resize(rows * k);
  } else {
    out.q.resize(rows * k);
  }
  out.d.resize(rows * out.groups);
  out.dsum.resize(rows * out.groups);
  out.sum.resize(rows * out.groups);
  const int64_t groups = out.groups;
  const bool packed = out.packed8();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < groups; ++j) {
        const int64_t at = r * groups + j, offset = r * k + j * g;
        quantize_group(x + r * ldx + j * g, g, bits, packed ? nullptr : out.q.data() + offset,
                       packed ? out.q8.data() + offset : nullptr, out.d[at], out.sum[at]);
        out.dsum[at] = out.d[at] * static_cast<float>(out.sum[at]);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------ linear

// Rows sharing one unpacked weight tile, and where their float accumulators live: AVX-512's 32 registers hold a
// block's integer and float accumulators; AVX2's 16 hold only the integer ones (two registers a row), the float
// ones stay in an L1-resident buffer (the same operations, so the same bits). Blocks of 4 to 8 rows ran within 5%
// of each other on both builds (1.5B shapes, Zen 4): a row's products, not the unpacking they share, set the cost.
#if SD_AVX512
constexpr int kRowBlock = 8;
constexpr bool kAccInMemory = false;
#elif SD_AVX2
constexpr int kRowBlock = 5;
constexpr bool kAccInMemory = true;
#else
constexpr int kRowBlock = 4;
constexpr bool kAccInMemory = false;
#endif

// The 16 lanes' scales (or offsets) of one group, stored as ScaleKind SK: `at` indexes the group's lanes,
// `super_at` its super-block's.
template <int SK>
static inline VF load_scales(const void* p, const uint16_t* super, int64_t at, int64_t super_at) {
  if constexpr (SK == kScaleSuper) {
    return vf_mul(vf_from_half(super + super_at), vf_from_i8(static_cast<const int8_t*>(p) + at));
  } else if constexpr (SK == kScaleF16) {
    return vf_from_half(static_cast<const uint16_t*>(p) + at);
  } else {
    return vf_load(static_cast<const float*>(p) + at);
  }
}

template <int SK>
constexpr int64_t kScaleBytes = SK == kScaleSuper ? 1 : SK == kScaleF16 ? 2 : 4;

#if SD_DOT8
static inline VI vi_dot8(VI acc, __m512i w, int32_t quad) {
  return {_mm512_dpbusd_epi32(acc.v, w, _mm512_set1_epi32(quad))};
}
#endif

#if SD_DOT8
// Byte l of v (values below 16: nibbles) gets 16 added where bit l of the 64 little-endian bits at p is set.
static inline __m512i high_bits8(__m512i v, const uint8_t* p) {
  uint64_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _mm512_mask_add_epi8(v, _cvtu64_mask64(bits), v, _mm512_set1_epi8(16));
}
#endif

// y[r, col0 + c] (+)= Σ_groups (s·(d·Σ u·xq − ...)) for R rows and one tile of 16 outputs (the template parameters
// at the top of this file).
template <int R, int G, int PACKING, int SCALES, bool SYMMETRIC, bool QUADS>
static void tile_rows(const Matrix& w, int64_t t, const QuantRows& x, int64_t r0, float* y, int64_t ldy,
                      int64_t ncols, const float* add, int64_t ldadd) {
  constexpr int kRegs = kAccInMemory ? 1 : R, kMem = kAccInMemory ? R : 1;
  VF acc_regs[kRegs];
  alignas(64) float acc_mem[kMem][kLanes];
  const auto acc_get = [&](int r) {
    if constexpr (kAccInMemory) return vf_load(acc_mem[r]);
    else return acc_regs[r];
  };
  const auto acc_set = [&](int r, VF v) {
    if constexpr (kAccInMemory) vf_store(acc_mem[r], v);
    else acc_regs[r] = v;
  };
  for (int r = 0; r < R; ++r) acc_set(r, vf_zero());
  const int64_t groups = w.groups;
  constexpr bool kNibbles = PACKING != kPackBytes, kHigh = PACKING == kPackNibblesHighBits;
  constexpr int64_t group_bytes = packed_group_bytes(PACKING, G);
  const uint8_t* wp = w.wp + t * groups * group_bytes;
  const int64_t sbase = t * groups * kLanes;
  const int64_t super_base = t * w.supers * kLanes;
  const int16_t* xrow[R];
  const int8_t* xrow8[R];
  for (int r = 0; r < R; ++r) {
    if constexpr (QUADS) {
      xrow8[r] = x.q8.data() + (r0 + r) * x.k;
    } else {
      xrow[r] = x.q.data() + (r0 + r) * x.k;
    }
  }
  // Few rows: two integer accumulators per row (exact, so the split changes nothing but latency).
  constexpr bool kSplit = R <= (kAccInMemory ? 2 : 4);
  for (int64_t j = 0; j < groups; ++j) {
    VI ia[R], ib[R];
    for (int r = 0; r < R; ++r) ia[r] = ib[r] = vi_zero();
    const int64_t k0 = j * G;
    const uint8_t* plane = wp + G * 8;  // kHigh: the group's fifth bits, after its nibbles
    // Streaming weights from memory (one row: bandwidth-bound): fetch ~16 groups ahead of use.
    for (int64_t at = 0; at < group_bytes; at += 64) __builtin_prefetch(wp + kPrefetchGroups * group_bytes + at);
    __builtin_prefetch(static_cast<const char*>(w.sp) + (sbase + (j + kPrefetchGroups) * kLanes) * kScaleBytes<SCALES>);
    if (!SYMMETRIC)
      __builtin_prefetch(static_cast<const char*>(w.op) + (sbase + (j + kPrefetchGroups) * kLanes) * kScaleBytes<SCALES>);
    if constexpr (QUADS) {  // the quad layout: 16 lanes of 4 consecutive inputs per 64 bytes
#if SD_DOT8
      if constexpr (kNibbles) {
        const __m512i mask = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
        for (int b = 0; b < G / 8; ++b) {
          const __m512i v = _mm512_loadu_si512(wp + b * 64);
          __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
          if constexpr (kHigh) {
            lo = high_bits8(lo, plane + b * 16);
            hi = high_bits8(hi, plane + b * 16 + 8);
          }
          for (int r = 0; r < R; ++r) vi_pin(ia[r] = vi_dot8(ia[r], lo, load_pair8(xrow8[r] + k0 + 8 * b)));
          for (int r = 0; r < R; ++r) {
            if constexpr (kSplit) {
              vi_pin(ib[r] = vi_dot8(ib[r], hi, load_pair8(xrow8[r] + k0 + 8 * b + 4)));
            } else {
              vi_pin(ia[r] = vi_dot8(ia[r], hi, load_pair8(xrow8[r] + k0 + 8 * b + 4)));
            }
          }
        }
      } else {
#pragma GCC unroll 8
        for (int q = 0; q < G / 4; q += 2) {
          const __m512i v0 = _mm512_loadu_si512(wp + q * 64), v1 = _mm512_loadu_si512(wp + (q + 1) * 64);
          for (int r = 0; r < R; ++r) vi_pin(ia[r] = vi_dot8(ia[r], v0, load_pair8(xrow8[r] + k0 + 4 * q)));
          for (int r = 0; r < R; ++r) {
            if constexpr (kSplit) {
              vi_pin(ib[r] = vi_dot8(ib[r], v1, load_pair8(xrow8[r] + k0 + 4 * (q + 1))));
            } else {
              vi_pin(ia[r] = vi_dot8(ia[r], v1, load_pair8(xrow8[r] + k0 + 4 * (q + 1))));
            }
          }
        }
      }
#endif
    } else if constexpr (kNibbles) {
      constexpr int kQuarter = G / 4;
#pragma GCC unroll 8
      for (int c = 0; c < kQuarter; ++c) {
        VW lo, hi;
        vw_nibbles(wp + c * 32, lo, hi);
        if constexpr (kHigh) {
          vw_high_bits(lo, plane + c * 8);
          vw_high_bits(hi, plane + c * 8 + 4);
        }
        for (int r = 0; r < R; ++r) vi_pin(ia[r] = vi_dot(ia[r], lo, load_pair(xrow[r] + k0 + 2 * c)));
        for (int r = 0; r < R; ++r) {
          if constexpr (kSplit) {
            vi_pin(ib[r] = vi_dot(ib[r], hi, load_pair(xrow[r] + k0 + 2 * (c + kQuarter))));
          } else {
            vi_pin(ia[r] = vi_dot(ia[r], hi, load_pair(xrow[r] + k0 + 2 * (c + kQuarter))));
          }
        }
      }
    } else {
#pragma GCC unroll 8
      for (int p = 0; p < G / 2; p += 2) {
        const VW b0 = vw_bytes(wp + p * 32), b1 = vw_bytes(wp + (p + 1) * 32);
        for (int r = 0; r < R; ++r) vi_pin(ia[r] = vi_dot(ia[r], b0, load_pair(xrow[r] + k0 + 2 * p)));
        for (int r = 0; r < R; ++r) {
          if constexpr (kSplit) {
            vi_pin(ib[r] = vi_dot(ib[r], b1, load_pair(xrow[r] + k0 + 2 * (p + 1))));
          } else {
            vi_pin(ia[r] = vi_dot(ia[r], b1, load_pair(xrow[r] + k0 + 2 * (p + 1))));
          }
        }
      }
    }
    if constexpr (kSplit)
      for (int r = 0; r < R; ++r) ia[r] = vi_add(ia[r], ib[r]);
    wp += group_bytes;
    const int64_t si = sbase + j * kLanes;
    const int64_t ssi = SCALES == kScaleSuper ? super_base + (j / w.per) * kLanes : 0;
    const VF s = load_scales<SCALES>(w.sp, w.ssp, si, ssi);
    if (SYMMETRIC) {
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * x.groups + j;
        const VI centred = vi_sub_const(ia[r], w.sym * x.sum[at]);
        acc_set(r, vf_fma(vf_mul(vf_cvt(centred), vf_set(x.d[at])), s, acc_get(r)));
      }
    } else {
      const VF off = load_scales<SCALES>(w.op, w.sop, si, ssi);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * x.groups + j;
        const VF a = vf_fma(vf_mul(vf_cvt(ia[r]), vf_set(x.d[at])), s, acc_get(r));
        acc_set(r, vf_fma(off, vf_set(x.dsum[at]), a));
      }
    }
  }
  const int64_t col0 = t * kLanes;
  const int64_t width = std::min<int64_t>(kLanes, ncols - col0);
  alignas(64) float lanes[kLanes];
  for (int r = 0; r < R; ++r) {
    VF out = acc_get(r);
    if (w.bp != nullptr) {
      alignas(64) float b[kLanes] = {0};
      for (int64_t c = 0; c < width; ++c) b[c] = w.bp[col0 + c];
      out = vf_add(out, vf_load(b));
    }
    float* dst = y + (r0 + r) * ldy + col0;
    if (add != nullptr) {
      const float* src = add + (r0 + r) * ldadd + col0;
      if (width == kLanes) {
        out = vf_add(vf_load(src), out);
      } else {
        alignas(64) float a[kLanes] = {0};
        for (int64_t c = 0; c < width; ++c) a[c] = src[c];
        out = vf_add(vf_load(a), out);
      }
    }
    if (width == kLanes) {
      vf_store(dst, out);
    } else {
      vf_lanes(out, lanes);
      for (int64_t c = 0; c < width; ++c) dst[c] = lanes[c];
    }
  }
}

// tile_rows for a block of `rows` rows (1..N; the parameters as there), the matrix's group size chosen at run time
// (the high-bit packing comes in groups of 32 only).
template <int N, int PACKING, int SCALES, bool SYMMETRIC, bool QUADS>
static void tile_any(int rows, const Matrix& w, int64_t t, const QuantRows& x, int64_t r0, float* y, int64_t ldy,
                     int64_t ncols, const float* add, int64_t ldadd) {
  if constexpr (N > 1) {
    if (rows < N) return tile_any<N - 1, PACKING, SCALES, SYMMETRIC, QUADS>(rows, w, t, x, r0, y, ldy, ncols, add, ldadd);
  }
  TORCH_CHECK(rows == N, "row block out of range");
  if (PACKING != kPackNibblesHighBits && w.g == 16)
    return tile_rows<N, 16, PACKING, SCALES, SYMMETRIC, QUADS>(w, t, x, r0, y, ldy, ncols, add, ldadd);
  return tile_rows<N, 32, PACKING, SCALES, SYMMETRIC, QUADS>(w, t, x, r0, y, ldy, ncols, add, ldadd);
}

using TileFn = void (*)(int, const Matrix&, int64_t, const QuantRows&, int64_t, float*, int64_t, int64_t, const float*,
                        int64_t);

template <int PACKING, bool QUADS>
static TileFn tile_fn_of_packing(const Matrix& w) {
  static const TileFn table[6] = {
      tile_any<kRowBlock, PACKING, kScaleF32, false, QUADS>,   tile_any<kRowBlock, PACKING, kScaleF32, true, QUADS>,
      tile_any<kRowBlock, PACKING, kScaleF16, false, QUADS>,   tile_any<kRowBlock, PACKING, kScaleF16, true, QUADS>,
      tile_any<kRowBlock, PACKING, kScaleSuper, false, QUADS>, tile_any<kRowBlock, PACKING, kScaleSuper, true, QUADS>,
  };
  return table[w.kind * 2 + (w.sym >= 0 ? 1 : 0)];
}

// The tile function of a matrix's format: PACKING, SCALES and SYMMETRIC from its fields, QUADS as the activations
// are packed.
template <bool QUADS>
static TileFn tile_fn_of(const Matrix& w) {
  switch (w.packing) {
    case kPackNibbles:
      return tile_fn_of_packing<kPackNibbles, QUADS>(w);
    case kPackNibblesHighBits:
      return tile_fn_of_packing<kPackNibblesHighBits, QUADS>(w);
    default:
      return tile_fn_of_packing<kPackBytes, QUADS>(w);
  }
}

static TileFn tile_fn(const Matrix& w, const QuantRows& x) {
  return x.packed8() ? tile_fn_of<true>(w) : tile_fn_of<false>(w);
}

// y[:, :ncols] (+ add) = x̂ @ W.T for the quantized rows x̂ (ncols ≤ w.n: a head may stop at the vocabulary).
static void linear_rows(const Matrix& w, const QuantRows& x, float* y, int64_t ldy, int64_t ncols, const float* add,
                        int64_t ldadd) {
  TORCH_CHECK(x.bits == w.abits && x.g == w.g, "activations quantized for another matrix");
  const TileFn fn = tile_fn(w, x);
  const int64_t tiles = (ncols + kLanes - 1) / kLanes;
  // Rows in blocks of nearly equal size (9 rows on AVX-512: 5 + 4, not 8 + 1), each block one pass over the tile.
  const int64_t rows = x.rows, blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
        const int block = static_cast<int>((rows - r0) / (blocks - b));
        fn(block, w, t, x, r0, y, ldy, ncols, add, ldadd);
        r0 += block;
      }
    }
  });
}

// A layer's linear: its parts side by side, each fed the input quantized per its own group size.
struct Inputs {
  QuantRows quantized[2][2];  // [group 16 / 32][8 / 16 bits]
  bool have[2][2] = {{false, false}, {false, false}};
};

static const QuantRows& quantized(Inputs& in, const float* x, int64_t ldx, int64_t rows, const Matrix& w) {
  const int gi = w.g == 32, bi = w.abits == 16;
  if (!in.have[gi][bi]) {
    quantize_rows(x, ldx, rows, w.k, w.g, w.abits, in.quantized[gi][bi]);
    in.have[gi][bi] = true;
  }
  return in.quantized[gi][bi];
}

static void apply_parts(const std::vector<std::shared_ptr<const Matrix>>& parts, const float* x, int64_t ldx,
                        int64_t rows, float* y, int64_t ldy, const float* add, int64_t ldadd) {
  Inputs in;
  int64_t col = 0;
  for (const auto& part : parts) {
    const QuantRows& q = quantized(in, x, ldx, rows, *part);
    linear_rows(*part, q, y + col, ldy, part->n, add == nullptr ? nullptr : add + col, ldadd);
    col += part->n;
  }
}

static int64_t width_of(const std::vector<std::shared_ptr<const Matrix>>& parts) {
  int64_t n = 0;
  for (const auto& p : parts) n += p->n;
  return n;
}

at::Tensor linear(const at::Tensor& x, at::IntArrayRef ids) {
  const auto parts = parts_of(ids);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == parts[0]->k, "linear: x must be [rows, ", parts[0]->k, "]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), width_of(parts)}, xf.options());
  apply_parts(parts, xf.data_ptr<float>(), xf.size(1), xf.size(0), y.data_ptr<float>(), y.size(1), nullptr, 0);
  return y;
}

}  // namespace sd
