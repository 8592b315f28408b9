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
// where the integer sum is exact (int32; K < 65,536). Two forms, chosen by what the CPU runs: AVX-512 with
// VNNI (16 weight rows a block) and AVX2 with AVX-VNNI (the 256-bit form, 8 rows a block); both give the
// same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#include <immintrin.h>
#define MTPCHAT_X86 1
#endif

namespace {

constexpr int64_t kRows = 16;     // weight rows a block multiplies at once (one int32 lane each)

// The instruction sets the operator can run on: AVX-512 with VNNI (16 lanes), or AVX2 with AVX-VNNI (the
// 256-bit VEX form of the same instruction, on CPUs without AVX-512: Intel's since Alder Lake).
enum Isa { kNone = 0, kAvx2Vnni = 1, kAvx512Vnni = 2 };

bool has_avx512_vnni() {
#ifdef MTPCHAT_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// AVX-VNNI: CPUID leaf 7, sub-leaf 1, EAX bit 4 (this libgcc's __builtin_cpu_supports does not know it). Not
// implied by AVX-512 VNNI: Ice Lake and Cascade Lake have that one only.
bool has_avx_vnni() {
#ifdef MTPCHAT_X86
  __builtin_cpu_init();
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __get_cpuid_count(7, 1, &a, &b, &c, &d) &&
         (a & (1u << 4));
#else
  return false;
#endif
}

bool runs(Isa isa) { return isa == kAvx512Vnni ? has_avx512_vnni() : isa == kAvx2Vnni && has_avx_vnni(); }

Isa cpu_isa() { return runs(kAvx512Vnni) ? kAvx512Vnni : runs(kAvx2Vnni) ? kAvx2Vnni : kNone; }

// The set in use: the best the CPU has, or a narrower one asked for (`int8_dots_isa`, tests and benches).
Isa g_isa = cpu_isa();

const char* isa_name(Isa isa) { return isa == kAvx512Vnni ? "avx512" : isa == kAvx2Vnni ? "avx2" : "none"; }

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
void dot_blocks(const int8_t* xq, int64_t Kp, const float* xs, const int32_t* xsum, int64_t M, int64_t K,
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
      const int8_t* xr = xq + m * Kp;
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

// The AVX2 forms. Activation rounding: the same float32 operations lane by lane as quantize_row, the tail
// past a multiple of 8 in scalar code (the same IEEE operations), so the integers are the same.
__attribute__((target("avx2,fma")))
void quantize_row_avx2(const float* x, int64_t K, int8_t* q, float* scale, int32_t* sum) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const int64_t K8 = K & ~int64_t(7);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(absmask, _mm256_loadu_ps(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.f;
  for (float v : lanes) amax = std::fmax(amax, v);
  for (int64_t k = K8; k < K; ++k) amax = std::fmax(amax, std::fabs(x[k]));
  const float d = amax / 127.f;
  const float inv = d == 0.f ? 0.f : 1.f / d;
  const __m256 vinv = _mm256_set1_ps(inv), half = _mm256_set1_ps(0.5f), zero = _mm256_setzero_ps();
  __m256i isum = _mm256_setzero_si256();
  alignas(32) int32_t ints[8];
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + k), vinv);
    const __m256 r = _mm256_round_ps(_mm256_add_ps(_mm256_and_ps(absmask, y), half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256 signed_r = _mm256_blendv_ps(r, _mm256_sub_ps(zero, r), _mm256_cmp_ps(y, zero, _CMP_LT_OQ));
    const __m256i v = _mm256_cvttps_epi32(signed_r);
    isum = _mm256_add_epi32(isum, v);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints), v);
    for (int i = 0; i < 8; ++i) q[k + i] = static_cast<int8_t>(ints[i]);
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(ints), isum);
  int32_t s = 0;
  for (int32_t v : ints) s += v;
  for (int64_t k = K8; k < K; ++k) {
    const float y = x[k] * inv;
    const float r = std::floor(std::fabs(y) + 0.5f);
    const int32_t v = static_cast<int32_t>(y < 0.f ? 0.f - r : r);
    q[k] = static_cast<int8_t>(v);
    s += v;
  }
  *scale = d;
  *sum = s;
}

constexpr int64_t kRows8 = 8;

// Rows [b0 * 8, min(b1 * 8, N)) of the output for every activation row; xq is padded with zeros to a
// multiple of 32 bytes, a weight row's tail is copied into a zeroed buffer.
__attribute__((target("avx2,fma,avxvnni")))
void dot_blocks_avx2(const int8_t* xq, int64_t Kp, const float* xs, const int32_t* xsum, int64_t M, int64_t K,
                     const uint8_t* w, const float* d, float* out, int64_t N, int64_t b0, int64_t b1) {
  const int64_t K32 = K & ~int64_t(31);
  alignas(32) uint8_t tails[kRows8][32];
  alignas(32) int32_t keep_bits[8];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * kRows8;
    const int64_t rows = std::min(kRows8, N - n0);
    const uint8_t* wr[kRows8];
    for (int64_t r = 0; r < kRows8; ++r) wr[r] = w + (n0 + std::min(r, rows - 1)) * K;   // past N: repeat the last row
    if (K32 < K) {
      for (int64_t r = 0; r < kRows8; ++r) {
        std::memset(tails[r], 0, 32);
        std::memcpy(tails[r], wr[r] + K32, K - K32);
      }
    }
    for (int i = 0; i < 8; ++i) keep_bits[i] = i < rows ? -1 : 0;
    const __m256i keep = _mm256_load_si256(reinterpret_cast<const __m256i*>(keep_bits));
    const __m256 dv = _mm256_maskload_ps(d + n0, keep);
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xr = xq + m * Kp;
      __m256i acc[kRows8];
      for (int64_t r = 0; r < kRows8; ++r) acc[r] = _mm256_setzero_si256();
      for (int64_t k = 0; k < K32; k += 32) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + k));
        for (int64_t r = 0; r < kRows8; ++r)
          acc[r] = _mm256_dpbusd_avx_epi32(acc[r], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r] + k)), xv);
      }
      if (K32 < K) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + K32));   // zero-padded
        for (int64_t r = 0; r < kRows8; ++r)
          acc[r] = _mm256_dpbusd_avx_epi32(acc[r], _mm256_load_si256(reinterpret_cast<const __m256i*>(tails[r])), xv);
      }
      // 8 vectors of 8 lanes -> lane r = the sum of vector r's lanes
      const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
      const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[4], acc[5]), _mm256_hadd_epi32(acc[6], acc[7]));
      const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
      const __m256i s = _mm256_sub_epi32(sums, _mm256_set1_epi32(128 * xsum[m]));
      const __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xs[m])), dv);
      _mm256_maskstore_ps(out + m * N + n0, keep, y);
    }
  }
}
#endif

