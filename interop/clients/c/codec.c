/* ECTP codec, schema-driven: one field table per message kind (ectp-v1.md sections 3-4,
 * ectp-v2.md sections 3-4, 10.2 and 11.1) and per tcp plane structure (plane-tcp.md). Decoding is the
 * two-phase rule of ectp-v1.md section 6 with the SINCE rule of ectp-v2.md section 2. */
#include "ectp.h"

#include <math.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { F_INT, F_FLOAT, F_STR, F_BIN, F_BOOL, F_LIST, F_MAP, F_STRUCT, F_TAG };
#define OPT 1 /* optional: omitted when empty, its default when absent */
#define NIL 2 /* F_STRUCT: nil allowed */

typedef struct fdef {
    const char *key;
    int type, flags;
    long long lo, hi;       /* F_INT value; F_STR chars, F_BIN bytes, F_LIST/F_MAP items */
    double flo, fhi;        /* F_FLOAT bounds; flo > fhi: any finite value */
    const struct fdef *sub; /* F_LIST element; F_MAP {key, value}; F_STRUCT fields */
    const char *tag;        /* F_TAG: the fixed value of key "type" */
} fdef;

#define I(k, a, b) {k, F_INT, 0, a, b, 0, 0, NULL, NULL}
#define S(k, n) {k, F_STR, 0, 0, n, 0, 0, NULL, NULL}
#define B(k, n) {k, F_BIN, 0, 0, n, 0, 0, NULL, NULL}
#define FL(k, a, b) {k, F_FLOAT, 0, 0, 0, a, b, NULL, NULL}
#define L(k, a, b, e) {k, F_LIST, 0, a, b, 0, 0, e, NULL}
#define END {NULL, 0, 0, 0, 0, 0, 0, NULL, NULL}
#define G63 9223372036854775807LL
#define N62 4611686018427387903LL

static const fdef E_VERSION = I(NULL, 0, 65535), E_PLANE = S(NULL, 64),
                  E_FEATURE = S(NULL, 32), E_GRANTID = I(NULL, 0, G63), E_MMHASH = S(NULL, 256);
static const fdef LOCALITY[] = {S(NULL, 64), B(NULL, 256)};
static const fdef GRANT[] = {I("grant_id", 0, G63), I("entry_bytes", 0, N62),
                             I("num_blocks", 0, N62), I("block_bytes", 0, N62),
                             FL("lease_s", 1, 0), S("plane", 64), B("plane_grant", 4 << 20), END};
static const fdef HELLO[] = {
    I("v", 0, 65535), S("session_id", 128), S("node_id", 128), L("versions", 0, 64, &E_VERSION),
    L("planes", 0, 64, &E_PLANE), S("compat_hash", 128), L("mem_kinds", 0, 8, &E_PLANE),
    {"localities", F_MAP, OPT, 0, 64, 0, 0, LOCALITY, NULL},
    {"features", F_LIST, OPT, 0, 16, 0, 0, &E_FEATURE, NULL},
    {"cert", F_BIN, OPT, 0, 16384, 0, 0, NULL, NULL}, END};
static const fdef WELCOME[] = {
    I("v", 0, 65535), S("session_id", 128), S("node_id", 128), I("status", 0, 7),
    I("version", 0, 65535), S("plane", 64), L("versions", 0, 64, &E_VERSION),
    L("planes", 0, 64, &E_PLANE), S("compat_hash", 128), S("detail", 1024),
    {"endpoint", F_BIN, OPT, 0, 65536, 0, 0, NULL, NULL},
    {"features", F_LIST, OPT, 0, 16, 0, 0, &E_FEATURE, NULL},
    {"cert", F_BIN, OPT, 0, 16384, 0, 0, NULL, NULL}, END};
static const fdef REQ[] = {I("v", 0, 65535), S("session_id", 128), S("mm_hash", 256),
                           S("compat_hash", 128), B("dest", 65536), END};
static const fdef ACK[] = {I("v", 0, 65535), S("session_id", 128), S("mm_hash", 256),
                           I("status", 0, 7), {"grant", F_STRUCT, NIL, 0, 0, 0, 0, GRANT, NULL},
                           S("detail", 1024), END};
