/*
 * fa_plan.c -- argument structs, geometry and sizing for llama.cpp's Metal flash-attention vec kernel
 * (ggml v0.15.3), in plain C.  See fa_plan.h for what each value means and where the facts come from.
 */
#include "fa_plan.h"
#include "mp_pin.h" /* mp_set_error */
#include "mp_bridge.h" /* only for the mp_attend_desc layout (introspection below) */

#include <math.h>
#include <stdio.h>
#include <string.h>

#define MP_PAD(x, n) ((((x) + (n) - 1) / (n)) * (n))

int32_t mp_fa_nsg(int32_t nwg, int32_t n_kv) {
    int64_t nsg = 1;
    while (2 * (int64_t)nwg * nsg * MP_FA_NCPSG < (int64_t)n_kv && nsg < MP_FA_NSG_MAX) {
        nsg *= 2;
    }
    return (int32_t)nsg;
}

uint64_t mp_fa_vec_smem_bytes(int32_t dk, int32_t dv, int32_t ncpsg, int32_t nsg) {
    /* per simdgroup: Q as half (padded to 128), 4*C halves of scores+mask scratch, and the f32
     * output accumulator (2 halves per float, padded to 128); 2 bytes per half; 16-byte aligned */
    const uint64_t halves = (uint64_t)MP_PAD(dk, 128) + 4u * (uint64_t)ncpsg + 2u * (uint64_t)MP_PAD(dv, 128);
    return MP_PAD(halves * (uint64_t)nsg * 2u, 16u);
}

static int32_t floor_pow2(int32_t n) {
    int32_t r = 1;
    while (r <= n / 2) {
        r *= 2;
    }
    return r;
}

static uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

