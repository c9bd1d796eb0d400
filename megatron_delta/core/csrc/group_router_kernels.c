/* Fused CPU kernels of the group router (megatron_delta/core/group_router.py).
 *
 * A group of S routers of the fine-grained modes shares one pass over the n sources older than the group
 * (the old pass), and each router merges its k in-group sources with the old pass's partial mix by an
 * online-softmax merge. Each function is one loop over the tokens that reads each [T, d] row it needs once
 * (from memory; a token's rows are re-read from cache). Rows are independent and the query gradients are
 * summed over fixed blocks of TB tokens, then over the blocks in order: bitwise the same for any number of
 * threads. fp32, contiguous [T, d] tensors; [S, M, T] / [M, T] weight tables (M = n + null).
 * Built on first use by megatron_delta/core/group_kernels.py (cc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { TB = 64 };

/* Column chunks: the weighted sums below keep a chunk of CW = 2 VL columns of each output row they build in
 * registers while they stream the input rows past it (each output read and written once per chunk, each input row
 * loaded once per chunk for up to four outputs). vf is GCC/Clang's generic vector of VL floats (the compiler maps it
 * onto whatever vector unit -march=native finds); a chunk at the end of a row narrower than CW is loaded into
 * zero-padded vectors and stored back element by element. Every output element gets exactly the operations, in
 * the order, that a scalar loop over the rows would give it: the blocking changes no bit. */
typedef float vf __attribute__((vector_size(64), aligned(4), may_alias));
enum { VL = 16, CW = 2 * VL, BLOCK = 4 };

static inline vf vload(const float *p, int w) {
  if (w == VL) return *(const vf *)p;
  vf x = {0};
  if (w > 0) memcpy(&x, p, (size_t)w * sizeof(float));
  return x;
}

static inline void vstore(float *p, vf x, int w) {
  if (w == VL)
    *(vf *)p = x;
  else if (w > 0)
    memcpy(p, &x, (size_t)w * sizeof(float));
}

/* the widths of a chunk's two vectors: w columns of the chunk are in the row */
static inline int half_width(int w, int h) {
  const int r = w - h * VL;
  return r < 0 ? 0 : r > VL ? VL : r;
}

/* a chunk of w columns from column c: its two vectors' first columns and widths */
struct chunk {
  int64_t c[2];
  int w[2];
};

static inline struct chunk chunk_at(int64_t c, int w) {
  return (struct chunk){{c, c + VL}, {half_width(w, 0), half_width(w, 1)}};
}

/* Dot products over 2 VL partial sums (lane l sums the elements k = l mod 2 VL, in order, in two generic vectors),
 * then the lanes pairwise (l + VL into l, then halves: a tree of fixed shape). Every product below is computed
 * exactly so, alone or in a tile, so a product has the same bits whichever computes it - the same pair of rows gives
 * the same logit or gradient whatever group it falls in (the parallel layouts cut the groups differently). A tree,
 * not a chain: 2 VL lanes added one after another cost more than the products themselves at d = 512. */
static inline float lanes_sum(vf lo, vf hi) {
  float t[VL];
  const vf s = lo + hi;
  memcpy(t, &s, sizeof(t));
#pragma GCC unroll 4
  for (int h = VL / 2; h > 0; h /= 2)
#pragma GCC unroll 8
    for (int l = 0; l < h; ++l) t[l] += t[l + h];
  return t[0];
}

/* A tile of dot products, IA rows a_i by JB rows b_j (IA <= 4, JB <= 3: the 2 IA JB partial sums stay in registers),
 * out[j][i] = <a_i + aoff, b_j + boff>: each chunk of a row loaded once for the tile (the dot products of a token's
 * sources with several queries or output gradients are load-bound one at a time). */
enum { TILE_A = 4, TILE_B = 3 };

static inline __attribute__((always_inline)) void tile_chunk(const int IA, const int JB, const int w, int64_t k,
                                                             const float *const *a, int64_t aoff,
                                                             const float *const *b, int64_t boff,
                                                             vf (*s)[TILE_B][2]) {
  const struct chunk col = chunk_at(k, w);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    vf bj[TILE_B];
#pragma GCC unroll 3
    for (int j = 0; j < JB; ++j) bj[j] = vload(b[j] + boff + col.c[h], col.w[h]);
#pragma GCC unroll 4
    for (int i = 0; i < IA; ++i) {
      const vf ai = vload(a[i] + aoff + col.c[h], col.w[h]);
#pragma GCC unroll 3
      for (int j = 0; j < JB; ++j) s[i][j][h] = s[i][j][h] + ai * bj[j];
    }
  }
}

