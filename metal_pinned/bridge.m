/*
 * bridge.m -- dispatches llama.cpp's Metal flash-attention vec kernel (ggml v0.15.3) from a pinned
 * metallib: kernel_flash_attn_ext_pad (when visible % 32 != 0), kernel_flash_attn_ext_vec_f16_dk128_dv128
 * with nwg = 32 workgroups per head, and kernel_flash_attn_ext_vec_reduce.  C ABI: mp_bridge.h.
 *
 * NEVER LINKED OR RUN: it was written on Linux machines that have no Metal device.  On Linux it is
 * compile-checked under ARC against Metal's API signatures (../shared/tools/metal-check/check.sh, run
 * after every change to this folder; not a CI step).  Build it on macOS with `make -C metal_pinned bridge`
 * (clang -fobjc-arc, macOS 10.14 and later, -framework Metal Foundation CoreGraphics).  Everything it
 * computes that does not need Metal -- argument structs, function-constant tables, geometry, scratch sizes, the bounds each
 * kernel reads, SHA-256 and the PIN rules -- lives in fa_plan.c / mp_pin.c, which are compiled and
 * tested on Linux (make check-plan, tests/test_metal_pinned.py).  This file only does the Metal calls.
 *
 * Written from the facts in shared/notes/llama-vec-kernel.md, checked against ggml v0.15.3
 * (eced84c8): buffer bindings of ggml_metal_op_flash_attn_ext (vec branch), the pipeline compile in
 * ggml-metal-device.m.  No ggml code is copied.
 */
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fa_plan.h"
#include "mp_bridge.h"
#include "mp_pin.h"

#if !__has_feature(objc_arc)
#error "bridge.m is written for ARC: compile with -fobjc-arc"
#endif

#define MP_EXPORT __attribute__((visibility("default")))

static int mp_fail(char *err, size_t errlen, NSString *msg) {
    if (err && errlen) {
        snprintf(err, errlen, "%s", msg ? msg.UTF8String : "unknown error");
    }
    return -1;
}

static NSString *mp_nserr(NSError *e) {
    return e ? e.localizedDescription : @"(no NSError)";
}

/* ------------------------------------------------------------------------------------------------ */

@interface MPBuffer : NSObject
@property(nonatomic, strong) id<MTLBuffer> buffer;
@property(nonatomic, strong) id<MTLDevice> device;
@end
@implementation MPBuffer
@end

@interface MPContext : NSObject
@property(nonatomic, strong) id<MTLDevice> device;
@property(nonatomic, strong) id<MTLCommandQueue> queue;
@property(nonatomic, strong) id<MTLLibrary> library;
@property(nonatomic, copy) NSString *metallibPath;
@property(nonatomic, copy) NSString *sha256;
@property(nonatomic, strong) NSMutableDictionary<NSString *, id<MTLComputePipelineState>> *pipelines;
@property(nonatomic, strong) id<MTLBuffer> padScratch;
@property(nonatomic, strong) id<MTLBuffer> tmpScratch;
@property(nonatomic, strong) NSLock *lock;
@end
@implementation MPContext
@end

/* the handles are retained ObjC objects (see __bridge_retained below); these borrow them */
static MPContext *ctx_of(const mp_ctx *c) { return (__bridge MPContext *)(void *)c; }
static MPBuffer *buf_of(const mp_buf *b) { return (__bridge MPBuffer *)(void *)b; }

/* ---- verification of the library against the constants this bridge sets ----------------------- */

