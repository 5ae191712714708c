// grpo's CPU ops (torch.ops.grpo_cpu): the native decoder's small elementwise and attention work as one op
// each, run in PyTorch's own thread pool. Built and loaded by grpo/kernels/__init__.py.
//
// Why C++ ops: on a CPU these are many small PyTorch ops, each paying dispatch and an OpenMP fork/join. The
// decode's attention was ~50 a layer (four batched matmuls of one [rep × D] × [D × t] product per row and KV
// head, the group <-> row transposes, the concatenation of prompt and completion scores, softmax,
// log-sum-exp): 30% of the eos-off rollout. RMSNorm is ~6 ops forward and ~10 backward, RoPE ~5 and ~6,
// SwiGLU's elementwise work 2 and 3 passes over [tokens, ffn]. Every loop here runs in at::parallel_for,
// the same OpenMP team as every other op (a second thread pool would wait on that team's spinning threads:
// docs/performance.md, "The decode attention as one fused kernel (numba)").
//
// decode_attention: each (row, KV head) item rotates its key and queries, writes this step's key and value
// into the cache, and reads its group's prompt keys and values and its own completion keys and values once,
// for all of its query heads.
//
// The numbers are PyTorch's to float32 rounding: sums add in another order, and exp (softmax, SiLU's
// sigmoid) is a Cephes-style polynomial (~1 ulp). tests/unit/test_cpu_ops.py compares every op.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// e^x for x <= 0 (a score minus its row's maximum), vectorisable: 2^n · p(r), r = x − n·ln 2.
inline float exp_nonpositive(float x) {
  const bool zero = !(x >= -87.0f);  // e^-87 ~ 1.6e-38, below which nothing adds to a sum ≥ 1; −inf: masked
  x = zero ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts (Cephes)
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  return zero ? 0.0f : p * two_n;
}

// The reductions below are `omp simd` loops: OpenMP allows them to add in vector lanes, which plain C++
// forbids without -ffast-math (which would also change every other float operation in this file).
// kD: the head dimension known when compiling (64 and 128 are instantiated: loops of a fixed length
// unroll into a few vector instructions and keep their accumulators in registers), 0 for any other.
template <int64_t kD>
inline float dot(const float* a, const float* b, int64_t d) {
  const int64_t n = kD > 0 ? kD : d;
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}

inline float max_of(const float* x, int64_t count) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < count; ++j) m = std::max(m, x[j]);
  return m;
}

inline float sum_of(const float* x, int64_t count) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < count; ++j) s += x[j];
  return s;
}

// scores[h * stride + j] = scale · q_h · k_j (+ bias[j]) for the rep query heads and keys j < count: each
// key is read once for all heads.
template <int64_t kD>
inline void score_keys(const float* q, int64_t rep, int64_t q_head_stride, const float* k, int64_t count,
                       int64_t k_stride, int64_t d, float scale, const float* bias, float* scores, int64_t stride) {
  for (int64_t j = 0; j < count; ++j) {
    const float* kj = k + j * k_stride;
    const float b = bias == nullptr ? 0.0f : bias[j];
    for (int64_t h = 0; h < rep; ++h) scores[h * stride + j] = dot<kD>(q + h * q_head_stride, kj, d) * scale + b;
  }
}

// out_h += Σ_j p[h * stride + j] · v_j over keys j < count: each value is read once for all heads.
template <int64_t kD>
inline void weigh_values(const float* p, int64_t rep, int64_t stride, const float* v, int64_t count,
                         int64_t v_stride, int64_t d, float* out) {
  const int64_t n = kD > 0 ? kD : d;
  for (int64_t j = 0; j < count; ++j) {
    const float* vj = v + j * v_stride;
    for (int64_t h = 0; h < rep; ++h) {
      const float w = p[h * stride + j];
      float* oh = out + h * n;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) oh[c] += w * vj[c];
    }
  }
}

struct Item {
  const float *q, *kp, *vp, *kc, *vc, *bias;  // this row's query heads of one KV head, and its keys/values
  int64_t q_head_stride, kp_stride, vp_stride, kc_stride, vc_stride, lp, t, rep, d;
  float scale;
  float *out, *lse;  // out: the rep heads' outputs, d apart; lse: rep values or nullptr
};

