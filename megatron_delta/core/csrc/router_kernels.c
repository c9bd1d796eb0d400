/* Fused CPU kernels of the depth router (megatron_delta/core/router.py, docs/design.md section 1).
 *
 * Why: on CPU the router is memory-bound, and eager PyTorch makes one pass over memory per operator
 * (the weighted sum re-reads its accumulator once per source, a row-wise dot product writes and
 * re-reads a product tensor, a softmax over depth is a dozen small operators). These loops do all of
 * one router's work for a token's row while that row is in cache: the logits of the sources it
 * projects itself (a source only this router reads: its norm and dot with the query), the softmax
 * over depth, the weighted sum; in backward the dot products, the softmax's derivative and every
 * source's gradient. Rows are independent, so the result of a row does not depend on the number of
 * threads (bitwise reproducible across thread counts and TP/SP shards).
 * fp32, contiguous [T, d] tensors and [M, T] weight tables. Built on first use by
 * megatron_delta/cpu_kernels.py (cc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

static float dot(const float *restrict a, const float *restrict b, int64_t d) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < d; ++k) acc += a[k] * b[k];
  return acc;
}

/* Per token t, with M = n + has_null:
 *   logit_i = col_i[t]                         (col_i given: projected once for all its readers)
 *           = (v_i[t] . q) * inv_i[t]          (col_i NULL: "local", projected here;
 *             inv_i[t] = 1/sqrt(mean_k v_i[t,k]^2 + eps), stored with the logit in inv_out/z_out)
 *   logit_null = null_logit
 *   alpha[:, t] = softmax(logit)               (stored, [M, T])
 *   out[t] = base[t] (or 0) + gate * (sum_i alpha_i v_i[t] + alpha_null null_value)
 * unit != 0 (base NULL): the base is the sum of the sources themselves, out[t] = sum_i (1 + gate alpha_i)
 *   v_i[t] + gate alpha_null null_value - the additive modes' residual stream kept as its sources. */
void delta_route_forward(int64_t T, int64_t d, int n, const float *const *v, const float *const *cols,
                         const float *restrict q, float eps, int has_null, float null_logit,
                         const float *restrict null_value, float gate, const float *restrict base,
                         int unit, float *restrict alpha, float *const *inv_out, float *const *z_out,
                         float *restrict out, int threads) {
  const float one = unit ? 1.0f : 0.0f;
  const int m = n + (has_null != 0);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < T; ++t) {
    float w[m];
    for (int i = 0; i < n; ++i) {
      if (cols[i]) {
        w[i] = cols[i][t];
        continue;
      }
      const float *restrict vi = v[i] + t * d;
      float ss = 0.0f, vq = 0.0f;
#pragma omp simd reduction(+ : ss, vq)
      for (int64_t k = 0; k < d; ++k) {
        ss += vi[k] * vi[k];
        vq += vi[k] * q[k];
      }
      const float inv = 1.0f / sqrtf(ss / (float)d + eps);
      inv_out[i][t] = inv;
      w[i] = z_out[i][t] = vq * inv;
    }
    if (has_null) w[n] = null_logit;
    float mx = w[0];
    for (int i = 1; i < m; ++i) mx = w[i] > mx ? w[i] : mx;
    float sum = 0.0f;
    for (int i = 0; i < m; ++i) sum += (w[i] = expf(w[i] - mx));
    const float scale = 1.0f / sum;
    for (int i = 0; i < m; ++i) {
      const float a = w[i] * scale;
      alpha[(int64_t)i * T + t] = a;
      w[i] = a * gate + (i < n ? one : 0.0f);
    }

    float *restrict o = out + t * d;
    const float *v0 = v[0] + t * d;
    if (base) {
      const float *b = base + t * d;
      for (int64_t k = 0; k < d; ++k) o[k] = b[k] + w[0] * v0[k];
    } else {
      for (int64_t k = 0; k < d; ++k) o[k] = w[0] * v0[k];
    }
    for (int i = 1; i < n; ++i) {
      const float wi = w[i];
      const float *restrict vi = v[i] + t * d;
      for (int64_t k = 0; k < d; ++k) o[k] += wi * vi[k];
    }
    if (has_null) {
      const float wz = w[n];
      for (int64_t k = 0; k < d; ++k) o[k] += wz * null_value[k];
    }
  }
}

