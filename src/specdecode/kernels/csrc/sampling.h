// Sampling on the kernels: Philox keyed Gumbel noise (reproducible sampling, bitwise keyed_noise.py's numpy
// path), inverse-CDF draws with float64 sums in a fixed order, argmax, and the whole exact accept/reject chain
// of speculative sampling (verify.py).
//
// A part of the kernels' one translation unit: ops.cpp includes the parts in order.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace sd {

// ------------------------------------------------------------------------------------------------ keyed sampling

// Philox4x64-10 (Salmon et al. 2011, Random123) as numpy's ``np.random.Philox(key=(position << 64) | seed)``: block
// b of the stream is philox(counter (b + 1, 0, 0, 0), key (seed, position)) (numpy bumps the counter before each
// block), its 4 words the stream's values 4b .. 4b + 3; ``random()`` maps a word w to (w >> 11) · 2^-53.
static inline void philox4x64(uint64_t block, uint64_t k0, uint64_t k1, uint64_t out[4]) {
  uint64_t c0 = block + 1, c1 = 0, c2 = 0, c3 = 0;
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += 0x9E3779B97F4A7C15ULL;
      k1 += 0xBB67AE8584CAA73BULL;
    }
    const unsigned __int128 p0 = static_cast<unsigned __int128>(0xD2E7470EE14C6C93ULL) * c0;
    const unsigned __int128 p1 = static_cast<unsigned __int128>(0xCA5A826395121157ULL) * c2;
    c0 = static_cast<uint64_t>(p1 >> 64) ^ c1 ^ k0;
    c1 = static_cast<uint64_t>(p1);
    c2 = static_cast<uint64_t>(p0 >> 64) ^ c3 ^ k1;
    c3 = static_cast<uint64_t>(p0);
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

static inline double philox_uniform(uint64_t word) {
  return static_cast<double>(word >> 11) * (1.0 / 9007199254740992.0);
}

// Standard Gumbel noise -log(-log u), -inf at u = 0, with the C library's log (which Python's math.log calls).
static inline double gumbel_of(double u) {
  return u == 0.0 ? -std::numeric_limits<double>::infinity() : -std::log(-std::log(u));
}

// argmax_x (l_x + g_x) over one row, g_x = gumbel_of(u_x), u = the Philox stream of (seed, position); ties: the
// lowest x. Most x are ruled out without a logarithm: with best0 = l_m + g_m at m = argmax l, x can win only if
// l_x - log E_x >= best0, E_x = -log u_x >= 1 - u_x = f·2^e (f in [1/2, 1)), so only if (e - 1)·ln 2 <= l_x - best0
// (plus a slack for rounding); m and the survivors are compared exactly. keyed_noise.py's numpy path is the same
// function, operation for operation.
static int64_t keyed_gumbel_argmax_row(const double* l, int64_t vocab, uint64_t seed, uint64_t position) {
  constexpr double kLn2 = 0.6931471805599453;
  int64_t m = 0;
  for (int64_t x = 1; x < vocab; ++x)
    if (l[x] > l[m]) m = x;
  uint64_t words[4];
  philox4x64(static_cast<uint64_t>(m / 4), seed, position, words);
  const double best0 = l[m] + gumbel_of(philox_uniform(words[m % 4]));
  const double slack = 1e-9 * (1.0 + std::fabs(best0));
  const int64_t blocks = (vocab + 3) / 4;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks / 2048));
  std::vector<double> best(chunks, -std::numeric_limits<double>::infinity());
  std::vector<int64_t> winner(chunks, -1);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      double top = -std::numeric_limits<double>::infinity();
      int64_t at_top = -1;
      uint64_t block_words[4];
      for (int64_t b = blocks * chunk / chunks; b < blocks * (chunk + 1) / chunks; ++b) {
        philox4x64(static_cast<uint64_t>(b), seed, position, block_words);
        for (int64_t lane = 0; lane < 4 && 4 * b + lane < vocab; ++lane) {
          const int64_t x = 4 * b + lane;
          // 1 - u = (2^53 - w)·2^-53 with w = word >> 11, so frexp's exponent e is bit_length(2^53 - w) - 53
          const uint64_t w = block_words[lane] >> 11;
          const int e = 64 - __builtin_clzll((1ULL << 53) - w) - 53;
          if (x != m && !(static_cast<double>(e - 1) * kLn2 <= (l[x] - best0) + slack)) continue;
          const double u = philox_uniform(block_words[lane]);
          const double value = l[x] + gumbel_of(u);
          if (at_top < 0 || value > top) top = value, at_top = x;
        }
      }
      best[chunk] = top, winner[chunk] = at_top;
    }
  });
  int64_t chosen = -1;
  double top = 0.0;
  for (int64_t chunk = 0; chunk < chunks; ++chunk)
    if (winner[chunk] >= 0 && (chosen < 0 || best[chunk] > top)) top = best[chunk], chosen = winner[chunk];
  return chosen;
}

