/* The fused decode step: one call runs every layer for the whole batch, in one OpenMP
 * parallel region with five barriers per layer (after qkv, attention, o_proj, gate_up and
 * down), instead of dozens of framework ops per layer.
 *
 * Per layer, each thread:
 *   1. normalises + quantizes the residual stream x (all rows, a private copy: cheaper than a
 *      barrier) and computes its partition of the qkv rows;              barrier
 *   2. takes (sequence, kv head) items: q/k norm, rope, K/V into the cache, attention; barrier
 *   3. quantizes the attention output, its o_proj rows, adds them into x;  barrier
 *   4. normalises x, computes gate and up for its partition of the intermediate features and
 *      applies silu(gate) * up (gate row j and up row j are in the same thread);  barrier
 *   5. quantizes that, its down_proj rows, adds them into x;               barrier
 * then the final norm and the lm_head rows of the sampled rows. Rows and items are shared out
 * by claiming chunks (work stealing, see claim_next): a thread takes its own share first (the
 * row partition sx_pack used to first-touch the weights, so it streams memory local to it),
 * then what is left of the others'. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "gemm.h"
#include "ops.h"
#include "prof.h"
#include "simd.h"

/* Rows per claimed chunk of a phase (work stealing, claim_next). */
#define STEAL_ROWS 64

typedef struct {
    float *xn;              /* [B, kmax] normalised activations */
    sx_act_block *blocks;   /* [B, kmax / 32] */
    float *scales;          /* [B, kmax / 32] */
    int32_t *zq;            /* [B, kmax / 32] */
    float *xsum;            /* [B, kmax / 32] */
    int32_t *hsum;          /* [B, kmax / 32, 2] */
    float *scores;          /* [2 head_dim + group * max_len]: the new key and value, then one row
                             * of attention scores per query head of a KV group */
    float *gu;              /* [2, B, STEAL_ROWS]: a gate/up chunk's gate, then up, outputs */
} sx_scratch;

/* Work-sharing phases of a step (each with its own claim counters): per layer qkv, store_kv,
 * attention, o_proj, gate_up, down; then the LM head. */
#define PHASES_PER_LAYER 6
#define PHASES(m) ((m)->n_layers * PHASES_PER_LAYER + 1)

struct sx_ctx {
    sx_model m;
    int max_batch, nt, nrc, kmax, q_out, kv_out, bs;
    const int32_t **row_table; /* [max_batch]: each row's block table, set per step */
    int *claims;               /* [phases, nt]: chunks claimed in each thread's share, per step */
    int32_t *ident;            /* [n_slots]: ident[s] = s, the tables of an unpaged cache */
    float *x, *qkv, *attn, *proj, *gu, *h;
    sx_act down_act; /* [B, inter / 32] blocks: h quantized for down_proj, shared by the threads */
    sx_scratch *ws;
    uint64_t *prof; /* [nt, n_layers + 1, SX_PROF_STRIDE] op clocks (prof.h); NULL unless SX_PROFILE */
};

const char *sx_simd(void) {
#if defined(SX_VNNI)
    return sx_amx_active() ? "avx2+fma+f16c+avx512vnni+amx" : "avx2+fma+f16c+avx512vnni";
#elif defined(SX_AVX2)
    return "avx2+fma+f16c";
#elif defined(SX_NEON)
    return "neon+dotprod";
#else
    return "portable";
#endif
}

int sx_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

int sx_pin_threads(const int *cpus, int n) {
    int bad = 0, got = 0;
#pragma omp parallel num_threads(n) reduction(max : bad) reduction(max : got)
    {
        const int t = sx_thread_num();
        got = sx_num_threads();
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[t], &set);
        if (sched_setaffinity(0, sizeof(set), &set) != 0) bad = t + 1;
    }
    if (got != n) return -1;
    return bad;
}