static const fdef DONE[] = {I("v", 0, 65535), S("session_id", 128), S("mm_hash", 256),
                            I("grant_id", 0, G63), {"ok", F_BOOL, 0, 0, 0, 0, 0, NULL, NULL}, END};
static const fdef RENEW[] = {I("v", 0, 65535), S("session_id", 128),
                             L("grant_ids", 0, 4096, &E_GRANTID), FL("extend_s", 1, 0), END};
static const fdef RENEW_ACK[] = {I("v", 0, 65535), S("session_id", 128),
                                 L("grant_ids", 0, 4096, &E_GRANTID), FL("extend_s", 0, 86400),
                                 END};
static const fdef NACK[] = {I("v", 0, 65535), I("status", 0, 7), S("detail", 1024), END};
static const fdef REQ_ITEM[] = {S("mm_hash", 256), B("dest", 65536), END};
static const fdef E_REQ_ITEM = {NULL, F_STRUCT, 0, 0, 0, 0, 0, REQ_ITEM, NULL};
static const fdef REQS[] = {I("v", 0, 65535), S("session_id", 128), I("batch_id", 0, G63),
                            S("compat_hash", 128), FL("wait_s", 0, 60),
                            I("inline_max", 0, 1 << 20), L("items", 1, 64, &E_REQ_ITEM), END};
static const fdef ACK_ITEM[] = {S("mm_hash", 256), I("status", 0, 7),
                                {"grant", F_STRUCT, NIL, 0, 0, 0, 0, GRANT, NULL},
                                B("data", 1 << 20), S("detail", 1024), END};
static const fdef E_ACK_ITEM = {NULL, F_STRUCT, 0, 0, 0, 0, 0, ACK_ITEM, NULL};
static const fdef ACKS[] = {I("v", 0, 65535), S("session_id", 128), I("batch_id", 0, G63),
                            L("items", 1, 64, &E_ACK_ITEM), END};
static const fdef PARK[] = {I("v", 0, 65535), S("session_id", 128), I("batch_id", 0, G63),
                            L("items", 1, 64, &E_MMHASH), FL("wait_s", 0, 60), END};
static const fdef DONE_ITEM[] = {S("mm_hash", 256), I("grant_id", 0, G63),
                                 {"ok", F_BOOL, 0, 0, 0, 0, 0, NULL, NULL}, END};
static const fdef E_DONE_ITEM = {NULL, F_STRUCT, 0, 0, 0, 0, 0, DONE_ITEM, NULL};
static const fdef DONES[] = {I("v", 0, 65535), S("session_id", 128),
                             L("items", 1, 64, &E_DONE_ITEM), END};
static const fdef SYNC[] = {I("v", 0, 65535), S("session_id", 128), FL("t", 0, 1e12), END};
static const fdef OFFER_ITEM[] = {S("mm_hash", 256),
                                  {"grant", F_STRUCT, 0, 0, 0, 0, 0, GRANT, NULL},
                                  FL("valid_s", 0, 86400), END};
static const fdef E_OFFER_ITEM = {NULL, F_STRUCT, 0, 0, 0, 0, 0, OFFER_ITEM, NULL};
static const fdef OFFER[] = {I("v", 0, 65535), S("session_id", 128), FL("anchor", 0, 1e12),
                             L("items", 1, 64, &E_OFFER_ITEM), END};

static const struct kind { const char *k; int since, frozen; const fdef *f; } KINDS[] = {
    {"hello", 1, 1, HELLO}, {"welcome", 1, 1, WELCOME}, {"req", 1, 0, REQ},
    {"ack", 1, 0, ACK},     {"done", 1, 0, DONE},       {"renew", 1, 0, RENEW},
    {"nack", 1, 0, NACK},   {"reqs", 2, 0, REQS},       {"acks", 2, 0, ACKS},
    {"park", 2, 0, PARK},   {"dones", 2, 0, DONES},     {"sync", 2, 0, SYNC},
    {"offer", 2, 0, OFFER}, {"renew_ack", 2, 0, RENEW_ACK}, {NULL, 0, 0, NULL}};