/* Backward of delta_route_forward for the output gradient grad [T, d]. Per token t:
 *   dw_i = <grad[t], v_i[t]> (and <grad[t], null_value>)      -> dw_out [M, T] (for the gate's grad)
 *   dlogit_i = alpha_i (gate dw_i - sum_k alpha_k gate dw_k)  -> dlogit_out [M, T]
 *   target_i[t] (+)= gate alpha_i grad[t]       (a gradient sink; assigned where fresh_i, else added;
 *                                                 (1 + gate alpha_i) grad[t] with unit, see the forward)
 *   local i: c = dlogit_i inv_i, target_i[t] = gate alpha_i grad[t] + c q - dlogit_i z_i inv_i^2 / d v_i[t]
 *            (its whole gradient: the weighted sum's share plus the projection's), and the query's
 *            gradient dq = sum_t sum_local c v_i[t] -> dq_out [d] (when given).
 * recover >= 0: v[recover] is NOT that source but the forward's output u = base + gate (sum_i alpha_i v_i
 *   + alpha_null null_value), and base = sum_i v_i (the sources sum to the residual stream: delta_block's
 *   x = h0 + sum Delta + P; with unit the base is that sum by construction). The source is rebuilt per token, v_r = (u - sum_{i!=r} (1 + w_i) v_i
 *   - w_null null_value) / (1 + w_r), w = gate alpha, from rows this loop reads anyway, so the forward
 *   need not keep it (one [T, d] tensor less saved per router). The caller guarantees 1 + w_r >= 1/2.
 * dq is summed over fixed blocks of TB tokens, then over the blocks in order: bitwise the same for any
 * number of threads. */
enum { TB = 64 };

void delta_route_backward(int64_t T, int64_t d, int n, const float *grad, const float *const *v,
                          const float *restrict alpha, float gate, int has_null,
                          const float *restrict null_value, const float *restrict q,
                          const float *const *inv, const float *const *z, float *const *target,
                          const int *fresh, int unit, float *restrict dw_out, float *restrict dlogit_out,
                          int recover, float *restrict dq_part, float *restrict dq_out, int threads) {
  const int m = n + (has_null != 0);
  const float one = unit ? 1.0f : 0.0f;
  const int64_t nblk = (T + TB - 1) / TB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < nblk; ++blk) {
    float *restrict part = dq_out ? dq_part + blk * d : NULL;
    if (part)
      for (int64_t k = 0; k < d; ++k) part[k] = 0.0f;
    float rec[recover >= 0 ? d : 1];
    const float *rows[n];
    float dw[m];
    const int64_t t1 = (blk + 1) * TB < T ? (blk + 1) * TB : T;
    for (int64_t t = blk * TB; t < t1; ++t) {
      const float *restrict g = grad + t * d;
      for (int i = 0; i < n; ++i) rows[i] = v[i] + t * d;
      if (recover >= 0) {
        const float *restrict u = rows[recover];
        for (int64_t k = 0; k < d; ++k) rec[k] = u[k];
        for (int i = 0; i < n; ++i) {
          if (i == recover) continue;
          const float ci = 1.0f + gate * alpha[(int64_t)i * T + t];
          const float *restrict vi = rows[i];
          for (int64_t k = 0; k < d; ++k) rec[k] -= ci * vi[k];
        }
        if (has_null) {
          const float wz = gate * alpha[(int64_t)n * T + t];
          for (int64_t k = 0; k < d; ++k) rec[k] -= wz * null_value[k];
        }
        const float s = 1.0f / (1.0f + gate * alpha[(int64_t)recover * T + t]);
        for (int64_t k = 0; k < d; ++k) rec[k] *= s;
        rows[recover] = rec;
      }
      for (int i = 0; i < n; ++i) dw[i] = dot(g, rows[i], d);
      if (has_null) dw[n] = dot(g, null_value, d);
      float s = 0.0f;
      for (int i = 0; i < m; ++i) s += alpha[(int64_t)i * T + t] * dw[i];
      s *= gate;
      for (int i = 0; i < m; ++i) {
        const int64_t it = (int64_t)i * T + t;
        dw_out[it] = dw[i];
        dlogit_out[it] = alpha[it] * (gate * dw[i] - s);
      }
      for (int i = 0; i < n; ++i) {
        const int64_t it = (int64_t)i * T + t;
        const float wi = alpha[it] * gate + one;
        float *restrict o = target[i] ? target[i] + t * d : NULL;
        const float *restrict vi = rows[i];
        if (inv[i]) {
          const float dl = dlogit_out[it], iv = inv[i][t];
          const float c = dl * iv, e = -dl * z[i][t] * iv * iv / (float)d;
          if (part)
            for (int64_t k = 0; k < d; ++k) part[k] += c * vi[k];
          if (!o) continue;
          if (fresh[i]) {
            for (int64_t k = 0; k < d; ++k) o[k] = wi * g[k] + c * q[k] + e * vi[k];
          } else {
            for (int64_t k = 0; k < d; ++k) o[k] += wi * g[k] + c * q[k] + e * vi[k];
          }
        } else if (o) {
          if (fresh[i]) {
            for (int64_t k = 0; k < d; ++k) o[k] = wi * g[k];
          } else {
            for (int64_t k = 0; k < d; ++k) o[k] += wi * g[k];
          }
        }
      }
    }
  }
  if (dq_out) {
    for (int64_t k = 0; k < d; ++k) dq_out[k] = 0.0f;
    for (int64_t blk = 0; blk < nblk; ++blk)
      for (int64_t k = 0; k < d; ++k) dq_out[k] += dq_part[blk * d + k];
  }
}
