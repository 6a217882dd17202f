/* Per-thread clocks around each op class of the fused step, compiled in only with -DSX_PROFILE
 * (build.py's "profile" variant, bench/step_profile.py); the engine's build has none of it.
 * Each thread adds the TSC ticks since its previous mark to its own row of SX_PROF_N counters
 * per layer (the LM head and the totals: a row after the last layer's), rows 256 bytes apart
 * (no false sharing). A "wait" class is the time from a thread's last
 * mark to its leaving the barrier: load imbalance plus the barrier itself. */
#ifndef SX_PROF_H
#define SX_PROF_H
#include <stdint.h>

enum {
    SX_P_ATTN_PREP,  /* attn norm + activation quantization for qkv */
    SX_P_QKV,        /* qkv GEMV */
    SX_P_QKV_WAIT,   /* barrier after qkv */
    SX_P_ATTN,       /* q/k norm, rope, KV store, attention */
    SX_P_ATTN_WAIT,  /* barrier(s) after attention */
    SX_P_O_PREP,     /* activation quantization for o */
    SX_P_O,          /* o GEMV + residual add */
    SX_P_O_WAIT,     /* barrier after o */
    SX_P_FFN_PREP,   /* ffn norm + activation quantization for gate/up */
    SX_P_GATE_UP,    /* gate/up GEMV + silu * up */
    SX_P_GU_WAIT,    /* barrier after gate/up */
    SX_P_DOWN_PREP,  /* activation quantization for down */
    SX_P_DOWN,       /* down GEMV + residual add */
    SX_P_DOWN_WAIT,  /* barrier after down */
    SX_P_HEAD_PREP,  /* final norm + activation quantization for the LM head */
    SX_P_HEAD,       /* LM head GEMV */
    SX_P_END_WAIT,   /* the barrier closing the parallel region */
    SX_P_TOTAL,      /* thread 0's last row only: the whole sx_step call, row checks, embedding rows,
                        fork and join included */
    SX_P_STEPS,      /* thread 0's last row only: steps counted */
    SX_PROF_N
};
#define SX_PROF_STRIDE 32 /* counters per thread row (256 bytes) */

#ifdef SX_PROFILE
#include <x86intrin.h>
static inline uint64_t sx_prof_now(void) { return __rdtsc(); }
#define SX_PROF_DECL uint64_t prof_t_ = __rdtsc()
#define SX_PROF(c, t, l, k)                                                                          \
    do {                                                                                             \
        const uint64_t now_ = __rdtsc();                                                             \
        (c)->prof[((size_t)(t) * ((c)->m.n_layers + 1) + (l)) * SX_PROF_STRIDE + (k)] += now_ - prof_t_; \
        prof_t_ = now_;                                                                              \
    } while (0)
#define SX_PROF_BARRIER _Pragma("omp barrier")
#else
static inline uint64_t sx_prof_now(void) { return 0; }
#define SX_PROF_DECL
#define SX_PROF(c, t, l, k)
#define SX_PROF_BARRIER
#endif
#endif