/* tcp plane (plane-tcp.md): msgpack maps tagged by key "type" */
#define TAG(t) {"type", F_TAG, 0, 0, 0, 0, 0, NULL, t}
static const fdef TCP_ENDPOINT[] = {TAG("tcp-ep"), I("v", 0, G63), S("host", 255),
                                    I("port", 1, 65535), S("node", 256), S("identity", 64), END};
static const fdef TCP_GRANT[] = {TAG("tcp/1"), S("host", 255), I("port", 1, 65535),
                                 {"token", F_BIN, 0, 16, 16, 0, 0, NULL, NULL},
                                 I("nbytes", 0, G63), I("runs_bytes", 0, G63),
                                 {"node", F_STR, OPT, 0, 256, 0, 0, NULL, NULL}, END};
static const fdef TCP_REQUEST[] = {TAG("req"), I("v", 0, G63), B("token", 1 << 20),
                                   B("notif", 2048), END};
static const fdef TCP_REPLY[] = {TAG("rep"), I("v", 0, G63), I("status", 0, G63),
                                 I("nbytes", 0, G63), S("detail", 1 << 20), END};
static const struct { const char *what; const fdef *f; } TCP[] = {
    {"endpoint", TCP_ENDPOINT}, {"grant", TCP_GRANT}, {"request", TCP_REQUEST},
    {"reply", TCP_REPLY}, {NULL, NULL}};

/* -- decoding ------------------------------------------------------------------------------- */
static long long codepoints(const char *s, size_t n) {
    long long c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

static int fail(char *err, size_t errlen, const char *key, const char *why) {
    snprintf(err, errlen, "%s: %s", key ? key : "item", why);
    return -1;
}

static int str_eq(const msgpack_object *o, const char *s) {
    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) &&
           !memcmp(o->via.str.ptr, s, o->via.str.size);
}

/* the last value of key in map o (duplicates: the last wins), or NULL */
static const msgpack_object *lookup(const msgpack_object *o, const char *key) {
    const msgpack_object *found = NULL;
    for (uint32_t i = 0; i < o->via.map.size; i++)
        if (str_eq(&o->via.map.ptr[i].key, key)) found = &o->via.map.ptr[i].val;
    return found;
}

static int decode_struct(const msgpack_object *o, const fdef *f, json_t **out, char *err,
                         size_t errlen);

