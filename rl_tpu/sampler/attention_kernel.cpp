// rl-tpu's float32 decode attention for the CPU sampler (AVX-512): one query token per row against a KV cache.
//
// out[b, h] = softmax(q[b, h] . k[b, h / G, j] * scale + mask[b, j], over j) @ v[b, h / G]  (Vaswani et al. 2017),
// the query heads h of one key/value head (G = heads / kv_heads of them, grouped-query attention) done together so
// the key and value rows are read once per key/value head. The matrix products batched over (row, key/value head)
// that this replaces are 48 small products per layer for SmolLM2 at 16 rows: ATen's bmm took ~180 us each for
// 1.2 MB of keys. Exponentials are SLEEF's expf16_u10 (ATen's vectorized exp, exported by libtorch_cpu); a row whose
// every key is masked gives NaN, as torch's softmax does. Where a boolean mask is false, neither the key nor the value
// row is read (its weight is exactly 0; the static cache's unwritten and padded slots), so a static cache read whole,
// masked, costs only its attended slots; an additive mask reads every slot. Built and loaded with panel_kernel.cpp by
// panel_kernel.py; called from attention.py, which checks shapes, dtypes and the mask first.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

extern "C" __m512 Sleef_expf16_u10(__m512);

namespace {

constexpr int64_t kLanes = 16;

inline __mmask16 tail(int64_t n) {
  return n >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

struct Args {
  const float *q, *k, *v;
  float* out;
  const bool* mask_bool;
  const float* mask_add;
  int64_t ms0, ms1, ks0, ks1, ks2, vs0, vs1, vs2, heads, kv_heads, group, len, padded;
  float scale;
};

// One (row, key/value head): its `group` query heads against `len` keys and values of DC x 16 floats each.
// next_keys, next_values: the next (row, head)'s, pulled into L2 a row at a time meanwhile (nullptr: none).
template <int DC>
void attend(const Args& a, int64_t b, int64_t h, float* probs, const float* next_keys, const float* next_values) {
  constexpr int64_t dim = DC * kLanes;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float* keys = a.k + b * a.ks0 + h * a.ks1;
  const float* values = a.v + b * a.vs0 + h * a.vs1;
  for (int64_t g = 0; g < a.group; ++g) {
    const float* query = a.q + (b * a.heads + h * a.group + g) * dim;
    float* row = probs + g * a.padded;
    __m512 qv[DC];
#pragma GCC unroll 16
    for (int c = 0; c < DC; ++c) qv[c] = _mm512_loadu_ps(query + c * kLanes);
    // scores: q . k_j * scale, masked (bool: -inf where false) or plus the additive mask
    for (int64_t j = 0; j < a.len; ++j) {
      const float* key = keys + j * a.ks2;
      if (a.mask_bool && !a.mask_bool[b * a.ms0 + j * a.ms1]) {  // masked: exp(-inf) = 0, its key is not read
        row[j] = neg_inf;
        continue;
      }
      if (g == 0) {  // the first query head pulls the keys 8 rows ahead, and this row's values, into cache
#pragma GCC unroll 16
        for (int c = 0; c < DC; ++c) {
          _mm_prefetch(reinterpret_cast<const char*>(key + 8 * a.ks2 + c * kLanes), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(values + j * a.vs2 + c * kLanes), _MM_HINT_T0);
        }
        if (next_keys) {  // and the next (row, head)'s row j into L2: its reads overlap this one's arithmetic
#pragma GCC unroll 16
          for (int c = 0; c < DC; ++c) {
            _mm_prefetch(reinterpret_cast<const char*>(next_keys + j * a.ks2 + c * kLanes), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(next_values + j * a.vs2 + c * kLanes), _MM_HINT_T1);
          }
        }
      }
      __m512 even = _mm512_mul_ps(qv[0], _mm512_loadu_ps(key));
      __m512 odd = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int c = 1; c < DC; ++c) {
        if (c % 2) odd = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(key + c * kLanes), odd);
        else even = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(key + c * kLanes), even);
      }
      float s = _mm512_reduce_add_ps(_mm512_add_ps(even, odd)) * a.scale;
      if (a.mask_add) s += a.mask_add[b * a.ms0 + j * a.ms1];
      row[j] = s;
    }
    // softmax over j: exp(s - max) / sum
    __m512 vmax = _mm512_set1_ps(neg_inf);
    for (int64_t j = 0; j < a.len; j += kLanes)
      vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), tail(a.len - j), row + j));
    const float top_s = _mm512_reduce_max_ps(vmax);
    float* dst = a.out + (b * a.heads + h * a.group + g) * dim;
    if (top_s == neg_inf) {  // every key masked: NaN, as torch's softmax gives (0 / 0)
      for (int64_t c = 0; c < dim; ++c) dst[c] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const __m512 top = _mm512_set1_ps(top_s);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < a.len; j += kLanes) {
      const __mmask16 m = tail(a.len - j);
      const __m512 e = _mm512_maskz_mov_ps(m, Sleef_expf16_u10(_mm512_sub_ps(_mm512_mask_loadu_ps(top, m, row + j), top)));
      _mm512_mask_storeu_ps(row + j, m, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(vsum);
    // out[g] = sum_j (p[g, j] / sum) v_j
    __m512 acc[DC];
#pragma GCC unroll 16
    for (int c = 0; c < DC; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < a.len; ++j) {
      if (a.mask_bool && !a.mask_bool[b * a.ms0 + j * a.ms1]) continue;  // weight 0: its value row is not read
      const __m512 p = _mm512_set1_ps(row[j] * inv);
      const float* value = values + j * a.vs2;
#pragma GCC unroll 16
      for (int c = 0; c < DC; ++c) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + c * kLanes), acc[c]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(dst + c * kLanes, acc[c]);
  }
}