// Reproducible sampling's token per row r of ``warped`` [n, V] (float64 warped logits, -inf where warped away):
// argmax_x (warped[r, x] + g(seed, positions[r])_x), the Gumbel-max draw keyed_noise.gumbel_max defines.
at::Tensor keyed_gumbel_argmax(const at::Tensor& warped, int64_t seed, at::IntArrayRef positions) {
  TORCH_CHECK(warped.dim() == 2 && warped.scalar_type() == at::kDouble, "keyed_gumbel_argmax: warped [n, V] float64");
  TORCH_CHECK(static_cast<int64_t>(positions.size()) == warped.size(0), "keyed_gumbel_argmax: one position per row");
  TORCH_CHECK(seed >= 0, "keyed_gumbel_argmax: seed in [0, 2^63)");
  const at::Tensor l = warped.contiguous();
  const int64_t n = l.size(0), vocab = l.size(1);
  TORCH_CHECK(vocab >= 1, "keyed_gumbel_argmax: an empty vocabulary");
  at::Tensor tokens = at::empty({n}, at::kLong);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(positions[r] >= 0, "keyed_gumbel_argmax: positions are >= 0");
    tokens.data_ptr<int64_t>()[r] = keyed_gumbel_argmax_row(l.data_ptr<double>() + r * vocab, vocab,
                                                           static_cast<uint64_t>(seed),
                                                           static_cast<uint64_t>(positions[r]));
  }
  return tokens;
}

// The first ``count`` values of numpy's Philox(key=(position << 64) | seed).random() stream (tests' probe).
at::Tensor philox_uniforms(int64_t seed, int64_t position, int64_t count) {
  at::Tensor u = at::empty({count}, at::kDouble);
  uint64_t words[4];
  for (int64_t x = 0; x < count; ++x) {
    if (x % 4 == 0)
      philox4x64(static_cast<uint64_t>(x / 4), static_cast<uint64_t>(seed), static_cast<uint64_t>(position), words);
    u.data_ptr<double>()[x] = philox_uniform(words[x % 4]);
  }
  return u;
}

// ------------------------------------------------------------------------------------------------ exact sampling

// Inverse-CDF draws for exact sampling (choices.inverse_cdf, verify.speculative_sample). The cumulative sums are
// float64 in a fixed order: the row in blocks of kDrawBlock entries, each block summed in 8 lanes (lane l takes
// entries l, l + 8, ...; combined as ((0+1)+(2+3))+((4+5)+(6+7)), then the block's tail in order); P_b, the mass
// before block b, is the running sum of the block sums in order, and inside block b, C(j) = P_b + w_start + ... + w_j
// in order. The draw at u is the first j with C(j) > u·P_B (P_B the total); a zero-weight entry never qualifies
// (adding 0 leaves C unchanged). Where rounding leaves block b's last C(j) at or below u·P_B although
// P_{b+1} > u·P_B, or u·P_B reaches P_B, the draw is the last entry with weight there: off by at most float64
// rounding, as any cumulative sum is.
constexpr int64_t kDrawBlock = 64;
#ifdef SD_MUTANT_EPS  // a test control's build (kernels.MUTANTS): residuals of mass up to 1e-3 replaced by p
constexpr double kResidualEps = 1e-3;
#else
constexpr double kResidualEps = 1e-12;  // verify.RESIDUAL_EPS
#endif