template <int64_t kD>
void attend(const Item& it, std::vector<float>& scores) {
  const int64_t keys = it.lp + it.t;
  scores.resize(it.rep * keys);
  float* sc = scores.data();
  score_keys<kD>(it.q, it.rep, it.q_head_stride, it.kp, it.lp, it.kp_stride, it.d, it.scale, it.bias, sc, keys);
  score_keys<kD>(it.q, it.rep, it.q_head_stride, it.kc, it.t, it.kc_stride, it.d, it.scale, nullptr, sc + it.lp,
                 keys);
  for (int64_t h = 0; h < it.rep; ++h) {
    float* sh = sc + h * keys;
    const float top = max_of(sh, keys);
#pragma omp simd
    for (int64_t j = 0; j < keys; ++j) sh[j] = exp_nonpositive(sh[j] - top);
    const float total = sum_of(sh, keys);
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t j = 0; j < keys; ++j) sh[j] *= inv;
    if (it.lse != nullptr) it.lse[h] = top + std::log(total);
  }
  weigh_values<kD>(sc, it.rep, keys, it.vp, it.lp, it.vp_stride, it.d, it.out);
  weigh_values<kD>(sc + it.lp, it.rep, keys, it.vc, it.t, it.vc_stride, it.d, it.out);
}

// out = x rotated by RoPE in the rotate-half convention: x·cos + (−x₂, x₁)·sin.
inline void rope(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t c = 0; c < half; ++c) out[c] = x[c] * cos[c] - x[c + half] * sin[c];
#pragma omp simd
  for (int64_t c = half; c < d; ++c) out[c] = x[c] * cos[c] + x[c - half] * sin[c];
}

// One decode step's attention for n rows. qk [n, H + Hkv, D]: this step's queries and keys before RoPE;
// v [n, Hkv, D] its values; cos, sin [n, D] RoPE at each row's position. kc, vc [n, Hkv, t, D]: each row's
// completion keys and values, whose last column (t − 1) receives this step's key (rotated) and value.
// kp, vp [P, Hkv, Lp, D]: each group's prompt; bias [P, Lp] 0 on a prompt's real tokens, −inf on its padding
// or holes; row_group [n] each row's prompt. Returns the output [n, H·D] and, with_lse, each query's
// log-sum-exp of its scaled scores [n, H] (else an empty tensor).
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                                                    const at::Tensor& sin, const at::Tensor& kc, const at::Tensor& vc,
                                                    const at::Tensor& kp, const at::Tensor& vp,
                                                    const at::Tensor& bias, const at::Tensor& row_group,
                                                    double scale, bool with_lse) {
  for (const auto* x : {&qk, &v, &cos, &sin, &kc, &vc, &kp, &vp})
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->device().is_cpu() && x->stride(-1) == 1,
                "grpo_cpu::decode_attention: float32 CPU tensors with a contiguous last dimension");
  TORCH_CHECK(qk.dim() == 3 && v.dim() == 3 && cos.dim() == 2 && sin.dim() == 2 && kc.dim() == 4 && vc.dim() == 4 &&
                  kp.dim() == 4 && vp.dim() == 4,
              "grpo_cpu::decode_attention: qk [n, H + Hkv, D], v [n, Hkv, D], cos/sin [n, D], caches [n|P, Hkv, T, D]");
  const int64_t n = qk.size(0), d = qk.size(2), hkv = kc.size(1), t = kc.size(2), heads = qk.size(1) - hkv;
  const int64_t lp = kp.size(2), rep = heads / hkv;
  TORCH_CHECK(heads == rep * hkv && v.size(1) == hkv && vc.size(2) == t && t >= 1 && kp.size(1) == hkv &&
                  vp.size(2) == lp && cos.size(1) == d && d % 2 == 0,
              "grpo_cpu::decode_attention: head or length mismatch");
  const auto mask = bias.to(at::kFloat).reshape({kp.size(0), lp}).contiguous();
  const auto groups = row_group.to(at::kLong).contiguous();
  auto out = at::zeros({n, heads * d}, qk.options());
  auto lse = with_lse ? at::empty({n, heads}, qk.options()) : at::empty({0}, qk.options());
  const float *qkp = qk.data_ptr<float>(), *vp_new = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *kcp = kc.data_ptr<float>(), *vcp = vc.data_ptr<float>();
  const float *kpp = kp.data_ptr<float>(), *vpp = vp.data_ptr<float>();
  const float* mp = mask.data_ptr<float>();
  const int64_t* grp = groups.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  float* lp_out = with_lse ? lse.data_ptr<float>() : nullptr;
  const float s = static_cast<float>(scale);
  auto run = d == 64 ? &attend<64> : d == 128 ? &attend<128> : &attend<0>;
  at::parallel_for(0, n * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, queries(rep * d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / hkv, g = item % hkv, group = grp[row];
      const float* x = qkp + row * qk.stride(0);
      const float *c = cp + row * cos.stride(0), *sn = sp + row * sin.stride(0);
      float* kc_item = kcp + row * kc.stride(0) + g * kc.stride(1);
      float* vc_item = vcp + row * vc.stride(0) + g * vc.stride(1);
      rope(x + (heads + g) * qk.stride(1), c, sn, d, kc_item + (t - 1) * kc.stride(2));
      std::memcpy(vc_item + (t - 1) * vc.stride(2), vp_new + row * v.stride(0) + g * v.stride(1), d * sizeof(float));
      for (int64_t h = 0; h < rep; ++h) rope(x + (g * rep + h) * qk.stride(1), c, sn, d, queries.data() + h * d);
      Item it{queries.data(),
              kpp + group * kp.stride(0) + g * kp.stride(1),
              vpp + group * vp.stride(0) + g * vp.stride(1),
              kc_item,
              vc_item,
              mp + group * lp,
              d, kp.stride(2), vp.stride(2), kc.stride(2), vc.stride(2), lp, t, rep, d, s,
              op + row * heads * d + g * rep * d,
              lp_out == nullptr ? nullptr : lp_out + row * heads + g * rep};
      run(it, scores);
    }
  });
  return {out, lse};
}