/* Zeroed scratch that costs nothing until used: an anonymous mapping (page aligned) whose pages
 * the kernel supplies, zero, on first touch. The buffers are sized for the largest step (the
 * scheduler's whole token budget: ~0.5 GB at 2048 tokens for a 1B model), which most steps
 * never reach; zeroing them with memset made every page resident at load (0.5-0.8 s of the 1B
 * load on a VM whose fresh memory costs the host a fault per page, and as much RSS). The
 * mapping's length sits in the first page, before the returned pointer. */
#define ZHEAD 4096
static void *zalloc(size_t bytes) {
    const size_t len = ZHEAD + (bytes + ZHEAD - 1) / ZHEAD * ZHEAD;
    char *base = (char *)mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return NULL;
    memcpy(base, &len, sizeof len);
    return base + ZHEAD;
}

static void zfree(void *p) {
    if (!p) return;
    char *base = (char *)p - ZHEAD;
    size_t len;
    memcpy(&len, base, sizeof len);
    munmap(base, len);
}

void sx_ctx_free(sx_ctx *c) {
    if (!c) return;
    if (c->ws)
        for (int t = 0; t < c->nt; t++) {
            zfree(c->ws[t].xn);
            zfree(c->ws[t].blocks);
            zfree(c->ws[t].scales);
            zfree(c->ws[t].zq);
            zfree(c->ws[t].xsum);
            zfree(c->ws[t].hsum);
            zfree(c->ws[t].scores);
            zfree(c->ws[t].gu);
        }
    free(c->ws);
    free(c->row_table);
    free(c->claims);
    free(c->ident);
    free(c->prof);
    zfree(c->x);
    zfree(c->qkv);
    zfree(c->attn);
    zfree(c->proj);
    zfree(c->gu);
    zfree(c->h);
    zfree(c->down_act.blocks);
    zfree(c->down_act.scales);
    zfree(c->down_act.zq);
    zfree(c->down_act.xsum);
    zfree(c->down_act.hsum);
    free(c);
}

sx_ctx *sx_ctx_new(const sx_model *m, int max_batch, int n_threads, int nrc) {
    const int ee = sx_block_elems(m->embed_type);
    if (!ee || m->hidden % ee) return NULL; /* an embedding type the step cannot read */
    sx_ctx *c = (sx_ctx *)calloc(1, sizeof(sx_ctx));
    if (!c) return NULL;
    c->m = *m;
    c->max_batch = max_batch;
    c->nt = n_threads < 1 ? 1 : n_threads;
    c->nrc = nrc;
    c->q_out = m->n_heads * m->head_dim;
    c->kv_out = m->n_kv_heads * m->head_dim;
    c->bs = m->block_size ? m->block_size : m->max_len;
    int kmax = m->hidden > c->q_out ? m->hidden : c->q_out;
    c->kmax = kmax > m->inter ? kmax : m->inter;
    const size_t B = (size_t)max_batch;
    c->x = zalloc(B * m->hidden * 4);
    c->qkv = zalloc(B * (c->q_out + 2 * c->kv_out) * 4);
    c->attn = zalloc(B * c->q_out * 4);
    c->proj = zalloc(B * m->hidden * 4);
    c->gu = zalloc(B * 2 * m->inter * 4);
    c->h = zalloc(B * m->inter * 4);
    const size_t hb = B * (m->inter / SX_QK), hb_pad = (B + SX_ACT_PAD_ROWS) * (m->inter / SX_QK);
    c->down_act.blocks = zalloc(hb_pad * sizeof(sx_act_block));
    c->down_act.scales = zalloc(hb_pad * 4);
    c->down_act.zq = zalloc(hb * 4);
    c->down_act.xsum = zalloc(hb_pad * 4);
    c->down_act.hsum = zalloc(hb * 8);
    c->down_act.x = c->h;
    c->ws = (sx_scratch *)calloc(c->nt, sizeof(sx_scratch));
    c->row_table = (const int32_t **)calloc(B, sizeof(int32_t *));
    c->claims = (int *)calloc((size_t)PHASES(m) * c->nt, sizeof(int));
    c->ident = (int32_t *)calloc(m->n_slots > 0 ? m->n_slots : 1, sizeof(int32_t));
    int ok = c->x && c->qkv && c->attn && c->proj && c->gu && c->h && c->down_act.blocks && c->down_act.scales &&
             c->down_act.zq && c->down_act.xsum && c->down_act.hsum && c->ws && c->row_table && c->ident && c->claims &&
             c->bs > 0 && (m->block_size == 0 || m->block_size % 8 == 0);
#ifdef SX_PROFILE
    c->prof = (uint64_t *)calloc((size_t)c->nt * (m->n_layers + 1) * SX_PROF_STRIDE, sizeof(uint64_t));
    ok = ok && c->prof;
#endif
    for (int s = 0; ok && s < m->n_slots; s++) c->ident[s] = s;
    const size_t kb = B * (c->kmax / SX_QK), kb_pad = (B + SX_ACT_PAD_ROWS) * (c->kmax / SX_QK);
    for (int t = 0; ok && t < c->nt; t++) {
        c->ws[t].xn = zalloc(B * c->kmax * 4);
        c->ws[t].blocks = zalloc(kb_pad * sizeof(sx_act_block));
        c->ws[t].scales = zalloc(kb_pad * 4);
        c->ws[t].zq = zalloc(kb * 4);
        c->ws[t].xsum = zalloc(kb_pad * 4);
        c->ws[t].hsum = zalloc(kb * 8);
        c->ws[t].scores = zalloc(((size_t)(m->n_heads / m->n_kv_heads) * m->max_len + 2 * m->head_dim) * 4);
        c->ws[t].gu = zalloc(2 * B * STEAL_ROWS * 4);
        ok = c->ws[t].xn && c->ws[t].blocks && c->ws[t].scales && c->ws[t].zq && c->ws[t].xsum && c->ws[t].hsum &&
             c->ws[t].scores && c->ws[t].gu;
    }
    if (!ok) {
        sx_ctx_free(c);
        return NULL;
    }
    return c;
}

