/* A decoding step's hot loops on a CPU, built and loaded by cpu_decoding.py (which says
 * when they run); GCC's and Clang's vector extensions:
 * - `attend`: a few queries per (sentence, head) against that sentence's cached keys and
 *   values, softmax(q k^T / sqrt(d_k) + mask) v, in one pass;
 * - `move_slots`: a step's keys and values into the cache, and its compaction in place;
 * - `best_extensions`: beam search's best candidates of each sentence, scores added;
 * - `add_norm`: LayerNorm(x + y), a residual connection;
 * - `linear`: products of a few rows with a weight packed once.
 *
 * Builds: one source, compiled for an instruction set (cpu_decoding.BUILDS): AVX-512 (16
 * lanes a vector), AVX2 with FMA (8) or the compiler's baseline for the architecture, SSE2
 * or NEON (4: "portable"). Vectors are as wide as the instruction set's registers: a
 * compiler splits a wider vector type into scalar code, not into two registers. The data
 * layouts do not depend on the build: keys in tiles of 16 and weights in panels of 16
 * outputs (T) are 16 / VW vectors a row.
 *
 * Attention: why not two batched products (torch's bmm): a step multiplies thousands of
 * tiny matrices (a beam of 4 queries by 20-200 keys of 32-64 dimensions), where a BLAS
 * spends most of its time packing each one, and the scores make two more passes (mask,
 * softmax) between the products. Here each (sentence, head) block is one loop nest over
 * keys already in cache: scores, softmax and the weighted sum of values. The scores take
 * 16 keys at a time, one per lane, with one query element broadcast: that needs the 16
 * keys transposed, (D, 16), which is how kv_cache stores the decoder's keys for this
 * kernel (a tile); keys stored as rows are transposed a chunk at a time here. (A dot
 * product per key, the lanes over d, then needs a sum across the lanes of each: more
 * shuffles than multiplies.)
 *
 * Arithmetic, fixed for every input of a build (the static and the shrinking beam search
 * agree bitwise only if a row's result does not depend on which other keys or rows are
 * there):
 * - a score is the dot product of (scale * query) and one key, summed over d in order in
 *   the key's own lane, whatever the key's position and layout;
 * - exp is a polynomial (relative error ~1e-7); masked keys (-inf) weigh exactly 0;
 * - the weights' sum and the weighted sum of values run over the keys in order, so that a
 *   masked key adds exactly 0 wherever it sits.
 * Builds differ in rounding (FMA or not, the order of add_norm's sums across lanes). */

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#define BUILD "avx512"
#define ROWS 8   /* linear: rows held in registers, */
#define PANELS 2 /* against this many panels: 16 of the 32 registers */
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define BUILD "avx2"
#define ROWS 6 /* 12 of the 16 registers */
#define PANELS 1
#else
#define VW 4
#define BUILD "portable"
#define ROWS 2 /* 8 of SSE's 16 registers */
#define PANELS 1
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
#define T 16            /* keys per tile, outputs per panel: cpu_decoding.TILE */
#define NV (T / VW)     /* vectors per tile row */
#define MAXM 8          /* queries per block: cpu_decoding.MAX_QUERIES */
#define MAXD 128        /* d_k: cpu_decoding.MAX_HEAD */
#define QP (VW >= 8 ? 4 : 2) /* queries per pass over a block's keys: 4 x NV accumulators */

/* Which build this is, and its lanes (cpu_decoding.py checks that the flags took). */
const char *build(void) { return BUILD; }
int lanes(void) { return VW; }

static inline vf splat(float x) { return (vf){0} + x; }
static inline vf pick(vi c, vf a, vf b) { return (vf)(((vi)a & c) | ((vi)b & ~c)); }

/* the lanes' sum, halves added in turn */
static inline float sum(vf x) {
    float h[VW];
    memcpy(h, &x, sizeof h);
    for (int w = VW / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) h[j] += h[j + w];
    return h[0];
}

/* n (<= VW) floats from p, zeros after */
static inline vf load(const float *p, int64_t n) {
    if (n == VW) return *(const vfu *)p;
    vf x = splat(0.0f);
    memcpy(&x, p, (size_t)n * sizeof(float));
    return x;
}

static inline void store(float *p, vf x, int64_t n) {
    if (n == VW) *(vfu *)p = x;
    else memcpy(p, &x, (size_t)n * sizeof(float));
}

