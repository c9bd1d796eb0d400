/* Fused CPU kernels of the depth router (megatron_delta/router.py, DESIGN.md section 1).
 *
 * Why: on CPU the router is memory-bound, and eager PyTorch makes one pass over memory per operator
 * (the weighted sum re-reads its accumulator once per source, a row-wise dot product writes and
 * re-reads a product tensor). These loops make each pass the method needs exactly once: a token's
 * row of every tensor is read while it is in L1. Rows are independent, so the result of a row does
 * not depend on the number of threads (bitwise reproducible across thread counts and TP/SP shards).
 * fp32, contiguous [T, d] tensors; the [M, T] softmax math stays in PyTorch.
 * Built on first use by megatron_delta/cpu_kernels.py (cc -O3 -march=native -fopenmp).
 */
#include <stddef.h>
#include <stdint.h>

/* out[t] = base[t] (or 0) + sum_i w[i][t] * v_i[t] (+ w_null[t] * null_value). */
void delta_route_forward(int64_t T, int64_t d, int n, const float *const *v, const float *restrict w,
                         const float *restrict base, const float *restrict null_value,
                         const float *restrict w_null, float *restrict out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < T; ++t) {
    float *restrict o = out + t * d;
    const float *v0 = v[0] + t * d;
    const float w0 = w[t];
    if (base) {
      const float *b = base + t * d;
      for (int64_t k = 0; k < d; ++k) o[k] = b[k] + w0 * v0[k];
    } else {
      for (int64_t k = 0; k < d; ++k) o[k] = w0 * v0[k];
    }
    for (int i = 1; i < n; ++i) {
      const float wi = w[(int64_t)i * T + t];
      const float *restrict vi = v[i] + t * d;
      for (int64_t k = 0; k < d; ++k) o[k] += wi * vi[k];
    }
    if (null_value) {
      const float wz = w_null[t];
      for (int64_t k = 0; k < d; ++k) o[k] += wz * null_value[k];
    }
  }
}

/* dw[i][t] = <grad[t], v_i[t]>; and, where sink[i] is given, sink_i[t] += w[i][t] * grad[t]
 * (= when fresh[i]: the first reader to reach a source's gradient sink creates it). */
void delta_route_backward(int64_t T, int64_t d, int n, const float *grad, const float *const *v,
                          const float *w, float *const *sink, const int *fresh, float *dw, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < T; ++t) {
    const float *restrict g = grad + t * d;
    for (int i = 0; i < n; ++i) {
      const float *restrict vi = v[i] + t * d;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < d; ++k) acc += g[k] * vi[k];
      dw[(int64_t)i * T + t] = acc;
      if (sink[i]) {
        const float wi = w[(int64_t)i * T + t];
        float *restrict s = sink[i] + t * d;
        if (fresh[i]) {
          for (int64_t k = 0; k < d; ++k) s[k] = wi * g[k];
        } else {
          for (int64_t k = 0; k < d; ++k) s[k] += wi * g[k];
        }
      }
    }
  }
}