/* Work sharing with stealing. A phase's rows are split as sx_partition splits them (each
 * thread's share is the rows whose weights it first-touched when packing), in chunks of
 * STEAL_ROWS. A thread claims the chunks of its own share first, then those left in the
 * others' shares: when the OS deschedules one thread (the gateway and the client share these
 * cores), the others finish its work instead of waiting for it at the next barrier. Which
 * thread computes a row never changes the row's numbers. Each phase of a step has its own
 * claim counters, zeroed before the step. */
typedef struct {
    int *claims; /* this phase's counters, one per share */
    int rows, t, nt, k;
    int unit; /* share boundaries are multiples of this (SX_PART, or a quant block: QUANT_UNIT) */
} sx_claim;

static sx_claim claim_start(sx_ctx *c, int phase, int rows, int t, int nt) {
    sx_claim q = {c->claims + (size_t)phase * c->nt, rows, t, nt, 0, SX_PART};
    return q;
}

/* The gate/up phase's shares end on 32-feature blocks, so that each chunk's silu(gate) * up
 * is quantized for down_proj by the thread that computed it (whole blocks; STEAL_ROWS is a
 * multiple). Those shares differ from sx_pack's first-touch partition by under 32 rows. */
#define QUANT_UNIT SX_QK

static int claim_next(sx_claim *q, int *r0, int *r1) {
    for (; q->k < q->nt; q->k++) {
        const int share = (q->t + q->k) % q->nt;
        int a, b;
        sx_partition_units(q->rows, q->unit, share, q->nt, &a, &b);
        const int lo = a + __atomic_fetch_add(&q->claims[share], 1, __ATOMIC_RELAXED) * STEAL_ROWS;
        if (lo < b) {
            *r0 = lo;
            *r1 = lo + STEAL_ROWS < b ? lo + STEAL_ROWS : b;
            return 1;
        }
    }
    return 0;
}