static int decode_value(const msgpack_object *o, const fdef *f, json_t **out, char *err,
                        size_t errlen) {
    const char *k = f->key;
    switch (f->type) {
    case F_INT:
        if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
            if (o->via.u64 > (uint64_t)f->hi || (long long)o->via.u64 < f->lo)
                return fail(err, errlen, k, "integer out of range");
            *out = json_integer((json_int_t)o->via.u64);
            return 0;
        }
        if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
            if (o->via.i64 < f->lo) return fail(err, errlen, k, "integer out of range");
            *out = json_integer(o->via.i64);
            return 0;
        }
        return fail(err, errlen, k, "expected an integer");
    case F_FLOAT: {
        double d;
        if (o->type == MSGPACK_OBJECT_FLOAT64 || o->type == MSGPACK_OBJECT_FLOAT32) d = o->via.f64;
        else if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) d = (double)o->via.u64;
        else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) d = (double)o->via.i64;
        else return fail(err, errlen, k, "expected a number");
        if (!isfinite(d)) return fail(err, errlen, k, "not a finite number (unsupported here)");
        if (f->flo <= f->fhi && (d < f->flo || d > f->fhi))
            return fail(err, errlen, k, "number out of range");
        *out = json_real(d);
        return 0;
    }
    case F_STR:
        if (o->type != MSGPACK_OBJECT_STR) return fail(err, errlen, k, "expected a str");
        if (codepoints(o->via.str.ptr, o->via.str.size) > f->hi)
            return fail(err, errlen, k, "string too long");
        *out = json_stringn(o->via.str.ptr, o->via.str.size);
        return *out ? 0 : fail(err, errlen, k, "invalid UTF-8");
    case F_BIN:
        if (o->type != MSGPACK_OBJECT_BIN) return fail(err, errlen, k, "expected a bin");
        if ((long long)o->via.bin.size > f->hi || (long long)o->via.bin.size < f->lo)
            return fail(err, errlen, k, "byte string length out of range");
        *out = hex_json((const unsigned char *)o->via.bin.ptr, o->via.bin.size);
        return 0;
    case F_BOOL:
        if (o->type != MSGPACK_OBJECT_BOOLEAN) return fail(err, errlen, k, "expected a bool");
        *out = json_boolean(o->via.boolean);
        return 0;
    case F_TAG:
        if (!str_eq(o, f->tag)) return fail(err, errlen, k, "unexpected type tag");
        *out = json_string(f->tag);
        return 0;
    case F_LIST: {
        if (o->type != MSGPACK_OBJECT_ARRAY) return fail(err, errlen, k, "expected an array");
        if (o->via.array.size < f->lo || o->via.array.size > f->hi)
            return fail(err, errlen, k, "array length out of range");
        json_t *a = json_array();
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            json_t *v;
            if (decode_value(&o->via.array.ptr[i], f->sub, &v, err, errlen)) {
                json_decref(a);
                return -1;
            }
            json_array_append_new(a, v);
        }
        *out = a;
        return 0;
    }
    case F_MAP: {
        if (o->type != MSGPACK_OBJECT_MAP) return fail(err, errlen, k, "expected a map");
        if (o->via.map.size > f->hi) return fail(err, errlen, k, "map too large");
        json_t *m = json_object();
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            json_t *kk, *vv;
            if (decode_value(&o->via.map.ptr[i].key, &f->sub[0], &kk, err, errlen)) {
                json_decref(m);
                return -1;
            }
            if (decode_value(&o->via.map.ptr[i].val, &f->sub[1], &vv, err, errlen)) {
                json_decref(kk);
                json_decref(m);
                return -1;
            }
            json_object_set_new(m, json_string_value(kk), vv);
            json_decref(kk);
        }
        *out = m;
        return 0;
    }
    case F_STRUCT:
        if (o->type == MSGPACK_OBJECT_NIL && (f->flags & NIL)) {
            *out = json_null();
            return 0;
        }
        return decode_struct(o, f->sub, out, err, errlen);
    }
    return fail(err, errlen, k, "schema error");
}

static json_t *empty_default(const fdef *f) {
    switch (f->type) {
    case F_MAP: return json_object();
    case F_LIST: return json_array();
    case F_STR: return json_string("");
    default: return json_string("hex:");
    }
}

static int decode_struct(const msgpack_object *o, const fdef *f, json_t **out, char *err,
                         size_t errlen) {
    if (o->type != MSGPACK_OBJECT_MAP) return fail(err, errlen, NULL, "expected a map");
    for (uint32_t i = 0; i < o->via.map.size; i++)
        if (o->via.map.ptr[i].key.type != MSGPACK_OBJECT_STR)
            return fail(err, errlen, NULL, "a map key is not a str");
    json_t *obj = json_object();
    for (; f->key; f++) {
        const msgpack_object *v = lookup(o, f->key);
        json_t *jv;
        if (!v) {
            if (!(f->flags & OPT)) {
                json_decref(obj);
                return fail(err, errlen, f->key, "missing");
            }
            jv = empty_default(f);
        } else if (decode_value(v, f, &jv, err, errlen)) {
            json_decref(obj);
            return -1;
        }
        json_object_set_new(obj, f->key, jv);
    }
    *out = obj;
    return 0;
}