// q (batch, heads, dim) contiguous; k, v (batch, kv_heads, len, dim) with their last dimension contiguous, dim 64,
// 128 or 256; mask (batch, len), bool (true = attend) or float32 (added), any strides, or none.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat && q.device().is_cpu(),
              "decode_attention: q must be a contiguous (batch, heads, dim) float32 CPU tensor");
  const int64_t dim = q.size(2);
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  k.stride(3) == 1 && v.stride(3) == 1 && k.size(0) == q.size(0) && v.size(0) == q.size(0) &&
                  k.size(1) == v.size(1) && k.size(2) == v.size(2) && k.size(3) == dim && v.size(3) == dim &&
                  k.size(1) > 0 && k.size(2) > 0 && q.size(1) % k.size(1) == 0 && (dim == 64 || dim == 128 || dim == 256),
              "decode_attention: k, v must be (batch, kv_heads, len, dim) float32 with the last dimension "
              "contiguous, dim 64, 128 or 256, len > 0, heads a multiple of kv_heads > 0");
  const int64_t batch = q.size(0), len = k.size(2);
  const bool bool_mask = mask.has_value() && mask->scalar_type() == at::kBool;
  TORCH_CHECK(!mask.has_value() || (mask->dim() == 2 && mask->size(0) == batch && mask->size(1) == len &&
                                    (bool_mask || mask->scalar_type() == at::kFloat)),
              "decode_attention: mask must be (batch, len), bool or float32");
  at::Tensor out = at::empty({batch, q.size(1), dim}, q.options());
  if (out.numel() == 0) return out;
  Args a{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
         bool_mask ? mask->data_ptr<bool>() : nullptr,
         mask.has_value() && !bool_mask ? mask->data_ptr<float>() : nullptr,
         mask.has_value() ? mask->stride(0) : 0, mask.has_value() ? mask->stride(1) : 0,
         k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
         q.size(1), k.size(1), q.size(1) / k.size(1), len, (len + kLanes - 1) / kLanes * kLanes,
         static_cast<float>(scale)};
  at::parallel_for(0, batch * a.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(static_cast<size_t>(a.group * a.padded));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / a.kv_heads, h = item % a.kv_heads, nb = (item + 1) / a.kv_heads,
                    nh = (item + 1) % a.kv_heads;
      const float* nk = item + 1 < end ? a.k + nb * a.ks0 + nh * a.ks1 : nullptr;
      const float* nv = item + 1 < end ? a.v + nb * a.vs0 + nh * a.vs1 : nullptr;
      if (dim == 64) attend<4>(a, b, h, probs.data(), nk, nv);
      else if (dim == 128) attend<8>(a, b, h, probs.data(), nk, nv);
      else attend<16>(a, b, h, probs.data(), nk, nv);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rl_tpu_kernels, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(rl_tpu_kernels, CPU, m) { m.impl("decode_attention", &decode_attention); }
