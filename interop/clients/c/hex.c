/* "hex:<lowercase hex>" strings: how bin fields are held as JSON (the golden vectors' index.json
 * convention, protocols/README.md). */
#include "ectp.h"

#include <stdlib.h>
#include <string.h>

void to_hex(const unsigned char *b, size_t n, char *out) {
    static const char *d = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = d[b[i] >> 4];
        out[2 * i + 1] = d[b[i] & 15];
    }
    out[2 * n] = 0;
}

json_t *hex_json(const unsigned char *b, size_t n) {
    char *s = malloc(2 * n + 5);
    memcpy(s, "hex:", 4);
    to_hex(b, n, s + 4);
    json_t *j = json_string(s);
    free(s);
    return j;
}

static int hexval(int c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

unsigned char *json_hex(json_t *v, size_t *n) {
    const char *s = json_string_value(v);
    size_t len = s ? json_string_length(v) : 0;
    if (!s || len < 4 || strncmp(s, "hex:", 4) || (len - 4) % 2) return NULL;
    *n = (len - 4) / 2;
    unsigned char *b = malloc(*n + 1);
    for (size_t i = 0; i < *n; i++) {
        int hi = hexval(s[4 + 2 * i]), lo = hexval(s[5 + 2 * i]);
        if (hi < 0 || lo < 0) { free(b); return NULL; }
        b[i] = (unsigned char)(hi << 4 | lo);
    }
    return b;
}

