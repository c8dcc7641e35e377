/* A decoding step's two hot loops on a CPU, built and loaded by cpu_decoding.py (which
 * says when they run); GCC's and Clang's vector extensions, compiled for the machine it
 * runs on:
 * - `attend`: a few queries per (sentence, head) against that sentence's cached keys and
 *   values, softmax(q k^T / sqrt(d_k) + mask) v, in one pass;
 * - `best_extensions`: beam search's best candidates of each sentence, scores added.
 *
 * Attention: why not two batched products (torch's bmm): a step multiplies thousands of
 * tiny matrices (a beam of 4 queries by 20-200 keys of 32-64 dimensions), where a BLAS
 * spends most of its time packing each one, and the scores make two more passes (mask,
 * softmax) between the products. Here each (sentence, head) block is one loop nest over
 * keys already in cache: scores, softmax and the weighted sum of values.
 *
 * Arithmetic, fixed for every input (the static and the shrinking beam search agree
 * bitwise only if a row's result does not depend on which other keys or rows are there):
 * - a score is the dot product of (scale * query) and one key, summed in the same tree
 *   whatever the key's position (reduce16);
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

/* Lanes of a and b (0-15: a's, 16-31: b's), as GCC and Clang each spell it */
#ifdef __clang__
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i16){__VA_ARGS__})
#endif
/* Pairs of lanes added: the even pairs of a, the odd ones of b, then the same for blocks
 * of 2, 4 and 8 lanes (reduce16) */
#define FOLD1(a, b) (SHUFFLE(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) + \
                     SHUFFLE(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#define FOLD2(a, b) (SHUFFLE(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) + \
                     SHUFFLE(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
#define FOLD4(a, b) (SHUFFLE(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) + \
                     SHUFFLE(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
#define FOLD8(a, b) (SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + \
                     SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))

/* r[j] = the sum of p[j]'s lanes, for 16 vectors at once, by one tree for every j */
static inline v16 reduce16(const v16 *p) {
    v16 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) a[j] = FOLD1(p[2 * j], p[2 * j + 1]);
    for (int j = 0; j < 4; j++) b[j] = FOLD2(a[2 * j], a[2 * j + 1]);
    for (int j = 0; j < 2; j++) c[j] = FOLD4(b[2 * j], b[2 * j + 1]);
    return FOLD8(c[0], c[1]);
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

/* Blocks [first, last) of (sentence, head); `nd` vectors of d_k per row, the last one
 * holding `tail` floats (16 for a full one). Inlined per d_k below, so that the loops
 * over d_k unroll for the usual head sizes. */
static inline __attribute__((always_inline)) void blocks(
    int64_t first, int64_t last, int64_t H, int64_t M, int64_t L, const int64_t nd,
    const int64_t tail, float scale, const float *q, const float *k, const float *v,
    const float *mask, float *out, const int64_t *st) {
    const int64_t *qs = st, *ks = st + 3, *vs = st + 6, *ms = st + 9;
    const int64_t Lp = (L + W - 1) / W * W, D = (nd - 1) * W + tail;
    float s[MAXM][Lp];
    for (int64_t bh = first; bh < last; bh++) {
        const int64_t b = bh / H, h = bh % H;
        const float *kb = k + b * ks[0] + h * ks[1], *vb = v + b * vs[0] + h * vs[1];
        v16 qv[MAXM][MAXD], o[MAXM][MAXD];
        float sum[MAXM];
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < nd; i++) {
                const float *qm = q + b * qs[0] + h * qs[1] + m * qs[2] + i * W;
                qv[m][i] = load(qm, i == nd - 1 ? tail : W) * scale;
            }
        /* scores, 16 keys at a time */
        for (int64_t l0 = 0; l0 < L; l0 += W) {
            const int64_t n = L - l0 < W ? L - l0 : W;
            for (int64_t m = 0; m < M; m++) {
                v16 p[W];
                for (int64_t j = 0; j < n; j++) {
                    const float *kl = kb + (l0 + j) * ks[2];
                    v16 acc = qv[m][0] * load(kl, nd == 1 ? tail : W);
                    for (int64_t i = 1; i < nd; i++)
                        acc += qv[m][i] * load(kl + i * W, i == nd - 1 ? tail : W);
                    p[j] = acc;
                }
                for (int64_t j = n; j < W; j++) p[j] = splat(0.0f);
                store(&s[m][l0], reduce16(p), W);
            }
        }
        /* mask, softmax's weights (unnormalised) */
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
            for (int64_t m = 0; m < M; m++) {
                const float w = s[m][l];
                for (int64_t i = 0; i < nd; i++)
                    o[m][i] += w * load(vl + i * W, i == nd - 1 ? tail : W);
                sum[m] += w;
            }
        }
        for (int64_t m = 0; m < M; m++) {
            float *om = out + (bh * M + m) * D;
            for (int64_t i = 0; i < nd; i++)
                store(om + i * W, o[m][i] * (1.0f / sum[m]), i == nd - 1 ? tail : W);
        }
    }
}

static void range(int64_t first, int64_t last, int64_t H, int64_t M, int64_t L, int64_t D,
                  float scale, const float *q, const float *k, const float *v,
                  const float *mask, float *out, const int64_t *st) {
    const int64_t nd = (D + W - 1) / W, tail = D - (nd - 1) * W;
    if (D == 32) blocks(first, last, H, M, L, 2, W, scale, q, k, v, mask, out, st);
    else if (D == 64) blocks(first, last, H, M, L, 4, W, scale, q, k, v, mask, out, st);
    else if (D == 128) blocks(first, last, H, M, L, 8, W, scale, q, k, v, mask, out, st);
    else blocks(first, last, H, M, L, nd, tail, scale, q, k, v, mask, out, st);
}

/* q (B, H, M, D); k, v (B, H, L, D); mask (B, H, M, L) additive, or NULL; out (B, H, M, D)
 * contiguous. `st`: the strides (in floats) of q, k and v's first three dimensions, then
 * the mask's four (0 where broadcast); the last dimension of each is contiguous.
 * M <= MAXM, D <= MAXD * 16. `threads` > 1 splits the blocks among OpenMP threads where
 * the library was built with OpenMP (cpu_decoding.py links the one torch runs). */
void attend(int64_t B, int64_t H, int64_t M, int64_t L, int64_t D, float scale, int threads,
            const float *q, const float *k, const float *v, const float *mask, float *out,
            const int64_t *st) {
    const int64_t n = B * H;
    if (threads <= 1 || n < 2 * threads) {
        range(0, n, H, M, L, D, scale, q, k, v, mask, out, st);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++)
        range(n * t / threads, n * (t + 1) / threads, H, M, L, D, scale, q, k, v, mask, out, st);
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