/* Claim the next item of an item-list phase (attention): one counter shared by all. */
static int claim_item(sx_ctx *c, int phase) {
    return __atomic_fetch_add(&c->claims[(size_t)phase * c->nt], 1, __ATOMIC_RELAXED);
}

/* y = W @ act for n rows, then x[i][r] += y[i][r], over the rows this thread claims. */
static void project_add(sx_ctx *c, const sx_mat *w, int n, const sx_act *act, int phase, int t, int nt) {
    sx_claim q = claim_start(c, phase, w->rows, t, nt);
    int r0, r1;
    while (claim_next(&q, &r0, &r1)) {
        sx_gemm_rows(w, r0, r1, n, act, c->proj, w->rows, c->nrc);
        for (int i = 0; i < n; i++) {
            float *x = c->x + (size_t)i * c->m.hidden, *p = c->proj + (size_t)i * c->m.hidden;
            for (int r = r0; r < r1; r++) x[r] = x[r] + p[r];
        }
    }
}

static void norm_rows(const float *x, const float *w, int n, int d, float eps, float *out) {
    for (int i = 0; i < n; i++) sx_rmsnorm(x + (size_t)i * d, w, d, eps, out + (size_t)i * d);
}

/* Where position pos of KV head g of a sequence with block table `table` is, in elements from
 * the layer's cache base ([blocks, kv_heads, block_size, head_dim]). */
/* The byte offset of position pos of KV head g in a layer's cache (rows of sx_kv_row_bytes). */
static inline size_t kv_at(const sx_ctx *c, const int32_t *table, int g, int64_t pos) {
    const sx_model *m = &c->m;
    const size_t row = ((size_t)table[pos / c->bs] * m->n_kv_heads + g) * c->bs + (size_t)(pos % c->bs);
    return row * sx_kv_row_bytes(m->kv_type, m->head_dim);
}

/* A key or value row of d floats as the cache holds it (sx_kv_row_bytes of `out`), and back. */
static void kv_encode(int kind, const float *x, int d, void *out) {
    if (kind == SX_F16)
        for (int i = 0; i < d; i++) ((uint16_t *)out)[i] = sx_f2h(x[i]);
    else if (kind == SX_Q8_0)
        sx_quantize(SX_Q8_0, x, d, out);
    else
        memcpy(out, x, (size_t)d * 4);
}

static void kv_decode(int kind, const void *in, int d, float *out) {
    if (kind == SX_F16)
        for (int i = 0; i < d; i++) out[i] = sx_h2f(((const uint16_t *)in)[i]);
    else if (kind == SX_Q8_0)
        sx_dequantize(SX_Q8_0, in, d, out);
    else
        memcpy(out, in, (size_t)d * 4);
}

/* The new key of row s, KV head g: normalised and rotated into k (d floats). */
static const float *new_kv(const sx_ctx *c, const sx_layer *L, int s, int g, int64_t pos, float *k) {
    const sx_model *m = &c->m;
    const int d = m->head_dim;
    const float *row = c->qkv + (size_t)s * (c->q_out + 2 * c->kv_out);
    memcpy(k, row + c->q_out + (size_t)g * d, (size_t)d * 4);
    if (L->k_norm) sx_rmsnorm(k, L->k_norm, d, m->eps, k);
    sx_rope(k, m->rope_cos + pos * d, m->rope_sin + pos * d, d);
    return row + c->q_out + c->kv_out + (size_t)g * d; /* the new value */
}

