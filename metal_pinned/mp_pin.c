/*
 * mp_pin.c -- SHA-256 and the PIN rules.  See mp_pin.h.
 */
#include "mp_pin.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int mp_set_error(char *err, size_t errlen, const char *fmt, ...) {
    /* the one error writer of the plain C: formats into err (if given) and returns -1 */
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* ---- SHA-256 (FIPS 180-4) -------------------------------------------------------------------- */

static const uint32_t K256[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u,
};

static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void compress(uint32_t h[8], const uint8_t p[64]) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
        w[i] = ((uint32_t)p[4 * i] << 24) | ((uint32_t)p[4 * i + 1] << 16) | ((uint32_t)p[4 * i + 2] << 8) |
               (uint32_t)p[4 * i + 3];
    }
    for (int i = 16; i < 64; ++i) {
        const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; ++i) {
        const uint32_t S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
        const uint32_t ch = (e & f) ^ (~e & g);
        const uint32_t t1 = k + S1 + ch + K256[i] + w[i];
        const uint32_t S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
        const uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
        const uint32_t t2 = S0 + maj;
        k = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

void mp_sha256_init(mp_sha256_ctx *c) {
    static const uint32_t H0[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                   0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    memcpy(c->h, H0, sizeof H0);
    c->nbytes = 0;
    c->fill = 0;
}

void mp_sha256_update(mp_sha256_ctx *c, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    c->nbytes += n;
    if (c->fill) {
        const size_t take = n < 64 - c->fill ? n : 64 - c->fill;
        memcpy(c->block + c->fill, p, take);
        c->fill += take;
        p += take;
        n -= take;
        if (c->fill < 64) {
            return;
        }
        compress(c->h, c->block);
        c->fill = 0;
    }
    while (n >= 64) {
        compress(c->h, p);
        p += 64;
        n -= 64;
    }
    if (n) {
        memcpy(c->block, p, n);
        c->fill = n;
    }
}

void mp_sha256_final(mp_sha256_ctx *c, uint8_t digest[32]) {
    const uint64_t bits = c->nbytes * 8u;
    c->block[c->fill++] = 0x80;
    if (c->fill > 56) {
        memset(c->block + c->fill, 0, 64 - c->fill);
        compress(c->h, c->block);
        c->fill = 0;
    }
    memset(c->block + c->fill, 0, 56 - c->fill);
    for (int i = 0; i < 8; ++i) {
        c->block[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    }
    compress(c->h, c->block);
    for (int i = 0; i < 8; ++i) {
        digest[4 * i] = (uint8_t)(c->h[i] >> 24);
        digest[4 * i + 1] = (uint8_t)(c->h[i] >> 16);
        digest[4 * i + 2] = (uint8_t)(c->h[i] >> 8);
        digest[4 * i + 3] = (uint8_t)(c->h[i]);
    }
}

static void to_hex(const uint8_t d[32], char out[65]) {
    static const char hx[] = "0123456789abcdef";
    for (int i = 0; i < 32; ++i) {
        out[2 * i] = hx[d[i] >> 4];
        out[2 * i + 1] = hx[d[i] & 15];
    }
    out[64] = '\0';
}

void mp_sha256_hex(const void *data, size_t n, char out[65]) {
    mp_sha256_ctx c;
    uint8_t d[32];
    mp_sha256_init(&c);
    mp_sha256_update(&c, data, n);
    mp_sha256_final(&c, d);
    to_hex(d, out);
}

int mp_sha256_file(const char *path, char out[65], char *err, size_t errlen) {
    if (!path || !*path) {
        return mp_set_error(err, errlen, "no file path given");
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        return mp_set_error(err, errlen, "cannot open %s: %s", path, strerror(errno));
    }
    mp_sha256_ctx c;
    uint8_t buf[1 << 16], d[32];
    size_t n;
    mp_sha256_init(&c);
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
        mp_sha256_update(&c, buf, n);
    }
    const int bad = ferror(f);
    fclose(f);
    if (bad) {
        return mp_set_error(err, errlen, "read error on %s", path);
    }
    mp_sha256_final(&c, d);
    to_hex(d, out);
    return 0;
}

/* ---- PIN ------------------------------------------------------------------------------------- */

static int is_hex64(const char *s, size_t n) {
    if (n != MP_SHA256_HEX_LEN) {
        return 0;
    }
    for (size_t i = 0; i < n; ++i) {
        if (!isxdigit((unsigned char)s[i])) {
            return 0;
        }
    }
    return 1;
}

int mp_pin_parse(const char *text, char out[65], char *err, size_t errlen) {
    if (!text) {
        return mp_set_error(err, errlen, "PIN: no text");
    }
    const char *value = NULL;
    size_t value_len = 0;
    int values = 0;
    const char *line = text;
    while (*line) {
        const char *end = strchr(line, '\n');
        const char *next = end ? end + 1 : line + strlen(line);
        if (!end) {
            end = next;
        }
        const char *a = line, *b = end;
        while (a < b && isspace((unsigned char)*a)) ++a;
        while (b > a && isspace((unsigned char)b[-1])) --b;
        if (a < b && *a != '#') {
            ++values;
            value = a;
            value_len = (size_t)(b - a);
        }
        line = next;
    }
    if (values == 0) {
        return mp_set_error(err, errlen, "PIN is empty: it must hold the metallib's sha256 (run `make -C metal_pinned pin` on macOS)");
    }
    if (values > 1) {
        return mp_set_error(err, errlen, "PIN has %d value lines; exactly one (the metallib's sha256) is allowed", values);
    }
    if (value_len == strlen(MP_PIN_PLACEHOLDER) && strncmp(value, MP_PIN_PLACEHOLDER, value_len) == 0) {
        return mp_set_error(err, errlen,
                    "PIN is unset (it holds the placeholder " MP_PIN_PLACEHOLDER "): build the metallib and run "
                    "`make -C metal_pinned pin` on macOS; the bridge refuses to load an unpinned metallib");
    }
    if (!is_hex64(value, value_len)) {
        return mp_set_error(err, errlen, "PIN value '%.*s' is not a sha256 (64 hex digits)", (int)(value_len > 80 ? 80 : value_len), value);
    }
    for (size_t i = 0; i < MP_SHA256_HEX_LEN; ++i) {
        out[i] = (char)tolower((unsigned char)value[i]);
    }
    out[MP_SHA256_HEX_LEN] = '\0';
    return 0;
}

int mp_pin_read(const char *pin_path, char out[65], char *err, size_t errlen) {
    if (!pin_path || !*pin_path) {
        return mp_set_error(err, errlen, "no PIN path given");
    }
    FILE *f = fopen(pin_path, "rb");
    if (!f) {
        return mp_set_error(err, errlen, "cannot open PIN %s: %s", pin_path, strerror(errno));
    }
    char text[4096];
    const size_t n = fread(text, 1, sizeof text - 1, f);
    const int more = fgetc(f) != EOF;
    const int bad = ferror(f);
    fclose(f);
    if (bad) {
        return mp_set_error(err, errlen, "read error on PIN %s", pin_path);
    }
    if (more) {
        return mp_set_error(err, errlen, "PIN %s is larger than %zu bytes; it should hold one sha256 and comments", pin_path,
                    sizeof text - 1);
    }
    text[n] = '\0';
    if (memchr(text, '\0', n)) {
        return mp_set_error(err, errlen, "PIN %s contains NUL bytes", pin_path);
    }
    char e[512];
    if (mp_pin_parse(text, out, e, sizeof e) != 0) {
        return mp_set_error(err, errlen, "%s: %s", pin_path, e);
    }
    return 0;
}

int mp_pin_check(const void *data, size_t n, const char *pin_hex, char actual[65], char *err, size_t errlen) {
    char want[65], got[65];
    if (!pin_hex) {
        return mp_set_error(err, errlen, "no pin given: the bridge refuses to load an unpinned metallib");
    }
    /* accept exactly what a PIN file may hold, so the placeholder is refused here too */
    if (mp_pin_parse(pin_hex, want, err, errlen) != 0) {
        return -1;
    }
    if (!data && n) {
        return mp_set_error(err, errlen, "no metallib bytes");
    }
    mp_sha256_hex(data, n, got);
    if (actual) {
        memcpy(actual, got, 65);
    }
    /* no early exit: compare every digit */
    unsigned diff = 0;
    for (int i = 0; i < MP_SHA256_HEX_LEN; ++i) {
        diff |= (unsigned)(want[i] ^ got[i]);
    }
    if (diff) {
        return mp_set_error(err, errlen, "metallib sha256 %s does not match PIN %s: refusing to load it", got, want);
    }
    return 0;
}