static int check_function(id<MTLLibrary> lib, const char *name, const mp_fc_value *c, int n, char *err, size_t errlen) {
    NSString *fname = [NSString stringWithUTF8String:name];
    if (![lib.functionNames containsObject:fname]) {
        return mp_fail(err, errlen, [NSString stringWithFormat:@"the metallib has no function %@ (is it ggml v0.15.3's?)", fname]);
    }
    id<MTLFunction> f = [lib newFunctionWithName:fname];
    if (!f) {
        return mp_fail(err, errlen, [NSString stringWithFormat:@"cannot get function %@ from the metallib", fname]);
    }
    NSDictionary<NSString *, MTLFunctionConstant *> *declared = f.functionConstantsDictionary;
    for (int i = 0; i < n; ++i) {
        const MTLDataType want = c[i].type == MP_FC_BOOL ? MTLDataTypeBool : MTLDataTypeInt;
        BOOL found = NO;
        for (MTLFunctionConstant *fc in declared.allValues) {
            if ((int32_t)fc.index == c[i].index) {
                if (fc.type != want) {
                    return mp_fail(err, errlen, [NSString stringWithFormat:
                        @"%@: function constant %d (%@) has type %lu, this bridge sets %s", fname, c[i].index, fc.name,
                        (unsigned long)fc.type, c[i].type == MP_FC_BOOL ? "bool" : "int32"]);
                }
                found = YES;
            }
        }
        if (!found) {
            return mp_fail(err, errlen, [NSString stringWithFormat:
                @"%@ declares no function constant at index %d (%s): the metallib is not the ggml this bridge was written for",
                fname, c[i].index, c[i].name]);
        }
    }
    return 0;
}

static id<MTLComputePipelineState> get_pipeline(MPContext *cx, const char *kernel, const mp_fc_value *c, int n,
                                               char *err, size_t errlen) {
    char key[512];
    mp_fa_pipeline_key(kernel, c, n, key, sizeof key);
    NSString *k = [NSString stringWithUTF8String:key];
    id<MTLComputePipelineState> ps = cx.pipelines[k];
    if (ps) {
        return ps;
    }
    MTLFunctionConstantValues *cv = [[MTLFunctionConstantValues alloc] init];
    for (int i = 0; i < n; ++i) {
        if (c[i].type == MP_FC_BOOL) {
            const bool b = c[i].value != 0;
            [cv setConstantValue:&b type:MTLDataTypeBool atIndex:(NSUInteger)c[i].index];
        } else {
            const int32_t v = c[i].value;
            [cv setConstantValue:&v type:MTLDataTypeInt atIndex:(NSUInteger)c[i].index];
        }
    }
    NSError *e = nil;
    id<MTLFunction> f = [cx.library newFunctionWithName:[NSString stringWithUTF8String:kernel] constantValues:cv error:&e];
    if (!f) {
        mp_fail(err, errlen, [NSString stringWithFormat:@"specializing %s: %@", key, mp_nserr(e)]);
        return nil;
    }
    ps = [cx.device newComputePipelineStateWithFunction:f error:&e];
    if (!ps) {
        mp_fail(err, errlen, [NSString stringWithFormat:@"pipeline %s: %@", key, mp_nserr(e)]);
        return nil;
    }
    if (ps.threadExecutionWidth != 32) {
        mp_fail(err, errlen, [NSString stringWithFormat:
            @"pipeline %s: SIMD width %lu; the llama kernels assume 32", key, (unsigned long)ps.threadExecutionWidth]);
        return nil;
    }
    cx.pipelines[k] = ps;
    return ps;
}

/* ---- open / close / identity ----------------------------------------------------------------- */