static void attend_heads(const sx_ctx *c, const sx_layer *L, int s, const int32_t *table, int h0, int h1,
                         int64_t pos, const float *k, const float *vn, float *scores) {
    const sx_model *m = &c->m;
    const int d = m->head_dim, g = h0 / (m->n_heads / m->n_kv_heads);
    float *row = c->qkv + (size_t)s * (c->q_out + 2 * c->kv_out);
    const float *cs = m->rope_cos + pos * d, *sn = m->rope_sin + pos * d;
    const float scale = (float)(1.0 / sqrt((double)d));
    const size_t block = (size_t)m->n_kv_heads * c->bs * d, head = (size_t)g * c->bs * d;
    for (int h = h0; h < h1; h++) {
        float *q = row + (size_t)h * d;
        if (L->q_norm) sx_rmsnorm(q, L->q_norm, d, m->eps, q);
        sx_rope(q, cs, sn, d);
    }
    sx_attend_heads_paged(row + (size_t)h0 * d, h1 - h0, L->k_cache, L->v_cache, m->kv_type, table, c->bs, block, head,
                          (int)pos, k, vn, d, scale, scores, (size_t)m->max_len, c->attn + (size_t)s * c->q_out + (size_t)h0 * d);
}

/* Step 2: attention of query heads [h0, h1) of row s, all of one KV head g. Each item
 * rotates its KV head's new key itself (64 multiplies) and attends over the cache's [0, pos)
 * plus the new key and value held locally; only the item holding the group's first head
 * writes them into the cache at pos. So no item reads what another writes in this phase.
 * Items are whole groups (each key and value read once per step: attention is memory-bound
 * at large batch) unless that leaves threads idle (batch 1), then single heads. */
static void attention_item(const sx_ctx *c, const sx_layer *L, int s, const int32_t *table, int h0, int h1,
                           int64_t pos, float *scratch) {
    const sx_model *m = &c->m;
    const int d = m->head_dim, group = m->n_heads / m->n_kv_heads, g = h0 / group;
    float *k = scratch, *vn = k + d; /* the new key and value as the cache holds them */
    const float *v = new_kv(c, L, s, g, pos, k);
    const size_t at = kv_at(c, table, g, pos), rb = sx_kv_row_bytes(m->kv_type, d);
    /* Attend with the new key and value as they will be read back later: rounded to the
     * cache's type (d <= 512: a row is at most 2 KiB). */
    unsigned char ek[2048], ev[2048];
    kv_encode(m->kv_type, k, d, ek);
    kv_encode(m->kv_type, v, d, ev);
    kv_decode(m->kv_type, ek, d, k);
    kv_decode(m->kv_type, ev, d, vn);
    if (h0 % group == 0) {
        memcpy((char *)L->k_cache + at, ek, rb);
        memcpy((char *)L->v_cache + at, ev, rb);
    }
    attend_heads(c, L, s, table, h0, h1, pos, k, vn, scratch + 2 * d);
}

/* Step 2 when rows of one sequence share the step (a prompt chunk): first every row's key
 * and value go into the cache (2a), then, after a barrier, each row attends over the cache's
 * [0, pos] (2b), so row j sees rows < j of its own chunk. The new key and value are read back
 * as the cache holds them, which is what the one-phase path attends with: same numbers. */
static void store_kv(const sx_ctx *c, const sx_layer *L, int s, const int32_t *table, int g, int64_t pos, float *k) {
    const sx_model *m = &c->m;
    const int d = m->head_dim;
    const float *v = new_kv(c, L, s, g, pos, k);
    const size_t at = kv_at(c, table, g, pos);
    kv_encode(m->kv_type, k, d, (char *)L->k_cache + at);
    kv_encode(m->kv_type, v, d, (char *)L->v_cache + at);
}

static void attend_stored(const sx_ctx *c, const sx_layer *L, int s, const int32_t *table, int h0, int h1,
                          int64_t pos, float *scratch) {
    const sx_model *m = &c->m;
    const int d = m->head_dim, g = h0 / (m->n_heads / m->n_kv_heads);
    const size_t at = kv_at(c, table, g, pos);
    float *k = scratch, *vn = k + d;
    kv_decode(m->kv_type, (const char *)L->k_cache + at, d, k);
    kv_decode(m->kv_type, (const char *)L->v_cache + at, d, vn);
    attend_heads(c, L, s, table, h0, h1, pos, k, vn, scratch + 2 * d);
}