int ectp_decode(const unsigned char *buf, size_t len, const int *A, int nA, const char **kind,
                json_t **out, char *err, size_t errlen) {
    *kind = NULL;
    *out = NULL;
    if (len > MAX_FRAME_BYTES) return fail(err, errlen, "frame", "too large"), ST_BAD_REQUEST;
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    int rc = ST_BAD_REQUEST;
    if (msgpack_unpack_next(&u, (const char *)buf, len, &off) != MSGPACK_UNPACK_SUCCESS) {
        fail(err, errlen, "frame", "not one complete msgpack value");
        goto done;
    }
    if (off != len) { fail(err, errlen, "frame", "trailing bytes"); goto done; }
    const msgpack_object *o = &u.data, *k, *v;
    if (o->type != MSGPACK_OBJECT_MAP) { fail(err, errlen, "frame", "not a map"); goto done; }
    k = lookup(o, "k");
    v = lookup(o, "v");
    if (!k || k->type != MSGPACK_OBJECT_STR) { fail(err, errlen, "k", "missing or not a str"); goto done; }
    if (!v || (v->type != MSGPACK_OBJECT_POSITIVE_INTEGER && v->type != MSGPACK_OBJECT_NEGATIVE_INTEGER)) {
        fail(err, errlen, "v", "missing or not an int");
        goto done;
    }
    const struct kind *kd = KINDS;
    while (kd->k && !str_eq(k, kd->k)) kd++;
    if (!kd->k) { fail(err, errlen, "k", "unknown message kind"); goto done; }
    *kind = kd->k;
    long long ver = v->type == MSGPACK_OBJECT_POSITIVE_INTEGER
                        ? (v->via.u64 > (uint64_t)G63 ? G63 : (long long)v->via.u64)
                        : v->via.i64;
    if (!kd->frozen) {
        int ok = 0;
        for (int i = 0; i < nA; i++) ok |= A[i] == ver;
        if (!ok) { rc = ST_VERSION; fail(err, errlen, "v", "version not acceptable here"); goto done; }
    }
    if (!kd->frozen && ver < kd->since) {
        rc = ST_VERSION;
        fail(err, errlen, "v", "kind does not exist at this version");
        goto done;
    }
    if (decode_struct(o, kd->f, out, err, errlen) == 0) rc = ST_OK;
done:
    msgpack_unpacked_destroy(&u);
    return rc;
}

int tcp_decode(const char *what, const unsigned char *buf, size_t len, json_t **out, char *err,
               size_t errlen) {
    int i = 0;
    while (TCP[i].what && strcmp(TCP[i].what, what)) i++;
    if (!TCP[i].what) return fail(err, errlen, what, "unknown structure");
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    int rc = -1;
    if (msgpack_unpack_next(&u, (const char *)buf, len, &off) != MSGPACK_UNPACK_SUCCESS || off != len)
        fail(err, errlen, what, "not one complete msgpack value");
    else
        rc = decode_struct(&u.data, TCP[i].f, out, err, errlen);
    msgpack_unpacked_destroy(&u);
    return rc;
}

/* -- encoding ------------------------------------------------------------------------------- */
static int encode_struct(msgpack_packer *pk, json_t *obj, const fdef *f, char *err, size_t errlen);

static int is_empty(json_t *v) {
    if (!v || json_is_null(v)) return 1;
    if (json_is_object(v)) return json_object_size(v) == 0;
    if (json_is_array(v)) return json_array_size(v) == 0;
    return json_is_string(v) && !strcmp(json_string_value(v), "hex:");
}

