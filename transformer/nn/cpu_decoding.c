/* A decoding step's hot loops on a CPU, built and loaded by cpu_decoding.py (which says
 * when they run); GCC's and Clang's vector extensions, compiled for the machine it runs on:
 * - `attend`: a few queries per (sentence, head) against that sentence's cached keys and
 *   values, softmax(q k^T / sqrt(d_k) + mask) v, in one pass;
 * - `move_slots`: a step's keys and values into the cache, and its compaction in place;
 * - `best_extensions`: beam search's best candidates of each sentence, scores added;
 * - `add_norm`: LayerNorm(x + y), a residual connection;
 * - `linear`: products of a few rows with a weight packed once.
 *
 * Attention: why not two batched products (torch's bmm): a step multiplies thousands of
 * tiny matrices (a beam of 4 queries by 20-200 keys of 32-64 dimensions), where a BLAS
 * spends most of its time packing each one, and the scores make two more passes (mask,
 * softmax) between the products. Here each (sentence, head) block is one loop nest over
 * keys already in cache: scores, softmax and the weighted sum of values. The scores take
 * 16 keys at a time, one per lane, with one query element broadcast: that needs the 16
 * keys transposed, (D, 16), which is how kv_cache stores the decoder's keys for this
 * kernel (a tile); keys stored as rows are transposed a chunk at a time here. (A dot
 * product per key, 16 lanes of d at once, then needs a sum across the lanes of each: more
 * shuffles than multiplies.)
 *
 * Arithmetic, fixed for every input (the static and the shrinking beam search agree
 * bitwise only if a row's result does not depend on which other keys or rows are there):
 * - a score is the dot product of (scale * query) and one key, summed over d in order in
 *   the key's own lane, whatever the key's position and layout;
 * - exp is a polynomial (relative error ~1e-7); masked keys (-inf) weigh exactly 0;
 * - the weights' sum and the weighted sum of values run over the keys in order, so that a
 *   masked key adds exactly 0 wherever it sits. */

#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));
#define W 16    /* lanes */
#define MAXM 8  /* queries per block: cpu_decoding.MAX_QUERIES */
#define MAXD 8  /* d_k up to 128: cpu_decoding.MAX_HEAD */

static inline v16 splat(float x) { return (v16){0} + x; }
static inline v16 pick(i16 c, v16 a, v16 b) { return (v16)(((i16)a & c) | ((i16)b & ~c)); }

/* the 16 lanes' sum, halves added in turn (lane by lane: GCC before 12 has no
 * __builtin_shufflevector) */
static inline float sum(v16 x) {
    float h[W / 2];
    for (int j = 0; j < W / 2; j++) h[j] = x[j] + x[j + W / 2];
    for (int j = 0; j < W / 4; j++) h[j] += h[j + W / 4];
    return (h[0] + h[2]) + (h[1] + h[3]);
}

/* n (<= 16) floats from p, zeros after */
static inline v16 load(const float *p, int64_t n) {
    if (n == W) return *(const v16u *)p;
    v16 x = splat(0.0f);
    memcpy(&x, p, (size_t)n * sizeof(float));
    return x;
}

static inline void store(float *p, v16 x, int64_t n) {
    if (n == W) *(v16u *)p = x;
    else memcpy(p, &x, (size_t)n * sizeof(float));
}

/* exp(x) for x <= 0 (scores minus their maximum): 2^n * poly(r), x = n ln2 + r; 0 below
 * -87 (where fp32's exp leaves the normal range) and at -inf, NaN for NaN */
static inline v16 exp_nonpositive(v16 x) {
    i16 low = x < -87.0f;
    v16 y = pick(low, splat(-87.0f), x);
    v16 n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to integer */
    v16 r = y - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    v16 p = splat(0.0013888889f);
    p = p * r + 0.008333334f;
    p = p * r + 0.041666668f;
    p = p * r + 0.16666667f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    v16 two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return pick(low, splat(0.0f), p * two_n);
}

/* n floats from p on their way to L2 */
static inline void fetch(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(p + i, 0, 2);
}

/* One chunk's scores for r (<= 4) queries: s[m][l0 .. l0 + 15] = sum over d, in order, of
 * qv[m][d] * key(l0 + j)[d]; `kt` holds the chunk's 16 keys transposed (D rows of 16) */
