// The lanes every kernel computes in: 16 float32 / int32 lanes (VF, VI) and 32 int16 lanes in pairs (VW), on
// AVX-512, on AVX2 (two 8-lane halves) or in portable C, each helper the same IEEE operation lane by lane in
// every backend; then the fixed-order reductions and the exp that the other parts share.
//
// A part of the kernels' one translation unit: ops.cpp includes the parts in order.

#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(SD_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define SD_AVX512 1
#include <immintrin.h>
#elif !defined(SD_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SD_AVX2 1
#include <immintrin.h>
#else
#define SD_SCALAR 1
#endif

namespace sd {

constexpr int kLanes = 16;

// ------------------------------------------------------------------------------------------------ 16 lanes

#if SD_AVX512
struct VF { __m512 v; };
struct VI { __m512i v; };
struct VW { __m512i v; };  // 32 int16: lane l holds the pair (2l, 2l+1)
static inline VF vf_zero() { return {_mm512_setzero_ps()}; }
static inline VF vf_set(float x) { return {_mm512_set1_ps(x)}; }
static inline VF vf_load(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void vf_store(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
static inline VF vf_add(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline VF vf_sub(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline VF vf_mul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline VF vf_max(VF a, VF b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline VF vf_min(VF a, VF b) { return {_mm512_min_ps(a.v, b.v)}; }
static inline VF vf_fma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline VF vf_round(VF a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
static inline VF vf_abs(VF a) { return {_mm512_abs_ps(a.v)}; }
static inline VF vf_from_half(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
static inline VF vf_from_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
static inline VF vf_cvt(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
static inline VI vf_to_int(VF a) { return {_mm512_cvtps_epi32(a.v)}; }  // a holds integers already
static inline VF vf_from_bits(VI a) { return {_mm512_castsi512_ps(a.v)}; }
static inline VI vi_zero() { return {_mm512_setzero_si512()}; }
static inline VI vi_add(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
static inline VI vi_sub_const(VI a, int32_t c) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(c))}; }
static inline VI vi_shl23(VI a) { return {_mm512_slli_epi32(a.v, 23)}; }
static inline VI vi_add_const(VI a, int32_t c) { return {_mm512_add_epi32(a.v, _mm512_set1_epi32(c))}; }
static inline VI vi_dot(VI acc, VW w, int32_t pair) {
#ifdef __AVX512VNNI__
  return {_mm512_dpwssd_epi32(acc.v, w.v, _mm512_set1_epi32(pair))};
#else
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(w.v, _mm512_set1_epi32(pair)))};
#endif
}
static inline void vw_nibbles(const uint8_t* p, VW& lo, VW& hi) {
  __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  lo.v = _mm512_and_si512(b, _mm512_set1_epi16(0x0F));
  hi.v = _mm512_srli_epi16(b, 4);
}
static inline VW vw_bytes(const uint8_t* p) {
  return {_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
// Lane l of w (values below 16: nibbles) gets 16 added where bit l of the 32 little-endian bits at p is set: the
// fifth bits of 5-bit weights (weights.h's high-bit plane).
static inline void vw_high_bits(VW& w, const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  w.v = _mm512_mask_add_epi16(w.v, _cvtu32_mask32(bits), w.v, _mm512_set1_epi16(16));
}
static inline void vf_lanes(VF a, float* out) { _mm512_storeu_ps(out, a.v); }
static inline VI vi_quantize(VF a) { return {_mm512_cvtps_epi32(a.v)}; }
static inline void vi_store16(int16_t* p, VI a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a.v));
}
static inline int32_t vi_hsum(VI a) { return _mm512_reduce_add_epi32(a.v); }  // integers: exact in any order
static inline float vf_hmax(VF a) { return _mm512_reduce_max_ps(a.v); }       // max: exact in any order

#elif SD_AVX2
struct VF { __m256 a, b; };
struct VI { __m256i a, b; };
struct VW { __m256i a, b; };
static inline VF vf_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline VF vf_set(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline VF vf_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vf_store(float* p, VF x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
#define SD_BIN(name, op) \
  static inline VF name(VF x, VF y) { return {op(x.a, y.a), op(x.b, y.b)}; }
SD_BIN(vf_add, _mm256_add_ps)
SD_BIN(vf_sub, _mm256_sub_ps)
SD_BIN(vf_mul, _mm256_mul_ps)
SD_BIN(vf_max, _mm256_max_ps)
SD_BIN(vf_min, _mm256_min_ps)
#undef SD_BIN
static inline VF vf_fma(VF x, VF y, VF z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
static inline VF vf_round(VF x) {
  const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.a, mode), _mm256_round_ps(x.b, mode)};
}
static inline VF vf_abs(VF x) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(x.a, mask), _mm256_and_ps(x.b, mask)};
}
static inline VF vf_from_half(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
static inline VF vf_from_i8(const int8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
static inline VF vf_cvt(VI x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
static inline VI vf_to_int(VF x) { return {_mm256_cvtps_epi32(x.a), _mm256_cvtps_epi32(x.b)}; }
static inline VF vf_from_bits(VI x) { return {_mm256_castsi256_ps(x.a), _mm256_castsi256_ps(x.b)}; }
static inline VI vi_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline VI vi_add(VI x, VI y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
static inline VI vi_sub_const(VI x, int32_t c) {
  const __m256i v = _mm256_set1_epi32(c);
  return {_mm256_sub_epi32(x.a, v), _mm256_sub_epi32(x.b, v)};
}
static inline VI vi_shl23(VI x) { return {_mm256_slli_epi32(x.a, 23), _mm256_slli_epi32(x.b, 23)}; }
static inline VI vi_add_const(VI x, int32_t c) {
  const __m256i v = _mm256_set1_epi32(c);
  return {_mm256_add_epi32(x.a, v), _mm256_add_epi32(x.b, v)};
}
static inline VI vi_dot(VI acc, VW w, int32_t pair) {
  const __m256i x = _mm256_set1_epi32(pair);
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(w.a, x)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(w.b, x))};
}
static inline void vw_nibbles(const uint8_t* p, VW& lo, VW& hi) {
  const __m256i b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i b1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  const __m256i mask = _mm256_set1_epi16(0x0F);
  lo = {_mm256_and_si256(b0, mask), _mm256_and_si256(b1, mask)};
  hi = {_mm256_srli_epi16(b0, 4), _mm256_srli_epi16(b1, 4)};
}
static inline VW vw_bytes(const uint8_t* p) {
  return {_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
static inline __m256i high_bits16(uint16_t bits) {  // lane l: 16 where bit l is set, else 0
  const __m256i select = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                           static_cast<int16_t>(0x8000));
  const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), select), select);
  return _mm256_and_si256(set, _mm256_set1_epi16(16));
}
static inline void vw_high_bits(VW& w, const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  w.a = _mm256_or_si256(w.a, high_bits16(static_cast<uint16_t>(bits)));
  w.b = _mm256_or_si256(w.b, high_bits16(static_cast<uint16_t>(bits >> 16)));
}
static inline void vf_lanes(VF x, float* out) { vf_store(out, x); }
static inline VI vi_quantize(VF x) { return vf_to_int(x); }
static inline void vi_store16(int16_t* p, VI x) {
  alignas(32) int32_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x.a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), x.b);
  for (int i = 0; i < 16; ++i) p[i] = static_cast<int16_t>(lanes[i]);
}
static inline int32_t vi_hsum(VI x) {
  alignas(32) int32_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x.a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), x.b);
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) s += lanes[i];
  return s;
}
static inline float vf_hmax(VF x) {
  alignas(32) float lanes[16];
  vf_store(lanes, x);
  float m = lanes[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, lanes[i]);
  return m;
}

