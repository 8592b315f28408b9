// Products of float activations by int8 weight rows with one scale per row, by the CPU's 8-bit dot
// product instructions (AVX-512 VNNI's vpdpbusd: 64 byte products summed into 16 int32 lanes by one
// instruction). Built and loaded by engine/kernels/int8_dots.py; MTP draft chains call it.
//
//   mtpchat::int8_dots(x [M, K] float32, w [N, K] uint8, d [N] float32) -> [M, N] float32
//
// w holds the int8 weights q with their top bit flipped (w = q + 128, unsigned), d their row scales.
// Each activation row is quantized to int8 with its own scale: s = max|x| / 127, xq = x / s rounded
// half away from zero (the rule of ggml's reference Q8_0 quantizer), in float32 arithmetic step by step
// as PyTorch does it, so a test can compute the same integers. Then
//   out[m, n] = float(sum_k w[n, k] * xq[m, k] - 128 * sum_k xq[m, k]) * s[m] * d[n]
// where the integer sum is exact (int32; K < 65,536).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define MTPCHAT_X86 1
#endif

namespace {

constexpr int64_t kRows = 16;     // weight rows a block multiplies at once (one int32 lane each)

bool cpu_has_vnni() {
#ifdef MTPCHAT_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

#ifdef MTPCHAT_X86
// 16 vectors of 16 int32 lanes -> one vector whose lane r is the sum of vector r's lanes.
__attribute__((target("avx512f,avx512bw"))) inline __m512i sum_lanes16(const __m512i* v) {
  __m512i a[8], b[4];
  for (int i = 0; i < 8; ++i)   // per 128-bit lane: [r0 + r2, s0 + s2, r1 + r3, s1 + s3]
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j)   // per 128-bit lane: the lane's sums of rows 4j .. 4j + 3
    b[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * j], a[2 * j + 1]),
                            _mm512_unpackhi_epi64(a[2 * j], a[2 * j + 1]));
  constexpr int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512i c0 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], even), _mm512_shuffle_i32x4(b[0], b[1], odd));
  const __m512i c1 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], even), _mm512_shuffle_i32x4(b[2], b[3], odd));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(c0, c1, even), _mm512_shuffle_i32x4(c0, c1, odd));
}

// One activation row -> int8 with its scale and the sum of its integers, in the float32 steps of
// _int8_symmetric (engine/kernels/packed.py) as torch evaluates them: d = amax / 127, inv = 1 / d (0 where
// d is 0), y = x * inv, q = sign(y) * floor(|y| + 0.5). Each step is one IEEE operation per lane (no
// fused multiply-add: built with -ffp-contract=off), so the integers equal torch's.
__attribute__((target("avx512f,avx512bw,avx512vl")))
void quantize_row(const float* x, int64_t K, int8_t* q, float* scale, int32_t* sum) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 live = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(live, x + k)));
  }
  const float amax = _mm512_reduce_max_ps(vmax);
  const float d = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(d == 0.f ? 0.f : 1.f / d);
  const __m512 half = _mm512_set1_ps(0.5f);
  __m512i isum = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 live = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, x + k), inv);
    const __m512 r = _mm512_roundscale_ps(_mm512_add_ps(_mm512_abs_ps(y), half),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __mmask16 neg = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512i v = _mm512_cvttps_epi32(_mm512_mask_sub_ps(r, neg, _mm512_setzero_ps(), r));   // y's sign
    isum = _mm512_add_epi32(isum, v);
    _mm_mask_storeu_epi8(q + k, live, _mm512_cvtepi32_epi8(v));
  }
  *scale = d;
  *sum = _mm512_reduce_add_epi32(isum);
}

// Rows [b0 * 16, min(b1 * 16, N)) of the output for every activation row.
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void dot_blocks(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t M, int64_t K,
                const uint8_t* w, const float* d, float* out, int64_t N, int64_t b0, int64_t b1) {
  const int64_t K64 = K & ~int64_t(63);
  const __mmask64 tail = K > K64 ? (~0ULL >> (64 - (K - K64))) : 0;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * kRows;
    const int64_t rows = std::min(kRows, N - n0);
    const uint8_t* wr[kRows];
    for (int64_t r = 0; r < kRows; ++r) wr[r] = w + (n0 + std::min(r, rows - 1)) * K;   // past N: repeat the last row
    const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
    const __m512 dv = _mm512_maskz_loadu_ps(keep, d + n0);
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xr = xq + m * K;
      __m512i acc[kRows];
      for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_si512();
      for (int64_t k = 0; k < K64; k += 64) {
        const __m512i xv = _mm512_loadu_si512(xr + k);
        for (int64_t r = 0; r < kRows; ++r)
          acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(wr[r] + k), xv);
      }
      if (tail) {
        const __m512i xv = _mm512_maskz_loadu_epi8(tail, xr + K64);
        for (int64_t r = 0; r < kRows; ++r)
          acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_maskz_loadu_epi8(tail, wr[r] + K64), xv);
      }
      const __m512i s = _mm512_sub_epi32(sum_lanes16(acc), _mm512_set1_epi32(128 * xsum[m]));
      // float(s) * xs * d, multiplied in that order (the test's reference does the same)
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xs[m])), dv);
      _mm512_mask_storeu_ps(out + m * N + n0, keep, y);
    }
  }
}
#endif

at::Tensor int8_dots(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d) {
  TORCH_CHECK(cpu_has_vnni(), "int8_dots: this CPU has no AVX-512 (F, BW, VL) with VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_dots: x must be a 2-D float32 tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte, "int8_dots: w must be a 2-D uint8 tensor");
  TORCH_CHECK(d.dim() == 1 && d.scalar_type() == at::kFloat, "int8_dots: d must be a 1-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && d.size(0) == N, "int8_dots: shapes x ", x.sizes(), ", w ", w.sizes(),
              ", d ", d.sizes(), " do not agree");
  TORCH_CHECK(K < 65536, "int8_dots: K = ", K, " could overflow the int32 sums");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const auto dc = d.contiguous();
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  thread_local std::vector<int32_t> xsum;
  xq.resize(M * K);
  xs.resize(M);
  xsum.resize(M);
  const float* xp = xc.data_ptr<float>();
#ifdef MTPCHAT_X86
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, xq.data() + m * K, &xs[m], &xsum[m]);
  const int8_t* q = xq.data();
  const float* s = xs.data();
  const int32_t* qsum = xsum.data();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const float* dp = dc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (N + kRows - 1) / kRows;
  // at least 128 KiB of weights a task: smaller products stay on one thread, where a second one's start
  // and wait cost more than it saves (a draft row of the demo model ~5 % faster than with 32 KiB)
  const int64_t grain = std::max<int64_t>(1, (128 << 10) / (kRows * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    dot_blocks(q, s, qsum, M, K, wp, dp, op, N, b0, b1);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY(mtpchat, m) {
  m.def("int8_dots(Tensor x, Tensor w, Tensor d) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpchat, CPU, m) { m.impl("int8_dots", &int8_dots); }