static inline __attribute__((always_inline)) void chunk_scores(
    const int64_t r, const int64_t D, const float *kt, float (*qv)[MAXD * W], float *s,
    int64_t Lp, int64_t l0) {
    v16 acc[4];
    for (int64_t m = 0; m < r; m++) acc[m] = qv[m][0] * *(const v16u *)kt;
    for (int64_t d = 1; d < D; d++) {
        const v16 kd = *(const v16u *)(kt + d * W);
        for (int64_t m = 0; m < r; m++) acc[m] += qv[m][d] * kd;
    }
    for (int64_t m = 0; m < r; m++) *(v16u *)(s + m * Lp + l0) = acc[m];
}

/* Blocks [first, last) of (sentence, head), `D` floats per head. Keys `tiled`: chunks of 16
 * keys stored transposed, (tiles, D, 16) per block, as kv_cache keeps them for this loop;
 * else rows (L, D), transposed here a chunk at a time. Inlined per layout and head size. */
static inline __attribute__((always_inline)) void blocks(
    int64_t first, int64_t last, int64_t H, int64_t M, int64_t L, const int64_t D,
    const int tiled, float scale, const float *q, const float *k, const float *v,
    const float *mask, float *out, const int64_t *st) {
    const int64_t *qs = st, *ks = st + 3, *vs = st + 6, *ms = st + 9, *os = st + 13;
    const int64_t Lp = (L + W - 1) / W * W, nd = (D + W - 1) / W, tail = D - (nd - 1) * W;
    float s[MAXM][Lp];
    float qv[MAXM][MAXD * W];
    float kt[MAXD * W * W] __attribute__((aligned(64)));
    for (int64_t bh = first; bh < last; bh++) {
        const int64_t b = bh / H, h = bh % H;
        const float *kb = k + b * ks[0] + h * ks[1], *vb = v + b * vs[0] + h * vs[1];
        /* the next block's keys and values, each fetched as the same ones of this block are
         * read: a block's keys and values are a few KB, and a cache's (sentence, head) rows
         * lie far apart (room for the longest output), too short a stream for the hardware
         * prefetcher to run ahead of; ~2x faster on a step's self-attention (Zen 4) */
        const int64_t next = bh + 1 < last ? bh + 1 : bh;
        const float *kn = k + next / H * ks[0] + next % H * ks[1];
        const float *vn = v + next / H * vs[0] + next % H * vs[1];
        for (int64_t m = 0; m < M; m++)
            for (int64_t d = 0; d < D; d++)
                qv[m][d] = q[b * qs[0] + h * qs[1] + m * qs[2] + d] * scale;
        /* scores, 16 keys at a time: for each, an FMA chain over d in one lane */
        for (int64_t l0 = 0; l0 < L; l0 += W) {
            const float *chunk = kb + l0 / W * ks[2];
            const int64_t n = L - l0 < W ? L - l0 : W;
            if (tiled) fetch(kn + l0 / W * ks[2], D * W);
            else
                for (int64_t j = 0; j < n; j++) fetch(kn + (l0 + j) * ks[2], D);
            if (!tiled) {
                for (int64_t j = 0; j < n; j++)
                    for (int64_t d = 0; d < D; d++) kt[d * W + j] = kb[(l0 + j) * ks[2] + d];
                chunk = kt;
            }
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int64_t r = M - m0 < 4 ? M - m0 : 4;
                float (*qm)[MAXD * W] = qv + m0;
                float *sm = &s[m0][0];
                if (r == 4) chunk_scores(4, D, chunk, qm, sm, Lp, l0);
                else if (r == 1) chunk_scores(1, D, chunk, qm, sm, Lp, l0);
                else if (r == 2) chunk_scores(2, D, chunk, qm, sm, Lp, l0);
                else chunk_scores(3, D, chunk, qm, sm, Lp, l0);
            }
        }
        /* mask, softmax's weights (unnormalised); lanes past L (a tile's unwritten keys,
         * whatever they hold) set to -inf, weight 0 */
        v16 o[MAXM][MAXD];
        float sum[MAXM];
        for (int64_t m = 0; m < M; m++) {
            if (mask) {
                const float *mk = mask + b * ms[0] + h * ms[1] + m * ms[2];
                for (int64_t l = 0; l < L; l++) s[m][l] += mk[l];
            }
            for (int64_t l = L; l < Lp; l++) s[m][l] = -__builtin_inff();
            v16 top = load(s[m], W);
            for (int64_t l = W; l < Lp; l += W) {
                v16 x = load(&s[m][l], W);
                top = pick(x > top, x, top);
            }
            float most = top[0];
            for (int j = 1; j < W; j++) most = top[j] > most ? top[j] : most;
            for (int64_t l = 0; l < Lp; l += W)
                store(&s[m][l], exp_nonpositive(load(&s[m][l], W) - most), W);
            for (int64_t i = 0; i < nd; i++) o[m][i] = splat(0.0f);
            sum[m] = 0.0f;
        }
        /* the weighted sum of values, key by key: each value row read once for all queries */
        for (int64_t l = 0; l < L; l++) {
            const float *vl = vb + l * vs[2];
            fetch(vn + l * vs[2], D);
            v16 vv[MAXD];
            for (int64_t i = 0; i < nd; i++) vv[i] = load(vl + i * W, i == nd - 1 ? tail : W);
            for (int64_t m = 0; m < M; m++) {
                const float w = s[m][l];
                for (int64_t i = 0; i < nd; i++) o[m][i] += w * vv[i];
                sum[m] += w;
            }
        }
        for (int64_t m = 0; m < M; m++) {
            float *om = out + b * os[0] + h * os[1] + m * os[2];
            for (int64_t i = 0; i < nd; i++)
                store(om + i * W, o[m][i] * (1.0f / sum[m]), i == nd - 1 ? tail : W);
        }
    }
}

