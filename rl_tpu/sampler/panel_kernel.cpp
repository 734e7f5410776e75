// rl-tpu's weight-streaming float32 linear layer for the CPU sampler's decode steps (AVX-512).
//
// out (M, N) = x (M, K) @ W^T + bias, with W (N, K) packed once as panels wp (P = ceil(N / 16), K, 16): panel p
// holds columns 16p..16p+15 of W^T, row k of the panel being the 16 weights that multiply x[:, k]. A panel is one
// contiguous run of memory, read once, front to back, while up to 16 rows of x are multiplied by it: 16 AVX-512
// accumulators (one per row of x) take one fused multiply-add per weight vector and row, and the panel's bytes a few
// KiB ahead are prefetched into L2 while the current ones are multiplied, so reading the weights from memory and the
// multiply-adds overlap. More than 16 rows are done 16 at a time on the same panel (then in cache). Panels are split
// among ATen's intra-op threads.
//
// Summation order: bias first, then k = 0..K-1 in order (float32 fused multiply-adds); the result differs from
// torch.nn.functional.linear by float32 rounding only. Built and loaded by panel_kernel.py, which checks the CPU
// and the arguments first.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;           // float32 lanes of one AVX-512 register = columns of a panel
constexpr int64_t kPrefetch = 16 * 256;  // floats ahead of the current weight row (16 KiB): tuned on AMD EPYC
// Prefetched into L2 (T1), not L1 (T0): x transposed, (in, 16) floats (36 KiB at SmolLM2's in = 576), fills a
// 32 KiB L1 already; on a Zen 4 core the 211 linears of a decode step took 49-54 ms with T0 and 42-44 with T1
// (4-16 KiB ahead alike; 72-76 ms without software prefetch), against ~41 ms with every weight in cache.

template <int R>
void panel_rows(const float* __restrict xt, const float* __restrict wp, int64_t k_dim, const float* bias,
                float* __restrict out, int64_t ldo, int64_t cols, bool prefetch) {
  const __mmask16 mask = cols >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 init = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = init;
  for (int64_t k = 0; k < k_dim; ++k) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wp + k * kLanes + kPrefetch), _MM_HINT_T1);
    const __m512 w = _mm512_loadu_ps(wp + k * kLanes);
    const float* a = xt + k * kLanes;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r]), w, acc[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, acc[r]);
}

using PanelFn = void (*)(const float*, const float*, int64_t, const float*, float*, int64_t, int64_t, bool);

template <int... R>
constexpr std::array<PanelFn, sizeof...(R)> table(std::integer_sequence<int, R...>) {
  return {&panel_rows<R + 1>...};
}

constexpr auto kPanels = table(std::make_integer_sequence<int, kLanes>{});

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias,
                        int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "panel_linear: x must be a contiguous (rows, in) float32 CPU tensor");
  TORCH_CHECK(wp.dim() == 3 && wp.scalar_type() == at::kFloat && wp.is_contiguous() && wp.size(2) == kLanes &&
                  wp.size(1) == x.size(1) && wp.size(0) * kLanes >= n && (wp.size(0) - 1) * kLanes < n,
              "panel_linear: wp must be the contiguous (ceil(out / 16), in, 16) float32 panels of an (out, in) weight");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                                    bias->scalar_type() == at::kFloat),
              "panel_linear: bias must be a contiguous (out,) float32 tensor");
  const int64_t rows = x.size(0), k_dim = x.size(1), panels = wp.size(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const int64_t chunks = (rows + kLanes - 1) / kLanes;
  // x transposed per chunk of 16 rows: (chunks, in, 16), zero where a chunk has fewer rows
  std::vector<float> xt(static_cast<size_t>(chunks * k_dim * kLanes), 0.0f);
  const float* xs = x.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = xt.data() + (r / kLanes) * k_dim * kLanes + (r % kLanes);
    const float* src = xs + r * k_dim;
    for (int64_t k = 0; k < k_dim; ++k) dst[k * kLanes] = src[k];
  }
  const float* w = wp.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(kLanes, n - p * kLanes);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t r = std::min<int64_t>(kLanes, rows - c * kLanes);
        kPanels[r - 1](xt.data() + c * k_dim * kLanes, w + p * k_dim * kLanes, k_dim, b ? b + p * kLanes : nullptr,
                       o + c * kLanes * n + p * kLanes, n, cols, c == 0);
      }
    }
  });
  return out;
}