#else  // portable C: the same operations lane by lane
struct VF { float v[16]; };
struct VI { int32_t v[16]; };
struct VW { int16_t v[32]; };
#define SD_LOOP for (int i = 0; i < 16; ++i)
static inline VF vf_zero() { VF r; SD_LOOP r.v[i] = 0.0f; return r; }
static inline VF vf_set(float x) { VF r; SD_LOOP r.v[i] = x; return r; }
static inline VF vf_load(const float* p) { VF r; SD_LOOP r.v[i] = p[i]; return r; }
static inline void vf_store(float* p, VF a) { SD_LOOP p[i] = a.v[i]; }
static inline VF vf_add(VF a, VF b) { VF r; SD_LOOP r.v[i] = a.v[i] + b.v[i]; return r; }
static inline VF vf_sub(VF a, VF b) { VF r; SD_LOOP r.v[i] = a.v[i] - b.v[i]; return r; }
static inline VF vf_mul(VF a, VF b) { VF r; SD_LOOP r.v[i] = a.v[i] * b.v[i]; return r; }
// max/min as x86 defines them (the second operand when either is NaN or both are zeros)
static inline VF vf_max(VF a, VF b) { VF r; SD_LOOP r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
static inline VF vf_min(VF a, VF b) { VF r; SD_LOOP r.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i]; return r; }
static inline VF vf_fma(VF a, VF b, VF c) { VF r; SD_LOOP r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r; }
static inline VF vf_round(VF a) { VF r; SD_LOOP r.v[i] = std::nearbyint(a.v[i]); return r; }
static inline VF vf_abs(VF a) { VF r; SD_LOOP r.v[i] = std::fabs(a.v[i]); return r; }
static inline VF vf_from_half(const uint16_t* p) {
  VF r;
  SD_LOOP r.v[i] = static_cast<float>(c10::Half(p[i], c10::Half::from_bits()));
  return r;
}
static inline VF vf_from_i8(const int8_t* p) { VF r; SD_LOOP r.v[i] = static_cast<float>(p[i]); return r; }
static inline VF vf_cvt(VI a) { VF r; SD_LOOP r.v[i] = static_cast<float>(a.v[i]); return r; }
static inline VI vf_to_int(VF a) { VI r; SD_LOOP r.v[i] = static_cast<int32_t>(std::nearbyint(a.v[i])); return r; }
static inline VF vf_from_bits(VI a) { VF r; std::memcpy(r.v, a.v, sizeof r.v); return r; }
static inline VI vi_zero() { VI r; SD_LOOP r.v[i] = 0; return r; }
static inline VI vi_add(VI a, VI b) { VI r; SD_LOOP r.v[i] = a.v[i] + b.v[i]; return r; }
static inline VI vi_sub_const(VI a, int32_t c) { VI r; SD_LOOP r.v[i] = a.v[i] - c; return r; }
static inline VI vi_shl23(VI a) {
  VI r;
  SD_LOOP r.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) << 23);
  return r;
}
static inline VI vi_add_const(VI a, int32_t c) { VI r; SD_LOOP r.v[i] = a.v[i] + c; return r; }
static inline VI vi_dot(VI acc, VW w, int32_t pair) {
  const int32_t x0 = static_cast<int16_t>(pair & 0xFFFF), x1 = static_cast<int16_t>(pair >> 16);
  SD_LOOP acc.v[i] += w.v[2 * i] * x0 + w.v[2 * i + 1] * x1;
  return acc;
}
static inline void vw_nibbles(const uint8_t* p, VW& lo, VW& hi) {
  for (int i = 0; i < 32; ++i) { lo.v[i] = p[i] & 0x0F; hi.v[i] = p[i] >> 4; }
}
static inline VW vw_bytes(const uint8_t* p) { VW r; for (int i = 0; i < 32; ++i) r.v[i] = p[i]; return r; }
static inline void vw_high_bits(VW& w, const uint8_t* p) {
  for (int i = 0; i < 32; ++i) w.v[i] = static_cast<int16_t>(w.v[i] | (((p[i / 8] >> (i % 8)) & 1) << 4));
}
static inline void vf_lanes(VF a, float* out) { vf_store(out, a); }
static inline VI vi_quantize(VF a) { return vf_to_int(a); }
static inline void vi_store16(int16_t* p, VI a) { SD_LOOP p[i] = static_cast<int16_t>(a.v[i]); }
static inline int32_t vi_hsum(VI a) { int32_t s = 0; SD_LOOP s += a.v[i]; return s; }
static inline float vf_hmax(VF a) { float m = a.v[0]; for (int i = 1; i < 16; ++i) m = std::max(m, a.v[i]); return m; }
#undef SD_LOOP
#endif

