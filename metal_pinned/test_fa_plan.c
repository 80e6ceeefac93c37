/*
 * test_fa_plan.c -- checks fa_plan.c and mp_pin.c against values stated independently (from the
 * notes in shared/notes/llama-vec-kernel.md, checked against ggml v0.15.3, and from FIPS 180-4's
 * test vectors).  Runs on Linux: `make -C metal_pinned check-plan`.
 */
#include "fa_plan.h"
#include "mp_pin.h"
#include "mp_bridge.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;
static int checks = 0;

#define EXPECT_EQ(a, b)                                                                                       \
    do {                                                                                                      \
        ++checks;                                                                                             \
        long long _a = (long long)(a), _b = (long long)(b);                                                   \
        if (_a != _b) {                                                                                       \
            ++failures;                                                                                       \
            fprintf(stderr, "%s:%d: %s == %lld, expected %s == %lld\n", __FILE__, __LINE__, #a, _a, #b, _b); \
        }                                                                                                     \
    } while (0)

#define EXPECT_TRUE(c)                                                              \
    do {                                                                            \
        ++checks;                                                                   \
        if (!(c)) {                                                                 \
            ++failures;                                                             \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #c);        \
        }                                                                           \
    } while (0)

#define EXPECT_STR(a, b)                                                                               \
    do {                                                                                               \
        ++checks;                                                                                      \
        if (strcmp((a), (b)) != 0) {                                                                   \
            ++failures;                                                                                \
            fprintf(stderr, "%s:%d: '%s' != expected '%s'\n", __FILE__, __LINE__, (a), (b));           \
        }                                                                                              \
    } while (0)

/* Glimmer: 32 query heads, 2 KV heads, head_dim 128 */
static mp_fa_problem head_major(int visible, int capacity) {
    mp_fa_problem p = {32, 2, 128, visible, 128, 128, (int64_t)capacity * 128 * 2, (int64_t)capacity * 128 * 2,
                       0.08838834764831845f, 0};
    return p;
}

static mp_fa_problem token_major(int visible) {
    mp_fa_problem p = {32, 2, 128, visible, 256, 256, 256, 256, 0.08838834764831845f, 0};
    return p;
}

static void test_sizes(void) {
    EXPECT_EQ(sizeof(mp_kargs_fa_vec), 192);
    EXPECT_EQ(sizeof(mp_kargs_fa_pad), 104);
    EXPECT_EQ(sizeof(mp_kargs_fa_vec_reduce), 4);
    /* the offsets the notes list */
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "ne01"), 0);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "nb01"), 16);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "ne11"), 40);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "ns10"), 52);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "nb11"), 56);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "ns20"), 80);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "nb21"), 88);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "ne31"), 112);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "nb31"), 128);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "ne1"), 152);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "scale"), 164);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "logit_softcap"), 184);
    EXPECT_EQ(mp_struct_offsetof("fa_pad", "nb11"), 16);
    EXPECT_EQ(mp_struct_offsetof("fa_pad", "ne31"), 64);
    EXPECT_EQ(mp_struct_offsetof("fa_pad", "nb33"), 96);
    EXPECT_EQ(mp_struct_offsetof("fa_vec", "nope"), -1);
}

static void test_nsg(void) {
    /* "nsg is 1 up to 2048 KV, 2 up to 4096, and 4 above that" (nwg = 32, C = 32) */
    const int v[] = {1, 31, 32, 33, 1024, 2047, 2048, 2049, 4095, 4096, 4097, 8192, 131072};
    const int e[] = {1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 4, 4, 4};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; ++i) {
        EXPECT_EQ(mp_fa_nsg(32, v[i]), e[i]);
    }
}

static void test_smem(void) {
    for (int nsg = 1; nsg <= 4; nsg *= 2) {
        EXPECT_EQ(mp_fa_vec_smem_bytes(128, 128, 32, nsg), 1024 * nsg);  /* (128+128+256)*nsg*2 */
    }
    EXPECT_EQ(mp_fa_vec_smem_bytes(64, 64, 32, 1), 1024);               /* dims pad up to 128 */
    EXPECT_EQ(mp_fa_vec_smem_bytes(192, 128, 32, 2), (256 + 128 + 256) * 2 * 2);
    EXPECT_EQ(mp_fa_vec_smem_bytes(576, 512, 32, 2), (640 + 128 + 1024) * 2 * 2);
}