static void range(int64_t first, int64_t last, int64_t H, int64_t M, int64_t L, int64_t D,
                  int tiled, float scale, const float *q, const float *k, const float *v,
                  const float *mask, float *out, const int64_t *st) {
#define BLOCKS(d, t) blocks(first, last, H, M, L, d, t, scale, q, k, v, mask, out, st)
    if (tiled) {
        if (D == 32) BLOCKS(32, 1);
        else if (D == 64) BLOCKS(64, 1);
        else BLOCKS(D, 1);
    } else {
        if (D == 32) BLOCKS(32, 0);
        else if (D == 64) BLOCKS(64, 0);
        else BLOCKS(D, 0);
    }
#undef BLOCKS
}

/* q (B, H, M, D); v (B, H, L, D); k (B, H, L, D) rows, or with `tiled` (B, H, ceil(L / 16),
 * D, 16), chunks of 16 keys transposed; mask (B, H, M, L) additive, or NULL; out
 * (B, H, M, D). `st`: the strides (in floats) of q's, k's and v's first three dimensions
 * (k tiled: of a tile), then the mask's four (0 where broadcast), then out's first three;
 * the last dimension of each is contiguous, and a tiled k's (D, 16) tiles too.
 * M <= MAXM, D <= MAXD * 16. `threads` > 1 splits the blocks among OpenMP threads where
 * the library was built with OpenMP (cpu_decoding.py links the one torch runs). */
void attend(int64_t B, int64_t H, int64_t M, int64_t L, int64_t D, int tiled, float scale,
            int threads, const float *q, const float *k, const float *v, const float *mask,
            float *out, const int64_t *st) {
    const int64_t n = B * H;
    if (threads <= 1 || n < 2 * threads) {
        range(0, n, H, M, L, D, tiled, scale, q, k, v, mask, out, st);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++)
        range(n * t / threads, n * (t + 1) / threads, H, M, L, D, tiled, scale, q, k, v, mask,
              out, st);
}

/* slot s of one (sentence, head)'s keys or values (see move_slots) */
static inline float *slot(float *t, int64_t D, int tiled, int64_t s) {
    return tiled ? t + s / W * D * W + s % W : t + s * D;
}

/* D floats, `from_step` apart, to `to_step` apart; inlined per pair of steps */
static inline __attribute__((always_inline)) void copy_slot(float *to, const float *from,
                                                            int64_t D, const int64_t to_step,
                                                            const int64_t from_step) {
    for (int64_t d = 0; d < D; d++) to[d * to_step] = from[d * from_step];
}

/* A cache's keys or values, (B, H, slots, D) rows, or with `tiled` keys in tiles (B, H,
 * tiles, D, 16), a tile's (D, 16) contiguous: slot s is lane s % 16 of tile s / 16, its D
 * floats 16 apart. `ds`: the strides of B and H (in floats); a row's slots contiguous.
 * Without `from`: new ones as rows (B, H, n, D), `rs` the strides of B, H and n, into slots
 * start .. start + n - 1. With `from` (B, n): slot from[b][j] into slot j, for j < n, in
 * place, j ascending: right wherever from[b][j] >= j, and elsewhere (kv_cache: slots no
 * row sees) a slot of the row all the same. `threads` > 1 splits the (B, H) rows. */