MP_EXPORT mp_ctx *mp_open(const char *metallib_path, const char *pin_hex, char *err, size_t errlen) {
    @autoreleasepool {
        if (!metallib_path || !*metallib_path) {
            mp_fail(err, errlen, @"no metallib path given");
            return NULL;
        }
        char want[65];
        if (!pin_hex || mp_pin_parse(pin_hex, want, err, errlen) != 0) {
            if (!pin_hex) mp_fail(err, errlen, @"no pin given: refusing to load an unpinned metallib");
            return NULL;
        }
        NSString *path = [NSString stringWithUTF8String:metallib_path];
        NSError *e = nil;
        /* read once: the bytes that are hashed are the bytes given to Metal (no check-then-reopen race) */
        NSData *bytes = [NSData dataWithContentsOfFile:path options:NSDataReadingUncached error:&e];
        if (!bytes) {
            mp_fail(err, errlen, [NSString stringWithFormat:@"cannot read metallib %@: %@", path, mp_nserr(e)]);
            return NULL;
        }
        char actual[65];
        if (mp_pin_check(bytes.bytes, bytes.length, want, actual, err, errlen) != 0) {
            return NULL;
        }

        id<MTLDevice> device = MTLCreateSystemDefaultDevice();
        if (!device) {
            mp_fail(err, errlen, @"no Metal device (MTLCreateSystemDefaultDevice returned nil)");
            return NULL;
        }
        dispatch_data_t dd = dispatch_data_create(bytes.bytes, bytes.length, NULL, DISPATCH_DATA_DESTRUCTOR_DEFAULT);
        id<MTLLibrary> lib = [device newLibraryWithData:dd error:&e];
        if (!lib) {
            mp_fail(err, errlen, [NSString stringWithFormat:@"Metal rejected %@: %@", path, mp_nserr(e)]);
            return NULL;
        }

        /* the constants a plan sets, by index and type, must be the ones the library declares */
        mp_fa_problem probe = {32, 2, 128, 33, 256, 256, 256, 256, 1.0f, 1};
        mp_fa_plan plan;
        if (mp_fa_make_plan(&probe, &plan, err, errlen) != 0) {
            return NULL;
        }
        mp_fc_value c[MP_FA_VEC_N_CONSTANTS];
        int n = mp_fa_vec_constants(&plan, c);
        if (check_function(lib, MP_KERNEL_FA_VEC, c, n, err, errlen) != 0) return NULL;
        n = mp_fa_pad_constants(&plan, c);
        if (check_function(lib, MP_KERNEL_FA_PAD, c, n, err, errlen) != 0) return NULL;
        n = mp_fa_reduce_constants(&plan, c);
        if (check_function(lib, MP_KERNEL_FA_VEC_REDUCE, c, n, err, errlen) != 0) return NULL;

        id<MTLCommandQueue> queue = [device newCommandQueue];
        if (!queue) {
            mp_fail(err, errlen, @"cannot create a Metal command queue");
            return NULL;
        }
        MPContext *cx = [[MPContext alloc] init];
        cx.device = device;
        cx.queue = queue;
        cx.library = lib;
        cx.metallibPath = path;
        cx.sha256 = [NSString stringWithUTF8String:actual];
        cx.pipelines = [NSMutableDictionary dictionary];
        cx.lock = [[NSLock alloc] init];
        return (mp_ctx *)(__bridge_retained void *)cx;
    }
}

MP_EXPORT void mp_close(mp_ctx *ctx) {
    if (!ctx) return;
    @autoreleasepool {
        MPContext *cx = (__bridge_transfer MPContext *)(void *)ctx;
        [cx.lock lock];
        [cx.pipelines removeAllObjects];
        cx.padScratch = nil;
        cx.tmpScratch = nil;
        [cx.lock unlock];
        /* the transferred reference is released when cx goes out of scope */
    }
}

MP_EXPORT int mp_identity(const mp_ctx *ctx, char sha256_out[65], char *device_out, size_t device_len) {
    if (!ctx) return -1;
    @autoreleasepool {
        MPContext *cx = ctx_of(ctx);
        if (sha256_out) snprintf(sha256_out, 65, "%s", cx.sha256.UTF8String);
        if (device_out && device_len) snprintf(device_out, device_len, "%s", cx.device.name.UTF8String);
    }
    return 0;
}

/* ---- buffers ---------------------------------------------------------------------------------- */

static mp_buf *wrap(MPContext *cx, id<MTLBuffer> b) {
    MPBuffer *mb = [[MPBuffer alloc] init];
    mb.buffer = b;
    mb.device = cx.device;
    return (mp_buf *)(__bridge_retained void *)mb;
}