at::Tensor int8_dots(const at::Tensor& x, const at::Tensor& w, const at::Tensor& d) {
  const Isa isa = g_isa;
  TORCH_CHECK(isa != kNone, "int8_dots: this CPU has neither AVX-512 (F, BW, VL) with VNNI nor AVX2 with AVX-VNNI");
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
  const int64_t Kp = (K + 31) & ~int64_t(31);   // activation rows padded with zeros (the AVX2 form reads them so)
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  thread_local std::vector<int32_t> xsum;
  xq.assign(M * Kp, 0);
  xs.resize(M);
  xsum.resize(M);
#ifdef MTPCHAT_X86
  const float* xp = xc.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    if (isa == kAvx512Vnni)
      quantize_row(xp + m * K, K, xq.data() + m * Kp, &xs[m], &xsum[m]);
    else
      quantize_row_avx2(xp + m * K, K, xq.data() + m * Kp, &xs[m], &xsum[m]);
  }
  const int8_t* q = xq.data();
  const float* s = xs.data();
  const int32_t* qsum = xsum.data();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const float* dp = dc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rows = isa == kAvx512Vnni ? kRows : kRows8;
  const int64_t blocks = (N + rows - 1) / rows;
  // at least 128 KiB of weights a task: smaller products stay on one thread, where a second one's start
  // and wait cost more than it saves (a draft row of the demo model ~5 % faster than with 32 KiB)
  const int64_t grain = std::max<int64_t>(1, (128 << 10) / (rows * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    if (isa == kAvx512Vnni)
      dot_blocks(q, Kp, s, qsum, M, K, wp, dp, op, N, b0, b1);
    else
      dot_blocks_avx2(q, Kp, s, qsum, M, K, wp, dp, op, N, b0, b1);
  });
#endif
  return out;
}

// The instruction set in use ("avx512", "avx2" or "none"); want = "" asks, "avx512" or "avx2" chooses one
// this CPU has (tests run the AVX2 form on AVX-512 CPUs this way).
std::string int8_dots_isa(const std::string& want) {
  if (!want.empty()) {
    const Isa isa = want == "avx512" ? kAvx512Vnni : want == "avx2" ? kAvx2Vnni : kNone;
    TORCH_CHECK(isa != kNone, "int8_dots_isa: expected avx512 or avx2, got ", want);
    TORCH_CHECK(runs(isa), "int8_dots_isa: this CPU does not run the ", want, " form");
    g_isa = isa;
  }
  return isa_name(g_isa);
}

}  // namespace

TORCH_LIBRARY(mtpchat, m) {
  m.def("int8_dots(Tensor x, Tensor w, Tensor d) -> Tensor");
  m.def("int8_dots_isa(str want) -> str", &int8_dots_isa);
}

TORCH_LIBRARY_IMPL(mtpchat, CPU, m) { m.impl("int8_dots", &int8_dots); }