void move_slots(int64_t B, int64_t H, int64_t n, int64_t D, int tiled, int threads,
                float *dest, const int64_t *ds, const float *rows, const int64_t *rs,
                int64_t start, const int64_t *from) {
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && B * H >= 2 * threads)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        float *t = dest + b * ds[0] + h * ds[1];
        for (int64_t j = 0; j < n; j++) {
            if (!from) {
                const float *r = rows + b * rs[0] + h * rs[1] + j * rs[2];
                if (tiled) copy_slot(slot(t, D, 1, start + j), r, D, W, 1);
                else copy_slot(slot(t, D, 0, start + j), r, D, 1, 1);
            } else if (from[b * n + j] != j) {
                const int64_t f = from[b * n + j];
                if (tiled) copy_slot(slot(t, D, 1, j), slot(t, D, 1, f), D, W, W);
                else copy_slot(slot(t, D, 0, j), slot(t, D, 0, f), D, 1, 1);
            }
        }
    }
}

/* Beam search's candidates: each sentence's best k of its beams x V extensions, a beam's
 * score added to its row of log-probabilities (in fp32, as torch's add), sorted by value
 * and among equal values by position (beam * V + token).
 *
 * Why not torch's topk: over a step's (sentences, beams x V) it is several times slower
 * than one pass that compares 16 candidates at a time with the k-th best so far and looks
 * closer only where one beats it: a few dozen of a sentence's thousands enter the k best
 * on the way (benchmarks/results/2026-11-28-zen4-decode/NOTES.md). */

/* (x, i) into the best `*have` (at most k) so far, tv/ti sorted; i is larger than every
 * kept position (the scan's order), so it goes after equal values */
static inline void enter(float x, int64_t i, float *tv, int64_t *ti, int64_t *have, int64_t k) {
    if (*have == k && !(x > tv[k - 1])) return;
    int64_t p = *have < k ? (*have)++ : k - 1;
    for (; p > 0 && tv[p - 1] < x; p--) {
        tv[p] = tv[p - 1];
        ti[p] = ti[p - 1];
    }
    tv[p] = x;
    ti[p] = i;
}

static void best_of_sentence(int64_t beams, int64_t V, int64_t k, const float *lp,
                             const float *scores, float *tv, int64_t *ti) {
    int64_t have = 0;
    for (int64_t b = 0; b < beams; b++) {
        const float *row = lp + b * V, s = scores[b];
        int64_t v = 0;
        for (; v < V && have < k; v++) enter(row[v] + s, b * V + v, tv, ti, &have, k);
        /* 16 at a time: only a candidate above the k-th best so far is looked at */
#ifdef __AVX512F__
        const __m512 add = _mm512_set1_ps(s);
        for (; v + W <= V; v += W) {
            const __m512 x = _mm512_add_ps(_mm512_loadu_ps(row + v), add);
            __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_set1_ps(tv[k - 1]), _CMP_GT_OQ);
            for (; above; above &= above - 1) {
                const int j = __builtin_ctz(above);
                enter(row[v + j] + s, b * V + v + j, tv, ti, &have, k);
            }
        }
#else
        for (; v + W <= V; v += W) {
            const v16 x = load(row + v, W) + s;
            float most = x[0];
            for (int j = 1; j < W; j++) most = x[j] > most ? x[j] : most;
            if (!(most > tv[k - 1])) continue;
            for (int j = 0; j < W; j++) enter(row[v + j] + s, b * V + v + j, tv, ti, &have, k);
        }
#endif
        for (; v < V; v++) enter(row[v] + s, b * V + v, tv, ti, &have, k);
    }
}

/* lp (N * beams, V) and scores (N, beams), contiguous -> the best k (<= beams * V) of each
 * sentence, values (N, k) and positions (N, k) in [0, beams * V). No NaN in lp or scores
 * (log-softmax outputs, -inf where banned). `threads` > 1 splits the sentences. */
void best_extensions(int64_t N, int64_t beams, int64_t V, int64_t k, int threads,
                     const float *lp, const float *scores, float *tv, int64_t *ti) {
    (void)threads; /* without OpenMP */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N >= 2 * threads)
    for (int64_t n = 0; n < N; n++)
        best_of_sentence(beams, V, k, lp + n * beams * V, scores + n * beams, tv + n * k,
                         ti + n * k);
}