MP_EXPORT mp_buf *mp_buffer_new(mp_ctx *ctx, size_t bytes, char *err, size_t errlen) {
    if (!ctx) { mp_fail(err, errlen, @"no context"); return NULL; }
    if (bytes == 0) { mp_fail(err, errlen, @"zero-length buffer"); return NULL; }
    @autoreleasepool {
        MPContext *cx = ctx_of(ctx);
        if (bytes > cx.device.maxBufferLength) {
            mp_fail(err, errlen, [NSString stringWithFormat:@"%zu bytes exceeds the device's maxBufferLength %lu",
                                  bytes, (unsigned long)cx.device.maxBufferLength]);
            return NULL;
        }
        id<MTLBuffer> b = [cx.device newBufferWithLength:bytes options:MTLResourceStorageModeShared];
        if (!b) { mp_fail(err, errlen, [NSString stringWithFormat:@"cannot allocate %zu bytes", bytes]); return NULL; }
        memset(b.contents, 0, bytes);
        return wrap(cx, b);
    }
}

MP_EXPORT mp_buf *mp_buffer_wrap(mp_ctx *ctx, void *ptr, size_t bytes, char *err, size_t errlen) {
    if (!ctx) { mp_fail(err, errlen, @"no context"); return NULL; }
    const size_t page = (size_t)getpagesize();
    if (!ptr || bytes == 0 || ((uintptr_t)ptr % page) != 0 || (bytes % page) != 0) {
        mp_fail(err, errlen, [NSString stringWithFormat:
            @"mp_buffer_wrap needs a non-NULL pointer and a length that are multiples of the page size %zu (got %p, %zu)",
            page, ptr, bytes]);
        return NULL;
    }
    @autoreleasepool {
        MPContext *cx = ctx_of(ctx);
        id<MTLBuffer> b = [cx.device newBufferWithBytesNoCopy:ptr length:bytes options:MTLResourceStorageModeShared
                                                 deallocator:nil];
        if (!b) { mp_fail(err, errlen, @"newBufferWithBytesNoCopy failed"); return NULL; }
        return wrap(cx, b);
    }
}

MP_EXPORT mp_buf *mp_buffer_from_mtl(mp_ctx *ctx, void *mtl_buffer, char *err, size_t errlen) {
    if (!ctx || !mtl_buffer) { mp_fail(err, errlen, @"no context or no buffer"); return NULL; }
    @autoreleasepool {
        MPContext *cx = ctx_of(ctx);
        id obj = (__bridge id)mtl_buffer;
        if (![obj conformsToProtocol:@protocol(MTLBuffer)]) {
            mp_fail(err, errlen, @"the object passed is not an id<MTLBuffer>");
            return NULL;
        }
        id<MTLBuffer> b = (id<MTLBuffer>)obj;
        if (b.device != cx.device) {
            mp_fail(err, errlen, @"the MTLBuffer belongs to another device than the bridge's");
            return NULL;
        }
        return wrap(cx, b);
    }
}

MP_EXPORT void *mp_buffer_contents(mp_buf *buf) {
    if (!buf) return NULL;
    id<MTLBuffer> b = buf_of(buf).buffer;
    return b.storageMode == MTLStorageModePrivate ? NULL : b.contents;
}

MP_EXPORT size_t mp_buffer_length(mp_buf *buf) { return buf ? (size_t)buf_of(buf).buffer.length : 0; }

MP_EXPORT void mp_buffer_free(mp_buf *buf) {
    if (!buf) return;
    @autoreleasepool {
        MPBuffer *mb = (__bridge_transfer MPBuffer *)(void *)buf; /* ARC releases it at scope exit */
        (void)mb;
    }
}

/* ---- dispatch --------------------------------------------------------------------------------- */

typedef struct {
    mp_fa_plan plan;
    id<MTLComputePipelineState> __unsafe_unretained vec, pad, reduce; /* owned by the pipeline cache */
} prepared;