/* the width of vector i of n floats: VW, or what is left (0 past the end) */
static inline int64_t part(int64_t n, int64_t i) {
    const int64_t left = n - i * VW;
    return left < 0 ? 0 : left < VW ? left : VW;
}

/* exp(x) for x <= 0 (scores minus their maximum): 2^n * poly(r), x = n ln2 + r; 0 below
 * -87 (where fp32's exp leaves the normal range) and at -inf, NaN for NaN */
static inline vf exp_nonpositive(vf x) {
    vi low = x < -87.0f;
    vf y = pick(low, splat(-87.0f), x);
    vf n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to integer */
    vf r = y - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    vf p = splat(0.0013888889f);
    p = p * r + 0.008333334f;
    p = p * r + 0.041666668f;
    p = p * r + 0.16666667f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return pick(low, splat(0.0f), p * two_n);
}

/* The threads for `work` (about a multiply-add each) split into `parts`: all of them where
 * each gets a share worth waking it for, else one. A parallel region costs a thread's
 * wake-up, which on a busy machine (its cores shared) is far longer than a spinning
 * team's hand-over; a decoding step makes dozens of small calls. */
#define MIN_WORK (1 << 18)
static inline int team(int threads, int64_t work, int64_t parts) {
    return threads > 1 && parts >= 2 * threads && work >= MIN_WORK * threads ? threads : 1;
}