/* LayerNorm(x + y) of R rows of D floats, D a multiple of 16 (x, y, out contiguous; `out`
 * may be x or y), with weight w and bias b (D each), the variance biased, as torch's.
 * Why not torch's add and layer_norm: on a decoding step's few hundred rows of 128-1024
 * they take ~2x as long, two ops and three passes. `threads` > 1 splits the rows. */
void add_norm(int64_t R, int64_t D, int threads, const float *x, const float *y,
              const float *w, const float *b, float eps, float *out) {
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && R >= 2 * threads)
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * D, *yr = y + r * D;
        float *o = out + r * D;
        v16 acc = splat(0.0f);
        for (int64_t d = 0; d < D; d += W) {
            const v16 s = *(const v16u *)(xr + d) + *(const v16u *)(yr + d);
            *(v16u *)(o + d) = s;
            acc += s;
        }
        const float mean = sum(acc) / (float)D;
        acc = splat(0.0f);
        for (int64_t d = 0; d < D; d += W) {
            const v16 c = *(const v16u *)(o + d) - mean;
            acc += c * c;
        }
        const float rstd = 1.0f / __builtin_sqrtf(sum(acc) / (float)D + eps);
        for (int64_t d = 0; d < D; d += W) {
            const v16 c = *(const v16u *)(o + d) - mean;
            *(v16u *)(o + d) = c * rstd * *(const v16u *)(w + d) + *(const v16u *)(b + d);
        }
    }
}

/* Products of a few rows (a decoding step's hypotheses) with weights packed once:
 * y (M, N) = x (M, K) w^T + b, w in panels of 16 outputs, (ceil(N / 16), K, 16), the
 * layout of tile_keys (zeros past N). Why not a BLAS: on 4-255 rows MKL packs the
 * weights at every call and runs a decoding step's 13 products at 20-87 GFLOP/s; here the
 * packed panels stream from memory once per call, two at a time against up to 8 rows held
 * in registers (1.2-1.4x, kernels.py). Each output is its bias plus the products summed
 * over k in order, whichever rows are there. */
#define ROWS 8

static inline __attribute__((always_inline)) void panel_rows(
    const int r, const int two, const int64_t K, const float *x, int64_t xs, const float *p,
    const float *b, int64_t n0, int64_t n1, float *y, int64_t ys) {
    v16 a0[ROWS], a1[ROWS];
    const v16 b0 = b ? load(b, n0) : splat(0.0f), b1 = b && two ? load(b + W, n1) : splat(0.0f);
    for (int i = 0; i < r; i++) a0[i] = b0, a1[i] = b1;
    const float *p1 = p + K * W;
    for (int64_t k = 0; k < K; k++) {
        const v16 w0 = *(const v16u *)(p + k * W);
        const v16 w1 = two ? *(const v16u *)(p1 + k * W) : w0;
        for (int i = 0; i < r; i++) {
            const float xv = x[i * xs + k];
            a0[i] += xv * w0;
            if (two) a1[i] += xv * w1;
        }
    }
    for (int i = 0; i < r; i++) {
        store(y + i * ys, a0[i], n0);
        if (two) store(y + i * ys + W, a1[i], n1);
    }
}

void linear(int64_t M, int64_t N, int64_t K, int threads, const float *x, int64_t xs,
            const float *p, const float *b, float *y, int64_t ys) {
    (void)threads;
    const int64_t pairs = (N + 2 * W - 1) / (2 * W);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && pairs >= 2 * threads)
    for (int64_t j = 0; j < pairs; j++) {
        const int64_t c = 2 * j * W, left = N - c;
        const int64_t n0 = left < W ? left : W, n1 = left - W < W ? left - W : W;
        const float *pj = p + c * K, *bj = b ? b + c : 0;
        for (int64_t m = 0; m < M; m += ROWS) {
            const int64_t r = M - m < ROWS ? M - m : ROWS;
            const float *xm = x + m * xs;
            float *ym = y + m * ys + c;
#define ROWS_OF(R)                                                                 \
    case R:                                                                        \
        if (left > W) panel_rows(R, 1, K, xm, xs, pj, bj, n0, n1, ym, ys);         \
        else panel_rows(R, 0, K, xm, xs, pj, bj, n0, n1, ym, ys);                  \
        break;
            switch (r) { ROWS_OF(1) ROWS_OF(2) ROWS_OF(3) ROWS_OF(4) ROWS_OF(5) ROWS_OF(6) ROWS_OF(7) ROWS_OF(8) }
#undef ROWS_OF
        }
    }
}