int mp_fa_make_plan(const mp_fa_problem *p, mp_fa_plan *out, char *err, size_t errlen) {
    if (!p || !out) {
        return mp_set_error(err, errlen, "mp_fa_make_plan: NULL problem or plan");
    }
    memset(out, 0, sizeof(*out));

    if (p->head_dim != MP_FA_DK) {
        return mp_set_error(err, errlen, "head_dim %d: the pinned pipeline is %s (head_dim 128 only)",
                    p->head_dim, MP_KERNEL_FA_VEC);
    }
    if (p->n_heads < 1 || p->n_kv_heads < 1) {
        return mp_set_error(err, errlen, "n_heads %d / n_kv_heads %d: both must be >= 1", p->n_heads, p->n_kv_heads);
    }
    if (p->n_heads % p->n_kv_heads != 0) {
        return mp_set_error(err, errlen, "n_heads %d is not a multiple of n_kv_heads %d (GQA needs whole groups)",
                    p->n_heads, p->n_kv_heads);
    }
    if (p->n_heads > 65535 || p->n_kv_heads > 65535) {
        return mp_set_error(err, errlen, "n_heads %d / n_kv_heads %d: the kernel indexes heads with 16-bit ids",
                    p->n_heads, p->n_kv_heads);
    }
    if (p->visible < 1) {
        return mp_set_error(err, errlen, "visible %d: at least one KV row must be attended", p->visible);
    }
    if (p->k_row_stride < p->head_dim || p->v_row_stride < p->head_dim) {
        return mp_set_error(err, errlen, "row strides k %d / v %d elements: each must be >= head_dim %d",
                    p->k_row_stride, p->v_row_stride, p->head_dim);
    }
    if (p->k_row_stride % 4 != 0 || p->v_row_stride % 4 != 0) {
        return mp_set_error(err, errlen, "row strides k %d / v %d elements: the kernel loads half4, so each must be a multiple of 4",
                    p->k_row_stride, p->v_row_stride);
    }
    if (p->k_head_stride < 0 || p->v_head_stride < 0 || p->k_head_stride % 8 != 0 || p->v_head_stride % 8 != 0) {
        return mp_set_error(err, errlen, "head strides k %lld / v %lld bytes: each must be >= 0 and a multiple of 8 (half4 alignment)",
                    (long long)p->k_head_stride, (long long)p->v_head_stride);
    }
    if (!isfinite(p->scale) || p->scale == 0.0f) {
        return mp_set_error(err, errlen, "scale %g: must be finite and non-zero", (double)p->scale);
    }
    if (p->has_mask != 0 && p->has_mask != 1) {
        return mp_set_error(err, errlen, "has_mask %d: must be 0 or 1", p->has_mask);
    }

    const int32_t nq = 1, nseq = 1;
    const int32_t dk = p->head_dim, dv = p->head_dim;
    const uint64_t nb11 = 2u * (uint64_t)p->k_row_stride;
    const uint64_t nb21 = 2u * (uint64_t)p->v_row_stride;
    const uint64_t nb12 = (uint64_t)p->k_head_stride;
    const uint64_t nb22 = (uint64_t)p->v_head_stride;
    /* one sequence: nb13/nb23 are never multiplied by a non-zero index; give them the view's span */
    const uint64_t nb13 = max_u64(nb11 * (uint64_t)p->visible, nb12 * (uint64_t)p->n_kv_heads);
    const uint64_t nb23 = max_u64(nb21 * (uint64_t)p->visible, nb22 * (uint64_t)p->n_kv_heads);

    /* mask: one f16 row of `visible` entries, broadcast over heads (ne32 = 1) and the sequence.
     * Without a mask ggml passes zeros here; we pass 1s so the kernel's unused (iq2 % ne32) mask
     * address is not a modulo by zero.  The mask pointer is never dereferenced when has_mask = 0. */
    const int32_t ne31 = 1, ne32 = 1, ne33 = 1;
    const uint64_t nb31 = p->has_mask ? 2u * (uint64_t)p->visible : 0;
    const uint64_t nb32 = nb31 * (uint64_t)ne31;
    const uint64_t nb33 = nb32 * (uint64_t)ne32;

    /* Q: f32 [n_heads][head_dim] seen as ggml's permuted [DK, n_q, n_head, n_seq] */
    const uint64_t nb02 = 4u * (uint64_t)dk;
    const uint64_t nb01 = nb02 * (uint64_t)p->n_heads;
    const uint64_t nb03 = nb01 * (uint64_t)nq;

    out->nwg = MP_FA_NWG;
    out->nsg = mp_fa_nsg(MP_FA_NWG, p->visible);
    out->ncpsg = MP_FA_NCPSG;
    out->has_mask = p->has_mask;
    out->has_sinks = 0;
    out->has_bias = 0;
    out->has_scap = 0;
    out->has_kvpad = (p->visible % MP_FA_NCPSG) != 0;

    const int32_t n_head_log2 = floor_pow2(p->n_heads);
    const float max_bias = 0.0f;
    mp_kargs_fa_vec *a = &out->vec;
    a->ne01 = nq;
    a->ne02 = p->n_heads;
    a->ne03 = nseq;
    a->nb01 = nb01;
    a->nb02 = nb02;
    a->nb03 = nb03;
    a->ne11 = p->visible;
    a->ne_12_2 = p->n_kv_heads;
    a->ne_12_3 = nseq;
    a->ns10 = p->k_row_stride;
    a->nb11 = nb11;
    a->nb12 = nb12;
    a->nb13 = nb13;
    a->ns20 = p->v_row_stride;
    a->nb21 = nb21;
    a->nb22 = nb22;
    a->nb23 = nb23;
    a->ne31 = ne31;
    a->ne32 = ne32;
    a->ne33 = ne33;
    a->nb31 = nb31;
    a->nb32 = nb32;
    a->nb33 = nb33;
    a->ne1 = p->n_heads;   /* dst is [DV, n_head, n_q, n_seq] */
    a->ne2 = nq;
    a->ne3 = nseq;
    a->scale = p->scale;   /* no softcap, so no scale /= softcap */
    a->max_bias = max_bias;
    a->m0 = powf(2.0f, -(max_bias) / (float)n_head_log2);
    a->m1 = powf(2.0f, -(max_bias / 2.0f) / (float)n_head_log2);
    a->n_head_log2 = n_head_log2;
    a->logit_softcap = 0.0f;

    mp_kargs_fa_pad *q = &out->pad;
    q->ne11 = p->visible;
    q->ne_12_2 = p->n_kv_heads;
    q->ne_12_3 = nseq;
    q->nb11 = nb11;
    q->nb12 = nb12;
    q->nb13 = nb13;
    q->nb21 = nb21;
    q->nb22 = nb22;
    q->nb23 = nb23;
    q->ne31 = ne31;
    q->ne32 = ne32;
    q->ne33 = ne33;
    q->nb31 = nb31;
    q->nb32 = nb32;
    q->nb33 = nb33;

    const int32_t nrows = a->ne1 * a->ne2 * a->ne3;
    out->reduce.nrows = nrows;

    /* vec: one threadgroup per (query, head, sequence*workgroup); 32 lanes x nsg simdgroups */
    out->vec_groups[0] = (uint32_t)nq;
    out->vec_groups[1] = (uint32_t)p->n_heads;
    out->vec_groups[2] = (uint32_t)(nseq * out->nwg);
    out->vec_threads[0] = 32;
    out->vec_threads[1] = (uint32_t)out->nsg;
    out->vec_threads[2] = 1;
    out->vec_smem_bytes = mp_fa_vec_smem_bytes(dk, dv, out->ncpsg, out->nsg);

    /* pad: one threadgroup per tail row slot (C of them) and KV head, 32 threads */
    out->pad_groups[0] = (uint32_t)out->ncpsg;
    out->pad_groups[1] = (uint32_t)(p->n_kv_heads > ne32 ? p->n_kv_heads : ne32);
    out->pad_groups[2] = (uint32_t)(nseq > ne33 ? nseq : ne33);
    out->pad_threads[0] = 32;
    out->pad_threads[1] = 1;
    out->pad_threads[2] = 1;

    /* reduce: one threadgroup per output row, 32*nwg threads (lane = workgroup) */
    out->reduce_groups[0] = (uint32_t)nrows;
    out->reduce_groups[1] = 1;
    out->reduce_groups[2] = 1;
    out->reduce_threads[0] = (uint32_t)(32 * out->nwg);
    out->reduce_threads[1] = 1;
    out->reduce_threads[2] = 1;

    out->q_bytes = 4u * (uint64_t)p->n_heads * (uint64_t)dk;
    out->out_bytes = 4u * (uint64_t)nrows * (uint64_t)dv;
    out->mask_bytes = p->has_mask ? 2u * (uint64_t)p->visible : 0;

    const uint64_t last_row = (uint64_t)(p->visible - 1);
    const uint64_t last_head = (uint64_t)(p->n_kv_heads - 1);
    out->k_extent = last_row * nb11 + last_head * nb12 + 2u * (uint64_t)dk;
    out->v_extent = last_row * nb21 + last_head * nb22 + 2u * (uint64_t)dv;
    if (out->has_kvpad) { /* the pad kernel copies whole row strides */
        out->k_extent = max_u64(out->k_extent, last_row * nb11 + last_head * nb12 + nb11);
        out->v_extent = max_u64(out->v_extent, last_row * nb21 + last_head * nb22 + nb21);
    }

    const uint64_t C = (uint64_t)out->ncpsg;
    const uint64_t kvh = (uint64_t)p->n_kv_heads * (uint64_t)nseq;
    const uint64_t mrows = (uint64_t)ne31 * (uint64_t)ne32 * (uint64_t)ne33;
    out->pad_bytes = C * (nb11 * kvh + nb21 * kvh + (p->has_mask ? 2u * mrows : 0));
    out->pad_bytes_ggml = (uint64_t)MP_FA_GGML_PAD_NCPSG * (nb11 * kvh + nb21 * kvh + (p->has_mask ? 2u * mrows : 0));
    out->tmp_bytes = 4u * (uint64_t)nrows * (uint64_t)out->nwg * (uint64_t)(dv + 2);
    out->tmp_bytes_ggml = 4u * (uint64_t)(nq < 32 ? nq : 32) * (uint64_t)p->n_heads * (uint64_t)nseq * 32u * (uint64_t)(dv + 2);
    return 0;
}