static int check_range(const char *what, mp_buf *b, uint64_t off, uint64_t bytes, uint64_t align, char *err, size_t errlen) {
    if (!b) return mp_fail(err, errlen, [NSString stringWithFormat:@"%s: no buffer", what]);
    const uint64_t len = buf_of(b).buffer.length;
    if (off % align != 0) {
        return mp_fail(err, errlen, [NSString stringWithFormat:@"%s: offset %llu is not %llu-byte aligned", what,
                                     (unsigned long long)off, (unsigned long long)align]);
    }
    if (off > len || bytes > len - off) {
        return mp_fail(err, errlen, [NSString stringWithFormat:
            @"%s: the kernels read/write bytes [%llu, %llu) but the buffer holds %llu%s", what, (unsigned long long)off,
            (unsigned long long)(off + bytes), (unsigned long long)len,
            (strcmp(what, "k") == 0 || strcmp(what, "v") == 0)
                ? " (a ragged window makes the pad kernel copy a whole row stride from the last head's offset)" : ""]);
    }
    return 0;
}

static int overlaps(mp_buf *a, uint64_t ao, uint64_t an, mp_buf *b, uint64_t bo, uint64_t bn) {
    if (!a || !b || buf_of(a).buffer != buf_of(b).buffer) return 0;
    return ao < bo + bn && bo < ao + an;
}

static int prepare(MPContext *cx, const mp_attend_desc *d, prepared *out, char *err, size_t errlen) {
    if (!d) return mp_fail(err, errlen, @"no descriptor");
    if (mp_fa_make_plan(&d->problem, &out->plan, err, errlen) != 0) return -1;
    const mp_fa_plan *pl = &out->plan;
    if (check_range("q", d->q, d->q_offset, pl->q_bytes, 16, err, errlen)) return -1;
    if (check_range("k", d->k, d->k_offset, pl->k_extent, 8, err, errlen)) return -1;
    if (check_range("v", d->v, d->v_offset, pl->v_extent, 8, err, errlen)) return -1;
    if (check_range("out", d->out, d->out_offset, pl->out_bytes, 16, err, errlen)) return -1;
    if (pl->has_mask) {
        if (check_range("mask", d->mask, d->mask_offset, pl->mask_bytes, 2, err, errlen)) return -1;
    } else if (d->mask) {
        return mp_fail(err, errlen, @"a mask buffer was given but problem.has_mask is 0");
    }
    const mp_buf *bufs[] = {d->q, d->k, d->v, d->out, d->mask};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) {
        if (bufs[i] && buf_of(bufs[i]).device != cx.device) {
            return mp_fail(err, errlen, @"a buffer belongs to another context's device");
        }
    }
    if (overlaps(d->out, d->out_offset, pl->out_bytes, d->q, d->q_offset, pl->q_bytes) ||
        overlaps(d->out, d->out_offset, pl->out_bytes, d->k, d->k_offset, pl->k_extent) ||
        overlaps(d->out, d->out_offset, pl->out_bytes, d->v, d->v_offset, pl->v_extent) ||
        (pl->has_mask && overlaps(d->out, d->out_offset, pl->out_bytes, d->mask, d->mask_offset, pl->mask_bytes))) {
        return mp_fail(err, errlen, @"the output range overlaps an input range");
    }
    if (pl->vec_smem_bytes > cx.device.maxThreadgroupMemoryLength) {
        return mp_fail(err, errlen, [NSString stringWithFormat:@"vec kernel needs %llu bytes of threadgroup memory, device has %lu",
                                     (unsigned long long)pl->vec_smem_bytes, (unsigned long)cx.device.maxThreadgroupMemoryLength]);
    }

    mp_fc_value c[MP_FA_VEC_N_CONSTANTS];
    int n = mp_fa_vec_constants(pl, c);
    id<MTLComputePipelineState> vec = get_pipeline(cx, MP_KERNEL_FA_VEC, c, n, err, errlen);
    if (!vec) return -1;
    n = mp_fa_reduce_constants(pl, c);
    id<MTLComputePipelineState> red = get_pipeline(cx, MP_KERNEL_FA_VEC_REDUCE, c, n, err, errlen);
    if (!red) return -1;
    id<MTLComputePipelineState> pad = nil;
    if (pl->has_kvpad) {
        n = mp_fa_pad_constants(pl, c);
        pad = get_pipeline(cx, MP_KERNEL_FA_PAD, c, n, err, errlen);
        if (!pad) return -1;
        if (pad.maxTotalThreadsPerThreadgroup < pl->pad_threads[0]) {
            return mp_fail(err, errlen, @"pad pipeline cannot run 32 threads per threadgroup");
        }
    }
    if (vec.maxTotalThreadsPerThreadgroup < (NSUInteger)pl->vec_threads[0] * pl->vec_threads[1]) {
        return mp_fail(err, errlen, [NSString stringWithFormat:@"vec pipeline allows %lu threads per group, nsg %d needs %u",
                                     (unsigned long)vec.maxTotalThreadsPerThreadgroup, pl->nsg, pl->vec_threads[0] * pl->vec_threads[1]]);
    }
    if (red.maxTotalThreadsPerThreadgroup < pl->reduce_threads[0]) {
        return mp_fail(err, errlen, [NSString stringWithFormat:@"reduce pipeline allows %lu threads per group, needs %u (32*nwg)",
                                     (unsigned long)red.maxTotalThreadsPerThreadgroup, pl->reduce_threads[0]]);
    }
    out->vec = vec;
    out->pad = pad;
    out->reduce = red;
    return 0;
}

