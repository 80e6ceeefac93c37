/*
 * fa_plan.h -- everything about dispatching llama.cpp's Metal flash-attention vec kernel that needs
 * no Metal: the kernel argument structs (byte-for-byte the layout the pinned metallib expects), the
 * function-constant tables, the dispatch geometry, the scratch sizing and the bounds each kernel reads.
 *
 * Plain C11.  gcc compiles it on Linux (make check-plan; tests/test_metal_pinned.py); bridge.m links
 * the same object on macOS, so the numbers the tests check are the numbers the bridge dispatches.
 *
 * Facts come from ggml v0.15.3 (commit eced84c86f8b012c752c016f7fe789adea168e1e):
 *   src/ggml-metal/ggml-metal-impl.h     struct layouts, FC_* offsets, OP_FLASH_ATTN_EXT_VEC_NCPSG
 *   src/ggml-metal/ggml-metal-ops.cpp    ggml_metal_op_flash_attn_ext (vec branch), extra_pad/_tmp
 *   src/ggml-metal/ggml-metal-device.cpp pipeline names and which constant goes to which index
 *   src/ggml-metal/ggml-metal.metal      kernel_flash_attn_ext_{pad,vec,vec_reduce}
 * This is an independent implementation written from those facts, not a copy of ggml code.
 *
 * Scope: one decode query (n_q = 1), one sequence, f16 K/V, DK = DV = 128, f32 Q and output, no
 * ALiBi, no softcap, no sinks; an optional f16 mask row broadcast over heads.
 */
#ifndef MUSER_METAL_PINNED_FA_PLAN_H
#define MUSER_METAL_PINNED_FA_PLAN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MP_ABI_VERSION 1

/* The ggml this is pinned to. */
#define MP_GGML_TAG    "v0.15.3"
#define MP_GGML_COMMIT "eced84c86f8b012c752c016f7fe789adea168e1e"

/* ------------------------------------------------------------------------------------------------
 * Kernel argument structs.  Field order and types follow ggml-metal-impl.h (v0.15.3); the layout is
 * natural C alignment, which is also what the Metal compiler uses for these scalar members.  The
 * static asserts below pin every offset, so a mistake here fails the build instead of the GPU.
 * ---------------------------------------------------------------------------------------------- */

/* ggml_metal_kargs_flash_attn_ext_vec */
typedef struct mp_kargs_fa_vec {
    int32_t  ne01;          /* number of queries (1 for decode)            */
    int32_t  ne02;          /* number of query heads                       */
    int32_t  ne03;          /* number of sequences (1)                     */
    uint64_t nb01;          /* Q byte strides                              */
    uint64_t nb02;
    uint64_t nb03;
    int32_t  ne11;          /* number of KV rows attended (visible)        */
    int32_t  ne_12_2;       /* number of KV heads (K and V share a shape)  */
    int32_t  ne_12_3;       /* number of KV sequences (1)                  */
    int32_t  ns10;          /* K row stride in elements                    */
    uint64_t nb11;          /* K byte strides: row, head, sequence         */
    uint64_t nb12;
    uint64_t nb13;
    int32_t  ns20;          /* V row stride in elements                    */
    uint64_t nb21;          /* V byte strides                              */
    uint64_t nb22;
    uint64_t nb23;
    int32_t  ne31;          /* mask rows, mask head broadcast, mask seqs   */
    int32_t  ne32;
    int32_t  ne33;
    uint64_t nb31;          /* mask byte strides                           */
    uint64_t nb32;
    uint64_t nb33;
    int32_t  ne1;           /* dst: n_head, n_q, n_seq (dst is permuted)   */
    int32_t  ne2;
    int32_t  ne3;
    float    scale;
    float    max_bias;
    float    m0;
    float    m1;
    int32_t  n_head_log2;
    float    logit_softcap;
} mp_kargs_fa_vec;

/* ggml_metal_kargs_flash_attn_ext_pad */
typedef struct mp_kargs_fa_pad {
    int32_t  ne11;
    int32_t  ne_12_2;
    int32_t  ne_12_3;
    uint64_t nb11;
    uint64_t nb12;
    uint64_t nb13;
    uint64_t nb21;
    uint64_t nb22;
    uint64_t nb23;
    int32_t  ne31;
    int32_t  ne32;
    int32_t  ne33;
    uint64_t nb31;
    uint64_t nb32;
    uint64_t nb33;
} mp_kargs_fa_pad;

/* ggml_metal_kargs_flash_attn_ext_vec_reduce */
typedef struct mp_kargs_fa_vec_reduce {
    int32_t nrows;
} mp_kargs_fa_vec_reduce;

#if defined(__cplusplus)
#define MP_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define MP_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif

