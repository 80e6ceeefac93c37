/*
 * mp_bridge.h -- the C ABI of libmuser_metal_pinned.dylib (bridge.m + fa_plan.c + mp_pin.c).
 *
 * Python loads it with ctypes on Darwin (muser_ti/metal_bridge.py mirrors every declaration here).
 * The types are plain C so the descriptor layout is checked on Linux too; only the functions marked
 * [macOS] need Metal.  All functions that can fail return 0 / non-NULL on success and -1 / NULL on
 * failure with a NUL-terminated message in err (errlen bytes); none of them aborts the process.
 *
 * Threading: one mp_ctx may be used from several threads (calls are serialized by a lock); buffers
 * belong to the context that made them and must be freed before it is closed.
 */
#ifndef MUSER_METAL_PINNED_MP_BRIDGE_H
#define MUSER_METAL_PINNED_MP_BRIDGE_H

#include <stddef.h>
#include <stdint.h>

#include "fa_plan.h"
#include "mp_pin.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mp_ctx mp_ctx; /* opaque: device, queue, verified library, pipeline cache, scratch */
typedef struct mp_buf mp_buf; /* opaque: one retained id<MTLBuffer>                                 */

/* One decode-attention dispatch (one layer, one token): pad (if visible % 32 != 0) + vec + reduce.
 * Offsets are bytes into the buffers.  q: f32 [n_heads][head_dim] at q_offset (16-byte aligned);
 * k, v: f16 planes (see mp_fa_problem for the strides; offsets 8-byte aligned) whose row 0 is the
 * first attended row; mask: f16 [visible] (only with problem.has_mask = 1, else NULL); out: f32
 * [n_heads][head_dim] at out_offset (16-byte aligned), must not overlap the inputs. */
typedef struct mp_attend_desc {
    mp_fa_problem problem;
    mp_buf  *q;    uint64_t q_offset;
    mp_buf  *k;    uint64_t k_offset;
    mp_buf  *v;    uint64_t v_offset;
    mp_buf  *mask; uint64_t mask_offset;
    mp_buf  *out;  uint64_t out_offset;
} mp_attend_desc;

MP_STATIC_ASSERT(sizeof(void *) == 8, "the ABI is defined for 64-bit targets (arm64/x86_64 macOS)");
MP_STATIC_ASSERT(sizeof(mp_attend_desc) == 128, "mp_attend_desc layout is part of the ABI");
MP_STATIC_ASSERT(offsetof(mp_attend_desc, q) == 48, "mp_attend_desc.q");
MP_STATIC_ASSERT(offsetof(mp_attend_desc, k) == 64, "mp_attend_desc.k");
MP_STATIC_ASSERT(offsetof(mp_attend_desc, mask) == 96, "mp_attend_desc.mask");
MP_STATIC_ASSERT(offsetof(mp_attend_desc, out_offset) == 120, "mp_attend_desc.out_offset");

/* Available everywhere (plain C, also exported by the dylib):
 *   int      mp_abi_version(void);                       -> MP_ABI_VERSION
 *   const char *mp_ggml_tag(void), *mp_ggml_commit(void);
 *   int      mp_fa_make_plan(const mp_fa_problem*, mp_fa_plan*, char *err, size_t errlen);
 *   int      mp_pin_read(const char *pin_path, char out_hex[65], char *err, size_t errlen);
 *   int      mp_sha256_file(const char *path, char out_hex[65], char *err, size_t errlen);
 *   int64_t  mp_struct_sizeof(const char*), mp_struct_offsetof(const char*, const char*);
 */

/* [macOS] Open the pinned metallib.  pin_hex: the 64-hex-digit digest from metal_pinned/PIN (read
 * it with mp_pin_read).  Refuses: a NULL/empty/placeholder/malformed pin; a file whose sha256 differs
 * (the bytes hashed are the bytes loaded); no Metal device; a library that lacks one of the three
 * kernels or whose function constants differ from the ones this bridge sets (index and type). */
mp_ctx *mp_open(const char *metallib_path, const char *pin_hex, char *err, size_t errlen);

/* [macOS] Release everything the context holds.  NULL is a no-op. */
void mp_close(mp_ctx *ctx);

/* [macOS] Identity: the verified sha256 (65 bytes incl. NUL) and the Metal device's name. */
int mp_identity(const mp_ctx *ctx, char sha256_out[65], char *device_out, size_t device_len);

/* [macOS] A new zero-filled buffer in shared storage (CPU-visible at mp_buffer_contents). */
mp_buf *mp_buffer_new(mp_ctx *ctx, size_t bytes, char *err, size_t errlen);

/* [macOS] Wrap caller memory without copying (newBufferWithBytesNoCopy).  ptr and bytes must be
 * multiples of the page size (getpagesize()); the caller keeps the memory alive until mp_buffer_free. */
mp_buf *mp_buffer_wrap(mp_ctx *ctx, void *ptr, size_t bytes, char *err, size_t errlen);

/* [macOS] Adopt an existing id<MTLBuffer> (passed as void*) created on the same device; retained. */
mp_buf *mp_buffer_from_mtl(mp_ctx *ctx, void *mtl_buffer, char *err, size_t errlen);

void  *mp_buffer_contents(mp_buf *buf);   /* [macOS] NULL for private storage */
size_t mp_buffer_length(mp_buf *buf);     /* [macOS] */
void   mp_buffer_free(mp_buf *buf);       /* [macOS] NULL is a no-op */

/* [macOS] Encode, commit and wait for one dispatch (pad? + vec + reduce). */
int mp_attend(mp_ctx *ctx, const mp_attend_desc *desc, char *err, size_t errlen);

/* [macOS] n dispatches (e.g. every pinned layer of one token) in one command buffer, in order,
 * with a buffer barrier between dependent kernels.  Every descriptor is validated before anything
 * is encoded: on error nothing runs. */
int mp_attend_batch(mp_ctx *ctx, const mp_attend_desc *descs, int n, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif /* MUSER_METAL_PINNED_MP_BRIDGE_H */