static int ensure_scratch(MPContext *cx, uint64_t pad_bytes, uint64_t tmp_bytes, char *err, size_t errlen) {
    /* the vec kernel always gets a valid buffer at index 6, as ggml binds one even without padding */
    if (pad_bytes < 16) pad_bytes = 16;
    if (!cx.padScratch || cx.padScratch.length < pad_bytes) {
        cx.padScratch = [cx.device newBufferWithLength:pad_bytes options:MTLResourceStorageModePrivate];
    }
    if (!cx.tmpScratch || cx.tmpScratch.length < tmp_bytes) {
        cx.tmpScratch = [cx.device newBufferWithLength:tmp_bytes options:MTLResourceStorageModePrivate];
    }
    if (!cx.padScratch || !cx.tmpScratch) {
        cx.padScratch = nil;
        cx.tmpScratch = nil;
        return mp_fail(err, errlen, @"cannot allocate the pad/tmp scratch buffers");
    }
    return 0;
}

static void encode(MPContext *cx, id<MTLComputeCommandEncoder> enc, const mp_attend_desc *d, const prepared *pr) {
    const mp_fa_plan *pl = &pr->plan;
    id<MTLBuffer> q = buf_of(d->q).buffer, k = buf_of(d->k).buffer, v = buf_of(d->v).buffer, o = buf_of(d->out).buffer;
    /* without a mask (and without sinks) ggml binds Q's buffer at those indices; so do we */
    id<MTLBuffer> m = pl->has_mask ? buf_of(d->mask).buffer : q;
    const NSUInteger moff = pl->has_mask ? (NSUInteger)d->mask_offset : (NSUInteger)d->q_offset;

    if (pl->has_kvpad) {
        [enc setComputePipelineState:pr->pad];
        [enc setBytes:&pl->pad length:sizeof pl->pad atIndex:0];
        [enc setBuffer:k offset:(NSUInteger)d->k_offset atIndex:1];
        [enc setBuffer:v offset:(NSUInteger)d->v_offset atIndex:2];
        [enc setBuffer:m offset:moff atIndex:3];
        [enc setBuffer:cx.padScratch offset:0 atIndex:4];
        [enc dispatchThreadgroups:MTLSizeMake(pl->pad_groups[0], pl->pad_groups[1], pl->pad_groups[2])
            threadsPerThreadgroup:MTLSizeMake(pl->pad_threads[0], pl->pad_threads[1], pl->pad_threads[2])];
        [enc memoryBarrierWithScope:MTLBarrierScopeBuffers];
    }

    [enc setComputePipelineState:pr->vec];
    [enc setBytes:&pl->vec length:sizeof pl->vec atIndex:0];
    [enc setBuffer:q offset:(NSUInteger)d->q_offset atIndex:1];
    [enc setBuffer:k offset:(NSUInteger)d->k_offset atIndex:2];
    [enc setBuffer:v offset:(NSUInteger)d->v_offset atIndex:3];
    [enc setBuffer:m offset:moff atIndex:4];
    [enc setBuffer:q offset:(NSUInteger)d->q_offset atIndex:5];   /* sinks: none */
    [enc setBuffer:cx.padScratch offset:0 atIndex:6];
    [enc setBuffer:cx.tmpScratch offset:0 atIndex:7];              /* nwg = 32 > 1: partials, then reduce */
    [enc setThreadgroupMemoryLength:(NSUInteger)pl->vec_smem_bytes atIndex:0];
    [enc dispatchThreadgroups:MTLSizeMake(pl->vec_groups[0], pl->vec_groups[1], pl->vec_groups[2])
        threadsPerThreadgroup:MTLSizeMake(pl->vec_threads[0], pl->vec_threads[1], pl->vec_threads[2])];
    [enc memoryBarrierWithScope:MTLBarrierScopeBuffers];

    [enc setComputePipelineState:pr->reduce];
    [enc setBytes:&pl->reduce length:sizeof pl->reduce atIndex:0];
    [enc setBuffer:cx.tmpScratch offset:0 atIndex:1];
    [enc setBuffer:o offset:(NSUInteger)d->out_offset atIndex:2];
    [enc dispatchThreadgroups:MTLSizeMake(pl->reduce_groups[0], pl->reduce_groups[1], pl->reduce_groups[2])
        threadsPerThreadgroup:MTLSizeMake(pl->reduce_threads[0], pl->reduce_threads[1], pl->reduce_threads[2])];
    /* the next dispatch reuses the pad/tmp scratch: let this reduce finish reading it first */
    [enc memoryBarrierWithScope:MTLBarrierScopeBuffers];
}