static int encode_value(msgpack_packer *pk, json_t *v, const fdef *f, char *err, size_t errlen) {
    const char *k = f->key;
    switch (f->type) {
    case F_INT: {
        if (!json_is_integer(v)) return fail(err, errlen, k, "expected an integer");
        long long x = json_integer_value(v);
        if (x < f->lo || x > f->hi) return fail(err, errlen, k, "integer out of range");
        return msgpack_pack_uint64(pk, (uint64_t)x);
    }
    case F_FLOAT:
        if (!json_is_number(v)) return fail(err, errlen, k, "expected a number");
        return msgpack_pack_double(pk, json_number_value(v));
    case F_STR: {
        if (!json_is_string(v)) return fail(err, errlen, k, "expected a string");
        size_t n = json_string_length(v);
        if (codepoints(json_string_value(v), n) > f->hi) return fail(err, errlen, k, "too long");
        msgpack_pack_str(pk, n);
        return msgpack_pack_str_body(pk, json_string_value(v), n);
    }
    case F_BIN: {
        size_t n;
        unsigned char *b = json_hex(v, &n);
        if (!b) return fail(err, errlen, k, "expected a hex: string");
        if ((long long)n > f->hi || (long long)n < f->lo) {
            free(b);
            return fail(err, errlen, k, "byte string length out of range");
        }
        msgpack_pack_bin(pk, n);
        msgpack_pack_bin_body(pk, b, n);
        free(b);
        return 0;
    }
    case F_BOOL:
        if (!json_is_boolean(v)) return fail(err, errlen, k, "expected a bool");
        return json_is_true(v) ? msgpack_pack_true(pk) : msgpack_pack_false(pk);
    case F_TAG:
        msgpack_pack_str(pk, strlen(f->tag));
        return msgpack_pack_str_body(pk, f->tag, strlen(f->tag));
    case F_LIST: {
        if (!json_is_array(v)) return fail(err, errlen, k, "expected an array");
        size_t n = json_array_size(v);
        if ((long long)n < f->lo || (long long)n > f->hi) return fail(err, errlen, k, "length");
        msgpack_pack_array(pk, n);
        for (size_t i = 0; i < n; i++)
            if (encode_value(pk, json_array_get(v, i), f->sub, err, errlen)) return -1;
        return 0;
    }
    case F_MAP: {
        if (!json_is_object(v)) return fail(err, errlen, k, "expected an object");
        const char *key;
        json_t *val;
        msgpack_pack_map(pk, json_object_size(v));
        json_object_foreach(v, key, val) {
            json_t *jk = json_string(key);
            int bad = encode_value(pk, jk, &f->sub[0], err, errlen) ||
                      encode_value(pk, val, &f->sub[1], err, errlen);
            json_decref(jk);
            if (bad) return -1;
        }
        return 0;
    }
    case F_STRUCT:
        if (json_is_null(v) && (f->flags & NIL)) return msgpack_pack_nil(pk);
        return encode_struct(pk, v, f->sub, err, errlen);
    }
    return fail(err, errlen, k, "schema error");
}

/* keys in table order: "k" (when kind) first, then the fields; optional ones only when set */
static int encode_fields(msgpack_packer *pk, json_t *obj, const fdef *f, const char *kind,
                         char *err, size_t errlen) {
    if (!json_is_object(obj)) return fail(err, errlen, NULL, "expected an object");
    size_t n = kind ? 1 : 0;
    for (const fdef *g = f; g->key; g++)
        n += g->type == F_TAG || !(g->flags & OPT) || !is_empty(json_object_get(obj, g->key));
    msgpack_pack_map(pk, n);
    if (kind) {
        msgpack_pack_str(pk, 1);
        msgpack_pack_str_body(pk, "k", 1);
        msgpack_pack_str(pk, strlen(kind));
        msgpack_pack_str_body(pk, kind, strlen(kind));
    }
    for (; f->key; f++) {
        json_t *v = json_object_get(obj, f->key);
        if (f->type != F_TAG && (f->flags & OPT) && is_empty(v)) continue;
        if (!v && f->type != F_TAG) return fail(err, errlen, f->key, "missing");
        msgpack_pack_str(pk, strlen(f->key));
        msgpack_pack_str_body(pk, f->key, strlen(f->key));
        if (encode_value(pk, v, f, err, errlen)) return -1;
    }
    return 0;
}

static int encode_struct(msgpack_packer *pk, json_t *obj, const fdef *f, char *err, size_t errlen) {
    return encode_fields(pk, obj, f, NULL, err, errlen);
}

static int finish(msgpack_sbuffer *sb, int rc, unsigned char **buf, size_t *len) {
    if (rc) {
        msgpack_sbuffer_destroy(sb);
        return -1;
    }
    *buf = (unsigned char *)sb->data;
    *len = sb->size;
    return 0;
}

int ectp_encode(const char *kind, json_t *fields, unsigned char **buf, size_t *len, char *err,
                size_t errlen) {
    const struct kind *kd = KINDS;
    while (kd->k && strcmp(kd->k, kind)) kd++;
    if (!kd->k) return fail(err, errlen, kind, "unknown kind");
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    return finish(&sb, encode_fields(&pk, fields, kd->f, kd->k, err, errlen), buf, len);
}

int tcp_encode(const char *what, json_t *fields, unsigned char **buf, size_t *len, char *err,
               size_t errlen) {
    int i = 0;
    while (TCP[i].what && strcmp(TCP[i].what, what)) i++;
    if (!TCP[i].what) return fail(err, errlen, what, "unknown structure");
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    return finish(&sb, encode_fields(&pk, fields, TCP[i].f, NULL, err, errlen), buf, len);
}