MP_STATIC_ASSERT(sizeof(mp_kargs_fa_vec) == 192, "fa_vec args must be 192 bytes");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne01) == 0, "ne01");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne02) == 4, "ne02");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne03) == 8, "ne03");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb01) == 16, "nb01");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb02) == 24, "nb02");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb03) == 32, "nb03");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne11) == 40, "ne11");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne_12_2) == 44, "ne_12_2");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne_12_3) == 48, "ne_12_3");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ns10) == 52, "ns10");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb11) == 56, "nb11");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb12) == 64, "nb12");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb13) == 72, "nb13");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ns20) == 80, "ns20");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb21) == 88, "nb21");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb22) == 96, "nb22");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb23) == 104, "nb23");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne31) == 112, "ne31");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne32) == 116, "ne32");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne33) == 120, "ne33");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb31) == 128, "nb31");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb32) == 136, "nb32");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, nb33) == 144, "nb33");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne1) == 152, "ne1");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne2) == 156, "ne2");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, ne3) == 160, "ne3");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, scale) == 164, "scale");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, max_bias) == 168, "max_bias");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, m0) == 172, "m0");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, m1) == 176, "m1");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, n_head_log2) == 180, "n_head_log2");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec, logit_softcap) == 184, "logit_softcap");

MP_STATIC_ASSERT(sizeof(mp_kargs_fa_pad) == 104, "fa_pad args must be 104 bytes");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, ne11) == 0, "pad.ne11");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, ne_12_2) == 4, "pad.ne_12_2");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, ne_12_3) == 8, "pad.ne_12_3");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, nb11) == 16, "pad.nb11");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, nb12) == 24, "pad.nb12");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, nb13) == 32, "pad.nb13");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, nb21) == 40, "pad.nb21");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, nb22) == 48, "pad.nb22");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, nb23) == 56, "pad.nb23");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, ne31) == 64, "pad.ne31");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, ne32) == 68, "pad.ne32");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, ne33) == 72, "pad.ne33");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, nb31) == 80, "pad.nb31");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, nb32) == 88, "pad.nb32");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_pad, nb33) == 96, "pad.nb33");

MP_STATIC_ASSERT(sizeof(mp_kargs_fa_vec_reduce) == 4, "fa_vec_reduce args must be 4 bytes");
MP_STATIC_ASSERT(offsetof(mp_kargs_fa_vec_reduce, nrows) == 0, "reduce.nrows");

/* ------------------------------------------------------------------------------------------------
 * Kernel names, function constants, fixed launch parameters
 * ---------------------------------------------------------------------------------------------- */

#define MP_KERNEL_FA_VEC        "kernel_flash_attn_ext_vec_f16_dk128_dv128"
#define MP_KERNEL_FA_PAD        "kernel_flash_attn_ext_pad"
#define MP_KERNEL_FA_VEC_REDUCE "kernel_flash_attn_ext_vec_reduce"

#define MP_FC_FA_PAD        100   /* +0 bool has_mask, +25 int32 ncpsg                          */
#define MP_FC_FA_VEC        400   /* +0..+4 bool mask/sinks/bias/scap/kvpad, +20..+23 int32     */
#define MP_FC_FA_VEC_REDUCE 500   /* +0 int32 DV, +1 int32 NWG                                  */

#define MP_FA_DK     128
#define MP_FA_DV     128
#define MP_FA_NCPSG  32           /* OP_FLASH_ATTN_EXT_VEC_NCPSG: KV rows per simdgroup chunk   */
#define MP_FA_NWG    32           /* workgroups per head; the reduce needs exactly 32 (SIMD width) */
#define MP_FA_NSG_MAX 4
#define MP_FA_GGML_PAD_NCPSG 64   /* OP_FLASH_ATTN_EXT_NCPSG: what ggml reserves the pad for     */

typedef enum { MP_FC_BOOL = 1, MP_FC_INT32 = 2 } mp_fc_type;

typedef struct mp_fc_value {
    int32_t index;     /* [[function_constant(index)]]                */
    int32_t type;      /* mp_fc_type                                  */
    int32_t value;     /* 0/1 for bools                               */
    const char *name;  /* for messages and pipeline cache keys        */
} mp_fc_value;

#define MP_FA_VEC_N_CONSTANTS    9
#define MP_FA_PAD_N_CONSTANTS    2
#define MP_FA_REDUCE_N_CONSTANTS 2

/* ------------------------------------------------------------------------------------------------
 * The problem: one decode token of one layer.
 * K/V are f16 planes addressed as row r of kv head h at  base + r*row_stride*2 + h*head_stride.
 *   head-major (NoPE) plane:  row_stride = head_dim (128),  head_stride = capacity*head_dim*2
 *   token-major (SWA) ring:   row_stride = n_kv_heads*head_dim (256), head_stride = head_dim*2
 * Q is f32 [n_heads][head_dim], the output f32 [n_heads][head_dim], both contiguous.
 * ---------------------------------------------------------------------------------------------- */