// RMSNorm over the last dimension of x [n, d], in float32: y = weight · x · inv, inv = 1 / sqrt(mean(x²) + eps).
// Forward returns y and inv [n] (what backward needs). Rows are split over the pool in fixed chunks, so a
// run on the same machine and thread count gets the same bits every time (resumes depend on it).
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() == 2 &&
                  weight.dim() == 1 && weight.size(0) == x.size(1) && x.device().is_cpu(),
              "grpo_cpu::rms_norm: float32 CPU x [n, d] and weight [d]");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t n = xc.size(0), d = xc.size(1);
  auto inv = at::empty({n}, xc.options());
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float *op = out.data_ptr<float>(), *ip = inv.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // A row is a few hundred to a few thousand floats: one thread takes ~64K of them before a second joins.
  at::parallel_for(0, n, std::max<int64_t>(1, 65536 / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * d;
      float* orow = op + r * d;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t c = 0; c < d; ++c) squares += xr[c] * xr[c];
      const float k = 1.0f / std::sqrt(squares / static_cast<float>(d) + e);
      ip[r] = k;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) orow[c] = wp[c] * (xr[c] * k);
    }
  });
  return {out, inv};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(rms_norm_forward(x, weight, eps));
}

// The gradients of rms_norm_forward: with u = grad · weight, dx = inv · u − x · inv³ · (u · x) / d and
// dweight = Σ_rows grad · x · inv. dweight's sum runs in per-thread partial sums added in thread order.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& inv) {
  const auto gc = grad.contiguous();
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  const int64_t n = xc.size(0), d = xc.size(1);
  TORCH_CHECK(gc.sizes() == xc.sizes() && inv.size(0) == n && gc.scalar_type() == at::kFloat,
              "grpo_cpu::rms_norm_backward: shapes");
  auto dx = at::empty_like(xc);
  const int64_t threads = at::get_num_threads();
  auto partial = at::zeros({threads, d}, xc.options());
  const float *gp = gc.data_ptr<float>(), *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  const float* ip = inv.data_ptr<float>();
  float *dp = dx.data_ptr<float>(), *pp = partial.data_ptr<float>();
  const float inv_d = 1.0f / static_cast<float>(d);
  at::parallel_for(0, n, std::max<int64_t>(1, 65536 / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
    float* acc = pp + at::get_thread_num() * d;
    for (int64_t r = begin; r < end; ++r) {
      const float *gr = gp + r * d, *xr = xp + r * d;
      const float k = ip[r];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < d; ++c) dot += gr[c] * wp[c] * xr[c];
      const float coef = k * k * k * dot * inv_d;
      float* dr = dp + r * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) {
        dr[c] = k * (gr[c] * wp[c]) - xr[c] * coef;
        acc[c] += gr[c] * (xr[c] * k);
      }
    }
  });
  return {dx, partial.sum(0)};
}

// RoPE in the rotate-half convention over x [S, H, D] (any strides, D contiguous) with cos, sin [S, D]
// (the same for every head): out = x·cos + (−x₂, x₁)·sin, contiguous. backward = true applies the transpose
// (the input gradient of that map for an output gradient x): x·cos + (x₂·sin₂, −x₁·sin₁).
at::Tensor rope_map(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  x.dim() == 3 && cos.dim() == 2 && sin.dim() == 2 && x.stride(2) == 1 && cos.stride(1) == 1 &&
                  sin.stride(1) == 1 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && x.size(2) % 2 == 0,
              "grpo_cpu::rope: float32 x [S, H, D] and cos, sin [S, D], D even and contiguous");
  const int64_t s = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  auto out = at::empty({s, heads, d}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x0 = x.stride(0), x1 = x.stride(1), c0 = cos.stride(0), s0 = sin.stride(0);
  at::parallel_for(0, s * heads, std::max<int64_t>(1, 32768 / d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const float* xr = xp + t * x0 + h * x1;
      const float *c = cp + t * c0, *sn = sp + t * s0;
      float* o = op + i * d;
      if (!backward) {
        rope(xr, c, sn, d, o);
        continue;
      }
#pragma omp simd
      for (int64_t k = 0; k < half; ++k) o[k] = xr[k] * c[k] + xr[k + half] * sn[k + half];
#pragma omp simd
      for (int64_t k = half; k < d; ++k) o[k] = xr[k] * c[k] - xr[k - half] * sn[k - half];
    }
  });
  return out;
}