MP_EXPORT int mp_attend_batch(mp_ctx *ctx, const mp_attend_desc *descs, int n, char *err, size_t errlen) {
    if (!ctx) return mp_fail(err, errlen, @"no context");
    if (n < 1 || !descs) return mp_fail(err, errlen, @"no descriptors");
    @autoreleasepool {
        MPContext *cx = ctx_of(ctx);
        [cx.lock lock];
        int rc = -1;
        prepared *pr = calloc((size_t)n, sizeof *pr);
        if (!pr) {
            [cx.lock unlock];
            return mp_fail(err, errlen, @"out of memory");
        }
        do {
            uint64_t pad_bytes = 0, tmp_bytes = 0;
            int i;
            for (i = 0; i < n; ++i) {
                char e[768] = "";
                if (prepare(cx, &descs[i], &pr[i], e, sizeof e) != 0) {
                    mp_fail(err, errlen, [NSString stringWithFormat:@"descriptor %d: %s", i, e]);
                    break;
                }
                if (pr[i].plan.has_kvpad && pr[i].plan.pad_bytes > pad_bytes) pad_bytes = pr[i].plan.pad_bytes;
                if (pr[i].plan.tmp_bytes > tmp_bytes) tmp_bytes = pr[i].plan.tmp_bytes;
            }
            if (i < n) break;
            if (ensure_scratch(cx, pad_bytes, tmp_bytes, err, errlen) != 0) break;

            id<MTLCommandBuffer> cmd = [cx.queue commandBuffer];
            id<MTLComputeCommandEncoder> enc = [cmd computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
            if (!cmd || !enc) {
                mp_fail(err, errlen, @"cannot create a command buffer / compute encoder");
                break;
            }
            for (i = 0; i < n; ++i) {
                encode(cx, enc, &descs[i], &pr[i]);
            }
            [enc endEncoding];
            [cmd commit];
            [cmd waitUntilCompleted];
            if (cmd.status != MTLCommandBufferStatusCompleted) {
                mp_fail(err, errlen, [NSString stringWithFormat:@"command buffer failed (status %ld): %@",
                                      (long)cmd.status, mp_nserr(cmd.error)]);
                break;
            }
            rc = 0;
        } while (0);
        free(pr);
        [cx.lock unlock];
        return rc;
    }
}

MP_EXPORT int mp_attend(mp_ctx *ctx, const mp_attend_desc *desc, char *err, size_t errlen) {
    return mp_attend_batch(ctx, desc, 1, err, errlen);
}