static inline __attribute__((always_inline)) void tile(const int IA, const int JB, int64_t d, const float *const *a,
                                                       int64_t aoff, const float *const *b, int64_t boff,
                                                       float *const *out) {
  vf s[TILE_A][TILE_B][2];
#pragma GCC unroll 4
  for (int i = 0; i < IA; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < JB; ++j) s[i][j][0] = s[i][j][1] = (vf){0};
  int64_t k = 0;
  for (; k + CW <= d; k += CW) tile_chunk(IA, JB, CW, k, a, aoff, b, boff, s);
  if (k < d) tile_chunk(IA, JB, (int)(d - k), k, a, aoff, b, boff, s);
#pragma GCC unroll 4
  for (int i = 0; i < IA; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < JB; ++j) out[j][i] = lanes_sum(s[i][j][0], s[i][j][1]);
}

#define TILE_CASE(IA, JB) \
  case (IA) * (TILE_B + 1) + (JB): tile(IA, JB, d, a, aoff, b, boff, out); break;

/* tile() for IA = 1 .. 4, JB = 1 .. 3, each a compile-time shape */
static void tile_any(int IA, int JB, int64_t d, const float *const *a, int64_t aoff, const float *const *b,
                     int64_t boff, float *const *out) {
  switch (IA * (TILE_B + 1) + JB) {
    TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3)
    TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(4, 1) TILE_CASE(4, 2) TILE_CASE(4, 3)
    default: break;
  }
}

/* out[j][i] = <a_i + aoff, b_j + boff> for i < na, j < nb, in tiles of TILE_A x TILE_B */
static void dot_table(int na, const float *const *a, int64_t aoff, int nb, const float *const *b, int64_t boff,
                      int64_t d, float *const *out) {
  for (int j0 = 0; j0 < nb; j0 += TILE_B) {
    const int JB = nb - j0 < TILE_B ? nb - j0 : TILE_B;
    for (int i0 = 0; i0 < na; i0 += TILE_A) {
      const int IA = na - i0 < TILE_A ? na - i0 : TILE_A;
      float *o[TILE_B];
      for (int j = 0; j < JB; ++j) o[j] = out[j0 + j] + i0;
      tile_any(IA, JB, d, a + i0, aoff, b + j0, boff, o);
    }
  }
}

static float dot(const float *a, const float *b, int64_t d) {
  float r;
  float *o = &r;
  tile(1, 1, d, &a, 0, &b, 0, &o);
  return r;
}

/* Weighted sums of rows, KB (<= BLOCK) outputs at once, over one chunk of w columns from column c:
 *   out_j = v_0 wt_j[0] + v_1 wt_j[1] + ... (first = 1) or out_j + v_0 wt_j[0] + ... (first = 0), rows i < n at
 *   offset off; then + null_j wt_j[n] (null: rows of the null value, or NULL), and with xo: x = v_0 + v_1 + ...
 *   written to xo, added to out_0 last when first_u (the first router's u).
 * Inlined with KB, w, first constant: the 2 KB (+ 2) accumulators stay in registers. next (not 0): the offset of
 * the next token's rows, whose chunk it asks for ahead of use (a pass streams n rows at once, more streams than the
 * hardware prefetchers follow; measured: the old pass 10 % faster on the benchmark's shapes). */