// The weight (out, in) float32 as panels (ceil(out / 16), in, 16), zero past out: the layout panel_linear reads.
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_panels: weight must be an (out, in) float32 CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k_dim = w.size(1), panels = (n + kLanes - 1) / kLanes;
  at::Tensor wp = at::empty({panels, k_dim, kLanes}, w.options().requires_grad(false));
  const float* src = w.data_ptr<float>();
  float* dst = wp.data_ptr<float>();
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t k = 0; k < k_dim; ++k)
      for (int64_t c = 0; c < kLanes; ++c) {
        const int64_t row = p * kLanes + c;
        dst[(p * k_dim + k) * kLanes + c] = row < n ? src[row * k_dim + k] : 0.0f;
      }
  return wp;
}

// Packed copies of the weights of one compiled sampler's graphs (compiled_packed.PackCache), per cache id. An entry
// is keyed by the weight's data pointer, shape and strides, and serves only while the weight's version counter is
// the one packed and its storage is the one packed: the weak reference keeps a freed StorageImpl's address from being
// reused while the entry exists, so an equal pointer is the same storage.
struct Packed {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t version;
  at::Tensor panels;
};
using Key = std::tuple<const void*, int64_t, int64_t, int64_t, int64_t>;
struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = std::hash<const void*>()(std::get<0>(key));
    for (int64_t v : {std::get<1>(key), std::get<2>(key), std::get<3>(key), std::get<4>(key)})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};
std::mutex g_mutex;
std::unordered_map<int64_t, std::unordered_map<Key, Packed, KeyHash>> g_caches;

at::Tensor cached_panels(int64_t cache, const at::Tensor& weight) {
  const Key key{weight.data_ptr(), weight.size(0), weight.size(1), weight.stride(0), weight.stride(1)};
  const int64_t version = weight._version();
  const c10::StorageImpl* storage = weight.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& entries = g_caches[cache];
  auto found = entries.find(key);
  if (found != entries.end() && found->second.version == version &&
      found->second.storage._unsafe_get_target() == storage && !found->second.storage.expired())
    return found->second.panels;
  for (auto it = entries.begin(); it != entries.end();)  // weights freed or rebound: their copies go with them
    it = it->second.storage.expired() ? entries.erase(it) : std::next(it);
  Packed entry{weight.storage().getWeakStorageImpl(), version, pack_panels(weight)};
  at::Tensor panels = entry.panels;
  entries.insert_or_assign(key, std::move(entry));
  return panels;
}

// F.linear(x, weight, bias) on cache's packed copy of weight: x (..., in), weight (out, in), bias (out,) or None ->
// (..., out); F.linear itself where x or weight is not a float32 CPU tensor.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t cache) {
  if (x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat || !x.device().is_cpu() ||
      !weight.device().is_cpu() || weight.dim() != 2 || (bias.has_value() && bias->scalar_type() != at::kFloat))
    return at::linear(x, weight, bias);
  const at::Tensor panels = cached_panels(cache, weight);
  const int64_t n = weight.size(0);
  std::optional<at::Tensor> b = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  at::Tensor out = panel_linear(x.reshape({-1, x.size(-1)}).contiguous(), panels, b, n);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

void release_cache(int64_t cache) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_caches.erase(cache);
}

int64_t cache_bytes(int64_t cache) {
  std::lock_guard<std::mutex> lock(g_mutex);
  int64_t total = 0;
  auto found = g_caches.find(cache);
  if (found != g_caches.end())
    for (const auto& item : found->second) total += item.second.panels.nbytes();
  return total;
}

}  // namespace

TORCH_LIBRARY(rl_tpu_kernels, m) {
  m.def("panel_linear(Tensor x, Tensor wp, Tensor? bias, int out_features) -> Tensor");
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, int cache) -> Tensor");
  m.def("release_cache(int cache) -> ()", &release_cache);  // no tensor arguments: one kernel for every device
  m.def("cache_bytes(int cache) -> int", &cache_bytes);
}

TORCH_LIBRARY_IMPL(rl_tpu_kernels, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("pack_panels", &pack_panels);
  m.impl("packed_linear", &packed_linear);
}