static void test_head_major(void) {
    char err[512] = "";
    mp_fa_plan pl;
    mp_fa_problem p = head_major(4097, 8192);
    EXPECT_EQ(mp_fa_make_plan(&p, &pl, err, sizeof err), 0);
    EXPECT_EQ(pl.vec.ne01, 1);
    EXPECT_EQ(pl.vec.ne02, 32);
    EXPECT_EQ(pl.vec.ne03, 1);
    EXPECT_EQ(pl.vec.nb01, 32 * 128 * 4);
    EXPECT_EQ(pl.vec.nb02, 128 * 4);
    EXPECT_EQ(pl.vec.ne11, 4097);
    EXPECT_EQ(pl.vec.ne_12_2, 2);
    EXPECT_EQ(pl.vec.ne_12_3, 1);
    EXPECT_EQ(pl.vec.ns10, 128);
    EXPECT_EQ(pl.vec.ns20, 128);
    EXPECT_EQ(pl.vec.nb11, 256);
    EXPECT_EQ(pl.vec.nb21, 256);
    EXPECT_EQ(pl.vec.nb12, 8192 * 256);
    EXPECT_EQ(pl.vec.nb22, 8192 * 256);
    EXPECT_EQ(pl.vec.ne1, 32);
    EXPECT_EQ(pl.vec.ne2, 1);
    EXPECT_EQ(pl.vec.ne3, 1);
    EXPECT_TRUE(pl.vec.scale == 0.08838834764831845f);
    EXPECT_TRUE(pl.vec.max_bias == 0.0f && pl.vec.logit_softcap == 0.0f);
    EXPECT_TRUE(pl.vec.m0 == 1.0f && pl.vec.m1 == 1.0f);
    EXPECT_EQ(pl.vec.n_head_log2, 32);
    EXPECT_EQ(pl.nwg, 32);
    EXPECT_EQ(pl.nsg, 4);
    EXPECT_EQ(pl.has_kvpad, 1);           /* 4097 % 32 = 1 */
    EXPECT_EQ(pl.has_mask, 0);
    EXPECT_EQ(pl.vec_groups[0], 1);
    EXPECT_EQ(pl.vec_groups[1], 32);
    EXPECT_EQ(pl.vec_groups[2], 32);
    EXPECT_EQ(pl.vec_threads[0], 32);
    EXPECT_EQ(pl.vec_threads[1], 4);
    EXPECT_EQ(pl.vec_threads[2], 1);
    EXPECT_EQ(pl.vec_smem_bytes, 4096);
    EXPECT_EQ(pl.pad_groups[0], 32);
    EXPECT_EQ(pl.pad_groups[1], 2);
    EXPECT_EQ(pl.pad_groups[2], 1);
    EXPECT_EQ(pl.pad_threads[0], 32);
    EXPECT_EQ(pl.reduce.nrows, 32);
    EXPECT_EQ(pl.reduce_groups[0], 32);
    EXPECT_EQ(pl.reduce_threads[0], 1024);
    EXPECT_EQ(pl.tmp_bytes, 32 * 32 * 130 * 4);     /* nrows*nwg*(DV + 2) floats */
    EXPECT_EQ(pl.tmp_bytes, pl.tmp_bytes_ggml);
    EXPECT_EQ(pl.pad_bytes, 32 * (256 * 2 + 256 * 2));
    EXPECT_EQ(pl.pad_bytes_ggml, 64 * (256 * 2 + 256 * 2));
    /* head-major: the pad copies exactly one head row, nothing past the last head's row */
    EXPECT_EQ(pl.k_extent, 4096 * 256 + 8192 * 256 + 256);
    EXPECT_EQ(pl.q_bytes, 32 * 128 * 4);
    EXPECT_EQ(pl.out_bytes, 32 * 128 * 4);

    mp_fc_value c[MP_FA_VEC_N_CONSTANTS];
    EXPECT_EQ(mp_fa_vec_constants(&pl, c), 9);
    const int idx[9] = {400, 401, 402, 403, 404, 420, 421, 422, 423};
    const int val[9] = {0, 0, 0, 0, 1, 128, 128, 4, 32};
    for (int i = 0; i < 9; ++i) {
        EXPECT_EQ(c[i].index, idx[i]);
        EXPECT_EQ(c[i].value, val[i]);
        EXPECT_EQ(c[i].type, i < 5 ? MP_FC_BOOL : MP_FC_INT32);
    }
    char key[256];
    mp_fa_pipeline_key(MP_KERNEL_FA_VEC, c, 9, key, sizeof key);
    EXPECT_STR(key, "kernel_flash_attn_ext_vec_f16_dk128_dv128_mask=0_sink=0_bias=0_scap=0_kvpad=1_ns10=128_ns20=128_nsg=4_nwg=32");
    EXPECT_EQ(mp_fa_pad_constants(&pl, c), 2);
    EXPECT_EQ(c[0].index, 100);
    EXPECT_EQ(c[0].type, MP_FC_BOOL);
    EXPECT_EQ(c[1].index, 125);
    EXPECT_EQ(c[1].value, 32);
    EXPECT_EQ(mp_fa_reduce_constants(&pl, c), 2);
    EXPECT_EQ(c[0].index, 500);
    EXPECT_EQ(c[0].value, 128);
    EXPECT_EQ(c[1].index, 501);
    EXPECT_EQ(c[1].value, 32);
}