static inline __attribute__((always_inline)) void mix_chunk(const int KB, const int w, const int first, int64_t c,
                                                            int n, const float *const *v, int64_t off,
                                                            const float *const *wt, const float *const *null,
                                                            float *const *out, float *xo, int first_u,
                                                            int64_t next) {
  vf acc[BLOCK][2], xs[2];
  if (next) {
    __builtin_prefetch(v[0] + next + c, 0, 3);
    if (w > VL) __builtin_prefetch(v[0] + next + c + VL, 0, 3);
  }
  const struct chunk col = chunk_at(c, w);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const vf v0 = vload(v[0] + off + col.c[h], col.w[h]);
#pragma GCC unroll 4
    for (int j = 0; j < KB; ++j) acc[j][h] = first ? v0 * wt[j][0] : vload(out[j] + col.c[h], col.w[h]) + v0 * wt[j][0];
    xs[h] = v0;
  }
  for (int i = 1; i < n; ++i) {
    if (next) {
      __builtin_prefetch(v[i] + next + c, 0, 3);
      if (w > VL) __builtin_prefetch(v[i] + next + c + VL, 0, 3);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const vf vi = vload(v[i] + off + col.c[h], col.w[h]);
#pragma GCC unroll 4
      for (int j = 0; j < KB; ++j) acc[j][h] = acc[j][h] + vi * wt[j][i];
      if (xo) xs[h] = xs[h] + vi;
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    if (null)
#pragma GCC unroll 4
      for (int j = 0; j < KB; ++j) acc[j][h] = acc[j][h] + vload(null[j] + col.c[h], col.w[h]) * wt[j][n];
    if (xo) {
      if (first_u) acc[0][h] = acc[0][h] + xs[h];
      vstore(xo + col.c[h], xs[h], col.w[h]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < KB; ++j) vstore(out[j] + col.c[h], acc[j][h], col.w[h]);
  }
}

static inline __attribute__((always_inline)) void mix_rows(const int KB, const int first, int64_t d, int n,
                                                           const float *const *v, int64_t off,
                                                           const float *const *wt, const float *const *null,
                                                           float *const *out, float *xo, int first_u,
                                                           int64_t next) {
  int64_t c = 0;
  for (; c + CW <= d; c += CW) mix_chunk(KB, CW, first, c, n, v, off, wt, null, out, xo, first_u, next);
  if (c < d) mix_chunk(KB, (int)(d - c), first, c, n, v, off, wt, null, out, xo, first_u, next);
}

/* mix_rows for KB = 1 .. BLOCK outputs (a compile-time count each: the accumulators in registers) */
static void mix(int KB, int first, int64_t d, int n, const float *const *v, int64_t off, const float *const *wt,
                const float *const *null, float *const *out, float *xo, int first_u, int64_t next) {
  switch (KB) {
    case 1: mix_rows(1, first, d, n, v, off, wt, null, out, xo, first_u, next); break;
    case 2: mix_rows(2, first, d, n, v, off, wt, null, out, xo, first_u, next); break;
    case 3: mix_rows(3, first, d, n, v, off, wt, null, out, xo, first_u, next); break;
    default: mix_rows(4, first, d, n, v, off, wt, null, out, xo, first_u, next); break;
  }
}

/* One token's source gradients in the old pass's backward (group_old_backward), up to BLOCK sources at once */
struct old_grads {
  int S, n, unit, k2, s2;
  int64_t d;
  const float *cf, *af, *gsum, *Q2;
  const float **q, **g, **g2;  /* per router: its query, its output gradient's row of the token (S; k2 received) */
  float *a2, *c2;              /* the received share's weights of the block's sources, [k2 or s2][BLOCK] */
  int i[BLOCK], mode[BLOCK];   /* per source of the block */
  float e[BLOCK];
  float *o[BLOCK];
  const float *v[BLOCK], *seed[BLOCK];
};

/*   o_m = init_m + sum_k (c_k q_k + a_k g_k) [+ sum_k A2_k G2_k + sum_k C2_k Q2_k], init_m = e v (mode 1),
 *   (seed + e v) (mode 2) or (o + e v) (mode 0), each + u1 gsum: over one chunk of w columns from c, IB constant. */
static inline __attribute__((always_inline)) void source_grads_chunk(const int IB, const int w, int64_t c,
                                                                     const struct old_grads *og) {
  const int S = og->S;
  const float u1 = og->unit ? 1.0f : 0.0f;
  vf acc[BLOCK][2];
  const struct chunk col = chunk_at(c, w);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
    for (int m = 0; m < IB; ++m) {
      /* without unit: u1 = 0 times any valid row (the source's own) */
      const vf gs = vload((og->unit ? og->gsum : og->v[m]) + col.c[h], col.w[h]);
      const vf ev = vload(og->v[m] + col.c[h], col.w[h]) * og->e[m];
      if (og->mode[m] == 1)
        acc[m][h] = ev + gs * u1;
      else if (og->mode[m] == 2)
        acc[m][h] = (vload(og->seed[m] + col.c[h], col.w[h]) + ev) + gs * u1;
      else
        acc[m][h] = (vload(og->o[m] + col.c[h], col.w[h]) + ev) + gs * u1;
    }
  }
  for (int k = 0; k < S; ++k) {
    float ck[BLOCK], ak[BLOCK];
#pragma GCC unroll 4
    for (int m = 0; m < IB; ++m) {
      ck[m] = og->cf[k * og->n + og->i[m]];
      ak[m] = og->af[k * og->n + og->i[m]];
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const vf q = vload(og->q[k] + col.c[h], col.w[h]), g = vload(og->g[k] + col.c[h], col.w[h]);
#pragma GCC unroll 4
      for (int m = 0; m < IB; ++m) acc[m][h] = (acc[m][h] + q * ck[m]) + g * ak[m];
    }
  }
  for (int k = 0; k < og->k2; ++k)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const vf g = vload(og->g2[k] + col.c[h], col.w[h]);
#pragma GCC unroll 4
      for (int m = 0; m < IB; ++m) acc[m][h] = acc[m][h] + g * og->a2[k * BLOCK + m];
    }
  for (int k = 0; k < og->s2; ++k)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const vf q = vload(og->Q2 + (int64_t)k * og->d + col.c[h], col.w[h]);