/* Checks a step's rows and sets c->row_table; returns 0 (one-phase attention), 1 (rows share
 * a sequence: two phases) or a negative error. Rows of one sequence must be adjacent, at
 * consecutive positions. */
static int check_rows(sx_ctx *c, int n, const int64_t *tokens, const int64_t *positions, const int64_t *seqs,
                      const int32_t *tables, int table_stride, int n_out, const int64_t *out_rows) {
    const sx_model *m = &c->m;
    if (n < 1 || n > c->max_batch || n_out < 0 || n_out > n) return -1;
    if (!tables && c->bs != m->max_len) return -4; /* no tables: a paged cache needs them */
    int shared = 0;
    for (int i = 0; i < n; i++) {
        if (positions[i] < 0 || positions[i] >= m->max_len) return -2;
        if (tokens[i] < 0 || tokens[i] >= m->vocab) return -3;
        const int64_t seq = seqs ? seqs[i] : i;
        if (seq < 0 || (!tables && seq >= m->n_slots)) return -4;
        const int32_t *table = tables ? tables + seq * (int64_t)table_stride : c->ident + seq;
        if (tables && positions[i] / c->bs >= table_stride) return -4;
        for (int64_t b = 0; b <= positions[i] / c->bs; b++)
            if (table[b] < 0 || table[b] >= m->n_slots) return -4;
        c->row_table[i] = table;
        if (i > 0 && seqs && seqs[i - 1] == seq) {
            if (positions[i] != positions[i - 1] + 1) return -5;
            shared = 1;
        } else {
            for (int j = 0; seqs && j < i - 1; j++)
                if (seqs[j] == seq) return -5;
        }
    }
    for (int j = 0; j < n_out; j++)
        if (out_rows[j] < 0 || out_rows[j] >= n) return -6;
    return shared;
}