static void fc(mp_fc_value *v, int32_t index, int32_t type, int32_t value, const char *name) {
    v->index = index;
    v->type = type;
    v->value = value;
    v->name = name;
}

int mp_fa_vec_constants(const mp_fa_plan *plan, mp_fc_value *out) {
    fc(&out[0], MP_FC_FA_VEC + 0, MP_FC_BOOL, plan->has_mask, "mask");
    fc(&out[1], MP_FC_FA_VEC + 1, MP_FC_BOOL, plan->has_sinks, "sink");
    fc(&out[2], MP_FC_FA_VEC + 2, MP_FC_BOOL, plan->has_bias, "bias");
    fc(&out[3], MP_FC_FA_VEC + 3, MP_FC_BOOL, plan->has_scap, "scap");
    fc(&out[4], MP_FC_FA_VEC + 4, MP_FC_BOOL, plan->has_kvpad, "kvpad");
    fc(&out[5], MP_FC_FA_VEC + 20, MP_FC_INT32, plan->vec.ns10, "ns10");
    fc(&out[6], MP_FC_FA_VEC + 21, MP_FC_INT32, plan->vec.ns20, "ns20");
    fc(&out[7], MP_FC_FA_VEC + 22, MP_FC_INT32, plan->nsg, "nsg");
    fc(&out[8], MP_FC_FA_VEC + 23, MP_FC_INT32, plan->nwg, "nwg");
    return MP_FA_VEC_N_CONSTANTS;
}