/* n floats from p on their way to L2 */
static inline void fetch(const float *p, int64_t n) {
#ifdef NOFETCH
    return;
#endif
    for (int64_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(p + i, 0, 2);
}

/* One chunk's scores for r (<= QP) queries: s[m][l0 .. l0 + 15] = sum over d, in order, of
 * qv[m][d] * key(l0 + j)[d]; `kt` holds the chunk's 16 keys transposed (D rows of 16);
 * `next`: a tile to fetch as this one is read, a row (one cache line) per d (NULL: none) */
static inline __attribute__((always_inline)) void chunk_scores(
    const int64_t r, const int64_t D, const float *kt, float (*qv)[MAXD], float *s,
    int64_t Lp, int64_t l0, const float *next) {
    vf acc[QP][NV];
    if (next) __builtin_prefetch(next, 0, 2);
    for (int64_t m = 0; m < r; m++)
        for (int j = 0; j < NV; j++) acc[m][j] = qv[m][0] * *(const vfu *)(kt + j * VW);
    for (int64_t d = 1; d < D; d++) {
        vf kd[NV];
        if (next) __builtin_prefetch(next + d * T, 0, 2);
        for (int j = 0; j < NV; j++) kd[j] = *(const vfu *)(kt + d * T + j * VW);
        for (int64_t m = 0; m < r; m++)
            for (int j = 0; j < NV; j++) acc[m][j] += qv[m][d] * kd[j];
    }
    for (int64_t m = 0; m < r; m++)
        for (int j = 0; j < NV; j++) *(vfu *)(s + m * Lp + l0 + j * VW) = acc[m][j];
}

/* r (<= QP) queries' weighted sums of values over vectors i0, i0 + 1 (`two`) of d, key by
 * key in order: out[m] = sum over l < L of s[m][l] * v[l], times inv[m]. The first pass
 * over a block (`first`) sums the weights too, key by key in order, and sets inv[m] to
 * 1 / that sum, and fetches the next block's values (`next`, vs apart) as it reads these. */
static inline __attribute__((always_inline)) void weigh(
    const int64_t r, const int two, const int first, int64_t L, int64_t D, int64_t i0,
    const float *v, int64_t vs, const float *s, int64_t Lp, float *inv, float *out,
    int64_t os, const float *next) {
    const int64_t n0 = part(D, i0), n1 = two ? part(D, i0 + 1) : 0;
    vf acc[QP][2];
    float total[QP];
    for (int64_t m = 0; m < r; m++) acc[m][0] = acc[m][1] = splat(0.0f), total[m] = 0.0f;
    for (int64_t l = 0; l < L; l++) {
        const float *vl = v + l * vs + i0 * VW;
        if (first && next) fetch(next + l * vs, D);
        const vf v0 = load(vl, n0), v1 = two ? load(vl + VW, n1) : v0;
        for (int64_t m = 0; m < r; m++) {
            const float w = s[m * Lp + l];
            acc[m][0] += w * v0;
            if (two) acc[m][1] += w * v1;
            if (first) total[m] += w;
        }
    }
    for (int64_t m = 0; m < r; m++)
        if (first) inv[m] = 1.0f / total[m];
    for (int64_t m = 0; m < r; m++) {
        float *om = out + m * os + i0 * VW;
        store(om, acc[m][0] * inv[m], n0);
        if (two) store(om + VW, acc[m][1] * inv[m], n1);
    }
}

/* Blocks [first, last) of (sentence, head), `D` floats per head. Keys `tiled`: chunks of 16
 * keys stored transposed, (tiles, D, 16) per block, as kv_cache keeps them for this loop;
 * else rows (L, D), transposed here a chunk at a time. Inlined per layout and head size. */
static inline __attribute__((always_inline)) void blocks(
    int64_t first, int64_t last, int64_t H, int64_t M, int64_t L, const int64_t D,
    const int tiled, float scale, const float *q, const float *k, const float *v,
    const float *mask, float *out, const int64_t *st) {
    const int64_t *qs = st, *ks = st + 3, *vs = st + 6, *ms = st + 9, *os = st + 13;
    const int64_t Lp = (L + T - 1) / T * T, nd = (D + VW - 1) / VW;
    float s[MAXM][Lp];
    float qv[MAXM][MAXD];
    float kt[MAXD * T] __attribute__((aligned(64)));
    for (int64_t bh = first; bh < last; bh++) {
        const int64_t b = bh / H, h = bh % H;
        const float *kb = k + b * ks[0] + h * ks[1], *vb = v + b * vs[0] + h * vs[1];
        /* the next block's keys and values, each fetched as the same ones of this block are
         * read: a block's keys and values are a few KB, and a cache's (sentence, head) rows
         * lie far apart (room for the longest output), too short a stream for the hardware
         * prefetcher to run ahead of */
        const int64_t next = bh + 1 < last ? bh + 1 : bh;
        const float *kn = k + next / H * ks[0] + next % H * ks[1];
        const float *vn = v + next / H * vs[0] + next % H * vs[1];
        for (int64_t m = 0; m < M; m++)
            for (int64_t d = 0; d < D; d++)
                qv[m][d] = q[b * qs[0] + h * qs[1] + m * qs[2] + d] * scale;
        /* scores, 16 keys at a time: for each, an FMA chain over d in one lane */
        for (int64_t l0 = 0; l0 < L; l0 += T) {
            const float *chunk = kb + l0 / T * ks[2];
            const int64_t n = L - l0 < T ? L - l0 : T;
            if (!tiled) {
                for (int64_t j = 0; j < n; j++) fetch(kn + (l0 + j) * ks[2], D);
                for (int64_t j = 0; j < n; j++)
                    for (int64_t d = 0; d < D; d++) kt[d * T + j] = kb[(l0 + j) * ks[2] + d];
                chunk = kt;
            }
            for (int64_t m0 = 0; m0 < M; m0 += QP) {
                const int64_t r = M - m0 < QP ? M - m0 : QP;
                float (*qm)[MAXD] = qv + m0;
                float *sm = &s[m0][0];
                const float *fn = tiled && m0 == 0 ? kn + l0 / T * ks[2] : 0;
                if (r == QP) chunk_scores(QP, D, chunk, qm, sm, Lp, l0, fn);
                else if (r == 1) chunk_scores(1, D, chunk, qm, sm, Lp, l0, fn);
#if QP > 2
                else if (r == 2) chunk_scores(2, D, chunk, qm, sm, Lp, l0, fn);
                else chunk_scores(3, D, chunk, qm, sm, Lp, l0, fn);
#endif
            }
        }
        /* mask, softmax's weights (unnormalised) and their sum; lanes past L (a tile's
         * unwritten keys, whatever they hold) set to -inf, weight 0 */
        float inv[MAXM];
        for (int64_t m = 0; m < M; m++) {
            if (mask) {
                const float *mk = mask + b * ms[0] + h * ms[1] + m * ms[2];
                for (int64_t l = 0; l < L; l++) s[m][l] += mk[l];
            }
            for (int64_t l = L; l < Lp; l++) s[m][l] = -__builtin_inff();
            vf top = load(s[m], VW);
            for (int64_t l = VW; l < Lp; l += VW) {
                vf x = load(&s[m][l], VW);
                top = pick(x > top, x, top);
            }
            float most = top[0];
            for (int j = 1; j < VW; j++) most = top[j] > most ? top[j] : most;
            for (int64_t l = 0; l < Lp; l += VW)
                store(&s[m][l], exp_nonpositive(load(&s[m][l], VW) - most), VW);
        }
        /* the weighted sum of values: each value row read once per QP queries and two
         * vectors of d */
        for (int64_t m0 = 0; m0 < M; m0 += QP) {
            const int64_t r = M - m0 < QP ? M - m0 : QP;
            float *om = out + b * os[0] + h * os[1] + m0 * os[2];
            const float *fn = m0 == 0 ? vn : 0;
            for (int64_t i0 = 0; i0 < nd; i0 += 2) {
#define WEIGH(R, TWO, FIRST) \
    weigh(R, TWO, FIRST, L, D, i0, vb, vs[2], &s[m0][0], Lp, inv + m0, om, os[2], fn)
#define QUERIES(TWO, FIRST)                      \
    if (r == QP) WEIGH(QP, TWO, FIRST);          \
    else if (r == 1) WEIGH(1, TWO, FIRST);       \
    else if (QP > 2 && r == 2) WEIGH(2, TWO, FIRST); \
    else WEIGH(QP - 1, TWO, FIRST);
                const int two = nd - i0 >= 2;
                if (i0 == 0) {
                    if (two) { QUERIES(1, 1) } else { QUERIES(0, 1) }
                } else {
                    if (two) { QUERIES(1, 0) } else { QUERIES(0, 0) }
                }
#undef QUERIES
#undef WEIGH
            }
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
 * M <= MAXM, D <= MAXD. `threads` > 1 splits the blocks among OpenMP threads where the
 * library was built with OpenMP (cpu_decoding.py links the one torch runs). */
void attend(int64_t B, int64_t H, int64_t M, int64_t L, int64_t D, int tiled, float scale,
            int threads, const float *q, const float *k, const float *v, const float *mask,
            float *out, const int64_t *st) {
    const int64_t n = B * H;
    threads = team(threads, n * M * L * D * 2, n);
    if (threads == 1) {
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
    return tiled ? t + s / T * D * T + s % T : t + s * D;
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
    threads = team(threads, B * H * n * D * 16, B * H); /* a cache line a key's float */
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        float *t = dest + b * ds[0] + h * ds[1];
        for (int64_t j = 0; j < n; j++) {
            if (!from) {
                const float *r = rows + b * rs[0] + h * rs[1] + j * rs[2];
                if (tiled) copy_slot(slot(t, D, 1, start + j), r, D, T, 1);
                else copy_slot(slot(t, D, 0, start + j), r, D, 1, 1);
            } else if (from[b * n + j] != j) {
                const int64_t f = from[b * n + j];
                if (tiled) copy_slot(slot(t, D, 1, j), slot(t, D, 1, f), D, T, T);
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
 * on the way. */

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

/* a bit for each of the 16 candidates row[0 .. 15] + s above t */
static inline unsigned above(const float *row, float s, float t) {
#if defined(__AVX512F__)
    const __m512 x = _mm512_add_ps(_mm512_loadu_ps(row), _mm512_set1_ps(s));
    return _mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_GT_OQ);
#elif VW == 8
    const __m256 add = _mm256_set1_ps(s), top = _mm256_set1_ps(t);
    const __m256 x0 = _mm256_add_ps(_mm256_loadu_ps(row), add);
    const __m256 x1 = _mm256_add_ps(_mm256_loadu_ps(row + 8), add);
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x0, top, _CMP_GT_OQ)) |
           (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x1, top, _CMP_GT_OQ)) << 8;
#else
    vf most = load(row, VW) + s;
    for (int j = 1; j < NV; j++) {
        const vf x = load(row + j * VW, VW) + s;
        most = pick(x > most, x, most);
    }
    for (int j = 0; j < VW; j++)
        if (most[j] > t) return 0xffff; /* some: each is looked at */
    return 0;
#endif
}

static void best_of_sentence(int64_t beams, int64_t V, int64_t k, const float *lp,
                             const float *scores, float *tv, int64_t *ti) {
    int64_t have = 0;
    for (int64_t b = 0; b < beams; b++) {
        const float *row = lp + b * V, s = scores[b];
        int64_t v = 0;
        for (; v < V && have < k; v++) enter(row[v] + s, b * V + v, tv, ti, &have, k);
        /* 16 at a time: only a candidate above the k-th best so far is looked at */
        for (; v + T <= V; v += T)
            for (unsigned bits = above(row + v, s, tv[k - 1]); bits; bits &= bits - 1) {
                const int j = __builtin_ctz(bits);
                enter(row[v + j] + s, b * V + v + j, tv, ti, &have, k);
            }
        for (; v < V; v++) enter(row[v] + s, b * V + v, tv, ti, &have, k);
    }
}

/* lp (N * beams, V) and scores (N, beams), contiguous -> the best k (<= beams * V) of each
 * sentence, values (N, k) and positions (N, k) in [0, beams * V). No NaN in lp or scores
 * (log-softmax outputs, -inf where banned). `threads` > 1 splits the sentences. */
void best_extensions(int64_t N, int64_t beams, int64_t V, int64_t k, int threads,
                     const float *lp, const float *scores, float *tv, int64_t *ti) {
    threads = team(threads, N * beams * V, N);
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t n = 0; n < N; n++)
        best_of_sentence(beams, V, k, lp + n * beams * V, scores + n * beams, tv + n * k,
                         ti + n * k);
}

/* log_softmax of R rows of V floats (contiguous), in place: each row's maximum, the sum of
 * exp(x - max) and x - (max + log(sum)), three passes over a row while it is in cache.
 * Why not torch's: a step's (rows, V) logits are the largest tensor of a step (several
 * MB), and torch's AVX2 kernel takes several times as long as these passes. No NaN (a
 * model's logits). `threads` > 1 splits the rows. */
void log_softmax(int64_t R, int64_t V, int threads, float *x) {
    threads = team(threads, R * V * 8, R); /* exp's polynomial, three passes */
    (void)threads;                         /* without OpenMP */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < R; r++) {
        float *row = x + r * V;
        const int64_t whole = V / VW * VW;
        vf top = splat(-__builtin_inff());
        for (int64_t v = 0; v < whole; v += VW) {
            const vf a = *(const vfu *)(row + v);
            top = pick(a > top, a, top);
        }
        float most = top[0];
        for (int j = 1; j < VW; j++) most = top[j] > most ? top[j] : most;
        for (int64_t v = whole; v < V; v++) most = row[v] > most ? row[v] : most;
        vf acc = splat(0.0f);
        for (int64_t v = 0; v < whole; v += VW) acc += exp_nonpositive(*(const vfu *)(row + v) - most);
        if (whole < V) { /* the last few, -inf (weight 0) past the row's end */
            float tail[VW];
            for (int j = 0; j < VW; j++) tail[j] = whole + j < V ? row[whole + j] : -__builtin_inff();
            acc += exp_nonpositive(*(const vfu *)tail - most);
        }
        const float lse = most + __builtin_logf(sum(acc));
        for (int64_t v = 0; v < whole; v += VW) *(vfu *)(row + v) = *(const vfu *)(row + v) - lse;
        for (int64_t v = whole; v < V; v++) row[v] -= lse;
    }
}

/* LayerNorm(x + y) of R rows of D floats, D a multiple of 16 (x, y, out contiguous; `out`
 * may be x or y), with weight w and bias b (D each), the variance biased, as torch's.
 * Why not torch's add and layer_norm: two ops and three passes over a decoding step's few
 * hundred rows. `threads` > 1 splits the rows. */
void add_norm(int64_t R, int64_t D, int threads, const float *x, const float *y,
              const float *w, const float *b, float eps, float *out) {
    threads = team(threads, R * D * 4, R);
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * D, *yr = y + r * D;
        float *o = out + r * D;
        vf acc = splat(0.0f);
        for (int64_t d = 0; d < D; d += VW) {
            const vf s = *(const vfu *)(xr + d) + *(const vfu *)(yr + d);
            *(vfu *)(o + d) = s;
            acc += s;
        }
        const float mean = sum(acc) / (float)D;
        acc = splat(0.0f);
        for (int64_t d = 0; d < D; d += VW) {
            const vf c = *(const vfu *)(o + d) - mean;
            acc += c * c;
        }
        const float rstd = 1.0f / __builtin_sqrtf(sum(acc) / (float)D + eps);
        for (int64_t d = 0; d < D; d += VW) {
            const vf c = *(const vfu *)(o + d) - mean;
            *(vfu *)(o + d) = c * rstd * *(const vfu *)(w + d) + *(const vfu *)(b + d);
        }
    }
}

/* Products of a few rows (a decoding step's hypotheses) with weights packed once:
 * y (M, N) = x (M, K) w^T + b, w in panels of 16 outputs, (ceil(N / 16), K, 16), the
 * layout of tile_keys (zeros past N). Why not a BLAS: on a few rows MKL and oneDNN pack
 * the weights at every call; here the packed panels stream from memory once per call,
 * PANELS at a time against up to ROWS rows held in registers. Each output is its bias
 * plus the products summed over k in order, whichever rows are there. */

/* r rows against np (<= PANELS) panels from p, of n[0], n[1] outputs */
static inline __attribute__((always_inline)) void panel_rows(
    const int r, const int np, const int64_t K, const float *x, int64_t xs, const float *p,
    const float *b, const int64_t *n, float *y, int64_t ys) {
    vf acc[ROWS][PANELS * NV];
    for (int c = 0; c < np * NV; c++) {
        const int64_t width = part(n[c / NV], c % NV);
        const vf bias = b && width ? load(b + c * VW, width) : splat(0.0f);
        for (int i = 0; i < r; i++) acc[i][c] = bias;
    }
    for (int64_t k = 0; k < K; k++) {
        vf w[PANELS * NV];
        for (int c = 0; c < np * NV; c++) w[c] = *(const vfu *)(p + c / NV * K * T + k * T + c % NV * VW);
        for (int i = 0; i < r; i++) {
            const float xv = x[i * xs + k];
            for (int c = 0; c < np * NV; c++) acc[i][c] += xv * w[c];
        }
    }
    for (int i = 0; i < r; i++)
        for (int c = 0; c < np * NV; c++) {
            const int64_t width = part(n[c / NV], c % NV);
            if (width) store(y + i * ys + c * VW, acc[i][c], width);
        }
}

/* panel group j (PANELS panels from output c = j * PANELS * T) against rows [m0, m1) */
static void group_rows(int64_t j, int64_t m0, int64_t m1, int64_t N, int64_t K, const float *x,
                       int64_t xs, const float *p, const float *b, float *y, int64_t ys) {
    const int64_t c = j * PANELS * T, left = N - c;
    const int64_t n[2] = {left < T ? left : T, left - T < T ? left - T : T};
    const float *pj = p + c * K, *bj = b ? b + c : 0;
    for (int64_t m = m0; m < m1; m += ROWS) {
        const int64_t r = m1 - m < ROWS ? m1 - m : ROWS;
        const float *xm = x + m * xs;
        float *ym = y + m * ys + c;
#if PANELS > 1
#define PANELS_OF(R)                                                             \
    if (left > T) panel_rows(R, 2, K, xm, xs, pj, bj, n, ym, ys);               \
    else panel_rows(R, 1, K, xm, xs, pj, bj, n, ym, ys);
#else
#define PANELS_OF(R) panel_rows(R, 1, K, xm, xs, pj, bj, n, ym, ys);
#endif
#define ROWS_OF(R) \
    case R:        \
        PANELS_OF(R) break;
        switch (r) {
            ROWS_OF(1) ROWS_OF(2)
#if ROWS > 2
            ROWS_OF(3) ROWS_OF(4) ROWS_OF(5) ROWS_OF(6)
#endif
#if ROWS > 6
            ROWS_OF(7) ROWS_OF(8)
#endif
        }
#undef PANELS_OF
#undef ROWS_OF
    }
}

/* Each thread takes a run of panel groups, PANEL_BLOCK floats of weights at a time (half
 * a 512 KB L2: they stay there while every row passes over them, ROWS rows at a time from
 * L1), so that the weights come from memory once a call, and a step's rows (up to
 * thousands) once for each block of panels, not for each panel. */
#define PANEL_BLOCK 65536
void linear(int64_t M, int64_t N, int64_t K, int threads, const float *x, int64_t xs,
            const float *p, const float *b, float *y, int64_t ys) {
    const int64_t groups = (N + PANELS * T - 1) / (PANELS * T);
    const int64_t fit = PANEL_BLOCK / (K * PANELS * T), block = fit > 1 ? fit : 1;
    const int nt = team(threads, M * N * K, groups);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        const int64_t last = groups * (t + 1) / nt;
        for (int64_t j0 = groups * t / nt; j0 < last; j0 += block)
            for (int64_t m = 0; m < M; m += ROWS)
                for (int64_t j = j0; j < (last - j0 < block ? last : j0 + block); j++)
                    group_rows(j, m, M - m < ROWS ? M : m + ROWS, N, K, x, xs, p, b, y, ys);
    }
}