int sx_step(sx_ctx *c, int n, const int64_t *tokens, const int64_t *positions, const int64_t *seqs,
            const int32_t *tables, int table_stride, int n_out, const int64_t *out_rows, float *logits) {
    const sx_model *m = &c->m;
    const uint64_t prof_in = sx_prof_now();
    const int two_phase = check_rows(c, n, tokens, positions, seqs, tables, table_stride, n_out, out_rows);
    if (two_phase < 0) return two_phase;
    /* The tokens' embedding rows, dequantized from the table as stored (F32 rows are copied). */
    const int64_t stride = m->embed_row_bytes ? m->embed_row_bytes : (int64_t)sx_row_bytes(m->embed_type, m->hidden);
    sx_dequantize_rows(m->embed_type, m->embed, stride, m->hidden, tokens, n, c->x);
    memset(c->claims, 0, (size_t)PHASES(m) * c->nt * sizeof(int));
#pragma omp parallel num_threads(c->nt)
    {
        const int t = sx_thread_num(), nt = sx_num_threads();
        SX_PROF_DECL;
        sx_scratch *ws = &c->ws[t < c->nt ? t : 0];
        sx_act act = {NULL, ws->blocks, ws->scales, ws->zq, ws->xsum, ws->hsum};
        int r0, r1;
        for (int l = 0; l < m->n_layers; l++) {
            const sx_layer *L = &m->layers[l];
            const int ph = l * PHASES_PER_LAYER;
            norm_rows(c->x, L->attn_norm, n, m->hidden, m->eps, ws->xn);
            sx_act_prepare(&L->qkv, ws->xn, n, &act);
            SX_PROF(c, t, l, SX_P_ATTN_PREP);
            sx_claim q = claim_start(c, ph, L->qkv.rows, t, nt);
            while (claim_next(&q, &r0, &r1)) sx_gemm_rows(&L->qkv, r0, r1, n, &act, c->qkv, L->qkv.rows, c->nrc);
            SX_PROF(c, t, l, SX_P_QKV);
#pragma omp barrier
            SX_PROF(c, t, l, SX_P_QKV_WAIT);
            const int per = n * m->n_kv_heads >= 2 * nt ? m->n_heads / m->n_kv_heads : 1;
            const int items_per_seq = m->n_heads / per;
            if (two_phase) {
                for (int item = claim_item(c, ph + 1); item < n * m->n_kv_heads; item = claim_item(c, ph + 1)) {
                    const int s = item / m->n_kv_heads;
                    store_kv(c, L, s, c->row_table[s], item % m->n_kv_heads, positions[s], ws->scores);
                }
#pragma omp barrier
                for (int item = claim_item(c, ph + 2); item < n * items_per_seq; item = claim_item(c, ph + 2)) {
                    const int s = item / items_per_seq, h0 = (item % items_per_seq) * per;
                    attend_stored(c, L, s, c->row_table[s], h0, h0 + per, positions[s], ws->scores);
                }
            } else {
                for (int item = claim_item(c, ph + 2); item < n * items_per_seq; item = claim_item(c, ph + 2)) {
                    const int s = item / items_per_seq, h0 = (item % items_per_seq) * per;
                    attention_item(c, L, s, c->row_table[s], h0, h0 + per, positions[s], ws->scores);
                }
            }
            SX_PROF(c, t, l, SX_P_ATTN);
#pragma omp barrier
            SX_PROF(c, t, l, SX_P_ATTN_WAIT);
            sx_act_prepare(&L->o, c->attn, n, &act);
            SX_PROF(c, t, l, SX_P_O_PREP);
            project_add(c, &L->o, n, &act, ph + 3, t, nt);
            SX_PROF(c, t, l, SX_P_O);
#pragma omp barrier
            SX_PROF(c, t, l, SX_P_O_WAIT);
            norm_rows(c->x, L->ffn_norm, n, m->hidden, m->eps, ws->xn);
            sx_act_prepare(&L->gate_up, ws->xn, n, &act);
            SX_PROF(c, t, l, SX_P_FFN_PREP);
            /* A quantized down_proj's activations are prepared here, chunk by chunk, each block
             * once (not by every thread after the barrier), from the chunk's gate and up rows
             * in a small per-thread buffer: at prefill the full [n, 2 inter] and [n, inter]
             * arrays are megabytes per layer, written and read back through DRAM. */
            const int down_q = sx_act_quantized(&L->down) && m->inter % QUANT_UNIT == 0;
            q = claim_start(c, ph + 4, m->inter, t, nt);
            if (down_q) q.unit = QUANT_UNIT;
            float *g = ws->gu, *u = ws->gu + (size_t)n * STEAL_ROWS;
            while (down_q && claim_next(&q, &r0, &r1)) {
                sx_gemm_rows_at(&L->gate_up, r0, r1, n, &act, g, STEAL_ROWS, r0, c->nrc);
                sx_gemm_rows_at(&L->gate_up, m->inter + r0, m->inter + r1, n, &act, u, STEAL_ROWS, m->inter + r0, c->nrc);
                for (int i = 0; i < n; i++) /* in place: h = silu(gate) * up */
                    sx_silu_mul(g + (size_t)i * STEAL_ROWS, u + (size_t)i * STEAL_ROWS, g + (size_t)i * STEAL_ROWS, r1 - r0);
                sx_act_prepare_cols(&L->down, g, STEAL_ROWS, 0, n, r0 / SX_QK, r1 / SX_QK, &c->down_act);
            }
            while (!down_q && claim_next(&q, &r0, &r1)) { /* F32/F16 down_proj reads h itself */
                sx_gemm_rows(&L->gate_up, r0, r1, n, &act, c->gu, 2 * m->inter, c->nrc);
                sx_gemm_rows(&L->gate_up, m->inter + r0, m->inter + r1, n, &act, c->gu, 2 * m->inter, c->nrc);
                for (int i = 0; i < n; i++) {
                    const float *gu = c->gu + (size_t)i * 2 * m->inter;
                    sx_silu_mul(gu + r0, gu + m->inter + r0, c->h + (size_t)i * m->inter + r0, r1 - r0);
                }
            }
            SX_PROF(c, t, l, SX_P_GATE_UP);
#pragma omp barrier
            SX_PROF(c, t, l, SX_P_GU_WAIT);
            const sx_act *down_act = &c->down_act;
            if (!down_q) {
                sx_act_prepare(&L->down, c->h, n, &act);
                down_act = &act;
            }
            SX_PROF(c, t, l, SX_P_DOWN_PREP);
            project_add(c, &L->down, n, down_act, ph + 5, t, nt);
            SX_PROF(c, t, l, SX_P_DOWN);
#pragma omp barrier
            SX_PROF(c, t, l, SX_P_DOWN_WAIT);
        }
        /* Only the rows that are sampled need the final norm and the LM head. */
        for (int j = 0; j < n_out; j++)
            sx_rmsnorm(c->x + (size_t)out_rows[j] * m->hidden, m->final_norm, m->hidden, m->eps,
                       ws->xn + (size_t)j * m->hidden);
        if (n_out > 0) {
            sx_act_prepare(&m->lm_head, ws->xn, n_out, &act);
            SX_PROF(c, t, m->n_layers, SX_P_HEAD_PREP);
            sx_claim q = claim_start(c, m->n_layers * PHASES_PER_LAYER, m->vocab, t, nt);
            while (claim_next(&q, &r0, &r1)) sx_gemm_rows(&m->lm_head, r0, r1, n_out, &act, logits, m->vocab, c->nrc);
            SX_PROF(c, t, m->n_layers, SX_P_HEAD);
        }
        SX_PROF_BARRIER;
        SX_PROF(c, t, m->n_layers, SX_P_END_WAIT);
    }
    if (c->prof) { /* thread 0's row after the last layer's */
        c->prof[(size_t)m->n_layers * SX_PROF_STRIDE + SX_P_TOTAL] += sx_prof_now() - prof_in;
        c->prof[(size_t)m->n_layers * SX_PROF_STRIDE + SX_P_STEPS] += 1;
    }
    return 0;
}