int mp_fa_pad_constants(const mp_fa_plan *plan, mp_fc_value *out) {
    fc(&out[0], MP_FC_FA_PAD + 0, MP_FC_BOOL, plan->has_mask, "mask");
    fc(&out[1], MP_FC_FA_PAD + 25, MP_FC_INT32, plan->ncpsg, "ncpsg");
    return MP_FA_PAD_N_CONSTANTS;
}

int mp_fa_reduce_constants(const mp_fa_plan *plan, mp_fc_value *out) {
    fc(&out[0], MP_FC_FA_VEC_REDUCE + 0, MP_FC_INT32, MP_FA_DV, "dv");
    fc(&out[1], MP_FC_FA_VEC_REDUCE + 1, MP_FC_INT32, plan->nwg, "nwg");
    return MP_FA_REDUCE_N_CONSTANTS;
}

int mp_fa_pipeline_key(const char *kernel, const mp_fc_value *c, int n, char *key, size_t keylen) {
    char buf[512];
    int len = snprintf(buf, sizeof buf, "%s", kernel ? kernel : "");
    for (int i = 0; i < n && len >= 0 && (size_t)len < sizeof buf; ++i) {
        const int w = snprintf(buf + len, sizeof buf - (size_t)len, "_%s=%d", c[i].name, c[i].value);
        if (w < 0) {
            return w;
        }
        len += w;
    }
    if (key && keylen) {
        snprintf(key, keylen, "%s", buf);
    }
    return len;
}

int mp_abi_version(void) { return MP_ABI_VERSION; }
const char *mp_ggml_tag(void) { return MP_GGML_TAG; }
const char *mp_ggml_commit(void) { return MP_GGML_COMMIT; }

/* ---- struct introspection (tests and the Python mirrors check against these) ---------------- */

typedef struct {
    const char *structure;
    const char *field;
    int64_t offset;
} field_entry;