enum class Weight { kP, kResidual, kWithout };  // p; max(0, p - q); p with one entry zeroed

template <Weight W, typename T>
static inline double draw_weight(const T* p, const float* q, int64_t removed, int64_t j) {
  if constexpr (W == Weight::kP) {
    return static_cast<double>(p[j]);
  } else if constexpr (W == Weight::kResidual) {
    const double d = static_cast<double>(p[j]) - static_cast<double>(q[j]);
#ifdef SD_MUTANT_RESIDUAL  // a test control's build (kernels.MUTANTS): 1% of p mixed into the residual
    return (d < 0.0 ? 0.0 : d) + 0.01 * static_cast<double>(p[j]);
#endif
    return d < 0.0 ? 0.0 : d;  // NaN stays NaN, as torch's clamp_min keeps it
  } else {
#ifdef SD_MUTANT_POINT_MASS  // a test control's build (kernels.MUTANTS): the rejected guess left in p
    return static_cast<double>(p[j]);
#endif
    return j == removed ? 0.0 : static_cast<double>(p[j]);
  }
}

template <Weight W, typename T>
static double block_sum(const T* p, const float* q, int64_t removed, int64_t start, int64_t end) {
  double lane[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  int64_t j = start;
  for (; j + 8 <= end; j += 8)
    for (int l = 0; l < 8; ++l) lane[l] += draw_weight<W>(p, q, removed, j + l);
  double s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; j < end; ++j) s += draw_weight<W>(p, q, removed, j);
  return s;
}

// The total mass of the weights and their block sums (into ``sums``).
template <Weight W, typename T>
static double draw_mass(const T* p, const float* q, int64_t removed, int64_t vocab, std::vector<double>& sums) {
#ifdef SD_MUTANT_BLOCK  // a test control's build (kernels.MUTANTS): the walk stops before a last, partial block
  const int64_t blocks = vocab / kDrawBlock;
#else
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
#endif
  sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = block_sum<W>(p, q, removed, b * kDrawBlock, std::min(vocab, (b + 1) * kDrawBlock));
    total += sums[b];
  }
  return total;
}

// The draw at uniform u given ``draw_mass``'s total and block sums; -1 when the mass is not positive and finite.
template <Weight W, typename T>
static int64_t draw_from(const T* p, const float* q, int64_t removed, int64_t vocab, const std::vector<double>& sums,
                         double total, double u) {
  if (!(std::isfinite(total) && total > 0.0)) return -1;
  const double goal = u * total;
  double before = 0.0;  // P_b
  int64_t last_block = -1;
  for (int64_t b = 0; b < static_cast<int64_t>(sums.size()); ++b) {
    if (sums[b] > 0.0) last_block = b;
    const double after = before + sums[b];
    if (after > goal) {
      const int64_t start = b * kDrawBlock, end = std::min(vocab, start + kDrawBlock);
      double c = before;
      int64_t last = -1;
      for (int64_t j = start; j < end; ++j) {
        const double w = draw_weight<W>(p, q, removed, j);
        c += w;
#ifdef SD_MUTANT_INDEX  // a test control's build (kernels.MUTANTS): every draw one index off
        if (c > goal) return (j + 1) % vocab;
#endif
        if (c > goal) return j;
        if (w > 0.0) last = j;
      }
      return last;
    }
    before = after;
  }
  const int64_t start = last_block * kDrawBlock, end = std::min(vocab, start + kDrawBlock);
  for (int64_t j = end - 1; j >= start; --j)
    if (draw_weight<W>(p, q, removed, j) > 0.0) return j;
  return -1;
}

template <typename T>
static int64_t draw_row(const T* p, int64_t vocab, double u, std::vector<double>& sums) {
  const double total = draw_mass<Weight::kP>(p, static_cast<const float*>(nullptr), -1, vocab, sums);
  return draw_from<Weight::kP>(p, static_cast<const float*>(nullptr), -1, vocab, sums, total, u);
}