#pragma GCC unroll 4
      for (int m = 0; m < IB; ++m) acc[m][h] = acc[m][h] + q * og->c2[k * BLOCK + m];
    }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
    for (int m = 0; m < IB; ++m) vstore(og->o[m] + col.c[h], acc[m][h], col.w[h]);
}

static inline __attribute__((always_inline)) void source_grads_rows(const int IB, const struct old_grads *og) {
  int64_t c = 0;
  for (; c + CW <= og->d; c += CW) source_grads_chunk(IB, CW, c, og);
  if (c < og->d) source_grads_chunk(IB, (int)(og->d - c), c, og);
}

static void source_grads(int IB, const struct old_grads *og) {
  switch (IB) {
    case 1: source_grads_rows(1, og); break;
    case 2: source_grads_rows(2, og); break;
    case 3: source_grads_rows(3, og); break;
    default: source_grads_rows(4, og); break;
  }
}

/* The old pass. Per token t, router k < S, source i < n (M = n + has_null, the null source last):
 *   inv_i = 1/sqrt(mean(v_i[t]^2) + eps)                    -> inv [n, T]
 *   z_ki = (v_i[t] . Q_k) inv_i, z_kn = null_logit_k        -> z [S, M, T]
 *   lse_k = logsumexp_i z_ki, p_ki = exp(z_ki - lse_k)      -> lse [S, T], p [S, M, T]
 *   r_k[t] = sum_i p_ki v_i[t] + p_kn null_value_k          -> r[k] [T, d]
 *   x[t] = sum_i v_i[t]                                     (x given: the older part of the residual stream)
 * first_u: r[0] is router 0's u, r_0 (+ x where given): its merge has no in-group source (group_router._OldPass) */
void group_old_forward(int64_t T, int64_t d, int n, int S, const float *const *v, const float *restrict Q,
                       float eps, int has_null, const float *restrict null_logit, const float *restrict null_value,
                       float *restrict inv, float *restrict z, float *restrict p, float *restrict lse,
                       float *const *r, float *restrict x, int first_u, int threads) {
  const int M = n + (has_null != 0);
  const float *qrows[S];
  for (int k = 0; k < S; ++k) qrows[k] = Q + (int64_t)k * d;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < T; ++t) {
    float zt[S * M], ivt[n > 0 ? n : 1];
    for (int i = 0; i < n; ++i) {
      const float *restrict vi = v[i] + t * d;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < d; ++c) ss += vi[c] * vi[c];
      ivt[i] = inv[(int64_t)i * T + t] = 1.0f / sqrtf(ss / (float)d + eps);
    }
    /* z_ki = <v_i, Q_k> inv_i */
    float *zrow[S];
    for (int k = 0; k < S; ++k) zrow[k] = zt + k * M;
    dot_table(n, v, t * d, S, qrows, 0, d, zrow);
    for (int k = 0; k < S; ++k)
      for (int i = 0; i < n; ++i) zt[k * M + i] *= ivt[i];
    if (has_null)
      for (int k = 0; k < S; ++k) zt[k * M + n] = null_logit[k];
    for (int k = 0; k < S; ++k) {
      float *zk = zt + k * M;
      float mx = zk[0];
      for (int i = 1; i < M; ++i) mx = zk[i] > mx ? zk[i] : mx;
      float sum = 0.0f;
      for (int i = 0; i < M; ++i) sum += expf(zk[i] - mx);
      const float l = mx + logf(sum);
      lse[(int64_t)k * T + t] = l;
      for (int i = 0; i < M; ++i) {
        const int64_t it = ((int64_t)k * M + i) * T + t;
        z[it] = zk[i];
        p[it] = zk[i] = expf(zk[i] - l);  /* zt now holds p */
      }
    }
    /* r_k = sum_i p_ki v_i (+ p_kn null_k), four routers per sweep of the sources; x with the first four */
    for (int k0 = 0; k0 < S; k0 += BLOCK) {
      const int KB = S - k0 < BLOCK ? S - k0 : BLOCK;
      const float *wt[BLOCK], *nl[BLOCK];
      float *out[BLOCK];
      for (int j = 0; j < KB; ++j) {
        wt[j] = zt + (k0 + j) * M;
        nl[j] = has_null ? null_value + (int64_t)(k0 + j) * d : NULL;
        out[j] = r[k0 + j] + t * d;
      }
      mix(KB, 1, d, n, v, t * d, wt, has_null ? nl : NULL, out, k0 == 0 && x ? x + t * d : NULL,
          first_u && k0 == 0, k0 == 0 && t + 1 < T ? (t + 1) * d : 0);
    }
  }
}