#define F(S, T, NAME) { S, #NAME, (int64_t)offsetof(T, NAME) }
static const field_entry FIELDS[] = {
    F("fa_vec", mp_kargs_fa_vec, ne01), F("fa_vec", mp_kargs_fa_vec, ne02), F("fa_vec", mp_kargs_fa_vec, ne03),
    F("fa_vec", mp_kargs_fa_vec, nb01), F("fa_vec", mp_kargs_fa_vec, nb02), F("fa_vec", mp_kargs_fa_vec, nb03),
    F("fa_vec", mp_kargs_fa_vec, ne11), F("fa_vec", mp_kargs_fa_vec, ne_12_2), F("fa_vec", mp_kargs_fa_vec, ne_12_3),
    F("fa_vec", mp_kargs_fa_vec, ns10), F("fa_vec", mp_kargs_fa_vec, nb11), F("fa_vec", mp_kargs_fa_vec, nb12),
    F("fa_vec", mp_kargs_fa_vec, nb13), F("fa_vec", mp_kargs_fa_vec, ns20), F("fa_vec", mp_kargs_fa_vec, nb21),
    F("fa_vec", mp_kargs_fa_vec, nb22), F("fa_vec", mp_kargs_fa_vec, nb23), F("fa_vec", mp_kargs_fa_vec, ne31),
    F("fa_vec", mp_kargs_fa_vec, ne32), F("fa_vec", mp_kargs_fa_vec, ne33), F("fa_vec", mp_kargs_fa_vec, nb31),
    F("fa_vec", mp_kargs_fa_vec, nb32), F("fa_vec", mp_kargs_fa_vec, nb33), F("fa_vec", mp_kargs_fa_vec, ne1),
    F("fa_vec", mp_kargs_fa_vec, ne2), F("fa_vec", mp_kargs_fa_vec, ne3), F("fa_vec", mp_kargs_fa_vec, scale),
    F("fa_vec", mp_kargs_fa_vec, max_bias), F("fa_vec", mp_kargs_fa_vec, m0), F("fa_vec", mp_kargs_fa_vec, m1),
    F("fa_vec", mp_kargs_fa_vec, n_head_log2), F("fa_vec", mp_kargs_fa_vec, logit_softcap),
    F("fa_pad", mp_kargs_fa_pad, ne11), F("fa_pad", mp_kargs_fa_pad, ne_12_2), F("fa_pad", mp_kargs_fa_pad, ne_12_3),
    F("fa_pad", mp_kargs_fa_pad, nb11), F("fa_pad", mp_kargs_fa_pad, nb12), F("fa_pad", mp_kargs_fa_pad, nb13),
    F("fa_pad", mp_kargs_fa_pad, nb21), F("fa_pad", mp_kargs_fa_pad, nb22), F("fa_pad", mp_kargs_fa_pad, nb23),
    F("fa_pad", mp_kargs_fa_pad, ne31), F("fa_pad", mp_kargs_fa_pad, ne32), F("fa_pad", mp_kargs_fa_pad, ne33),
    F("fa_pad", mp_kargs_fa_pad, nb31), F("fa_pad", mp_kargs_fa_pad, nb32), F("fa_pad", mp_kargs_fa_pad, nb33),
    F("fa_vec_reduce", mp_kargs_fa_vec_reduce, nrows),
    F("problem", mp_fa_problem, n_heads), F("problem", mp_fa_problem, n_kv_heads),
    F("problem", mp_fa_problem, head_dim), F("problem", mp_fa_problem, visible),
    F("problem", mp_fa_problem, k_row_stride), F("problem", mp_fa_problem, v_row_stride),
    F("problem", mp_fa_problem, k_head_stride), F("problem", mp_fa_problem, v_head_stride),
    F("problem", mp_fa_problem, scale), F("problem", mp_fa_problem, has_mask),
    F("plan", mp_fa_plan, vec), F("plan", mp_fa_plan, pad), F("plan", mp_fa_plan, reduce),
    F("plan", mp_fa_plan, nwg), F("plan", mp_fa_plan, nsg), F("plan", mp_fa_plan, ncpsg),
    F("plan", mp_fa_plan, has_mask), F("plan", mp_fa_plan, has_sinks), F("plan", mp_fa_plan, has_bias),
    F("plan", mp_fa_plan, has_scap), F("plan", mp_fa_plan, has_kvpad),
    F("plan", mp_fa_plan, vec_groups), F("plan", mp_fa_plan, vec_threads),
    F("plan", mp_fa_plan, pad_groups), F("plan", mp_fa_plan, pad_threads),
    F("plan", mp_fa_plan, reduce_groups), F("plan", mp_fa_plan, reduce_threads),
    F("plan", mp_fa_plan, vec_smem_bytes), F("plan", mp_fa_plan, q_bytes), F("plan", mp_fa_plan, out_bytes),
    F("plan", mp_fa_plan, mask_bytes), F("plan", mp_fa_plan, k_extent), F("plan", mp_fa_plan, v_extent),
    F("plan", mp_fa_plan, pad_bytes), F("plan", mp_fa_plan, pad_bytes_ggml),
    F("plan", mp_fa_plan, tmp_bytes), F("plan", mp_fa_plan, tmp_bytes_ggml),
    F("fc_value", mp_fc_value, index), F("fc_value", mp_fc_value, type), F("fc_value", mp_fc_value, value),
    F("fc_value", mp_fc_value, name),
    F("attend_desc", mp_attend_desc, problem), F("attend_desc", mp_attend_desc, q),
    F("attend_desc", mp_attend_desc, q_offset), F("attend_desc", mp_attend_desc, k),
    F("attend_desc", mp_attend_desc, k_offset), F("attend_desc", mp_attend_desc, v),
    F("attend_desc", mp_attend_desc, v_offset), F("attend_desc", mp_attend_desc, mask),
    F("attend_desc", mp_attend_desc, mask_offset), F("attend_desc", mp_attend_desc, out),
    F("attend_desc", mp_attend_desc, out_offset),
};
#undef F

int64_t mp_struct_sizeof(const char *s) {
    if (!s) return -1;
    if (strcmp(s, "fa_vec") == 0) return (int64_t)sizeof(mp_kargs_fa_vec);
    if (strcmp(s, "fa_pad") == 0) return (int64_t)sizeof(mp_kargs_fa_pad);
    if (strcmp(s, "fa_vec_reduce") == 0) return (int64_t)sizeof(mp_kargs_fa_vec_reduce);
    if (strcmp(s, "problem") == 0) return (int64_t)sizeof(mp_fa_problem);
    if (strcmp(s, "plan") == 0) return (int64_t)sizeof(mp_fa_plan);
    if (strcmp(s, "fc_value") == 0) return (int64_t)sizeof(mp_fc_value);
    if (strcmp(s, "attend_desc") == 0) return (int64_t)sizeof(mp_attend_desc);
    return -1;
}

int64_t mp_struct_offsetof(const char *s, const char *field) {
    if (!s || !field) return -1;
    for (size_t i = 0; i < sizeof(FIELDS) / sizeof(FIELDS[0]); ++i) {
        if (strcmp(FIELDS[i].structure, s) == 0 && strcmp(FIELDS[i].field, field) == 0) {
            return FIELDS[i].offset;
        }
    }
    return -1;
}