static void test_token_major(void) {
    char err[512] = "";
    mp_fa_plan pl;
    mp_fa_problem p = token_major(2048);
    EXPECT_EQ(mp_fa_make_plan(&p, &pl, err, sizeof err), 0);
    EXPECT_EQ(pl.vec.ns10, 256);
    EXPECT_EQ(pl.vec.nb11, 512);
    EXPECT_EQ(pl.vec.nb12, 256);
    EXPECT_EQ(pl.pad.nb11, 512);
    EXPECT_EQ(pl.pad.nb12, 256);
    EXPECT_EQ(pl.nsg, 1);
    EXPECT_EQ(pl.has_kvpad, 0);
    EXPECT_EQ(pl.vec_smem_bytes, 1024);
    EXPECT_EQ(pl.k_extent, 2047 * 512 + 256 + 256);   /* exactly the plane's 2048 rows */
    EXPECT_EQ(pl.pad_bytes, 32 * (512 * 2 + 512 * 2));

    /* a ragged token-major window: the pad kernel copies 512 bytes from the last head's offset,
     * 256 bytes past the last row (the over-read the SWA len % 32 predicate avoids) */
    p = token_major(33);
    EXPECT_EQ(mp_fa_make_plan(&p, &pl, err, sizeof err), 0);
    EXPECT_EQ(pl.has_kvpad, 1);
    EXPECT_EQ(pl.k_extent, 32 * 512 + 256 + 512);
    EXPECT_TRUE(pl.k_extent > 33u * 512u);

    /* with a mask: one f16 row broadcast over heads */
    p = token_major(256);
    p.has_mask = 1;
    EXPECT_EQ(mp_fa_make_plan(&p, &pl, err, sizeof err), 0);
    EXPECT_EQ(pl.has_mask, 1);
    EXPECT_EQ(pl.vec.ne31, 1);
    EXPECT_EQ(pl.vec.ne32, 1);
    EXPECT_EQ(pl.vec.nb31, 512);
    EXPECT_EQ(pl.mask_bytes, 512);
    EXPECT_EQ(pl.pad_bytes, 32 * (512 * 2 + 512 * 2 + 2));
}