/* Backward of the old pass. G[k] (NULL: router k had no gradient) is router k's output gradient and
 * w[k, t] = gate beta_k its older sources' share, so d r_k = w_k G_k. Per token:
 *   dp_ki = w_k <G_k, v_i> (null: <G_k, null_value_k>)
 *   dz_ki = p_ki (dp_ki - sum_l p_kl dp_kl) + p_ki dlse_k   -> dz [S, M, T]
 *   c_ki = dz_ki inv_i, e_i = -(sum_k dz_ki z_ki) inv_i^2 / d
 *   target_i[t] (+)= sum_k w_k p_ki G_k + unit sum_k G_k + sum_k c_ki Q_k + e_i v_i
 *   (fresh_i: 1 assigned, 0 added in place, 2 assigned seed_i[t] + the sum: a sink the final sum seeded)
 *   dq_k = sum_t sum_i c_ki v_i[t]                           -> dq [S, d]
 * E2 (not NULL): the next group's deferred share of every source's gradient (group_router.OldShare), added as the
 * target is written: + E2_i v_i + sum_k A2_ki G2_k (k2 output gradients) + sum_k C2_ki Q2_k (s2 queries). */
void group_old_backward(int64_t T, int64_t d, int n, int S, const float *const *G, const float *restrict w,
                        const float *restrict dlse, const float *const *v, const float *restrict inv,
                        const float *restrict z, const float *restrict p, const float *restrict Q, int has_null,
                        const float *restrict null_value, float *const *target, const int *fresh,
                        const float *const *seed, int unit, int k2, const float *const *G2,
                        const float *restrict A2, int s2, const float *restrict C2, const float *restrict Q2,
                        const float *restrict E2,
                        float *restrict dz_out, float *restrict dq_part, float *restrict dq_out, int threads) {
  const int M = n + (has_null != 0);
  const int64_t nblk = (T + TB - 1) / TB;
  int targets[n > 0 ? n : 1], n_targets = 0;  /* the sources with a gradient to write */
  for (int i = 0; i < n; ++i)
    if (target[i]) targets[n_targets++] = i;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < nblk; ++blk) {
    float *restrict part = dq_part + blk * (int64_t)S * d;
    for (int64_t c = 0; c < (int64_t)S * d; ++c) part[c] = 0.0f;
    float dz[S * M];
    float cf[S * n > 0 ? S * n : 1], af[S * n > 0 ? S * n : 1];
    float gsum[unit ? d : 1];
    const int64_t t1 = (blk + 1) * TB < T ? (blk + 1) * TB : T;
    for (int64_t t = blk * TB; t < t1; ++t) {
      /* <G_k, v_i> for the routers with a gradient, in one table */
      const float *gt[S];
      float *dzrow[S];
      int ng = 0;
      for (int k = 0; k < S; ++k)
        if (G[k]) {
          gt[ng] = G[k] + t * d;
          dzrow[ng++] = dz + k * M;
        }
      dot_table(n, v, t * d, ng, gt, 0, d, dzrow);
      for (int k = 0; k < S; ++k) {
        const float *gk = G[k] ? G[k] + t * d : NULL;
        const float wk = w[(int64_t)k * T + t];
        float s = 0.0f;
        if (gk) {
          for (int i = 0; i < n; ++i) dz[k * M + i] *= wk;
          if (has_null) dz[k * M + n] = wk * dot(gk, null_value + (int64_t)k * d, d);
        } else {
          for (int i = 0; i < M; ++i) dz[k * M + i] = 0.0f;
        }
        for (int i = 0; i < M; ++i) s += p[((int64_t)k * M + i) * T + t] * dz[k * M + i];
        const float dl = dlse[(int64_t)k * T + t];
        for (int i = 0; i < M; ++i) {
          const int64_t it = ((int64_t)k * M + i) * T + t;
          dz[k * M + i] = p[it] * (dz[k * M + i] - s + dl);
          dz_out[it] = dz[k * M + i];
        }
      }
      if (unit) {
        for (int64_t c = 0; c < d; ++c) gsum[c] = 0.0f;
        for (int k = 0; k < S; ++k)
          if (G[k]) {
            const float *restrict gk = G[k] + t * d;
            for (int64_t c = 0; c < d; ++c) gsum[c] += gk[c];
          }
      }
      /* per (router k, source i): c_ki = dz_ki inv_i (query terms) and a_ki = w_k p_ki (output gradient terms) */
      for (int k = 0; k < S; ++k)
        for (int i = 0; i < n; ++i) {
          cf[k * n + i] = dz[k * M + i] * inv[(int64_t)i * T + t];
          af[k * n + i] = G[k] ? w[(int64_t)k * T + t] * p[((int64_t)k * M + i) * T + t] : 0.0f;
        }
      /* the query gradients: part_k += sum_i c_ki v_i, four routers per sweep of the sources */
      for (int k0 = 0; n > 0 && k0 < S; k0 += BLOCK) {
        const int KB = S - k0 < BLOCK ? S - k0 : BLOCK;
        const float *wt[BLOCK];
        float *out[BLOCK];
        for (int j = 0; j < KB; ++j) {
          wt[j] = cf + (k0 + j) * n;
          out[j] = part + (int64_t)(k0 + j) * d;
        }
        mix(KB, 0, d, n, v, t * d, wt, NULL, out, NULL, 0, k0 == 0 && t + 1 < t1 ? (t + 1) * d : 0);
      }
      /* each source's gradient, four sources per sweep of the queries and output gradients */
      const float *qrow[S], *grow[S], *g2row[k2 > 0 ? k2 : 1];
      float a2[(k2 > 0 ? k2 : 1) * BLOCK], c2[(s2 > 0 ? s2 : 1) * BLOCK];
      struct old_grads og = {.S = S, .n = n, .d = d, .cf = cf, .af = af, .unit = unit, .gsum = gsum, .k2 = E2 ? k2 : 0,
                             .s2 = E2 ? s2 : 0, .Q2 = Q2, .q = qrow, .g = grow, .g2 = g2row, .a2 = a2, .c2 = c2};
      for (int k = 0; k < S; ++k) {
        qrow[k] = Q + (int64_t)k * d;
        grow[k] = G[k] ? G[k] + t * d : qrow[k];  /* no gradient: a_ki = 0 */
      }
      for (int k = 0; k < og.k2; ++k) g2row[k] = G2[k] + t * d;
      for (int i0 = 0; i0 < n_targets;) {
        int IB = 0;
        for (; IB < BLOCK && i0 < n_targets; ++IB, ++i0) {
          const int i = targets[i0];
          const float iv = inv[(int64_t)i * T + t];
          float e = 0.0f;
          for (int k = 0; k < S; ++k) e += dz[k * M + i] * z[((int64_t)k * M + i) * T + t];
          e *= -iv * iv / (float)d;
          if (E2) e += E2[(int64_t)i * T + t];
          og.i[IB] = i;
          og.e[IB] = e;
          og.o[IB] = target[i] + t * d;
          og.v[IB] = v[i] + t * d;
          og.mode[IB] = fresh[i];
          og.seed[IB] = fresh[i] == 2 ? seed[i] + t * d : NULL;
          for (int k = 0; k < og.k2; ++k) a2[k * BLOCK + IB] = A2[((int64_t)k * n + i) * T + t];
          for (int k = 0; k < og.s2; ++k) c2[k * BLOCK + IB] = C2[((int64_t)k * n + i) * T + t];
        }
        source_grads(IB, &og);
      }
    }
  }
  for (int64_t c = 0; c < (int64_t)S * d; ++c) dq_out[c] = 0.0f;
  for (int64_t blk = 0; blk < nblk; ++blk)
    for (int64_t c = 0; c < (int64_t)S * d; ++c) dq_out[c] += dq_part[blk * (int64_t)S * d + c];
}