int sx_prof_read(sx_ctx *c, uint64_t *out, int reset) {
    if (!c->prof) return -1;
    const size_t rows = (size_t)c->nt * (c->m.n_layers + 1);
    for (size_t i = 0; i < rows; i++)
        for (int k = 0; k < SX_PROF_N; k++) out[i * SX_PROF_N + k] = c->prof[i * SX_PROF_STRIDE + k];
    if (reset) memset(c->prof, 0, rows * SX_PROF_STRIDE * sizeof(uint64_t));
    return c->nt;
}

uint64_t sx_prof_tsc(void) { return sx_prof_now(); }

int sx_decode(sx_ctx *c, int n, const int64_t *tokens, const int64_t *positions, float *logits) {
    if (n > c->m.n_slots) return -1;
    int64_t rows[n > 0 ? n : 1];
    for (int i = 0; i < n; i++) rows[i] = i;
    return sx_step(c, n, tokens, positions, NULL, NULL, 0, n, rows, logits);
}

void sx_place_kv(void *k, void *v, int n_layers, int n_blocks, int n_kv_heads, int block_size, int head_dim,
                 int elem_bytes, int n_threads) {
    /* Zero the caches, blocks spread over the threads (a block is written by whichever thread
     * runs its sequence's attention: there is no better owner to first-touch it). */
    const size_t per = (size_t)n_kv_heads * block_size * head_dim * elem_bytes;
#pragma omp parallel num_threads(n_threads < 1 ? 1 : n_threads)
    {
        const int t = sx_thread_num(), nt = sx_num_threads();
        for (int l = 0; l < n_layers; l++)
            for (int b = t; b < n_blocks; b += nt) {
                const size_t off = ((size_t)l * n_blocks + b) * per;
                memset((char *)k + off, 0, per);
                memset((char *)v + off, 0, per);
            }
    }
}