// SwiGLU's elementwise work, one pass each way over [S, f] (gate and up may be strided views, e.g. the two
// halves of one [S, 2f] product). Forward: silu = gate · σ(gate), product = silu · up. Backward, for the
// product's gradient gp: d_up = gp · silu, d_gate = gp · up · σ(gate) · (1 + gate · (1 − σ(gate))).
inline float sigmoid(float x) {
  // e^−x for any x: e^x = 1 / e^−x keeps exp_nonpositive's argument ≤ 0 (where its polynomial is accurate)
  const float e = exp_nonpositive(-std::fabs(x));  // e^−|x| in (0, 1]
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1 && t.sizes() == like.sizes() &&
                  t.device().is_cpu(),
              "grpo_cpu::swiglu: ", name, " must be float32 [S, f] with contiguous rows");
}

void swiglu_forward(const at::Tensor& gate, const at::Tensor& up, at::Tensor& silu, at::Tensor& product) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&up, &silu, &product}) check_rows(*t, gate, "every tensor");
  check_rows(gate, gate, "gate");
  const int64_t s = gate.size(0), f = gate.size(1);
  const float *gp = gate.data_ptr<float>(), *up_ = up.data_ptr<float>();
  float *sp = silu.data_ptr<float>(), *pp = product.data_ptr<float>();
  const int64_t g0 = gate.stride(0), u0 = up.stride(0), s0 = silu.stride(0), p0 = product.stride(0);
  at::parallel_for(0, s, std::max<int64_t>(1, 32768 / std::max<int64_t>(f, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *g = gp + r * g0, *u = up_ + r * u0;
      float *so = sp + r * s0, *po = pp + r * p0;
#pragma omp simd
      for (int64_t c = 0; c < f; ++c) {
        const float v = g[c] * sigmoid(g[c]);
        so[c] = v;
        po[c] = v * u[c];
      }
    }
  });
}

void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& silu,
                     at::Tensor& d_gate, at::Tensor& d_up) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&grad, &up, &silu, &d_gate, &d_up}) check_rows(*t, gate, "every tensor");
  check_rows(gate, gate, "gate");
  const int64_t s = gate.size(0), f = gate.size(1);
  const float *gr = grad.data_ptr<float>(), *gp = gate.data_ptr<float>(), *up_ = up.data_ptr<float>();
  const float* sp = silu.data_ptr<float>();
  float *dg = d_gate.data_ptr<float>(), *du = d_up.data_ptr<float>();
  const int64_t r0 = grad.stride(0), g0 = gate.stride(0), u0 = up.stride(0), s0 = silu.stride(0);
  const int64_t dg0 = d_gate.stride(0), du0 = d_up.stride(0);
  at::parallel_for(0, s, std::max<int64_t>(1, 32768 / std::max<int64_t>(f, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *a = gr + r * r0, *g = gp + r * g0, *u = up_ + r * u0, *sl = sp + r * s0;
      float *og = dg + r * dg0, *ou = du + r * du0;
#pragma omp simd
      for (int64_t c = 0; c < f; ++c) {
        const float sg = sigmoid(g[c]);
        ou[c] = a[c] * sl[c];
        og[c] = (a[c] * u[c]) * (sg * (1.0f + g[c] * (1.0f - sg)));
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(grpo_cpu, m) {
  m.def(
      "decode_attention(Tensor qk, Tensor v, Tensor cos, Tensor sin, Tensor(a!) kc, Tensor(b!) vc, Tensor kp, "
      "Tensor vp, Tensor bias, Tensor row_group, float scale, bool with_lse) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("swiglu_forward(Tensor gate, Tensor up, Tensor(a!) silu, Tensor(b!) product) -> ()");
  m.def(
      "swiglu_backward(Tensor grad, Tensor gate, Tensor up, Tensor silu, Tensor(a!) d_gate, Tensor(b!) d_up) -> ()");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool backward) -> Tensor");
  m.def("rms_norm_forward(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor inv) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(grpo_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_forward", &rms_norm_forward);
  m.impl("rope", &rope_map);
  m.impl("swiglu_forward", &swiglu_forward);
  m.impl("swiglu_backward", &swiglu_backward);
  m.impl("rms_norm_backward", &rms_norm_backward);
}