/* The merge of router k of a group with its k in-group sources. Per token:
 *   inv_i, z_i = (v_i[t] . q) inv_i                         -> inv [k, T], z [k, T]
 *   a = softmax(lse[t], z_0, .., z_{k-1})                   -> a [1 + k, T] (a_0 = beta)
 *   out[t] = base[t] + x[t] + gate a_0 r[t] + sum_i (unit + gate a_{1+i}) v_i[t]   (base, x: when given) */
void group_merge_forward(int64_t T, int64_t d, int k, const float *restrict r, const float *restrict lse,
                         const float *restrict x, const float *restrict base, float gate, const float *restrict q,
                         const float *const *v, float eps, int unit, float *restrict inv, float *restrict z,
                         float *restrict a, float *restrict out, int threads) {
  const float one = unit ? 1.0f : 0.0f;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < T; ++t) {
    float l[k + 1];
    l[0] = lse[t];
    for (int i = 0; i < k; ++i) {
      const float *restrict vi = v[i] + t * d;
      float ss = 0.0f, vq = 0.0f;
#pragma omp simd reduction(+ : ss, vq)
      for (int64_t c = 0; c < d; ++c) {
        ss += vi[c] * vi[c];
        vq += vi[c] * q[c];
      }
      const float iv = 1.0f / sqrtf(ss / (float)d + eps);
      inv[(int64_t)i * T + t] = iv;
      l[1 + i] = z[(int64_t)i * T + t] = vq * iv;
    }
    float mx = l[0];
    for (int i = 1; i <= k; ++i) mx = l[i] > mx ? l[i] : mx;
    float sum = 0.0f;
    for (int i = 0; i <= k; ++i) sum += (l[i] = expf(l[i] - mx));
    const float scale = 1.0f / sum;
    for (int i = 0; i <= k; ++i) {
      l[i] *= scale;
      a[(int64_t)i * T + t] = l[i];
    }
    float *restrict o = out + t * d;
    const float *restrict rt = r + t * d;
    const float w0 = gate * l[0];
    const float *restrict b = base ? base + t * d : NULL;
    const float *restrict xt = x ? x + t * d : NULL;
    if (b && xt) {
      for (int64_t c = 0; c < d; ++c) o[c] = w0 * rt[c] + b[c] + xt[c];
    } else if (b || xt) {
      const float *restrict y = b ? b : xt;
      for (int64_t c = 0; c < d; ++c) o[c] = w0 * rt[c] + y[c];
    } else {
      for (int64_t c = 0; c < d; ++c) o[c] = w0 * rt[c];
    }
    for (int i = 0; i < k; ++i) l[1 + i] = one + gate * l[1 + i];  /* each in-group source's weight in u */
    if (k > 0) {
      const float *wt = l + 1;
      float *orow = o;
      mix(1, 0, d, k, v, t * d, &wt, NULL, &orow, NULL, 0, 0);
    }
  }
}