static void test_errors(void) {
    char err[512];
    mp_fa_plan pl;
    mp_fa_problem p = token_major(64);
    p.head_dim = 64;
    err[0] = 0;
    EXPECT_EQ(mp_fa_make_plan(&p, &pl, err, sizeof err), -1);
    EXPECT_TRUE(strstr(err, "head_dim") != NULL);
    p = token_major(64);
    p.n_heads = 31;
    EXPECT_EQ(mp_fa_make_plan(&p, &pl, err, sizeof err), -1);
    EXPECT_TRUE(strstr(err, "multiple of n_kv_heads") != NULL);
    p = token_major(0);
    EXPECT_EQ(mp_fa_make_plan(&p, &pl, err, sizeof err), -1);
    EXPECT_TRUE(strstr(err, "visible") != NULL);
    p = token_major(64);
    p.k_row_stride = 130;
    EXPECT_EQ(mp_fa_make_plan(&p, &pl, err, sizeof err), -1);
    EXPECT_TRUE(strstr(err, "multiple of 4") != NULL);
    p = token_major(64);
    p.v_row_stride = 64;
    EXPECT_EQ(mp_fa_make_plan(&p, &pl, err, sizeof err), -1);
    p = token_major(64);
    p.k_head_stride = 4;
    EXPECT_EQ(mp_fa_make_plan(&p, &pl, err, sizeof err), -1);
    EXPECT_EQ(mp_fa_make_plan(NULL, &pl, err, sizeof err), -1);
}

static void test_sha256_and_pin(void) {
    char hex[65], err[512];
    mp_sha256_hex("", 0, hex);
    EXPECT_STR(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    mp_sha256_hex("abc", 3, hex);
    EXPECT_STR(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    mp_sha256_hex(two, strlen(two), hex);
    EXPECT_STR(hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    {   /* one million 'a', fed in odd-sized pieces through the streaming interface */
        mp_sha256_ctx c;
        uint8_t d[32];
        char piece[997];
        memset(piece, 'a', sizeof piece);
        mp_sha256_init(&c);
        size_t left = 1000000;
        while (left) {
            const size_t n = left < sizeof piece ? left : sizeof piece;
            mp_sha256_update(&c, piece, n);
            left -= n;
        }
        mp_sha256_final(&c, d);
        static const char hx[] = "0123456789abcdef";
        for (int i = 0; i < 32; ++i) {
            hex[2 * i] = hx[d[i] >> 4];
            hex[2 * i + 1] = hx[d[i] & 15];
        }
        hex[64] = 0;
        EXPECT_STR(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    }

    EXPECT_EQ(mp_pin_parse("# comment\nUNSET\n", hex, err, sizeof err), -1);
    EXPECT_TRUE(strstr(err, "unset") != NULL);
    EXPECT_EQ(mp_pin_parse("# only comments\n\n", hex, err, sizeof err), -1);
    EXPECT_EQ(mp_pin_parse("abc\n", hex, err, sizeof err), -1);
    EXPECT_EQ(mp_pin_parse("BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD\n"
                           "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\n", hex, err, sizeof err), -1);
    EXPECT_EQ(mp_pin_parse("# pinned\n  BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD  \r\n", hex, err,
                           sizeof err), 0);
    EXPECT_STR(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    EXPECT_EQ(mp_pin_check("abc", 3, hex, NULL, err, sizeof err), 0);
    EXPECT_EQ(mp_pin_check("abd", 3, hex, NULL, err, sizeof err), -1);
    EXPECT_TRUE(strstr(err, "does not match") != NULL);
    EXPECT_EQ(mp_pin_check("abc", 3, "UNSET", NULL, err, sizeof err), -1);
    EXPECT_EQ(mp_pin_check("abc", 3, "", NULL, err, sizeof err), -1);
    EXPECT_EQ(mp_pin_check("abc", 3, NULL, NULL, err, sizeof err), -1);
}

int main(int argc, char **argv) {
    test_sizes();
    test_nsg();
    test_smem();
    test_head_major();
    test_token_major();
    test_errors();
    test_sha256_and_pin();
    if (argc > 1) { /* optional: the repository's PIN must parse or be refused, never crash */
        char hex[65], err[512];
        if (mp_pin_read(argv[1], hex, err, sizeof err) == 0) {
            printf("PIN %s holds %s\n", argv[1], hex);
        } else {
            printf("%s refused (expected while it holds the placeholder): %s\n", argv[1], err);
        }
    }
    if (failures) {
        fprintf(stderr, "test_fa_plan: %d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("test_fa_plan: all %d checks passed\n", checks);
    return 0;
}