// An empty barrier on an accumulator: the compiler may not reassociate the integer sums across it. Without it, g++
// turns a row's chain of dot products into a tree, which keeps every product live at once and spills them to the
// stack (AVX2's 16 registers: the row-block loop ran at a third of its speed).
static inline void vi_pin(VI& a) {
#if SD_AVX512
  asm("" : "+v"(a.v));
#elif SD_AVX2
  asm("" : "+x"(a.a), "+x"(a.b));
#else
  (void)a;
#endif
}

// Sum of 16 lanes in one fixed tree (lane i + lane i+8, then +4, +2, +1), the same in every backend.
static inline float vf_hsum(VF a) {
  alignas(64) float l[16];
  vf_lanes(a, l);
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  const float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
  return s2a + s2b;
}

static inline int32_t load_pair(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline int32_t load_pair8(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// exp(x) for x in any range (clamped to [-87, 88]): 2^n · p(r), n = round(x·log2 e), |r| ≤ ln2/2, with Cephes'
// polynomial; the same fused multiply-adds in every backend.
static inline VF vf_exp(VF x) {
  x = vf_min(vf_max(x, vf_set(-87.0f)), vf_set(88.0f));
  const VF n = vf_round(vf_mul(x, vf_set(1.44269504088896341f)));
  VF r = vf_fma(n, vf_set(-0.693359375f), x);
  r = vf_fma(n, vf_set(2.12194440e-4f), r);
  VF p = vf_set(1.9875691500e-4f);
  p = vf_fma(p, r, vf_set(1.3981999507e-3f));
  p = vf_fma(p, r, vf_set(8.3334519073e-3f));
  p = vf_fma(p, r, vf_set(4.1665795894e-2f));
  p = vf_fma(p, r, vf_set(1.6666665459e-1f));
  p = vf_fma(p, r, vf_set(5.0000001201e-1f));
  const VF r2 = vf_mul(r, r);
  p = vf_fma(p, r2, r);
  p = vf_add(p, vf_set(1.0f));
  const VF scale = vf_from_bits(vi_shl23(vi_add_const(vf_to_int(n), 127)));
  return vf_mul(p, scale);
}

static inline float exp_scalar(float x) {
  alignas(64) float l[16];
  vf_lanes(vf_exp(vf_set(x)), l);
  return l[0];
}

}  // namespace sd