/* Backward of the merge for the output gradient grad [T, d]. Per token:
 *   da_0 = <grad, r>, da_{1+i} = <grad, v_i>                 -> da [1 + k, T] (without the gate)
 *   dlog_j = a_j (gate da_j - sum_l a_l gate da_l)           -> dlog [1 + k, T] (dlog_0: d lse)
 *   w_i = unit + gate a_{1+i}, c_i = dlog_{1+i} inv_i, e_i = -dlog_{1+i} z_i inv_i^2 / d   -> coef [3, k, T]
 *   dq = sum_t sum_i c_i v_i[t]                              -> dq [d]
 * Source i's share of the gradient, w_i grad + c_i q + e_i v_i, is deferred (coef, group_router._Merge) to the merge
 * of router i + 1, its earliest in-group reader, which runs last: this merge writes the gradient of its newest source
 * v_{k-1} only, its own share and the n_later later merges' (their output gradients later_g, queries later_q and
 * rows of w, c, e):
 *   target[t] (+)= w grad + c q + (e + sum_m e_m) v_{k-1} + sum_m (w_m later_g_m + c_m later_q_m)
 *   (fresh: 1 assigned, 0 added in place, 2 assigned seed[t] + the sum: a sink the final sum seeded) */
void group_merge_backward(int64_t T, int64_t d, int k, const float *grad, const float *restrict r, float gate,
                          const float *restrict q, const float *const *v, const float *restrict inv,
                          const float *restrict z, const float *restrict a, int unit, float *target, int fresh,
                          const float *seed, int n_later, const float *const *later_g, const float *const *later_q,
                          const float *const *later_w, const float *const *later_c, const float *const *later_e,
                          float *restrict coef_out, float *restrict da_out, float *restrict dlog_out,
                          float *restrict dq_part, float *restrict dq_out, int threads) {
  const float one = unit ? 1.0f : 0.0f;
  const int64_t nblk = (T + TB - 1) / TB;
  const float *rows[k + 1];  /* r, then the in-group sources: the rows the output gradient is dotted with */
  rows[0] = r;
  for (int i = 0; i < k; ++i) rows[1 + i] = v[i];
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < nblk; ++blk) {
    float *restrict part = dq_part + blk * d;
    for (int64_t c = 0; c < d; ++c) part[c] = 0.0f;
    float dl[k + 1];
    const int64_t t1 = (blk + 1) * TB < T ? (blk + 1) * TB : T;
    for (int64_t t = blk * TB; t < t1; ++t) {
      const float *restrict g = grad + t * d;
      float s = 0.0f;
      const float *grow = g;
      float *dlrow = dl;
      dot_table(k + 1, rows, t * d, 1, &grow, 0, d, &dlrow);
      for (int j = 0; j <= k; ++j) {
        const float dj = dl[j];
        da_out[(int64_t)j * T + t] = dj;
        dl[j] = gate * dj;
        s += a[(int64_t)j * T + t] * dl[j];
      }
      for (int j = 0; j <= k; ++j) {
        dl[j] = a[(int64_t)j * T + t] * (dl[j] - s);
        dlog_out[(int64_t)j * T + t] = dl[j];
      }
      for (int i = 0; i < k; ++i) {
        const float *restrict vi = v[i] + t * d;
        const float iv = inv[(int64_t)i * T + t];
        const float c = dl[1 + i] * iv, e = -dl[1 + i] * z[(int64_t)i * T + t] * iv * iv / (float)d;
        const float wi = one + gate * a[(int64_t)(1 + i) * T + t];
        coef_out[(int64_t)i * T + t] = wi;
        coef_out[(int64_t)(k + i) * T + t] = c;
        coef_out[(int64_t)(2 * k + i) * T + t] = e;
        if (i < k - 1 || !target) {
          for (int64_t cc = 0; cc < d; ++cc) part[cc] += c * vi[cc];
          continue;
        }
        /* the query gradient's share in the same sweep as the source's gradient (v_i read once); the later
         * merges' e_m multiply the same v_i, so their sum scales it once */
        float *restrict o = target + t * d;
        float ev = e;
        for (int m = 0; m < n_later; ++m) ev += later_e[m][t];
        if (fresh == 1) {
          for (int64_t cc = 0; cc < d; ++cc) {
            part[cc] += c * vi[cc];
            o[cc] = wi * g[cc] + c * q[cc] + ev * vi[cc];
          }
        } else if (fresh == 2) {
          const float *si = seed + t * d;
          for (int64_t cc = 0; cc < d; ++cc) {
            part[cc] += c * vi[cc];
            o[cc] = si[cc] + wi * g[cc] + c * q[cc] + ev * vi[cc];
          }
        } else {
          for (int64_t cc = 0; cc < d; ++cc) {
            part[cc] += c * vi[cc];
            o[cc] += wi * g[cc] + c * q[cc] + ev * vi[cc];
          }
        }
        for (int m = 0; m < n_later; ++m) {
          const float *restrict gm = later_g[m] + t * d, *restrict qm = later_q[m];
          const float wm = later_w[m][t], cm = later_c[m][t];
          for (int64_t cc = 0; cc < d; ++cc) o[cc] += wm * gm[cc] + cm * qm[cc];
        }
      }
    }
  }
  for (int64_t c = 0; c < d; ++c) dq_out[c] = 0.0f;
  for (int64_t blk = 0; blk < nblk; ++blk)
    for (int64_t c = 0; c < d; ++c) dq_out[c] += dq_part[blk * d + c];
}

/* The residual stream handed out by delta's last layer (x is the sum of the sources, group_router._FinalSum):
 * x[t] = ((v_0 + v_1) + v_2) + ... , in the order of PyTorch's chain of adds; each source row read once, x
 * written once. Its backward writes nothing: the gradient of x seeds the sources' sinks (fresh_i = 2 above). */
void group_final_sum(int64_t T, int64_t d, int n, const float *const *v, float *restrict x, int threads) {
  const int64_t nblk = (T + TB - 1) / TB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const int64_t t1 = (blk + 1) * TB < T ? (blk + 1) * TB : T;
    for (int64_t t = blk * TB; t < t1; ++t) {
      float *restrict o = x + t * d;
      const float *restrict v0 = v[0] + t * d;
      for (int64_t c = 0; c < d; ++c) o[c] = v0[c];
      for (int i = 1; i < n; ++i) {
        const float *restrict vi = v[i] + t * d;
        for (int64_t c = 0; c < d; ++c) o[c] += vi[c];
      }
    }
  }
}