typedef struct mp_fa_problem {
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;       /* must be 128: the pinned pipeline is dk128_dv128              */
    int32_t visible;        /* KV rows attended, >= 1                                       */
    int32_t k_row_stride;   /* elements (halves) between consecutive K rows -> ns10        */
    int32_t v_row_stride;   /* elements between consecutive V rows -> ns20                 */
    int64_t k_head_stride;  /* bytes between KV heads in K -> nb12                          */
    int64_t v_head_stride;  /* bytes between KV heads in V -> nb22                          */
    float   scale;          /* attention scale, e.g. 1/sqrt(head_dim)                       */
    int32_t has_mask;       /* 1: an f16 row of `visible` entries is added to every head's  */
                            /*    scores (the serving graph's -inf padding); 0: no mask     */
} mp_fa_problem;

MP_STATIC_ASSERT(sizeof(mp_fa_problem) == 48, "mp_fa_problem layout is part of the ABI");
MP_STATIC_ASSERT(offsetof(mp_fa_problem, k_head_stride) == 24, "mp_fa_problem.k_head_stride");
MP_STATIC_ASSERT(offsetof(mp_fa_problem, scale) == 40, "mp_fa_problem.scale");
MP_STATIC_ASSERT(offsetof(mp_fa_problem, has_mask) == 44, "mp_fa_problem.has_mask");

typedef struct mp_fa_plan {
    mp_kargs_fa_vec        vec;
    mp_kargs_fa_pad        pad;
    mp_kargs_fa_vec_reduce reduce;

    int32_t nwg, nsg, ncpsg;
    int32_t has_mask, has_sinks, has_bias, has_scap, has_kvpad;

    uint32_t vec_groups[3], vec_threads[3];        /* threadgroups, threads per threadgroup   */
    uint32_t pad_groups[3], pad_threads[3];        /* only dispatched when has_kvpad          */
    uint32_t reduce_groups[3], reduce_threads[3];
    uint64_t vec_smem_bytes;                       /* threadgroup memory, index 0             */

    uint64_t q_bytes;          /* Q bytes read                                                  */
    uint64_t out_bytes;        /* output bytes written                                          */
    uint64_t mask_bytes;       /* mask bytes read (0 without a mask)                            */
    uint64_t k_extent;         /* bytes past the K base that any kernel reads (see note below)  */
    uint64_t v_extent;
    uint64_t pad_bytes;        /* pad buffer bytes the pad kernel writes and the vec kernel reads */
    uint64_t pad_bytes_ggml;   /* what ggml reserves for it (ncpsg 64, always)                  */
    uint64_t tmp_bytes;        /* per-workgroup partials: nrows*nwg*(DV+2) floats               */
    uint64_t tmp_bytes_ggml;   /* what ggml reserves: 4*min(ne01,32)*ne02*ne03*32*(DV+2)        */
} mp_fa_plan;
/* Note on k_extent: the vec kernel reads head_dim halves of each row, but the pad kernel copies
 * the whole row stride (nb11 bytes) of each tail row starting at the head's offset.  On a
 * token-major ring that reaches n_kv_heads-1 heads past the last row's start: the over-read the
 * chapter's SWA len % 32 predicate avoids.  The bridge refuses a dispatch whose extent runs past
 * the end of the buffer rather than let the GPU read foreign memory. */

/* nsg for nwg workgroups over n_kv rows: 1, doubled while 2*nwg*nsg*ncpsg < n_kv and nsg < 4. */
int32_t mp_fa_nsg(int32_t nwg, int32_t n_kv);

/* Threadgroup memory of the vec kernel in bytes:
 * GGML_PAD((GGML_PAD(dk,128) + 4*ncpsg + 2*GGML_PAD(dv,128)) * nsg * 2, 16). */
uint64_t mp_fa_vec_smem_bytes(int32_t dk, int32_t dv, int32_t ncpsg, int32_t nsg);

/* Fill a plan.  Returns 0, or -1 with a message in err (never aborts). */
int mp_fa_make_plan(const mp_fa_problem *p, mp_fa_plan *out, char *err, size_t errlen);

/* Function-constant tables for the three pipelines of a plan (out must hold N_CONSTANTS entries).
 * Return the number of entries written. */
int mp_fa_vec_constants(const mp_fa_plan *plan, mp_fc_value *out);
int mp_fa_pad_constants(const mp_fa_plan *plan, mp_fc_value *out);
int mp_fa_reduce_constants(const mp_fa_plan *plan, mp_fc_value *out);

/* A pipeline-cache key naming every constant, e.g.
 * "kernel_flash_attn_ext_vec_f16_dk128_dv128_mask=0_sink=0_bias=0_scap=0_kvpad=1_ns10=256_ns20=256_nsg=2_nwg=32".
 * Returns the length written (truncated to keylen-1), like snprintf. */
int mp_fa_pipeline_key(const char *kernel, const mp_fc_value *c, int n, char *key, size_t keylen);

/* Introspection for tests and for the Python ctypes mirrors. */
int     mp_abi_version(void);
const char *mp_ggml_tag(void);
const char *mp_ggml_commit(void);
int64_t mp_struct_sizeof(const char *struct_name);                 /* -1 if unknown */
int64_t mp_struct_offsetof(const char *struct_name, const char *field); /* -1 if unknown */

#ifdef __cplusplus
}
#endif

#endif /* MUSER_METAL_PINNED_FA_PLAN_H */