// choices.inverse_cdf: per row r of ``probs`` [n, V] (float32 or float64, non-negative), the draw at u[r]; -1 for a
// row with no positive, finite mass.
at::Tensor inverse_cdf_rows(const at::Tensor& probs, const at::Tensor& u) {
  TORCH_CHECK(probs.dim() == 2 && (probs.scalar_type() == at::kFloat || probs.scalar_type() == at::kDouble),
              "inverse_cdf_rows: probs [n, V] float32 or float64");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.size(0) == probs.size(0),
              "inverse_cdf_rows: one float64 uniform per row");
  const at::Tensor rows = probs.contiguous();
  const at::Tensor uc = u.contiguous();
  const int64_t n = rows.size(0), vocab = rows.size(1);
  at::Tensor drawn = at::empty({n}, at::kLong);
  std::vector<double> sums;
  for (int64_t r = 0; r < n; ++r) {
    const double ur = uc.data_ptr<double>()[r];
    drawn.data_ptr<int64_t>()[r] = rows.scalar_type() == at::kFloat
                                       ? draw_row(rows.data_ptr<float>() + r * vocab, vocab, ur, sums)
                                       : draw_row(rows.data_ptr<double>() + r * vocab, vocab, ur, sums);
  }
  return drawn;
}

// torch.argmax(logits, dim=-1) for float32 rows [n, V], the same index: the first maximal value's, a row's first NaN
// if it has one (torch orders NaN above every number). One vector pass for the maximum (NaN noted apart), one for
// the first index that holds it: ~6 us a row of 49,152 with AVX-512, ~8 with AVX2, against torch's ~100 us.
static float row_max(const float* row, int64_t vocab, bool* nan) {
  int64_t j = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
#if defined(SD_AVX512)
  const int64_t whole = vocab - vocab % 64;
  __m512 m0 = _mm512_set1_ps(best), m1 = m0, m2 = m0, m3 = m0;
  __mmask16 unordered = 0;
  for (; j < whole; j += 64) {
    const __m512 a = _mm512_loadu_ps(row + j), b = _mm512_loadu_ps(row + j + 16);
    const __m512 c = _mm512_loadu_ps(row + j + 32), d = _mm512_loadu_ps(row + j + 48);
    unordered |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, d, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(a, m0);  // max_ps(x, m) keeps m where x is NaN
    m1 = _mm512_max_ps(b, m1);
    m2 = _mm512_max_ps(c, m2);
    m3 = _mm512_max_ps(d, m3);
  }
  best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
  any_nan = unordered != 0;
#elif defined(SD_AVX2)
  const int64_t whole = vocab - vocab % 32;
  __m256 m0 = _mm256_set1_ps(best), m1 = m0, m2 = m0, m3 = m0;
  __m256 unordered = _mm256_setzero_ps();
  for (; j < whole; j += 32) {
    const __m256 a = _mm256_loadu_ps(row + j), b = _mm256_loadu_ps(row + j + 8);
    const __m256 c = _mm256_loadu_ps(row + j + 16), d = _mm256_loadu_ps(row + j + 24);
    unordered = _mm256_or_ps(unordered,
                             _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
    m0 = _mm256_max_ps(a, m0);
    m1 = _mm256_max_ps(b, m1);
    m2 = _mm256_max_ps(c, m2);
    m3 = _mm256_max_ps(d, m3);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  for (const float x : lanes) best = best < x ? x : best;
  any_nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; j < vocab; ++j) {
    any_nan |= std::isnan(row[j]);
    best = best < row[j] ? row[j] : best;
  }
  *nan = any_nan;
  return best;
}

// the first j with row[j] == best (with ``nan``: the first NaN); a row of -inf finds its first entry
static int64_t first_index(const float* row, int64_t vocab, float best, bool nan) {
  int64_t j = 0;
#if defined(SD_AVX512)
  const int64_t whole = vocab - vocab % 16;
  const __m512 target = _mm512_set1_ps(best);
  for (; j < whole; j += 16) {
    const __m512 x = _mm512_loadu_ps(row + j);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(x, target, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
#elif defined(SD_AVX2)
  const int64_t whole = vocab - vocab % 8;
  const __m256 target = _mm256_set1_ps(best);
  for (; j < whole; j += 8) {
    const __m256 x = _mm256_loadu_ps(row + j);
    const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(x, x, _CMP_UNORD_Q) : _mm256_cmp_ps(x, target, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < vocab; ++j) {
    if (nan ? std::isnan(row[j]) : row[j] == best) return j;
  }
  return 0;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: logits [n, V] float32, V > 0");
  const at::Tensor rows = logits.contiguous();
  const int64_t n = rows.size(0), vocab = rows.size(1);
  at::Tensor chosen = at::empty({n}, at::kLong);
  const float* data = rows.data_ptr<float>();
  int64_t* out = chosen.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      bool nan = false;
      const float best = row_max(data + r * vocab, vocab, &nan);
      out[r] = first_index(data + r * vocab, vocab, best, nan);
    }
  });
  return chosen;
}

// verify.speculative_sample for a chain, in one call: guess i (token x_i) is accepted iff accept_u[i] < p_i(x_i) /
// q_i(x_i) in float64 (0 where q_i(x_i) = 0; q_i(x_i) = 1 without ``draft``, point masses); after a rejection at n
// the next token is drawn at draw_u from max(0, p_n - q_n) (p_n with x_n zeroed for a point mass; p_n itself when
// that mass is <= kResidualEps or not finite), after k acceptances from p_k. ``target`` [k+1, V] and ``draft``
// [k, V] float32. Returns {n_accepted, token}, token -1 when the row drawn from has no positive, finite mass.
std::vector<int64_t> exact_chain(const at::Tensor& target, const c10::optional<at::Tensor>& draft,
                                 const at::Tensor& tokens, const at::Tensor& accept_u, double draw_u) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong, "exact_chain: tokens [k] int64");
  const int64_t k = tokens.size(0);
  TORCH_CHECK(target.dim() == 2 && target.scalar_type() == at::kFloat && target.size(0) == k + 1,
              "exact_chain: target [k+1, V] float32");
  TORCH_CHECK(accept_u.dim() == 1 && accept_u.scalar_type() == at::kDouble && accept_u.size(0) == k,
              "exact_chain: accept_u [k] float64");
  const int64_t vocab = target.size(1);
  const at::Tensor p = target.contiguous();
  at::Tensor q;
  if (draft.has_value()) {
    TORCH_CHECK(draft->dim() == 2 && draft->scalar_type() == at::kFloat && draft->size(0) == k &&
                    draft->size(1) == vocab,
                "exact_chain: draft [k, V] float32");
    q = draft->contiguous();
  }
  const at::Tensor x = tokens.contiguous();
  const at::Tensor ua = accept_u.contiguous();
  const float* pp = p.data_ptr<float>();
  const float* qp = q.defined() ? q.data_ptr<float>() : nullptr;
  int64_t n = k;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t token = x.data_ptr<int64_t>()[i];
    TORCH_CHECK(token >= 0 && token < vocab, "exact_chain: a drafted token outside the vocabulary");
    const double px = pp[i * vocab + token];
    const double qx = qp ? static_cast<double>(qp[i * vocab + token]) : 1.0;
    const double ratio = qx > 0.0 ? px / std::max(qx, std::numeric_limits<double>::min()) : 0.0;
#ifdef SD_MUTANT_ACCEPT  // a test control's build (kernels.MUTANTS): u <= ratio, so u = 0 accepts a p = 0 guess
    if (!(ua.data_ptr<double>()[i] <= ratio)) {
#else
    if (!(ua.data_ptr<double>()[i] < ratio)) {
#endif
      n = i;
      break;
    }
  }
  const float* row = pp + n * vocab;
  std::vector<double> sums;
  if (n < k) {
    const int64_t rejected = x.data_ptr<int64_t>()[n];
    if (qp) {
      const float* qrow = qp + n * vocab;
      const double mass = draw_mass<Weight::kResidual>(row, qrow, -1, vocab, sums);
      if (mass > kResidualEps) return {n, draw_from<Weight::kResidual>(row, qrow, -1, vocab, sums, mass, draw_u)};
    } else {
      const double mass = draw_mass<Weight::kWithout>(row, qp, rejected, vocab, sums);
      if (mass > kResidualEps)
        return {n, draw_from<Weight::kWithout>(row, qp, rejected, vocab, sums, mass, draw_u)};
    }
  }
  return {n, draw_row(row, vocab, draw_u, sums)};
}

}  // namespace sd
