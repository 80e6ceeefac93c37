/*
 * mp_pin.h -- the metallib pin: SHA-256 (FIPS 180-4, own implementation), reading metal_pinned/PIN,
 * and checking bytes against it.  Plain C11; gcc builds and tests it on Linux, bridge.m uses it on
 * macOS, so the refusal rules ("PIN unset -> refuse", "mismatch -> refuse") are tested here.
 *
 * PIN file format: lines starting with '#' and blank lines are comments; exactly one other line
 * holds the value: 64 hex digits (the sha256 of the metallib), or the placeholder UNSET that the
 * repository ships with until `make -C metal_pinned pin` writes the real digest.
 */
#ifndef MUSER_METAL_PINNED_MP_PIN_H
#define MUSER_METAL_PINNED_MP_PIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Format an error message into err (if err and errlen are non-zero) and return -1. */
int mp_set_error(char *err, size_t errlen, const char *fmt, ...)
#if defined(__GNUC__) || defined(__clang__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;


#define MP_PIN_PLACEHOLDER "UNSET"
#define MP_SHA256_HEX_LEN 64

typedef struct mp_sha256_ctx {
    uint32_t h[8];
    uint64_t nbytes;
    uint8_t block[64];
    size_t fill;
} mp_sha256_ctx;

void mp_sha256_init(mp_sha256_ctx *c);
void mp_sha256_update(mp_sha256_ctx *c, const void *data, size_t n);
void mp_sha256_final(mp_sha256_ctx *c, uint8_t digest[32]);

/* sha256 of a buffer as 64 lowercase hex digits + NUL (out must hold 65 bytes). */
void mp_sha256_hex(const void *data, size_t n, char out[65]);

/* sha256 of a file; 0 or -1 with err. */
int mp_sha256_file(const char *path, char out[65], char *err, size_t errlen);

/* Parse the text of a PIN file into 64 lowercase hex digits.  Refuses (-1, err) the placeholder,
 * an empty file, more than one value line, or anything that is not 64 hex digits. */
int mp_pin_parse(const char *text, char out[65], char *err, size_t errlen);

/* Read and parse a PIN file. */
int mp_pin_read(const char *pin_path, char out[65], char *err, size_t errlen);

/* Check that pin_hex is a valid set pin and that sha256(data) equals it.  On success 0 and the
 * digest in actual (65 bytes, may be NULL); on any failure -1 with err naming both digests. */
int mp_pin_check(const void *data, size_t n, const char *pin_hex, char actual[65], char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif /* MUSER_METAL_PINNED_MP_PIN_H */
